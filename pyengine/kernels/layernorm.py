"""LayerNorm and RMSNorm: forward, JVP, VJP and dense Jacobian, batched over tokens.

Every function takes ``x`` of shape ``(..., d)`` (any leading batch shape; the
normalization runs over the last axis), float32 or float64, and returns an array
of the same dtype. ``gamma`` / ``beta`` of shape ``(d,)`` are converted to that
dtype; ``None`` means ones / zeros. All statistics are accumulated in float64
with a two-pass variance, so large-mean float32 rows stay exact.

``mode="full"`` gives the true derivative; ``mode="frozen_scale"`` treats the
scale s (LayerNorm) or r (RMSNorm) as a constant, the "detached" linearization
used in interpretability work.

``out=`` takes a preallocated C-contiguous array of the result's shape and dtype
(not overlapping any input) and returns it, so repeated calls on large arrays
pay no allocation. ``backend=`` is ``"auto"`` (fastest available), ``"cpp"``,
``"numba"`` or ``"numpy"`` (the reference).

Inputs are never modified. Errors: ``TypeError`` for a non-float dtype;
``ValueError`` for wrong shapes, d < 2, eps < 0, NaN/Inf in x, gamma, beta or the
tangent, a constant (LayerNorm) or all-zero (RMSNorm) row with eps = 0, a bad
``out``, an unknown or unavailable backend, and a dense Jacobian over
``max_bytes``. On an error, the contents of ``out`` are unspecified.

For hot loops on arrays that are already validated (the matrix-free Jacobian
operators of :mod:`pyengine.linalg`, block JVPs) the kernels can be called
directly, without this layer: see :func:`kernel`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _validate as _v
from ..backends import NORM_KERNELS, resolve

__all__ = ["kernel", *NORM_KERNELS]  # a public function per kernel id of the family


def kernel(name: str, backend: str = "auto"):
    """The raw kernel ``name`` of ``backend``: the fast path, with no validation.

    ``name`` is a kernel id of :data:`pyengine.backends.NORM_KERNELS`. The kernel
    contract (stated in :mod:`pyengine.kernels._reference.layernorm`): C-contiguous
    arrays of one dtype (float32 or float64) of the shapes below, ``eps`` a float >= 0,
    ``frozen`` a bool (``mode == "frozen_scale"``), ``out`` preallocated and not
    overlapping any input; the return value is the number of bad rows (NaN/Inf in x
    or the tangent, a zero scale), which the caller should check (for example with
    :func:`pyengine._validate.raise_bad_rows`). Signatures::

        layer_norm(x (n, d), gamma (d,), beta (d,), eps, out (n, d)) -> int
        rms_norm(x (n, d), gamma (d,), eps, out (n, d)) -> int
        layer_norm_jvp | layer_norm_vjp | rms_norm_jvp | rms_norm_vjp(
            x (n, d), v_or_u (n, d), gamma (d,), eps, frozen, out (n, d)) -> int
        layer_norm_jacobian | rms_norm_jacobian(x (n, d), gamma (d,), eps, frozen, out (n, d, d)) -> int

    Resolve it once, outside the loop: resolving costs about a microsecond.
    """
    return resolve(name, backend)


def _forward(norm: str, x: Any, gamma: Any, beta: Any, eps: Any, backend: str, out: Any) -> np.ndarray:
    fn = resolve(norm, backend)
    x2, shape = _v.rows("x", x)
    eps = _v.eps(eps)
    args = [x2, _v.param("gamma", gamma, x2, 1.0)]
    if norm == "layer_norm":
        args.append(_v.param("beta", beta, x2, 0.0))
    res, o2 = _v.output(out, shape, x2.dtype, (x, gamma, beta))
    _v.raise_bad_rows(fn(*args, eps, o2), x2, shape, eps, norm)
    return res


def _tangent(
    kernel: str, name: str, x: Any, w: Any, gamma: Any, eps: Any, mode: Any, backend: str, out: Any
) -> np.ndarray:
    fn = resolve(kernel, backend)
    x2, shape = _v.rows("x", x)
    w2 = _v.tangent(name, w, x2, shape)
    g = _v.param("gamma", gamma, x2, 1.0)
    eps, frozen = _v.eps(eps), _v.frozen(mode)
    res, o2 = _v.output(out, shape, x2.dtype, (x, w, gamma))
    nbad = fn(x2, w2, g, eps, frozen, o2)
    _v.raise_bad_rows(nbad, x2, shape, eps, kernel.rsplit("_", 1)[0], name, w2)
    return res


def _jacobian(
    norm: str, x: Any, gamma: Any, eps: Any, mode: Any, backend: str, out: Any, max_bytes: Any
) -> np.ndarray:
    fn = resolve(norm + "_jacobian", backend)
    x2, shape = _v.rows("x", x)
    g = _v.param("gamma", gamma, x2, 1.0)
    eps, frozen = _v.eps(eps), _v.frozen(mode)
    jshape = shape + shape[-1:]
    if out is None:
        _v.dense_budget(jshape, x2.dtype, max_bytes)
    res, o2 = _v.output(out, jshape, x2.dtype, (x, gamma), core=2)
    _v.raise_bad_rows(fn(x2, g, eps, frozen, o2), x2, shape, eps, norm)
    return res


def layer_norm(
    x: Any, gamma: Any = None, beta: Any = None, eps: float = 1e-5, backend: str = "auto",
    *, out: np.ndarray | None = None,
) -> np.ndarray:
    """LayerNorm over the last axis: ``gamma * (x - mean) / sqrt(var + eps) + beta``.

    Parameters
    ----------
    x : array_like, shape (..., d), float32 or float64
        Tokens to normalize, d >= 2.
    gamma, beta : array_like, shape (d,), optional
        Scale and shift (default ones and zeros), converted to x's dtype.
    eps : float, default 1e-5
        Added to the variance; must be >= 0 (and > 0 if a row is constant).
    backend : {"auto", "cpp", "numba", "numpy"}
    out : ndarray, shape (..., d), x's dtype, optional
        Preallocated result (C-contiguous, not overlapping the inputs).

    Returns
    -------
    ndarray, shape (..., d), x's dtype

    Raises
    ------
    TypeError, ValueError
        See the module docstring.
    """
    return _forward("layer_norm", x, gamma, beta, eps, backend, out)


def rms_norm(
    x: Any, gamma: Any = None, eps: float = 1e-5, backend: str = "auto",
    *, out: np.ndarray | None = None,
) -> np.ndarray:
    """RMSNorm over the last axis: ``gamma * x / sqrt(mean(x**2) + eps)``.

    Parameters and returns as :func:`layer_norm`, without ``beta``.
    """
    return _forward("rms_norm", x, gamma, None, eps, backend, out)


def layer_norm_jvp(
    x: Any, v: Any, gamma: Any = None, eps: float = 1e-5, mode: str = "full",
    backend: str = "auto", *, out: np.ndarray | None = None,
) -> np.ndarray:
    """Jacobian-vector product of LayerNorm at ``x``, per token: ``J(x) v``.

    ``J v = gamma/s * (v - mean(v) - xh * mean(xh * v))`` with ``xh = (x - mean)/s``;
    ``mode="frozen_scale"`` drops the last term. O(d) per token; J is never formed.

    Parameters
    ----------
    x : array_like, shape (..., d), float32 or float64
        Points of linearization, d >= 2.
    v : array_like, shape of x
        Tangents, converted to x's dtype.
    gamma : array_like, shape (d,), optional
    eps : float, default 1e-5
    mode : {"full", "frozen_scale"}
    backend : {"auto", "cpp", "numba", "numpy"}
    out : ndarray, shape of x, x's dtype, optional

    Returns
    -------
    ndarray, shape (..., d), x's dtype
    """
    return _tangent("layer_norm_jvp", "v", x, v, gamma, eps, mode, backend, out)


def layer_norm_vjp(
    x: Any, u: Any, gamma: Any = None, eps: float = 1e-5, mode: str = "full",
    backend: str = "auto", *, out: np.ndarray | None = None,
) -> np.ndarray:
    """Vector-Jacobian product of LayerNorm at ``x``, per token: ``J(x)^T u``.

    ``J^T u = (g - mean(g) - xh * mean(xh * g)) / s`` with ``g = gamma * u``.
    Parameters and returns as :func:`layer_norm_jvp`, with the cotangent ``u``.
    """
    return _tangent("layer_norm_vjp", "u", x, u, gamma, eps, mode, backend, out)


def rms_norm_jvp(
    x: Any, v: Any, gamma: Any = None, eps: float = 1e-5, mode: str = "full",
    backend: str = "auto", *, out: np.ndarray | None = None,
) -> np.ndarray:
    """Jacobian-vector product of RMSNorm at ``x``: ``gamma/r * (v - x * mean(x * v) / r**2)``.

    Parameters and returns as :func:`layer_norm_jvp`.
    """
    return _tangent("rms_norm_jvp", "v", x, v, gamma, eps, mode, backend, out)


def rms_norm_vjp(
    x: Any, u: Any, gamma: Any = None, eps: float = 1e-5, mode: str = "full",
    backend: str = "auto", *, out: np.ndarray | None = None,
) -> np.ndarray:
    """Vector-Jacobian product of RMSNorm at ``x``: ``(g - x * mean(x * g) / r**2) / r``, g = gamma*u.

    Parameters and returns as :func:`layer_norm_vjp`.
    """
    return _tangent("rms_norm_vjp", "u", x, u, gamma, eps, mode, backend, out)


def layer_norm_jacobian(
    x: Any, gamma: Any = None, eps: float = 1e-5, mode: str = "full", backend: str = "auto",
    *, out: np.ndarray | None = None, max_bytes: float | None = None,
) -> np.ndarray:
    """Dense LayerNorm Jacobian per token: ``diag(gamma)/s (I - 11^T/d - xh xh^T/d)``.

    Parameters
    ----------
    x : array_like, shape (..., d), float32 or float64
    gamma : array_like, shape (d,), optional
    eps : float, default 1e-5
    mode : {"full", "frozen_scale"}
    backend : {"auto", "cpp", "numba", "numpy"}
    out : ndarray, shape (..., d, d), x's dtype, optional
    max_bytes : float, optional
        Refuse (ValueError, before allocating) a result larger than this;
        default ``pyengine._validate.DENSE_MAX_BYTES`` (2 GiB). Not applied to ``out``.

    Returns
    -------
    ndarray, shape (..., d, d), x's dtype
        ``J[..., i, j] = d y_i / d x_j``.
    """
    return _jacobian("layer_norm", x, gamma, eps, mode, backend, out, max_bytes)


def rms_norm_jacobian(
    x: Any, gamma: Any = None, eps: float = 1e-5, mode: str = "full", backend: str = "auto",
    *, out: np.ndarray | None = None, max_bytes: float | None = None,
) -> np.ndarray:
    """Dense RMSNorm Jacobian per token: ``diag(gamma)/r (I - x x^T/(d r^2))``.

    Parameters and returns as :func:`layer_norm_jacobian`.
    """
    return _jacobian("rms_norm", x, gamma, eps, mode, backend, out, max_bytes)
