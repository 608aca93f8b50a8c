"""pyengine.scan in-process: store, resume, chunking, bad points, malformed grids, the CLI.

The cluster tests (2-worker LocalCluster on 127.0.0.1) are in test_distributed_cluster.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import pyengine
from pyengine.distributed import Store, get_job, scan

NORMS = {"seeds": list(range(12)), "scales": [1.0, 3.0], "tokens": 32, "d": 48, "method": "power"}


class NoSubmit:
    """A client that fails the test if anything is submitted to it."""

    def nthreads(self):
        return {"w": 1}

    def submit(self, *a, **k):
        raise AssertionError("a task was submitted for a malformed grid")


def test_scan_is_exported_with_load(tmp_path):
    assert pyengine.scan is scan and "scan" in pyengine.__all__
    res = pyengine.scan("norms", NORMS, out=tmp_path / "s")
    back = pyengine.scan.load(tmp_path / "s")
    assert back.complete and res.complete
    assert np.array_equal(back.metrics["sigma"], res.metrics["sigma"])
    assert back.metrics["sigma"].shape == (12, 2, 32)
    assert back.points == res.points


def test_results_are_the_kernel_results():
    res = scan("norms", {"seeds": [3], "scales": [2.0], "tokens": 16, "d": 8})
    rng = np.random.default_rng(pyengine.distributed.seed_of(3))
    x = (rng.standard_normal((16, 8)) * 2.0).astype(np.float32)
    ref = pyengine.layer_norm_spectral_norm(x, None, 1e-5)
    assert np.array_equal(res.metrics["sigma"][0, 0], ref.sigma)


@pytest.mark.parametrize("chunk", [1, 5, 24])
def test_any_chunking_is_bit_identical(chunk):
    base = scan("norms", NORMS, chunk=2)
    res = scan("norms", NORMS, chunk=chunk)
    assert res.tasks == -(-24 // chunk)
    assert np.array_equal(res.metrics["sigma"], base.metrics["sigma"])


def test_spectral_windows_in_any_chunking_match_one_sequence_per_window():
    grid = {"model": "tiny", "tokens": 300, "seq_len": 64, "method": "power"}
    a, b = scan("spectral", grid, chunk=1), scan("spectral", grid, chunk=3)
    assert a.metrics["sigma"].shape == (9, 300)  # 4 pre-LN blocks x 2 norms + the final norm, every token
    assert a.params["sites"][-1] == "final_norm"
    assert np.isfinite(a.metrics["sigma"]).all()
    assert np.array_equal(a.metrics["sigma"], b.metrics["sigma"])
    # window 2 by hand: the block-0 norm1 input of the tiny pre-LN stack is the embedded stream
    from pyengine.distributed import corpus_ids
    from pyengine.distributed.worker import get_model

    m = get_model("tiny")
    ids = corpus_ids("tiny", 300)[128:192]
    h = m.hidden_states(ids)
    gamma = m.weights["blocks.0.norm1.gamma"]
    ref = pyengine.layer_norm_spectral_norm(h[0], gamma, m.config.eps, method="exact")
    assert np.allclose(a.metrics["sigma"][0, 128:192], ref.sigma, rtol=1e-4)


def test_resume_recomputes_nothing_stored(tmp_path):
    out = tmp_path / "s"
    calls = []

    def stop_after_some(done, total):
        calls.append(done)
        if done >= 8:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        scan("norms", NORMS, out=out, chunk=4, progress=stop_after_some)
    store = Store(out)
    have = store.done(24)
    assert len(have) == 8
    stamps = {i: os.stat(store.point_path(i)).st_mtime_ns for i in have}
    with pytest.raises(ValueError, match="resume"):
        scan("norms", NORMS, out=out)  # not without resume=True
    res = scan("norms", NORMS, out=out, chunk=4, resume=True)
    assert res.complete and res.computed == 16
    assert {i: os.stat(store.point_path(i)).st_mtime_ns for i in have} == stamps
    assert np.array_equal(res.metrics["sigma"], scan("norms", NORMS).metrics["sigma"])
    again = scan("norms", NORMS, out=out, resume=True)
    assert again.computed == 0 and again.tasks == 0


def test_a_retried_task_skips_the_points_it_stored(tmp_path):
    from pyengine.distributed import run_chunk

    j = get_job("norms")
    params, points, inputs = j.plan(NORMS)
    Store(tmp_path).create("norms", params, points, resume=False, content=inputs)
    items = [(i, points[i], inputs[i]) for i in range(4)]
    run_chunk(j, params, items[:2], os.fspath(tmp_path))
    stamp = os.stat(Store(tmp_path).point_path(0)).st_mtime_ns
    run_chunk(j, params, items, os.fspath(tmp_path))
    assert os.stat(Store(tmp_path).point_path(0)).st_mtime_ns == stamp
    assert Store(tmp_path).done(24) == {0, 1, 2, 3}


def test_another_sweep_in_the_same_folder_is_refused(tmp_path):
    scan("norms", NORMS, out=tmp_path / "s")
    with pytest.raises(ValueError, match="another sweep"):
        scan("norms", {**NORMS, "d": 40}, out=tmp_path / "s", resume=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("x")
    with pytest.raises(ValueError, match="not a sweep folder"):
        scan("norms", NORMS, out=tmp_path / "other")


def test_a_failing_point_is_reported_and_the_rest_complete(tmp_path):
    grid = {**NORMS, "scales": [1.0, 1e39]}  # float32 overflows to Inf: the kernel rejects it
    res = scan("norms", grid, out=tmp_path / "s", chunk=5)
    bad = [i for i, p in enumerate(res.points) if p["scales"] == 1e39]
    assert sorted(e["index"] for e in res.errors) == bad
    assert all("Inf" in e["error"] and e["point"]["scales"] == 1e39 for e in res.errors)
    assert not res.missing
    sigma = res.metrics["sigma"]
    assert np.isnan(sigma[:, 1]).all() and np.isfinite(sigma[:, 0]).all()
    ok = scan("norms", {**NORMS, "scales": [1.0]})
    assert np.array_equal(sigma[:, 0], ok.metrics["sigma"][:, 0])
    saved = json.loads((tmp_path / "s" / "errors.json").read_text())
    assert [e["index"] for e in saved["errors"]] == bad and saved["provenance"]["version"] == pyengine.__version__
    assert len(pyengine.scan.load(tmp_path / "s").errors) == len(bad)


@pytest.mark.parametrize("job, grid, match", [
    ("norms", {"seed": [1]}, "unknown key 'seed'"),
    ("norms", {"seeds": []}, r"grid\['seeds'\] is empty"),
    ("norms", {"seeds": [1.5]}, r"grid\['seeds'\] must hold integers"),
    ("norms", {"scales": [float("nan")]}, r"grid\['scales'\]"),
    ("norms", {"d": 1}, r"grid\['d'\]"),
    ("nope", {}, "job must be one of"),
    ("spectral", {"model": "tiny", "seq_len": 5000}, "max_seq_len"),
    ("spectral", {"model": "tiny", "method": "svd"}, r"grid\['method'\]"),
    ("recovery", {"model": "tiny"}, r"needs 'prompts'"),
    ("recovery", {"model": "tiny", "prompts": ["a b"], "layers": [9]}, r"grid\['layers'\]"),
    ("recovery", {"model": "tiny", "prompts": ["a b"], "directions": np.zeros((2, 5))}, r"grid\['directions'\]"),
    ("attention", {"lrs": [0.01, -1.0]}, r"grid\['lrs'\]"),
    ("attention", {"seeds": ["x"]}, r"grid\['seeds'\]"),
    ("stability", {"schemes": ["nope"]}, r"grid\['schemes'\]"),
])
def test_a_malformed_grid_fails_before_any_task(job, grid, match):
    with pytest.raises((ValueError, TypeError), match=match):
        scan(job, grid, client=NoSubmit())


def test_bad_arguments_name_themselves(tmp_path):
    with pytest.raises(ValueError, match="chunk"):
        scan("norms", NORMS, chunk=0)
    with pytest.raises(ValueError, match="memory_budget"):
        scan("norms", NORMS, memory_budget=-1)
    with pytest.raises(ValueError, match="more than memory_budget"):
        scan("norms", {**NORMS, "tokens": 4096, "d": 256}, memory_budget=1 << 20, client=NoSubmit())
    with pytest.raises(ValueError, match="resume=True needs out"):
        scan("norms", NORMS, resume=True)


def test_the_budget_caps_the_chunk():
    # recovery ships each prompt's ids; a point's working estimate is 64 MiB
    grid = {"model": "tiny", "prompts": ["one two", "three four five"], "layers": [0, 1, 2]}
    assert scan("recovery", grid, chunk=6, memory_budget=(64 << 20) + 200).tasks == 6
    res = scan("recovery", grid, chunk=6)
    assert res.tasks == 1 and res.metrics["projection"].shape == (2, 3, 5, 4, 3)
    assert np.isnan(res.metrics["projection"][:, 1, :1]).all()
    assert np.isfinite(res.metrics["projection"][:, 1, 1:]).all()


def _cli(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "pyengine", "scan", *args], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)


def test_cli_spectral_in_process_with_resume_and_plot(tmp_path):
    args = ["spectral", "--model", "tiny", "--tokens", "200", "--seq-len", "50", "--workers", "0", "--out", "o"]
    r = _cli(tmp_path, *args)
    assert r.returncode == 0, r.stderr
    assert "blocks.3.norm2" in r.stdout and (tmp_path / "o" / "sigma_max.png").stat().st_size > 1000
    r = _cli(tmp_path, *args)
    assert r.returncode == 2 and "--resume" in r.stderr and r.stderr.count("\n") == 1
    r = _cli(tmp_path, *args, "--resume")
    assert r.returncode == 0 and "0 computed now, 4 stored before" in r.stdout


def test_cli_bad_input_is_one_line(tmp_path):
    r = _cli(tmp_path, "recovery", "--model", "tiny", "--prompts", "missing.txt", "--workers", "0")
    assert r.returncode == 2 and "prompts file not found" in r.stderr and "Traceback" not in r.stderr
    r = _cli(tmp_path, "spectral", "--model", "tiny", "--corpus", "missing.txt", "--workers", "0")
    assert r.returncode == 2 and "corpus file not found" in r.stderr


def test_every_job_is_registered_by_import_pyengine_without_the_cli():
    code = ("import sys, pyengine; jobs = set(pyengine.distributed.JOBS); "
            "assert jobs >= {'norms', 'spectral', 'recovery', 'attention', 'stability'}, jobs; "
            "assert 'pyengine.cli' not in sys.modules; "
            "assert 'pyengine.experiments' not in sys.modules")  # the jobs import their experiment lazily
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_attention_and_stability_jobs_match_the_experiments():
    from pyengine.experiments import attention_dynamics, stability

    res = scan("attention", {"seeds": [1, 2], "lrs": [0.01, 0.03], "steps": 4, "T": 40})
    ref = attention_dynamics(seeds=(2,), lr=0.03, steps=4, T=40)
    assert res.metrics["gd.loss"].shape == (2, 2, 5)
    assert np.array_equal(res.metrics["gd.loss"][1, 1], ref.metrics["gd"]["loss"][0])
    assert np.array_equal(res.metrics["m_step.accuracy"][1, 1], ref.metrics["m_step"]["accuracy"][0])
    st = scan("stability", {"schemes": ["xavier_normal", "orthogonal"], "depth": 4, "width": 32, "tokens": 16})
    rep = stability(("orthogonal",), 4, 32, 16, demo=False)
    assert st.metrics["forward_rms"].shape == (2, 4, 5)
    assert np.array_equal(st.metrics["forward_rms"][1], np.stack([r.forward_rms for r in rep.runs]))
