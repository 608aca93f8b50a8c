"""The ``pyengine`` command.

``pyengine recovery``  the main job: inject a direction into the residual stream and
                   measure its decay, exact and linearized, with spectra and ablations.
``pyengine demo``  every normalization kernel on every backend: agreement with the
                   NumPy reference and throughput, on a built-in synthetic batch.
``pyengine spectral``  per-token sigma_max of LayerNorm/RMSNorm Jacobians of activations.
``pyengine bench``  every kernel x backend, as a fraction of the machine's limits
                   measured in the same run; ``--compare`` checks for regressions.
``pyengine attention``  attention gradient dynamics on a sticky Markov chain (EM-style vs GD).
``pyengine backends``  which backends load, and why not.

Bad arguments never end in a traceback: one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import numpy as np

from .. import backends
from ..kernels import layernorm as ln
from ..bench import time_call

__all__ = ["main"]

#: Kernel id -> arrays of x's size streamed through memory (inputs read + output written).
_STREAMS = {"layer_norm": 2, "layer_norm_jvp": 3, "layer_norm_vjp": 3, "rms_norm": 2, "rms_norm_jvp": 3, "rms_norm_vjp": 3}


def _progress(msg: str) -> None:
    if sys.stderr.isatty():
        print(f"\r\033[K{msg}", end="", file=sys.stderr, flush=True)


def _kernel_call(kernel: str, x, w, gamma, beta, backend: str, out):
    fn = getattr(ln, kernel)
    if kernel == "layer_norm":
        return fn(x, gamma, beta, backend=backend, out=out)
    if kernel == "rms_norm":
        return fn(x, gamma, backend=backend, out=out)
    return fn(x, w, gamma, backend=backend, out=out)


def demo(tokens: int, d: int, dtype: str, repeat: int) -> int:
    """Print agreement with the reference and throughput for every kernel and backend."""
    rng = np.random.default_rng(0)
    dt = np.dtype(dtype)
    x = (3.0 + rng.standard_normal((tokens, d))).astype(dt)
    w = rng.standard_normal((tokens, d)).astype(dt)
    gamma = rng.uniform(0.5, 1.5, d).astype(dt)
    beta = (0.1 * rng.standard_normal(d)).astype(dt)
    out = np.empty_like(x)
    avail = backends.available_backends()
    for info in avail.values():
        if not info.available:
            print(f"backend {info.name}: unavailable ({info.reason})")
    names = [n for n, i in avail.items() if i.available]
    print(f"pyengine demo: {tokens} tokens x d={d}, {dt.name}, median of {repeat} runs, out= preallocated")
    print(f"{'kernel':<16}{'backend':<8}{'max rel err':>13}{'time ms':>10}{'GB/s':>8}{'vs numpy':>10}")
    for kernel, streams in _STREAMS.items():
        ref = _kernel_call(kernel, x, w, gamma, beta, "numpy", None)
        scale = float(np.abs(ref).max())
        t_ref = None
        for name in reversed(names):  # numpy first, for the speed-up column
            _progress(f"{kernel} on {name} ...")
            got = _kernel_call(kernel, x, w, gamma, beta, name, out)
            err = float(np.abs(got.astype(np.float64) - ref).max()) / scale
            t = time_call(lambda: _kernel_call(kernel, x, w, gamma, beta, name, out), repeat)[0]
            t_ref = t if name == "numpy" else t_ref
            gbs = streams * x.nbytes / t / 1e9
            speed = f"{t_ref / t:9.1f}x" if t_ref else ""
            _progress("")
            print(f"{kernel:<16}{name:<8}{err:>13.2e}{t * 1e3:>10.3f}{gbs:>8.1f}{speed:>10}")
    return 0


# -- pyengine spectral ---------------------------------------------------------------------
#: Synthetic default of ``pyengine spectral``: tokens x d, like one GPT-2-small layer's batch.
SPECTRAL_TOKENS, SPECTRAL_D = 20000, 768


def _load_array(path: str, key: str | None, what: str) -> np.ndarray:
    """An array from .npy (memory-mapped) or .npz (``key``, or its only array); errors name the file."""
    import zipfile

    try:
        obj = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        if isinstance(exc, FileNotFoundError):
            raise OSError(f"{what} file not found: {path}") from None
        raise ValueError(f"cannot read {what} file {path} as .npy/.npz: {exc}") from None
    if isinstance(obj, np.lib.npyio.NpzFile):
        with obj:
            names = list(obj.files)
            if key is None:
                if len(names) != 1:
                    raise ValueError(f"{path} holds {len(names)} arrays ({', '.join(names)}); choose one with --key")
                key = names[0]
            if key not in names:
                raise ValueError(f"{path} has no array {key!r}; it holds: {', '.join(names) or 'nothing'}")
            try:
                arr = obj[key]
            except (ValueError, OSError, zipfile.BadZipFile) as exc:
                raise ValueError(f"cannot read array {key!r} of {path}: {exc}") from None
    elif isinstance(obj, np.ndarray):
        arr = obj
    else:
        raise ValueError(f"{path} is not a .npy or .npz file")
    if arr.dtype.kind != "f" or arr.dtype.itemsize not in (4, 8):
        raise TypeError(f"{what} in {path} must be float32 or float64; got {arr.dtype}")
    return arr


def _synthetic(tokens: int, d: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded residual-stream-like activations (float32) and a LayerNorm gamma.

    Per-channel lognormal scales and offsets, a few massive-activation channels,
    and gamma lognormal around 1: close to what trained transformers show.
    """
    rng = np.random.default_rng(seed)
    scale = rng.lognormal(0.0, 0.5, d)
    offset = 0.3 * rng.standard_normal(d)
    hot = rng.choice(d, size=min(3, d), replace=False)
    scale[hot] *= 20.0
    x = np.empty((tokens, d), np.float32)
    for lo in range(0, tokens, 4096):  # bounded float64 temporaries
        n = min(tokens, lo + 4096) - lo
        x[lo : lo + n] = rng.standard_normal((n, d)) * scale + offset
    gamma = rng.lognormal(0.0, 0.3, d).astype(np.float32)
    return x, gamma


class _ProgressBar:
    """``callback(done, total)`` that draws a bar on stderr."""

    def __init__(self, enabled: bool, label: str) -> None:
        self.enabled, self.label, self.t0 = enabled, label, time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        frac = done / total if total else 1.0
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        rate = done / max(time.perf_counter() - self.t0, 1e-9)
        print(f"\r{self.label} [{bar}] {100 * frac:5.1f}%  {done}/{total} tokens  {rate:,.0f}/s",
              end="", file=sys.stderr, flush=True)
        if done >= total:
            print(file=sys.stderr, flush=True)


def _histogram(values: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    counts, edges = np.histogram(values, bins=bins)
    top = max(int(counts.max(initial=0)), 1)
    lines = [f"  [{edges[i]:9.5g}, {edges[i + 1]:9.5g})  {'#' * round(40 * c / top):<40} {c}"
             for i, c in enumerate(counts)]
    return counts, edges, lines


def _finite_or_none(a: np.ndarray) -> list:
    return [float(v) if np.isfinite(v) else None for v in np.asarray(a, np.float64).ravel()]


def spectral(args: argparse.Namespace) -> int:
    """Per-token sigma_max of LayerNorm/RMSNorm Jacobians: summary, histogram, JSON/CSV."""
    import json

    from ..linalg import spectral as sp

    if args.input is not None:
        x = _load_array(args.input, args.key, "activations")
        if x.ndim < 2:
            raise ValueError(f"activations in {args.input} must have shape (N, d); got {x.shape}")
        x = x.reshape(-1, x.shape[-1])
        gamma, source = None, args.input
    else:
        if args.key is not None:
            raise ValueError("--key needs --input")
        if args.d < 2:
            raise ValueError(f"--d must be at least 2; got {args.d}")
        x, gamma = _synthetic(args.tokens, args.d, args.seed)
        source = f"synthetic, seed {args.seed}"
    if args.gamma is not None:
        gamma = _load_array(args.gamma, None, "gamma")
        if gamma.ndim != 1:
            raise ValueError(f"gamma in {args.gamma} must have shape (d,); got {gamma.shape}")
        gamma = np.asarray(gamma)
    if args.csv and args.csv == args.json:
        raise ValueError("--csv and --json must be different files")
    n, d = x.shape
    norm = "layer_norm" if args.norm == "layernorm" else "rms_norm"
    fn = sp.layer_norm_spectral_norm if norm == "layer_norm" else sp.rms_norm_spectral_norm
    show = sys.stderr.isatty() if args.progress == "auto" else args.progress == "always"
    chunk = args.chunk_size or (max(256, -(-n // 100)) if show else None)
    print(f"pyengine spectral: {n} tokens x d={d} ({source}), {args.norm}, mode {args.mode}, "
          f"method {args.method}, backend {args.backend}")
    t0 = time.perf_counter()
    res = fn(x, gamma, args.eps, args.mode, args.method, tol=args.tol, max_iter=args.max_iter,
             seed=args.seed, backend=args.backend, chunk_size=chunk,
             callback=_ProgressBar(show, f"sigma_max ({args.method})"))
    elapsed = time.perf_counter() - t0
    sigma = res.sigma.ravel()
    below = int((sigma < 1).sum())
    conv = int(res.converged.sum())
    counts, edges, lines = _histogram(sigma, args.bins)
    print(f"sigma_max of the {args.norm} Jacobian per token:")
    if n:
        print(f"  min {sigma.min():.6g}   median {np.median(sigma):.6g}   max {sigma.max():.6g}")
    print(f"  sigma_max < 1: {below} of {n} tokens ({100 * below / max(n, 1):.2f}%)")
    if args.method != "exact":
        note = "" if conv == n else "  (the others report a lower bound only)"
        print(f"  converged (residual <= {args.tol:g}): {conv} of {n}{note}")
        print(f"  iterations: mean {res.iterations.mean():.1f}  max {res.iterations.max(initial=0)}")
    print(f"histogram ({args.bins} bins):")
    print("\n".join(lines))
    print(f"time: {elapsed:.3f} s ({1e6 * elapsed / max(n, 1):.2f} us/token)")
    if args.json:
        doc = {
            "tokens": n, "d": d, "source": source, "norm": args.norm, "mode": args.mode,
            "method": args.method, "tol": args.tol, "eps": args.eps, "seconds": elapsed,
            "summary": {
                "min": float(sigma.min()) if n else None, "median": float(np.median(sigma)) if n else None,
                "max": float(sigma.max()) if n else None, "below_one": below, "converged": conv,
            },
            "histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
            "sigma": _finite_or_none(res.sigma), "lower": _finite_or_none(res.lower),
            "upper": _finite_or_none(res.upper), "residual": _finite_or_none(res.residual),
            "iterations": res.iterations.ravel().tolist(), "converged": res.converged.ravel().tolist(),
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh)
        print(f"wrote {args.json}")
    if args.csv:
        table = np.column_stack([np.arange(n), sigma, res.lower.ravel(), res.upper.ravel(),
                                 res.residual.ravel(), res.iterations.ravel(), res.converged.ravel()])
        np.savetxt(args.csv, table, delimiter=",", comments="",
                   header="token,sigma,lower,upper,residual,iterations,converged",
                   fmt=["%d", "%.17g", "%.17g", "%.17g", "%.6g", "%d", "%d"])
        print(f"wrote {args.csv}")
    return 0


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number; got {text}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive; got {text}")
    return value


def _add_spectral_parser(sub) -> None:
    s = sub.add_parser("spectral", help="per-token sigma_max of LayerNorm/RMSNorm Jacobians")
    s.add_argument("--input", metavar="FILE", help="activations (N, d), .npy or .npz (default: synthetic)")
    s.add_argument("--key", help="array name inside an .npz with several arrays")
    s.add_argument("--gamma", metavar="FILE", help="gamma (d,), .npy or one-array .npz (default: ones, "
                   "or the synthetic gamma)")
    s.add_argument("--norm", choices=["layernorm", "rmsnorm"], default="layernorm")
    s.add_argument("--method", choices=["exact", "power", "lanczos"], default="exact")
    s.add_argument("--mode", choices=["full", "frozen_scale"], default="full")
    s.add_argument("--eps", type=float, default=1e-5, help="normalization eps (default 1e-5)")
    s.add_argument("--tol", type=_positive_float, default=1e-6, help="residual tolerance (default 1e-6)")
    s.add_argument("--max-iter", type=_positive, default=1000, help="iterations cap per token (default 1000)")
    s.add_argument("--backend", choices=["auto", *backends.BACKENDS], default="auto")
    s.add_argument("--tokens", type=_positive, default=SPECTRAL_TOKENS,
                   help=f"synthetic tokens (default {SPECTRAL_TOKENS})")
    s.add_argument("--d", type=_positive, default=SPECTRAL_D, help=f"synthetic width (default {SPECTRAL_D})")
    s.add_argument("--seed", type=int, default=0, help="seed of the synthetic data and start vectors (default 0)")
    s.add_argument("--chunk-size", type=_positive, default=None, help="tokens per chunk (default: automatic)")
    s.add_argument("--bins", type=_positive, default=20, help="histogram bins (default 20)")
    s.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                   help="progress bar on stderr (auto: when stderr is a terminal)")
    s.add_argument("--json", metavar="FILE", help="write the summary and per-token results as JSON")
    s.add_argument("--csv", metavar="FILE", help="write per-token results as CSV")


# -- pyengine recovery ---------------------------------------------------------------------


class _StageBar:
    """``progress(fraction, stage)`` for the recovery experiment: a bar on a terminal,
    otherwise one line per stage (so logs show where the time goes)."""

    def __init__(self, mode: str) -> None:
        self.tty = sys.stderr.isatty() if mode == "auto" else mode == "always"
        self.quiet = mode == "never"
        self.stage, self.t0 = None, time.perf_counter()

    def __call__(self, frac: float, stage: str) -> None:
        if self.quiet:
            return
        elapsed = time.perf_counter() - self.t0
        if self.tty:
            bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
            end = "\n" if stage == "done" else ""
            print(f"\r\033[K[{bar}] {100 * frac:5.1f}%  {elapsed:6.1f} s  {stage}", end=end, file=sys.stderr,
                  flush=True)
        elif stage != self.stage:
            print(f"[{100 * frac:5.1f}%] {elapsed:6.1f} s  {stage}", file=sys.stderr, flush=True)
        self.stage = stage


def _floats(text: str) -> list[float]:
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers; got {text}") from None
    if not vals:
        raise argparse.ArgumentTypeError("needs at least one number")
    return vals


def _positions(text: str):
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


def load_model(name: str, seed: int = 0):
    """The built-in default ("default", weights seeded by ``seed``), a ``.npz`` Stack, or a
    pretrained model by name or folder."""
    from ..experiments import default_model

    if name == "default":
        return default_model(seed), None
    if name.endswith(".npz"):
        from ..models import Stack

        return Stack.load(name), name
    from ..models.pretrained import load_pretrained

    model = load_pretrained(name)
    return model, getattr(model, "name", name)


def recovery(args: argparse.Namespace) -> int:
    from ..experiments import recovery as run
    from ..experiments import format_table, write_report

    model, name = load_model(args.model, args.seed)
    print(f"pyengine recovery: model {name or 'default (seeded GPT-2-small-shaped pre-LN stack)'}; "
          f"output folder {args.out}", flush=True)
    rep = run(model, text=args.text, layer=args.layer, scales=args.scales, protocol_scale=args.scale,
              n_directions=args.directions, positions=args.positions, read=args.read,
              spectral_tokens=args.spectral_tokens, seed=args.seed, dtype=args.dtype, name=name,
              progress=_StageBar(args.progress))
    print(format_table(rep))
    paths = write_report(rep, args.out, plots=not args.no_plots)
    print(f"time: {rep.seconds['total']:.1f} s; wrote {', '.join(paths)}")
    return 0


def _add_recovery_parser(sub) -> None:
    r = sub.add_parser("recovery", help="the main job: how an injected direction decays through the stack")
    r.add_argument("--model", default="default",
                   help="default (a seeded GPT-2-small-shaped pre-LN stack, no download), all-MiniLM-L6-v2, "
                        "SmolLM2-135M-Instruct, a model folder, or a .npz saved by Stack.save")
    r.add_argument("--text", default=None, help="the input sentence (default: a built-in sentence)")
    r.add_argument("--layer", type=int, default=2, help="hidden-state index of the injection (default 2)")
    r.add_argument("--scale", type=_positive_float, default=6.0,
                   help="the protocol scale: fits and the table use it (default 6)")
    r.add_argument("--scales", type=_floats, default=None,
                   help="comma-separated scales of the sweep (default 0.01,0.03,...,30)")
    r.add_argument("--directions", type=_positive, default=4, help="random unit directions (default 4)")
    r.add_argument("--positions", type=_positions, default="all", help="all, last, a:b or i,j,k (default all)")
    r.add_argument("--read", choices=["last", "injected", "downstream", "all"], default="last",
                   help="positions whose |projection| is fitted (default last: the published protocol)")
    r.add_argument("--spectral-tokens", type=_positions, default="last",
                   help="tokens whose Jacobian blocks are formed (default last)")
    r.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    r.add_argument("--seed", type=int, default=0,
                   help="seeds the directions and the default model's weights (default 0)")
    r.add_argument("--out", default="recovery-out", help="output folder (default ./recovery-out)")
    r.add_argument("--no-plots", action="store_true", help="skip recovery.png")
    r.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                   help="bar on a terminal, stage lines otherwise (auto), or force either")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pyengine", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="kernels x backends: agreement with the reference and throughput")
    d.add_argument("--tokens", type=_positive, default=4096, help="tokens in the batch (default 4096)")
    d.add_argument("--d", type=_positive, default=768, help="model width d >= 2 (default 768)")
    d.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    d.add_argument("--repeat", type=_positive, default=10, help="timed runs per kernel (default 10)")
    sub.add_parser("backends", help="which backends load, and why not")
    _add_spectral_parser(sub)
    _add_recovery_parser(sub)
    from . import attention as _attention_cmd  # one module per subcommand (rewired at merge)

    _attention_cmd.add_parser(sub)
    b = sub.add_parser("bench", help="every kernel x backend as a fraction of the machine's limits")
    b.add_argument("--quick", action="store_true", help="small sizes, few repeats (under a minute)")
    b.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    b.add_argument("--compare", metavar="BASELINE", help="a --json report: exit 1 on a regression against it")
    b.add_argument("--threshold", type=float, default=0.25, help="allowed relative drop beyond noise (default 0.25)")
    b.add_argument("--dtype", choices=["float32", "float64", "both"], default="float32")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            if args.d < 2:
                raise ValueError(f"--d must be at least 2; got {args.d}")
            return demo(args.tokens, args.d, args.dtype, args.repeat)
        if args.command == "spectral":
            return spectral(args)
        if args.command == "recovery":
            if args.scales is None:
                from ..experiments.recovery import DEFAULT_SCALES

                args.scales = list(DEFAULT_SCALES)
            return recovery(args)
        if args.command == "attention":
            return args.run(args)
        if args.command == "bench":
            from .. import bench

            dtypes = ("float32", "float64") if args.dtype == "both" else (args.dtype,)
            return bench.main(args.quick, args.json, args.compare, args.threshold, dtypes)
        for info in backends.available_backends().values():
            print(f"{info.name:<6} {'available' if info.available else 'unavailable: ' + info.reason}")
        return 0
    except (ValueError, TypeError, OSError, MemoryError, ImportError) as exc:
        print(f"pyengine: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
