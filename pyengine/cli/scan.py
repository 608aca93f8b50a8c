"""``pyengine scan``: a sweep on Dask (a 127.0.0.1 ``LocalCluster`` of ``--workers``, or an
existing cluster by ``--scheduler``) into a resumable store, with a progress bar fed by
task completions, a summary table and, for spectral scans, a plot of sigma_max per layer.

``pyengine scan spectral --model NAME --corpus FILE --workers 2``,
``pyengine scan recovery --prompts FILE ...``, ``pyengine scan attention ...``,
``pyengine scan stability ...``, ``pyengine scan norms ...`` (the synthetic benchmark job).
``--workers 0`` runs in this process. Every job is defined and registered in
:mod:`pyengine.distributed` (the sweep layer, above the experiments it sweeps).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

from .._figures import COLUMN, log_axis, save, styled, subplots
from .._progress import Progress
from ..distributed import Store, load, local_client, scan
from ..distributed.cluster import close_client
from ._args import add_format_option, floats, non_negative, positive, positive_float, positive_floats, width
from ._provenance import block, named_model_fields
from ._stages import hold

__all__ = ["add_parser", "run"]


# --------------------------------------------------------------------------- summaries

def _spectral_summary(res: Any, out: str | None, fmt: str = "png") -> None:
    sigma, sites = res.metrics["sigma"], res.params["sites"]
    print(f"sigma_max per norm layer over {sigma.shape[1]} tokens:")
    print(f"  {'layer':<18} {'min':>9} {'median':>9} {'p99':>9} {'max':>9} {'<1':>7}")
    for name, row in zip(sites, sigma):
        row = row[np.isfinite(row)]
        if row.size:
            q = np.percentile(row, [0, 50, 99, 100])
            print(f"  {name:<18} {q[0]:9.4g} {q[1]:9.4g} {q[2]:9.4g} {q[3]:9.4g} {100 * (row < 1).mean():6.1f}%")
    if out is not None:
        print(f"wrote {_sigma_figure(sigma, sites, res.params['model'], out, fmt)}")


@styled
def _sigma_figure(sigma: np.ndarray, sites: list[str], model: str, out: str, fmt: str) -> str:
    """Box plots of sigma_max per norm site (quartiles, median, whiskers at 5 and 95 %); the path written."""
    fig, ax = subplots(size=(max(COLUMN, 0.6 + 0.32 * len(sites)), 2.8))
    data = [r[np.isfinite(r)] for r in sigma]
    ax.boxplot([d if d.size else [np.nan] for d in data], whis=(5, 95), showfliers=False, widths=0.6,
               medianprops={"color": "C1"})
    ax.set_xticks(range(1, len(sites) + 1), [s.replace("blocks.", "") for s in sites], rotation=60, ha="right",
                  rotation_mode="anchor")
    log_axis(ax)
    ax.set_xlabel("norm site (block.norm)")
    ax.set_ylabel(r"$\sigma_{\max}$ of the norm Jacobian")
    ax.set_title(f"{model}: {sigma.shape[1]} tokens\nbox: quartiles and median; whiskers: 5-95 %")
    return save(fig, os.path.join(out, "sigma_max"), fmt)


def _summary(res: Any, out: str | None, fmt: str = "png") -> None:
    m, p = res.metrics, res.params
    if not m:
        return
    if res.job == "spectral":
        _spectral_summary(res, out, fmt)
    elif res.job == "recovery":
        proj = m["projection"]  # (prompts, layers, n_layers + 1, K, S)
        print("projection at the last hidden state / scale (mean over prompts and directions):")
        print(f"  {'layer':>5} " + " ".join(f"{s:>10g}" for s in p["scales"]))
        for i, layer in enumerate(p["layers"]):
            gain = np.nanmean(proj[:, i, -1], axis=(0, 1)) / np.asarray(p["scales"])
            print(f"  {layer:>5} " + " ".join(f"{g:10.4g}" for g in gain))
    elif res.job == "attention":
        print("final loss (mean over seeds) per learning rate:")
        arms = sorted({k.split(".")[0] for k in m})
        print(f"  {'lr':>8} " + " ".join(f"{a:>10}" for a in arms))
        for i, lr in enumerate(p["lrs"]):
            print(f"  {lr:>8g} " + " ".join(f"{np.nanmean(m[a + '.loss'][:, i, -1]):10.4g}" for a in arms))
    elif res.job == "stability":
        print("forward RMS at the last layer (per setting):")
        for i, s in enumerate(p["schemes"]):
            print(f"  {s:<16} " + " ".join(f"{v:10.4g}" for v in m["forward_rms"][i, :, -1]))
    else:
        for k, v in m.items():
            print(f"  {k}: shape {v.shape}, mean {np.nanmean(v):.6g}")


# --------------------------------------------------------------------------- the command

def _lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as fh:
            out = [ln.strip() for ln in fh if ln.strip()]
    except FileNotFoundError:
        raise OSError(f"prompts file not found: {path}") from None
    if not out:
        raise ValueError(f"prompts file {path} has no non-empty lines")
    return out


def _ints(text: str) -> list[int]:
    return [non_negative(t) for t in text.split(",") if t.strip()]


def _grid(args: argparse.Namespace) -> dict[str, Any]:
    if args.job == "spectral":
        sites = None if args.sites is None else [p.strip() for p in args.sites.split(",") if p.strip()]
        return {"model": args.model, "corpus": args.corpus, "tokens": args.tokens, "seq_len": args.seq_len,
                "method": args.method, "seed": args.seed, "sites": sites}
    if args.job == "recovery":
        prompts = _lines(args.prompts) if args.prompts else ["The quick brown fox jumps over the lazy dog."]
        return {"model": args.model, "prompts": prompts, "layers": args.layers, "directions": args.directions,
                "scales": args.scales, "linearized": args.linearized, "seed": args.seed}
    if args.job == "attention":
        return {"seeds": args.seeds, "lrs": args.lrs, "steps": args.steps, "T": args.T}
    if args.job == "stability":
        schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
        if not schemes:
            raise ValueError(f"--schemes needs at least one initialization scheme; got {args.schemes!r}")
        return {"schemes": schemes, "depth": args.depth, "width": args.width, "seed": args.seed}
    return {"seeds": list(range(args.points)), "tokens": args.tokens, "d": args.d}


def _provenance(args: argparse.Namespace, grid: dict[str, Any]) -> dict[str, Any]:
    """The manifest's provenance block: the seeds and the model of the grid."""
    from ..distributed.worker import SYNTHETIC

    seeds = grid.get("seeds", [grid["seed"]] if "seed" in grid else None)
    if "model" in grid:
        fields = named_model_fields(grid["model"], SYNTHETIC)
    else:
        what = {"attention": "one causal attention head on a sticky Markov chain",
                "stability": "MLP stacks by initialization scheme", "norms": "random normalization inputs"}
        fields = {"model": f"synthetic: {what[args.job]}"}
    return block(args, seeds=seeds, inputs=(getattr(args, "corpus", None), getattr(args, "prompts", None)), **fields)


def _note_repeats(args: argparse.Namespace) -> None:
    """Say on stderr when --tokens is more than the corpus has: the job repeats the text."""
    from ..distributed.model_jobs import corpus_size

    n = corpus_size(args.model, args.corpus)
    if 0 < n < args.tokens:
        print(f"pyengine scan spectral: note: the corpus has {n} tokens for {args.model}; --tokens {args.tokens} "
              f"repeats it {args.tokens / n:.1f} times (give a longer --corpus, or fewer --tokens)", file=sys.stderr)


def _kept(out: str) -> str:
    """What an interrupted scan kept: the point files in the store ``out``."""
    n = len(Store(out).done(sys.maxsize)) if os.path.isdir(out) else 0
    return (f"the {n} finished point(s) are in the store {out} (continue with --resume)" if n
            else "no point had finished")


def run(args: argparse.Namespace) -> int:
    out = args.out or f"scan-{args.job}"
    grid = _grid(args)
    if args.workers < 0:
        raise ValueError(f"--workers must be >= 0; got {args.workers}")
    if args.job == "spectral":
        _note_repeats(args)
    prov = _provenance(args, grid)
    bar = Progress(args.progress, label=f"scan {args.job}", unit="points")
    client, interrupted = None, False
    try:
        if args.scheduler or args.workers:
            client = local_client(args.workers or 1, scheduler=args.scheduler)
        where = args.scheduler or (f"LocalCluster of {args.workers} workers on 127.0.0.1" if client else "in-process")
        print(f"pyengine scan {args.job}: {where}, out {out}")

        def progress(n: int, total: int) -> None:  # a point is in the store before it is counted
            bar.count(n, total)
            if n:
                hold()

        res = scan(args.job, grid, client=client, out=out, chunk=args.chunk, resume=args.resume,
                   memory_budget=int(args.memory_budget * 2**20), progress=progress, provenance=prov)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if client is not None:
            interrupted = close_client(client) or interrupted
    if interrupted:  # also a Ctrl-C while the cluster closed after the last point
        raise KeyboardInterrupt(_kept(out))
    for msg in res.damaged.values():
        print(f"recomputed: {msg}")
    print(f"{len(res.points)} points ({res.computed} computed now, {len(res.points) - res.computed} stored before) "
          f"in {res.tasks} tasks, {res.seconds:.2f} s")
    _summary(load(out), out, getattr(args, "format", "png"))
    for e in res.errors[:10]:
        print(f"failed point {e['index']} {e['point']}: {e['error']}")
    if res.errors:
        print(f"{len(res.errors)} point(s) failed (listed in {os.path.join(out, 'errors.json')})")
        return 1
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    s = subparsers.add_parser("scan", help="a sweep on Dask (local cluster or --scheduler), resumable")
    jobs = s.add_subparsers(dest="job", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--workers", type=int, default=2, help="LocalCluster worker processes on 127.0.0.1 "
                        "(default 2; 0: in this process)")
    common.add_argument("--scheduler", metavar="tcp://HOST:PORT", help="an existing Dask cluster instead "
                        "(--out must then be on a file system its workers share)")
    common.add_argument("--out", metavar="DIR", help="store folder (default scan-<job>)")
    common.add_argument("--resume", action="store_true", help="continue the sweep stored in --out")
    common.add_argument("--chunk", type=positive, default=None, help="grid points per task (default: automatic)")
    common.add_argument("--memory-budget", type=positive_float, default=256.0, metavar="MIB",
                        help="MiB one task may hold at a time (default 256)")
    common.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                        help="progress bar: auto (on a terminal), always or never")
    sp = jobs.add_parser("spectral", parents=[common], help="sigma_max of every norm layer over a corpus")
    sp.add_argument("--model", default="all-MiniLM-L6-v2", help="load_pretrained name or path (default MiniLM)")
    sp.add_argument("--corpus", metavar="FILE", help="UTF-8 text (default: the built-in corpus)")
    sp.add_argument("--tokens", type=positive, default=100_000, help="corpus tokens scanned (default 100000)")
    sp.add_argument("--seq-len", type=positive, default=128, help="tokens per window / grid point (default 128)")
    sp.add_argument("--method", choices=["exact", "power", "lanczos"], default="exact",
                    help="sigma_max solver (default exact)")
    sp.add_argument("--seed", type=non_negative, default=0, help="seed of the iterative solvers' start vectors")
    sp.add_argument("--sites", default=None, help="comma-separated norm-input sites or globs, e.g. "
                    "'blocks.*.norm1.input' (default every norm of the model)")
    add_format_option(sp)
    rc = jobs.add_parser("recovery", parents=[common], help="propagation over prompts x layers (x directions x scales)")
    rc.add_argument("--model", default="default", help="load_pretrained name/path, 'default' or 'tiny' (synthetic)")
    rc.add_argument("--prompts", metavar="FILE", help="one prompt per line")
    rc.add_argument("--layers", type=_ints, default=[2], help="comma-separated injection layers (default 2)")
    rc.add_argument("--directions", type=positive, default=4, help="seeded random directions (default 4)")
    rc.add_argument("--scales", type=positive_floats, default=[1.0, 4.0, 16.0],
                    help="comma-separated injection scales (default 1,4,16)")
    rc.add_argument("--linearized", action="store_true", help="also the linearized propagation")
    rc.add_argument("--seed", type=non_negative, default=0, help="seed of the random directions")
    at = jobs.add_parser("attention", parents=[common], help="attention dynamics over seeds x learning rates")
    at.add_argument("--seeds", type=_ints, default=[42, 2024, 1337, 7777, 9999],
                    help="comma-separated seeds (default the paper's five)")
    at.add_argument("--lrs", type=floats, default=[0.01], help="comma-separated learning rates (default 0.01)")
    at.add_argument("--steps", type=positive, default=1000, help="training steps per arm (default 1000)")
    at.add_argument("--T", type=positive, default=2000, help="sequence length (default 2000)")
    st = jobs.add_parser("stability", parents=[common], help="signal propagation over init schemes")
    st.add_argument("--schemes", default="kaiming_normal,xavier_normal,torch_default,orthogonal",
                    help="comma-separated initialization schemes")
    st.add_argument("--depth", type=positive, default=48, help="layers (default 48)")
    st.add_argument("--width", type=width, default=768, help="d_model (default 768)")
    st.add_argument("--seed", type=non_negative, default=0, help="seed of the weights")
    nm = jobs.add_parser("norms", parents=[common], help="synthetic small tasks (benchmark of the machinery)")
    nm.add_argument("--points", type=positive, default=1000, help="grid points (default 1000)")
    nm.add_argument("--tokens", type=positive, default=64, help="tokens per point (default 64)")
    nm.add_argument("--d", type=positive, default=64, help="width of the synthetic tokens (default 64)")
    return s
