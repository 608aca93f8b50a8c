"""The dense-layer kernels linear, linear_act, linear_mul against the reference.

Every backend and dtype over awkward shapes (one row, rows not a multiple of the tile, odd
k and n, k = 0), the epilogues (bias, residual in place, activations, a coefficient shared
by K tangents), the C++ epilogues equal to the separate kernels bit for bit, independence of the thread count, the numpy.matmul
fallback (forced), aliasing and bad-input errors. The BLAS library under them: test_blas.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import require
from helpers import assert_close
from pyengine import backends
from pyengine.kernels import linear as L

SHAPES = [(1, 7, 5), (37, 33, 17), (130, 64, 96), (1000, 48, 130), (513, 1, 3), (300, 512, 520)]
ACTS = ["none", "gelu", "gelu_tanh", "relu"]


def _case(N, k, n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, k)).astype(dtype)
    w = (rng.standard_normal((k, n)) / np.sqrt(max(k, 1))).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    r = rng.standard_normal((N, n)).astype(dtype)
    return x, w, b, r


def _ref(name):
    return backends.resolve(name, "numpy")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_b", [False, True])
@pytest.mark.parametrize("with_r", [False, True])
def test_linear_matches_the_reference(backend, dtype, shape, with_b, with_r):
    x, w, b, r = _case(*shape, dtype)
    b, r = (b if with_b else None), (r if with_r else None)
    want = np.empty((shape[0], shape[2]), dtype)
    assert _ref("linear")(x, w, b, r, want) == 0
    got = np.full_like(want, np.nan)
    copies = [a.copy() for a in (x, w) if a is not None]
    assert L.kernel("linear", backend)(x, w, b, r, got) == 0
    assert_close(got, want, dtype)
    assert all(np.array_equal(a, c) for a, c in zip((x, w), copies))  # inputs untouched


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("keep_u", [False, True])
def test_linear_act_matches_the_reference(backend, dtype, shape, act, keep_u):
    x, w, b, _ = _case(*shape, dtype, seed=1)
    N, _, n = shape
    want_u, want = np.empty((N, n), dtype), np.empty((N, n), dtype)
    _ref("linear_act")(x, w, b, act, want_u, want)
    u = np.full((N, n), np.nan, dtype) if keep_u else None
    got = np.full((N, n), np.nan, dtype)
    assert L.kernel("linear_act", backend)(x, w, b, act, u, got) == 0
    assert_close(got, want, dtype, scale=max(1.0, float(np.abs(want).max())))
    if keep_u:
        assert_close(u, want_u, dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("m_div", [1, 3])  # coef with N or N/3 rows (shared by 3 tangents)
def test_linear_mul_matches_the_reference(backend, dtype, shape, m_div):
    N, k, n = shape
    N = N * m_div
    x, w, _, _ = _case(N, k, n, dtype, seed=2)
    coef = np.random.default_rng(3).standard_normal((N // m_div, n)).astype(dtype)
    want = np.empty((N, n), dtype)
    _ref("linear_mul")(x, w, coef, want)
    assert_close(want.reshape(m_div, -1, n), (x @ w).reshape(m_div, -1, n) * coef, dtype)
    got = np.full_like(want, np.nan)
    assert L.kernel("linear_mul", backend)(x, w, coef, got) == 0
    assert_close(got, want, dtype)


def test_cpp_epilogues_equal_the_separate_kernels_bit_for_bit(dtype):
    """The fused epilogue is the separate pass, element for element: act(u) is the activation
    kernel on the kernel's own u, and linear_mul is linear's product times coef. (The tile's
    gemm itself may round differently from one numpy matmul over all rows.)"""
    require("cpp")
    from pyengine import _core

    x, w, b, r = _case(1000, 64, 130, dtype, seed=4)
    out = np.empty((1000, 130), dtype)
    _core.linear(x, w, b, r, out)
    assert_close(out, x @ w + b + r, dtype)
    for act in ("gelu", "gelu_tanh", "relu"):
        u = np.empty_like(out)
        _core.linear_act(x, w, b, act, u, out)
        z = np.empty_like(u)
        getattr(_core, act)(u, z)
        assert np.array_equal(out, z), act
        assert_close(u, x @ w + b, dtype)
    p = np.empty_like(out)
    _core.linear(x, w, None, None, p)
    coef = r[:100]
    _core.linear_mul(x, w, coef, out)
    assert np.array_equal(out, (p.reshape(10, 100, 130) * coef).reshape(1000, 130))
    with_b = np.empty_like(out)
    _core.linear(x, w, b, None, with_b)
    assert np.array_equal(with_b, p + b)


@pytest.mark.parametrize("shape", [(777, 40, 300), (600, 512, 512), (257, 768, 384)], ids=lambda s: "x".join(map(str, s)))
def test_results_do_not_depend_on_the_thread_count(compiled, dtype, shape):
    # The first shape is tiled by its shape alone; the others are large products (k n >= 2^18),
    # whose row tiles follow the thread count (a row's rounding does not depend on its tile).
    N, k, n = shape
    x, w, b, r = _case(N, k, n, dtype, seed=5)
    fn = L.kernel("linear_act", compiled)
    outs = []
    for t in (1, 2, 3, 5):
        o = np.empty((N, n), dtype)
        with backends.num_threads(t):
            fn(x, w, b, "gelu_tanh", None, o)
        outs.append(o)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("threads", [1, 2, 3, 8, 64])
def test_row_tiles_of_a_large_product_follow_the_thread_count(threads):
    from pyengine.kernels._numba.linear import row_tiles

    for N in (256, 257, 600, 4096, 4097, 8320, 20000):
        b = row_tiles(N, 768, 768, threads)
        sizes = np.diff(b)
        t = min(threads, 8)
        assert b[0] == 0 and b[-1] == N and np.all(b[:-1] % 16 == 0), (N, b)
        assert len(sizes) % t == 0 and sizes.min() >= 16 and sizes.max() <= 2048, (N, sizes)
        assert sizes.max() - sizes.min() < 32, (N, sizes)
    assert row_tiles(255, 768, 768, threads) is None
    small = row_tiles(4096, 40, 300, threads)  # not large: about 8 tiles, whatever the threads
    assert np.array_equal(small, np.arange(9) * 512)


def test_residual_in_place_and_k_zero(backend, dtype):
    x, w, b, r = _case(130, 33, 17, dtype, seed=6)
    out = r.copy()
    L.kernel("linear", backend)(x, w, b, out, out)  # out = x w + b + out
    assert_close(out, x @ w + b + r, dtype)
    x0, w0 = np.empty((5, 0), dtype), np.empty((0, 4), dtype)
    out = np.full((5, 4), np.nan, dtype)
    L.kernel("linear", backend)(x0, w0, b[:4], None, out)
    assert np.array_equal(out, np.broadcast_to(b[:4], (5, 4)))


def test_nonfinite_rows_are_counted(backend):
    x, w, b, _ = _case(40, 9, 11, np.float64, seed=7)
    x[[3, 17], 2] = np.nan
    out = np.empty((40, 11))
    assert L.kernel("linear", backend)(x, w, b, None, out) == 2
    assert L.kernel("linear_act", backend)(x, w, b, "gelu", None, out) == 2
    assert L.kernel("linear_mul", backend)(x, w, np.ones((20, 11)), out) == 2
    with pytest.raises(ValueError, match="NaN or Inf in 2 row"):
        L.linear(x, w, b, backend=backend)


def test_fallback_path_forced(dtype):
    """Without its BLAS a compiled kernel returns -1 and leaves out alone; the registered "cpp"
    kernel then takes numpy.matmul and the compiled epilogue."""
    require("cpp")
    from pyengine import _core

    x, w, b, r = _case(300, 70, 90, dtype, seed=8)
    fast = L.linear(x, w, b, activation="gelu_tanh", backend="cpp")
    fast_r = L.linear(x, w, b, residual=r, backend="cpp")
    _core.linear_force_fallback(True)
    try:
        assert _core.linear_blas_info().startswith("numpy matmul")
        assert L.blas_info().startswith("numpy matmul")
        untouched = np.full((300, 90), 7.0, dtype)
        assert _core.linear(x, w, b, None, untouched) == -1 and (untouched == 7).all()
        slow = L.linear(x, w, b, activation="gelu_tanh", backend="cpp")
        slow_r = L.linear(x, w, b, residual=r, backend="cpp")
        out = r.copy()
        L.kernel("linear", "cpp")(x, w, b, out, out)
        u, z = np.empty((300, 90), dtype), np.empty((300, 90), dtype)
        L.kernel("linear_act", "cpp")(x, w, b, "relu", u, z)
        coef = r[:100].copy()
        m = np.empty((300, 90), dtype)
        L.kernel("linear_mul", "cpp")(x, w, coef, m)
    finally:
        _core.linear_force_fallback(False)
    assert not _core.linear_blas_info().startswith("numpy matmul") or "forced" not in _core.linear_blas_info()
    assert_close(slow, fast, dtype, scale=1.0)
    assert_close(slow_r, fast_r, dtype)
    assert_close(out, x @ w + b + r, dtype)
    assert_close(u, x @ w + b, dtype)
    assert_close(z, np.maximum(x @ w + b, 0), dtype)
    assert_close(m, ((x @ w).reshape(3, 100, 90) * coef).reshape(300, 90), dtype)


def test_public_function_shapes_and_out(dtype):
    x, w, b, r = _case(6 * 5, 8, 9, dtype, seed=9)
    x3 = x.reshape(6, 5, 8)
    got = L.linear(x3, w, b, activation="relu")
    assert got.shape == (6, 5, 9) and got.dtype == dtype
    assert_close(got, np.maximum(x3 @ w + b, 0), dtype)
    out = r.reshape(6, 5, 9).copy()
    assert L.linear(x3, w, b, residual=out, out=out) is out
    assert_close(out, x3 @ w + b + r.reshape(6, 5, 9), dtype)
    coef = r[:5]
    assert_close(L.linear_mul(x3, w, coef), (x3 @ w) * coef, dtype)
    other = w.astype(np.float64 if dtype == np.float32 else np.float32)
    got = L.linear(x3, other)  # w converted to x's dtype
    assert got.dtype == dtype
    assert_close(got, x3 @ other.astype(dtype), dtype)


def test_bad_input_names_the_argument():
    x, w, b, r = _case(10, 4, 3, np.float64)
    with pytest.raises(ValueError, match=r"^w must have shape \(4, n\)"):
        L.linear(x, w.T)
    with pytest.raises(ValueError, match=r"^b must have shape \(3,\)"):
        L.linear(x, w, b[:2])
    with pytest.raises(ValueError, match="activation"):
        L.linear(x, w, b, activation="tanh")
    with pytest.raises(TypeError, match="^x must be a float32 or float64"):
        L.linear(x.astype(int), w)
    with pytest.raises(ValueError, match="^residual must have shape"):
        L.linear(x, w, residual=r[:5])
    with pytest.raises(ValueError, match="residual"):
        L.linear(x, w, activation="gelu", residual=r)
    with pytest.raises(ValueError, match="^coef must have shape"):
        L.linear_mul(x, w, r[:, :2])
    with pytest.raises(ValueError, match="^out must not overlap"):
        big = np.zeros((10, 4))
        L.linear(big, np.eye(4), out=big)
    with pytest.raises(ValueError, match="^out must have shape"):
        L.linear(x, w, out=np.empty((10, 4)))


def test_raw_cpp_kernel_checks(dtype):
    require("cpp")
    from pyengine import _core

    x, w, b, r = _case(10, 4, 4, dtype)
    with pytest.raises(ValueError, match="^w must have shape"):
        _core.linear(x, w[:3], None, None, np.empty((10, 4), dtype))
    with pytest.raises(ValueError, match="^out must not overlap x"):
        _core.linear(x, w, None, None, x)
    with pytest.raises(ValueError, match="^out must not overlap r"):
        buf = np.zeros((11, 4), dtype)
        _core.linear(x, w, None, buf[1:], buf[:-1])  # overlapping, but not the same array
    with pytest.raises(ValueError, match="^activation must be one of"):
        _core.linear_act(x, w, None, "tanh", None, np.empty((10, 4), dtype))
    with pytest.raises(ValueError, match="^out must not overlap u"):
        u = np.empty((10, 4), dtype)
        _core.linear_act(x, w, None, "gelu", u, u)
    with pytest.raises(ValueError, match="^coef must have shape"):
        _core.linear_mul(x, w, np.empty((3, 4), dtype), np.empty((10, 4), dtype))
    with pytest.raises(TypeError):
        _core.linear(x, w.astype(np.float32 if dtype == np.float64 else np.float64), None, None,
                     np.empty((10, 4), dtype))


def test_pyengine_backends_says_which_path_is_active(capsys):
    from pyengine import cli

    assert cli.main(["backends"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("linear kernels' products (cpp): ") and line.endswith(L.blas_info())
