"""argparse types shared by the subcommands: each rejects a bad value with one line."""

from __future__ import annotations

import argparse

__all__ = ["floats", "positions", "positive", "positive_float"]


def positive(text: str) -> int:
    """A positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text}")
    return value


def positive_float(text: str) -> float:
    """A positive number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number; got {text}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive; got {text}")
    return value


def floats(text: str) -> list[float]:
    """Comma-separated numbers, at least one."""
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers; got {text}") from None
    if not vals:
        raise argparse.ArgumentTypeError("needs at least one number")
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
