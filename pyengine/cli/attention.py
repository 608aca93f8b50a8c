"""``pyengine attention``: attention gradient dynamics on a sticky Markov chain (EM-style vs GD).

One module per subcommand: :func:`add_parser` adds the subcommand to the ``pyengine``
parser and :func:`run` executes it (exit status 0; 2 on bad arguments; 130 on Ctrl-C,
after writing what had finished: every finished (seed, arm) run is in ``OUT/runs`` as it ends,
and ``--resume`` continues from them).
"""

from __future__ import annotations

import argparse
import sys
import time

from ._args import add_format_option, positive, positive_float, writable_folder
from ._provenance import block
from ._stages import hold

__all__ = ["add_parser", "run"]


class _Bar:
    """``progress(fraction, label)``: a bar on a terminal, else a line per tenth (logs stay short)."""

    def __init__(self, mode: str) -> None:
        self.tty = sys.stderr.isatty() if mode == "auto" else mode == "always"
        self.quiet = mode == "never"
        self.t0, self.last = time.perf_counter(), -1

    def __call__(self, frac: float, label: str) -> None:
        if self.quiet:
            return
        el = time.perf_counter() - self.t0
        eta = el / frac - el if frac > 0 else float("nan")
        if self.tty:
            bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
            end = "\n" if label == "done" else ""
            print(f"\r\033[K[{bar}] {100 * frac:5.1f}%  {el:6.1f} s  eta {eta:5.0f} s  {label}", end=end,
                  file=sys.stderr, flush=True)
        elif int(10 * frac) != self.last:
            self.last = int(10 * frac)
            print(f"[{100 * frac:5.1f}%] {el:6.1f} s  {label}", file=sys.stderr, flush=True)


#: The store of finished (seed, arm) runs inside the output folder, and its job name.
RUNS, RUNS_JOB = "runs", "attention-runs"


class _Runs:
    """The finished (seed, arm) runs of one configuration in ``<out>/runs``: a checksummed
    :class:`~pyengine.distributed.Store` with one point per (seed, arm), each written as the run
    ends (atomically), so Ctrl-C keeps every finished run and ``--resume`` continues from them.
    Without ``--resume`` a store of this command is started afresh, as the report files are."""

    def __init__(self, out: str, cfg: dict, seeds: list[int], arms: list[str], resume: bool, prov: dict) -> None:
        import os
        import shutil

        from ..distributed import Store

        self.path = os.path.join(out, RUNS)
        self.store = Store(self.path)
        self.points = [{"seed": s, "arm": a} for s in seeds for a in arms]
        self.index = {(p["seed"], p["arm"]): i for i, p in enumerate(self.points)}
        if not resume and self.store.exists() and self.store.manifest().get("job") == RUNS_JOB:
            shutil.rmtree(self.path)
        self.store.create(RUNS_JOB, cfg, self.points, resume=resume, provenance=prov)
        for i in self.store.damaged(len(self.points)):
            print(f"recomputed: {self.store.set_aside(i)} did not read back whole")

    def load(self) -> dict:
        from ..experiments.attention_dynamics import run_from_arrays

        done = self.store.done(len(self.points))
        return {(p["seed"], p["arm"]): run_from_arrays(self.store.read(i)) for i, p in enumerate(self.points)
                if i in done}

    def write(self, seed: int, arm: str, run: dict) -> None:
        from ..experiments.attention_dynamics import run_to_arrays

        self.store.write(self.index[(seed, arm)], run_to_arrays(run))
        hold()  # the test hook: after the first finished run

    def kept(self) -> str:
        n = len(self.store.done(len(self.points)))
        return (f"the {n} finished run(s) are in {self.path} (continue with --resume)" if n
                else "no run had finished")


def _ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers; got {text}") from None
    if not vals:
        raise argparse.ArgumentTypeError("needs at least one seed")
    if min(vals) < 0:
        raise argparse.ArgumentTypeError(f"seeds must be non-negative integers; got {text}")
    return vals


def _arms(text: str) -> list[str]:
    from ..experiments.attention_dynamics import ARMS

    vals = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in vals if v not in ARMS]
    if bad or "gd" not in vals:
        raise argparse.ArgumentTypeError(f"must be a comma-separated subset of {','.join(ARMS)} including gd; "
                                         f"got {text}")
    return vals



def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0; got {text}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0; got {text}")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``attention`` to the ``pyengine`` subcommands."""
    a = subparsers.add_parser(
        "attention", help="attention gradient dynamics on a sticky Markov chain: EM-style value updates vs GD",
        description="Train a single causal attention head full-batch on a sticky Markov chain (8 symbols) with "
                    "three arms: gd (lr on all weights), value_lr (10x lr on W_V) and m_step (a damped, ridge-"
                    "penalized Newton M-step on W_V with routing fixed), over several seeds; evaluate every arm on "
                    "held-out sequences of the same chain; print the table and the verdict, write JSON, CSV and "
                    "plots.")
    a.add_argument("--preset", choices=["default", "toy"], default="default",
                   help="default: 1000 steps, held-out losses at steps 0-10 and every 20th; toy: the short run, "
                        "100 steps, held-out losses at every step (--steps and --eval-every override either)")
    a.add_argument("--steps", type=positive, default=None, help="training steps per run (default: the preset's)")
    a.add_argument("--eval-every", type=positive, default=None,
                   help="held-out evaluation every this many steps, and at steps 0-10 (default: the preset's)")
    a.add_argument("--n-heldout", type=positive, default=4,
                   help="held-out sequences per seed, seeds seed + 10000 + i (default 4)")
    a.add_argument("--seeds", type=_ints, default=[42, 2024, 1337, 7777, 9999],
                   help="comma-separated seeds (default 42,2024,1337,7777,9999)")
    a.add_argument("--arms", type=_arms, default=["gd", "value_lr", "m_step"],
                   help="comma-separated arms, gd included (default gd,value_lr,m_step)")
    a.add_argument("--T", type=positive, default=2000, help="sequence length (default 2000)")
    a.add_argument("--stay", type=float, default=0.3, help="the chain's stay weight (default 0.3)")
    a.add_argument("--lr", type=positive_float, default=0.01, help="learning rate of gd (default 0.01)")
    a.add_argument("--value-lr-factor", type=positive_float, default=10.0,
                   help="value_lr arm: factor on W_V's learning rate (default 10)")
    a.add_argument("--newton-damping", type=positive_float, default=1e-3,
                   help="m_step arm: damping relative to the Hessian's mean eigenvalue (default 1e-3)")
    a.add_argument("--m-step-ridge", type=_nonnegative_float, default=None,
                   help="m_step arm: ridge penalty r / 2 |W_V|^2 in the M-step (default: the one chosen on the "
                        "validation sequences, see the experiment's docstring)")
    a.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="dtype of the data, weights and attention kernels (default float32: about twice as "
                        "fast as float64; the final losses agree to ~1e-7)")
    a.add_argument("--backend", choices=["auto", "cpp", "numba", "numpy"], default="auto",
                   help="kernel backend of the attention head (default auto)")
    a.add_argument("--workers", type=positive, default=2,
                   help="worker processes for the seeds, each single-threaded (default 2; 1: serial in this "
                        "process); the results are identical")
    a.add_argument("--out", default="attention-out", help="output folder (default ./attention-out); each "
                   "finished (seed, arm) run is written to OUT/runs as it ends")
    a.add_argument("--resume", action="store_true",
                   help="continue the run stored in OUT/runs (same options): only the missing runs are computed")
    a.add_argument("--no-plots", action="store_true", help="skip the figures")
    add_format_option(a)
    a.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                   help="bar on a terminal, a line per tenth otherwise (auto), or force either")
    a.set_defaults(run=run)
    return a


def run(args: argparse.Namespace) -> int:
    """Run the experiment with the parsed arguments; print the table and write the outputs."""
    from ..experiments import attention_dynamics, format_attention_table, write_attention_report
    from ..experiments.attention_dynamics import M_STEP_RIDGE, PRESETS

    preset = PRESETS[args.preset]
    steps = args.steps if args.steps is not None else preset["steps"]
    every = args.eval_every if args.eval_every is not None else preset["eval_every"]
    ridge = args.m_step_ridge if args.m_step_ridge is not None else M_STEP_RIDGE
    try:
        writable_folder(args.out)  # before the training, not after it
        cfg = {"steps": steps, "T": args.T, "stay": args.stay, "lr": args.lr, "value_lr_factor": args.value_lr_factor,
               "newton_damping": args.newton_damping, "m_step_ridge": ridge, "n_heldout": args.n_heldout,
               "eval_every": every, "dtype": args.dtype, "backend": args.backend}
        prov = block(args, seeds=list(args.seeds), dtype=args.dtype, backend=args.backend,
                     model="synthetic: one causal attention head on a sticky Markov chain")
        runs = _Runs(args.out, cfg, list(args.seeds), list(args.arms), args.resume, prov)
        before = runs.load()
        print(f"pyengine attention ({args.preset}): {len(args.seeds)} seed(s) x {len(args.arms)} arm(s) x {steps} "
              f"steps, T = {args.T}, {args.dtype}, {args.workers} worker(s); output folder {args.out}"
              + (f"; {len(before)} run(s) stored before" if args.resume else ""), flush=True)
        try:
            rep = attention_dynamics(seeds=args.seeds, arms=args.arms, n_heldout=args.n_heldout, eval_every=every,
                                     progress=_Bar(args.progress), workers=args.workers, on_run=runs.write,
                                     done_runs=before, **{k: cfg[k] for k in ("steps", "T", "stay", "lr",
                                     "value_lr_factor", "newton_damping", "m_step_ridge", "dtype", "backend")})
        except KeyboardInterrupt:
            raise KeyboardInterrupt(f"no seed had every arm finished; {runs.kept()}") from None
        print(format_attention_table(rep))
        paths = write_attention_report(rep, args.out, plots=not args.no_plots, fmt=args.format, provenance=prov)
        print(f"time: {rep.seconds['total']:.1f} s ({rep.seconds['per_step_ms']:.2f} ms per step); "
              f"wrote {', '.join(paths)}")
        if rep.interrupted:
            raise KeyboardInterrupt(f"wrote the report of the seeds whose every arm finished; "
                                    f"{rep.missing_runs()}; {runs.kept()}")
        return 0
    except (ValueError, TypeError, OSError, MemoryError, ImportError, FloatingPointError) as exc:
        print(f"pyengine: error: {exc}", file=sys.stderr)
        return 2
