"""pyengine positions: positional signal by layer and pre- against post-LN placement
(decomposition with and without the first positions and per-token normalized, probe,
propagation, position-only run, attention against the query-key offset, norm growth,
cosine against block removal); prints the protocol, the tables, a warning where one
position dominates, and the findings; writes JSON, CSV and the figures."""

from __future__ import annotations

import argparse

from .._progress import Progress
from ._args import add_format_option, non_negative, positive
from ._provenance import block, model_fields
from ._stages import Stages

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("positions", help="positional signal by layer; pre- vs post-LN; cosine vs block removal",
                       description=__doc__)
    p.add_argument("--model", action="append", default=None,
                   help="a load_pretrained name or path (repeatable); default the synthetic pre/post pair")
    p.add_argument("--corpus", default=None, help="a text file, one sentence per line (default the built-in corpus)")
    p.add_argument("--layers", default=None, help="hidden-state indices for the positional analyses, e.g. 0,2,4 "
                   "(default all)")
    p.add_argument("--length", type=positive, default=12, help="tokens per context (shorter sentences are dropped)")
    p.add_argument("--contexts", type=positive, default=256, help="at most this many contexts")
    p.add_argument("--ablation-contexts", type=positive, default=32, help="contexts used for the block removals")
    p.add_argument("--folds", type=positive, default=3, help="cross-validation folds of the position probe")
    p.add_argument("--exclude-first", type=non_negative, default=None, metavar="N",
                   help="leave positions 0..N-1 out of the 'without first' decomposition (0: no such variant; "
                   "default: one past the last position holding more than half of |h - mu|^2 at some layer, "
                   "1 if none does)")
    p.add_argument("--out", default="positions-out", help="folder for positions.json, positions.csv and the figures")
    add_format_option(p)
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the synthetic pair's weights, of random ids for models without a tokenizer, and of the probe's folds (default 0)")


def _layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--layers must be comma-separated integers; got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from ..experiments.positions import format_positions, positions_report, write_positions

    layers = _layers(args.layers)
    if args.exclude_first is not None and args.exclude_first > args.length - 2:
        raise ValueError(f"--exclude-first must leave at least 2 of the --length {args.length} positions; "
                         f"got {args.exclude_first}")
    models = None
    if args.model:
        from ..models import load_pretrained

        models = [(m, load_pretrained(m)) for m in args.model]
    if models:
        fields = [model_fields(m, name) for name, m in models]
        archs = [f.get("architecture") for f in fields]
        prov = block(args, seeds=[args.seed], model=", ".join(f["model"] for f in fields),
                     architecture=", ".join(a or "none" for a in archs) if any(archs) else None,
                     weight_files=[p for f in fields for p in f["weight_files"]], inputs=(args.corpus,))
    else:
        prov = block(args, seeds=[args.seed], inputs=(args.corpus,),
                     model=f"synthetic: pre-LN / post-LN pair, seed {args.seed}")
    bar = Progress("auto")
    stages = Stages(args.out, prov)  # each model's measurements on disk as soon as they are done
    with stages.keep():
        rep = positions_report(models, corpus=args.corpus, length=args.length, max_contexts=args.contexts,
                               layers=layers, folds=args.folds, ablation_contexts=args.ablation_contexts,
                               seed=args.seed, exclude_first=args.exclude_first, progress=bar.stage,
                               on_stage=stages)
    bar.stage(1.0, "done")
    print(format_positions(rep))
    for path in write_positions(rep, args.out, fmt=args.format, provenance=prov):
        print(f"wrote {path}")
    return 0
