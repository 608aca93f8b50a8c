"""``pyengine demo``: every normalization kernel on every backend, on a built-in synthetic
batch: agreement with the NumPy reference and throughput."""

from __future__ import annotations

import argparse

import numpy as np

from .. import backends
from .._progress import Progress
from ..bench import time_call
from ..kernels import layernorm as ln
from ._args import positive

__all__ = ["add_parser", "demo", "run"]

#: Kernel id -> arrays of x's size streamed through memory (inputs read + output written).
_STREAMS = {"layer_norm": 2, "layer_norm_jvp": 3, "layer_norm_vjp": 3, "rms_norm": 2, "rms_norm_jvp": 3, "rms_norm_vjp": 3}


def add_parser(subparsers) -> argparse.ArgumentParser:
    d = subparsers.add_parser("demo", help="kernels x backends: agreement with the reference and throughput")
    d.add_argument("--tokens", type=positive, default=4096, help="tokens in the batch (default 4096)")
    d.add_argument("--d", type=positive, default=768, help="model width d >= 2 (default 768)")
    d.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="dtype of the batch (default float32)")
    d.add_argument("--repeat", type=positive, default=10, help="timed runs per kernel (default 10)")
    return d


def run(args: argparse.Namespace) -> int:
    if args.d < 2:
        raise ValueError(f"--d must be at least 2; got {args.d}")
    return demo(args.tokens, args.d, args.dtype, args.repeat)


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
    status = Progress("auto").status  # "kernel on backend ..." while it runs, on a terminal
    print(f"pyengine demo: {tokens} tokens x d={d}, {dt.name}, median of {repeat} runs, out= preallocated")
    print(f"{'kernel':<16}{'backend':<8}{'max rel err':>13}{'time ms':>10}{'GB/s':>8}{'vs numpy':>10}")
    for kernel, streams in _STREAMS.items():
        ref = _kernel_call(kernel, x, w, gamma, beta, "numpy", None)
        scale = float(np.abs(ref).max())
        t_ref = None
        for name in reversed(names):  # numpy first, for the speed-up column
            status(f"{kernel} on {name} ...")
            got = _kernel_call(kernel, x, w, gamma, beta, name, out)
            err = float(np.abs(got.astype(np.float64) - ref).max()) / scale
            t = time_call(lambda: _kernel_call(kernel, x, w, gamma, beta, name, out), repeat)[0]
            t_ref = t if name == "numpy" else t_ref
            gbs = streams * x.nbytes / t / 1e9
            speed = f"{t_ref / t:9.1f}x" if t_ref else ""
            status("")
            print(f"{kernel:<16}{name:<8}{err:>13.2e}{t * 1e3:>10.3f}{gbs:>8.1f}{speed:>10}")
    return 0
