"""``pyengine bench``: every kernel x backend as a fraction of the machine's limits
measured in the same run; ``--compare`` checks for regressions (:mod:`pyengine.bench`)."""

from __future__ import annotations

import argparse

from .. import bench
from ._args import fraction

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    b = subparsers.add_parser("bench", help="every kernel x backend as a fraction of the machine's limits")
    b.add_argument("--quick", action="store_true", help="small sizes, few repeats (under a minute)")
    b.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    b.add_argument("--compare", metavar="BASELINE", help="a --json report: exit 1 on a regression against it")
    b.add_argument("--threshold", type=fraction, default=bench.THRESHOLD,
                   help=f"allowed relative drop beyond noise, in [0, 1) (default {bench.THRESHOLD})")
    b.add_argument("--dtype", choices=["float32", "float64", "both"], default="float32",
                   help="dtype(s) benchmarked (default float32)")
    return b


def run(args: argparse.Namespace) -> int:
    dtypes = ("float32", "float64") if args.dtype == "both" else (args.dtype,)
    return bench.main(args.quick, args.json, args.compare, args.threshold, dtypes)
