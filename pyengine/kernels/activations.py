"""Attention softmax and MLP activations, with their JVPs, batched.

``softmax(x, offset=...)`` is the row softmax of attention scores over the last axis
with an optional causal mask; ``softmax_jvp(p, dx)`` its Jacobian-vector product at
the softmax output p, for one or many tangents dx. ``activation(name, x)`` applies
an MLP activation ("gelu", "gelu_tanh", "relu" or the Llama gate "silu_gated")
and ``activation_jvp_coef(name, x)`` gives the coefficients of its JVP. The
formulas are in :mod:`pyengine.kernels._reference.activations`.

Arrays are float32 or float64 and results have the dtype of the (first) input;
every computation runs in float64 internally. ``out=`` takes a preallocated
C-contiguous array of the result's shape and dtype and returns it; it may be the
input array itself (``x``, resp. ``dx``) to work in place, but must not overlap an
input otherwise. ``backend=`` is ``"auto"`` (fastest available), ``"cpp"``,
``"numba"`` or ``"numpy"`` (the reference).

Inputs are never modified (unless passed as ``out``). Non-contiguous inputs are
copied once. Errors: ``TypeError`` for a non-float dtype; ``ValueError`` for wrong
shapes, a negative or non-integer offset, an unknown activation, a NaN or +Inf
among the visible scores (or a row whose visible scores are all -inf), a NaN or Inf
in any other input, a bad ``out``, an unknown or unavailable backend. On an error,
the contents of ``out`` are unspecified.

For hot loops on arrays that are already validated (C-contiguous, right dtype and
shape) the kernels can be called directly, without this layer: see
:func:`kernel`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _validate as _v
from ..backends import resolve

__all__ = [
    "ACTIVATIONS",
    "activation",
    "activation_jvp_coef",
    "kernel",
    "softmax",
    "softmax_jvp",
]

#: Activation names of :func:`activation`; ``silu_gated`` halves the last axis.
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu_gated")


def kernel(name: str, backend: str = "auto"):
    """The raw kernel ``name`` of ``backend``: the fast path, with no validation.

    ``name`` is a kernel id of :data:`pyengine.backends.ACTIVATION_KERNELS`. The
    kernel contract (stated in :mod:`pyengine.kernels._reference.activations`): C-contiguous
    arrays of one dtype (float32 or float64), of the documented shapes, ``out``
    preallocated (it may be the input, for in-place use); the return value is the
    number of bad rows (NaN/Inf input), which the caller should check. Signatures::

        softmax(x (N, Tq, Tk), offset: int >= 0, out (N, Tq, Tk)) -> int
        softmax_jvp(p (M, Tq, Tk), dx (R, M, Tq, Tk), out (R, M, Tq, Tk)) -> int
        gelu | gelu_grad | gelu_tanh | gelu_tanh_grad | relu | relu_grad(x (N, n), out (N, n)) -> int
        silu_gated(u (N, 2n), out (N, n)) -> int
        silu_gated_grad(u (N, 2n), out_a (N, n), out_b (N, n)) -> int

    Resolve it once, outside the loop: resolving costs about a microsecond.
    """
    return resolve(name, backend)


# --------------------------------------------------------------------------- softmax


def softmax(x: Any, *, offset: int | None = None, out: np.ndarray | None = None,
            backend: str = "auto") -> np.ndarray:
    """Row softmax of attention scores over the last axis, optionally causally masked.

    ``p[..., i, j] = exp(x[..., i, j] - m) / sum_k exp(x[..., i, k] - m)`` over the keys
    j <= i + offset that query i sees (m their max); keys j > i + offset are masked:
    never read and exactly 0 in the result.

    Parameters
    ----------
    x : array_like, shape (..., Tq, Tk), float32 or float64
        Scores, Tk >= 1. A visible score may be ``-inf`` (masked by the caller: its
        probability is exactly 0), as long as each row has a finite visible score.
    offset : int >= 0, optional
        Causal mask: query i sees keys j <= i + offset. ``None`` (default) masks
        nothing; ``0`` with Tq == Tk is the standard causal mask; ``Tk - Tq`` makes
        the Tq queries the last positions of the Tk keys (a causal suffix).
    out : ndarray, shape of x, x's dtype, optional
        Preallocated result; may be ``x`` itself (in place).
    backend : {"auto", "cpp", "numba", "numpy"}

    Returns
    -------
    ndarray, shape (..., Tq, Tk), x's dtype
        Rows sum to 1 over the visible keys.

    Raises
    ------
    TypeError, ValueError
        See the module docstring.
    """
    fn = resolve("softmax", backend)
    x0 = x
    x = _v.scores("x", x)
    shape = x.shape
    tq, tk = shape[-2:]
    off = _v.causal_offset(offset, tk)
    res = _v.output(out, shape, x.dtype, (x0, x), None, inplace=x)[0]
    if x.size == 0:
        return res
    x3 = x.reshape(-1, tq, tk)
    nbad = fn(x3, off, res.reshape(x3.shape))
    if nbad:
        _v.raise_bad_softmax_rows(nbad, x3, off, shape)
    return res


def softmax_jvp(p: Any, dx: Any, *, out: np.ndarray | None = None, backend: str = "auto") -> np.ndarray:
    """Jacobian-vector product of the row softmax at its output p: ``p * (dx - sum_j p dx)``.

    Parameters
    ----------
    p : array_like, shape (..., Tq, Tk), float32 or float64
        A softmax output (rows sum to 1; masked entries 0), as :func:`softmax` returns.
    dx : array_like, shape (R, ..., Tq, Tk) or shape of p
        Tangents of the scores, converted to p's dtype. p is shared by every leading
        index of dx that p lacks; leading axes of length 1 of p broadcast too, so p
        of shape (1, H, T, T) serves dx of shape (K, H, T, T).
    out : ndarray, shape of dx, p's dtype, optional
        Preallocated result; may be ``dx`` itself (in place).
    backend : {"auto", "cpp", "numba", "numpy"}

    Returns
    -------
    ndarray, shape of dx, p's dtype
        Each row sums to 0; entries where p = 0 are exactly 0.

    Raises
    ------
    TypeError, ValueError
        See the module docstring.
    """
    fn = resolve("softmax_jvp", backend)
    p0, dx0 = p, dx
    p = _v.scores("p", p)
    dx, core = _v.softmax_tangents(p, dx)  # leading unit axes of p broadcast
    shape = dx.shape
    res = _v.output(out, shape, p.dtype, (p0, dx0, dx), None, inplace=dx, of="p")[0]
    if dx.size == 0:
        return res
    tq, tk = core[-2:]
    p3 = p.reshape(-1, tq, tk)
    dx4 = dx.reshape(-1, p3.shape[0], tq, tk)
    nbad = fn(p3, dx4, res.reshape(dx4.shape))
    if nbad:
        _v.raise_nonfinite(nbad, [("p", p3, p.shape[:-1]), ("dx", dx4, shape[:-1])])
    return res


# --------------------------------------------------------------------------- activations


def activation(name: str, x: Any, *, out: np.ndarray | None = None, backend: str = "auto") -> np.ndarray:
    """An MLP activation, elementwise (or gated, for ``silu_gated``).

    Parameters
    ----------
    name : {"gelu", "gelu_tanh", "relu", "silu_gated"}
        ``gelu``: x Phi(x) (exact, Phi the normal CDF); ``gelu_tanh``:
        0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); ``relu``: max(x, 0);
        ``silu_gated``: x = [gate | up] along the last axis, result silu(gate) * up
        with silu(g) = g sigmoid(g) (Llama's MLP).
    x : array_like, shape (..., n) (``silu_gated``: (..., 2n)), float32 or float64
        Pre-activations.
    out : ndarray, shape (..., n), x's dtype, optional
        Preallocated result; may be ``x`` itself, except for ``silu_gated``.
    backend : {"auto", "cpp", "numba", "numpy"}

    Returns
    -------
    ndarray, shape (..., n), x's dtype

    Raises
    ------
    TypeError, ValueError
        See the module docstring.
    """
    fn = resolve(_v.choice("name", name, ACTIVATIONS), backend)
    x0 = x
    xa, x2, n = _v.activation_rows(name, x)
    shape = xa.shape[:-1] + (n,) if name == "silu_gated" else xa.shape
    res = _v.output(out, shape, xa.dtype, (x0, xa), None, inplace=None if name == "silu_gated" else xa)[0]
    if xa.size == 0:
        return res
    nbad = fn(x2, res.reshape(x2.shape[0], n))
    if nbad:
        _v.raise_nonfinite(nbad, [("x", x2, xa.shape[:-1] if xa.ndim else (1,))])
    return res


def activation_jvp_coef(name: str, x: Any, *, backend: str = "auto") -> tuple[np.ndarray, ...]:
    """Coefficients of the activation's JVP at x.

    For the elementwise activations one array c, ``dz = c * dx`` (the derivative
    elementwise: ``gelu`` Phi(x) + x phi(x), ``gelu_tanh`` its derivative, ``relu``
    1 where x > 0, else 0). For ``silu_gated`` two arrays (a, b) with
    ``dz = a * dgate + b * dup``: a = silu'(gate) * up, b = silu(gate).

    Parameters
    ----------
    name : {"gelu", "gelu_tanh", "relu", "silu_gated"}
    x : array_like, shape (..., n) (``silu_gated``: (..., 2n)), float32 or float64
    backend : {"auto", "cpp", "numba", "numpy"}

    Returns
    -------
    tuple of ndarray, each of shape (..., n) and x's dtype
        ``(c,)``, or ``(a, b)`` for ``silu_gated``.

    Raises
    ------
    TypeError, ValueError
        See the module docstring.
    """
    fn = resolve(_v.choice("name", name, ACTIVATIONS) + "_grad", backend)
    xa, x2, n = _v.activation_rows(name, x)
    shape = xa.shape[:-1] + (n,) if name == "silu_gated" else xa.shape
    outs = tuple(np.empty(shape, xa.dtype) for _ in range(2 if name == "silu_gated" else 1))
    if xa.size == 0:
        return outs
    nbad = fn(x2, *(o.reshape(x2.shape[0], n) for o in outs))
    if nbad:
        _v.raise_nonfinite(nbad, [("x", x2, xa.shape[:-1] if xa.ndim else (1,))])
    return outs
