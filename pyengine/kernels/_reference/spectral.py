"""NumPy reference of the spectral kernels: exact sigma_max and fused power iteration.

Same kernel contract as :mod:`pyengine.kernels._reference.layernorm` (C-contiguous float32 or
float64 ``x`` of shape (n, d), ``gamma`` (d,) of the same dtype, preallocated outputs,
the bad-row count returned), except that every output here is float64 (``iterations``
int64) whatever the dtype of ``x``. A row is bad when its statistics are not finite
(NaN/Inf in ``x``, or in ``v0``) or its scale is zero; its outputs are NaN (0
iterations).

Exact sigma_max (``*_sigma_max``)
---------------------------------
Per token, with D = diag(gamma^2) and the scale s (LayerNorm) or r (RMSNorm),

    s^2 J^T J  has the eigenvalues of  A = D^1/2 (I - U U^T) D^1/2,

U = [a, b] with orthogonal columns (the "downdate" directions, scaled):

* LayerNorm: J = diag(gamma)/s (I - e1 e1^T - c e2 e2^T), e1 = 1/sqrt(d), e2 = xh/|xh|,
  c = var/(var + eps), and (I - e1 e1^T - c e2 e2^T)^2 = I - e1 e1^T - (2c - c^2) e2 e2^T,
  so a = e1, b = sqrt(2c - c^2) e2 = sqrt((2 - c)/d) xh. Frozen scale: b = 0.
* RMSNorm: J = diag(gamma)/r (I - c e e^T), e = x/|x|, c = ms/(ms + eps):
  a = sqrt((2 - c)/d) x/r, b = 0. Frozen scale: J = diag(gamma)/r, sigma = max|gamma|/r.

U^T U = I - diag(kappa) exactly, kappa = (0, (1 - c)^2) for LayerNorm ((0, 1) frozen),
kappa = ((1 - c)^2, 1) for RMSNorm, with 1 - c = eps/(var + eps) computed as written
(no cancellation). sigma_max = sqrt(lambda_max(A))/s.

The count. For lambda not an eigenvalue of D, Haynsworth's inertia additivity on
[[D - lambda I, D^1/2 U], [U^T D^1/2, I]] (whose two Schur complements are
A - lambda I and I - M(lambda), M = sum_i delta_i u_i u_i^T/(delta_i - lambda), u_i the
i-th row of U) gives the number of eigenvalues of A above lambda:

    n_>(lambda) = #{i : delta_i > lambda} + npos(I - M(lambda)) - 2,

and I - M(lambda) = diag(kappa) - lambda N(lambda), N = sum_i u_i u_i^T/(delta_i - lambda)
(from U^T U = I - diag(kappa)), a 2 x 2 matrix per token that costs O(d).
lambda_max = sup{lambda : n_>(lambda) >= 1} lies in [0, max delta]; the reference finds it
by bisection on the count, vectorized over tokens, until the bracket is one ulp wide
(full relative precision; slow, but obviously right). A midpoint that hits a pole
(an entry of delta) exactly is moved to the middle of the upper half.

Power iteration (``*_power_iteration``)
---------------------------------------
Per token, from v = v0/|v0|, for k = 1 .. max_iter: u = J v, w = J^T u (one product
J^T J), rho = |u|^2 (the Rayleigh quotient), residual = |w - rho v| / rho; stop when
residual <= tol, else v = w/|w|. Outputs: sigma = |J v| = sqrt(rho) for the last unit v
(a lower bound of sigma_max up to rounding), the residual at exit, and k (the number of
products). A zero Rayleigh quotient (v in the null space of J, e.g. v0 constant for
LayerNorm) or a zero v0 stops with sigma = 0 and residual = inf: not converged; so does
w = 0 exactly (no next vector). The zero operator (LayerNorm, eps = 0, d = 2, full mode: J = 0)
gives sigma = 0, residual = 0 (converged) and 0 iterations, as the exact method; every other
row reports iterations in [1, max_iter].
Internal arithmetic is float64.
"""

from __future__ import annotations

import numpy as np

from ...backends import register
from .layernorm import _finite_rows, _ln_stats, _scale, row_scale

__all__ = [
    "layer_norm_power_iteration",
    "layer_norm_sigma_max",
    "rms_norm_power_iteration",
    "rms_norm_sigma_max",
]

#: Upper bound on bisection steps: each halves the bracket [lo, hi] within [0, h],
#: and it reaches one ulp, or hi < 2^-100 h, within about 160 halvings. A safety net.
_MAX_BISECT = 400


# --------------------------------------------------------------------------- #
# Exact sigma_max
# --------------------------------------------------------------------------- #


def _row_stats(norm, x, eps):
    """Rows scaled by c (``layernorm.row_scale``) and centred (c (x - mu), or c x for RMSNorm)
    in float64, their mean square and scale^2 (n, 1) (including c^2 eps), c (n, 1) and the bad
    rows (n,). The true scale is sqrt(scale^2) / c; ratios such as xh need no c."""
    with np.errstate(invalid="ignore", over="ignore"):
        if norm == "layer_norm":
            xc, ms, c = _ln_stats(x, eps)
        else:
            xd = x.astype(np.float64)
            c = row_scale(xd, eps)
            xc = xd * c
            ms = np.mean(xc * xc, axis=-1, keepdims=True)
        s, bad = _scale(ms, eps, c)
        bad |= ~_finite_rows(xc)
    return xc, ms, s * s, c, bad


def _downdate(x, eps, frozen, norm):
    """Per-token columns a, b (n, d), kappa (n, 2), scale^2 (n,) and c (n,) of the scaled row, bad rows (n,)."""
    n, d = x.shape
    xc, ms, s2, cs, bad = _row_stats(norm, x, eps)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        one_minus_c = eps * cs * cs / s2  # 1 - c = eps / (ms + eps), no cancellation
        c = ms / s2
        col = np.sqrt((2.0 - c) / (d * s2)) * xc  # sqrt((2 - c)/d) * xh
        kappa = np.empty((n, 2))
        if norm == "layer_norm":
            a = np.broadcast_to(1.0 / np.sqrt(d), (n, d))
            b = np.zeros((n, d)) if frozen else col
            kappa[:, 0] = 0.0
            kappa[:, 1] = 1.0 if frozen else one_minus_c[:, 0] ** 2
        else:
            a, b = col, np.zeros((n, d))
            kappa[:, 0] = one_minus_c[:, 0] ** 2
            kappa[:, 1] = 1.0
    return a, b, kappa, s2[:, 0], cs[:, 0], bad


def _count_above(lam, delta, a, b, kappa):
    """n_>(lam): eigenvalues of A above lam, per token. lam (n,) must avoid every delta_i."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = 1.0 / (delta[None, :] - lam[:, None])  # (n, d)
        naa = np.einsum("nd,nd,nd->n", q, a, a)
        nab = np.einsum("nd,nd,nd->n", q, a, b)
        nbb = np.einsum("nd,nd,nd->n", q, b, b)
        h = np.empty((lam.size, 2, 2))
        h[:, 0, 0] = kappa[:, 0] - lam * naa
        h[:, 0, 1] = h[:, 1, 0] = -lam * nab
        h[:, 1, 1] = kappa[:, 1] - lam * nbb
    npos = (np.linalg.eigvalsh(h) > 0).sum(axis=1)
    return (delta[None, :] > lam[:, None]).sum(axis=1) + npos - 2


def _lambda_max(delta, a, b, kappa):
    """sup{lam : n_>(lam) >= 1} per token, by bisection on [0, max delta] to one ulp."""
    n = a.shape[0]
    top = float(delta.max()) if delta.size else 0.0
    lo = np.zeros(n)
    hi = np.full(n, top)
    poles = np.unique(delta)
    for _ in range(_MAX_BISECT):
        mid = 0.5 * (lo + hi)
        # Stop at one ulp, or once lambda_max < 2^-100 max(delta): zero to all precision
        # that sigma can show (sqrt(2^-100) = 1e-15 of the largest possible sigma).
        active = (mid > lo) & (mid < hi) & (hi > top * 2.0**-100)
        if not active.any():
            break
        # Never evaluate at a pole: move to the middle of the upper half instead.
        at_pole = np.isin(mid, poles) & active
        while at_pole.any():
            moved = 0.5 * (mid[at_pole] + hi[at_pole])
            # One ulp below hi the midpoint rounds back: then the bracket is done.
            mid[at_pole] = np.where(moved == mid[at_pole], hi[at_pole], moved)
            at_pole &= (mid < hi) & np.isin(mid, poles)
        idx = np.flatnonzero(active & (mid < hi))
        if idx.size == 0:
            break
        above = _count_above(mid[idx], delta, a[idx], b[idx], kappa[idx]) >= 1
        lo[idx[above]] = mid[idx[above]]
        hi[idx[~above]] = mid[idx[~above]]
    # One ulp apart: hi (exact when lambda_max is a pole, e.g. max delta); below the floor,
    # lo (0 when lambda_max = 0).
    return np.where(hi > top * 2.0**-100, hi, lo)


def _sigma_max(norm, x, gamma, eps, frozen, out):
    g = gamma.astype(np.float64)
    delta = g * g
    a, b, kappa, s2, cs, bad = _downdate(x, eps, frozen, norm)
    if norm == "rms_norm" and frozen:
        lam = np.full(x.shape[0], float(delta.max()))
    else:
        good = ~bad
        lam = np.full(x.shape[0], np.nan)
        lam[good] = _lambda_max(delta, a[good], b[good], kappa[good])
    with np.errstate(invalid="ignore"):
        out[...] = np.sqrt(lam / s2) * cs  # sigma = sqrt(lam) / s, s = sqrt(s2) / c
    out[bad] = np.nan
    return int(bad.sum())


@register("layer_norm_sigma_max", "numpy")
def layer_norm_sigma_max(x, gamma, eps, frozen, out):
    """Exact largest singular value of each token's LayerNorm Jacobian; out (n,) float64."""
    return _sigma_max("layer_norm", x, gamma, eps, frozen, out)


@register("rms_norm_sigma_max", "numpy")
def rms_norm_sigma_max(x, gamma, eps, frozen, out):
    """Exact largest singular value of each token's RMSNorm Jacobian; out (n,) float64."""
    return _sigma_max("rms_norm", x, gamma, eps, frozen, out)


# --------------------------------------------------------------------------- #
# Power iteration
# --------------------------------------------------------------------------- #


def _power_iteration(norm, x, gamma, eps, frozen, v0, tol, max_iter, sigma, residual, iterations):
    """Batched power iteration on J^T J, alternating the reference JVP and VJP kernels."""
    from . import layernorm as ln

    jvp = ln.layer_norm_jvp if norm == "layer_norm" else ln.rms_norm_jvp
    vjp = ln.layer_norm_vjp if norm == "layer_norm" else ln.rms_norm_vjp
    n, d = x.shape
    g = gamma.astype(np.float64)
    x64 = x.astype(np.float64)
    _, _, _, _, bad = _row_stats(norm, x, eps)
    v = v0.astype(np.float64)
    bad |= ~_finite_rows(v)
    with np.errstate(invalid="ignore", over="ignore"):
        norm0 = np.sqrt(np.einsum("nd,nd->n", v, v))
        v /= np.where(norm0 > 0, norm0, 1.0)[:, None]
    sigma[...] = 0.0
    residual[...] = np.inf
    iterations[...] = 0
    zero = norm == "layer_norm" and not frozen and eps == 0 and d == 2  # J = 0 exactly: 0 iterations
    if zero:
        sigma[~bad], residual[~bad] = 0.0, 0.0
    active = np.flatnonzero(~bad & (norm0 > 0) & (not zero))
    u = np.empty((n, d))
    w = np.empty((n, d))
    for k in range(1, max_iter + 1):
        if active.size == 0:
            break
        whole = active.size == n  # no copies while every token is still iterating
        xa, va = (x64, v) if whole else (x64[active], v[active])
        ua, wa = u[: active.size], w[: active.size]
        jvp(xa, va, g, eps, frozen, ua)
        vjp(xa, ua, g, eps, frozen, wa)
        rho = np.einsum("nd,nd->n", ua, ua)
        with np.errstate(invalid="ignore", divide="ignore"):
            r = wa - rho[:, None] * va
            res = np.sqrt(np.einsum("nd,nd->n", r, r)) / rho
        res[rho == 0] = np.inf
        sigma[active] = np.sqrt(rho)
        residual[active] = res
        iterations[active] = k
        wn = np.sqrt(np.einsum("nd,nd->n", wa, wa))
        go = (res > tol) & (rho > 0) & (wn > 0)  # wn = 0: J^T J v = 0 exactly, no next vector
        if whole and go.all():
            np.divide(wa, wn[:, None], out=v)
        else:
            v[active[go]] = wa[go] / wn[go, None]
        active = active[go]
    sigma[bad] = np.nan
    residual[bad] = np.nan
    return int(bad.sum())


@register("layer_norm_power_iteration", "numpy")
def layer_norm_power_iteration(x, gamma, eps, frozen, v0, tol, max_iter, sigma, residual, iterations):
    """Power iteration on J^T J per token of LayerNorm; sigma, residual (n,) float64, iterations (n,) int64."""
    return _power_iteration(
        "layer_norm", x, gamma, eps, frozen, v0, tol, max_iter, sigma, residual, iterations
    )


@register("rms_norm_power_iteration", "numpy")
def rms_norm_power_iteration(x, gamma, eps, frozen, v0, tol, max_iter, sigma, residual, iterations):
    """Power iteration on J^T J per token of RMSNorm; sigma, residual (n,) float64, iterations (n,) int64."""
    return _power_iteration(
        "rms_norm", x, gamma, eps, frozen, v0, tol, max_iter, sigma, residual, iterations
    )

from . import spectral_lanczos  # noqa: E402,F401  (registers the fused Lanczos kernels)
