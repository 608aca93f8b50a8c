"""Issue 13, reliability: each reproducer of the issue as a test (it failed before the fix),
plus the classes behind them (property tests with hypothesis live in test_properties.py).

Arguments: every public argument is checked with a message that names it, before any
heavy work; numbers are never NaN where a range is asked for; booleans are booleans and
callables are callable; files are checked before a benchmark or a run starts.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import pyengine as pe
from pyengine import _validate as _v
from pyengine import bench, cli

# -- item 9, 10: array and budget arguments -------------------------------------------


def test_item9_max_bytes_nan_is_refused():
    x = np.random.default_rng(0).standard_normal((2, 4))
    for bad in (float("nan"), 0, -1.0, "1e9", True):
        with pytest.raises((ValueError, TypeError), match="max_bytes"):
            pe.layer_norm_jacobian(x, max_bytes=bad)
        with pytest.raises((ValueError, TypeError), match="max_bytes"):
            pe.rms_norm_jacobian(x, max_bytes=bad)
    assert pe.layer_norm_jacobian(x, max_bytes=float("inf")).shape == (2, 4, 4)


@pytest.mark.parametrize("fn", [pe.layer_norm, pe.rms_norm])
def test_item10_ragged_x_names_x(fn):
    with pytest.raises(ValueError, match="^x must be an array of numbers"):
        fn([[1.0, 2.0], [3.0]])
    with pytest.raises(ValueError, match="^v must be an array of numbers"):
        pe.layer_norm_jvp(np.ones((2, 2)) + np.eye(2), [[1.0, 2.0], [3.0]])
    with pytest.raises(ValueError, match="^gamma must be an array of numbers"):
        fn(np.eye(2) + 1, [[1.0], [1.0, 2.0]])


def test_real_refuses_nan_in_every_range():
    for kw in ({"low": 0}, {"high": 1}, {"low": 0, "high": 1, "high_open": True}, {"finite": False}):
        with pytest.raises(ValueError, match="^t must be"):
            _v.real("t", float("nan"), **kw)
    with pytest.raises(TypeError, match="^t must be"):
        _v.real("t", True)
    assert _v.real("t", np.float32(0.5), low=0, high=1) == 0.5


# -- items 17, 18, 19: pyengine bench checks its arguments and its baseline first ------


def _never_run(monkeypatch):
    def boom(**kwargs):
        raise AssertionError("the benchmark ran before the arguments were checked")

    monkeypatch.setattr(bench, "run", boom)


def _good_report():
    return {"machine": {}, "results": [{"kernel": "layer_norm", "backend": "cpp", "dtype": "float32",
                                        "size": "2048x768", "spread": 0.1, "fraction": 0.5,
                                        "speedup_vs_numpy": 3.0}]}


@pytest.mark.parametrize("threshold", ["-1", "nan", "inf", "1", "1.5", "x"])
def test_item17_bench_threshold_is_a_fraction(threshold, tmp_path, monkeypatch, capsys):
    _never_run(monkeypatch)
    base = tmp_path / "base.json"
    base.write_text(json.dumps(_good_report()))
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--quick", "--threshold", threshold, "--compare", str(base)])
    assert exc.value.code == 2
    assert "--threshold" in capsys.readouterr().err
    for bad in (-1, float("nan"), 1.0):
        with pytest.raises(ValueError, match="^threshold must be"):
            bench.compare(_good_report(), _good_report(), bad)
        with pytest.raises(ValueError, match="^threshold must be"):
            bench.main(True, None, str(base), bad, ("float32",))


@pytest.mark.parametrize("results", [
    [{"kernel": "layer_norm"}, 7],
    [7],
    [{"kernel": "layer_norm", "backend": "cpp", "dtype": "float32", "size": "8x8"}],
    [{**_good_report()["results"][0], "fraction": "fast"}],
    [{**_good_report()["results"][0], "spread": float("nan")}],
])
def test_item18_bench_baseline_rows_are_checked_before_the_run(results, tmp_path, monkeypatch, capsys):
    _never_run(monkeypatch)
    base = tmp_path / "rows.json"
    base.write_text(json.dumps({"machine": {}, "results": results}))
    assert cli.main(["bench", "--quick", "--compare", str(base)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pyengine: error: baseline {base}: results[") and err.count("\n") == 1
    with pytest.raises(ValueError, match=r"^baseline: results\["):
        bench.compare(_good_report(), {"results": results})


def test_item19_bench_binary_baseline_names_the_file(tmp_path, monkeypatch, capsys):
    _never_run(monkeypatch)
    npy = tmp_path / "good.npy"
    np.save(npy, np.random.default_rng(0).standard_normal(100))
    assert cli.main(["bench", "--quick", "--compare", str(npy)]) == 2
    err = capsys.readouterr().err
    assert err == f"pyengine: error: baseline {npy} is not a text (UTF-8 JSON) file: not a `pyengine bench --json` file\n"


def test_bench_good_baseline_still_compares():
    assert bench.compare(_good_report(), _good_report()) == []
    assert bench.load_baseline  # public


# -- items 13 (CLI side), 20: the CLI refuses bad numbers and ignored options ----------


@pytest.mark.parametrize("argv", [
    ["spectral", "--seed", "-1"],
    ["recovery", "--seed", "-1"],
    ["recovery", "--scale", "inf"],
    ["recovery", "--scale", "nan"],
    ["recovery", "--scales", "1,nan"],
    ["spectral", "--eps", "nan"],
    ["spectral", "--eps", "-1"],
    ["spectral", "--tol", "inf"],
])
def test_item13_item20_cli_numbers_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "RuntimeWarning" not in err and f"argument {argv[1]}" in err


def test_item20_spectral_key_with_npy_is_refused(tmp_path, capsys):
    npy = tmp_path / "good.npy"
    np.save(npy, np.random.default_rng(0).standard_normal((4, 8)))
    assert cli.main(["spectral", "--input", str(npy), "--key", "a", "--progress", "never"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pyengine: error: --key a") and str(npy) in err and err.count("\n") == 1
