"""NumPy reference: the executable specification of every pyengine kernel.

Every kernel here has the *kernel contract* shared by all backends:

* array arguments are C-contiguous and of one dtype, float32 or float64; the
  public layer (``pyengine.kernels.layernorm``) has already validated and converted them;
* ``x`` has shape ``(n, d)`` (one row per token); ``gamma``, ``beta`` shape ``(d,)``;
  ``v`` / ``u`` the shape of ``x``; ``out`` is preallocated, ``(n, d)`` or, for
  Jacobians, ``(n, d, d)``, and is written in full;
* ``frozen`` selects the ``"frozen_scale"`` linearization (s, resp. r, constant);
* the return value is the number of *bad rows*: rows whose statistics are not
  finite (NaN/Inf in ``x``, or in the tangent ``v`` / ``u``) or whose scale is zero
  (s = 0 or r = 0). An exactly constant row has LayerNorm mean x[0] and
  variance 0 exactly, whatever the summation order. Bad rows' output is
  unspecified; the public layer turns a non-zero count into a ``ValueError``
  that names the argument and the first bad row.
  Value checks live in the kernels because they need every value read once, and
  a separate pass would cost as much memory traffic as the kernel itself.

Everything is computed in float64 (two-pass variance) and cast to the dtype of
``x`` on the way out; the compiled backends must match this to rounding. The row
statistics are taken of the row scaled by a power of two (:func:`row_scale`), so
rows of any magnitude keep full precision and, with eps = 0, the results are
scale-invariant; for ordinary rows the scaling is exact and changes no bit.

LayerNorm (DESIGN.md): mu = mean(x), s = sqrt(var(x) + eps), xh = (x - mu) / s,
y = gamma * xh + beta, J = diag(gamma)/s (I - 11^T/d - xh xh^T/d).
RMSNorm: r = sqrt(mean(x^2) + eps), y = gamma * x / r, J = diag(gamma)/r (I - x x^T/(d r^2)).
"""

from __future__ import annotations

import numpy as np

from ...backends import NORM_KERNELS, register

__all__ = list(NORM_KERNELS)  # one reference per kernel id of the family


def row_scale(xd, eps):
    """Per-row power of two c = 2^-e that brings max(max|x|, sqrt(eps)) into [0.5, 1), shape (n, 1).

    Every statistic is computed on the row scaled by c, which is exact (a power of
    two), so squares neither underflow (rows of 1e-160) nor overflow (rows of 1e+200):
    with eps = 0 the normalization is scale-invariant to rounding at every scale.
    eps is scaled with the row (var(c x) + c^2 eps = c^2 (var(x) + eps)), and since c
    is set by sqrt(eps) too, c^2 eps never overflows. For rows of ordinary size
    every scaled operation is exact, so the results are bit-identical to the unscaled
    formulas. Non-finite or all-zero rows get c = 1.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.maximum(np.abs(xd).max(axis=-1, keepdims=True), np.sqrt(eps))
    ok = np.isfinite(m) & (m > 0)
    _, e = np.frexp(np.where(ok, m, 1.0))
    # e in [-1073, 1024]; c = 2^1022 at most (2^1074 is not a float64), 2^-1024 at least.
    return np.where(ok, np.ldexp(1.0, -np.clip(e, -1022, 1024)), 1.0)


def _ln_stats(x, eps):
    """Per-row (xc, var, c): centred values c (x - mu), their variance and the row scale
    c (:func:`row_scale`), in float64, two-pass. Then s = sqrt(var + c^2 eps) / c.

    An exactly constant row has mean x[0] and variance 0 exactly (part of the
    kernel contract): a rounded mean would leave it a variance of ~1e-34 or 0
    depending on summation order, and so on the backend.
    """
    xd = x.astype(np.float64)
    c = row_scale(xd, eps)
    xs = xd * c
    const = (xd == xd[:, :1]).all(axis=-1, keepdims=True)
    xc = np.where(const, 0.0, xs - xs.mean(axis=-1, keepdims=True))
    return xc, np.mean(xc * xc, axis=-1, keepdims=True), c


def _scale(ms, eps, c=1.0):
    """sqrt(ms + c^2 eps) (the scale of a row scaled by c) with a mask of rows whose statistics are unusable."""
    with np.errstate(invalid="ignore", over="ignore"):
        sq = ms + eps * c * c  # (eps * c) * c: c * c alone may overflow, c^2 eps <= 1 does not
        bad = ~(np.isfinite(sq) & (sq > 0))
        s = np.sqrt(np.where(bad, 1.0, sq))
    return s, bad[..., 0]


def _finite_rows(a):
    return np.isfinite(a).all(axis=-1)


@register("layer_norm", "numpy")
def layer_norm(x, gamma, beta, eps, out):
    """y = gamma * (x - mu) / sqrt(var + eps) + beta, per row."""
    with np.errstate(invalid="ignore", over="ignore"):
        xc, var, c = _ln_stats(x, eps)
        s, bad = _scale(var, eps, c)
        bad |= ~_finite_rows(xc)
        out[...] = gamma.astype(np.float64) * (xc / s) + beta.astype(np.float64)
    return int(bad.sum())


def _ln_tangent(x, w, eps, frozen):
    """The shared core of LayerNorm JVP and VJP: (w - mean w - xh mean(xh w)) / s."""
    with np.errstate(invalid="ignore", over="ignore"):
        xc, var, c = _ln_stats(x, eps)
        s, bad = _scale(var, eps, c)  # of the scaled row: xh = xc / s, the true scale is s / c
        bad |= ~(_finite_rows(xc) & _finite_rows(w))
        mw = w.mean(axis=-1, keepdims=True)
        r = w - mw
        bad |= ~np.isfinite(mw[:, 0])  # the tangent's own sums overflowed
        if not frozen:
            xh = xc / s
            m2 = np.mean(xh * w, axis=-1, keepdims=True)
            r -= xh * m2
            bad |= ~np.isfinite(m2[:, 0])
        return r / (s / c), bad


@register("layer_norm_jvp", "numpy")
def layer_norm_jvp(x, v, gamma, eps, frozen, out):
    """J v = gamma/s * (v - mean v - xh mean(xh v)); frozen: gamma/s * (v - mean v)."""
    t, bad = _ln_tangent(x, v.astype(np.float64), eps, frozen)
    out[...] = gamma.astype(np.float64) * t
    return int(bad.sum())


@register("layer_norm_vjp", "numpy")
def layer_norm_vjp(x, u, gamma, eps, frozen, out):
    """J^T u = (g - mean g - xh mean(xh g)) / s with g = gamma * u; frozen drops the xh term."""
    t, bad = _ln_tangent(x, gamma.astype(np.float64) * u.astype(np.float64), eps, frozen)
    out[...] = t
    return int(bad.sum())


@register("layer_norm_jacobian", "numpy")
def layer_norm_jacobian(x, gamma, eps, frozen, out):
    """Dense J per row, shape (n, d, d): J[i, j] = gamma_i/s (delta_ij - 1/d - xh_i xh_j/d)."""
    d = x.shape[-1]
    with np.errstate(invalid="ignore", over="ignore"):
        xc, var, c = _ln_stats(x, eps)
        s, bad = _scale(var, eps, c)
        bad |= ~_finite_rows(xc)
        core = np.eye(d) - 1.0 / d
        if frozen:
            jac = core[None, :, :]
        else:
            xh = xc / s
            jac = core[None, :, :] - xh[:, :, None] * xh[:, None, :] / d
        out[...] = (gamma.astype(np.float64)[None, :] / (s / c))[:, :, None] * jac
    return int(bad.sum())


def _rms_stats(x, eps):
    """(c x, r of the scaled row, c, bad): the true r is r / c (see :func:`row_scale`)."""
    xd = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        c = row_scale(xd, eps)
        xs = xd * c
        r, bad = _scale(np.mean(xs * xs, axis=-1, keepdims=True), eps, c)
        bad |= ~_finite_rows(xd)
    return xs, r, c, bad


@register("rms_norm", "numpy")
def rms_norm(x, gamma, eps, out):
    """y = gamma * x / sqrt(mean(x^2) + eps), per row."""
    xs, r, _, bad = _rms_stats(x, eps)
    with np.errstate(invalid="ignore", over="ignore"):
        out[...] = gamma.astype(np.float64) * (xs / r)
    return int(bad.sum())


def _rms_tangent(x, w, eps, frozen):
    """The shared core of RMSNorm JVP and VJP: (w - x mean(x w)/r^2) / r."""
    xs, r, c, bad = _rms_stats(x, eps)
    with np.errstate(invalid="ignore", over="ignore"):
        bad |= ~_finite_rows(w)
        t = w.copy()
        coef = np.mean(xs * w, axis=-1, keepdims=True) / (r * r)
        bad |= ~np.isfinite(coef[:, 0])  # the tangent's sums overflowed (checked in frozen mode too)
        if not frozen:
            t -= xs * coef
        return t / (r / c), bad


@register("rms_norm_jvp", "numpy")
def rms_norm_jvp(x, v, gamma, eps, frozen, out):
    """J v = gamma/r * (v - x mean(x v)/r^2); frozen: gamma * v / r."""
    t, bad = _rms_tangent(x, v.astype(np.float64), eps, frozen)
    out[...] = gamma.astype(np.float64) * t
    return int(bad.sum())


@register("rms_norm_vjp", "numpy")
def rms_norm_vjp(x, u, gamma, eps, frozen, out):
    """J^T u = (g - x mean(x g)/r^2) / r with g = gamma * u; frozen: g / r."""
    t, bad = _rms_tangent(x, gamma.astype(np.float64) * u.astype(np.float64), eps, frozen)
    out[...] = t
    return int(bad.sum())


@register("rms_norm_jacobian", "numpy")
def rms_norm_jacobian(x, gamma, eps, frozen, out):
    """Dense J per row, shape (n, d, d): J[i, j] = gamma_i/r (delta_ij - x_i x_j/(d r^2))."""
    d = x.shape[-1]
    xs, r, c, bad = _rms_stats(x, eps)
    with np.errstate(invalid="ignore", over="ignore"):
        jac = np.broadcast_to(np.eye(d), (x.shape[0], d, d))
        if not frozen:
            xn = xs / r
            jac = jac - xn[:, :, None] * xn[:, None, :] / d
        out[...] = (gamma.astype(np.float64)[None, :] / (r / c))[:, :, None] * jac
    return int(bad.sum())
