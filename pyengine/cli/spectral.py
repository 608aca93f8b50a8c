"""``pyengine spectral``: per-token sigma_max of the LayerNorm/RMSNorm Jacobians of activations
(a .npy/.npz file, or a synthetic default), with a summary, a histogram, JSON and CSV."""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import numpy as np

from .. import backends
from .._progress import Progress
from ._args import non_negative, non_negative_float, positive, positive_float
from ._provenance import block, model_fields
from ._stages import Stages

__all__ = ["SPECTRAL_D", "SPECTRAL_TOKENS", "add_parser", "run"]

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
        if key is not None:
            raise ValueError(f"--key {key} names an array inside an .npz, but {path} is a .npy file "
                             "(one array): drop --key")
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


def _histogram(values: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    counts, edges = np.histogram(values, bins=bins)
    top = max(int(counts.max(initial=0)), 1)
    lines = [f"  [{edges[i]:9.5g}, {edges[i + 1]:9.5g})  {'#' * round(40 * c / top):<40} {c}"
             for i, c in enumerate(counts)]
    return counts, edges, lines


def _finite_or_none(a: np.ndarray) -> list:
    return [float(v) if np.isfinite(v) else None for v in np.asarray(a, np.float64).ravel()]


def _scan(fn, x: np.ndarray, gamma, n_layers: int | None, args: argparse.Namespace, chunk, bar: Progress,
          stage=None):
    """``fn`` over all tokens; with a layer axis, one call per layer (gamma (L, d): that layer's
    row) and the results concatenated in layer order, each layer a finished ``stage``."""
    kw = dict(tol=args.tol, max_iter=args.max_iter, seed=args.seed, backend=args.backend, chunk_size=chunk)
    if not n_layers:
        return fn(x, gamma, args.eps, args.mode, args.method, callback=bar.count, **kw)
    import types

    per = x.shape[0] // n_layers
    fields = ("sigma", "lower", "upper", "residual", "iterations", "converged")
    parts = []
    for k in range(n_layers):
        g = gamma[k] if gamma is not None and np.ndim(gamma) == 2 else gamma
        parts.append(fn(x[k * per:(k + 1) * per], g, args.eps, args.mode, args.method,
                        callback=lambda d, t, k=k: bar.count(k * per + d, n_layers * per), **kw))
        if stage is not None:
            stage(f"layer {k}" + (f" {_site_name(args, k)}" if _site_name(args, k) else ""),
                  {"layer": k, "site": _site_name(args, k),
                                 **{f: np.ravel(getattr(parts[-1], f)) for f in fields}})
    return types.SimpleNamespace(**{f: np.concatenate([np.ravel(getattr(p, f)) for p in parts]) for f in fields})


def _site_name(args: argparse.Namespace, k: int) -> str | None:
    sites = getattr(args, "_sites", None)
    return sites[k] if sites else None


def _model_sites(args: argparse.Namespace) -> tuple[list[str], np.ndarray, np.ndarray, str]:
    """The norm-input sites ``--sites`` of ``--model`` at ``--text``: names, (S, T, d), (S, d), source."""
    from ..analysis.site_spectra import DEFAULT_SITES, norm_site_inputs
    from ..experiments.recovery import DEFAULT_TEXT, byte_ids
    from .recovery import load_model

    model, name = load_model(args.model or "default", args.seed)
    text = DEFAULT_TEXT if args.text is None else args.text
    ids = model.tokenize(text) if hasattr(model, "tokenize") else byte_ids(text)
    pats = DEFAULT_SITES if args.sites is None else [p.strip() for p in args.sites.split(",") if p.strip()]
    sites, X, gamma = norm_site_inputs(model, ids, pats)
    args._norm, args._eps = model.config.norm, model.config.eps
    name_or_file = args.model if args.model and args.model.endswith(".npz") else model
    args._model_fields = model_fields(name_or_file, name, synthetic=f"synthetic: default (seed {args.seed})")
    return sites, X, gamma, f"{name or args.model or 'default'}: {len(sites)} norm-input site(s) at T = {len(ids)} tokens"


def run(args: argparse.Namespace) -> int:
    """Per-token sigma_max of LayerNorm/RMSNorm Jacobians: summary, histogram, JSON/CSV."""
    import json

    from ..linalg import spectral as sp

    for option, path in (("--json", args.json), ("--csv", args.csv)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            raise OSError(f"{option} {path}: the folder {folder} does not exist")
    if args.text is not None and args.model is None and args.sites is None:
        raise ValueError("--text is the input of --model (or --sites): give --model, or drop --text")
    sites = None
    if args.model is not None or args.sites is not None:  # norm-input sites of a model
        if args.input is not None or args.gamma is not None:
            raise ValueError("--model/--sites read the activations and gammas from the model: drop --input/--gamma")
        sites, x, gamma, source = _model_sites(args)
        n_layers = len(sites)
        args.norm, args.eps = args._norm, args._eps  # the model's own norm and eps
        x = x.reshape(-1, x.shape[-1])
    elif args.input is not None:
        x = _load_array(args.input, args.key, "activations")
        if x.ndim < 2:
            raise ValueError(f"activations in {args.input} must have shape (N, d) or (L, T, d); got {x.shape}")
        n_layers = x.shape[0] if x.ndim >= 3 else None  # (L, T, d): the layer axis is kept
        x = x.reshape(-1, x.shape[-1])
        gamma, source = None, args.input
    else:
        if args.key is not None:
            raise ValueError("--key needs --input")
        if args.d < 2:
            raise ValueError(f"--d must be at least 2; got {args.d}")
        x, gamma = _synthetic(args.tokens, args.d, args.seed)
        source, n_layers = f"synthetic, seed {args.seed}", None
    if args.gamma is not None and sites is None:
        gamma = np.asarray(_load_array(args.gamma, None, "gamma"))
        if gamma.ndim == 2 and n_layers is None:
            raise ValueError(f"gamma in {args.gamma} has shape {gamma.shape} (one per layer), but the activations "
                             "have no layer axis: pass (L, T, d) activations or a (d,) gamma")
        bad_layers = gamma.ndim == 2 and gamma.shape[0] != n_layers
        if gamma.ndim not in (1, 2) or bad_layers or gamma.shape[-1] != x.shape[1]:
            want = f"(d,) or (L, d) = ({n_layers}, {x.shape[1]})" if n_layers else f"(d,) = ({x.shape[1]},)"
            raise ValueError(f"gamma in {args.gamma} must have shape {want}; got {gamma.shape}")
    if args.csv and args.csv == args.json:
        raise ValueError("--csv and --json must be different files")
    n, d = x.shape
    norm = "layer_norm" if args.norm == "layernorm" else "rms_norm"
    fn = sp.layer_norm_spectral_norm if norm == "layer_norm" else sp.rms_norm_spectral_norm
    bar = Progress(args.progress, label=f"sigma_max ({args.method})", unit="tokens")
    chunk = args.chunk_size or (max(256, -(-n // 100)) if bar.enabled else None)
    print(f"pyengine spectral: {n} tokens x d={d} ({source}), {args.norm}, mode {args.mode}, "
          f"method {args.method}, backend {args.backend}")
    t0 = time.perf_counter()
    args._sites = sites
    out_dir = next((os.path.dirname(os.path.abspath(f)) for f in (args.json, args.csv) if f), None)
    fields = getattr(args, "_model_fields", None) or {"model": source if args.input is None else None}
    prov = None if out_dir is None else block(args, seeds=[args.seed], dtype=x.dtype, backend=args.backend,
                                              inputs=(args.input, args.gamma), **fields)
    stages = Stages(out_dir, prov) if out_dir and n_layers else None  # each layer / site on disk when done
    with (stages.keep() if stages else contextlib.nullcontext()):
        res = _scan(fn, x, gamma, n_layers, args, chunk, bar, stages)
    elapsed = time.perf_counter() - t0
    layer = np.repeat(np.arange(n_layers), n // n_layers) if n_layers else None
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
    if n_layers:
        print("per layer (index along the first axis of the input):")
        print(f"  {'layer':>5} {'min':>10} {'median':>10} {'max':>10} {'< 1':>8}")
        for k in range(n_layers):
            v = sigma[layer == k]
            print(f"  {k:>5} {v.min():>10.6g} {np.median(v):>10.6g} {v.max():>10.6g} {int((v < 1).sum()):>8}"
                  + (f"  {sites[k]}" if sites else ""))
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
            "layers": n_layers, "layer": None if layer is None else layer.tolist(), "sites": sites,
            "per_layer": None if layer is None else [
                {"layer": k, "site": _site_name(args, k), "min": float(sigma[layer == k].min()), "median": float(np.median(sigma[layer == k])),
                 "max": float(sigma[layer == k].max()), "below_one": int((sigma[layer == k] < 1).sum())}
                for k in range(n_layers)],
            "sigma": _finite_or_none(res.sigma), "lower": _finite_or_none(res.lower),
            "upper": _finite_or_none(res.upper), "residual": _finite_or_none(res.residual),
            "iterations": res.iterations.ravel().tolist(), "converged": res.converged.ravel().tolist(),
            "provenance": prov,
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh)
        print(f"wrote {args.json}")
    if args.csv:
        token = np.arange(n) % (n // n_layers) if n_layers else np.arange(n)
        cols = [token, sigma, res.lower.ravel(), res.upper.ravel(), res.residual.ravel(), res.iterations.ravel(),
                res.converged.ravel()]
        header, fmt = "token,sigma,lower,upper,residual,iterations,converged", ["%d", "%.17g", "%.17g", "%.17g",
                                                                               "%.6g", "%d", "%d"]
        if n_layers:
            cols, header, fmt = [layer, *cols], "layer," + header, ["%d", *fmt]
        if sites:  # a site column after the layer index
            import csv

            with open(args.csv, "w", newline="") as fh:
                w = csv.writer(fh)
                w.writerow(["layer", "site", *header.split(",")[1:]])
                for row in zip(*cols):
                    w.writerow([int(row[0]), sites[int(row[0])], *[f % v for f, v in zip(fmt[1:], row[1:])]])
        else:
            np.savetxt(args.csv, np.column_stack(cols), delimiter=",", comments="", header=header, fmt=fmt)
        print(f"wrote {args.csv}")
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    s = subparsers.add_parser("spectral", help="per-token sigma_max of LayerNorm/RMSNorm Jacobians")
    s.add_argument("--input", metavar="FILE", help="activations (N, d), or (L, T, d) with a layer axis that is "
                   "kept (per-layer summary, a layer column), .npy or .npz (default: synthetic)")
    s.add_argument("--key", help="array name inside an .npz with several arrays")
    s.add_argument("--gamma", metavar="FILE", help="gamma (d,), or (L, d) one per layer of an (L, T, d) input, .npy or one-array .npz "
                   "(default: ones, or the synthetic gamma)")
    s.add_argument("--norm", choices=["layernorm", "rmsnorm"], default="layernorm",
                   help="the normalization whose Jacobian is scanned (default layernorm)")
    s.add_argument("--method", choices=["exact", "power", "lanczos"], default="exact",
                   help="exact (closed form), power or lanczos iteration (default exact)")
    s.add_argument("--mode", choices=["full", "frozen_scale"], default="full",
                   help="full Jacobian, or frozen_scale (1/sigma held fixed) (default full)")
    s.add_argument("--eps", type=non_negative_float, default=1e-5, help="normalization eps (default 1e-5)")
    s.add_argument("--tol", type=positive_float, default=1e-6, help="residual tolerance (default 1e-6)")
    s.add_argument("--max-iter", type=positive, default=1000, help="iterations cap per token (default 1000)")
    s.add_argument("--backend", choices=["auto", *backends.BACKENDS], default="auto",
                   help="kernel backend (default auto: the fastest that loads)")
    s.add_argument("--tokens", type=positive, default=SPECTRAL_TOKENS,
                   help=f"synthetic tokens (default {SPECTRAL_TOKENS})")
    s.add_argument("--d", type=positive, default=SPECTRAL_D, help=f"synthetic width (default {SPECTRAL_D})")
    s.add_argument("--seed", type=non_negative, default=0, help="seed of the synthetic data and start vectors (default 0)")
    s.add_argument("--chunk-size", type=positive, default=None, help="tokens per chunk (default: automatic)")
    s.add_argument("--bins", type=positive, default=20, help="histogram bins (default 20)")
    s.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                   help="progress bar on stderr (auto: when stderr is a terminal)")
    s.add_argument("--model", default=None, help="scan the norm inputs of this model (a load_pretrained name, "
                   "a .npz Stack or 'default') at --text, instead of --input; its norm, eps and gammas are used")
    s.add_argument("--sites", default=None, help="comma-separated norm-input sites or globs of --model, e.g. "
                   "'blocks.*.norm1.input,final_norm.input' (default every block's norm inputs, blocks.*.norm*.input); "
                   "one layer row per site, named in the JSON and CSV")
    s.add_argument("--text", default=None, help="the text whose tokens are scanned with --model (default a built-in sentence)")
    s.add_argument("--json", metavar="FILE", help="write the summary and per-token results as JSON")
    s.add_argument("--csv", metavar="FILE", help="write per-token results as CSV")
    return s
