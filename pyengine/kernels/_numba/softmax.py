"""Numba kernels of the attention softmax and its JVP.

Same kernel contract and parameter names as :mod:`pyengine.kernels._reference.activations`
(C-contiguous float32 or float64 arrays, preallocated outputs, ``out`` possibly the
input itself, the number of bad rows returned); the formulas are in its docstring.

Every batch kernel runs ``prange`` over chunks of contiguous rows only (``_CHUNKS``, as the
norm kernels), so each row is computed by one thread in an order fixed by the source and
results do not depend on the number of threads. The loops over a row run in whole blocks
of ``LANES`` with a select for what lies past the row's visible keys, not over lengths
known only at run time: on a Zen 4 host LLVM vectorizes those 64 floats at a time and
leaves most of a causal row (a mean of Tk / 2 keys) to the scalar remainder. With both
changes the softmax at (768, 128, 128) float32 ran 15.7-17.6 -> 10.8-12.1 ms (C++
9.0-9.1), its JVP at (64, 12, 128, 128) 6.7 -> 5.4 ms (C++ 3.8), the same values bit for bit.
Everything is computed in float64 and cast to the dtype of the output on the store, except the softmax's exponential of float32 scores, which is
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

import numba
import numpy as np
from numba import prange

from ...backends import register
from ._jit import fma_inline, fma_jit, fma_pjit, inline, pjit
from ._attention_short import _visible
from ._reduce import LANES, _fold, _max_fold, _padded
from ._vecmath import exp_term
from .layernorm import _CHUNKS, _prefetch_row_ahead

__all__ = ["LANES", "softmax", "softmax_jvp"]

_f64 = np.float64


# --------------------------------------------------------------------------- #
# Row reductions in a fixed order: LANES partial results in acc (LANES,).
# --------------------------------------------------------------------------- #


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
    """out[:vis] = softmax of x[:vis], out[vis:] = 0; True for a bad row.

    x : (npad,), vis rounded up to a multiple of LANES (the scores past vis are read and
    ignored); out : (Tk,); e : (Tk + LANES,) float64, the terms. Every pass runs over npad
    in whole blocks of LANES, the keys past vis masked by a select (-inf for the max, 0 for
    the terms): three passes (the max; the terms and their sum; the output), as the C++
    kernel, and no scalar tail. Causal rows are short (a mean of Tk / 2), and loops of
    unknown length leave much of them to the scalar remainder, the more so where LLVM
    vectorizes 64 floats at a time (16 lanes, 4 interleaved; Zen 4). On the Zen 4 host,
    float32 (768, 128, 128) causal, 2 threads: 17.5-17.9 ms with the former five passes (a
    copy into e padded with -inf, the max, the terms, their sum, the output), 13.0 ms
    blocked (C++ 9.3-9.8), before the rows were chunked; the values are the same bit for
    bit (the same terms summed in the same lanes in the same order).
    """
    npad = _padded(vis)
    nb = npad // LANES
    for k in range(LANES):
        acc[k] = -np.inf
    for b in range(nb):
        o = b * LANES
        for k in range(LANES):
            j = o + k
            v = _f64(x[j]) if j < vis else -np.inf
            acc[k] = v if v > acc[k] else acc[k]  # NaN never wins, as in _max_lanes
    m = _max_fold(acc)
    for k in range(LANES):
        acc[k] = 0.0
    for b in range(nb):
        o = b * LANES
        for k in range(LANES):
            j = o + k
            term = exp_term(x[j], m)  # float32 x: the float32 exp
            t = term if j < vis else 0.0
            e[j] = t
            acc[k] += t
    # NaN or +inf among x[:vis], or all of it -inf, make s NaN; a good row has s >= 1.
    s = _fold(acc)
    if not s >= 1.0:
        for j in range(out.size):
            out[j] = np.nan
        return True
    inv = 1.0 / s
    n = out.size
    nw = min(npad, n) // LANES  # e is 0 past vis: out[vis:npad] = 0
    for b in range(nw):
        o = b * LANES
        for k in range(LANES):
            out[o + k] = e[o + k] * inv
    for j in range(nw * LANES, vis):
        out[j] = e[j] * inv
    w = max(nw * LANES, vis)
    nz = (n - w) // LANES
    for b in range(nz):
        o = w + b * LANES
        for k in range(LANES):
            out[o + k] = 0.0
    for j in range(w + nz * LANES, n):
        out[j] = 0.0
    return False


@register("softmax", "numba")
def softmax(x, offset, out):
    """x, out : (N, Tq, Tk); keys j <= i + offset visible. Returns the number of bad rows.

    :func:`_softmax_row` reads a row's visible scores rounded up to LANES, which for Tk
    not a multiple of LANES runs into the next row (ignored there). Every row whose
    reach stays inside x is read in place (:func:`_softmax_rows`); the last few, whose
    reach would leave x, through a staging copy (:func:`_softmax_staged`). Two kernels,
    so that each inlines the row's exponential once (two inlined copies in one function
    trip Numba's SSA check, NumbaIRAssumptionWarning).
    """
    n, tq, tk = x.shape
    rows = n * tq
    over = -tk % LANES  # how far a full row's reach runs past its end (0 also for Tk = 0)
    inside = rows if over == 0 else max(0, rows - (over + tk - 1) // tk)  # r * tk + tk + over <= rows * tk
    nbad = _softmax_rows(x, offset, out, inside)
    if inside < rows:
        nbad += _softmax_staged(x, offset, out, inside)
    return nbad


@fma_pjit
def _softmax_rows(x, offset, out, stop):
    """:func:`softmax` of rows 0 .. stop - 1 (N * Tq rows), each read from x flattened, in
    ``_CHUNKS`` chunks of contiguous rows as the norm kernels (a prange over rows: 5-10 %
    slower on the Zen 4 host)."""
    n, tq, tk = x.shape
    xf = x.reshape(n * tq * tk)
    out2 = out.reshape((n * tq, tk))
    outf = out.reshape(n * tq * tk)
    nbad = 0
    nc = min(stop, _CHUNKS)
    for c in prange(nc):
        e = np.empty(tk + LANES, dtype=np.float64)  # hoisted: once per thread
        acc = np.empty(LANES, dtype=np.float64)
        for row in range(c * stop // nc, (c + 1) * stop // nc):
            _prefetch_row_ahead(outf, row * tk, tk)
            vis = _visible(row % tq, offset, tk)
            o = row * tk
            if _softmax_row(xf[o:o + _padded(vis)], vis, out2[row], e, acc):
                nbad += 1
    return nbad


@fma_jit
def _softmax_staged(x, offset, out, start):
    """:func:`softmax` of rows start .. N * Tq - 1, each copied into a row of padded length."""
    n, tq, tk = x.shape
    x2 = x.reshape((n * tq, tk))
    out2 = out.reshape((n * tq, tk))
    e = np.empty(tk + LANES, dtype=np.float64)
    xs = np.zeros(tk + LANES, dtype=x.dtype)
    acc = np.empty(LANES, dtype=np.float64)
    nbad = 0
    for row in range(start, n * tq):
        vis = _visible(row % tq, offset, tk)
        xr = x2[row]
        for j in range(vis):
            xs[j] = xr[j]
        if _softmax_row(xs, vis, out2[row], e, acc):
            nbad += 1
    return nbad


if numba.config.DISABLE_JIT:  # pragma: no cover - the NUMBA_DISABLE_JIT=1 runs
    # As Python the masked keys' terms warn (e^(garbage - m)); the errstate wrapper of pjit.
    _softmax_staged = pjit(_softmax_staged)


@inline
def _softmax_jvp_row(p, dx, out, acc):
    dot = _dot(p, dx, acc)
    if not np.isfinite(dot):
        for j in range(out.size):
            out[j] = np.nan
        return True
    n = out.size
    nb = n // LANES  # whole blocks, then the tail: see _softmax_row
    for b in range(nb):
        o = b * LANES
        for k in range(LANES):
            out[o + k] = _f64(p[o + k]) * (_f64(dx[o + k]) - dot)
    for j in range(nb * LANES, n):
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
    rows = r * prow
    nc = min(rows, _CHUNKS)
    for c in prange(nc):
        acc = np.empty(LANES, dtype=np.float64)  # hoisted: once per thread
        for row in range(c * rows // nc, (c + 1) * rows // nc):
            _prefetch_row_ahead(outf, row * tk, tk)
            if _softmax_jvp_row(p2[row % prow], dx2[row], out2[row], acc):
                nbad += 1
    return nbad
