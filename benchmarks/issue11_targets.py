"""Issue 11's speed targets other than the training step, side by side in one process.

1. ``Stack.block_vjp`` of K cotangents at one sequence against ``block_forward`` of K
   sequences, GPT-2-small block (d = 768, 12 heads, d_mlp = 3072, T = 128), float32,
   K = 64 (the issue's) and K = 8 (the asv suite's): target ratio <= 1.5.
2. The attention backward kernels (``attention_score_grad``, ``attention_advantage``,
   ``attention_backward``) on (12 heads, 128, 128), head width 64, causal: C++ against
   the NumPy reference (target >= 10x), and each against its bytes-moved limit: the
   bytes it must read and write divided by the all-core copy bandwidth measured here
   for a buffer of the same size (``pyengine.bench.copy_bandwidth``), target within
   1.5x where the kernel is memory-bound (the score gradient and the advantage are:
   O(T^2) bytes for O(T^2 dv) work at dv = 64 they are not far from it either way;
   the fused backward is compute-bound, ~4 T^2 d flops on O(T d) bytes, and its
   limit is reported for completeness only).

Timings are medians (and minima) of repeated calls after a warm-up call; run

    python benchmarks/issue11_targets.py [--repeat 30] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import pyengine as pe
from pyengine import _core, backends
from pyengine.bench import copy_bandwidth


def _times(fn, repeat: int) -> tuple[float, float]:
    fn()
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), float(np.min(ts))


def block_vjp_ratio(k: int, repeat: int) -> dict:
    cfg = pe.StackConfig(d_model=768, n_heads=12, d_mlp=3072, n_layers=1, activation="gelu_tanh",
                         positions="learned", max_seq_len=128)
    st = pe.init_weights(cfg, "gpt2", seed=0, dtype=np.float32, bias_std=0.02)
    rng = np.random.default_rng(3)
    hb = rng.standard_normal((k, 128, 768), dtype=np.float32)
    h = hb[0].copy()
    g = rng.standard_normal((k, 128, 768), dtype=np.float32)
    _, cache = st.block_forward(0, h, return_cache=True)
    st.block_vjp(0, h, g, cache=cache)
    fwd = _times(lambda: st.block_forward(0, hb), repeat)
    vjp = _times(lambda: st.block_vjp(0, h, g, cache=cache), repeat)
    return {"K": k, "forward_ms": 1e3 * fwd[0], "vjp_ms": 1e3 * vjp[0], "ratio_median": vjp[0] / fwd[0],
            "ratio_min": vjp[1] / fwd[1], "target": 1.5}


def _kernel_args(kernel: str, dtype: str, n=12, t=128, d=64):
    rng = np.random.default_rng(0)
    rand = lambda *s: rng.standard_normal(s).astype(dtype)  # noqa: E731
    if kernel in ("attention_score_grad", "attention_advantage"):
        p = np.empty((n, t, t), dtype)
        backends.resolve("softmax", "numpy")(3.0 * rand(n, t, t), 0, p)
        outs = [np.zeros_like(p) for _ in range(2 if kernel == "attention_advantage" else 1)]
        args = [p, rand(n, t, d), rand(n, t, d), 0, *outs]
        # read p (the visible half), u, v; write the gradient (and the advantage) whole
        nbytes = p.itemsize * (n * t * (t + 1) // 2 + 2 * n * t * d + len(outs) * n * t * t)
        return args, nbytes
    q, k, v = rand(n, t, d), rand(n, t, d), rand(n, t, d)
    scale = 1.0 / np.sqrt(d)
    lse, ent = np.zeros((n, t)), np.zeros((n, t))
    out = np.zeros((n, t, d), dtype)
    backends.resolve("attention_forward", "numpy")(q, k, v, 0, scale, out, lse, ent)
    args = [q, k, v, out, rand(n, t, d), lse, 0, scale, np.zeros_like(q), np.zeros_like(k), np.zeros_like(v), ent]
    nbytes = q.itemsize * 8 * n * t * d + 8 * 2 * n * t  # q k v o d_o in, dq dk dv out; lse in, spread out
    return args, nbytes


def _flops(kernel: str, n=12, t=128, d=64) -> float:
    """Multiply-adds x 2 of the products on the visible half (causal), all 128 x 128 x 64:
    b = u v^T for the score gradient; s, dp, dv, dq, dk for the backward pass (5 products)."""
    pairs = n * t * (t + 1) / 2
    return 2 * d * pairs * (1 if kernel != "attention_backward" else 5)


def backward_kernels(repeat: int) -> list[dict]:
    rows = []
    for dtype in ("float32", "float64"):
        for kernel in ("attention_score_grad", "attention_advantage", "attention_backward"):
            args, nbytes = _kernel_args(kernel, dtype)
            bw = copy_bandwidth(max(nbytes // 2, 1 << 16))
            row = {"kernel": kernel, "dtype": dtype, "bytes": nbytes, "copy_GBps": bw / 1e9,
                   "limit_ms": 1e3 * nbytes / bw}
            for be in ("numpy", "numba", "cpp"):
                if not backends.provides(kernel, be):
                    continue
                fn = backends.resolve(kernel, be)
                row[f"{be}_ms"] = 1e3 * _times(lambda: fn(*args), repeat if be != "numpy" else max(5, repeat // 3))[0]
            # the C++ register-blocked kernels (the path without BLAS), for comparison
            _core.attention_force_fallback(True)
            try:
                fn = backends.resolve(kernel, "cpp")
                row["cpp_fallback_ms"] = 1e3 * _times(lambda: fn(*args), repeat)[0]
            finally:
                _core.attention_force_fallback(False)
            row["flops"] = _flops(kernel)
            row["cpp_GFLOPs"] = row["flops"] / row["cpp_ms"] / 1e6
            row["cpp_speedup_over_numpy"] = row["numpy_ms"] / row["cpp_ms"]
            row["cpp_over_limit"] = row["cpp_ms"] / row["limit_ms"]
            rows.append(row)
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None, help="pyengine.set_num_threads (default: all cores)")
    ap.add_argument("--skip-k64", action="store_true", help="only K = 8 for the block VJP (K = 64 needs ~1 GiB)")
    ap.add_argument("--kernels-only", action="store_true", help="only the attention backward kernels")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        pe.set_num_threads(args.threads)
    out = {"block_vjp": [], "backward_kernels": backward_kernels(args.repeat)}
    for r in out["backward_kernels"]:
        print(f"{r['kernel']:>21} {r['dtype']}: numpy {r['numpy_ms']:8.3f} ms, numba {r.get('numba_ms', float('nan')):7.3f}"
              f" ms, cpp {r['cpp_ms']:7.3f} ms = {r['cpp_speedup_over_numpy']:5.1f}x numpy (target >= 10x; without BLAS "
              f"{r['cpp_fallback_ms']:.3f} ms), {r['cpp_GFLOPs']:.0f} GFLOP/s on the visible half; "
              f"bytes-moved limit {r['limit_ms']:.3f} ms ({r['copy_GBps']:.1f} GB/s): cpp {r['cpp_over_limit']:.2f}x it")
    for k in (() if args.kernels_only else (8,) if args.skip_k64 else (8, 64)):
        r = block_vjp_ratio(k, max(5, args.repeat // 3))
        out["block_vjp"].append(r)
        print(f"block_vjp K={k}: {r['vjp_ms']:.1f} ms vs block_forward {r['forward_ms']:.1f} ms: "
              f"ratio {r['ratio_median']:.2f} (median; {r['ratio_min']:.2f} of minima; target <= 1.5)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
