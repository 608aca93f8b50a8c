"""``pyengine bench``: every kernel x backend as a fraction of the machine's limits measured
next to it; ``--compare`` checks against a stored report, ``--compare-rev`` times another
revision's build against this one in the same run (:mod:`pyengine.bench`)."""

from __future__ import annotations

import argparse
import os

from .. import bench
from ._args import fraction
from ._provenance import ARGV

__all__ = ["add_parser", "run"]


def _names(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"must be comma-separated names; got {text!r}")
    return names


def _backends(text: str) -> tuple[str, ...]:
    from ..backends import BACKENDS

    names = _names(text)
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise argparse.ArgumentTypeError(f"must be comma-separated backends out of {', '.join(BACKENDS)}; "
                                         f"got {unknown[0]!r}")
    return names


def _rounds(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 3:
        raise argparse.ArgumentTypeError(f"must be an integer >= 3; got {text}")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    b = subparsers.add_parser("bench", help="every kernel x backend as a fraction of the machine's limits")
    b.add_argument("--quick", action="store_true", help="small sizes, fewer rounds")
    b.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    which = b.add_mutually_exclusive_group()
    which.add_argument("--compare", metavar="BASELINE", help="a --json report: exit 1 on a regression against it")
    which.add_argument("--compare-rev", metavar="REV",
                       help="build git revision REV into its own virtualenv and time it against this build, "
                            "interleaved in one run: exit 1 on a regression")
    which.add_argument("--compare-python", metavar="PYTHON",
                       help="like --compare-rev, with an interpreter that already has the other build installed")
    b.add_argument("--threshold", type=fraction, default=None,
                   help=f"relative speed drop that counts, in [0, 1) (default {bench.THRESHOLD} with --compare, "
                        f"{bench.AB_THRESHOLD} with --compare-rev)")
    b.add_argument("--kernels", type=_names, metavar="K1,K2", help="only these benchmark cases")
    b.add_argument("--backends", type=_backends, metavar="B1,B2", help="only these backends (NumPy is still timed)")
    b.add_argument("--rounds", type=_rounds, help="A/B rounds per row (default 8 quick, 12 standard)")
    b.add_argument("--repo", default=".", help="git checkout --compare-rev reads REV from (default: .)")
    b.add_argument("--ab-cache", default=os.environ.get("PYENGINE_BENCH_AB_CACHE"),
                   help="where built revisions are kept (default ~/.cache/pyengine-bench-ab)")
    b.add_argument("--dtype", choices=["float32", "float64", "both"], default="float32",
                   help="dtype(s) benchmarked (default float32)")
    return b


def run(args: argparse.Namespace) -> int:
    dtypes = ("float32", "float64") if args.dtype == "both" else (args.dtype,)
    if args.compare_rev is not None or args.compare_python is not None:
        threshold = bench.AB_THRESHOLD if args.threshold is None else args.threshold
        return bench.ab_main(args.compare_rev, args.compare_python, args.quick, args.json, threshold, dtypes,
                             kernels=args.kernels, backends=args.backends, root=args.repo, cache=args.ab_cache,
                             rounds=args.rounds, argv=getattr(args, ARGV, None))
    threshold = bench.THRESHOLD if args.threshold is None else args.threshold
    return bench.main(args.quick, args.json, args.compare, threshold, dtypes, kernels=args.kernels,
                      backends=args.backends, argv=getattr(args, ARGV, None))
