"""pyengine bench: every registered kernel and backend measured; the regression check."""

from __future__ import annotations

import copy
import json

import pytest

from pyengine import backends, bench, cli


@pytest.fixture(scope="module")
def report():
    from pyengine._bench import stats

    sizes, sample_s = bench.SIZES["quick"], stats.SAMPLE_S
    bench.SIZES["quick"], stats.SAMPLE_S = [(64, 16)], 2e-4  # tiny arrays, short samples: coverage, not timing
    try:
        return bench.run(quick=True, repeat=1)
    finally:
        bench.SIZES["quick"], stats.SAMPLE_S = sizes, sample_s


def test_bench_covers_every_kernel_and_backend(report):
    seen = {(r["kernel"], r["backend"]) for r in report["results"]}
    for kernel in backends.KERNELS:
        for b in backends.BACKENDS:
            if backends.provides(kernel, b):
                assert (kernel, b) in seen
    assert report["machine"]["copy_bytes_per_s"] > 0
    assert all(r["time_s"] > 0 for r in report["results"])
    assert all(r["speedup_vs_numpy"] is not None for r in report["results"])


def test_compare_flags_a_real_regression_only(report):
    assert bench.compare(report, report) == []
    worse = copy.deepcopy(report)
    row = next(r for r in worse["results"] if r["backend"] != "numpy" and r["fraction"])
    row["fraction"] *= 0.3
    row["spread"] = 0.0
    baseline = copy.deepcopy(report)
    for r in baseline["results"]:
        r["spread"] = 0.0
    found = bench.compare(worse, baseline)
    assert len(found) == 1 and row["kernel"] in found[0] and "fraction" in found[0]
    noisy = copy.deepcopy(worse)
    next(r for r in noisy["results"] if r is not None and r["kernel"] == row["kernel"]
         and r["backend"] == row["backend"])["spread"] = 2.0
    assert bench.compare(noisy, baseline) == []  # within the measured noise


def test_register_case_adds_a_downstream_kernel():
    import numpy as np

    def setup(backend, dtype, size):
        a = np.ones(size, dtype)
        return (lambda: a.sum()), a.nbytes, 0.0

    case = bench.register_case(bench.Case("downstream_sum", setup, backends=("numpy",)))
    try:
        sizes = bench.SIZES["quick"]
        bench.SIZES["quick"] = [(8, 8)]
        rows = bench.run(quick=True, repeat=1)["results"]
        assert any(r["kernel"] == "downstream_sum" for r in rows)
    finally:
        bench.SIZES["quick"] = sizes
        bench._CASES.pop(case.name)
    with pytest.raises(ValueError, match="case.limit must be"):
        bench.register_case(bench.Case("x", setup, limit="flops"))


def test_cli_bench_rejects_a_bad_baseline(tmp_path, capsys):
    bad = tmp_path / "base.json"
    bad.write_text("{not json")
    assert cli.main(["bench", "--quick", "--compare", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    bad.write_text(json.dumps({"machine": {}}))
    assert cli.main(["bench", "--quick", "--compare", str(bad)]) == 2
    assert cli.main(["bench", "--quick", "--compare", str(tmp_path / "missing.json")]) == 2


def test_rounds_rotate_the_backends_order(monkeypatch):
    """Each round starts with the next backend, so no backend always runs right after another's."""
    from pyengine._bench import measure, runner

    seen = []
    monkeypatch.setattr(measure, "sample", lambda call, loops, n: [call()] * n)
    calls = {b: (lambda b=b: seen.append(b) or 1.0) for b in ("numpy", "numba", "cpp")}
    lims, stats, reruns = runner._rounds(None, calls, {b: 1 for b in calls}, {b: 1 for b in calls}, 4)
    assert reruns == 0 and lims == [None] * 4
    assert [seen[3 * i] for i in range(4)] == ["numpy", "numba", "cpp", "numpy"]
    assert sorted(seen[3:6]) == ["cpp", "numba", "numpy"]  # every backend once per round
    assert set(stats) == set(calls) and all(len(v) == 4 for v in stats.values())


def test_time_alternated_calls_in_turn_and_reverses_every_other_round():
    seen = []
    calls = {k: (lambda k=k: seen.append(k)) for k in ("a", "b", "c")}
    ts = bench.time_alternated(calls, 3)
    assert seen == ["a", "b", "c"] + ["a", "b", "c", "c", "b", "a", "a", "b", "c"]  # warm-ups, then 3 rounds
    assert set(ts) == {"a", "b", "c"} and all(len(v) == 3 and min(v) >= 0.0 for v in ts.values())
