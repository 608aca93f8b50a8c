"""The per-call fast paths of the public layer: cached resolution, cached
default parameters, the quick finiteness test of gamma/beta. Each must keep the checks
and their messages of the slow path."""

from __future__ import annotations

import numpy as np
import pytest

import pyengine as pe
from pyengine import _validate as _v
from pyengine import backends


def test_resolve_cache_follows_use_backend():
    fn_auto = backends.resolve("layer_norm")
    with pe.use_backend("numpy"):
        assert backends.resolve("layer_norm") is backends.resolve("layer_norm", "numpy")
        assert backends.resolve("layer_norm") is not fn_auto or backends.auto_backend("layer_norm") == "numpy"
    assert backends.resolve("layer_norm") is fn_auto


@pytest.mark.parametrize("bad", [["cpp"], None, 3])
def test_resolve_bad_backend_still_named(bad):
    with pytest.raises(ValueError, match="backend must be one of"):
        backends.resolve("layer_norm", bad)


def test_resolve_unknown_kernel():
    with pytest.raises(KeyError, match="unknown kernel id"):
        backends.resolve("no_such_kernel")


def test_default_params_are_shared_and_read_only():
    x2 = np.zeros((3, 5), np.float32)
    g1, g2 = _v.param("gamma", None, x2, 1.0), _v.param("gamma", None, x2, 1.0)
    assert g1 is g2 and not g1.flags.writeable
    np.testing.assert_array_equal(g1, np.ones(5, np.float32))
    assert _v.param("beta", None, x2, 0.0).dtype == np.float32
    np.testing.assert_array_equal(_v.param("beta", None, x2.astype(np.float64), 0.0), np.zeros(5))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_param_nonfinite_found_by_the_quick_test(value, dtype):
    x2 = np.zeros((2, 6), dtype)
    g = np.ones(6, dtype)
    g[4] = value
    with pytest.raises(ValueError, match=r"gamma contains NaN or Inf \(first at index 4"):
        _v.param("gamma", g, x2, 1.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_param_huge_finite_entries_pass(dtype):
    # g . g overflows, every entry is finite: the slow check must clear it.
    big = np.finfo(dtype).max / 4
    g = np.full(6, big, dtype)
    out = _v.param("gamma", g, np.zeros((2, 6), dtype), 1.0)
    np.testing.assert_array_equal(out, g)


@pytest.mark.parametrize("eps", [np.nan, np.inf, -1.0, -0.0 - 1e-300])
def test_eps_float_fast_path_keeps_checks(eps):
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        _v.eps(eps)


@pytest.mark.parametrize("eps", [True, "1e-5", None])
def test_eps_non_float_rejected(eps):
    with pytest.raises(TypeError, match="eps must be a real number >= 0"):
        _v.eps(eps)


def test_eps_numpy_scalar_accepted():
    assert _v.eps(np.float32(0.5)) == 0.5 and type(_v.eps(np.float64(1e-5))) is float


def test_rows_fast_path_returns_the_input_view_unchanged():
    x = np.arange(12.0).reshape(3, 4)
    x2, shape = _v.rows("x", x)
    assert x2 is x and shape == (3, 4)
    t = np.asfortranarray(x)
    t2, _ = _v.rows("x", t)
    assert t2.flags.c_contiguous and np.array_equal(t2, x)


def test_tangent_fast_path_and_conversion():
    x2 = np.zeros((2, 3), np.float32)
    v = np.ones((2, 3), np.float32)
    assert _v.tangent("v", v, x2, (2, 3)) is v
    v64 = _v.tangent("v", v.astype(np.float64), x2, (2, 3))
    assert v64.dtype == np.float32


@pytest.mark.parametrize("backend", ["auto", "numpy"])
def test_default_gamma_beta_match_explicit(backend):
    x = np.random.default_rng(1).standard_normal((2, 4, 16))
    want = pe.layer_norm(x, np.ones(16), np.zeros(16), backend=backend)
    got = pe.layer_norm(x, backend=backend)
    np.testing.assert_array_equal(got, want)
    assert got.flags.writeable and got.shape == x.shape
