"""Checks of array arguments, and the messages for bad rows found by the kernels.

Part of :mod:`pyengine._validate` (the one home of argument checks; import it from there).

Every check names the argument, what was expected and what was given
(DESIGN.md, "Bad input"). Shapes, dtypes and parameters are checked here,
before any kernel runs. Checks on the *values* of the large arrays (NaN/Inf,
constant rows with eps = 0) need every value read once, so the kernels count
bad rows during their own first pass and :func:`raise_bad_rows` turns a non-zero
count into the same kind of message, found again here on the slow path.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from .values import FLOAT_DTYPES, real

#: Default memory budget of dense outputs (Jacobians): 2 GiB.
DENSE_MAX_BYTES = 2 * 2**30


def as_array(name: str, a: Any, dtype: Any = None) -> np.ndarray:
    """``np.asarray(a, dtype)``, with NumPy's conversion errors (ragged nested lists, objects
    that are not numbers) turned into a ValueError that names ``name``."""
    if isinstance(a, np.ndarray) and dtype is None:
        return a
    try:
        return np.asarray(a, dtype=dtype)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name} must be an array of numbers (a regular, non-ragged nesting); "
                         f"cannot convert it: {exc}") from None


def widened(a: Any) -> Any:
    """A float16 or bfloat16 ndarray as a new float32 array, exactly (each of their values is a
    float32: bfloat16 is the top half of one); anything else as it is. bfloat16 (ml_dtypes') is
    recognised by its dtype's name and size, so ml_dtypes is never imported."""
    if not isinstance(a, np.ndarray):
        return a
    if a.dtype == np.float16:
        return a.astype(np.float32)
    if a.dtype.name == "bfloat16" and a.dtype.itemsize == 2:
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return a


def float_array(name: str, a: Any) -> np.ndarray:
    """``a`` as an ndarray of float32/float64 (not copied; float16 and bfloat16 widened exactly
    to float32, see :func:`widened`), or a TypeError naming ``name``."""
    arr = widened(as_array(name, a))
    if arr.dtype in FLOAT_DTYPES:
        return arr
    kind = arr.dtype.kind
    if kind in "biu":
        hint = f"convert it first, e.g. {name}.astype(np.float64)"
    elif kind == "f":  # longdouble
        hint = f"convert it to float32 or float64, e.g. {name}.astype(np.float32)"
    elif kind == "c":
        hint = "complex input is not supported; pass the real part or split real and imaginary parts"
    else:
        hint = "pass a numeric array"
    raise TypeError(f"{name} must be a float32 or float64 array; got dtype {arr.dtype}: {hint}")


def rows(name: str, a: Any) -> tuple[np.ndarray, tuple[int, ...]]:
    """Validate ``a`` of shape (..., d), d >= 2; return its C-contiguous (n, d) view and shape."""
    arr = float_array(name, a)
    if arr.ndim == 0:
        raise ValueError(f"{name} must have shape (..., d); got a scalar")
    d = arr.shape[-1]
    if d < 2:
        raise ValueError(f"{name} must have a last axis d >= 2 to normalize over; got shape {arr.shape}")
    if arr.ndim == 2 and arr.flags.c_contiguous:  # already the kernel view
        return arr, arr.shape
    return np.ascontiguousarray(arr).reshape(-1, d), arr.shape


def tangent(name: str, a: Any, x2: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A tangent (v or u): the shape of x, converted to x's dtype, as (n, d)."""
    arr = float_array(name, a)
    if arr.shape != shape:
        raise ValueError(f"{name} must have the shape of x, {shape}; got {arr.shape}")
    if arr.ndim == 2 and arr.dtype == x2.dtype and arr.flags.c_contiguous:
        return arr
    return np.ascontiguousarray(arr, dtype=x2.dtype).reshape(x2.shape)


def param(name: str, a: Any, x2: np.ndarray, fill: float) -> np.ndarray:
    """gamma or beta: shape (d,), finite, in x's dtype; ``None`` means all ``fill``."""
    d = x2.shape[1]
    if a is None:
        return _filled(d, fill, x2.dtype)
    arr = float_array(name, a)
    if arr.shape != (d,):
        raise ValueError(f"{name} must have shape (d,) = ({d},) to match x; got {arr.shape}")
    # A finite dot product with a constant tiny vector proves every entry finite (one BLAS
    # call, a third of isfinite + all on a small vector). The weight 2^-64 (float32) or
    # 2^-600 (float64) keeps the sum of any finite entries far from overflow, so a finite
    # gamma never warns; NaN/Inf give NaN/Inf, and only then are the entries looked at.
    tiny = _TINY_VECS.get((d, arr.dtype.char))
    if tiny is None:
        tiny = _TINY_VECS[d, arr.dtype.char] = _filled(d, _TINY[arr.dtype.itemsize == 4], arr.dtype)
    if not math.isfinite(arr.dot(tiny)) and not np.isfinite(arr).all():
        i = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise ValueError(f"{name} contains NaN or Inf (first at index {i}: {arr[i]})")
    if arr.dtype is x2.dtype and arr.flags.c_contiguous:  # the common case: no conversion
        return arr
    return np.ascontiguousarray(arr, dtype=x2.dtype)


_TINY = (2.0**-600, 2.0**-64)  # the weights of param's finiteness test: float64, float32
#: param's tiny vectors by (d, dtype char): a dict lookup, cheaper than _filled's lru_cache
#: (a one-token call spends microseconds in this layer). Each is one of _filled's arrays.
_TINY_VECS: dict[tuple[int, str], np.ndarray] = {}


@functools.lru_cache(maxsize=64)
def _filled(d: int, fill: float, dtype: np.dtype) -> np.ndarray:
    """A read-only (d,) array of ``fill``: the default gamma / beta, made once per (d, dtype)."""
    arr = np.full(d, fill, dtype=dtype)
    arr.flags.writeable = False
    return arr


def output(
    out: Any, shape: tuple[int, ...], dtype: np.dtype, inputs: tuple[Any, ...], core: int | None = 1,
    *, inplace: np.ndarray | None = None, name: str = "out", of: str = "x",
) -> tuple[np.ndarray, np.ndarray]:
    """The result array (``out`` or a new one) and its C-contiguous kernel view.

    ``shape`` is the full output shape; the kernel view keeps the last ``core``
    axes (1: (n, d); 2 for Jacobians: (n, d, d)) and merges the rest into one
    token axis (``core=None``: no view, None in its place). ``out`` must not overlap any of ``inputs``, except that it may be
    ``inplace`` itself (the whole array, for kernels that work in place). ``name``
    and ``of`` (the input whose dtype the result takes) are for the messages.
    """
    if out is None:
        res = np.empty(shape, dtype=dtype)
        if core is None:
            return res, None
        return res, res if len(shape) == core + 1 else res.reshape((-1,) + shape[len(shape) - core :])
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray; got {type(out).__name__}")
    if out.shape != shape:
        raise ValueError(f"{name} must have shape {shape}; got {out.shape}")
    if out.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype} (the dtype of {of}); got {out.dtype}")
    if not out.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if not out.flags.writeable:
        raise ValueError(f"{name} must be writeable")
    seen: set[int] = set()
    for a in inputs:
        if not isinstance(a, np.ndarray) or id(a) in seen:
            continue
        seen.add(id(a))
        if a is out and a is inplace:  # in place, the common case: no need to look further
            continue
        if np.may_share_memory(out, a):
            same = (a is inplace and a.shape == out.shape and a.flags.c_contiguous
                    and a.ctypes.data == out.ctypes.data)
            if not same:
                hint = " (it may be the input itself, for in-place use)" if inplace is not None else ""
                raise ValueError(f"{name} must not overlap any input array{hint}")
    return out, None if core is None else out.reshape((-1,) + shape[len(shape) - core :])


def dense_budget(shape: tuple[int, ...], dtype: np.dtype, max_bytes: Any) -> None:
    """Refuse a dense output larger than ``max_bytes`` before allocating it."""
    limit = DENSE_MAX_BYTES if max_bytes is None else real("max_bytes", max_bytes, low=0, low_open=True,
                                                           finite=False, what="a positive number of bytes")
    need = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
    if need > limit:
        raise ValueError(
            f"the dense Jacobian of shape {shape} ({dtype}) needs {need / 2**30:.2f} GiB, over the "
            f"budget max_bytes = {limit / 2**30:.2f} GiB; use the matrix-free *_jvp / *_vjp "
            f"functions, fewer tokens, or pass a larger max_bytes"
        )


def raise_bad_rows(
    nbad: int,
    x2: np.ndarray,
    shape: tuple[int, ...],
    eps_value: float,
    norm: str,
    tangent_name: str | None = None,
    t2: np.ndarray | None = None,
) -> None:
    """Turn a kernel's bad-row count into a ValueError that names the argument and row."""
    if nbad == 0:
        return
    lead = shape[:-1]

    def where(flat_row: int) -> str:
        return str(tuple(int(i) for i in np.unravel_index(flat_row, lead)))

    for name, arr in (("x", x2), (tangent_name, t2)):
        if arr is not None:
            finite = np.isfinite(arr)
            if not finite.all():
                i, j = (int(k) for k in np.argwhere(~finite)[0])
                raise ValueError(
                    f"{name} contains NaN or Inf ({nbad} bad row(s); first in row {where(i)}, "
                    f"entry {j}: {arr[i, j]})"
                )
    xd = x2.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        # Each row scaled by a power of two first (exact), as the kernels do: a row of
        # 1e-170 is not constant, though its variance underflows to 0.
        top = np.abs(xd).max(axis=1, keepdims=True)
        ok = np.isfinite(top) & (top > 0)
        xd = xd * np.ldexp(1.0, -np.clip(np.frexp(np.where(ok, top, 1.0))[1], -1022, 1024))
        if norm == "layer_norm":
            stat = np.var(xd, axis=1)
            what, cure = "constant (zero variance)", "LayerNorm divides by zero"
        else:
            stat = np.mean(xd * xd, axis=1)
            what, cure = "all zeros", "RMSNorm divides by zero"
    zero = np.flatnonzero(stat + eps_value <= 0)
    if zero.size:
        raise ValueError(
            f"x row {where(int(zero[0]))} is {what} and eps = 0, so {cure} "
            f"({nbad} such row(s)); use eps > 0"
        )
    i = int(np.flatnonzero(~np.isfinite(stat))[0]) if not np.isfinite(stat).all() else 0
    raise ValueError(
        f"x row {where(i)}: the row statistics overflow float64 ({nbad} bad row(s)); "
        f"rescale x{'' if tangent_name is None else ' or ' + tangent_name} (normalization is "
        "scale-invariant up to eps, its derivatives linear in the tangent)"
    )


# -- kernels/cli checks --


def row_index(lead: tuple[int, ...], flat_row: int) -> str:
    """The index of row ``flat_row`` of a (N, n) view, in the array's own leading shape ``lead``."""
    return str(tuple(int(i) for i in np.unravel_index(flat_row, lead)))


def contiguous(name: str, a: Any) -> np.ndarray:
    """:func:`float_array`, made C-contiguous (copied only if it is not)."""
    arr = float_array(name, a)
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def scores(name: str, a: Any) -> np.ndarray:
    """Attention scores (or probabilities) of shape (..., Tq, Tk), Tk >= 1, C-contiguous."""
    arr = contiguous(name, a)
    if arr.ndim < 2 or arr.shape[-1] < 1:
        raise ValueError(f"{name} must have shape (..., Tq, Tk) with Tk >= 1; got {arr.shape}")
    return arr


def softmax_tangents(p: np.ndarray, dx: Any) -> tuple[np.ndarray, tuple[int, ...]]:
    """dx of ``softmax_jvp``: shape (R, ..., Tq, Tk) ending in p's shape, in p's dtype, C-contiguous.

    Leading unit axes of p broadcast (they may be left out of dx). Returns dx and the
    core shape of p (p's shape without those axes).
    """
    dxa = float_array("dx", dx)
    core = p.shape
    while len(core) > 2 and core[0] == 1:
        core = core[1:]
    k = len(core)
    if dxa.ndim < k or dxa.shape[dxa.ndim - k:] != core:
        raise ValueError(
            f"dx must have shape (R, ..., Tq, Tk) ending in p's shape {p.shape} (leading unit "
            f"axes of p may be left out); got {dxa.shape}"
        )
    return np.ascontiguousarray(dxa, dtype=p.dtype), core


def activation_rows(name: str, x: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """x of activation ``name``: (x as a C-contiguous array, its (N, n_in) view, the output width n).

    ``silu_gated`` needs an even, non-zero last axis [gate | up]; the others take any shape.
    """
    xa = contiguous("x", x)
    if name == "silu_gated":
        if xa.ndim < 1 or xa.shape[-1] % 2 or xa.shape[-1] == 0:
            raise ValueError(
                f"x must have shape (..., 2n) = [gate | up] for silu_gated (an even, non-zero "
                f"last axis); got {xa.shape}"
            )
        n_in = xa.shape[-1]
        return xa, xa.reshape(-1, n_in) if xa.size else xa, n_in // 2
    n_in = xa.shape[-1] if xa.ndim else 1
    return xa, xa.reshape(-1, n_in) if xa.size else xa, n_in


def raise_nonfinite(nbad: int, named: list[tuple[str, np.ndarray, tuple[int, ...]]]) -> None:
    """A kernel's bad-row count as a ValueError naming the argument, row and entry.

    ``named``: (argument name, array, its shape without the last axis) in the order to
    check. The message is that of :func:`raise_bad_rows`; with every input finite the
    kernel overflowed, and the message says so.
    """
    for name, a, lead in named:
        a2 = a.reshape(-1, a.shape[-1])
        finite = np.isfinite(a2)
        if not finite.all():
            i, j = (int(k) for k in np.argwhere(~finite)[0])
            raise ValueError(
                f"{name} contains NaN or Inf ({nbad} bad row(s); first in row "
                f"{row_index(lead, i)}, entry {j}: {a2[i, j]})"
            )
    raise ValueError(f"the computation overflowed in {nbad} row(s); rescale the inputs")


def raise_bad_softmax_rows(nbad: int, x3: np.ndarray, offset: int, shape: tuple[int, ...]) -> None:
    """The softmax kernel's bad-row count as a ValueError: a NaN/+Inf visible score, or a row
    with no finite visible score. ``x3`` : (N, Tq, Tk), the scores; ``shape``: x's own shape."""
    tq, tk = x3.shape[1:]
    visible = np.arange(tk)[None, :] <= np.arange(tq)[:, None] + offset
    lead = shape[:-1]
    bad = visible & (np.isnan(x3) | (x3 == np.inf))
    if bad.any():
        n, i, j = (int(k) for k in np.argwhere(bad)[0])
        raise ValueError(
            f"x contains NaN or +Inf among the visible scores ({nbad} bad row(s); first in row "
            f"{row_index(lead, n * tq + i)}, key {j}: {x3[n, i, j]})"
        )
    empty = ~(visible & (x3 > -np.inf)).any(axis=-1)
    n, i = (int(k) for k in np.argwhere(empty)[0])
    raise ValueError(
        f"x row {row_index(lead, n * tq + i)} has no finite visible score (all -inf): nothing to "
        f"normalize ({nbad} such row(s))"
    )


# -- bench checks --


# -- linalg checks --
def finite(name: str, a: Any) -> np.ndarray:
    """``a`` as an array if every value is finite; else a ValueError naming ``name`` and the first bad entry.

    The one message for NaN/Inf in an argument: ``"<name> contains NaN or Inf (first at
    index <i or (i, j, ...)>: <value>)"``, the index into the array as given.
    """
    arr = np.asarray(a)
    if np.isfinite(arr).all():
        return arr
    if arr.ndim == 0:
        raise ValueError(f"{name} contains NaN or Inf (got {arr[()]})")
    first = tuple(int(k) for k in np.argwhere(~np.isfinite(arr))[0])
    where = first[0] if arr.ndim == 1 else first
    raise ValueError(f"{name} contains NaN or Inf (first at index {where}: {arr[first]})")


def start_vectors(name: str, a: Any, batch: int, n: int) -> np.ndarray:
    """Start vectors of an iterative solver: shape (batch, n), finite, no zero row; unit rows in float64."""
    arr = float_array(name, a)
    if arr.shape != (batch, n):
        raise ValueError(f"{name} must have shape (B, n) = ({batch}, {n}); got {arr.shape}")
    arr = finite(name, arr).astype(np.float64)
    # Each row divided by its largest |entry| first, so that the norm of a row of 1e300
    # (or 1e-300) neither overflows nor underflows: only the direction matters.
    top = np.abs(arr).max(axis=1, keepdims=True) if n else np.zeros((batch, 1))
    if (top == 0).any():
        raise ValueError(
            f"{name} row {int(np.flatnonzero(top[:, 0] == 0)[0])} is zero; start vectors must be non-zero"
        )
    arr = arr / top
    return arr / np.linalg.norm(arr, axis=1, keepdims=True)


# -- models/analysis checks --
# Stacks, their initialization and the analyses on them (models/, analysis/, experiments/).
# They build on the checks above (finite, float_dtype, index, indices, choice) and keep
# their message formats.


def unit_rows(name: str, a: Any, d: int) -> np.ndarray:
    """Directions (d,) or (K, d), K >= 1, finite, none zero: as unit rows (K, d), float64."""
    v = float_array(name, a)
    if v.ndim not in (1, 2) or v.shape[-1] != d or v.size == 0:
        raise ValueError(f"{name} must have shape ({d},) or (K, {d}) with K >= 1; got {v.shape}")
    v = finite(name, np.atleast_2d(v).astype(np.float64))
    top = np.abs(v).max(axis=1)
    if (top == 0).any():
        raise ValueError(f"{name} {int(np.argmin(top))} is the zero vector: it has no direction")
    return normalized_rows(v, top)


def normalized_rows(v: np.ndarray, top: np.ndarray | None = None) -> np.ndarray:
    """The rows of ``v`` (K, d), float64, finite, none zero (not checked: see :func:`unit_rows`),
    scaled to unit length; ``top`` (K,) their largest |entry| (computed when not given)."""
    # Divided by its largest |entry| before the norm is taken, so that the norm of a
    # direction of 1e300 does not overflow (nor that of 1e-160 underflow): exact unit rows.
    top = np.abs(v).max(axis=1) if top is None else top
    v = v / top[:, None]
    return v / np.linalg.norm(v, axis=1)[:, None]


def reals(name: str, value: Any) -> np.ndarray:
    """A number or a 1-D sequence of numbers, finite, at least one: as a float64 array (S,)."""
    s = as_array(name, value, dtype=object if isinstance(value, str) else None)
    if s.dtype.kind not in "iuf" or s.ndim > 1 or s.size == 0:
        raise ValueError(f"{name} must be a number or a 1-D array of numbers; got {value!r}")
    return finite(name, np.atleast_1d(s).astype(np.float64))
