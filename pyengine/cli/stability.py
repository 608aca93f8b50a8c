"""``pyengine stability``: forward/backward signal propagation by initialization scheme (with and
without LayerNorm and residual), the spectral condition of a real model, GD vs sign vs
spectral descent, and the training-time stability (sigma_max of the weight over steps) of
plain, normalized, clipped and weight-decayed gradient descent; prints the tables and the
finding and writes the figures."""

from __future__ import annotations

import argparse

from .._progress import Progress
from ._args import add_format_option, positive, width
from ._provenance import block, model_fields
from ._stages import Stages

__all__ = ["add_parser", "run"]

#: The real model of the spectral-condition table by default (small: 6 layers, d = 384).
DEFAULT_MODEL = "all-MiniLM-L6-v2"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stability", help="signal propagation by init scheme, spectral condition, steepest descent",
                       description=__doc__.replace("``", ""))
    p.add_argument("--schemes", default="kaiming_normal,xavier_normal,torch_default,orthogonal",
                   help="comma-separated initialization schemes")
    p.add_argument("--depth", type=positive, default=48, help="layers of the signal-propagation stacks (default 48)")
    p.add_argument("--width", type=width, default=768, help="width of the stacks (default 768)")
    p.add_argument("--tokens", type=positive, default=128, help="tokens of the input batch (default 128)")
    p.add_argument("--activation", default="relu", choices=("relu", "gelu", "tanh", "linear"),
                   help="activation of the MLP stacks (default relu)")
    p.add_argument("--stack-depth", type=positive, default=12,
                   help="blocks of the transformer stacks (attention + MLP; default 12)")
    p.add_argument("--stack-width", type=positive, default=256, help="d_model of the transformer stacks (default 256)")
    p.add_argument("--no-stacks", action="store_true", help="skip the transformer stacks")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a load_pretrained name or path for the spectral-condition table (default {DEFAULT_MODEL}, "
                        "skipped with a note if its package is not installed; 'none' skips it)")
    p.add_argument("--no-demo", action="store_true", help="skip the steepest-descent and training-time comparison")
    p.add_argument("--out", default="stability-out", help="folder for the figures and stability.json")
    add_format_option(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs (default 0)")


def run(args: argparse.Namespace) -> int:
    from ..experiments.stability import STACK_PLACEMENTS, format_stability, stability, write_stability

    schemes = tuple(s.strip() for s in args.schemes.split(",") if s.strip())
    from ..models.initialization import ALIASES, SCHEMES

    if not schemes:
        raise ValueError(f"--schemes needs at least one scheme of {', '.join(SCHEMES)}; got {args.schemes!r}")
    for s in schemes:  # before any work, the default model's loading included
        if s.lower() not in SCHEMES and s.lower() not in ALIASES:
            raise ValueError(f"--schemes: unknown scheme {s!r}; expected one of {', '.join(SCHEMES)}")
    model = None if args.model.lower() == "none" else args.model
    if model is not None:  # loaded here, before any work: its weight files' hashes go into the provenance
        from ..models.pretrained import load_pretrained

        try:
            model = load_pretrained(model)
            model.name = args.model  # the report names it as given
        except (FileNotFoundError, ImportError) as e:
            if args.model != DEFAULT_MODEL:  # the default only may be missing: a model asked for must load
                raise
            print(f"spectral condition of a real model: skipped ({e})")
            model = None
    synthetic = f"synthetic: {args.activation} MLP and transformer stacks, seed {args.seed}"
    fields = model_fields(model, synthetic=synthetic)
    if model is not None:
        fields["model"] = f"{fields['model']}; {synthetic}"
    prov = block(args, seeds=[args.seed], **fields)
    bar = Progress("auto")
    stages = Stages(args.out, prov)  # each finished part on disk at once
    with stages.keep():
        rep = stability(schemes, args.depth, args.width, args.tokens, activation=args.activation, model=model,
                        demo=not args.no_demo, seed=args.seed, progress=bar.step,
                        stack_depth=args.stack_depth, stack_width=args.stack_width,
                        placements=() if args.no_stacks else STACK_PLACEMENTS, on_stage=stages)
    bar.step(1, 1, "done")
    print(format_stability(rep))
    for path in write_stability(rep, args.out, fmt=args.format, provenance=prov):
        print(f"wrote {path}")
    return 0
