"""The fused attention head's row-at-a-time Numba kernels, for short sequences.

One query row (forward, backward dq) or key column (backward dk, dv) per ``prange``
iteration, the loops over features innermost: the kernels of
:mod:`pyengine.kernels._numba.attention` before it ran along the token axis, kept for
sequences shorter than ``attention.SHORT`` tokens, where the token-axis kernels' fixed
cost per sum (``LANES`` partial sums to clear and fold) outweighs their vectorized loops
(at (12 heads, 128, 128, 64): forward ~5 ms here against ~15 ms, backward ~20 against
~33 ms). Same contract, float64 arrays; the backward pass makes a row pass and a
column pass, each recomputing p and dp, so no sum crosses threads.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from ._jit import jit, pjit

__all__ = ["attention_forward_kernel", "backward_columns", "backward_rows"]

_f64 = np.float64


@jit
def _visible(i, offset, tk):
    """Number of keys visible to query i (j <= i + offset), without overflow."""
    return tk if offset >= tk - i else i + offset + 1


@pjit
def attention_forward_kernel(q, k, v, offset, scale, out, lse, entropy):
    n, tq, dk = q.shape
    tk, dv = k.shape[1], v.shape[2]
    nbad = 0
    for row in prange(n * tq):
        h, i = row // tq, row % tq
        vis = _visible(i, offset, tk)
        s = np.empty(tk, dtype=np.float64)
        o = np.zeros(dv, dtype=np.float64)
        m = -np.inf
        for j in range(vis):
            acc = 0.0
            for c in range(dk):
                acc += _f64(q[h, i, c]) * _f64(k[h, j, c])
            s[j] = scale * acc
            m = max(m, s[j])
        z = 0.0
        zs = 0.0
        for j in range(vis):
            e = math.exp(s[j] - m)
            z += e
            zs += e * s[j]
            for c in range(dv):
                o[c] += e * _f64(v[h, j, c])
        lv = m + math.log(z)
        lse[h, i] = lv
        entropy[h, i] = lv - zs / z
        bad = not np.isfinite(lv)
        for c in range(dv):
            oc = o[c] / z
            out[h, i, c] = oc
            bad = bad or not np.isfinite(oc)
        if bad:
            nbad += 1
    return nbad


@pjit
def backward_rows(q, k, v, d_o, lse, offset, scale, dq, spread, delta):
    n, tq, dk = q.shape
    tk, dv = k.shape[1], v.shape[2]
    nbad = 0
    for row in prange(n * tq):
        h, i = row // tq, row % tq
        vis = _visible(i, offset, tk)
        d = delta[h, i]
        sp = 0.0
        gq = np.zeros(dk, dtype=np.float64)
        for j in range(vis):
            acc = 0.0
            for c in range(dk):
                acc += _f64(q[h, i, c]) * _f64(k[h, j, c])
            pp = math.exp(min(scale * acc - lse[h, i], 0.0))  # <= 0 up to rounding; clamped so p <= 1
            g = 0.0
            for c in range(dv):
                g += _f64(d_o[h, i, c]) * _f64(v[h, j, c])
            a = g - d
            gs = pp * a
            sp += gs * a
            for c in range(dk):
                gq[c] += gs * _f64(k[h, j, c])
        spread[h, i] = math.sqrt(sp)
        bad = not (np.isfinite(d) and np.isfinite(sp))
        for c in range(dk):
            dq[h, i, c] = scale * gq[c]
            bad = bad or not np.isfinite(gq[c])
        if bad:
            nbad += 1
    return nbad


@pjit
def backward_columns(q, k, v, d_o, lse, offset, scale, delta, dk_out, dv_out):
    n, tq, dk = q.shape
    tk, dv = k.shape[1], v.shape[2]
    nbad = 0
    for col in prange(n * tk):
        h, j = col // tk, col % tk
        i0 = min(tq, max(0, j - offset))  # queries i >= j - offset see key j
        gk = np.zeros(dk, dtype=np.float64)
        gv = np.zeros(dv, dtype=np.float64)
        for i in range(i0, tq):
            acc = 0.0
            for c in range(dk):
                acc += _f64(q[h, i, c]) * _f64(k[h, j, c])
            p = math.exp(min(scale * acc - lse[h, i], 0.0))
            g = 0.0
            for c in range(dv):
                g += _f64(d_o[h, i, c]) * _f64(v[h, j, c])
            gs = p * (g - delta[h, i])
            for c in range(dk):
                gk[c] += gs * _f64(q[h, i, c])
            for c in range(dv):
                gv[c] += p * _f64(d_o[h, i, c])
        bad = False
        for c in range(dk):
            dk_out[h, j, c] = scale * gk[c]
            bad = bad or not np.isfinite(gk[c])
        for c in range(dv):
            dv_out[h, j, c] = gv[c]
            bad = bad or not np.isfinite(gv[c])
        if bad:
            nbad += 1
    return nbad
