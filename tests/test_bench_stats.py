"""pyengine bench's statistics on synthetic timings of known ratio and noise, the
slowdown switch, and the argument checks that must fire before any timing."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pyengine import bench, cli
from pyengine._bench import ab as _ab
from pyengine._bench import measure, stats


def _rounds(rng, n, true, noise, bursts=0):
    """n round statistics: true time x lognormal noise; ``bursts`` rounds x3 (a neighbour)."""
    x = true * np.exp(noise * rng.standard_normal(n))
    x[rng.choice(n, bursts, replace=False)] *= 3.0
    return x


@pytest.mark.parametrize("noise", [0.02, 0.08])
def test_paired_verdicts_match_the_true_ratio(noise):
    verdicts = {1.0: set(), 1.05: set(), 1.5: set(), 0.6: set()}
    for seed in range(40):
        rng = np.random.default_rng(seed)
        machine = np.exp(0.3 * rng.standard_normal(12))  # drift shared by both sides of a round
        for ratio in verdicts:
            old = _rounds(rng, 12, 1e-3, noise) * machine
            new = _rounds(rng, 12, 1e-3 * ratio, noise) * machine
            r = stats.paired_ratio(old, new, seed=seed)
            assert r.low <= r.ratio <= r.high
            verdicts[ratio].add(stats.verdict(r, 0.1))
    assert verdicts[1.0] == {"same"}        # no false alarm in 40 tries, drift or not
    assert verdicts[1.05] == {"same"}       # below the threshold: never a regression
    assert verdicts[1.5] == {"regression"}  # caught every time
    assert verdicts[0.6] == {"faster"}


def test_paired_interval_covers_the_true_ratio_and_narrows_with_less_noise():
    rng = np.random.default_rng(1)
    widths = []
    for noise in (0.2, 0.02):
        old, new = _rounds(rng, 16, 1.0, noise), _rounds(rng, 16, 1.3, noise)
        r = stats.paired_ratio(old, new)
        assert r.low < 1.3 < r.high
        widths.append(r.high / r.low)
    assert widths[1] < widths[0]


def test_unpaired_ratio_sees_both_spreads():
    rng = np.random.default_rng(2)
    base = _rounds(rng, 7, 1.0, 0.03)
    assert stats.verdict(stats.unpaired_ratio(base, _rounds(rng, 7, 1.0, 0.03)), 0.25) == "same"
    assert stats.verdict(stats.unpaired_ratio(base, _rounds(rng, 7, 1.6, 0.03)), 0.25) == "regression"
    wide = stats.unpaired_ratio(_rounds(rng, 7, 1.0, 0.6), _rounds(rng, 7, 1.6, 0.6))
    assert stats.verdict(wide, 0.25) == "same"  # 1.6x inside that much noise: no evidence


def test_outlier_rounds_are_the_bursts():
    rng = np.random.default_rng(3)
    x = _rounds(rng, 10, 1.0, 0.02)
    x[[2, 7]] *= 3.0
    assert stats.outlier_rounds(x) == [2, 7]
    assert stats.outlier_rounds(_rounds(rng, 10, 1.0, 0.02)) == []
    assert stats.outlier_rounds([1.0, 9.0]) == []  # too few rounds to call one an outlier


@pytest.mark.parametrize("bad", [-0.1, float("nan"), 1.0])
def test_verdict_refuses_a_bad_threshold(bad):
    with pytest.raises(ValueError, match="threshold"):
        stats.verdict(stats.Ratio(1.0, 0.9, 1.1), bad)


@pytest.mark.parametrize("bad", [[1.0], [1.0, float("nan")], [1.0, -2.0], [[1.0, 2.0]]])
def test_ratios_refuse_bad_samples(bad):
    with pytest.raises(ValueError, match="old must be"):
        stats.paired_ratio(bad, [1.0, 1.0])
    with pytest.raises(ValueError, match="paired rounds need equal counts"):
        stats.paired_ratio([1.0, 1.0, 1.0], [1.0, 1.0])


def test_slowdown_switch_parses_and_refuses():
    env = {measure.SLOWDOWN_ENV: "layer_norm:cpp=1.5, softmax:numba=1.2"}
    assert measure.slowdown(env) == {("layer_norm", "cpp"): 1.5, ("softmax", "numba"): 1.2}
    assert measure.slowdown({}) == {}
    for text in ("layer_norm=1.5", "layer_norm:cpp", "layer_norm:cpp=fast", "layer_norm:cpp=0.5",
                 "layer_norm:cpp=nan", "layer_norm:cpp=inf"):
        with pytest.raises(ValueError, match=measure.SLOWDOWN_ENV):
            measure.slowdown({measure.SLOWDOWN_ENV: text})


@pytest.mark.parametrize("factor, loops, calls", [(1.5, 2, 3), (1.2, 5, 6), (2.0, 1, 2), (1.0, 4, 4)])
def test_slowed_runs_exactly_factor_times_the_work(factor, loops, calls):
    count = [0]

    def call():
        count[0] += 1

    slow = measure.slowed(call, factor)
    assert getattr(slow, "multiple", 1) == loops or factor == 1.0
    for _ in range(3):
        count[0] = 0
        for _ in range(loops):
            slow()
        assert count[0] == calls


def _report(scale=1.0, noise=0.02, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for backend in ("numpy", "cpp"):
        f = list(0.5 * scale * np.exp(noise * rng.standard_normal(5)))
        s = list(20.0 * scale * np.exp(noise * rng.standard_normal(5)))
        rows.append({"kernel": "layer_norm", "backend": backend, "dtype": "float32", "size": "8x8",
                     "time_s": 1e-3, "spread": 0.05, "fraction": float(np.median(f)), "fraction_rounds": f,
                     "speedup_vs_numpy": float(np.median(s)), "speedup_rounds": s})
    return {"machine": {}, "results": rows}


def test_compare_uses_the_stored_rounds():
    base = _report()
    assert bench.compare(_report(seed=1), base) == []
    found = bench.compare(_report(scale=1 / 1.6, seed=1), base)
    assert len(found) == 1 and found[0].startswith("layer_norm cpp") and "fraction" in found[0]
    assert "speedup_vs_numpy" in found[0]
    probe = _report(seed=1)  # only the fraction fell (a noisy limit probe): the speed-up did not
    row = probe["results"][1]
    row["fraction_rounds"] = [v / 1.6 for v in row["fraction_rounds"]]
    assert bench.compare(probe, base) == []
    assert bench.compare(_report(scale=1 / 1.6, noise=0.8, seed=1), base) == []  # that noisy: no evidence


def test_baseline_with_bad_rounds_is_refused_before_timing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "run", lambda **kw: pytest.fail("timed before the baseline was checked"))
    doc = _report()
    doc["results"][1]["fraction_rounds"] = [0.5, "fast"]
    path = tmp_path / "base.json"
    path.write_text(json.dumps(doc))
    assert cli.main(["bench", "--quick", "--compare", str(path)]) == 2
    assert "fraction_rounds" in capsys.readouterr().err
    path.write_text(json.dumps([1, 2, 3]))  # JSON, but not a report
    assert cli.main(["bench", "--quick", "--compare", str(path)]) == 2
    assert "not a `pyengine bench --json` file" in capsys.readouterr().err


@pytest.mark.parametrize("threshold", ["-0.1", "nan", "1"])
def test_ab_threshold_is_checked_before_any_build(threshold, monkeypatch, capsys):
    monkeypatch.setattr(_ab, "build_revision", lambda *a: pytest.fail("built before the arguments were checked"))
    monkeypatch.setattr(bench, "compare_builds", lambda *a, **k: pytest.fail("timed before the check"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--quick", "--compare-rev", "HEAD", "--threshold", threshold])
    assert exc.value.code == 2 and "--threshold" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^threshold must be"):
        bench.ab_main("HEAD", None, True, None, float(threshold), ("float32",))


def test_ab_refuses_bad_inputs_before_timing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "compare_builds", lambda *a, **k: pytest.fail("timed before the check"))
    assert cli.main(["bench", "--compare-python", str(tmp_path / "nope")]) == 2
    assert "old_python" in capsys.readouterr().err
    assert cli.main(["bench", "--compare-rev", "HEAD", "--repo", str(tmp_path)]) == 2  # not a git checkout
    assert "rev 'HEAD'" in capsys.readouterr().err
    monkeypatch.setenv(measure.SLOWDOWN_ENV, "layer_norm:cpp=0.5")
    assert cli.main(["bench", "--compare-python", str(tmp_path / "nope")]) == 2
    assert measure.SLOWDOWN_ENV in capsys.readouterr().err
    monkeypatch.setattr(bench, "run", lambda **kw: pytest.fail("timed before the switch was checked"))
    assert cli.main(["bench", "--quick"]) == 2
    with pytest.raises(SystemExit):
        cli.main(["bench", "--rounds", "2", "--compare-rev", "HEAD"])
    assert math.isfinite(bench.AB_THRESHOLD)


def test_compare_forgives_a_machine_wide_slowdown_but_not_one_kernel():
    def rows(scales, seed):
        rng = np.random.default_rng(seed)
        out = []
        for k, scale in scales.items():
            for backend in ("numpy", "cpp"):
                f = list(0.5 * scale * np.exp(0.02 * rng.standard_normal(5)))
                out.append({"kernel": k, "backend": backend, "dtype": "float32", "size": "8x8", "time_s": 1e-3,
                            "spread": 0.05, "fraction": float(np.median(f)), "fraction_rounds": f})
        return {"machine": {}, "results": out}

    names = ["layer_norm", "rms_norm", "softmax", "gelu"]
    base = rows(dict.fromkeys(names, 1.0), 0)
    busy = rows(dict.fromkeys(names, 0.5), 1)  # a neighbour halves every kernel's share of the machine
    assert bench.compare(busy, base) == []
    one = rows({**dict.fromkeys(names, 0.5), "softmax": 0.5 / 1.6}, 2)  # ... and softmax regressed 1.6x
    found = bench.compare(one, base)
    assert len(found) == 1 and found[0].startswith("softmax cpp")
    faster = rows({**dict.fromkeys(names, 2.0), "softmax": 1.0}, 3)  # a faster machine does not sharpen it
    assert bench.compare(faster, base) == []
