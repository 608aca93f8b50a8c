"""``pyengine backends``: which backends load, and why not."""

from __future__ import annotations

import argparse

from .. import backends
from ..kernels.linear import blas_info

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    return subparsers.add_parser("backends", help="which backends load, and why not")


def run(args: argparse.Namespace) -> int:
    for info in backends.available_backends().values():
        print(f"{info.name:<6} {'available' if info.available else 'unavailable: ' + info.reason}")
    print(f"linear kernels' products (cpp): {blas_info()}")  # which BLAS path is active
    return 0
