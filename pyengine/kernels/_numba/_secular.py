"""The exact sigma_max solver of the Numba spectral kernels: lambda_max by the secular equation.

A single algorithm, longer than ~400 lines by exception: this docstring is its specification
(csrc/secular.hpp mirrors it step by step).

Called from :mod:`pyengine.kernels._numba.spectral`: :func:`_pole_data` once per call,
:func:`_lambda_max` once per token; the special cases that need no solve and the
accuracy of the result are described there.

lambda_max of A = D^1/2 (I - U U^T) D^1/2 (D = diag(gamma^2), U = [a, b] per token, at
most rank 2) is found per token in O(d) per evaluation of the 2 x 2 secular matrix

    G(lam) = diag(kappa)/lam - N(lam),   N(lam) = sum_i u_i u_i^T / (delta_i - lam),

which has the inertia of I - M(lam) (reference docstring) and decreases (Loewner order)
on every interval between poles, so each of its two eigenvalues does too. The count
n_>(lam) = #{delta_i > lam} + npos(G) - 2 then pins lambda_max down:

1. Per call (gamma only): delta = gamma^2, the three largest distinct values
   D1 > D2 > D3 (0 where absent) with the index groups g1, g2 of D1 and D2, and the
   offsets E_k = delta - D_k (k = 1, 2, 3), +inf on g1 and g2, so that the bulk sums
   skip those entries without a branch (1/inf = 0). The groups are summed exactly per
   token instead: S_g = sum_{i in g} u_i u_i^T, of rank r_g <= min(m_g, 2).
2. Deflation: if m_1 > r_1, D1 itself is an eigenvalue (a vector supported on g1 and
   orthogonal to U exists): lambda_max = D1 exactly. Constant gamma (m_1 = d >= 3)
   gives sigma_max = |g|/s this way.
3. Otherwise lambda_max < D1 lies in (D2, D1), or, only if m_1 = m_2 = 1, possibly in
   (D3, D2] (interlacing: lambda_max >= the third largest delta). It is in (D2, D1) iff
   the count just above D2 is >= 1: certain when r_2 = 2 or when a cheap lower bound
   (the 2 x 2 principal submatrix of A on the two largest delta) exceeds D2, else
   decided by the sign of the remaining eigenvalue of G at D2+ (one extra pass). If it
   is not there and m_2 > r_2, lambda_max = D2.
4. In the chosen interval (lo, hi) the root is where one eigenvalue of G (the smaller
   if m_1 = 1 in the top interval, else the larger; for one column, the scalar) changes
   sign. The point is kept as the pair (y, tau) = (lam - lo, hi - lam), each exact where
   it is the smaller, and every denominator is formed from the nearer pole, as
   (delta_i - hi) + tau or (delta_i - lo) - y (LAPACK dlaed4's device), so roots
   within rounding of a pole are found to full relative precision.
   Only the bulk costs O(d): one pass gives N and N' at a point (6 sums). The solver
   replaces the bulk by a rational fit anchored there, N_a + N'_a (lam_a - p)(lam -
   lam_a)/(lam - p) with p = D3 its largest pole (exact in value and derivative at the
   anchor; the groups and the kappa term stay exact), and solves that model to full
   precision in O(1) steps: each fits the "middle way" rational c - s_R/(hi - lam) +
   s_L/(lam - lo) to the target's value and split (right-pole / left-pole) derivative
   at the current eigenvector and solves it for the correction, inside a bracket that
   every evaluation narrows (bisection when a step leaves it). The model's root is
   the next point of a bulk pass and the next anchor; the solver stops when the model
   anchored at the last pass puts the root within 1e-7 of that point's offset (so
   the error is ~1e-14 of it). The first anchor is D2 when the interval had to be
   decided there (that pass is reused), else the lower bound of step 3. 2-4 passes
   per token in practice (measured over uniform, lognormal, clustered and outlier
   gamma, with and without massive activations).
5. The determinant of G is formed with the pole term of the nearer group split off,
   det(K - S/den) = det K - tr(adj(K) S)/den + det(S)/den^2, det(S) exact (0 for rank 1,
   the Lagrange identity for two indices), so the eigenvalue near a pole is accurate.

Caching: the kernels that call this solver live in :mod:`pyengine.kernels._numba.spectral`, and
Numba's on-disk cache (``cache=True``) checks only the source file of the function it
caches. After an edit to *this* file, delete ``pyengine/_numba/__pycache__`` (or touch
``spectral.py``) so the callers are recompiled.
"""

from __future__ import annotations

import math

import numpy as np

from ._formula import row_sums
from ._jit import jit
from ._reduce import _f64

__all__ = [
    "_LN1",
    "_LN2",
    "_RMS1",
    "_lambda_max",
    "_pole_data",
]

#: Secular solver: stop when the root of the model anchored at the last evaluated point
#: lies within this fraction of the offset from the nearer pole of that point. The
#: model matches value and derivative there, so the root's error is about STOP^2
#: relative: far below rounding.
_STOP = 1e-7
#: The model's own root is iterated to this relative step (each step is O(1) work).
_INNER_STOP = 1e-15
#: Both stop at a step below this fraction of lambda too: the result is lambda, and a
#: finer offset from a pole would not show in it (rounding noise could stall the tests).
_LAM_STOP = 1e-15
#: Cap on iterations, inner and outer (the bracket halves at worst).
_MAX_IT = 100
#: Columns: LayerNorm (a = 1/sqrt(d), b = cb (x - mu)), constant column only (frozen
#: LayerNorm: a = 1/sqrt(d)), RMSNorm (a = ca x).
_LN2, _LN1, _RMS1 = 0, 1, 2


# --------------------------------------------------------------------------- #
# Per-call precomputation on gamma (compiled: once per call)
# --------------------------------------------------------------------------- #


@jit
def _indices_of(delta, value):
    """Indices i with delta[i] == value (ascending), or none when value is 0."""
    m = 0
    if value > 0.0:
        for i in range(delta.size):
            if delta[i] == value:
                m += 1
    g = np.empty(m, dtype=np.int64)
    m = 0
    if value > 0.0:
        for i in range(delta.size):
            if delta[i] == value:
                g[m] = i
                m += 1
    return g


@jit
def _pole_data(gamma):
    """delta, (D1, D2, D3), groups g1, g2, offsets E (3, d), the two largest indices.

    delta = gamma^2 in float64; D1 > D2 > D3 the three largest distinct positive values of
    delta (0 where absent); g1, g2 the indices of D1 and D2; E[k] = delta - D_k, +inf on g1
    and g2; order the indices of the two largest delta, ties by index (a stable sort of
    -delta; one index when d = 1). Compiled (the NumPy form took 34-38 us per call at
    d = 768, 7 % of a 256-token call and most of a one-token one); ``tests/test_secular_pole_data.py``
    checks it against that NumPy form.
    """
    d = gamma.size
    delta = np.empty(d, dtype=np.float64)
    for i in range(d):
        g = np.float64(gamma[i])
        delta[i] = g * g
    t0, t1, t2 = 0.0, 0.0, 0.0
    for i in range(d):
        v = delta[i]
        if v > t0:
            t0, t1, t2 = v, t0, t1
        elif t1 < v < t0:
            t1, t2 = v, t1
        elif t2 < v < t1:
            t2 = v
    top = np.array([t0, t1, t2])
    g1 = _indices_of(delta, t0)
    g2 = _indices_of(delta, t1)
    offs = np.empty((3, d), dtype=np.float64)
    for k in range(3):
        for i in range(d):
            offs[k, i] = delta[i] - top[k]
        for i in g1:
            offs[k, i] = np.inf
        for i in g2:
            offs[k, i] = np.inf
    order = np.empty(min(d, 2), dtype=np.int64)
    for j in range(order.size):
        best = -1
        for i in range(d):
            if j == 1 and i == order[0]:
                continue
            if best < 0 or delta[i] > delta[best]:
                best = i
        order[j] = best
    return delta, top, g1, g2, offs, order


# --------------------------------------------------------------------------- #
# Bulk sums: one pass over d, q_i = 1/(e_i + off), by _formula.row_sums
# --------------------------------------------------------------------------- #


def _ln2_terms(x, e, mu, off, one):
    """The six terms of element i of a LayerNorm bulk pass (:func:`_bulk`): q = 1/(e_i + off),
    t = x_i - mu; q, q t, q t^2, q^2, q^2 t, q^2 t^2."""
    q = one / (e + off)
    t = x - mu
    qt = q * t
    q2 = q * q
    q2t = q2 * t
    return q, qt, qt * t, q2, q2t, q2t * t


def _sq_terms(x, e, off, one):
    """q t^2 and q^2 t^2 with t = x_i (RMSNorm)."""
    q = one / (e + off)
    qt2 = (q * x) * x
    return qt2, q * qt2


def _one_terms(e, off, one):
    """q and q^2 (a constant column)."""
    q = one / (e + off)
    return q, q * q


# The bulk passes are bound by the divisions: one vector of partial sums per sum (as the
# C++ kernel's bulk) does as well as four. A LayerNorm pass over d = 768 (float64, in L1)
# took 482 ns with ``LANES`` partial sums in a scratch array, 265 ns so.
_bulk_ln2 = row_sums(_ln2_terms, 6, 1)
_bulk_sq = row_sums(_sq_terms, 2, 1)
_bulk_one = row_sums(_one_terms, 2, 1)


@jit
def _bulk(kind, x, mu, ca, cb, e, off):
    """(Naa, Nab, Nbb, N'aa, N'ab, N'bb) over the bulk (entries outside g1, g2)."""
    if kind == _LN2:
        r0, r1, r2, r3, r4, r5 = _bulk_ln2((x, e), (mu, off, 1.0))
        return ca * ca * r0, ca * cb * r1, cb * cb * r2, ca * ca * r3, ca * cb * r4, cb * cb * r5
    if kind == _RMS1:
        r0, r3 = _bulk_sq((x, e), (off, 1.0))
        return ca * ca * r0, 0.0, 0.0, ca * ca * r3, 0.0, 0.0
    r0, r3 = _bulk_one((e,), (off, 1.0))
    return ca * ca * r0, 0.0, 0.0, ca * ca * r3, 0.0, 0.0


# --------------------------------------------------------------------------- #
# Per-token pieces: columns at an index, group sums and ranks
# --------------------------------------------------------------------------- #


@jit
def _col(kind, x, mu, ca, cb, i):
    """(a_i, b_i)."""
    if kind == _LN2:
        return ca, cb * (_f64(x[i]) - mu)
    if kind == _RMS1:
        return ca * _f64(x[i]), 0.0
    return ca, 0.0


@jit
def _group(kind, x, mu, ca, cb, g, out):
    """S = sum_{i in g} u_i u_i^T into out[:4] = (S_aa, S_ab, S_bb, det S); returns rank S.

    Rank and determinant are exact: the rank from equalities of x, the determinant 0
    below rank 2 and, for two indices, (a_i b_j - a_j b_i)^2 (no cancellation)."""
    saa = 0.0
    sab = 0.0
    sbb = 0.0
    for i in g:
        a, b = _col(kind, x, mu, ca, cb, i)
        saa += a * a
        sab += a * b
        sbb += b * b
    m = g.size
    rank = 0
    if m > 0:
        if kind == _LN2:
            # a is constant: rank 1 iff x (hence b) is constant on g, or cb = 0.
            rank = 1
            if cb != 0.0:
                for i in g:
                    if x[i] != x[g[0]]:
                        rank = 2
                        break
        elif kind == _RMS1:
            if ca != 0.0:
                for i in g:
                    if x[i] != 0:
                        rank = 1
                        break
        else:
            rank = 1 if ca != 0.0 else 0
    det = 0.0
    if rank == 2:
        if m == 2:
            ai, bi = _col(kind, x, mu, ca, cb, g[0])
            aj, bj = _col(kind, x, mu, ca, cb, g[1])
            det = (ai * bj - aj * bi) ** 2
        else:
            det = max(saa * sbb - sab * sab, 0.0)
    out[0] = saa
    out[1] = sab
    out[2] = sbb
    out[3] = det
    return rank


@jit
def _tau_bound(kind, x, mu, ca, cb, delta, top, order):
    """Upper bound on D1 - lambda_max: lambda_min(D1 I - A_sub), A_sub the principal 2 x 2
    submatrix of A on the two largest delta (Cauchy interlacing), without cancellation."""
    i1 = order[0]
    i2 = order[1]
    a1, b1 = _col(kind, x, mu, ca, cb, i1)
    a2, b2 = _col(kind, x, mu, ca, cb, i2)
    d1 = delta[i1]
    d2 = delta[i2]
    n1 = a1 * a1 + b1 * b1
    n2 = a2 * a2 + b2 * b2
    gap = top[0] - d2
    t11 = d1 * n1
    t22 = gap + d2 * n2
    t12 = math.sqrt(d1 * d2) * (a1 * a2 + b1 * b2)
    det = d1 * (n1 * gap + d2 * (a1 * b2 - a2 * b1) ** 2)
    big = 0.5 * (t11 + t22) + math.hypot(0.5 * (t11 - t22), t12)
    return det / big if big > 0.0 else 0.0


@jit
def _eig2(p, q, r, det):
    """(mu_min, mu_max, v_max) of [[p, q], [q, r]] whose determinant is ``det``: the
    eigenvalue of larger magnitude from the trace, the other as det / it."""
    h = 0.5 * (p - r)
    m = 0.5 * (p + r)
    rad = math.hypot(h, q)
    if m >= 0.0:
        hi = m + rad
        lo = det / hi if hi != 0.0 else m - rad
    else:
        lo = m - rad
        hi = det / lo
    if h >= 0.0:
        v0, v1 = h + rad, q
    else:
        v0, v1 = q, rad - h
    nv = math.hypot(v0, v1)
    if nv == 0.0:
        return lo, hi, 1.0, 0.0
    return lo, hi, v0 / nv, v1 / nv


# --------------------------------------------------------------------------- #
# The secular solver. Points of the interval (lo, hi) are pairs (y, tau) =
# (lam - lo, hi - lam); the smaller one is the exact one.
# Interval state iv: [lo, hi, D1, D2, bulk pole p, kappa_a, kappa_b, flags]
#   flags = 1 * two columns + 2 * want the larger eigenvalue + 4 * g2 right of lam
# Group sums sg: (2, 4) rows (S_aa, S_ab, S_bb, det S) of g1 and g2.
# --------------------------------------------------------------------------- #


@jit
def _lam_of(iv, y, tau):
    return iv[1] - tau if tau <= y else iv[0] + y


@jit
def _target(iv, sg, m2, y, tau, naa, nab, nbb, paa, pab, pbb):
    """The target eigenvalue of G at (y, tau), given the bulk's N and N' there, and the
    pieces of the rational step: (target, psi, dpsi, dphi) with psi = -v^T R v (R: the
    right-pole terms) and dpsi, dphi the right and left parts of d(v^T G v)/dlam."""
    lo_p, hi_p, d1, d2, ka, kb = iv[0], iv[1], iv[2], iv[3], iv[5], iv[6]
    flags = int(iv[7])
    two = (flags & 1) != 0
    want_max = (flags & 2) != 0
    g2_right = (flags & 4) != 0
    near_hi = tau <= y
    if near_hi:
        lam = hi_p - tau
        den1 = (d1 - hi_p) + tau
        den2 = (d2 - hi_p) + tau
    else:
        lam = lo_p + y
        den1 = (d1 - lo_p) - y
        den2 = (d2 - lo_p) - y
    s1 = sg[0]
    s2 = sg[1]
    i1 = 1.0 / den1
    i2 = 1.0 / den2 if m2 > 0 else 0.0
    t2aa, t2ab, t2bb = s2[0] * i2, s2[1] * i2, s2[2] * i2
    # Right-pole terms R = sum S/den and R' = sum S/den^2; left derivative L' (G' = -R' - L').
    raa, rab, rbb = s1[0] * i1, s1[1] * i1, s1[2] * i1
    qaa, qab, qbb = raa * i1, rab * i1, rbb * i1
    daa = paa + ka / (lam * lam)
    dab = pab
    dbb = pbb + kb / (lam * lam)
    if g2_right:
        raa += t2aa
        rab += t2ab
        rbb += t2bb
        qaa += t2aa * i2
        qab += t2ab * i2
        qbb += t2bb * i2
    else:
        daa += t2aa * i2
        dab += t2ab * i2
        dbb += t2bb * i2
    gaa = ka / lam - naa - s1[0] * i1 - t2aa
    gab = -nab - s1[1] * i1 - t2ab
    gbb = kb / lam - nbb - s1[2] * i1 - t2bb
    if two:
        # det G with the term of the group at the nearer pole split off:
        # det(K - S/den) = det K - tr(adj(K) S)/den + det(S)/den^2.
        o = 0
        if near_hi:
            o = 2 if g2_right else 1
        elif not g2_right and m2 > 0:
            o = 2
        if o > 0:
            so = sg[o - 1]
            io = i1 if o == 1 else i2
            kaa = gaa + so[0] * io
            kab = gab + so[1] * io
            kbb = gbb + so[2] * io
            det = (kaa * kbb - kab * kab) - (kbb * so[0] - 2.0 * kab * so[1] + kaa * so[2]) * io
            det += so[3] * io * io
        else:
            det = gaa * gbb - gab * gab
        mn, mx, v0, v1 = _eig2(gaa, gab, gbb, det)
        if want_max:
            target = mx
        else:
            target = mn
            v0, v1 = -v1, v0
    else:
        target = gaa
        v0, v1 = 1.0, 0.0
    psi = -(v0 * v0 * raa + 2.0 * v0 * v1 * rab + v1 * v1 * rbb)
    dpsi = -(v0 * v0 * qaa + 2.0 * v0 * v1 * qab + v1 * v1 * qbb)
    dphi = -(v0 * v0 * daa + 2.0 * v0 * v1 * dab + v1 * v1 * dbb)
    return target, psi, dpsi, dphi


@jit
def _step(y, tau, target, psi, dpsi, dphi):
    """Root eta in (-y, tau) of the "middle way" model a0 - s_R/(tau - eta) + s_L/(y + eta),
    fitted to the target's value and split derivative at eta = 0; NaN if none."""
    s_r = -dpsi * tau * tau
    s_l = -dphi * y * y
    a0 = (psi + s_r / tau) + ((target - psi) - s_l / y)
    # -a0 eta^2 + b1 eta + c0 = 0 with c0 = tau y target (the model is exact at eta = 0).
    c0 = tau * y * target
    b1 = a0 * (tau - y) - s_r - s_l
    disc = b1 * b1 + 4.0 * a0 * c0
    sq = math.sqrt(disc) if disc > 0.0 else 0.0
    qq = 0.5 * (b1 + math.copysign(sq, b1))
    if qq != 0.0:
        eta = -c0 / qq
        if -y < eta < tau:
            return eta
    if a0 != 0.0:
        eta = qq / a0
        if -y < eta < tau:
            return eta
    return math.nan


@jit
def _advance(iv, br, y, tau, eta):
    """The point (y, tau) moved by eta, if strictly inside the bracket br = (ylo, tlo,
    yhi, thi); else the bracket's midpoint. Returns (y, tau, moved)."""
    w = iv[1] - iv[0]
    if not math.isnan(eta):
        if tau <= y:
            nt = tau - eta
            ny = w - nt
        else:
            ny = y + eta
            nt = w - ny
        inside = (br[3] < nt < br[1]) if nt <= ny else (br[0] < ny < br[2])
        if inside:
            return ny, nt, True
    return 0.5 * (br[0] + br[2]), 0.5 * (br[1] + br[3]), False


@jit
def _narrow(br, y, tau, target):
    """Update the bracket with the sign of the target at (y, tau) (it decreases in lam)."""
    if target > 0.0:
        br[0] = y
        br[1] = tau
    elif target < 0.0:
        br[2] = y
        br[3] = tau


@jit
def _bracket_done(iv, br):
    """The bracket is a few ulps wide (relative to its lower end)."""
    lam_lo = iv[0] + br[0]
    return br[2] - br[0] <= 4e-16 * lam_lo or br[1] - br[3] <= 4e-16 * lam_lo


@jit
def _model_root(iv, sg, m2, an, br0, br, y, tau):
    """Root of the model secular function, iterated to full precision (O(1) per step).

    The model is G with the bulk N(lam) replaced by its rational fit at the anchor an =
    (y_a, tau_a, N, N'): N(lam) ~ N_a + N'_a (lam_a - p)(lam - lam_a)/(lam - p), p the
    largest bulk pole, exact in value and derivative at lam_a; the groups g1, g2 and the
    kappa term are exact. br0 is the outer bracket, br scratch for the inner one."""
    for k in range(4):
        br[k] = br0[k]
    lo_p, hi_p, p = iv[0], iv[1], iv[4]
    ya, ta = an[0], an[1]
    la_p = (lo_p - p) + ya if ya < ta else (hi_p - p) - ta  # lam_a - p
    for _ in range(_MAX_IT):
        if tau <= y:
            dl = ta - tau
            l_p = (hi_p - p) - tau
        else:
            dl = y - ya
            l_p = (lo_p - p) + y
        r = la_p / l_p
        f = r * dl
        r2 = r * r
        target, psi, dpsi, dphi = _target(
            iv, sg, m2, y, tau, an[2] + an[5] * f, an[3] + an[6] * f, an[4] + an[7] * f,
            an[5] * r2, an[6] * r2, an[7] * r2,
        )
        _narrow(br, y, tau, target)
        if target == 0.0:
            return y, tau
        eta = _step(y, tau, target, psi, dpsi, dphi)
        # Converged: the point is within |eta| of the model's root. (Tested before the
        # bracket: the point itself may have just become an end of it.)
        if abs(eta) <= max(_INNER_STOP * min(y, tau), _LAM_STOP * _lam_of(iv, y, tau)):
            return y, tau
        y, tau, moved = _advance(iv, br, y, tau, eta)
        if not moved and _bracket_done(iv, br):
            return y, tau
    return y, tau


@jit
def _lambda_max(kind, x, mu, ca, cb, ka, kb, delta, top, g1, g2, offs, order, work):
    """lambda_max of D^1/2 (I - U U^T) D^1/2 for one token (see the module docstring).

    work: float64 scratch of 32 values."""
    d1, d2, d3 = top[0], top[1], top[2]
    if d1 == 0.0:
        return 0.0
    sg = work[0:8].reshape(2, 4)
    iv = work[8:16]
    an = work[16:24]
    br0 = work[24:28]
    br = work[28:32]
    m1 = g1.size
    m2 = g2.size
    r1 = _group(kind, x, mu, ca, cb, g1, sg[0])
    if m1 > r1:
        return d1
    r2 = _group(kind, x, mu, ca, cb, g2, sg[1])
    two = kind == _LN2
    tau_r = _tau_bound(kind, x, mu, ca, cb, delta, top, order)
    gap = d1 - d2
    # The anchor of the first model: D2 when the interval must be decided there (or when
    # the bound is of no use), else the lower bound lam_R = D1 - tau_R, else D1/2.
    need_limit = m1 == 1 and r2 < 2 and d2 > 0.0 and not (tau_r < gap)
    if d2 > 0.0 and (need_limit or not (0.0 < tau_r < gap)):
        at, e_a, off_a = 0, offs[1], 0.0
    elif 0.0 < tau_r < gap:
        at, e_a, off_a = 1, offs[0], tau_r
    else:
        at, e_a, off_a = 2, offs[0], 0.5 * d1
    # (One call site per helper keeps Numba's compile time down: LLVM inlines each site.)
    naa, nab, nbb, paa, pab, pbb = _bulk(kind, x, mu, ca, cb, e_a, off_a)
    in_top = True
    if need_limit:
        # The eigenvalue of G that stays finite as lam -> D2+ (g2 removed, at lam = D2).
        inv = 1.0 / gap
        kaa = ka / d2 - naa - sg[0, 0] * inv
        kab = -nab - sg[0, 1] * inv
        kbb = kb / d2 - nbb - sg[0, 2] * inv
        if r2 == 1:
            pa = 0.0
            pb = 0.0
            for i in g2:
                pa, pb = _col(kind, x, mu, ca, cb, i)
                if pa != 0.0 or pb != 0.0:
                    break
            lim = pb * pb * kaa - 2.0 * pa * pb * kab + pa * pa * kbb  # u_perp = (-pb, pa)
        else:
            lim = kaa if not two else 0.5 * (kaa + kbb) - math.hypot(0.5 * (kaa - kbb), kab)
        in_top = lim > 0.0
    if in_top:
        lo_p, hi_p = d2, d1
        e_hi, e_lo = offs[0], offs[1]
        flags = (1 if two else 0) + (2 if m1 != 1 else 0)
    else:
        if m2 > r2:
            return d2
        lo_p, hi_p = d3, d2
        e_hi, e_lo = offs[1], offs[2]
        flags = (1 if two else 0) + 2 + 4
    w = hi_p - lo_p
    iv[0] = lo_p
    iv[1] = hi_p
    iv[2] = d1
    iv[3] = d2
    iv[4] = d3
    iv[5] = ka
    iv[6] = kb
    iv[7] = flags
    br0[0], br0[1], br0[2], br0[3] = 0.0, w, w, 0.0
    if at == 0:
        ya, ta = (0.0, w) if in_top else (w, 0.0)
    elif at == 1:
        ya, ta = w - tau_r, tau_r
    else:
        ya, ta = 0.5 * w, 0.5 * w
    an[0], an[1] = ya, ta
    an[2], an[3], an[4], an[5], an[6], an[7] = naa, nab, nbb, paa, pab, pbb
    evaluated = at != 0  # the anchor is an interior point: its true target is known
    if evaluated:
        target, _, _, _ = _target(iv, sg, m2, ya, ta, naa, nab, nbb, paa, pab, pbb)
        _narrow(br0, ya, ta, target)
        y, tau = ya, ta
    elif in_top and 0.0 < tau_r < w:
        y, tau = w - tau_r, tau_r
    else:
        y, tau = 0.5 * w, 0.5 * w
    for _ in range(_MAX_IT):
        y, tau = _model_root(iv, sg, m2, an, br0, br, y, tau)
        if evaluated:
            dist = abs(an[1] - tau) if tau <= y else abs(y - an[0])
            if dist <= max(_STOP * min(y, tau), _LAM_STOP * _lam_of(iv, y, tau)):
                return _lam_of(iv, y, tau)
        inside = (br0[3] < tau < br0[1]) if tau <= y else (br0[0] < y < br0[2])
        if not inside:
            y, tau = 0.5 * (br0[0] + br0[2]), 0.5 * (br0[1] + br0[3])
            if _bracket_done(iv, br0):
                return _lam_of(iv, y, tau)
        e, off = (e_hi, tau) if tau <= y else (e_lo, -y)
        naa, nab, nbb, paa, pab, pbb = _bulk(kind, x, mu, ca, cb, e, off)
        target, _, _, _ = _target(iv, sg, m2, y, tau, naa, nab, nbb, paa, pab, pbb)
        if target == 0.0:
            return _lam_of(iv, y, tau)
        _narrow(br0, y, tau, target)
        an[0], an[1] = y, tau
        an[2], an[3], an[4], an[5], an[6], an[7] = naa, nab, nbb, paa, pab, pbb
        evaluated = True
    return _lam_of(iv, y, tau)
