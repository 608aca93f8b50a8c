"""Attention backward kernels and the fused (row-streaming) attention head, batched.

``attention_score_grad(p, u, v)`` is dL/ds = p ⊙ A for one head's scores from the
attention probabilities p, the upstream gradient u = dL/do of the head's output and
the values v; with ``advantage=True`` it also returns the advantage
A_ij = u_i.v_j - sum_k p_ik u_i.v_k. ``attention_forward(q, k, v)`` and
``attention_backward(q, k, v, d_o, lse, o=out)`` are one head's forward and backward
pass, fused: the compiled backends never store a (Tq, Tk) matrix (the NumPy reference
materializes them); the backward pass is one pass over the visible (query, key) pairs. The formulas are in
:mod:`pyengine.kernels._reference.attention`.

The mask is the softmax's: key j is visible to query i when j <= i + offset;
``offset=None`` masks nothing, ``0`` (with Tq == Tk) is the causal mask. Arrays are
float32 or float64; results have the dtype of the first input (the row statistics lse,
entropy and spread are float64). Computation runs in float64, except the C++ fused head
on float32 input, which computes in float32 (8-wide AVX lanes, a float exp; about twice
as fast) with its sums over T terms in float64: at T = 2000 its results are within
~1e-6 of float64 relative to their largest entry, more for large logits (see
tests/test_attention.py, FLOAT32_CASES). On heads of width >= 16 the C++ score gradient
and backward pass use NumPy's OpenBLAS for the per-head products (``csrc/attention_blas.hpp``;
``_core.attention_blas_info()``). Inputs are never modified; non-contiguous inputs are copied once. ``backend=`` is ``"auto"``,
``"cpp"``, ``"numba"`` or ``"numpy"``.

Errors: ``TypeError`` for a non-float dtype or a non-int offset; ``ValueError`` for
mismatched shapes, a negative offset, a non-positive or non-finite scale, NaN or Inf in
an input (a visible entry of p), an unknown or unavailable backend.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import numpy as np

from .. import _validate as _v
from ..backends import resolve
from .._validate import causal_offset as _offset

__all__ = [
    "AttentionBackward",
    "AttentionForward",
    "attention_backward",
    "attention_forward",
    "attention_score_grad",
    "kernel",
]


class AttentionForward(NamedTuple):
    """The fused forward pass: out (..., Tq, dv), lse and entropy (..., Tq) float64."""

    out: np.ndarray
    lse: np.ndarray
    entropy: np.ndarray


class AttentionBackward(NamedTuple):
    """The fused backward pass: dq, dk, dv (shapes of q, k, v) and spread (..., Tq) float64."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    spread: np.ndarray


def kernel(name: str, backend: str = "auto"):
    """The raw kernel ``name`` of ``backend``: the fast path, with no validation.

    ``name`` is one of :data:`pyengine.backends.ATTENTION_KERNELS`. Contract as in
    :mod:`pyengine.kernels._reference.attention` (C-contiguous arrays of one dtype, 3-D
    with a leading batch axis N, outputs preallocated, the bad-row count returned)::

        attention_score_grad(p, u, v, offset, out) -> int
        attention_advantage(p, u, v, offset, out, advantage) -> int
        attention_forward(q, k, v, offset, scale, out, lse, entropy) -> int
        attention_backward(q, k, v, o, d_o, lse, offset, scale, dq, dk, dv, spread) -> int
    """
    return resolve(name, backend)


def _array(name: str, a: Any, dtype: np.dtype | None = None) -> np.ndarray:
    arr = _v.float_array(name, a)
    if arr.ndim < 2:
        raise ValueError(f"{name} must have at least 2 dimensions (..., rows, features); got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=dtype or arr.dtype)


def _check_finite(**arrays: np.ndarray) -> None:
    for name, a in arrays.items():
        if not np.isfinite(a).all():
            idx = tuple(int(i) for i in np.argwhere(~np.isfinite(a))[0])
            raise ValueError(f"{name} contains NaN or Inf (first at {idx}: {a[idx]})")


def _lead(name: str, a: np.ndarray, lead: tuple[int, ...], what: str) -> None:
    if a.shape[:-2] != lead:
        raise ValueError(f"{name} must have the leading axes {lead} of {what}; got shape {a.shape}")


def _scale(scale: Any, dk: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(dk)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not (0 < scale < math.inf):
        raise ValueError(f"scale must be a positive finite number (default 1/sqrt(dk)); got {scale!r}")
    return float(scale)


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape((-1,) + a.shape[-2:])


def attention_score_grad(p: Any, u: Any, v: Any, *, offset: int | None = None, advantage: bool = False,
                         backend: str = "auto") -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """dL/ds of one attention head: ``p ⊙ (b - rowsum(p ⊙ b))``, ``b = u vᵀ``, b formed once.

    Parameters
    ----------
    p : array_like, shape (..., Tq, Tk), float32 or float64
        Attention probabilities (a softmax output); masked entries are not read.
    u : array_like, shape (..., Tq, dv)
        dL/do, the upstream gradient of the head's output o = p v; converted to p's dtype.
    v : array_like, shape (..., Tk, dv)
        The values; converted to p's dtype.
    offset : int >= 0, optional
        The mask (see the module docstring); ``None`` masks nothing.
    advantage : bool
        Also return the advantage A = b - rowsum(p ⊙ b) (0 where masked).
    backend : {"auto", "cpp", "numba", "numpy"}

    Returns
    -------
    ndarray (..., Tq, Tk), p's dtype, or a pair (gradient, advantage)
        Each row of the gradient sums to 0 and the gradient is p ⊙ A.
    """
    fn = resolve("attention_advantage" if advantage else "attention_score_grad", backend)
    p = _array("p", p)
    u, v = _array("u", u, p.dtype), _array("v", v, p.dtype)
    lead, (tq, tk) = p.shape[:-2], p.shape[-2:]
    _lead("u", u, lead, "p")
    _lead("v", v, lead, "p")
    if u.shape[-2] != tq or v.shape[-2] != tk or u.shape[-1] != v.shape[-1]:
        raise ValueError(f"u must have shape (..., Tq={tq}, dv) and v (..., Tk={tk}, dv) with the same dv; "
                         f"got u {u.shape}, v {v.shape}")
    off = _offset(offset, tk)
    outs = [np.empty(p.shape, p.dtype) for _ in range(2 if advantage else 1)]
    if p.size == 0:
        return tuple(outs) if advantage else outs[0]
    nbad = fn(_flat(p), _flat(u), _flat(v), off, *(_flat(o) for o in outs))
    if nbad:
        vis = np.arange(tk)[None, :] <= np.arange(tq)[:, None] + off
        _check_finite(p=np.where(vis, p, 0.0), u=u, v=v)
        raise ValueError(f"the score gradient overflowed in {nbad} row(s); rescale u or v")
    return tuple(outs) if advantage else outs[0]


def _qkv(q: Any, k: Any, v: Any, offset: Any, scale: Any):
    q = _array("q", q)
    k, v = _array("k", k, q.dtype), _array("v", v, q.dtype)
    lead = q.shape[:-2]
    _lead("k", k, lead, "q")
    _lead("v", v, lead, "q")
    if k.shape[-1] != q.shape[-1] or v.shape[-2] != k.shape[-2] or k.shape[-2] < 1:
        raise ValueError(f"q (..., Tq, dk), k (..., Tk, dk) and v (..., Tk, dv) must agree in dk and Tk >= 1; "
                         f"got q {q.shape}, k {k.shape}, v {v.shape}")
    _check_finite(q=q, k=k, v=v)
    return q, k, v, _offset(offset, k.shape[-2]), _scale(scale, q.shape[-1])


def attention_forward(q: Any, k: Any, v: Any, *, offset: int | None = None, scale: float | None = None,
                      backend: str = "auto") -> AttentionForward:
    """One attention head forward, ``o = softmax(scale q kᵀ, masked) v``, with its row statistics.

    Parameters
    ----------
    q : array_like, shape (..., Tq, dk), float32 or float64
    k : array_like, shape (..., Tk, dk); converted to q's dtype
    v : array_like, shape (..., Tk, dv); converted to q's dtype
    offset : int >= 0, optional
        The mask; ``None`` masks nothing, ``0`` is causal.
    scale : float > 0, optional
        Score scale, default 1/sqrt(dk).
    backend : {"auto", "cpp", "numba", "numpy"}

    Returns
    -------
    AttentionForward
        ``out`` (..., Tq, dv) in q's dtype; ``lse`` (..., Tq) float64, the log-partition
        of each row (pass it to :func:`attention_backward`); ``entropy`` (..., Tq)
        float64, the entropy of each row's attention distribution.
    """
    fn = resolve("attention_forward", backend)
    q, k, v, off, sc = _qkv(q, k, v, offset, scale)
    lead, tq = q.shape[:-2], q.shape[-2]
    out = np.empty(lead + (tq, v.shape[-1]), q.dtype)
    lse, ent = np.empty(lead + (tq,)), np.empty(lead + (tq,))
    if out.size or lse.size:
        nbad = fn(_flat(q), _flat(k), _flat(v), off, sc, _flat(out), lse.reshape(-1, tq), ent.reshape(-1, tq))
        if nbad:
            raise ValueError(f"the attention scores overflowed in {nbad} row(s); rescale q, k or scale")
    return AttentionForward(out, lse, ent)


def attention_backward(q: Any, k: Any, v: Any, d_o: Any, lse: Any, *, o: Any = None, offset: int | None = None,
                       scale: float | None = None, backend: str = "auto") -> AttentionBackward:
    """One attention head backward: dq, dk, dv from dL/do, recomputing p from ``lse``.

    Parameters
    ----------
    q, k, v : array_like
        As for :func:`attention_forward`, with the same offset and scale.
    d_o : array_like, shape (..., Tq, dv)
        dL/do; converted to q's dtype.
    lse : array_like, shape (..., Tq)
        The ``lse`` of :func:`attention_forward` (float64).
    o : array_like, shape (..., Tq, dv), optional
        The ``out`` of :func:`attention_forward` (the row sums sum_j p_ij d_o_i.v_j are
        d_o_i.o_i); converted to q's dtype. If None, a forward pass computes it.
    offset, scale, backend
        As for :func:`attention_forward`.

    Returns
    -------
    AttentionBackward
        ``dq``, ``dk``, ``dv`` in q's dtype and ``spread`` (..., Tq) float64: the
        attention-weighted standard deviation sqrt(sum_j p_ij A_ij^2) of each row's advantage.
    """
    fn = resolve("attention_backward", backend)
    q, k, v, off, sc = _qkv(q, k, v, offset, scale)
    lead, tq = q.shape[:-2], q.shape[-2]
    d_o = _array("d_o", d_o, q.dtype)
    if d_o.shape != lead + (tq, v.shape[-1]):
        raise ValueError(f"d_o must have shape {lead + (tq, v.shape[-1])} (..., Tq, dv); got {d_o.shape}")
    lse_a = np.ascontiguousarray(_v.float_array("lse", lse), dtype=np.float64)
    if lse_a.shape != lead + (tq,):
        raise ValueError(f"lse must have shape {lead + (tq,)} (..., Tq); got {lse_a.shape}")
    _check_finite(d_o=d_o, lse=lse_a)
    if o is None:
        o = attention_forward(q, k, v, offset=off, scale=sc, backend=backend).out
    else:
        o = _array("o", o, q.dtype)
        if o.shape != d_o.shape:
            raise ValueError(f"o must have shape {d_o.shape} (..., Tq, dv), the forward pass's out; got {o.shape}")
        _check_finite(o=o)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    spread = np.empty(lead + (tq,))
    if q.size or k.size:
        nbad = fn(_flat(q), _flat(k), _flat(v), _flat(o), _flat(d_o), lse_a.reshape(-1, tq), off, sc,
                  _flat(dq), _flat(dk), _flat(dv), spread.reshape(-1, tq))
        if nbad:
            raise ValueError(f"the attention backward pass overflowed in {nbad} row(s); are o and lse the "
                             "forward pass's for the same q, k, v, offset and scale?")
    return AttentionBackward(dq, dk, dv, spread)
