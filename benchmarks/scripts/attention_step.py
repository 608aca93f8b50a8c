"""Attention speed: a training step against PyTorch autograd, the backward kernels, the block VJP.

    python benchmarks/scripts/attention_step.py step [--threads 2] [--repeat 50] [--T 2000]
    python benchmarks/scripts/attention_step.py kernels [--repeat 30] [--threads N]
    python benchmarks/scripts/attention_step.py block-vjp [--repeat 30] [--skip-k64]
    python benchmarks/scripts/attention_step.py dtype
    python benchmarks/scripts/attention_step.py all [--json out.json]

``step``: one full-batch training step of the attention-dynamics experiment's single-head
model (T = 2000, d_in = 20, d_k = 10, d_v = 15, 8 symbols, causal, mean cross-entropy,
float32) on the same data and weights: the forward pass, the loss and the gradients of all
four matrices (no optimiser update: 4 tiny axpys on both sides). It checks that both compute
the same loss and gradients (float32 tolerances), then prints the median ms per step of
torch autograd (explicit masked softmax), torch with scaled_dot_product_attention, and
``Model.step`` on each compiled backend (with the median ms of its two fused kernel calls
alone), and the ratios torch / pyengine (target >= 8x). PyTorch is a test extra.

``kernels``: the attention backward kernels (``attention_score_grad``,
``attention_advantage``, ``attention_backward``) on (12 heads, 128, 128), head width 64,
causal, float32 and float64: C++ against the NumPy reference (target >= 10x), the C++
register-blocked path without BLAS, and each against its bytes-moved limit (the bytes it must
read and write over the all-core copy bandwidth measured here for a buffer of the same size;
target within 1.5x where the kernel is memory-bound; the fused backward is compute-bound and
its limit is reported for completeness only).

``block-vjp``: ``Stack.block_vjp`` of K cotangents at one sequence against ``block_forward``
of K sequences, one GPT-2-small block (T = 128, float32), K = 8 and 64: target ratio <= 1.5.

``dtype``: the fused attention kernels at T = 2000 (dk 10, dv 15, one head), Numba and C++,
float32 and float64, on 1 and 2 threads (medians of 5).

Every figure is a median (and a minimum where shown) of repeated calls after a warm-up call.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math

import numpy as np
from _common import gpt2_small, median_s, samples_s, use_suites
from threadpoolctl import threadpool_limits

import pyengine as pe
from pyengine import backends
from pyengine.bench import copy_bandwidth

ad = importlib.import_module("pyengine.experiments.attention_dynamics")
#: heads x Tq x Tk x head width of the ``kernels`` part and of the ``dtype`` part (asv's shapes).
KERNEL_SHAPE, DTYPE_SHAPE = "12x128x128x64", "1x2000x2000x10"


def _arrays(kernel: str, dtype: str, shape: str) -> list:
    use_suites()
    from benchmarks.bench_attention import _arrays as arrays

    return arrays(kernel, dtype, shape)


# -- step ------------------------------------------------------------------------------------


def parts_ms(m, W, repeat: int) -> dict[str, float]:
    """Median ms of the step's two fused kernel calls alone, on the step's own shapes; the rest is NumPy.

    ``Model.step`` attends over the values seen through W_O, X W_V W_O (T x 8).
    """
    Q, K, V, O = m.attend(W, V=(m.X @ W["W_V"]) @ W["W_O"])
    o = np.empty_like(O)[None]
    d_o = np.random.default_rng(1).standard_normal(o.shape).astype(O.dtype) * 1e-3
    dq, dk, dv = np.empty_like(Q), np.empty_like(K), np.empty_like(V)
    return {"forward_kernel": 1e3 * median_s(lambda: m.fwd(Q, K, V, 0, m.scale, o, m.lse, m.ent), repeat),
            "backward_kernel": 1e3 * median_s(lambda: m.bwd(Q, K, V, O[None], d_o, m.lse, 0, m.scale, dq, dk, dv,
                                                            m.spread), repeat)}


def torch_step(X, y, W, sdpa: bool):
    import torch
    import torch.nn.functional as F

    Xt, yt = torch.from_numpy(X), torch.from_numpy(y.astype(np.int64))
    P = {k: torch.from_numpy(v.copy()).requires_grad_(True) for k, v in W.items()}
    T = X.shape[0]
    mask = torch.triu(torch.full((T, T), float("-inf"), dtype=Xt.dtype), diagonal=1)
    scale = 1.0 / math.sqrt(ad.D_K)

    def step():
        for p in P.values():
            p.grad = None
        q, k, v = Xt @ P["W_Q"], Xt @ P["W_K"], Xt @ P["W_V"]
        if sdpa:
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)[0]
        else:
            o = torch.softmax(q @ k.T * scale + mask, dim=-1) @ v
        loss = F.cross_entropy(o @ P["W_O"], yt)
        loss.backward()
        return float(loss.detach()), {n: p.grad.numpy() for n, p in P.items()}

    return step


def step(args: argparse.Namespace) -> dict:
    P = ad.markov_chain()
    mu = np.random.default_rng(0).standard_normal((8, ad.D_IN))
    rng = np.random.default_rng(args.seed)
    X, y = ad.make_data(P, args.T, mu, rng)
    X = X.astype(np.float32)
    W = ad.init_params(rng, 8, "float32")
    out: dict = {"T": args.T, "threads": args.threads, "repeat": args.repeat, "ms": {}, "parts_ms": {}}
    ref = None
    for be in ("cpp", "numba"):
        try:
            m = ad.Model(X, y, 8, be)
        except Exception as e:  # a backend not built here
            print(f"pyengine {be}: unavailable ({e})")
            continue
        with threadpool_limits(1):  # as the experiment runs it: the GEMMs are tiny
            metrics, grads, _ = m.step(W)
            ref = ref or (metrics["loss"], grads)
            out["ms"][f"pyengine_{be}"] = 1e3 * median_s(lambda: m.step(W), args.repeat)
            out["parts_ms"][be] = parts_ms(m, W, args.repeat)
    try:
        import torch
    except ImportError:
        print("torch not installed: pip install torch==2.13.0 (the test extra has it)")
        torch = None
    if torch is not None:
        torch.set_num_threads(args.threads)
        out["torch_version"] = torch.__version__
        for name, sdpa in (("torch_autograd", False), ("torch_sdpa", True)):
            fn = torch_step(X, y, W, sdpa)
            loss, g = fn()
            if ref is not None:
                assert abs(loss - ref[0]) < 1e-4 * max(1.0, abs(loss)), (name, loss, ref[0])
                for n in g:
                    err = np.abs(g[n] - ref[1][n]).max() / max(np.abs(g[n]).max(), 1e-30)
                    assert err < 1e-3, (name, n, err)
            out["ms"][name] = 1e3 * median_s(fn, args.repeat)
    for k, v in out["ms"].items():
        print(f"{k:>18}: {v:8.2f} ms/step")
    for be, parts in out["parts_ms"].items():
        rest = out["ms"][f"pyengine_{be}"] - sum(parts.values())
        print(f"{'':>18}  pyengine_{be}: forward kernel {parts['forward_kernel']:.2f} ms, backward kernel "
              f"{parts['backward_kernel']:.2f} ms, rest (NumPy: projections, loss head, weight gradients) "
              f"{rest:.2f} ms")
    best = min((v for k, v in out["ms"].items() if k.startswith("pyengine")), default=None)
    if best and "torch_autograd" in out["ms"]:
        out["ratio_torch_autograd_over_pyengine"] = out["ms"]["torch_autograd"] / best
        out["ratio_torch_sdpa_over_pyengine"] = out["ms"]["torch_sdpa"] / best
        print(f"torch autograd / pyengine = {out['ratio_torch_autograd_over_pyengine']:.1f}x "
              f"(target >= 8x); torch sdpa / pyengine = {out['ratio_torch_sdpa_over_pyengine']:.1f}x")
    return out


# -- kernels ---------------------------------------------------------------------------------


def _bytes_and_flops(kernel: str, itemsize: int, n=12, t=128, d=64) -> tuple[int, float]:
    """Bytes a kernel must move (read p's visible half, u, v and write the outputs; or q k v o d_o
    in, dq dk dv out, lse in and the spread out) and its flops on the visible half (causal):
    b = u v^T for the score gradient; s, dp, dv, dq, dk (5 products) for the backward pass."""
    pairs = n * t * (t + 1) / 2
    if kernel == "attention_backward":
        return itemsize * 8 * n * t * d + 8 * 2 * n * t, 2 * d * pairs * 5
    outs = 2 if kernel == "attention_advantage" else 1
    return itemsize * (n * t * (t + 1) // 2 + 2 * n * t * d + outs * n * t * t), 2 * d * pairs


def kernels(args: argparse.Namespace) -> list[dict]:
    from pyengine import _core

    rows = []
    for dtype in ("float32", "float64"):
        for kernel in ("attention_score_grad", "attention_advantage", "attention_backward"):
            a = _arrays(kernel, dtype, KERNEL_SHAPE)
            nbytes, flops = _bytes_and_flops(kernel, np.dtype(dtype).itemsize)
            bw = copy_bandwidth(max(nbytes // 2, 1 << 16))
            row = {"kernel": kernel, "dtype": dtype, "bytes": nbytes, "copy_GBps": bw / 1e9,
                   "limit_ms": 1e3 * nbytes / bw, "flops": flops}
            for be in ("numpy", "numba", "cpp"):
                if backends.provides(kernel, be):
                    fn = backends.resolve(kernel, be)
                    reps = args.repeat if be != "numpy" else max(5, args.repeat // 3)
                    row[f"{be}_ms"] = 1e3 * median_s(lambda: fn(*a), reps)
            _core.attention_force_fallback(True)  # the C++ register-blocked kernels (no BLAS), for comparison
            try:
                fn = backends.resolve(kernel, "cpp")
                row["cpp_fallback_ms"] = 1e3 * median_s(lambda: fn(*a), args.repeat)
            finally:
                _core.attention_force_fallback(False)
            row["cpp_GFLOPs"] = flops / row["cpp_ms"] / 1e6
            row["cpp_speedup_over_numpy"] = row["numpy_ms"] / row["cpp_ms"]
            row["cpp_over_limit"] = row["cpp_ms"] / row["limit_ms"]
            rows.append(row)
            r = row
            print(f"{kernel:>21} {dtype}: numpy {r['numpy_ms']:8.3f} ms, numba {r.get('numba_ms', float('nan')):7.3f}"
                  f" ms, cpp {r['cpp_ms']:7.3f} ms = {r['cpp_speedup_over_numpy']:5.1f}x numpy (target >= 10x; "
                  f"without BLAS {r['cpp_fallback_ms']:.3f} ms), {r['cpp_GFLOPs']:.0f} GFLOP/s on the visible half; "
                  f"bytes-moved limit {r['limit_ms']:.3f} ms ({r['copy_GBps']:.1f} GB/s): cpp "
                  f"{r['cpp_over_limit']:.2f}x it", flush=True)
    return rows


# -- block-vjp -------------------------------------------------------------------------------


def block_vjp(args: argparse.Namespace) -> list[dict]:
    st = gpt2_small(layers=1, tokens=128, vocab=0)
    rows = []
    for k in (8,) if args.skip_k64 else (8, 64):
        rng = np.random.default_rng(3)
        hb = rng.standard_normal((k, 128, 768), dtype=np.float32)
        h = hb[0].copy()
        g = rng.standard_normal((k, 128, 768), dtype=np.float32)
        _, cache = st.block_forward(0, h, return_cache=True)
        repeat = max(5, args.repeat // 3)
        fwd = samples_s(lambda: st.block_forward(0, hb), repeat)
        vjp = samples_s(lambda: st.block_vjp(0, h, g, cache=cache), repeat)
        r = {"K": k, "forward_ms": 1e3 * np.median(fwd), "vjp_ms": 1e3 * np.median(vjp),
             "ratio_median": np.median(vjp) / np.median(fwd), "ratio_min": vjp.min() / fwd.min(), "target": 1.5}
        rows.append(r)
        print(f"block_vjp K={k}: {r['vjp_ms']:.1f} ms vs block_forward {r['forward_ms']:.1f} ms: "
              f"ratio {r['ratio_median']:.2f} (median; {r['ratio_min']:.2f} of minima; target <= 1.5)", flush=True)
    return rows


# -- dtype -----------------------------------------------------------------------------------


def dtype(args: argparse.Namespace) -> list[dict]:
    rows = []
    for threads in (1, 2):
        with pe.num_threads(threads):
            for dt in ("float32", "float64"):
                fa = _arrays("attention_forward", dt, DTYPE_SHAPE)
                ba = _arrays("attention_backward", dt, DTYPE_SHAPE)
                for be in ("numba", "cpp"):
                    fw, bw = backends.resolve("attention_forward", be), backends.resolve("attention_backward", be)
                    tf, tb = 1e3 * median_s(lambda: fw(*fa), 5), 1e3 * median_s(lambda: bw(*ba), 5)
                    rows.append({"threads": threads, "dtype": dt, "backend": be, "forward_ms": tf, "backward_ms": tb})
                    print(f"threads {threads} {dt} {be}: fwd {tf:.1f} ms bwd {tb:.1f} ms", flush=True)
    return rows


PARTS = {"step": step, "kernels": kernels, "block-vjp": block_vjp, "dtype": dtype}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", nargs="?", default="step", choices=[*PARTS, "all"])
    ap.add_argument("--threads", type=int, default=None,
                    help="step: torch's thread count (default 2); other parts: pyengine.set_num_threads")
    ap.add_argument("--repeat", type=int, default=None, help="calls timed per figure (default: step 50, else 30)")
    ap.add_argument("--T", type=int, default=2000, help="step: sequence length")
    ap.add_argument("--seed", type=int, default=42, help="step: data and weights seed")
    ap.add_argument("--skip-k64", action="store_true", help="block-vjp: only K = 8 (K = 64 needs ~1 GiB)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    out = {}
    for name in PARTS if args.part == "all" else [args.part]:
        part = argparse.Namespace(**vars(args))
        if name == "step":
            part.threads = 2 if args.threads is None else args.threads
        elif args.threads:
            pe.set_num_threads(args.threads)
        part.repeat = args.repeat or (50 if name == "step" else 30)
        out[name] = PARTS[name](part)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=float)
    return out


if __name__ == "__main__":
    main()
