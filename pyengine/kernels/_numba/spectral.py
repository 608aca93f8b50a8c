"""Numba spectral kernels: exact sigma_max (secular equation) and fused power iteration.

Same kernel contract, parameter names and outputs as :mod:`pyengine.kernels._reference.spectral`,
whose docstring states the mathematics; this module adds the fast solver.

Exact sigma_max
---------------
lambda_max of A = D^1/2 (I - U U^T) D^1/2 (D = diag(gamma^2), U = [a, b] per token, at
most rank 2) is found per token by the secular-equation solver in
:mod:`pyengine.kernels._numba._secular` (its docstring states the algorithm); this module holds
the batch kernels around it.

Special cases: frozen LayerNorm (b = 0, a = 1/sqrt(d)) depends on gamma alone: one
solve per call, sigma = sqrt(lam)/s per token; a constant row (var = 0, eps > 0) has
the same Jacobian; LayerNorm with d = 2 has the closed form
sigma = (1 - c) sqrt(mean(gamma^2))/s ((1 - c) -> 1 when frozen); frozen RMSNorm is
max|gamma|/r.

Accuracy: the eigenvalue problem is solved to a few ulps; its data (u_i from the
float64 row statistics) carry rounding, which moves lambda by about eps * max(delta), so
the relative error of sigma is about eps * (max|gamma| / (s sigma))^2 at worst (1e-15
typically; ~1e-13 when a huge x entry sits at the largest gamma of a short row).

Power iteration
---------------
Per token, in a float64 scratch row v (one per thread), two passes over d per product
J^T J, with xh = (x - mu)/s formed on the fly from x: (B) u = J v on the fly, summing
|u|^2, sum gamma u, sum xh gamma u; (C) w = J^T u (u recomputed), summing
|w - rho v|^2 (directly, not expanded: the residual must reach far below sqrt(eps)),
|w|^2 and the next product's sums of w and xh w, storing w over v (normalized lazily
through a carried factor). The existing JVP/VJP row cores of ``layernorm.py`` do not
fit: they round to the dtype of x on the store and recompute the row statistics on
every call. The passes are inlined into the per-token loop and compiled with
``_jit.CONTRACT`` (multiply-adds fused, as in the C++ kernel): Numba/C++ at (8192, 768)
float32, 10 iterations, 1.45 -> 1.29; (1024, 4096) 1.37 -> 1.17.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from ...backends import register
from ._jit import fma_inline, fma_jit, jit, pjit
from ._reduce import LANES, _f64, _fold, _mean_sq, _scale, _zero
from ._secular import _LN1, _LN2, _RMS1, _lambda_max, _pole_data

__all__ = [
    "layer_norm_power_iteration",
    "layer_norm_sigma_max",
    "rms_norm_power_iteration",
    "rms_norm_sigma_max",
]


# --------------------------------------------------------------------------- #
# Registered batch kernels: exact sigma_max
# --------------------------------------------------------------------------- #


@jit
def _sigma_row(kind, row, eps, frozen, lam_frozen, mean_delta, delta, top, g1, g2, offs, order,
               work):
    """(sigma_max, bad) of one token; row is its float64 copy. kind _LN1 instead returns
    (lambda_max of frozen LayerNorm, False): a function of gamma alone."""
    d = row.size
    mu = 0.0
    s = 1.0
    if kind == _LN1:
        if d == 2:
            return mean_delta, False
        solve, lam = True, 0.0
        ca, cb, ka, kb = 1.0 / math.sqrt(d), 0.0, 0.0, 1.0
    else:
        centre = kind == _LN2
        mu, ms = _mean_sq(row, centre)
        s, bad = _scale(ms, eps)
        if bad or not np.isfinite(mu):
            return np.nan, True
        s2 = s * s
        omc = eps / s2  # 1 - c, no cancellation
        c = ms / s2
        col = math.sqrt((2.0 - c) / (d * s2))
        solve = not frozen and ms != 0.0 and not (centre and d == 2)
        if centre:
            # Frozen, or a constant row (same Jacobian), from the per-call solve; d = 2 closed.
            lam = omc * omc * mean_delta if d == 2 and not frozen and ms != 0.0 else lam_frozen
            ca, cb, ka, kb = 1.0 / math.sqrt(d), col, 0.0, omc * omc
        else:
            lam = top[0]  # frozen, or x = 0: J = diag(gamma)/r
            ca, cb, ka, kb = col, 0.0, omc * omc, 1.0
    if solve:  # the one call site of the solver (see _lambda_max on compile time)
        lam = _lambda_max(kind, row, mu, ca, cb, ka, kb, delta, top, g1, g2, offs, order, work)
    if kind == _LN1:
        return lam, False
    return math.sqrt(lam) / s, False


@pjit
def _sigma_max(kind, x, eps, frozen, lam_frozen, delta, top, g1, g2, offs, order, out):
    """x : (n, d); out : (n,) float64. Returns the number of bad rows."""
    n, d = x.shape
    mean_delta = 0.0
    for i in range(d):
        mean_delta += delta[i]
    mean_delta /= d
    nbad = 0
    for r in prange(n):
        work = np.empty(32, dtype=np.float64)  # hoisted: once per thread
        row = np.empty(d, dtype=np.float64)
        xr = x[r]
        for i in range(d):  # float64 copy: the solver is compiled once, for float64
            row[i] = xr[i]
        sg, bad = _sigma_row(kind, row, eps, frozen, lam_frozen, mean_delta, delta, top, g1, g2,
                             offs, order, work)
        out[r] = sg
        if bad:
            nbad += 1
    return nbad


def _sigma_max_call(kind, x, gamma, eps, frozen, out):
    delta, top, g1, g2, offs, order = _pole_data(gamma)
    lam_frozen = 0.0
    if kind == _LN2 and x.shape[0] > 0:
        # Frozen LayerNorm depends on gamma alone: one solve per call, through the same
        # compiled kernel (x[:1] only fixes the types; its values are not read).
        one = np.empty(1)
        _sigma_max(_LN1, x[:1], 0.0, False, 0.0, delta, top, g1, g2, offs, order, one)
        lam_frozen = float(one[0])
    return _sigma_max(kind, x, float(eps), bool(frozen), lam_frozen, delta, top, g1, g2, offs,
                      order, out)


@register("layer_norm_sigma_max", "numba")
def layer_norm_sigma_max(x, gamma, eps, frozen, out):
    """x : (n, d); gamma : (d,); out : (n,) float64. Returns the number of bad rows."""
    return _sigma_max_call(_LN2, x, gamma, eps, frozen, out)


@register("rms_norm_sigma_max", "numba")
def rms_norm_sigma_max(x, gamma, eps, frozen, out):
    """x : (n, d); gamma : (d,); out : (n,) float64. Returns the number of bad rows."""
    return _sigma_max_call(_RMS1, x, gamma, eps, frozen, out)


# --------------------------------------------------------------------------- #
# Fused power iteration
# --------------------------------------------------------------------------- #


@fma_inline
def _pass_b(x, g, v, mu, inv, alpha, mv, m2, acc):
    """u = g inv (alpha v - mv - xh m2), xh = (x - mu) inv, on the fly; returns
    (|u|^2, sum g u, sum xh g u). acc : (4, LANES) (_reduce.py explains the lanes)."""
    d = v.size
    _zero(acc, 3)
    a = acc[0]
    b = acc[1]
    c = acc[2]
    nb = d // LANES
    for j in range(nb):
        o = j * LANES
        for k in range(LANES):
            i = o + k
            gi = _f64(g[i])
            xi = (_f64(x[i]) - mu) * inv
            u = gi * (inv * ((alpha * v[i] - mv) - xi * m2))
            gu = gi * u
            a[k] += u * u
            b[k] += gu
            c[k] += xi * gu
    uu = _fold(a)
    sg = _fold(b)
    sxg = _fold(c)
    for i in range(nb * LANES, d):
        gi = _f64(g[i])
        xi = (_f64(x[i]) - mu) * inv
        u = gi * (inv * ((alpha * v[i] - mv) - xi * m2))
        gu = gi * u
        uu += u * u
        sg += gu
        sxg += xi * gu
    return uu, sg, sxg


@fma_inline
def _pass_c(x, g, v, mu, inv, alpha, mv, m2, mg, m2g, rho, acc):
    """w = inv (g u - mg - xh m2g) (u recomputed); v <- w; returns
    (|w - rho alpha v|^2, |w|^2, sum w, sum xh w). acc : (4, LANES)."""
    d = v.size
    _zero(acc, 4)
    a = acc[0]
    b = acc[1]
    c = acc[2]
    e = acc[3]
    nb = d // LANES
    for j in range(nb):
        o = j * LANES
        for k in range(LANES):
            i = o + k
            gi = _f64(g[i])
            xi = (_f64(x[i]) - mu) * inv
            vi = alpha * v[i]
            u = gi * (inv * ((vi - mv) - xi * m2))
            wi = inv * ((gi * u - mg) - xi * m2g)
            t = wi - rho * vi
            a[k] += t * t
            b[k] += wi * wi
            c[k] += wi
            e[k] += xi * wi
            v[i] = wi
    rr = _fold(a)
    ww = _fold(b)
    sw = _fold(c)
    sxw = _fold(e)
    for i in range(nb * LANES, d):
        gi = _f64(g[i])
        xi = (_f64(x[i]) - mu) * inv
        vi = alpha * v[i]
        u = gi * (inv * ((vi - mv) - xi * m2))
        wi = inv * ((gi * u - mg) - xi * m2g)
        t = wi - rho * vi
        rr += t * t
        ww += wi * wi
        sw += wi
        sxw += xi * wi
        v[i] = wi
    return rr, ww, sw, sxw


@fma_jit
def _power_row(centre, x, g, eps, frozen, v0, tol, max_iter, v, acc):
    """Power iteration of one token; returns (bad, sigma, residual, iterations).

    v : (d,) float64 scratch holding the last w unnormalized; alpha = 1/|w| is carried
    along, and pass C also sums w and xh w, the first sums of the next product: two
    passes over d per product J^T J."""
    d = x.size
    mu, ms = _mean_sq(x, centre)
    s, bad = _scale(ms, eps)
    if bad or not np.isfinite(mu):
        return True, np.nan, np.nan, 0
    inv = 1.0 / s
    vv = 0.0
    sv = 0.0
    sxv = 0.0
    for i in range(d):
        t = _f64(v0[i])
        v[i] = t
        vv += t * t
        sv += t
        sxv += (_f64(x[i]) - mu) * inv * t
    if not np.isfinite(vv):
        return True, np.nan, np.nan, 0
    # LayerNorm with eps = 0 and d = 2 (full mode): J = 0 exactly; sigma 0, residual 0, 0 iterations
    if centre and not frozen and eps == 0.0 and d == 2:
        return False, 0.0, 0.0, 0
    if vv == 0.0:
        return False, 0.0, np.inf, 0
    alpha = 1.0 / math.sqrt(vv)
    sigma = 0.0
    res = np.inf
    k = 0
    while k < max_iter:
        k += 1
        mv = alpha * sv / d if centre else 0.0
        m2 = 0.0 if frozen else alpha * sxv / d
        rho, sg, sxg = _pass_b(x, g, v, mu, inv, alpha, mv, m2, acc)
        mg = sg / d if centre else 0.0
        m2g = 0.0 if frozen else sxg / d
        rr, ww, sv, sxv = _pass_c(x, g, v, mu, inv, alpha, mv, m2, mg, m2g, rho, acc)
        sigma = math.sqrt(rho)
        if rho == 0.0:
            res = np.inf
            break
        res = math.sqrt(rr) / rho
        if res <= tol or ww == 0.0:  # J^T J v = 0 exactly: no next vector (not converged)
            break
        alpha = 1.0 / math.sqrt(ww)
    return False, sigma, res, k


@pjit
def _power_iteration(centre, x, g, eps, frozen, v0, tol, max_iter, sigma, residual, iterations):
    n, d = x.shape
    nbad = 0
    for r in prange(n):
        acc = np.empty((4, LANES), dtype=np.float64)  # hoisted: once per thread
        v = np.empty(d, dtype=np.float64)
        bad, sg, res, k = _power_row(centre, x[r], g, eps, frozen, v0[r], tol, max_iter, v, acc)
        sigma[r] = sg
        residual[r] = res
        iterations[r] = k
        if bad:
            nbad += 1
    return nbad


@register("layer_norm_power_iteration", "numba")
def layer_norm_power_iteration(x, gamma, eps, frozen, v0, tol, max_iter, sigma, residual, iterations):
    """x, v0 : (n, d); gamma : (d,); sigma, residual : (n,) float64; iterations : (n,) int64."""
    return _power_iteration(True, x, gamma, float(eps), bool(frozen), v0, float(tol),
                            int(max_iter), sigma, residual, iterations)


@register("rms_norm_power_iteration", "numba")
def rms_norm_power_iteration(x, gamma, eps, frozen, v0, tol, max_iter, sigma, residual, iterations):
    """x, v0 : (n, d); gamma : (d,); sigma, residual : (n,) float64; iterations : (n,) int64."""
    return _power_iteration(False, x, gamma, float(eps), bool(frozen), v0, float(tol),
                            int(max_iter), sigma, residual, iterations)

from . import spectral_lanczos  # noqa: E402,F401  (registers the fused Lanczos kernels)
