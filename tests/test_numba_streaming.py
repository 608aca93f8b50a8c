"""The Numba norm kernels' non-temporal stores (issue 18): large outputs go through a per-thread
row buffer and ``_jit.stream_copy``; the values must be bit for bit those of the plain path."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import require
from pyengine.backends import resolve

pytestmark = pytest.mark.usefixtures("numba_backend")


@pytest.fixture(scope="module")
def numba_backend():
    require("numba")


def _kernels():
    from pyengine.kernels._numba import _jit, layernorm

    return _jit, layernorm


# kernel id -> argument letters: x, v (tangent/cotangent), g(amma), b(eta), e(ps), f(rozen)
KERNELS = {
    "layer_norm": "xgbe",
    "layer_norm_jvp": "xvgef",
    "layer_norm_vjp": "xvgef",
    "rms_norm": "xge",
    "rms_norm_jvp": "xvgef",
    "rms_norm_vjp": "xvgef",
}


def _args(letters, n, d, dtype, seed=0, frozen=False):
    rng = np.random.default_rng(seed)
    m = {
        "x": (3.0 + rng.standard_normal((n, d))).astype(dtype),
        "v": rng.standard_normal((n, d)).astype(dtype),
        "g": rng.uniform(0.5, 1.5, d).astype(dtype),
        "b": rng.standard_normal(d).astype(dtype),
        "e": 1e-5,
        "f": frozen,
    }
    return [m[c] for c in letters]


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("offset", [0, 1, 5], ids=["aligned", "off1", "off5"])
def test_streamed_rows_equal_plain_rows(kernel, dtype, offset):
    """An output over STREAM_MIN_BYTES (streamed) holds exactly what small calls on its rows write."""
    _, layernorm = _kernels()
    fn = resolve(kernel, "numba")
    item = np.dtype(dtype).itemsize
    d = 1031  # odd: the stores' unaligned ends and a leftover of the prefetch blocks
    n = layernorm.STREAM_MIN_BYTES // (item * d) + 3
    args = _args(KERNELS[kernel], n, d, dtype, frozen=kernel.endswith("jvp"))
    x = args[0]
    x[7, 3] = np.nan  # a bad row is counted on both paths
    keep = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    store = np.full(n * d + offset, 7.0, dtype)
    out = store[offset:].reshape(n, d)  # not 64-byte aligned unless offset = 0
    assert out.nbytes >= layernorm.STREAM_MIN_BYTES
    bad = fn(*args, out)
    assert bad == 1
    if offset:
        assert store[0] == 7.0  # nothing written before out
    for lo, hi in [(0, 9), (n // 2, n // 2 + 5), (n - 4, n)]:
        small = [a[lo:hi] if isinstance(a, np.ndarray) and a.ndim == 2 else a for a in args]
        ref = np.empty((hi - lo, d), dtype)
        fn(*small, ref)
        finite = np.isfinite(ref).all(axis=1)
        np.testing.assert_array_equal(out[lo:hi][finite], ref[finite])
    for a, b in zip(args, keep):
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)  # inputs untouched


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("n", [0, 1, 7, 15, 16, 17, 64, 1000])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_stream_copy_intrinsic(dtype, n, offset):
    """stream_copy copies every element exactly, whatever dst's alignment, and only dst."""
    import numba

    _jit, _ = _kernels()

    @numba.njit
    def copy(dst, src):
        _jit.stream_copy(dst, src)
        _jit.store_fence()

    src = np.random.default_rng(n).standard_normal(n).astype(dtype)
    store = np.full(n + offset + 2, -1.0, dtype)
    dst = store[offset:offset + n]
    copy(dst, src)
    np.testing.assert_array_equal(dst, src)
    assert (store[:offset] == -1).all() and (store[offset + n:] == -1).all()


def test_stream_copy_misaligned_bytes():
    """A float64 destination that is not 8-byte aligned (a byte view) is copied with plain stores."""
    import numba

    _jit, _ = _kernels()

    @numba.njit
    def copy(dst, src):
        _jit.stream_copy(dst, src)
        _jit.store_fence()

    raw = np.zeros(8 * 200 + 3, np.uint8)
    dst = raw[3:3 + 8 * 200].view(np.float64)
    assert not dst.flags.aligned
    src = np.arange(200, dtype=np.float64)
    copy(dst, src)
    np.testing.assert_array_equal(dst, src)
