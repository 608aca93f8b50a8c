"""Every finished (seed, arm) run of the attention experiment is handed out as it ends (``on_run``),
bit for bit what an uninterrupted run computes, and a run resumed from them (``done_runs``) gives
the uninterrupted report; Ctrl-C is injected at fixed points, serially and in worker processes."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from pyengine.experiments.attention_dynamics import run_from_arrays, run_to_arrays

ad = importlib.import_module("pyengine.experiments.attention_dynamics")  # the module, not the function
KW = dict(seeds=(1, 2), arms=("gd", "value_lr", "m_step"), steps=6, T=40)


def _collect(**kw):
    runs = {}
    rep = ad.attention_dynamics(**KW, on_run=lambda s, a, r: runs.__setitem__((s, a), run_to_arrays(r)), **kw)
    return rep, runs


@pytest.fixture(scope="module")
def full():
    return _collect()


def assert_same_arrays(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def assert_same_report(a, b):
    assert a.seeds == b.seeds and a.arms == b.arms and not a.interrupted and not a.missing
    for arm in a.arms:
        for field in (a.metrics, a.curves, a.changes):
            assert_same_arrays(field[arm], (b.metrics if field is a.metrics else b.curves if field is a.curves
                                            else b.changes)[arm])
        np.testing.assert_array_equal(a.value_pca[arm], b.value_pca[arm])
        assert_same_arrays({str(k): v for k, v in a.heatmaps[arm].items()},
                           {str(k): v for k, v in b.heatmaps[arm].items()})
    np.testing.assert_array_equal(a.m_step_skipped, b.m_step_skipped)


def test_a_run_round_trips_through_arrays(full):
    _, runs = full
    assert set(runs) == {(s, a) for s in KW["seeds"] for a in KW["arms"]}
    for arrays in runs.values():
        assert_same_arrays(run_to_arrays(run_from_arrays(arrays)), arrays)
    with pytest.raises(ValueError, match="lacks hist"):
        run_from_arrays({k: v for k, v in runs[(1, "gd")].items() if k != "hist"})


def test_ctrl_c_keeps_every_finished_run_and_a_resume_completes_the_report(full, monkeypatch):
    rep_full, runs_full = full
    real, calls = ad.run_arm, [0]

    def interrupted_fifth(*args, **kwargs):  # seed 1's three arms, seed 2's gd, then Ctrl-C
        calls[0] += 1
        if calls[0] == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ad, "run_arm", interrupted_fifth)
    rep, runs = _collect()
    monkeypatch.setattr(ad, "run_arm", real)
    assert set(runs) == {(1, "gd"), (1, "value_lr"), (1, "m_step"), (2, "gd")}
    for key, arrays in runs.items():
        assert_same_arrays(arrays, runs_full[key])
    assert rep.interrupted and rep.seeds == (1,) and rep.missing == {2: ("value_lr", "m_step")}
    (part,) = rep.partial
    assert (part["seed"], part["arm"]) == (2, "gd")
    np.testing.assert_array_equal(part["metrics"]["loss"], runs_full[(2, "gd")]["hist"][:, 0])
    assert rep.missing_runs() == "missing runs: seed 2: value_lr, m_step (finished: gd)"

    done = {k: run_from_arrays(v) for k, v in runs.items()}
    resumed, more = _collect(done_runs=done)
    assert set(more) == {(2, "value_lr"), (2, "m_step")}  # only the missing runs are computed
    assert_same_report(resumed, rep_full)


def test_no_seed_finished_reraises_after_handing_out_the_finished_runs(monkeypatch):
    real, calls = ad.run_arm, [0]

    def interrupted_second(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ad, "run_arm", interrupted_second)
    runs = {}
    with pytest.raises(KeyboardInterrupt):
        ad.attention_dynamics(**KW, on_run=lambda s, a, r: runs.__setitem__((s, a), r))
    assert set(runs) == {(1, "gd")}


def test_ctrl_c_in_worker_processes_keeps_the_recorded_runs(full):
    """With 2 workers, Ctrl-C raised where the second finished run is recorded: the report holds
    exactly those two runs, each bit for bit the serial one's."""
    _, runs_full = full
    runs = {}

    def record(seed, arm, run):
        runs[(seed, arm)] = run_to_arrays(run)
        if len(runs) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # two runs finish; no seed has every arm
        ad.attention_dynamics(**KW, workers=2, on_run=record)
    assert len(runs) == 2
    for key, arrays in runs.items():
        assert_same_arrays(arrays, runs_full[key])
