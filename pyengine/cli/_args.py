"""argparse types shared by the subcommands: each rejects a bad value with one line.

Numbers are finite (``nan`` and ``inf`` are refused: they pass no comparison, so a
range check alone would let NaN through); the ranges are those of the library's own
checks in :mod:`pyengine._validate`, so a bad value stops here, before any work.
"""

from __future__ import annotations

import argparse
import os
import math

__all__ = ["add_format_option", "count_or_npy", "fraction", "floats", "non_negative", "non_negative_float",
           "positions", "positive", "positive_float", "positive_floats", "width", "writable_folder"]


def _int(text: str, what: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}; got {text}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {what}; got {text}")
    return value


def _float(text: str, what: str, ok) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}; got {text}") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"must be {what}; got {text}")
    return value


def positive(text: str) -> int:
    """A positive integer."""
    return _int(text, "a positive integer", 1)


def width(text: str) -> int:
    """An integer >= 2 (a width d: a normalization needs two features)."""
    return _int(text, "an integer >= 2 (a width)", 2)


def non_negative(text: str) -> int:
    """An integer >= 0 (a seed)."""
    return _int(text, "a non-negative integer", 0)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _float(text, "a positive finite number", lambda v: v > 0)


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (an eps)."""
    return _float(text, "a finite number >= 0", lambda v: v >= 0)


def fraction(text: str) -> float:
    """A finite number in [0, 1) (a relative threshold)."""
    return _float(text, "a number in [0, 1)", lambda v: 0 <= v < 1)


def floats(text: str) -> list[float]:
    """Comma-separated finite numbers, at least one."""
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers; got {text}") from None
    if not vals:
        raise argparse.ArgumentTypeError("needs at least one number")
    if not all(math.isfinite(v) for v in vals):
        raise argparse.ArgumentTypeError(f"must be finite numbers; got {text}")
    return vals


def positive_floats(text: str) -> list[float]:
    """Comma-separated finite numbers > 0, at least one (injection scales)."""
    vals = floats(text)
    if any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"must be positive numbers; got {text}")
    return vals


def positions(text: str):
    """"all", "last", "a:b" (a slice) or "i,j,k"."""
    if text in ("all", "last"):
        return text
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            return slice(int(a) if a else None, int(b) if b else None)
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be all, last, a:b or i,j,k; got {text}") from None


def count_or_npy(text: str):
    """A positive integer (a count of random directions), or a ``.npy`` file of directions
    (d,) or (K, d), float; read here, so a bad file stops before any work."""
    try:
        return positive(text)
    except argparse.ArgumentTypeError:
        if not text.endswith(".npy"):
            raise argparse.ArgumentTypeError(f"must be a positive integer or a .npy file of directions; got {text}") \
                from None
    import numpy as np

    try:
        arr = np.load(text, allow_pickle=False)
    except FileNotFoundError:
        raise argparse.ArgumentTypeError(f"file not found: {text}") from None
    except (OSError, ValueError, EOFError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text} as .npy: {exc}") from None
    if arr.dtype.kind not in "fiu" or arr.ndim not in (1, 2) or arr.size == 0:
        raise argparse.ArgumentTypeError(f"{text} must hold real directions of shape (d,) or (K, d); "
                                         f"got {arr.dtype} {arr.shape}")
    return arr


def add_format_option(parser: argparse.ArgumentParser) -> None:
    """``--format png|pdf|svg`` (default png): the file format of the command's figures."""
    from .._figures import FORMATS

    parser.add_argument("--format", choices=FORMATS, default="png",
                        help="file format of the figures: png (200 dpi), or pdf or svg (vector) (default png)")


def writable_folder(path: str, option: str = "--out") -> None:
    """Create ``path`` if needed and check that a file can be written there, before any work:
    an OSError naming ``option`` and the reason otherwise."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".pyengine-write-check-"):
            pass
    except OSError as exc:
        raise OSError(f"{option} {path}: cannot write there ({exc.strerror or exc})") from None
