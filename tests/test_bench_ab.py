"""pyengine bench's same-run A/B: two worker processes, one per build, driven alternately.

The "other build" here is this same interpreter (``--compare-python``), so the true ratio
is 1 except where the test-only slowdown switch, given to the new build's worker only,
makes one kernel slower."""

from __future__ import annotations

import json
import sys

import pytest

from pyengine import bench, cli


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(bench.SIZES, "quick", [(512, 256)])


def test_ab_flags_the_injected_slowdown_only(tiny, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(bench.SLOWDOWN_ENV, "layer_norm:numpy=2.0")
    out = tmp_path / "ab.json"
    code = cli.main(["bench", "--quick", "--compare-python", sys.executable, "--kernels", "layer_norm,rms_norm",
                     "--backends", "numpy", "--json", str(out)])
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = {r["kernel"]: r for r in report["results"]}
    assert set(rows) == {"layer_norm", "rms_norm"} and all(r["backend"] == "numpy" for r in rows.values())
    assert rows["layer_norm"]["verdict"] == "regression", text
    assert rows["layer_norm"]["ratio"] > 1.6, text  # 2x by construction; a loaded host inflates it, never halves it
    assert rows["rms_norm"]["verdict"] != "regression", text  # the same code on both sides
    assert rows["rms_norm"]["low"] <= rows["rms_norm"]["ratio"] <= rows["rms_norm"]["high"]
    assert code == 1 and "REGRESSION layer_norm numpy" in text and "1 regression(s)" in text


def test_ab_self_comparison_passes(tiny, monkeypatch, capsys):
    monkeypatch.delenv(bench.SLOWDOWN_ENV, raising=False)
    code = bench.ab_main(None, sys.executable, True, None, 0.1, ("float32",), kernels=("rms_norm",),
                         backends=("numpy",))
    assert code == 0, capsys.readouterr().out


def test_ab_refuses_an_unknown_kernel(tiny):
    with pytest.raises(ValueError, match="^kernels: unknown benchmark case"):
        bench.compare_builds(sys.executable, kernels=("no_such_kernel",))
