"""The Numba dense Jacobians' non-temporal stores (issue 18): an output over
``layernorm.STREAM_MIN_BYTES`` is written by ``_jit.stream_affine``; its values must be bit
for bit those of the plain path, whatever the output's alignment. Also the prefetch hints
the norm kernels issue ahead of their rows (``_jit.prefetch``, ``_jit.prefetch_write``)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import require
from pyengine.backends import resolve


@pytest.fixture(scope="module")
def nb():
    """(_jit, layernorm) of the Numba backend, and a jitted caller of stream_affine."""
    require("numba")
    import numba

    from pyengine.kernels._numba import _jit, layernorm

    @numba.njit
    def affine(dst, src, a, b, c):
        _jit.stream_affine(dst, src, a, b, c)
        _jit.store_fence()

    @numba.njit
    def loop(dst, src, a, b, c):  # the same expression as a plain Numba loop
        for j in range(src.size):
            dst[j] = a * (b - c * src[j])

    return layernorm, affine, loop


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("n", [0, 1, 7, 15, 16, 17, 64, 1000])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_stream_affine_intrinsic(nb, dtype, n, offset):
    """Every element equals the plain loop's (and NumPy's), whatever dst's alignment; only dst is written."""
    _, affine, loop = nb
    rng = np.random.default_rng(n)
    src = rng.standard_normal(n)
    src_copy = src.copy()
    a, b, c = 1.7, -0.3, 0.123456789
    store = np.full(n + offset + 2, -1.0, dtype)
    dst = store[offset : offset + n]
    affine(dst, src, a, b, c)
    ref = np.empty(n, dtype)
    loop(ref, src, a, b, c)
    np.testing.assert_array_equal(dst, ref)
    np.testing.assert_array_equal(dst, (a * (b - c * src)).astype(dtype))
    assert (store[:offset] == -1).all() and (store[offset + n :] == -1).all()
    np.testing.assert_array_equal(src, src_copy)


def test_stream_affine_misaligned_bytes(nb):
    """A float64 destination that is not 8-byte aligned (a byte view) is written with plain stores."""
    _, affine, _ = nb
    raw = np.zeros(8 * 200 + 3, np.uint8)
    dst = raw[3 : 3 + 8 * 200].view(np.float64)
    assert not dst.flags.aligned
    src = np.arange(200, dtype=np.float64)
    affine(dst, src, 2.0, 1.0, 0.5)
    np.testing.assert_array_equal(dst, 2.0 * (1.0 - 0.5 * src))


def test_stream_affine_refuses_strided_arrays(nb):
    """The intrinsic indexes memory directly, so a non-contiguous dst or src must not type-check."""
    import numba

    if numba.config.DISABLE_JIT:
        pytest.skip("typing is compiled-mode only")
    _, affine, _ = nb
    src = np.arange(40, dtype=np.float64)
    with pytest.raises(numba.core.errors.TypingError):
        affine(np.zeros(40, np.float32)[::2], src[::2], 1.0, 0.0, 1.0)
    with pytest.raises(numba.core.errors.TypingError):
        affine(np.zeros(20, np.float32), src[::2], 1.0, 0.0, 1.0)


def test_prefetch_hints_never_fault_nor_write():
    """``prefetch`` / ``prefetch_write`` on indices far outside the array (the norm kernels ask
    for lines ahead of the row being written) neither fault nor change a value."""
    require("numba")
    import numba

    from pyengine.kernels._numba import _jit

    @numba.njit
    def touch(a, lo, hi, step):
        for i in range(lo, hi, step):
            _jit.prefetch(a, i)
            _jit.prefetch_write(a, i)
        return a.sum()

    for dtype in (np.float32, np.float64):
        a = np.arange(100, dtype=dtype)
        before = a.copy()
        assert touch(a, -(1 << 20), 1 << 20, 61) == before.sum()
        np.testing.assert_array_equal(a, before)
    if not numba.config.DISABLE_JIT:
        with pytest.raises(numba.core.errors.TypingError):
            touch(np.zeros((4, 4)), 0, 4, 1)  # 1-D arrays only


@pytest.mark.parametrize("kernel", ["layer_norm_jacobian", "rms_norm_jacobian"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("frozen", [False, True], ids=["full", "frozen"])
@pytest.mark.parametrize("offset", [0, 1, 5], ids=["aligned", "off1", "off5"])
def test_streamed_jacobian_equals_plain(nb, kernel, dtype, frozen, offset):
    """A streamed (n, d, d) Jacobian holds exactly what one-token calls (plain stores) write."""
    layernorm = nb[0]
    fn = resolve(kernel, "numba")
    item = np.dtype(dtype).itemsize
    d = 1031  # odd: unaligned row starts and ends, and a diagonal in every position of a line
    n = -(-layernorm.STREAM_MIN_BYTES // (item * d * d)) + 1
    assert d * d * item < layernorm.STREAM_MIN_BYTES  # one token: the plain path
    rng = np.random.default_rng(3)
    x = (2.0 + rng.standard_normal((n, d))).astype(dtype)
    x[1, 17] = np.nan  # a bad row is counted on both paths
    gamma = rng.uniform(0.5, 1.5, d).astype(dtype)
    keep = x.copy(), gamma.copy()
    store = np.full(n * d * d + offset, 7.0, dtype)
    out = store[offset:].reshape(n, d, d)  # not 64-byte aligned unless offset = 0
    assert out.nbytes >= layernorm.STREAM_MIN_BYTES
    assert fn(x, gamma, 1e-5, frozen, out) == 1
    assert (store[:offset] == 7.0).all()  # nothing written before out
    for r in range(n):
        one = np.empty((1, d, d), dtype)
        bad = fn(x[r : r + 1], gamma, 1e-5, frozen, one)
        if not bad:
            np.testing.assert_array_equal(out[r], one[0])
    np.testing.assert_array_equal(x, keep[0])
    np.testing.assert_array_equal(gamma, keep[1])
