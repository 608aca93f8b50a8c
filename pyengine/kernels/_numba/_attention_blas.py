"""Numba attention kernels on head-sized problems as BLAS products, as ``csrc/attention_blas.hpp``.

The per-head products (b = u vᵀ; s = q kᵀ and o = p v in the forward pass; s, dp = d_o vᵀ,
dv = pᵀ d_o, dq = g k and dk = gᵀ q in the backward pass) are ``np.dot`` calls, which Numba
sends to SciPy's BLAS (``scipy.linalg.cython_blas``); the row epilogues run on a block of
:data:`ROWS` query rows while it is in cache. The caller holds
:func:`pyengine.backends.one_blas_thread`, so each Numba thread's products run
single-threaded (as the C++ kernels' ``openblas_set_num_threads_local(1)``). The kernel
contracts are those of :mod:`pyengine.kernels._reference.attention`; :func:`serves` is the
C++ backend's rule (widths >= 16; the backward pass, one head per thread, needs >= 4 heads
or short heads), and the row-at-a-time kernels of :mod:`.attention` serve the rest.

Causal masks: a block's products stop at the last key its last row sees (``nmax``), and the
masked entries inside a block are written as 0 before they enter a product. Precision:
the score gradient forms b in float64 for both dtypes (a block's u and v copied to
float64), the forward and backward products run in the input's dtype, and the row sums,
lse, entropy, D_i = d_o_i . o_i and the spread are float64 sums in LANES partial sums
(:func:`._reduce._dot_lanes`). Which product computes a number depends on
the shape alone: the results do not depend on the number of threads.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.linalg  # noqa: F401  (np.dot's BLAS: loaded before one_blas_thread() limits it)
from numba import prange

from ._attention_short import _visible
from ._jit import pjit
from ._reduce import LANES, _dot_lanes, _padded, _sum_lanes
from ._vecmath import _exp_neg

__all__ = ["ROWS", "backward", "forward", "score_grad", "serves"]

#: Query rows per block (csrc/attention_blas.hpp's kRows).
ROWS = 32

_f64 = np.float64


def serves(n: int, tq: int, tk: int, d1: int, d2: int, per_head: bool) -> bool:
    """Whether these kernels take n heads of tq x tk with widths (d1, d2): the shape alone decides."""
    if tq <= 0 or tk <= 0 or min(d1, d2) < 16:
        return False
    return not per_head or n >= 4 or tq * tk <= 256 * 256


@pjit
def score_grad(p, u, v, offset, out, advantage, want_a):
    """dL/ds (and the advantage) with b = u vᵀ formed in float64. Returns the bad-row count."""
    n, tq, tk = p.shape
    dv = u.shape[2]
    blocks = (tq + ROWS - 1) // ROWS
    nbad = 0
    for task in prange(n * blocks):
        buf = np.empty(ROWS * tk, dtype=np.float64)  # hoisted: once per thread
        ubuf = np.empty(ROWS * dv, dtype=np.float64)  # u and v of the block, as float64
        vbuf = np.empty(tk * dv, dtype=np.float64)
        pb = np.empty(tk, dtype=np.float64)
        acc = np.empty(LANES, dtype=np.float64)
        h, i0 = task // blocks, (task % blocks) * ROWS
        rows = min(ROWS, tq - i0)
        nmax = _visible(i0 + rows - 1, offset, tk)
        b = buf[: rows * nmax].reshape((rows, nmax))
        ub = ubuf[: rows * dv].reshape((rows, dv))
        vb = vbuf[: nmax * dv].reshape((nmax, dv))
        for r in range(rows):
            for c in range(dv):
                ub[r, c] = u[h, i0 + r, c]
        for j in range(nmax):
            for c in range(dv):
                vb[j, c] = v[h, j, c]
        np.dot(ub, vb.T, b)
        for r in range(rows):
            i = i0 + r
            vis = _visible(i, offset, tk)
            pr, br, o, a = p[h, i], b[r], out[h, i], advantage[h, i]
            for j in range(vis):
                pb[j] = _f64(pr[j])
            body = vis - vis % LANES  # LANES partial sums, then the tail in order
            c = _dot_lanes(pb, br, body, acc)
            for j in range(body, vis):
                c += pb[j] * br[j]
            if not np.isfinite(c):
                nbad += 1
                for j in range(tk):
                    o[j] = np.nan
                    if want_a:
                        a[j] = np.nan
                continue
            for j in range(vis):
                o[j] = pb[j] * (br[j] - c)
            for j in range(vis, tk):
                o[j] = 0.0
            if want_a:
                for j in range(vis):
                    a[j] = br[j] - c
                for j in range(vis, tk):
                    a[j] = 0.0
    return nbad


@pjit
def forward(q, k, v, offset, scale, out, lse, entropy):
    """out = softmax(scale q kᵀ, masked) v with lse and entropy per row. Returns the bad-row count."""
    n, tq, _ = q.shape
    tk, dv = k.shape[1], v.shape[2]
    blocks = (tq + ROWS - 1) // ROWS
    nbad = 0
    for task in prange(n * blocks):
        sbuf = np.empty(ROWS * tk, dtype=q.dtype)  # hoisted: once per thread
        obuf = np.empty(ROWS * dv, dtype=q.dtype)
        x = np.empty(tk + LANES, dtype=np.float64)
        e = np.empty(tk + LANES, dtype=np.float64)
        acc = np.empty(LANES, dtype=np.float64)
        h, i0 = task // blocks, (task % blocks) * ROWS
        rows = min(ROWS, tq - i0)
        nmax = _visible(i0 + rows - 1, offset, tk)
        s = sbuf[: rows * nmax].reshape((rows, nmax))
        np.dot(q[h, i0:i0 + rows], k[h, :nmax].T, s)
        bad = np.empty(ROWS, dtype=np.bool_)  # bad[r] is set for every row r < rows below
        for r in range(rows):
            i = i0 + r
            vis = _visible(i, offset, tk)
            npad = _padded(vis)
            sr = s[r]
            m = -np.inf
            for j in range(vis):
                x[j] = scale * _f64(sr[j])
                m = max(m, x[j])
            for j in range(vis):
                e[j] = _exp_neg(x[j] - m)
            for j in range(vis, npad):
                x[j] = 0.0
                e[j] = 0.0
            z = _sum_lanes(e, npad, acc)
            zs = _dot_lanes(e, x, npad, acc)
            lv = m + math.log(z)
            lse[h, i] = lv
            entropy[h, i] = lv - zs / z
            bad[r] = not np.isfinite(lv)
            inv = 1.0 / z
            for j in range(vis):
                sr[j] = e[j] * inv
            for j in range(vis, nmax):
                sr[j] = 0.0
        ob = obuf[: rows * dv].reshape((rows, dv))
        np.dot(s, v[h, :nmax], ob)
        for r in range(rows):
            orow, src = out[h, i0 + r], ob[r]
            for c in range(dv):
                orow[c] = src[c]
                bad[r] = bad[r] or not np.isfinite(src[c])
            if bad[r]:
                nbad += 1
    return nbad


@pjit
def backward(q, k, v, o, d_o, lse, offset, scale, dq, dkey, dval, spread):
    """dq, dk, dv and the spread, p recomputed from lse, one head per thread. Returns the bad-row count."""
    n, tq, dk = q.shape
    tk, dv = k.shape[1], v.shape[2]
    nbad = 0
    colbad = 0
    for h in prange(n):
        sbuf = np.empty(ROWS * tk, dtype=q.dtype)  # hoisted: once per thread
        gbuf = np.empty(ROWS * tk, dtype=q.dtype)
        kbuf = np.empty(tk * max(dk, dv), dtype=q.dtype)
        qbuf = np.empty(ROWS * dk, dtype=q.dtype)
        t = np.empty(tk + LANES, dtype=np.float64)
        acc = np.empty(LANES, dtype=np.float64)
        kh, vh, dkh, dvh = k[h], v[h], dkey[h], dval[h]
        for x in range(tk):
            for c in range(dk):
                dkh[x, c] = 0.0
            for c in range(dv):
                dvh[x, c] = 0.0
        bad = 0
        for i0 in range(0, tq, ROWS):
            rows = min(ROWS, tq - i0)
            nmax = _visible(i0 + rows - 1, offset, tk)
            qb, gob = q[h, i0:i0 + rows], d_o[h, i0:i0 + rows]
            s = sbuf[: rows * nmax].reshape((rows, nmax))
            g = gbuf[: rows * nmax].reshape((rows, nmax))
            np.dot(qb, kh[:nmax].T, s)
            np.dot(gob, vh[:nmax].T, g)
            for r in range(rows):
                i = i0 + r
                vis = _visible(i, offset, tk)
                npad = _padded(vis)
                d = 0.0  # D_i = d_o_i . o_i
                for c in range(dv):
                    d += _f64(d_o[h, i, c]) * _f64(o[h, i, c])
                li = lse[h, i]
                sr, gr = s[r], g[r]
                for j in range(vis):
                    # <= 0 up to rounding when lse is the forward pass's; clamped so p <= 1.
                    pv = _exp_neg(min(scale * _f64(sr[j]) - li, 0.0))
                    ad = _f64(gr[j]) - d  # the advantage A_ij
                    gv = pv * ad  # dL/ds_ij
                    sr[j] = pv
                    gr[j] = gv
                    t[j] = gv * ad
                for j in range(vis, nmax):
                    sr[j] = 0.0
                    gr[j] = 0.0
                for j in range(vis, npad):
                    t[j] = 0.0
                sp = _sum_lanes(t, npad, acc)
                spread[h, i] = math.sqrt(sp)
                if not np.isfinite(d) or not np.isfinite(sp):
                    bad += 1
            pv_d = kbuf[: nmax * dv].reshape((nmax, dv))
            np.dot(s.T, gob, pv_d)  # dv += pᵀ d_o
            for x in range(nmax):
                for c in range(dv):
                    dvh[x, c] += pv_d[x, c]
            dqb = qbuf[: rows * dk].reshape((rows, dk))
            np.dot(g, kh[:nmax], dqb)  # dq = scale g k
            for r in range(rows):
                rb = False
                for c in range(dk):
                    val = scale * dqb[r, c]
                    dq[h, i0 + r, c] = val
                    rb = rb or not np.isfinite(val)
                if rb and np.isfinite(spread[h, i0 + r]):
                    bad += 1
            gk = kbuf[: nmax * dk].reshape((nmax, dk))
            np.dot(g.T, qb, gk)  # dk += scale gᵀ q
            for x in range(nmax):
                for c in range(dk):
                    dkh[x, c] += scale * gk[x, c]
        cb = False
        for x in range(tk):
            for c in range(dk):
                cb = cb or not np.isfinite(dkh[x, c])
            for c in range(dv):
                cb = cb or not np.isfinite(dvh[x, c])
        nbad += bad
        if cb:
            colbad += 1
    return nbad if nbad else (1 if colbad else 0)
