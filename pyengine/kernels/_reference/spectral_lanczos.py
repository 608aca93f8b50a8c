"""NumPy reference of the fused per-token Lanczos kernels (``*_lanczos``).

Contract (as the power-iteration kernels of :mod:`.spectral`): ``x`` (n, d) C-contiguous
float32/float64, ``gamma`` (d,) of its dtype, ``v0`` (n, d) float64 start vectors (those of
the generic solver, ``spectral_norm``), outputs ``sigma``, ``residual`` (n,) float64 and
``iterations`` (n,) int64; returns the number of bad rows (non-finite statistics, NaN/Inf in
v0, zero scale), whose outputs are NaN with 0 iterations. A zero v0 gives sigma 0,
residual inf (not converged); the zero operator (LayerNorm, eps = 0, d = 2, full mode)
sigma 0, residual 0 and 0 iterations.

The algorithm, per token, is stated in :mod:`pyengine.kernels._numba.spectral_lanczos`
(symmetric Lanczos on K^T K, K = s J, with full reorthogonalization, the Ritz pair
verified with one explicit product, iterations <= max_iter). This reference runs it one
token at a time with NumPy vector operations and ``numpy.linalg.eigh`` for the small
tridiagonal problem (where the compiled kernels use bisection and inverse iteration), so
it agrees with them to rounding, not bit for bit. The public entry point for NumPy users
is the generic batched solver (``spectral_norm(..., method="lanczos", backend="numpy")``),
which the tests also compare against.
"""

from __future__ import annotations

import numpy as np

from ...backends import register
from .layernorm import row_scale

__all__ = ["layer_norm_lanczos", "rms_norm_lanczos"]

MAX_BASIS = 160
BREAKDOWN = 1e-14
DGKS_ETA = 0.7071067811865476
FIRST_TEST, TEST_GAP = 4, 8


def _next_gap(est, last_est, since, target):
    """Products until the next Ritz test (the generic solver's schedule, as the kernels)."""
    if not (0 < est < last_est and np.isfinite(last_est) and target > 0):  # else no prediction
        return TEST_GAP
    rate = (est / last_est) ** (1.0 / max(since, 1))
    if not 0 < rate < 1:
        return TEST_GAP
    steps = np.log(target / est) / np.log(rate)
    gap = np.floor(steps / 2) if np.isfinite(steps) else TEST_GAP
    return int(min(max(gap, 1), TEST_GAP))


def _token(centre, x, g, eps, frozen, v0, tol, max_iter):
    d = x.size
    xd = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        c = float(row_scale(xd[None, :], eps)[0, 0])
        xc = xd * c
        mu = xc.mean() if centre else 0.0
        sq = np.mean((xc - mu) ** 2) + eps * c * c
    if not (np.isfinite(mu) and np.isfinite(sq) and sq > 0):
        return True, np.nan, np.nan, 0
    sc = np.sqrt(sq)
    xh = (xc - mu) / sc
    gd = g.astype(np.float64)
    gmax = float(np.abs(gd).max())

    def proj(v):
        m1 = v.sum() / d if centre else 0.0
        m2 = xh @ v / d if not frozen else 0.0
        return (v - m1) - xh * m2

    def verify(y):
        u = gd * proj(y)
        top = np.abs(u).max()
        sig = 0.0 if top == 0 else float(np.linalg.norm(u / top) * top)
        z = proj(gd * (u / sig)) if sig > 0 else proj(gd * u)
        rn = float(np.linalg.norm(z - sig * y))
        res = rn / sig if sig > 0 else (0.0 if rn == 0 and gmax == 0 else np.inf)
        return sig * c / sc, res

    top = np.abs(v0).max()
    if not np.isfinite(top):
        return True, np.nan, np.nan, 0
    # LayerNorm with eps = 0 and d = 2 (full mode): J = 0 exactly; sigma 0, residual 0, 0 iterations
    if centre and not frozen and eps == 0 and d == 2:
        return False, 0.0, 0.0, 0
    if top == 0:
        return False, 0.0, np.inf, 0
    q = v0 / top
    q = q / np.linalg.norm(q)
    if max_iter <= 1:
        sig, res = verify(q)
        return False, sig, res, 1
    p = max(1, min(d, max_iter, MAX_BASIS))
    Q, al, be = [q], [], []
    used, factor, scale = 0, 1.0, 0.0
    due, last_est, last_at = FIRST_TEST, np.inf, 0
    while True:
        w = proj(gd * gd * proj(Q[-1]))
        used += 1
        B = np.array(Q)
        alpha = float(Q[-1] @ w)  # the three-term step, then full reorthogonalization
        w = w - alpha * Q[-1] - (be[-1] * Q[-2] if len(Q) > 1 else 0.0)
        for _ in range(2):
            before = w @ w
            h = B @ w
            w = w - h @ B
            alpha += float(h[-1])
            if not w @ w < DGKS_ETA**2 * before:
                break
        beta = float(np.linalg.norm(w))
        scale = max(scale, abs(alpha), beta)
        al.append(alpha)
        be.append(beta)
        m = len(al)
        breakdown = beta <= BREAKDOWN * max(scale, 1e-300)
        last = used + 1 >= max_iter
        if not breakdown:
            Q.append(w / beta)
        if not (used >= due or breakdown or m == p or last):
            continue
        T = np.diag(al) + np.diag(be[:-1], 1) + np.diag(be[:-1], -1)
        evals, evecs = np.linalg.eigh(T)
        theta, z = evals[-1], evecs[:, -1]
        fp = 0.0 if breakdown else beta * abs(z[-1])
        est = fp / theta if theta > 0 else (0.0 if fp == 0 else np.inf)
        due, last_est, last_at = used + _next_gap(est, last_est, used - last_at, tol * factor), est, used
        if not (est <= tol * factor or breakdown or m == p or last):
            continue
        y = z @ B
        y = y / np.linalg.norm(y)
        sig, res = verify(y)
        used += 1
        if res <= tol or breakdown or last or used + 2 > max_iter:
            return False, sig, res, used
        factor *= 0.1
        if m == p:
            Q, al, be = [y], [], []


def _lanczos(centre, x, gamma, eps, frozen, v0, tol, max_iter, sigma, residual, iterations):
    nbad = 0
    for r in range(x.shape[0]):
        bad, sg, res, k = _token(centre, x[r], gamma, float(eps), bool(frozen), v0[r], float(tol),
                                 int(max_iter))
        sigma[r], residual[r], iterations[r] = sg, res, k
        nbad += bad
    return nbad


@register("layer_norm_lanczos", "numpy")
def layer_norm_lanczos(x, gamma, eps, frozen, v0, tol, max_iter, sigma, residual, iterations):
    """x : (n, d); gamma : (d,); v0 : (n, d) float64; sigma, residual : (n,) float64;
    iterations : (n,) int64. Returns the number of bad rows."""
    return _lanczos(True, x, gamma, eps, frozen, v0, tol, max_iter, sigma, residual, iterations)


@register("rms_norm_lanczos", "numpy")
def rms_norm_lanczos(x, gamma, eps, frozen, v0, tol, max_iter, sigma, residual, iterations):
    """As :func:`layer_norm_lanczos`, for RMSNorm."""
    return _lanczos(False, x, gamma, eps, frozen, v0, tol, max_iter, sigma, residual, iterations)
