"""Ctrl-C in every long subcommand: the stages already finished are in the output
folder, then one line on stderr and exit status 130, no traceback.

Deterministic: with PYENGINE_TEST_HOLD=<file> the command creates <file> at its first hold
point (right after its first finished stage, see pyengine/cli/_stages.py) and waits there;
the test sends SIGINT once the file exists. Commands run with cwd outside the repository.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import pyengine as pe


def _interrupt(tmp_path, *args, timeout=240):
    hold = tmp_path / "hold"
    env = {**os.environ, "PYENGINE_TEST_HOLD": str(hold)}
    proc = subprocess.Popen([sys.executable, "-m", "pyengine", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not hold.exists() and proc.poll() is None and time.monotonic() - t0 < timeout:
        time.sleep(0.02)
    assert proc.poll() is None, f"the command ended before its first stage: {proc.communicate()}"
    assert hold.exists(), "no stage finished in time"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pyengine: interrupted"), err
    return lines[0]


def _stages(folder):
    files = sorted((folder / "stages").glob("*.json"))
    assert files and not list((folder / "stages").glob("*.tmp"))
    return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="module")
def small_npz(tmp_path_factory):
    cfg = pe.StackConfig(d_model=32, n_heads=4, n_layers=3, d_mlp=64, vocab_size=256, max_seq_len=256,
                         positions="learned")
    path = tmp_path_factory.mktemp("m") / "m.npz"
    pe.init_weights(cfg, scheme="gpt2", seed=0).save(str(path))
    return str(path)


def test_positions(tmp_path):
    line = _interrupt(tmp_path, "positions", "--length", "6", "--contexts", "8", "--ablation-contexts", "2",
                      "--folds", "2", "--out", "o")
    assert "1 finished stage(s)" in line and "stages" in line
    (st,) = _stages(tmp_path / "o")
    assert st["stage"].startswith("model 1") and st["model"]["name"] == "synthetic pre-LN"
    assert not (tmp_path / "o" / "positions.json").exists()


def test_stability(tmp_path):
    line = _interrupt(tmp_path, "stability", "--schemes", "kaiming_normal,orthogonal", "--depth", "4", "--width",
                      "16", "--tokens", "8", "--stack-depth", "2", "--stack-width", "16", "--model", "none",
                      "--out", "o")
    assert "1 finished stage(s)" in line
    (st,) = _stages(tmp_path / "o")
    assert st["stage"] == "signal propagation" and len(st["runs"]) >= 2
    assert len(st["runs"][0]["forward_rms"]) == 5
    assert not (tmp_path / "o" / "stability.json").exists()


def test_spectral_sites_of_a_model(tmp_path, small_npz):
    line = _interrupt(tmp_path, "spectral", "--model", small_npz, "--json", "s.json", "--csv", "s.csv",
                      "--progress", "never")
    assert "1 finished stage(s)" in line
    (st,) = _stages(tmp_path)
    assert st["site"] == "blocks.0.norm1.input" and st["layer"] == 0 and len(st["sigma"]) > 0
    assert not (tmp_path / "s.json").exists()


def test_scan(tmp_path):
    line = _interrupt(tmp_path, "scan", "norms", "--workers", "0", "--points", "6", "--chunk", "1", "--tokens",
                      "8", "--d", "8", "--progress", "never", "--out", "st")
    assert "finished point(s) are in the store st" in line and "--resume" in line
    done = subprocess.run([sys.executable, "-m", "pyengine", "scan", "norms", "--workers", "0", "--points", "6",
                           "--chunk", "1", "--tokens", "8", "--d", "8", "--progress", "never", "--out", "st",
                           "--resume"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "stored before" in done.stdout and " 0 stored before" not in done.stdout


ATTENTION = ["attention", "--steps", "60", "--T", "64", "--workers", "1", "--progress", "never", "--no-plots"]


def _stored_runs(folder):
    from pyengine.distributed import Store

    store = Store(folder / "runs")
    points = store.manifest()["points"]
    return {(points[i]["seed"], points[i]["arm"]): store.read(i) for i in sorted(store.done(len(points)))}


def _without_times(doc):
    return {k: v for k, v in doc.items() if k not in ("seconds", "provenance")}


def test_attention(tmp_path):
    """Held after the first finished run (seed 1's only arm): the report of seed 1, seed 2 missing."""
    line = _interrupt(tmp_path, *ATTENTION, "--seeds", "1,2", "--arms", "gd", "--out", "o")
    assert "wrote the report of the seeds whose every arm finished" in line
    assert "missing runs: seed 2: gd" in line and "the 1 finished run(s) are in o/runs" in line
    rep = json.loads((tmp_path / "o" / "attention.json").read_text())
    assert rep["seeds"] == [1] and rep["interrupted"] is True  # the finished seed, not the running one
    assert rep["missing"] == {"2": ["gd"]} and rep["partial"] == []
    assert (tmp_path / "o" / "attention.csv").exists()
    assert set(_stored_runs(tmp_path / "o")) == {(1, "gd")}


def test_attention_resume_after_ctrl_c_gives_the_uninterrupted_report(tmp_path):
    """Ctrl-C after the first of four runs: that run is stored (no seed complete, no report);
    --resume computes the other three, and the report equals an uninterrupted run's."""
    args = [*ATTENTION, "--seeds", "1,2", "--arms", "gd,value_lr"]
    line = _interrupt(tmp_path, *args, "--out", "o")
    assert "no seed had every arm finished" in line and "the 1 finished run(s) are in o/runs" in line
    assert "--resume" in line and not (tmp_path / "o" / "attention.json").exists()
    first = _stored_runs(tmp_path / "o")
    assert set(first) == {(1, "gd")}
    run = lambda *extra: subprocess.run([sys.executable, "-m", "pyengine", *args, *extra], cwd=tmp_path,
                                        capture_output=True, text=True, timeout=240)
    done = run("--out", "o", "--resume")
    assert done.returncode == 0, done.stderr
    assert "1 run(s) stored before" in done.stdout
    whole = run("--out", "w")
    assert whole.returncode == 0, whole.stderr
    resumed, full = _stored_runs(tmp_path / "o"), _stored_runs(tmp_path / "w")
    assert set(resumed) == set(full) == {(s, a) for s in (1, 2) for a in ("gd", "value_lr")}
    for key, arrays in full.items():
        assert arrays.keys() == resumed[key].keys()
        for name, a in arrays.items():
            np.testing.assert_array_equal(resumed[key][name], a)
    for key, arrays in first.items():  # the run stored at Ctrl-C is the uninterrupted run's, bit for bit
        for name, a in arrays.items():
            np.testing.assert_array_equal(full[key][name], a)
    docs = [json.loads((tmp_path / f / "attention.json").read_text()) for f in ("o", "w")]
    assert _without_times(docs[0]) == _without_times(docs[1])


def test_hold_is_inert_without_the_variable(tmp_path, small_npz):
    done = subprocess.run([sys.executable, "-m", "pyengine", "spectral", "--model", small_npz, "--sites",
                           "blocks.*.norm2.input,final_norm.input", "--json", "s.json", "--csv", "s.csv",
                           "--progress", "never"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["sites"] == ["blocks.0.norm2.input", "blocks.1.norm2.input", "blocks.2.norm2.input",
                            "final_norm.input"]
    assert [p["site"] for p in doc["per_layer"]] == doc["sites"]
    rows = (tmp_path / "s.csv").read_text().splitlines()
    assert rows[0].startswith("layer,site,token,sigma") and rows[1].startswith("0,blocks.0.norm2.input,0,")
    assert len(_stages(tmp_path)) == 4
