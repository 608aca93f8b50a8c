"""Numba kernels of the attention softmax and its JVP.

Same kernel contract and parameter names as :mod:`pyengine.kernels._reference.activations`
(C-contiguous float32 or float64 arrays, preallocated outputs, ``out`` possibly the
input itself, the number of bad rows returned); the formulas are in its docstring.

Every batch kernel runs ``prange`` over rows only, so each row is computed by one
thread in an order fixed by the source and results do not depend on the number of
threads. Everything is computed in float64 and cast to the dtype of the output on
the store, except the softmax's exponential of float32 scores, which is
:func:`._vecmath._exp_neg_f` (float32, vectorizable; :func:`._vecmath._exp_neg` for float64). Without
``reassoc`` LLVM keeps float sums in source order, so the reductions (the softmax's
max and sum, the JVP's dot product) use ``LANES`` partial results in a scratch
array, as :mod:`pyengine.kernels._numba.layernorm` does. Numba options: :mod:`._jit`
(the softmax ``fma_inline`` / ``fma_pjit``; the JVP has no polynomial, so plain ``inline`` /
``pjit``, with its products and sums rounded as written). The row helpers are inlined: a
row of Tk = 128 costs about as much as a call with its array arguments (the JVP at
(16, 64, 128, 128) float32 took 12.8 ms with the calls, 9.1-9.3 without; C++ 7.0).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ...backends import register
from ._jit import fma_inline, fma_pjit, inline, pjit
from ._reduce import LANES, _fold, _max_lanes
from ._vecmath import exp_term
from .layernorm import _prefetch_row_ahead

__all__ = ["LANES", "softmax", "softmax_jvp"]

_f64 = np.float64


# --------------------------------------------------------------------------- #
# Row reductions in a fixed order: LANES partial results in acc (LANES,).
# --------------------------------------------------------------------------- #


@fma_inline
def _sum(e, n, acc):
    """sum(e[:n]) of a float64 row."""
    for k in range(LANES):
        acc[k] = 0.0
    nb = n // LANES
    for b in range(nb):
        o = b * LANES
        for k in range(LANES):
            acc[k] += e[o + k]
    s = _fold(acc)
    for i in range(nb * LANES, n):
        s += e[i]
    return s


@inline
def _dot(p, dx, acc):
    """sum(p * dx) in float64. p, dx : (d,)."""
    d = p.size
    for k in range(LANES):
        acc[k] = 0.0
    nb = d // LANES
    for b in range(nb):
        o = b * LANES
        for k in range(LANES):
            acc[k] += _f64(p[o + k]) * _f64(dx[o + k])
    s = _fold(acc)
    for i in range(nb * LANES, d):
        s += _f64(p[i]) * _f64(dx[i])
    return s


# --------------------------------------------------------------------------- #
# Softmax and its JVP
# --------------------------------------------------------------------------- #


@fma_inline
def _softmax_row(x, vis, out, e, acc):
    """out[:vis] = softmax of x[:vis], out[vis:] = 0; True for a bad row. e : (Tk + LANES,) float64.

    The max and the sum run over vis rounded up to a multiple of LANES (e padded with -inf,
    then 0), so they have no scalar tail: causal rows are short (a mean of Tk / 2), and the
    tail loops had left the shorter half of them scalar (float32 (192, 128, 128) 4.2 -> 2.9 ms).
    """
    npad = (vis + LANES - 1) // LANES * LANES
    for j in range(vis):
        e[j] = _f64(x[j])
    for j in range(vis, npad):
        e[j] = -np.inf
    m = _max_lanes(e, npad, acc)
    for j in range(vis):
        e[j] = exp_term(x[j], m)  # float32 x: the float32 exp
    for j in range(vis, npad):
        e[j] = 0.0
    # NaN or +inf among x[:vis], or all of it -inf, make s NaN; a good row has s >= 1.
    s = _sum(e, npad, acc)
    if not s >= 1.0:
        for j in range(out.size):
            out[j] = np.nan
        return True
    inv = 1.0 / s
    for j in range(vis):
        out[j] = e[j] * inv
    for j in range(vis, out.size):
        out[j] = 0.0
    return False


@register("softmax", "numba")
@fma_pjit
def softmax(x, offset, out):
    """x, out : (N, Tq, Tk); keys j <= i + offset visible. Returns the number of bad rows."""
    n, tq, tk = x.shape
    x2 = x.reshape((n * tq, tk))
    out2 = out.reshape((n * tq, tk))
    outf = out.reshape(n * tq * tk)
    nbad = 0
    for row in prange(n * tq):
        e = np.empty(tk + LANES, dtype=np.float64)  # hoisted: once per thread
        acc = np.empty(LANES, dtype=np.float64)
        _prefetch_row_ahead(outf, row * tk, tk)
        i = row % tq
        vis = tk if offset >= tk - i else i + offset + 1
        if _softmax_row(x2[row], vis, out2[row], e, acc):
            nbad += 1
    return nbad


@inline
def _softmax_jvp_row(p, dx, out, acc):
    dot = _dot(p, dx, acc)
    if not np.isfinite(dot):
        for j in range(out.size):
            out[j] = np.nan
        return True
    for j in range(out.size):
        out[j] = _f64(p[j]) * (_f64(dx[j]) - dot)
    return False


@register("softmax_jvp", "numba")
@pjit
def softmax_jvp(p, dx, out):
    """p : (M, Tq, Tk); dx, out : (R, M, Tq, Tk). Returns the number of bad rows."""
    r, m, tq, tk = dx.shape
    prow = m * tq
    p2 = p.reshape((prow, tk))
    dx2 = dx.reshape((r * prow, tk))
    out2 = out.reshape((r * prow, tk))
    outf = out.reshape(r * prow * tk)
    nbad = 0
    for row in prange(r * prow):
        acc = np.empty(LANES, dtype=np.float64)  # hoisted: once per thread
        _prefetch_row_ahead(outf, row * tk, tk)
        if _softmax_jvp_row(p2[row % prow], dx2[row], out2[row], acc):
            nbad += 1
    return nbad
