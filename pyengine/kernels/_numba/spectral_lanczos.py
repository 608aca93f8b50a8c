"""Numba fused per-token Lanczos for sigma_max of the LayerNorm / RMSNorm Jacobians.

A single algorithm, longer than ~400 lines by exception: this docstring is its specification.

Same kernel contract and parameter names as :mod:`pyengine.kernels._reference.spectral_lanczos`
(``x`` (n, d) float32/float64, ``gamma`` (d,) of its dtype, ``v0`` (n, d) float64 start
vectors, float64 ``sigma`` / ``residual`` and int64 ``iterations`` outputs, the bad-row
count returned; a bad row gets NaN outputs and 0 iterations); ``csrc/spectral_lanczos.hpp``
is the C++ twin, step for step.

Per token, in float64:

* The row is scaled by c = 2^-e (``_row_scale``: exact) and eps by c^2, so rows of 2^+-500
  neither overflow nor underflow; xh = (c x - c mu) / (c s) is O(1) and
  K = s J = diag(gamma) P, P = I - 11^T/d - xh xh^T/d (no 11^T/d for RMSNorm, no xh
  term in frozen mode), K^T = P diag(gamma). sigma_max(J) = sigma_max(K) / s, and the
  relative residual is the same for K and J.
* Symmetric Lanczos on A = K^T K = P G^2 P (three O(d) passes per product) from
  q0 = v0/|v0|, with full reorthogonalization (classical Gram-Schmidt and the DGKS second
  pass of the generic solver), after the three-term step, against the token's basis, at most ``MAX_BASIS`` vectors of
  d doubles, which stay in the thread's cache.
* When a test is due (the generic solver's schedule: after 4 products, then halfway to
  where the estimate's observed rate predicts tol, at most 8 apart) the top eigenpair (theta, z) of the tridiagonal T_m: theta by Sturm
  bisection to a few ulps, z by two steps of inverse iteration. The Ritz estimate
  beta_m |z_m| / theta is the residual of the Ritz vector y = Q z in exact arithmetic.
* When the estimate passes tol (tightened tenfold after each failed check), at a breakdown
  (beta_m <= BREAKDOWN * the largest alpha/beta seen: an invariant subspace), when the
  basis is full, or when only one product is left, y is verified explicitly: sigma = |K y|,
  residual = ||K^T (K y / sigma) - sigma y|| / sigma, the generic solver's
  ``_relative_residual`` (0 only for a zero operator, else inf when sigma = 0). That
  product counts as an iteration. The token finishes when the residual is <= tol, at a
  breakdown, or when no room is left for one more step and its check (so iterations <=
  max_iter); a full basis restarts from y.

``sigma`` is |J y| for the final unit y (a lower bound of sigma_max up to rounding),
``converged`` is for the caller to set as ``residual <= tol``.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from ...backends import register
from ._jit import jit, pjit
from ._reduce import LANES, _fold, _row_scale

__all__ = ["layer_norm_lanczos", "rms_norm_lanczos"]

#: Largest Lanczos basis per token (vectors of d float64), as kMaxBasis in the C++.
MAX_BASIS = 160
BREAKDOWN = 1e-14
DGKS_ETA = 0.7071067811865476
#: First Ritz test (products) and the longest gap between tests (LANCZOS_FIRST_TEST / _GAP).
FIRST_TEST = 4
TEST_GAP = 8
_EPS = 2.220446049250313e-16
_TINY = 2.2250738585072014e-308


@jit
def _dot(a, b, d, acc):
    """a . b over d in LANES partial sums (the loop vectorizer's form, see _reduce.py);
    acc : (LANES,) float64 scratch."""
    for k in range(LANES):
        acc[k] = 0.0
    nb = d // LANES
    for j in range(nb):
        o = j * LANES
        for k in range(LANES):
            acc[k] += a[o + k] * b[o + k]
    s = _fold(acc)
    for i in range(nb * LANES, d):
        s += a[i] * b[i]
    return s


@jit
def _sum(v, d, acc):
    """sum of v over d in LANES partial sums; acc : (LANES,) float64 scratch."""
    for k in range(LANES):
        acc[k] = 0.0
    nb = d // LANES
    for j in range(nb):
        o = j * LANES
        for k in range(LANES):
            acc[k] += v[o + k]
    s = _fold(acc)
    for i in range(nb * LANES, d):
        s += v[i]
    return s


@jit
def _proj(xh, centre, full, v, out, acc):
    """out = P v (out may be v)."""
    d = v.size
    m1 = _sum(v, d, acc) / d if centre else 0.0
    m2 = _dot(xh, v, d, acc) / d if full else 0.0
    for i in range(d):
        out[i] = (v[i] - m1) - xh[i] * m2


@jit
def _count_above(a, b, m, x, pivmin):
    neg = 0
    q = a[0] - x
    if abs(q) < pivmin:
        q = -pivmin
    if q < 0:
        neg += 1
    for i in range(1, m):
        q = (a[i] - x) - b[i - 1] * b[i - 1] / q
        if abs(q) < pivmin:
            q = -pivmin
        if q < 0:
            neg += 1
    return m - neg


@jit
def _top_eigenpair(a, b, m, z, work):
    """Top eigenpair of the m x m tridiagonal (a, b): theta returned, z (unit) filled."""
    lo = a[0]
    hi = a[0]
    tmax = 0.0
    for i in range(m):
        r = (abs(b[i - 1]) if i > 0 else 0.0) + (abs(b[i]) if i + 1 < m else 0.0)
        lo = min(lo, a[i] - r)
        hi = max(hi, a[i] + r)
        tmax = max(tmax, abs(a[i]) + r)
    pivmin = max(tmax * _EPS * _EPS, _TINY)
    it = 0
    while it < 200 and hi - lo > 2.0 * _EPS * max(abs(lo), abs(hi)):
        it += 1
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if _count_above(a, b, m, mid, pivmin) >= 1:
            lo = mid
        else:
            hi = mid
    theta = 0.5 * (lo + hi)
    if m == 1:
        z[0] = 1.0
        return theta
    dd = work[0]
    du = work[1]
    dl = work[2]
    du2 = work[3]
    for i in range(m):
        z[i] = 1.0
    for _rep in range(2):  # inverse iteration: elimination with partial pivoting (dgtsv)
        for i in range(m):
            dd[i] = a[i] - theta
            du[i] = b[i] if i + 1 < m else 0.0
            dl[i] = b[i] if i + 1 < m else 0.0
            du2[i] = 0.0
        for i in range(m - 1):
            if abs(dd[i]) >= abs(dl[i]):
                if dd[i] == 0.0:
                    dd[i] = pivmin
                f = dl[i] / dd[i]
                dd[i + 1] -= f * du[i]
                z[i + 1] -= f * z[i]
            else:
                f = dd[i] / dl[i]
                dd[i] = dl[i]
                t = dd[i + 1]
                dd[i + 1] = du[i] - f * t
                if i + 2 < m:
                    du2[i] = du[i + 1]
                    du[i + 1] = -f * du2[i]
                du[i] = t
                zt = z[i]
                z[i] = z[i + 1]
                z[i + 1] = zt - f * z[i + 1]
        if dd[m - 1] == 0.0:
            dd[m - 1] = pivmin
        z[m - 1] /= dd[m - 1]
        z[m - 2] = (z[m - 2] - du[m - 2] * z[m - 1]) / dd[m - 2]
        for i in range(m - 3, -1, -1):
            z[i] = (z[i] - du[i] * z[i + 1] - du2[i] * z[i + 2]) / dd[i]
        top = 0.0
        for i in range(m):
            top = max(top, abs(z[i]))
        if not (top > 0.0 and np.isfinite(top)):
            for i in range(m):
                z[i] = 1.0 if i == 0 else 0.0
            return theta
        nn = 0.0
        for i in range(m):
            z[i] /= top
            nn += z[i] * z[i]
        inv = 1.0 / math.sqrt(nn)
        for i in range(m):
            z[i] *= inv
    return theta


@jit
def _project_out(Q, j, w, h, acc):
    """h[i] = Q_i . w for rows 0..j-1, then w -= sum_i h[i] Q_i (two rows per sweep)."""
    d = w.size
    for i in range(j):
        h[i] = _dot(Q[i], w, d, acc)
    i = 0
    while i + 2 <= j:
        q0 = Q[i]
        q1 = Q[i + 1]
        c0 = h[i]
        c1 = h[i + 1]
        for k in range(d):
            w[k] = (w[k] - c0 * q0[k]) - c1 * q1[k]
        i += 2
    if i < j:
        qi = Q[i]
        c = h[i]
        for k in range(d):
            w[k] -= c * qi[k]


@jit
def _orthogonalize(Q, j, bprev, w, h, acc):
    """The three-term step w -= alpha q_{j-1} + bprev q_{j-2}, then w -= Q Q^T w against rows
    0..j-1 (classical Gram-Schmidt; a second pass where the norm fell below DGKS_ETA of its
    value). Returns alpha, the coefficient of q_{j-1} over all passes."""
    d = w.size
    qa = Q[j - 1]
    alpha = _dot(qa, w, d, acc)
    for k in range(d):
        w[k] -= alpha * qa[k]
    if j >= 2:
        qb = Q[j - 2]
        for k in range(d):
            w[k] -= bprev * qb[k]
    for _pass in range(2):
        before = _dot(w, w, d, acc)
        _project_out(Q, j, w, h, acc)
        alpha += h[j - 1]
        if not (_dot(w, w, d, acc) < DGKS_ETA * DGKS_ETA * before):
            break
    return alpha


@jit
def _next_gap(est, last_est, since, target):
    """Products until the next Ritz test: halfway to where the estimate's observed rate
    predicts target, in [1, TEST_GAP] (the generic solver's schedule)."""
    if not (est > 0.0 and est < last_est and np.isfinite(last_est) and target > 0.0):
        return TEST_GAP
    rate = (est / last_est) ** (1.0 / max(since, 1))
    if not (rate > 0.0 and rate < 1.0):
        return TEST_GAP
    steps = math.log(target / est) / math.log(rate)
    gap = math.floor(steps / 2.0) if np.isfinite(steps) else float(TEST_GAP)
    return int(min(max(gap, 1.0), float(TEST_GAP)))


@jit
def _verify(xh, g, centre, full, gmax, y, u, acc):
    """(sigma of K y, relative residual) for the unit y; u is scratch."""
    d = y.size
    _proj(xh, centre, full, y, u, acc)
    ut = 0.0
    for i in range(d):
        u[i] *= g[i]
        ut = max(ut, abs(u[i]))
    un = 0.0
    if ut > 0.0:
        for i in range(d):
            u[i] /= ut
        un = math.sqrt(_dot(u, u, d, acc))
        for i in range(d):
            u[i] = g[i] * (u[i] / un)
    sig = un * ut
    _proj(xh, centre, full, u, u, acc)
    rr = 0.0
    for i in range(d):
        t = u[i] - sig * y[i]
        rr += t * t
    rn = math.sqrt(rr)
    if sig > 0.0:
        return sig, rn / sig
    return sig, (0.0 if (rn == 0.0 and gmax == 0.0) else np.inf)


@jit
def _lanczos_row(centre, x, gamma, eps, frozen, v0, tol, max_iter, Q, vec, tri, work, acc):
    """One token; returns (bad, sigma, residual, iterations). Q : (p + 1, d), vec : (6, d),
    tri : (4, p + 1), work : (4, p) float64 scratch."""
    d = x.size
    p = Q.shape[0] - 1
    xh = vec[0]
    g = vec[1]
    g2 = vec[2]
    w = vec[3]
    y = vec[4]
    u = vec[5]
    al = tri[0]
    be = tri[1]
    z = tri[2]
    h = tri[3]
    full = not frozen
    c = _row_scale(x, eps)
    mu = 0.0
    if centre:
        for i in range(d):
            mu += float(x[i]) * c
        mu /= d
    ms = 0.0
    for i in range(d):
        t = float(x[i]) * c - mu
        ms += t * t
    sq = ms / d + eps * c * c
    if not (np.isfinite(mu) and np.isfinite(sq) and sq > 0.0):
        return True, np.nan, np.nan, 0
    sc = math.sqrt(sq)
    inv_s = c / sc
    gmax = 0.0
    for i in range(d):
        xh[i] = (float(x[i]) * c - mu) / sc
        g[i] = float(gamma[i])
        g2[i] = g[i] * g[i]
        gmax = max(gmax, abs(g[i]))
    top = 0.0
    finite = True
    for i in range(d):
        a = abs(v0[i])
        finite = finite and np.isfinite(a)
        top = max(top, a)
    if not finite:
        return True, np.nan, np.nan, 0
    # LayerNorm with eps = 0 and d = 2 (full mode): J = 0 exactly; sigma 0, residual 0, 0 iterations
    if centre and full and eps == 0.0 and d == 2:
        return False, 0.0, 0.0, 0
    if top == 0.0:
        return False, 0.0, np.inf, 0
    q0 = Q[0]
    for i in range(d):
        q0[i] = v0[i] / top
    qn = 1.0 / math.sqrt(_dot(q0, q0, d, acc))
    for i in range(d):
        q0[i] *= qn
    used = 0
    if max_iter <= 1:  # no room for a step and its check: one power step
        for i in range(d):
            y[i] = q0[i]
        sig, res = _verify(xh, g, centre, full, gmax, y, u, acc)
        return False, sig * inv_s, res, 1
    factor = 1.0
    scale = 0.0
    due = FIRST_TEST
    last_est = np.inf
    last_at = 0
    m = 0
    while True:
        _proj(xh, centre, full, Q[m], w, acc)  # w = P G^2 P q_m
        for i in range(d):
            w[i] *= g2[i]
        _proj(xh, centre, full, w, w, acc)
        used += 1
        alpha = _orthogonalize(Q, m + 1, be[m - 1] if m > 0 else 0.0, w, h, acc)
        beta = math.sqrt(_dot(w, w, d, acc))
        scale = max(scale, max(abs(alpha), beta))
        al[m] = alpha
        be[m] = beta
        m += 1
        breakdown = beta <= BREAKDOWN * max(scale, 1e-300)
        if not breakdown:
            ib = 1.0 / beta
            qm = Q[m]
            for i in range(d):
                qm[i] = w[i] * ib
        last = used + 1 >= max_iter
        if not (used >= due or breakdown or m == p or last):
            continue
        theta = _top_eigenpair(al, be, m, z, work)
        fp = 0.0 if breakdown else beta * abs(z[m - 1])
        if theta > 0.0:
            est = fp / theta
        else:
            est = 0.0 if fp == 0.0 else np.inf
        due = used + _next_gap(est, last_est, used - last_at, tol * factor)
        last_est = est
        last_at = used
        if not (est <= tol * factor or breakdown or m == p or last):
            continue
        for i in range(d):
            y[i] = 0.0
        for k in range(m):
            zk = z[k]
            qk = Q[k]
            for i in range(d):
                y[i] += zk * qk[i]
        yn = 1.0 / math.sqrt(_dot(y, y, d, acc))
        for i in range(d):
            y[i] *= yn
        sig, res = _verify(xh, g, centre, full, gmax, y, u, acc)
        used += 1
        if res <= tol or breakdown or last or used + 2 > max_iter:
            return False, sig * inv_s, res, used
        factor *= 0.1  # the estimate was optimistic: ask more of it next time
        if m == p:  # basis full: restart from the Ritz vector
            for i in range(d):
                q0[i] = y[i]
            m = 0


def basis_size(d: int, max_iter: int) -> int:
    """Lanczos vectors kept per token (as lanczos_detail::basis_size in the C++)."""
    return max(1, min(d, max_iter, MAX_BASIS))


@pjit
def _lanczos(centre, x, gamma, eps, frozen, v0, tol, max_iter, p, nt, sigma, residual, iterations):
    """All tokens, each by one thread; each of the ``nt`` threads allocates its scratch once.

    Token r runs on thread r % nt (strided, so tokens of differing iteration counts
    spread evenly). ``prange(nt)`` has one iteration per thread, and each allocates the
    scratch of its tokens (the basis Q of (p + 1) x d doubles, 67 KB at d = 768 and
    p = 10, 360 KB at d = 4096) at its top. Not per token: Numba does not hoist an array
    that is passed to a function, and where malloc maps blocks afresh (glibc above its
    mmap threshold; the bench pins it at 128 KiB) each token paid page faults (2.1x C++
    at 256 x 4096 in ``pyengine bench``). Not one (nt, p + 1, d) block per call either:
    at d = 768 that block (135 KB) is mapped and faulted on every call, while each
    thread's own stays below the threshold, on the heap. Results do not depend on ``nt``.
    """
    n, d = x.shape
    bad = np.zeros(n, dtype=np.bool_)
    for t in prange(nt):
        Q = np.empty((p + 1, d), dtype=np.float64)
        vec = np.empty((6, d), dtype=np.float64)
        tt = np.empty((4, p + 1), dtype=np.float64)
        work = np.empty((4, p + 1), dtype=np.float64)
        acc = np.empty(LANES, dtype=np.float64)
        for r in range(t, n, nt):
            for i in range(4):
                for j in range(p + 1):
                    tt[i, j] = 0.0
            b, sg, res, k = _lanczos_row(centre, x[r], gamma, eps, frozen, v0[r], tol, max_iter,
                                         Q, vec, tt, work, acc)
            sigma[r] = sg
            residual[r] = res
            iterations[r] = k
            bad[r] = b
    return np.count_nonzero(bad)


def _threads(n: int) -> int:
    """Threads a call on n tokens uses: Numba's current count, at most n, at least 1."""
    return max(1, min(n, numba.get_num_threads()))


@register("layer_norm_lanczos", "numba")
def layer_norm_lanczos(x, gamma, eps, frozen, v0, tol, max_iter, sigma, residual, iterations):
    """x : (n, d); gamma : (d,); v0 : (n, d) float64; sigma, residual : (n,) float64;
    iterations : (n,) int64. Returns the number of bad rows."""
    p = basis_size(x.shape[1], int(max_iter))
    return _lanczos(True, x, gamma, float(eps), bool(frozen), v0, float(tol), int(max_iter), p,
                    _threads(x.shape[0]), sigma, residual, iterations)


@register("rms_norm_lanczos", "numba")
def rms_norm_lanczos(x, gamma, eps, frozen, v0, tol, max_iter, sigma, residual, iterations):
    """As :func:`layer_norm_lanczos`, for RMSNorm."""
    p = basis_size(x.shape[1], int(max_iter))
    return _lanczos(False, x, gamma, float(eps), bool(frozen), v0, float(tol), int(max_iter), p,
                    _threads(x.shape[0]), sigma, residual, iterations)
