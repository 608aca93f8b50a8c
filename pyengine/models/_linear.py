"""The block engine's weight products: fused epilogues and reused workspaces.

Every ``x @ W`` of :mod:`pyengine.models._blocks` and :mod:`._attention` goes through the
dense-layer kernels of :mod:`pyengine.kernels.linear` (the ``"auto"`` backend, called
raw: the Stack validated everything): the bias, the activation, the JVP coefficient and
the residual add are applied to each row tile of the product while it is in cache,
instead of by separate passes over the (K*T, n) result. The ``"cpp"`` kernels call
NumPy's OpenBLAS single-threaded from pyengine's own threads, so no second thread pool
spins after each product (that cost every OpenMP kernel after a GEMM up to 2x).

Temporaries that do not outlive a block (the MLP hidden activations, the projections of a
forward whose cache is discarded, the JVP's hidden tangents) come from :func:`workspace`:
per thread, one array per (role, shape, dtype), reused by the next block instead of being
allocated (and page-faulted in) afresh, at the price of keeping a few of them alive
between calls (:func:`release_workspaces` frees them).

:func:`bf16_products` switches this thread's float32 weight products to bf16 operands with
float32 accumulation (:mod:`pyengine.kernels.linear_bf16`): each weight is rounded to bf16
and packed once, kept while the weight array lives, and the epilogues stay float32.

float32 only: the tile's gemm can round differently from one gemm over all rows (where a
row falls in its tile), within float32 rounding of the product. float64 keeps NumPy's
``x @ w + b`` and the separate kernels, bit for bit as before (but with the workspaces).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..kernels.activations import kernel as activation_kernel
from ..kernels import linear_bf16
from ..kernels.linear import kernel

__all__ = ["FUSED_ACTIVATIONS", "bf16_active", "bf16_products", "dense", "dense_act", "dense_mul", "release_workspaces",
           "workspace"]

#: Activations the ``linear_act`` epilogue applies; the gated ones keep their own kernels.
FUSED_ACTIVATIONS = ("gelu", "gelu_tanh", "relu")
#: Workspaces kept per thread, all roles and shapes together (the oldest goes first).
MAX_WORKSPACES = 8

_local = threading.local()


def workspace(role: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialized array of ``shape`` and ``dtype``, the same one for the same role on this thread.

    Its contents are overwritten by the next caller of the same role: use it only for a
    temporary that no caller keeps (not for anything stored in a cache that outlives
    the block, or handed to a hook).
    """
    pool: dict = _local.__dict__.setdefault("pool", {})
    key = (role, tuple(shape), np.dtype(dtype))
    a = pool.pop(key, None)
    if a is None:
        a = np.empty(shape, dtype)
        while len(pool) >= MAX_WORKSPACES:
            pool.pop(next(iter(pool)))
    pool[key] = a  # most recently used last
    return a


def release_workspaces() -> None:
    """Free this thread's workspaces."""
    _local.__dict__.pop("pool", None)


#: id(weight) -> (weak reference to it, its packed bf16 copy); an entry goes with its weight.
_PACKED: dict[int, tuple[weakref.ref, linear_bf16.PackedWeight]] = {}


@contextlib.contextmanager
def bf16_products() -> Iterator[None]:
    """While active, this thread's float32 weight products take bf16 operands (float32 accumulation).

    The attention heads' products, the norms and the activations stay float32. Raises
    ValueError (one line: why) where bf16 products are refused
    (:func:`pyengine.kernels.linear_bf16.require`). What runs inside carries no error
    estimate: the caller measures it against float32 (:func:`pyengine.propagate` does).
    """
    linear_bf16.require()
    prev = bf16_active()
    _local.bf16 = True
    try:
        yield
    finally:
        _local.bf16 = prev


def bf16_active() -> bool:
    """Whether :func:`bf16_products` is active on this thread."""
    return getattr(_local, "bf16", False)


def _packed(w: np.ndarray) -> np.ndarray:
    """The packed bf16 copy of weight ``w`` (made on first use, kept while ``w`` lives)."""
    key = id(w)
    hit = _PACKED.get(key)
    if hit is not None and hit[0]() is w:
        return hit[1].data

    def forget(ref: weakref.ref, key: int = key) -> None:
        if _PACKED.get(key, (None,))[0] is ref:
            del _PACKED[key]

    p = linear_bf16.pack(np.ascontiguousarray(w, dtype=np.float32))
    _PACKED[key] = (weakref.ref(w, forget), p)
    return p.data


def _fused(dtype: np.dtype) -> bool:
    """float32 takes the linear kernels; float64 keeps NumPy's ``x @ w + b``, bit for bit as before."""
    return dtype == np.float32


def dense(x2: np.ndarray, w: np.ndarray, b: np.ndarray | None, r: np.ndarray | None = None,
          out: np.ndarray | None = None) -> np.ndarray:
    """x2 @ w (+ b) (+ r), (N, n), into ``out`` (fresh if None)."""
    if out is None:
        out = np.empty((x2.shape[0], w.shape[1]), x2.dtype)
    if _fused(x2.dtype):
        if bf16_active():
            linear_bf16.kernel("linear_bf16")(np.ascontiguousarray(x2), _packed(w), b, r, out)
        else:
            kernel("linear")(np.ascontiguousarray(x2), w, b, r, out)
        return out
    np.matmul(x2, w, out=out)
    if b is not None:
        out += b
    if r is not None:
        out += r
    return out


def dense_act(x2: np.ndarray, w: np.ndarray, b: np.ndarray | None, activation: str, u: np.ndarray | None,
              out: np.ndarray) -> int:
    """u = x2 @ w (+ b) (kept in u unless None), out = activation(u); the rows of u with NaN/Inf."""
    if _fused(x2.dtype):
        if bf16_active():
            return linear_bf16.kernel("linear_act_bf16")(np.ascontiguousarray(x2), _packed(w), b, activation, u, out)
        return kernel("linear_act")(np.ascontiguousarray(x2), w, b, activation, u, out)
    p = dense(x2, w, b, out=out if u is None else u)
    return activation_kernel(activation)(p, out)


def dense_mul(x2: np.ndarray, w: np.ndarray, coef: np.ndarray, out: np.ndarray) -> np.ndarray:
    """(x2 @ w) * coef into ``out``; coef (M, n) with M dividing N: row i uses coef[i % M]."""
    if _fused(x2.dtype):
        if bf16_active():
            linear_bf16.kernel("linear_mul_bf16")(np.ascontiguousarray(x2), _packed(w), coef, out)
        else:
            kernel("linear_mul")(np.ascontiguousarray(x2), w, coef, out)
        return out
    np.matmul(x2, w, out=out)
    out.reshape((-1,) + coef.shape)[...] *= coef
    return out
