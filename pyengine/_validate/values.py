"""Checks of scalar arguments: counts, reals, flags, options, indices, seeds, callbacks.

Part of :mod:`pyengine._validate` (the one home of argument checks; import it from there).
Every message names the argument, what was expected and what was given.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

BENCH_FIGURES = ("fraction", "speedup_vs_numpy")

#: The fields of a ``pyengine bench --json`` row that :func:`pyengine.bench.compare` reads.
BENCH_KEYS = ("kernel", "backend", "dtype", "size")

MODES = ("full", "frozen_scale")

def count(name: str, value: Any, allow_none: bool = False) -> int | None:
    """A positive int (bool excluded), or None if ``allow_none``; ValueError naming ``name``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return int(value)

def real(
    name: str, value: Any, *, low: float | None = None, high: float | None = None, low_open: bool = False,
    high_open: bool = False, finite: bool = True, what: str | None = None,
) -> float:
    """``value`` as a float: a real number (bool excluded), never NaN, finite unless ``finite`` is
    False (then +-inf pass the bounds test like any number), in the interval given by ``low`` /
    ``high`` (open ends with ``low_open`` / ``high_open``). TypeError for a non-number, ValueError
    otherwise; both name ``name`` and say what was expected (``what``, or the interval)."""
    if what is None:
        what = "a finite number" if finite else "a number"
        if low is not None:
            what += f" {'>' if low_open else '>='} {low:g}"
        if high is not None:
            what += f"{' and' if low is not None else ''} {'<' if high_open else '<='} {high:g}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {what}; got {value!r}")
    v = float(value)
    ok = not np.isnan(v) and (not finite or np.isfinite(v))
    ok = ok and (low is None or (v > low if low_open else v >= low))
    ok = ok and (high is None or (v < high if high_open else v <= high))
    if not ok:
        raise ValueError(f"{name} must be {what}; got {value!r}")
    return v

def flag(name: str, value: Any) -> bool:
    """A boolean argument: True or False (NumPy's bool too), nothing else (no "no", 0 or None)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False; got {value!r}")

def eps(value: Any) -> float:
    """eps: a finite real number >= 0."""
    if type(value) is not float:  # the common case skips the (slow) check against numbers.Real
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"eps must be a real number >= 0; got {value!r}")
        value = float(value)
    if not (math.isfinite(value) and value >= 0):  # math, not NumPy: a microsecond less per call
        raise ValueError(f"eps must be a finite number >= 0; got {value}")
    return value

def frozen(mode: Any) -> bool:
    """mode: 'full' (the true derivative) or 'frozen_scale' (scale held constant)."""
    if mode not in MODES:
        raise ValueError(f"mode must be 'full' or 'frozen_scale'; got {mode!r}")
    return mode == "frozen_scale"

def choice(name: str, value: Any, options: tuple[str, ...]) -> str:
    """``value`` if it is one of ``options``; a ValueError naming ``name`` otherwise."""
    if value not in options:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}; got {value!r}")
    return value

def causal_offset(offset: Any, tk: int) -> int:
    """The softmax's causal ``offset``: None (no mask, Tk - 1) or an int >= 0, clipped to Tk - 1."""
    if offset is None:
        return tk - 1
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):
        raise TypeError(f"offset must be None or an int >= 0; got {offset!r}")
    if offset < 0:
        raise ValueError(
            f"offset must be >= 0 (key j is visible to query i when j <= i + offset, so key 0 "
            f"is always visible); got {offset}"
        )
    return int(min(offset, tk - 1))

def bench_report(name: str, doc: Any) -> dict[str, Any]:
    """A bench report (``{"results": [row, ...], ...}``) whose rows :func:`pyengine.bench.compare`
    can read: each row a dict with string ``kernel``, ``backend``, ``dtype``, ``size``, a finite
    ``spread`` >= 0, and ``fraction`` / ``speedup_vs_numpy`` absent, None or finite numbers.
    ValueError naming ``name`` and the first bad row otherwise."""
    hint = "not a `pyengine bench --json` file"
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise ValueError(f"{name} has no 'results' list: {hint}")

    def number(v: Any) -> bool:
        return isinstance(v, numbers.Real) and not isinstance(v, bool) and bool(np.isfinite(v))

    for i, row in enumerate(doc["results"]):
        if not isinstance(row, dict):
            raise ValueError(f"{name}: results[{i}] is {type(row).__name__} {row!r}, not a row object: {hint}")
        for key in BENCH_KEYS:
            if not isinstance(row.get(key), str):
                raise ValueError(f"{name}: results[{i}] has no string {key!r} (got {row.get(key)!r}): {hint}")
        if not (number(row.get("spread")) and row["spread"] >= 0):
            raise ValueError(f"{name}: results[{i}] needs a 'spread' >= 0 (got {row.get('spread')!r}): {hint}")
        for key in BENCH_FIGURES:
            if row.get(key) is not None and not number(row[key]):
                raise ValueError(f"{name}: results[{i}] {key!r} must be a number or null; got {row[key]!r}")
    return doc

def float_dtype(name: str, dtype: Any) -> np.dtype:
    """``dtype`` as float32 or float64; a TypeError naming ``name`` otherwise."""
    dt = np.dtype(dtype)
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32 or float64; got {dt}")
    return dt

def tol(value: Any, name: str = "tol") -> float:
    """A relative residual tolerance: a real number in (0, 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 < float(value) < 1):
        raise ValueError(f"{name} must be a real number in (0, 1) (a relative residual); got {value!r}")
    return float(value)

def callback(value: Any, name: str = "callback") -> Any:
    """None or a progress callable ``callback(done, total)``."""
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable as {name}(done, total) or None; got {type(value).__name__}")
    return value

def seed(value: Any, name: str = "seed") -> int | None:
    """A random seed: a non-negative integer, or None (fresh entropy)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0):
        raise ValueError(f"{name} must be a non-negative integer or None; got {value!r}")
    return None if value is None else int(value)

def index(name: str, value: Any, size: int) -> int:
    """One integer index in [0, size)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < size:
        raise ValueError(f"{name} must be an integer in [0, {size}); got {value!r}")
    return int(value)

def indices(name: str, value: Any, size: int) -> np.ndarray:
    """A 1-D array of integer indices in [0, size), as intp (not copied if it already is)."""
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise TypeError(f"{name} must be a 1-D array of integer indices; got {arr.dtype} of shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() >= size):
        raise IndexError(f"{name} must lie in [0, {size}); got values in [{arr.min()}, {arr.max()}]")
    return arr.astype(np.intp, copy=False)

def token_ids(name: str, value: Any, vocab_size: int) -> np.ndarray:
    """Token ids (T,) or (B, T), T >= 1, each in [0, vocab_size), as given (not copied).

    TypeError for a non-integer dtype; ValueError for a wrong shape or an id out of range
    (the message shows the first such id).
    """
    ids = np.asarray(value)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array; got dtype {ids.dtype}")
    if ids.ndim not in (1, 2) or ids.shape[-1] < 1:
        raise ValueError(f"{name} must have shape (T,) or (B, T) with T >= 1; got {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)].flat[0]
        raise ValueError(f"{name} must lie in [0, vocab_size = {vocab_size}); got {bad}")
    return ids

def index_of(name: str, value: Any, size: int, what: str, *, negative: bool = False) -> int:
    """:func:`index` with what it indexes in the message; ``negative``: [-size, 0) counts from the end.

    ValueError ``"<name> must be an integer in [0, size) (<what>[; negative counts from
    the end]); got <value>"``. Returns the index in [0, size).
    """
    low = -size if negative else 0
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value < size:
        more = "; negative counts from the end" if negative else ""
        raise ValueError(f"{name} must be an integer in [0, {size}) ({what}{more}); got {value!r}")
    return int(value) % size

def int_seed(value: Any, name: str = "seed") -> int:
    """A random seed that must be given: a non-negative integer (:func:`seed` also takes None)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer; got {value!r}")
    return int(value)

def nonnegative(name: str, value: Any) -> float:
    """A finite real number >= 0 (bool excluded), e.g. a standard deviation."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (np.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0; got {value!r}")
    return float(value)
