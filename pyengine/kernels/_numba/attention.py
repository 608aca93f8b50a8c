"""Numba kernels of the attention score gradient, the advantage and the fused head.

Same kernel contract and parameter names as :mod:`pyengine.kernels._reference.attention`
(C-contiguous float32 or float64 arrays of shape (N, ...), preallocated outputs, the
number of bad rows returned); the formulas are in its docstring. Everything is computed
in float64 and cast to the dtype of the output on the store.

Parallelism: ``prange`` over the (head, query row) pairs for the score gradient and the
forward pass; the backward pass takes the row sums D_i = d_o_i.o_i from the forward
pass's o, then makes a row pass over the (head, query) pairs (dq, the spread) and a
column pass over the (head, key) pairs (dk, dv), each recomputing p and dp: no
reduction across threads, so the results do not depend on the number of threads (the
C++ backend makes one pass, with fixed chunks of keys). The fused head keeps one row (or column)
of scores in a per-iteration scratch of length Tk (Tq) and never stores a (Tq, Tk)
matrix. The inner loops are plain: this backend is the portable fallback, the C++ one
the fast path (tiles of four rows in registers).
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from ...backends import register
from ._jit import jit, pjit

__all__ = ["attention_advantage", "attention_backward", "attention_forward", "attention_score_grad"]

_f64 = np.float64


@jit
def _visible(i, offset, tk):
    """Number of keys visible to query i (j <= i + offset), without overflow."""
    return tk if offset >= tk - i else i + offset + 1


@jit
def _score_grad_row(pr, ur, vh, vis, o, a, b, want_a):
    """One row of dL/ds (and the advantage if want_a); True for a bad row. b : (Tk,) scratch."""
    dv = ur.size
    c = 0.0
    for j in range(vis):
        s = 0.0
        for d in range(dv):
            s += _f64(ur[d]) * _f64(vh[j, d])
        b[j] = s  # b_ij, formed once
        c += _f64(pr[j]) * s
    if not np.isfinite(c):
        for j in range(o.size):
            o[j] = np.nan
            if want_a:
                a[j] = np.nan
        return True
    for j in range(vis):
        o[j] = _f64(pr[j]) * (b[j] - c)
        if want_a:
            a[j] = b[j] - c
    for j in range(vis, o.size):
        o[j] = 0.0
        if want_a:
            a[j] = 0.0
    return False


@pjit
def _score_grad(p, u, v, offset, out, advantage, want_a):
    n, tq, tk = p.shape
    nbad = 0
    for row in prange(n * tq):
        h, i = row // tq, row % tq
        b = np.empty(tk, dtype=np.float64)
        if _score_grad_row(p[h, i], u[h, i], v[h], _visible(i, offset, tk), out[h, i], advantage[h, i], b, want_a):
            nbad += 1
    return nbad


@register("attention_score_grad", "numba")
def attention_score_grad(p, u, v, offset, out):
    """dL/ds = p * (b - sum_j p b), b = u v^T; p, out : (N, Tq, Tk). Returns the bad-row count."""
    return _score_grad(p, u, v, offset, out, out, False)


@register("attention_advantage", "numba")
def attention_advantage(p, u, v, offset, out, advantage):
    """dL/ds into out and the advantage into advantage, in one pass. Returns the bad-row count."""
    return _score_grad(p, u, v, offset, out, advantage, True)


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


def _as64(*arrays):
    """float32 inputs as float64 copies, once per call (O(T d)): the loops then read float64 directly.

    The kernels compute in float64 either way; converting each element inside the O(T² d) loops
    (a float32 load and a cvtss2sd per multiply, which also blocks LLVM's vectorizer) made the
    float32 kernels about 1.3-1.5x slower than the float64 ones.
    """
    return tuple(a if a.dtype == np.float64 else a.astype(np.float64) for a in arrays)


@register("attention_forward", "numba")
def attention_forward(q, k, v, offset, scale, out, lse, entropy):
    """Fused forward: out = softmax(scale q k^T) v, lse and entropy per row. Returns the bad-row count."""
    q, k, v = _as64(q, k, v)
    return attention_forward_kernel(q, k, v, offset, scale, out, lse, entropy)


@pjit
def _backward_delta(o, d_o, delta):
    n, tq, dv = o.shape
    for row in prange(n * tq):
        h, i = row // tq, row % tq
        d = 0.0
        for c in range(dv):
            d += _f64(d_o[h, i, c]) * _f64(o[h, i, c])
        delta[h, i] = d


@pjit
def _backward_rows(q, k, v, d_o, lse, offset, scale, dq, spread, delta):
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
def _backward_columns(q, k, v, d_o, lse, offset, scale, delta, dk_out, dv_out):
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


@register("attention_backward", "numba")
def attention_backward(q, k, v, o, d_o, lse, offset, scale, dq, dk, dv, spread):
    """Fused backward: dq, dk, dv and the spread, p recomputed from lse, D = d_o.o. Returns the bad-row count."""
    q, k, v, o, d_o = _as64(q, k, v, o, d_o)
    delta = np.empty(lse.shape, dtype=np.float64)
    _backward_delta(o, d_o, delta)
    nbad = _backward_rows(q, k, v, d_o, lse, offset, scale, dq, spread, delta)
    colbad = _backward_columns(q, k, v, d_o, lse, offset, scale, delta, dk, dv)
    return nbad if nbad or not colbad else 1
