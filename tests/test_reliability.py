"""Reliability at the edges: argument checks, wrong-answer cases of the solvers and norms,
and extreme magnitudes (property tests with hypothesis live in test_properties.py).

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

# -- array and budget arguments -------------------------------------------


def test_jacobian_max_bytes_refuses_bad_values():
    x = np.random.default_rng(0).standard_normal((2, 4))
    for bad in (float("nan"), 0, -1.0, "1e9", True):
        with pytest.raises((ValueError, TypeError), match="max_bytes"):
            pe.layer_norm_jacobian(x, max_bytes=bad)
        with pytest.raises((ValueError, TypeError), match="max_bytes"):
            pe.rms_norm_jacobian(x, max_bytes=bad)
    assert pe.layer_norm_jacobian(x, max_bytes=float("inf")).shape == (2, 4, 4)


@pytest.mark.parametrize("fn", [pe.layer_norm, pe.rms_norm])
def test_ragged_arrays_name_the_argument(fn):
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


# -- pyengine bench checks its arguments and its baseline first ------


def _never_run(monkeypatch):
    def boom(**kwargs):
        raise AssertionError("the benchmark ran before the arguments were checked")

    monkeypatch.setattr(bench, "run", boom)


def _good_report():
    return {"machine": {}, "results": [{"kernel": "layer_norm", "backend": "cpp", "dtype": "float32",
                                        "size": "2048x768", "spread": 0.1, "fraction": 0.5,
                                        "speedup_vs_numpy": 3.0}]}


@pytest.mark.parametrize("threshold", ["-1", "nan", "inf", "1", "1.5", "x"])
def test_bench_threshold_is_a_fraction(threshold, tmp_path, monkeypatch, capsys):
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
def test_bench_baseline_rows_are_checked_before_the_run(results, tmp_path, monkeypatch, capsys):
    _never_run(monkeypatch)
    base = tmp_path / "rows.json"
    base.write_text(json.dumps({"machine": {}, "results": results}))
    assert cli.main(["bench", "--quick", "--compare", str(base)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pyengine: error: baseline {base}: results[") and err.count("\n") == 1
    with pytest.raises(ValueError, match=r"^baseline: results\["):
        bench.compare(_good_report(), {"results": results})


def test_bench_binary_baseline_names_the_file(tmp_path, monkeypatch, capsys):
    _never_run(monkeypatch)
    npy = tmp_path / "good.npy"
    np.save(npy, np.random.default_rng(0).standard_normal(100))
    assert cli.main(["bench", "--quick", "--compare", str(npy)]) == 2
    err = capsys.readouterr().err
    assert err == f"pyengine: error: baseline {npy} is not a text (UTF-8 JSON) file: not a `pyengine bench --json` file\n"


def test_bench_good_baseline_still_compares():
    assert bench.compare(_good_report(), _good_report()) == []
    assert bench.load_baseline  # public


# -- the CLI refuses bad numbers and ignored options ----------


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
def test_cli_numbers_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "RuntimeWarning" not in err and f"argument {argv[1]}" in err


def test_spectral_key_with_npy_is_refused(tmp_path, capsys):
    npy = tmp_path / "good.npy"
    np.save(npy, np.random.default_rng(0).standard_normal((4, 8)))
    assert cli.main(["spectral", "--input", str(npy), "--key", "a", "--progress", "never"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pyengine: error: --key a") and str(npy) in err and err.count("\n") == 1


# -- wrong answers and solver contracts -------------------------
# (RuntimeWarnings are errors in this test suite, so every test here also checks that none is raised.)


@pytest.mark.parametrize("method", ["exact", "power", "lanczos"])
def test_sigma_max_d2_eps0_is_zero_and_converged(backend, method):
    r = pe.layer_norm_spectral_norm(np.tile([[1.0, 2.0]], (8, 1)), eps=0.0, method=method, backend=backend)
    assert (r.sigma == 0).all() and (r.upper == 0).all() and r.converged.all() and (r.residual == 0).all()


@pytest.mark.parametrize("fn", [pe.rms_norm_spectral_norm, pe.layer_norm_spectral_norm])
@pytest.mark.parametrize("method", ["power", "lanczos"])
def test_sigma_max_float32_tiny_rows_have_a_finite_residual(fn, method):
    x = (np.random.default_rng(0).standard_normal((2, 64)) * 1e-20).astype(np.float32)
    r = fn(x, eps=0.0, method=method)
    assert np.isfinite(r.residual).all() and r.converged.all()
    np.testing.assert_allclose(r.sigma, fn(x, eps=0.0, method="exact").sigma, rtol=1e-6)


def test_norms_eps0_extreme_rows_keep_full_precision(backend):
    x = np.random.default_rng(0).standard_normal((1, 64))
    for scale in (1e-160, 1e-300, 1e200, 1e300):
        assert abs(pe.rms_norm(x * scale, eps=0, backend=backend) - pe.rms_norm(x, eps=0, backend=backend)).max() < 1e-14
        assert abs(pe.layer_norm(x * scale, eps=0, backend=backend) - pe.layer_norm(x, eps=0, backend=backend)).max() < 1e-14


def test_layer_norm_tiny_row_with_eps_keeps_full_precision(backend):
    """eps > 0 on a tiny row: s = sqrt(var + eps), var negligible; x / s keeps full precision."""
    x = np.random.default_rng(1).standard_normal((2, 16)) * 1e-170
    y = pe.layer_norm(x, eps=1e-5, backend=backend)
    np.testing.assert_allclose(y, (x - x.mean(1, keepdims=True)) / np.sqrt(1e-5), rtol=1e-14)


def test_lanczos_iterations_never_exceed_max_iter():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    g = rng.lognormal(0, 0.5, 64).astype(np.float32)
    r = pe.rms_norm_spectral_norm(x, g, method="lanczos", max_iter=40, tol=1e-10)
    assert r.iterations.max() <= 40
    assert (r.converged == (r.residual <= 1e-10)).all()


def test_lanczos_converged_agrees_with_the_residual(backend):
    r = pe.layer_norm_spectral_norm(np.array([[0.3, -1.2]]), eps=0.0, method="lanczos", max_iter=5, backend=backend)
    assert (r.converged == (r.residual <= r.tol)).all() and r.converged.all()


def test_spectral_radius_extreme_v0():
    a = np.random.default_rng(1).standard_normal((3, 8, 8))
    r = pe.spectral_radius(a, v0=np.full((3, 8), 1e300))
    np.testing.assert_allclose(r.rho, np.abs(np.linalg.eigvals(a)).max(axis=1), rtol=1e-6)
    np.testing.assert_allclose(pe.spectral_radius(a, v0=np.full((3, 8), 1e-300)).rho, r.rho, rtol=1e-6)


# -- propagate and recovery ----------------------------------------------


@pytest.fixture(scope="module")
def stack():
    return pe.init_weights(pe.StackConfig(d_model=64, n_heads=4, n_layers=3, vocab_size=50), seed=0)


IDS = np.arange(10) % 50
V2 = np.random.default_rng(0).standard_normal((2, 64))


@pytest.mark.parametrize("size", [1e300, 1e-160, 1e-300, 1.7e308])
def test_propagate_directions_of_extreme_norm(stack, size):
    p = pe.propagate(stack, IDS, np.full(64, size), 1.0, 1)
    np.testing.assert_allclose(p.delta_norm[0].max(), 1.0, rtol=1e-15)


def _no_heavy_work(monkeypatch):
    import importlib

    from pyengine.models import Stack

    def boom(*a, **k):
        raise AssertionError("the work started before the arguments were checked")

    monkeypatch.setattr(Stack, "forward", boom)
    monkeypatch.setattr(importlib.import_module("pyengine.experiments.recovery"), "propagate", boom)


@pytest.mark.parametrize("kwargs, name", [
    ({"progress": 5}, "progress"),
    ({"positions": slice(0, 5, 0)}, "positions"),
    ({"positions": slice(0.5, 3)}, "positions"),
    ({"linearized": "no"}, "linearized"),
    ({"linearized": 1}, "linearized"),
    ({"mode": "nope"}, "mode"),
    ({"batch_size": 0}, "batch_size"),
    ({"dtype": np.int32}, "dtype"),
])
def test_propagate_checks_arguments_before_work(stack, monkeypatch, kwargs, name):
    if name not in ("positions",):  # positions need T, known only from the baseline's input
        _no_heavy_work(monkeypatch)
    with pytest.raises((ValueError, TypeError), match=f"^{name}"):
        pe.propagate(stack, IDS, V2, 1.0, 1, **kwargs)


@pytest.mark.parametrize("kwargs, name", [
    ({"ids": np.array([], int)}, "ids"),
    ({"seed": -1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"protocol_scale": float("inf")}, "protocol_scale"),
    ({"protocol_scale": float("nan")}, "protocol_scale"),
    ({"scales": [1.0, float("nan")]}, "scales"),
    ({"scales": [[1.0], [1.0, 2.0]]}, "scales"),
    ({"eps_values": [-1.0]}, "eps_values"),
    ({"gamma_values": [float("inf")]}, "gamma_values"),
    ({"progress": 3}, "progress"),
    ({"name": 7}, "name"),
    ({"n_directions": 0}, "n_directions"),
    ({"read": "first"}, "read"),
    ({"spectral_tokens": slice(0, 2, 0)}, "positions"),
    ({"n_probes": 0}, "n_probes"),
    ({"spectra": "no"}, "spectra"),
])
def test_recovery_checks_arguments_before_work(stack, monkeypatch, kwargs, name):
    from pyengine.experiments import recovery

    _no_heavy_work(monkeypatch)
    args = {"ids": IDS, **kwargs}
    with pytest.raises((ValueError, TypeError), match=f"^{name}"):
        recovery(stack, **args)
