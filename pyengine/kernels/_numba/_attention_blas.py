"""Numba attention kernels on head-sized problems as BLAS products, as ``csrc/attention_blas.hpp``.

Longer than ~400 lines by exception: a single algorithm (forward, score gradient and backward
of one head tiling) whose docstring is its specification, the twin of one C++ header.

The per-head products (b = u vᵀ; s = q kᵀ and o = p v in the forward pass; s, dp = d_o vᵀ,
dv = pᵀ d_o, dq = g k and dk = gᵀ q in the backward pass) are ``np.dot`` calls, which Numba
sends to SciPy's BLAS (``scipy.linalg.cython_blas``); the row epilogues run on a block of
:data:`ROWS` query rows while it is in cache. The caller holds
:func:`pyengine.backends.one_blas_thread`, so each Numba thread's products run
single-threaded (as the C++ kernels' ``openblas_set_num_threads_local(1)``). The kernel
contracts are those of :mod:`pyengine.kernels._reference.attention`; :func:`serves` says
which shapes these kernels take (every head but the tiny narrow ones), and the
row-at-a-time kernels of :mod:`.attention` serve the rest. The backward pass runs
``prange`` over (head, chunk of query blocks), the chunks fixed by the shape
(:func:`chunk_bounds`), each with its own dk, dv partial, summed in chunk order
(:func:`gather`), so that one head also uses every thread.

Causal masks: a block's products stop at the last key its last row sees (``nmax``), and the
masked entries inside a block are written as 0 before they enter a product. Precision:
the score gradient forms b in float64 for both dtypes (a block's u and v copied to
float64), the forward and backward products, the scaled scores x = scale s and the
probabilities e^(x - m) run in the input's dtype (float32 heads in float32, the exp's
argument and reduction too, :func:`._vecmath.exp_own`, as the C++ fused head; compiled with
``CONTRACT``), and the row sums, lse, entropy, D_i = d_o_i . o_i and the
spread are float64 sums in LANES partial sums (:func:`._reduce._dot_lanes`). Which product
computes a number depends on the shape alone: the results do not depend on the number of
threads.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.linalg  # noqa: F401  (np.dot's BLAS: loaded before one_blas_thread() limits it)
from numba import prange

from ._attention_short import _visible
from ._jit import fma_inline, fma_pjit, jit, pjit
from ._reduce import LANES, _dot_lanes, _max_fold, _padded, _sum_dot_lanes, _sum_lanes
from ._vecmath import exp_own, like, lowest_like
from .layernorm import _prefetch_row_ahead

__all__ = ["JOBS", "MIN_BLOCKS", "NARROW_MIN_PAIRS", "ROWS", "backward", "chunk_bounds", "forward", "gather",
           "score_grad", "serves"]

#: Query rows per block (csrc/attention_blas.hpp's kRows).
ROWS = 32

_f64 = np.float64


#: Narrow heads (a width below 16) with fewer than this many (query, key) pairs per head stay
#: on the row kernels of :mod:`.attention` (:func:`serves`).
NARROW_MIN_PAIRS = 128 * 128


def serves(tq: int, tk: int, d1: int, d2: int) -> bool:
    """Whether these kernels take heads of tq x tk with widths (d1, d2): the shape alone decides.

    Numba's own rule, not the C++ backend's (widths >= 16; its register-blocked kernels
    serve narrow heads faster than any product): Numba's row kernels compute in float64
    one query row at a time and lose to these kernels on every head measured but the
    tiny narrow ones. Per call, median of 7, float32, 2 cores (C++ in brackets), measured
    when the rule was set, before the epilogue work of the same change (the first row's
    BLAS figures were 2.5 / 3.0 ms after it, 1.3-1.4 / 2.3-2.5 ms with float32 exponentials):

    ============================  ==========  ==========  ===============
    shape (n x Tq=Tk, dk, dv)     rows (ms)   BLAS (ms)   kernel
    ============================  ==========  ==========  ===============
    1 x 2000, 10, 8               7.1 / 12.2  4.5 / 3.8   fwd / bwd (1.1 / 1.5)
    1 x 2000, 64, 64              - / 84.7    7.7 / 10.2  fwd / bwd (3.3 / 7.9)
    2 x 1024, 32, 32              - / 21.5    2.3 / 3.0   fwd / bwd (1.3 / 2.7)
    12 x 512, 8, 8                5.9 / 11.5  3.0 / 2.9   fwd / bwd (1.1 / 1.7)
    1 x 2000, 8 (score grad)      8.1         1.8         (1.0)
    1 x 32, 2, 2                  0.01 / 0.02 0.03 / 0.05 fwd / bwd (0.01 / 0.01)
    1 x 64, 4 (score grad)        0.012       0.025       (0.006)
    ============================  ==========  ==========  ===============

    (a "-": the BLAS forward already served widths >= 16), hence narrow heads from
    :data:`NARROW_MIN_PAIRS` pairs on (about 128 x 128; equal there).
    """
    if tq <= 0 or tk <= 0:
        return False
    return min(d1, d2) >= 16 or tq * tk >= NARROW_MIN_PAIRS


@jit
def _zigzag(t, m):
    """Block of task t of m: 0, m - 1, 1, m - 2, ... (a permutation of 0 .. m - 1).

    ``prange`` gives each thread an equal contiguous range of tasks, and a causal block's
    work grows with its index, so in block order the last thread got the heaviest blocks
    (one head of T = 2000 on 2 threads: three quarters of the work on one). In this order
    each pair of neighbouring tasks is about the mean work twice. Which block a task computes
    does not change the block's result.
    """
    return t // 2 if t % 2 == 0 else m - 1 - t // 2


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
        h, i0 = task // blocks, _zigzag(task % blocks, blocks) * ROWS
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
        outf, advf = out[h].reshape(tq * tk), advantage[h].reshape(tq * tk)
        for r in range(rows):
            i = i0 + r
            vis = _visible(i, offset, tk)
            _prefetch_row_ahead(outf, i * tk, tk)
            if want_a:
                _prefetch_row_ahead(advf, i * tk, tk)
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


@fma_inline
def _scale_max(sr, vis, scale, x, accx):
    """x[:vis] = scale * sr[:vis] in sr's dtype (float32: scale rounded to float32 first), and
    max x (the non-NaN values, -inf if none) as float64, in LANES running maxima of that dtype:
    exact, and one pass instead of two (float32, in L1: 0.32 -> 0.22 ns an element)."""
    sc = like(sr[0], scale)
    for k in range(LANES):
        accx[k] = -np.inf
    nb = vis // LANES
    for b in range(nb):
        o = b * LANES
        for k in range(LANES):
            v = sc * sr[o + k]
            x[o + k] = v
            accx[k] = v if v > accx[k] else accx[k]
    m = _f64(_max_fold(accx))
    for i in range(nb * LANES, vis):
        v = sc * sr[i]
        x[i] = v
        m = v if v > m else m
    return m


@fma_inline
def _row_exponentials(sr, vis, scale, x, e, acc, accx):
    """(m, z, zs) of a row of scores sr[:vis]: x = scale * sr and e = e^(x - m) in sr's dtype
    (float32 heads in float32, the difference and its exp too: :func:`._vecmath.exp_own`),
    m = max x, z = sum e, zs = sum e x in float64.

    x, e : (>= padded(vis),) of sr's dtype, acc : (2, LANES) float64, accx : (LANES,) of sr's
    dtype. x is padded to a multiple of LANES with the dtype's lowest finite value, whose e is
    exactly 0 and e x = -0 for every finite m, so the loops have no scalar tail (a pad of
    m - 2048, as before, rounds to m itself once |m| >= 2^35 in float32, and each pad then
    added 1 to z: wrong probabilities, not flagged, for scores of about 3e10); the
    exponentials and the sums are separate loops (fused, one loop took 0.80 ns per element
    against 0.47 + 0.17 for the two). A
    float32 x - m is within half an ulp of |x - m|, so e is within about |x - m| 2^-24 relative
    of e^(x - m), under 2.2e-8 absolute (float32, in L1: 0.49 -> 0.28 ns an element against a
    float64 difference and reduction).
    """
    npad = _padded(vis)
    m = _scale_max(sr, vis, scale, x, accx)
    low = lowest_like(x[0])
    for j in range(vis, npad):
        x[j] = low
    mx = like(x[0], m)
    for j in range(npad):
        e[j] = exp_own(x[j] - mx)
    z, zs = _sum_dot_lanes(e, x, npad, acc)
    return m, z, zs


@fma_pjit
def forward(q, k, v, offset, scale, out, lse, entropy):
    """out = softmax(scale q kᵀ, masked) v with lse and entropy per row. Returns the bad-row count."""
    n, tq, _ = q.shape
    tk, dv = k.shape[1], v.shape[2]
    blocks = (tq + ROWS - 1) // ROWS
    nbad = 0
    for task in prange(n * blocks):
        sbuf = np.empty(ROWS * tk, dtype=q.dtype)  # hoisted: once per thread
        obuf = np.empty(ROWS * dv, dtype=q.dtype)
        x = np.empty(tk + LANES, dtype=q.dtype)
        e = np.empty(tk + LANES, dtype=q.dtype)
        acc = np.empty((2, LANES), dtype=np.float64)
        accx = np.empty(LANES, dtype=q.dtype)
        h, i0 = task // blocks, _zigzag(task % blocks, blocks) * ROWS
        rows = min(ROWS, tq - i0)
        nmax = _visible(i0 + rows - 1, offset, tk)
        s = sbuf[: rows * nmax].reshape((rows, nmax))
        np.dot(q[h, i0:i0 + rows], k[h, :nmax].T, s)
        bad = np.empty(ROWS, dtype=np.bool_)  # bad[r] is set for every row r < rows below
        for r in range(rows):
            i = i0 + r
            vis = _visible(i, offset, tk)
            sr = s[r]
            m, z, zs = _row_exponentials(sr, vis, scale, x, e, acc, accx)
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


#: The backward pass splits each head into ceil(JOBS / n) chunks of query blocks (of about
#: equal work, fixed by the shape alone), so that one to three heads also use every thread
#: (before, a head was one task: one head of T = 2000, d = 64 ran on one thread, 8x slower
#: than C++)...
JOBS = 4
#: ... but no chunk has fewer than this many blocks (of ROWS query rows): a chunk costs a
#: dk, dv partial to clear and to sum (2 heads of T = 1024, d = 32 on 2 cores: 3.2 ms in 8
#: chunks, 3.0 in 4, 2.7 as one task per head, which leaves a third head's thread idle).
MIN_BLOCKS = 4


def chunk_bounds(n: int, tq: int, tk: int, offset: int) -> np.ndarray:
    """First query block of each of a head's chunks, and the end: (nch + 1,) int64.

    nch = min(blocks, ceil(JOBS / n)); a block's work is the keys its last row sees. The
    bounds depend on the shape alone, so the results do not depend on the number of threads.
    """
    blocks = (tq + ROWS - 1) // ROWS
    nch = max(1, min(blocks // MIN_BLOCKS, -(-JOBS // max(n, 1))))
    last = np.minimum(np.arange(1, blocks + 1) * ROWS, tq) - 1
    work = np.cumsum(np.clip(last + min(offset, tk) + 1, 0, tk) + 1.0)
    cuts = np.searchsorted(work, work[-1] * np.arange(1, nch) / nch, side="left") + 1
    return np.unique(np.concatenate(([0], np.minimum(cuts, blocks), [blocks]))).astype(np.int64)


@pjit
def gather(part, nch, out):
    """out[h] = sum of the chunk partials part[h * nch + c] in chunk order; True where not finite.

    part : (n * nch, tk, m); out : (n, tk, m). Returns the number of heads with a value
    that is not finite."""
    n, tk, m = out.shape
    bad = np.zeros(n, dtype=np.bool_)
    for h in prange(n):
        b = False
        for x in range(tk):
            for c in range(m):
                t = part[h * nch, x, c]
                for ch in range(1, nch):
                    t += part[h * nch + ch, x, c]
                out[h, x, c] = t
                b = b or not np.isfinite(t)
        bad[h] = b
    return np.count_nonzero(bad)


@fma_pjit
def backward(q, k, v, o, d_o, lse, offset, scale, dq, dkey, dval, spread, bounds):
    """dq, dk, dv and the spread, p recomputed from lse. Returns the bad-row count.

    ``prange`` over (head, chunk of query blocks) with the chunks' first blocks in
    ``bounds`` (:func:`chunk_bounds`); dkey, dval : (n * nch, tk, dk), (n * nch, tk, dv), the
    chunks' partials (the outputs themselves when nch = 1; else summed by :func:`gather`).
    """
    n, tq, dk = q.shape
    tk, dv = k.shape[1], v.shape[2]
    nch = bounds.size - 1
    nbad = 0
    colbad = 0
    for job in prange(n * nch):
        h, ch = job // nch, job % nch
        sbuf = np.empty(ROWS * tk, dtype=q.dtype)  # hoisted: once per thread
        gbuf = np.empty(ROWS * tk, dtype=q.dtype)
        kbuf = np.empty(tk * max(dk, dv), dtype=q.dtype)
        qbuf = np.empty(ROWS * dk, dtype=q.dtype)
        t = np.empty(tk + LANES, dtype=np.float64)
        acc = np.empty(LANES, dtype=np.float64)
        kh, vh, dkh, dvh = k[h], v[h], dkey[job], dval[job]
        dkf, dvf = dkh.reshape(tk * dk), dvh.reshape(tk * dv)
        for x in range(tk * dk):
            dkf[x] = 0.0
        for x in range(tk * dv):
            dvf[x] = 0.0
        bad = 0
        for i0 in range(bounds[ch] * ROWS, min(tq, bounds[ch + 1] * ROWS), ROWS):
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
                # p_ij = e^(x - lse) with x = scale s in the head's dtype, as the forward pass
                # (float32 heads: scale rounded to float32, about 0.1 ns an element less);
                # lse = c + cl split at the dtype's precision, (x - c) - cl clamped to <= 0
                # (<= 0 up to rounding when lse is the forward pass's), so p <= 1. Then the
                # rest in a second loop (in one, 1.0 ns an element against 0.73).
                c = like(sr[0], li)
                cl = like(sr[0], li - _f64(c))
                zero = like(sr[0], 0.0)
                sc = like(sr[0], scale)
                for j in range(vis):
                    sr[j] = exp_own(min((sc * sr[j] - c) - cl, zero))
                for j in range(vis):
                    ad = _f64(gr[j]) - d  # the advantage A_ij
                    gv = _f64(sr[j]) * ad  # dL/ds_ij
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
            # The partials' first nmax rows as one flat loop (a nest of nmax x dv ran dv
            # wide: one head of T = 2000, d = 10 spent 0.4 ms of its 2.5 in the two sums).
            for x in range(nmax * dv):
                dvf[x] += kbuf[x]
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
            for x in range(nmax * dk):
                dkf[x] += scale * kbuf[x]
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
