"""Numba dense-layer kernels (``linear``, ``linear_act``, ``linear_mul``); the contract is the
reference's (:mod:`pyengine.kernels._reference.linear`).

From 256 rows on, the rows are cut into the tiles of the C++ kernels (``csrc/linear.hpp``:
full-width row tiles of at most 2048 rows, a multiple of the thread count of them for a large
product, about 8 otherwise; see :func:`row_tiles`): ``prange`` over the tiles, each an
``np.dot`` into the destination (SciPy's BLAS, single-threaded in each Numba thread under
:func:`~pyengine.backends.one_blas_thread`) followed at once by its epilogue (bias, residual,
activation or coefficient, the bad-row count) while the tile is warm.
Measured at 2048 x 768 @ 768 x 3072 float32 with gelu_tanh: one threaded ``np.matmul``
then a ``prange`` epilogue took 67 ms against 29 + 10 ms for the two alone, because
OpenBLAS's threads still spin after the product and the epilogue's threads wait for the
cores. Fewer rows: one ``np.matmul`` (NumPy's threaded BLAS) and the epilogue pass. The
activation cores are those of :mod:`._vecmath` that the Numba activation kernels use, so
the results equal theirs element for element.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ...backends import one_blas_thread, register
from ._jit import fma_inline, fma_pjit
from ._vecmath import _nonfinite, _relu1, gelu_t, gelu_tanh_t

__all__ = ["linear", "linear_act", "linear_mul"]

_CODES = {"none": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}


@fma_inline
def _act_row(pr, o, act, coef, has_coef, i):
    """o = act(pr), or pr * coef[i], or pr (act 0)."""
    n = pr.shape[0]
    if has_coef:
        c = coef[i % coef.shape[0]]
        for j in range(n):
            o[j] = pr[j] * c[j]
    elif act == 1:
        for j in range(n):
            o[j] = gelu_t(pr[j])
    elif act == 2:
        for j in range(n):
            o[j] = gelu_tanh_t(pr[j])
    elif act == 3:
        for j in range(n):
            o[j] = _relu1(pr[j])
    else:
        for j in range(n):
            o[j] = pr[j]


@fma_inline
def _rows(p, b, has_b, r, has_r, act, coef, has_coef, out, copy, r0, r1, buf):
    """Rows r0..r1 of the epilogue: p += b, then p += r; out = act(p), p * coef, or p; the number
    of rows of p with NaN/Inf. ``copy``: out is not p; buf: a row of scratch. One loop per
    case, so each vectorizes."""
    nbad = 0
    n = p.shape[1]
    for i in range(r0, r1):
        pr, o = p[i], out[i]
        if has_b:
            for j in range(n):
                pr[j] += b[j]
        if has_r:
            ri = r[i]
            for j in range(n):
                pr[j] += ri[j]
        bad = False
        for j in range(n):
            bad |= _nonfinite(pr[j])
        nbad += 1 if bad else 0
        if copy or act != 0 or has_coef:
            # In place, the row goes through buf: LLVM's overlap check of o against the same row
            # fails and leaves the loop scalar (measured: gelu_tanh 5x slower).
            src = pr
            if not copy:
                for j in range(n):
                    buf[j] = pr[j]
                src = buf
            _act_row(src, o, act, coef, has_coef, i)
    return nbad


@fma_pjit
def _epilogue(p, b, has_b, r, has_r, act, coef, has_coef, out, copy):
    """The epilogue of :func:`_rows` over all rows of p (a product already made), in parallel."""
    nbad = 0
    for i in prange(p.shape[0]):
        buf = np.empty(p.shape[1], dtype=p.dtype)  # hoisted: once per thread
        nbad += _rows(p, b, has_b, r, has_r, act, coef, has_coef, out, copy, i, i + 1, buf)
    return nbad


@fma_pjit
def _tiled(x, w, p, b, has_b, r, has_r, act, coef, has_coef, out, copy, bounds):
    """p = x @ w tile by tile (rows bounds[t]:bounds[t + 1]), each tile's epilogue right after its product."""
    nbad = 0
    for t in prange(bounds.shape[0] - 1):
        buf = np.empty(p.shape[1], dtype=p.dtype)  # hoisted: once per thread
        r0 = bounds[t]
        r1 = bounds[t + 1]
        np.dot(x[r0:r1], w, p[r0:r1])
        nbad += _rows(p, b, has_b, r, has_r, act, coef, has_coef, out, copy, r0, r1, buf)
    return nbad


#: k * n from which a product is large: its row tiles may follow the thread count (csrc/linear.hpp).
ROW_INVARIANT_WORK = 1 << 18


def row_tiles(N: int, k: int, n: int, threads: int) -> np.ndarray | None:
    """Row tile bounds (tiles + 1,) of an (N, k) @ (k, n) product, or None for one threaded matmul:
    csrc/linear.hpp's row tiling. A large product (k * n >= 2^18) takes a multiple of the thread
    count (at most 8) of tiles of at most 2048 rows, spread evenly at multiples of 16 rows (a
    row's rounding does not depend on its tile there, so the results do not depend on the thread
    count); others about 8 tiles, by the shape alone."""
    if N < 256:
        return None
    if k * n >= ROW_INVARIANT_WORK:
        t = min(max(int(threads), 1), 8)
        tiles = t * -(-N // (2048 * t))
        bounds = np.arange(tiles + 1, dtype=np.int64) * N // tiles // 16 * 16
    else:
        per = -(-N // 8)  # ceil(N / 8), rounded up to a multiple of 16
        rows = min(2048, max(16, -(-per // 16) * 16))
        bounds = np.minimum(np.arange(-(-N // rows) + 1, dtype=np.int64) * rows, N)
    bounds[-1] = N
    return bounds


def _dummy(x: np.ndarray) -> np.ndarray:
    return np.empty((1, 1), x.dtype)


def _product(x, w, p, b, r, act, coef, out) -> int:
    """p = x @ w, then the epilogue into out; the rows of the result with NaN/Inf."""
    d = _dummy(p)
    args = (d[0] if b is None else b, b is not None, d if r is None else r, r is not None, act,
            d if coef is None else coef, coef is not None, out, p is not out)
    bounds = row_tiles(x.shape[0], x.shape[1], w.shape[1], numba.get_num_threads())
    if bounds is not None:
        with one_blas_thread():
            return int(_tiled(x, w, p, *args, bounds))
    np.matmul(x, w, out=p)
    return int(_epilogue(p, *args))


@register("linear", "numba")
def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, r: np.ndarray | None, out: np.ndarray) -> int:
    """out = x @ w (+ b) (+ r); the rows of the result with NaN/Inf."""
    p = np.empty_like(out) if r is out else out
    return _product(x, w, p, b, r, 0, None, out)


@register("linear_act", "numba")
def linear_act(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, activation: str, u: np.ndarray | None,
               out: np.ndarray) -> int:
    """u = x @ w (+ b) (kept in u unless None), out = activation(u); the rows of u with NaN/Inf."""
    if activation not in _CODES:
        raise ValueError(f"activation must be one of {', '.join(map(repr, _CODES))}, got {activation!r}")
    return _product(x, w, out if u is None else u, b, None, _CODES[activation], None, out)


@register("linear_mul", "numba")
def linear_mul(x: np.ndarray, w: np.ndarray, coef: np.ndarray, out: np.ndarray) -> int:
    """out = (x @ w) * coef; the rows of x @ w with NaN/Inf."""
    return _product(x, w, out, None, None, 0, coef, out)
