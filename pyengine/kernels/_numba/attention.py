"""Numba kernels of the attention score gradient, the advantage and the fused head.

Every head but the tiny narrow ones (see ``_attention_blas.serves``) goes to the BLAS
kernels of :mod:`._attention_blas`; the kernels below serve the rest (widths below 16 and
fewer than about 128 x 128 pairs) and, with :data:`BLAS` off, everything.

Same kernel contract and parameter names as :mod:`pyengine.kernels._reference.attention`
(C-contiguous float32 or float64 arrays of shape (N, ...), preallocated outputs, the
number of bad rows returned); the formulas are in its docstring. Everything is computed
in float64 and cast to the dtype of the output on the store.

Parallelism: ``prange`` over the (head, query row) pairs for the score gradient and the
forward pass; the backward pass takes the row sums D_i = d_o_i.o_i from the forward
pass's o, then makes one pass over the visible pairs, key-major, as the C++ backend
does: ``prange`` over (head, chunk of keys), the chunks (at most ``CHUNKS``, of about
equal work) fixed by the shape alone; a chunk computes dk, dv of its keys whole and adds
its share of dq and of the spread into its own partial, and the partials are summed in
chunk order afterwards, so the results do not depend on the number of threads. The
fused head keeps one row (or column) of scores in a per-iteration scratch of length Tk
(Tq) and never stores a (Tq, Tk) matrix (the backward pass's partials are O(chunks Tq
dk)). Its loops run along the token axis on padded transposes of the keys and values
(of the queries and d_o in the backward pass), so they are elementwise and vectorize;
sums over tokens are kept in ``LANES`` partial sums in a fixed order and e^x is the
branch-free ``_vecmath._exp_neg`` (see the comment above ``_dot_lanes``). The C++
backend is still the fast path (tiles of four rows in registers). Numba's disk cache
does not see edits to ``_reduce`` / ``_vecmath``: delete ``kernels/_numba/__pycache__``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from ...backends import one_blas_thread, register
from . import _attention_blas as _blas
from . import _attention_short as _short
from ._attention_short import _visible
from ._jit import jit, pjit
from ._reduce import LANES, _dot_lanes, _padded, _sum_lanes
from ._vecmath import _exp_neg

__all__ = ["attention_advantage", "attention_backward", "attention_forward", "attention_score_grad"]

_f64 = np.float64


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


#: The BLAS kernels of :mod:`._attention_blas` serve the shapes their ``serves`` accepts;
#: False forces the row kernels of this module everywhere (the tests run both).
BLAS = True


def _score_grad_any(p, u, v, offset, out, advantage, want_a):
    tq, tk = p.shape[1:]
    if BLAS and _blas.serves(tq, tk, u.shape[2], u.shape[2]):
        with one_blas_thread():
            return _blas.score_grad(p, u, v, offset, out, advantage, want_a)
    return _score_grad(p, u, v, offset, out, advantage, want_a)


@register("attention_score_grad", "numba")
def attention_score_grad(p, u, v, offset, out):
    """dL/ds = p * (b - sum_j p b), b = u v^T; p, out : (N, Tq, Tk). Returns the bad-row count."""
    return _score_grad_any(p, u, v, offset, out, out, False)


@register("attention_advantage", "numba")
def attention_advantage(p, u, v, offset, out, advantage):
    """dL/ds into out and the advantage into advantage, in one pass. Returns the bad-row count."""
    return _score_grad_any(p, u, v, offset, out, advantage, True)


@pjit
def attention_forward_kernel(q, kt, vt, offset, scale, out, lse, entropy):
    """The forward pass on the padded transposes kt (n, dk, tk + LANES), vt (n, dv, tk + LANES)."""
    n, tq, dk = q.shape
    tk, dv = kt.shape[2] - LANES, vt.shape[1]
    nbad = 0
    for row in prange(n * tq):
        h, i = row // tq, row % tq
        s = np.empty(tk + LANES, dtype=np.float64)  # hoisted by the parfor pass: once per thread
        e = np.empty(tk + LANES, dtype=np.float64)
        acc = np.empty(LANES, dtype=np.float64)
        vis = _visible(i, offset, tk)
        npad = _padded(vis)
        for j in range(npad):
            s[j] = 0.0
            e[j] = 0.0
        _accumulate(s, q[h, i], kt[h], vis)
        m = -np.inf
        for j in range(vis):
            s[j] *= scale
            m = max(m, s[j])
        for j in range(vis):
            e[j] = _exp_neg(s[j] - m)
        z = _sum_lanes(e, npad, acc)
        zs = _dot_lanes(e, s, npad, acc)
        lv = m + math.log(z)
        lse[h, i] = lv
        entropy[h, i] = lv - zs / z
        bad = not np.isfinite(lv)
        for c in range(dv):
            oc = _dot_lanes(e, vt[h, c], npad, acc) / z
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
    if BLAS and _blas.serves(q.shape[1], k.shape[1], q.shape[2], v.shape[2]):
        with one_blas_thread():
            return _blas.forward(q, k, v, offset, scale, out, lse, entropy)
    q, k, v = _as64(q, k, v)
    if k.shape[1] < SHORT:
        return _short.attention_forward_kernel(q, k, v, offset, scale, out, lse, entropy)
    return attention_forward_kernel(q, _transposed(k), _transposed(v), offset, scale, out, lse, entropy)


@pjit
def _backward_delta(o, d_o, delta):
    n, tq, dv = o.shape
    for row in prange(n * tq):
        h, i = row // tq, row % tq
        d = 0.0
        for c in range(dv):
            d += _f64(d_o[h, i, c]) * _f64(o[h, i, c])
        delta[h, i] = d


# The backward pass, vectorized along the token axis: the kernels read transposed,
# zero-padded copies (features, tokens + LANES) of k, v (the forward pass) and of q, d_o (the
# backward pass), so a row of scores is a loop of elementwise multiply-adds over tokens
# (s_j += q_c kT[c, j]), p comes from the branch-free _exp_neg (libm's exp stays scalar),
# and every sum over tokens is _dot_lanes: LANES partial sums in a fixed order, over a
# length rounded up to a multiple of LANES (the scratch and the copies are 0 there), so
# there is no scalar tail. The order of every addition is fixed by the source: the results
# do not depend on the machine or the number of threads.


@jit
def _accumulate(s, w, bt, n):
    """s[x] += sum_c w[c] bt[c, x] for x < n, two features per pass over s (c in order)."""
    m = w.size
    for c in range(0, m - 1, 2):
        w0, w1 = w[c], w[c + 1]
        b0, b1 = bt[c], bt[c + 1]
        for x in range(n):
            s[x] += w0 * b0[x] + w1 * b1[x]
    if m % 2:
        w0 = w[m - 1]
        b0 = bt[m - 1]
        for x in range(n):
            s[x] += w0 * b0[x]


@pjit
def _backward_chunks(k, v, qt, gt, lse, offset, scale, delta, bounds, dk_out, dv_out, part):
    """One pass over the visible pairs, key-major: per chunk of keys (bounds, fixed by the
    shape), dk and dv of its keys whole, and its share of dq^T and of the spread into its
    own partial part[h, chunk] (dk + 1, tq + LANES), from the chunk's first query on."""
    n, tk, dk = k.shape
    dv = v.shape[2]
    tq = qt.shape[2] - LANES
    nch = bounds.size - 1
    nbad = 0
    for job in prange(n * nch):
        h, ch = job // nch, job % nch
        s = np.empty(tq + LANES, dtype=np.float64)  # hoisted: once per thread
        a = np.empty(tq + LANES, dtype=np.float64)
        pv = np.empty(tq + LANES, dtype=np.float64)
        acc = np.empty(LANES, dtype=np.float64)
        pq = part[h, ch]
        f0 = min(tq, max(0, bounds[ch] - offset))
        for c in range(dk + 1):
            row = pq[c]
            for x in range(f0, tq):
                row[x] = 0.0
        for j in range(bounds[ch], bounds[ch + 1]):
            i0 = min(tq, max(0, j - offset))  # queries i >= j - offset see key j
            cnt = tq - i0
            npad = _padded(cnt)
            for x in range(npad):
                s[x] = 0.0
                a[x] = 0.0
                pv[x] = 0.0
            _accumulate(s, k[h, j], qt[h, :, i0:], cnt)
            _accumulate(a, v[h, j], gt[h, :, i0:], cnt)
            lh = lse[h, i0:]
            dh = delta[h, i0:]
            for x in range(cnt):
                p = _exp_neg(min(scale * s[x] - lh[x], 0.0))
                ad = a[x] - dh[x]  # the advantage
                g = p * ad
                s[x] = g
                a[x] = g * ad  # the spread's term
                pv[x] = p
            bad = False
            for c in range(dk):
                gk = _dot_lanes(s, qt[h, c, i0:], npad, acc)
                dk_out[h, j, c] = scale * gk
                bad = bad or not np.isfinite(gk)
            for c in range(dv):
                gv = _dot_lanes(pv, gt[h, c, i0:], npad, acc)
                dv_out[h, j, c] = gv
                bad = bad or not np.isfinite(gv)
            if bad:
                nbad += 1
            for c in range(dk):
                kc = k[h, j, c]
                row = pq[c, i0:]
                for x in range(cnt):
                    row[x] += s[x] * kc
            row = pq[dk, i0:]
            for x in range(cnt):
                row[x] += a[x]
    return nbad


@pjit
def _backward_gather(part, bounds, offset, scale, delta, dq, spread):
    """dq and the spread of each query: the chunks' partials summed in chunk order."""
    n, tq, dk = dq.shape
    nch = bounds.size - 1
    nbad = 0
    for row in prange(n * tq):
        h, i = row // tq, row % tq
        bad = not np.isfinite(delta[h, i])
        for c in range(dk + 1):
            t = 0.0
            for ch in range(nch):
                if min(tq, max(0, bounds[ch] - offset)) > i:
                    break  # this chunk's keys (and every later chunk's) are not visible to i
                t += part[h, ch, c, i]
            bad = bad or not np.isfinite(t)
            if c < dk:
                dq[h, i, c] = scale * t
            else:
                spread[h, i] = math.sqrt(t)
        if bad:
            nbad += 1
    return nbad


#: Below this many tokens on the axis of their sums (keys in the forward pass, queries in
#: the backward pass) the kernels are the row-at-a-time ones of :mod:`._attention_short`:
#: the token-axis kernels' fixed cost per sum (clearing and folding LANES partial sums)
#: outweighs their vectorized loops there (measured: 3x slower forward at T = 128, d = 64;
#: faster from T = 512 on, 3.3x in the backward pass at T = 2000, d = 10).
SHORT = 4 * LANES

#: Chunks of keys of the backward pass (of about equal work, fixed by the shape alone).
CHUNKS = 16


def _chunk_bounds(tq, tk, offset):
    """Key bounds of at most CHUNKS contiguous chunks of about equal work (visible queries + 1 per key)."""
    j = np.arange(tk)
    work = np.cumsum(tq - np.minimum(tq, np.maximum(0, j - offset)) + 1.0)
    nch = min(tk, CHUNKS)
    cuts = np.searchsorted(work, work[-1] * np.arange(1, nch) / nch, side="left") + 1
    return np.unique(np.concatenate(([0], np.minimum(cuts, tk), [tk]))).astype(np.int64)


def _transposed(x):
    """x (n, t, d) as float64 (n, d, t + LANES), zero past t: the backward pass's padded copies."""
    out = np.zeros((x.shape[0], x.shape[2], x.shape[1] + LANES))
    out[:, :, : x.shape[1]] = x.transpose(0, 2, 1)
    return out


def _blas_backward(q, k, v, o, d_o, lse, offset, scale, dq, dk, dv, spread):
    """The BLAS backward pass: chunks of query blocks, their dk, dv partials summed in chunk order."""
    n, tq, tk = q.shape[0], q.shape[1], k.shape[1]
    bounds = _blas.chunk_bounds(n, tq, tk, offset)
    nch = bounds.size - 1
    if nch == 1:
        pk, pv = dk, dv
    else:
        pk, pv = np.empty((n * nch,) + dk.shape[1:], dk.dtype), np.empty((n * nch,) + dv.shape[1:], dv.dtype)
    with one_blas_thread():
        nbad = _blas.backward(q, k, v, o, d_o, lse, offset, scale, dq, pk, pv, spread, bounds)
    if nch > 1 and _blas.gather(pk, nch, dk) + _blas.gather(pv, nch, dv) and not nbad:
        nbad = 1
    return nbad


@register("attention_backward", "numba")
def attention_backward(q, k, v, o, d_o, lse, offset, scale, dq, dk, dv, spread):
    """Fused backward: dq, dk, dv and the spread, p recomputed from lse, D = d_o.o. Returns the bad-row count."""
    if BLAS and _blas.serves(q.shape[1], k.shape[1], q.shape[2], v.shape[2]):
        return _blas_backward(q, k, v, o, d_o, lse, offset, scale, dq, dk, dv, spread)
    q, k, v, o, d_o = _as64(q, k, v, o, d_o)
    delta = np.empty(lse.shape, dtype=np.float64)
    _backward_delta(o, d_o, delta)
    n, tq = lse.shape
    if tq < SHORT:  # the backward pass's sums run over queries
        nbad = _short.backward_rows(q, k, v, d_o, lse, offset, scale, dq, spread, delta)
        colbad = _short.backward_columns(q, k, v, d_o, lse, offset, scale, delta, dk, dv)
        return nbad if nbad or not colbad else 1
    bounds = _chunk_bounds(tq, k.shape[1], offset)
    part = np.empty((n, bounds.size - 1, q.shape[2] + 1, tq + LANES))
    colbad = _backward_chunks(k, v, _transposed(q), _transposed(d_o), lse, offset, scale, delta, bounds, dk, dv,
                              part)
    nbad = _backward_gather(part, bounds, offset, scale, delta, dq, spread)
    return nbad if nbad or not colbad else 1
