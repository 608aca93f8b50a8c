"""Batched, matrix-free linear operators: a batch of B operators, each m x n.

Longer than ~400 lines by exception: the protocol's ``@ + - * .T take`` return the compositions
defined here, so they cannot move to a module of their own without an import cycle.

The protocol (:class:`BatchedOperator`) is small:

* ``batch`` (B), ``shape`` (m, n) and ``dtype`` (float32 or float64);
* ``matvec(V)``: V of shape (B, n) -> (B, m), row b is ``A_b @ V[b]``;
* ``rmatvec(U)``: U of shape (B, m) -> (B, n), row b is ``A_b.T @ U[b]``;
* ``upper_bound()``: (B,) float64, a cheap *guaranteed* upper bound of each
  ``sigma_max(A_b)`` (``np.inf`` where none is known);
* ``take(idx)``: the sub-batch ``idx`` (what the spectral solvers use to stop
  iterating operators that have converged).

Both products accept ``out=``, a preallocated C-contiguous (B, m) resp. (B, n)
array of the operator's dtype, so that iterative solvers allocate nothing per
step. Inputs are converted to the operator's dtype and never modified.

An operator with ``batch == 1`` is *one* operator shared by the whole batch: its
products accept any number of rows, each multiplied by the same matrix, and in a
composition it broadcasts against a batch of B (a weight matrix W shared by all
tokens, composed with per-token LayerNorm Jacobians: ``I + W @ J``).

Here: the protocol and the compositions :class:`Product` (``A @ B``), :class:`Sum`
(``A + B``, ``A - B``), :class:`Scaled` (``c * A``, ``-A``) and
:class:`Identity` (``I + A``), whose bounds compose (product of the bounds, sum,
``|c|`` times, 1). Elsewhere in :mod:`pyengine.linalg`: :class:`~.dense.DenseOperator`
(a stack of matrices; products are GEMMs in BLAS), :class:`~.norm_jacobians.LayerNormJacobian`
and :class:`~.norm_jacobians.RMSNormJacobian` (per token, through the LayerNorm JVP / VJP
kernels: the d x d Jacobian is never formed); :func:`~.convert.as_linear_operator` and
:func:`~.convert.from_linear_operator` convert one operator to and from
:class:`scipy.sparse.linalg.LinearOperator`.

Subclassing: implement ``_matvec(V, out)`` and ``_rmatvec(U, out)`` (``V`` is
already validated, C-contiguous and of ``self.dtype``; ``out`` is ``None`` or a
buffer to fill and return), and optionally ``upper_bound`` and ``take``, then
call ``super().__init__(batch, shape, dtype)``.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from .. import _validate as _v

__all__ = [
    "BatchedOperator",
    "Identity",
    "Product",
    "Scaled",
    "Sum",
]

#: Relative slack added to bounds computed in floating point, so that rounding in
#: the bound itself can never make it smaller than the quantity that it bounds.
_BOUND_SLACK = 1e-12


def _batch_of(name: str, *ops: BatchedOperator) -> int:
    """Common batch of ``ops``: equal, or 1 (broadcast)."""
    sizes = {op.batch for op in ops} - {1}
    if len(sizes) > 1:
        got = ", ".join(str(op.batch) for op in ops)
        raise ValueError(f"{name}: batch sizes must be equal or 1 (broadcast); got {got}")
    return sizes.pop() if sizes else 1


def _as_slice(idx: np.ndarray) -> slice | None:
    """``idx`` as a slice if it is a contiguous increasing range (then take() can return views)."""
    if idx.size and idx[-1] - idx[0] == idx.size - 1 and (idx.size == 1 or (np.diff(idx) == 1).all()):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return None


def _check_op(name: str, op: Any) -> BatchedOperator:
    if not isinstance(op, BatchedOperator):
        raise TypeError(
            f"{name} must be a pyengine BatchedOperator (see pyengine.linalg.operators); got {type(op).__name__}"
        )
    return op


class BatchedOperator:
    """A batch of ``batch`` linear operators, each of shape ``shape`` = (m, n).

    See the module docstring for the protocol. Arithmetic: ``A @ B`` is
    :class:`Product`, ``A + B`` / ``A - B`` :class:`Sum`, ``c * A`` / ``-A``
    :class:`Scaled`; ``A.T`` is the batch of transposes.
    """

    __array_ufunc__ = None  # so that ``ndarray * op`` and ``c * op`` reach __rmul__

    def __init__(self, batch: int, shape: tuple[int, int], dtype: Any) -> None:
        batch = _v.count("batch", batch)
        if (
            not isinstance(shape, tuple)
            or len(shape) != 2
            or not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) and s >= 1 for s in shape)
        ):
            raise ValueError(f"shape must be a tuple (m, n) of positive integers; got {shape!r}")
        self.batch = batch
        self.shape = (int(shape[0]), int(shape[1]))
        self.dtype = _v.float_dtype("dtype", dtype)

    # -- the protocol ---------------------------------------------------------------
    def _rows(self, name: str, a: Any, width: int) -> np.ndarray:
        arr = _v.float_array(name, a)
        if arr.ndim != 2 or arr.shape[1] != width or (self.batch != 1 and arr.shape[0] != self.batch):
            want = f"(k, {width})" if self.batch == 1 else f"(B, {width}) = ({self.batch}, {width})"
            raise ValueError(f"{name} must have shape {want} for {self._name()}; got {arr.shape}")
        return np.ascontiguousarray(arr, dtype=self.dtype)

    def _out(self, out: Any, rows: int, width: int, inputs: tuple[Any, ...]) -> np.ndarray | None:
        if out is None:
            return None
        return _v.output(out, (rows, width), self.dtype, inputs, core=None, of="the operator")[0]

    def matvec(self, V: Any, out: np.ndarray | None = None) -> np.ndarray:
        """``A_b @ V[b]`` for every b: V (B, n) -> (B, m), in the operator's dtype."""
        V2 = self._rows("V", V, self.shape[1])
        res = self._matvec(V2, self._out(out, V2.shape[0], self.shape[0], (V,)))
        return res if out is None else out

    def rmatvec(self, U: Any, out: np.ndarray | None = None) -> np.ndarray:
        """``A_b.T @ U[b]`` for every b: U (B, m) -> (B, n), in the operator's dtype."""
        U2 = self._rows("U", U, self.shape[0])
        res = self._rmatvec(U2, self._out(out, U2.shape[0], self.shape[1], (U,)))
        return res if out is None else out

    def upper_bound(self) -> np.ndarray:
        """(B,) float64: guaranteed upper bounds of sigma_max per operator (inf: unknown)."""
        return np.full(self.batch, np.inf)

    def take(self, idx: Any) -> BatchedOperator:
        """The operators ``idx`` (integer indices into the batch) as a new batch."""
        idx = self._indices(idx)
        return self if self.batch == 1 else _Taken(self, idx)

    # -- to implement -----------------------------------------------------------------
    def _matvec(self, V: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        raise NotImplementedError(f"{type(self).__name__} does not implement _matvec")

    def _rmatvec(self, U: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        raise NotImplementedError(f"{type(self).__name__} does not implement _rmatvec")

    # -- helpers ----------------------------------------------------------------------
    def _indices(self, idx: Any) -> np.ndarray:
        return _v.indices("idx", idx, self.batch)

    def _name(self) -> str:
        return f"{type(self).__name__} of batch {self.batch} and shape {self.shape}"

    def __repr__(self) -> str:
        return f"<{self._name()}, {self.dtype}>"

    @property
    def T(self) -> BatchedOperator:
        """The batch of transposes (matvec and rmatvec exchanged)."""
        return _Transposed(self)

    # -- arithmetic -------------------------------------------------------------------
    def __matmul__(self, other: Any) -> BatchedOperator:
        if not isinstance(other, BatchedOperator):
            return NotImplemented
        return Product(self, other)

    def __add__(self, other: Any) -> BatchedOperator:
        if not isinstance(other, BatchedOperator):
            return NotImplemented
        return Sum(self, other)

    def __sub__(self, other: Any) -> BatchedOperator:
        if not isinstance(other, BatchedOperator):
            return NotImplemented
        return Sum(self, Scaled(-1.0, other))

    def __mul__(self, c: Any) -> BatchedOperator:
        if isinstance(c, BatchedOperator):
            return NotImplemented
        return Scaled(c, self)

    __rmul__ = __mul__

    def __neg__(self) -> BatchedOperator:
        return Scaled(-1.0, self)


class _Taken(BatchedOperator):
    """Generic sub-batch of an operator without its own ``take``: scatters into the full batch."""

    def __init__(self, op: BatchedOperator, idx: np.ndarray) -> None:
        super().__init__(len(idx), op.shape, op.dtype)
        if len(idx) == 0:
            raise ValueError("idx must select at least one operator")
        self.op, self.idx = op, idx

    def _full(self, W: np.ndarray, width: int) -> np.ndarray:
        full = np.zeros((self.op.batch, width), dtype=self.dtype)
        full[self.idx] = W
        return full

    def _apply(self, which, W, out, width_in, width_out):
        if W.shape[0] == self.batch:
            res = getattr(self.op, which)(self._full(W, width_in))[self.idx]
        else:  # batch 1 shared by k rows: one row at a time
            res = np.concatenate([getattr(self.op, which)(self._full(w[None], width_in))[self.idx] for w in W])
        if out is None:
            return res
        out[...] = res
        return out

    def _matvec(self, V, out):
        return self._apply("matvec", V, out, self.shape[1], self.shape[0])

    def _rmatvec(self, U, out):
        return self._apply("rmatvec", U, out, self.shape[0], self.shape[1])

    def upper_bound(self):
        return self.op.upper_bound()[self.idx]

    def take(self, idx):
        return self.op.take(self.idx[self._indices(idx)])


class _Transposed(BatchedOperator):
    def __init__(self, op: BatchedOperator) -> None:
        super().__init__(op.batch, op.shape[::-1], op.dtype)
        self.op = op

    def _matvec(self, V, out):
        return self.op.rmatvec(V, out=out)

    def _rmatvec(self, U, out):
        return self.op.matvec(U, out=out)

    def upper_bound(self):
        return self.op.upper_bound()

    def take(self, idx):
        return _Transposed(self.op.take(self._indices(idx)))

    @property
    def T(self):
        return self.op


class Identity(BatchedOperator):
    """The n x n identity, for ``I + A``; ``batch`` 1 broadcasts against any batch.

    Parameters
    ----------
    n : int
    batch : int, default 1
    dtype : float32 or float64, default float64
    """

    def __init__(self, n: int, batch: int = 1, dtype: Any = np.float64) -> None:
        super().__init__(batch, (n, n), dtype)

    def _matvec(self, V, out):
        if out is None:
            return V.copy()
        out[...] = V
        return out

    _rmatvec = _matvec

    def upper_bound(self):
        return np.ones(self.batch)

    def take(self, idx):
        idx = self._indices(idx)
        return self if self.batch == 1 else Identity(self.shape[0], len(idx), self.dtype)


class Scaled(BatchedOperator):
    """``c * A``: c a real scalar or one real per operator (shape (B,)).

    The dtype is A's; the bound is ``|c|`` times A's.
    """

    def __init__(self, c: Any, A: BatchedOperator) -> None:
        A = _check_op("A", A)
        carr = np.asarray(c)
        if carr.dtype.kind not in "biuf" or carr.dtype.kind == "b":
            raise TypeError(f"c must be a real number or a (B,) array of reals; got {carr.dtype}")
        carr = _v.finite("c", carr.astype(np.float64))
        if carr.ndim == 0:
            batch = A.batch
        elif carr.ndim == 1 and (A.batch == 1 or carr.shape[0] == A.batch):
            batch = carr.shape[0]
        else:
            raise ValueError(f"c must be a scalar or have shape (B,) = ({A.batch},); got {carr.shape}")
        super().__init__(batch, A.shape, A.dtype)
        self.c, self.A = carr, A

    def _coef(self, rows: int) -> np.ndarray | float:
        if self.c.ndim == 0:
            return float(self.c)
        if rows != self.batch:  # a batch-1 operator applied to k rows
            return float(self.c[0])
        return self.c.astype(self.dtype)[:, None]

    def _matvec(self, V, out):
        res = self.A.matvec(V, out=out)
        res *= self._coef(V.shape[0])
        return res

    def _rmatvec(self, U, out):
        res = self.A.rmatvec(U, out=out)
        res *= self._coef(U.shape[0])
        return res

    def upper_bound(self):
        b = np.abs(self.c) * self.A.upper_bound()
        return np.broadcast_to(b, (self.batch,)).astype(np.float64)

    def take(self, idx):
        idx = self._indices(idx)
        if self.batch == 1:
            return self
        return Scaled(self.c if self.c.ndim == 0 else self.c[idx], self.A.take(idx) if self.A.batch > 1 else self.A)

    def _name(self):
        return f"Scaled({'c' if self.c.ndim else float(self.c)} * {self.A._name()})"


class Sum(BatchedOperator):
    """``A + B`` (same shape; batches equal or 1). The bound is the sum of the bounds."""

    def __init__(self, A: BatchedOperator, B: BatchedOperator) -> None:
        A, B = _check_op("A", A), _check_op("B", B)
        if A.shape != B.shape:
            raise ValueError(f"A + B needs operators of the same shape; got {A.shape} and {B.shape}")
        super().__init__(_batch_of("A + B", A, B), A.shape, np.result_type(A.dtype, B.dtype))
        self.A, self.B = A, B

    def _apply(self, V, out, which):
        width = self.shape[0] if which == "matvec" else self.shape[1]
        res = np.empty((V.shape[0], width), self.dtype) if out is None else out
        if self.A.dtype == self.dtype:
            getattr(self.A, which)(V, out=res)
        else:
            res[...] = getattr(self.A, which)(V)
        res += getattr(self.B, which)(V)
        return res

    def _matvec(self, V, out):
        return self._apply(V, out, "matvec")

    def _rmatvec(self, U, out):
        return self._apply(U, out, "rmatvec")

    def upper_bound(self):
        return np.broadcast_to(self.A.upper_bound() + self.B.upper_bound(), (self.batch,)).astype(np.float64)

    def take(self, idx):
        idx = self._indices(idx)
        if self.batch == 1:
            return self
        return Sum(*(op.take(idx) if op.batch > 1 else op for op in (self.A, self.B)))

    def _name(self):
        return f"Sum of batch {self.batch} and shape {self.shape}"


class Product(BatchedOperator):
    """``A @ B`` (A: m x k, B: k x n; batches equal or 1): ``matvec(V) = A.matvec(B.matvec(V))``.

    The bound is the product of the bounds. The intermediate (B, k) array is kept
    between calls, so a product is not safe to call from two threads at once.
    """

    def __init__(self, A: BatchedOperator, B: BatchedOperator) -> None:
        A, B = _check_op("A", A), _check_op("B", B)
        if A.shape[1] != B.shape[0]:
            raise ValueError(
                f"A @ B needs A's columns to match B's rows; got A of shape {A.shape} and B of shape {B.shape}"
            )
        super().__init__(
            _batch_of("A @ B", A, B), (A.shape[0], B.shape[1]), np.result_type(A.dtype, B.dtype)
        )
        self.A, self.B = A, B
        self._mid: dict[tuple[str, int], np.ndarray] = {}

    def _scratch(self, key: str, rows: int, dtype: np.dtype) -> np.ndarray:
        buf = self._mid.get((key, rows))
        if buf is None or buf.dtype != dtype:
            buf = self._mid[key, rows] = np.empty((rows, self.A.shape[1]), dtype)
        return buf

    def _finish(self, op, which, mid, out, width):
        if out is not None and op.dtype == self.dtype:
            return getattr(op, which)(mid, out=out)
        res = getattr(op, which)(mid)
        if out is None:
            return res.astype(self.dtype, copy=False)
        out[...] = res
        return out

    def _matvec(self, V, out):
        mid = self.B.matvec(V, out=self._scratch("m", V.shape[0], self.B.dtype))
        return self._finish(self.A, "matvec", mid, out, self.shape[0])

    def _rmatvec(self, U, out):
        mid = self.A.rmatvec(U, out=self._scratch("r", U.shape[0], self.A.dtype))
        return self._finish(self.B, "rmatvec", mid, out, self.shape[1])

    def upper_bound(self):
        b = self.A.upper_bound() * self.B.upper_bound()
        return np.broadcast_to(b, (self.batch,)).astype(np.float64)

    def take(self, idx):
        idx = self._indices(idx)
        if self.batch == 1:
            return self
        return Product(*(op.take(idx) if op.batch > 1 else op for op in (self.A, self.B)))

    def _name(self):
        return f"Product of batch {self.batch} and shape {self.shape}"
