"""Dense layers ``x @ w (+ b)`` with a fused epilogue: bias, residual, activation.

``linear(x, w, b, activation=..., residual=...)`` is ``act(x @ w + b) `` or
``x @ w + b + residual``, and ``linear_mul(x, w, coef)`` is ``(x @ w) * coef`` (an
activation's JVP). The kernels ``linear``, ``linear_act`` and ``linear_mul`` (contract:
:mod:`pyengine.kernels._reference.linear`) are what the block engine's weight products
run on (:mod:`pyengine.models._linear`).

The ``"cpp"`` kernels compute the product with MKL (the ``mkl`` extra, sequential) or else
NumPy's own OpenBLAS, called single-threaded on row tiles from pyengine's OpenMP threads,
each applying the epilogue to its tile while it is in cache (:func:`blas_info` says which
library, and whether this path is active; without either they use ``numpy.matmul`` and a
separate pass; ``PYENGINE_BLAS`` picks, see :mod:`pyengine.kernels._blas`). So no BLAS thread
pool spins next to pyengine's threads after a product, whatever the environment;
:func:`matmul_one_thread` keeps it so for the small ``numpy.matmul`` products in between.

Arrays are float32 or float64; w, b and residual are converted to x's dtype. ``x`` is
(..., k), ``w`` (k, n), ``b`` (n,), ``residual`` and the result (..., n). ``out=`` takes a
C-contiguous array of the result's shape and dtype; it may be ``residual`` itself (the
product is added to it), but must not overlap any other input. Inputs are never modified.
Errors: TypeError for a non-float dtype, ValueError naming the argument for wrong shapes,
an unknown activation, a bad ``out``, or NaN/Inf in the product.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _validate as _v
from ..backends import available_backends, backend_module, resolve
from ._blas import matmul_one_thread

__all__ = ["ACTIVATIONS", "attention_forward_kernel", "attention_jvp_kernel", "blas_info", "kernel", "linear", "linear_mul",
           "matmul_one_thread"]

#: Activations the epilogue applies (the kernels of :mod:`pyengine.kernels.activations`).
ACTIVATIONS = ("none", "gelu", "gelu_tanh", "relu")


def kernel(name: str, backend: str = "auto"):
    """The raw kernel ``name`` (``linear``, ``linear_act``, ``linear_mul``): no validation.

    Contract (:mod:`pyengine.kernels._reference.linear`): C-contiguous arrays of one dtype;
    returns the number of rows of the product holding NaN/Inf. Signatures::

        linear(x (N, k), w (k, n), b (n,) | None, r (N, n) | None, out (N, n)) -> int
        linear_act(x, w, b | None, activation: str, u (N, n) | None, out (N, n)) -> int
        linear_mul(x (N, k), w (k, n), coef (M, n), M | N, out (N, n)) -> int
    """
    return resolve(name, backend)


def attention_jvp_kernel():
    """The ``"cpp"`` kernel ``linear_attention_jvp`` while it is the block engine's path, or None.

    The block engine's float32 fast path, next to the ``linear`` kernels it shares BLAS and
    threads with: returned only while the ``"auto"`` ``linear`` kernel is the ``"cpp"`` one
    (so ``backend=`` contexts are honoured) and its BLAS path is on (else the kernel would
    return -1); otherwise the caller keeps its numpy products. Contract:
    :mod:`pyengine.kernels._reference.linear_attention`.
    """
    return _compiled("linear_attention_jvp")


def attention_forward_kernel():
    """The ``"cpp"`` kernel ``linear_attention_forward`` while it is the block engine's path, or None.

    Like :func:`attention_jvp_kernel`. Contract: :mod:`pyengine.kernels._reference.linear_attention`.
    """
    return _compiled("linear_attention_forward")


def _compiled(name: str):
    try:
        cpp = resolve("linear", "cpp")
    except ValueError:
        return None
    if resolve("linear") is not cpp or not backend_module("cpp").linear_blas_ready():
        return None
    return resolve(name, "cpp")


def blas_info() -> str:
    """Which path the ``"cpp"`` kernels' products take, in words (or why the backend is missing)."""
    cpp = backend_module("cpp")
    if cpp is None:
        return f"cpp backend unavailable ({available_backends()['cpp'].reason})"
    return cpp.linear_blas_info()


def _operands(x: Any, w: Any, b: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, tuple[int, ...]]:
    x = np.ascontiguousarray(_v.float_array("x", x))
    if x.ndim < 1:
        raise ValueError(f"x must have at least 1 dimension (..., k); got shape {x.shape}")
    w = _v.float_array("w", w)
    if w.ndim != 2 or w.shape[0] != x.shape[-1]:
        raise ValueError(f"w must have shape ({x.shape[-1]}, n) to match x {x.shape}; got {w.shape}")
    w = np.ascontiguousarray(w, dtype=x.dtype)
    n = w.shape[1]
    if b is not None:
        b = _v.float_array("b", b)
        if b.shape != (n,):
            raise ValueError(f"b must have shape ({n},); got {b.shape}")
        b = np.ascontiguousarray(b, dtype=x.dtype)
    return x, w, b, x.shape[:-1] + (n,)


def _raise(nbad: int, what: str) -> None:
    if nbad:
        raise ValueError(f"{what} holds NaN or Inf in {nbad} row(s) (are the inputs finite and moderate?)")


def linear(x: Any, w: Any, b: Any = None, *, activation: str = "none", residual: Any = None,
           out: np.ndarray | None = None, backend: str = "auto") -> np.ndarray:
    """``activation(x @ w + b)``, or ``x @ w + b + residual`` (activation "none" only).

    Parameters
    ----------
    x : array_like, (..., k), float32 or float64
    w : array_like, (k, n)
    b : array_like, (n,), optional
    activation : {"none", "gelu", "gelu_tanh", "relu"}
    residual : array_like, (..., n), optional
        Added after the bias; only with ``activation="none"``.
    out : ndarray, (..., n), x's dtype, optional; may be ``residual`` itself.
    backend : {"auto", "cpp", "numba", "numpy"}
    """
    x0, res0 = x, residual
    act = _v.choice("activation", activation, ACTIVATIONS)
    x, w, b, shape = _operands(x, w, b)
    r = None
    if residual is not None:
        if act != "none":
            raise ValueError("residual is added after the bias only with activation='none'")
        r = _v.float_array("residual", residual)
        if r.shape != shape:
            raise ValueError(f"residual must have shape {shape}; got {r.shape}")
        if r is not out:
            r = np.ascontiguousarray(r, dtype=x.dtype)
    res, _ = _v.output(out, shape, x.dtype, (x0, x, w, b, res0, r), None, inplace=r)
    if res.size == 0:
        return res
    k, n = w.shape
    x2, o2 = x.reshape(-1, k), res.reshape(-1, n)
    if act == "none":
        nbad = resolve("linear", backend)(x2, w, b, None if r is None else (o2 if r is res else r.reshape(-1, n)), o2)
    else:
        nbad = resolve("linear_act", backend)(x2, w, b, act, None, o2)
    _raise(nbad, "x @ w" + (" + b" if b is not None else "") + (" + residual" if r is not None else ""))
    return res


def linear_mul(x: Any, w: Any, coef: Any, *, out: np.ndarray | None = None, backend: str = "auto") -> np.ndarray:
    """``(x @ w) * coef`` (an activation's JVP at its coefficients ``coef``).

    ``coef`` has the result's shape (..., n) or a trailing part of it (T, n), broadcast
    over the leading axes (the base's T rows shared by K tangents).
    """
    x0, c0 = x, coef
    x, w, _, shape = _operands(x, w, None)
    c = _v.float_array("coef", coef)
    if c.ndim == 0 or c.shape != shape[-c.ndim :]:
        raise ValueError(f"coef must have shape {shape} or a trailing part of it (..., {shape[-1]}); got {c.shape}")
    c = np.ascontiguousarray(c, dtype=x.dtype)
    res, _ = _v.output(out, shape, x.dtype, (x0, x, w, c0, c), None)
    if res.size == 0:
        return res
    k, n = w.shape
    _raise(resolve("linear_mul", backend)(x.reshape(-1, k), w, c.reshape(-1, n), res.reshape(-1, n)), "x @ w")
    return res
