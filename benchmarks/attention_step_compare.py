"""One full-batch training step of issue 11's single-head model: pyengine against PyTorch autograd.

T = 2000 tokens, d_in = 20, d_k = 10, d_v = 15, 8 symbols, causal, mean cross-entropy,
float32 (pyengine's experiment default) on the same data and weights. A step is the
forward pass, the loss and the gradients of all four matrices (no optimiser update:
the update is 4 tiny axpys on both sides). PyTorch is a test extra; run

    python benchmarks/attention_step_compare.py [--threads 2] [--repeat 50] [--T 2000]

It checks that both compute the same loss and gradients (float32 tolerances), then
prints the median ms per step of: torch autograd (explicit masked softmax, as the
paper's public script), torch with scaled_dot_product_attention, and pyengine's
``Model.step`` on each compiled backend (with the median ms of its two fused kernel
calls alone), and the ratios torch / pyengine.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import time

import numpy as np
from threadpoolctl import threadpool_limits

ad = importlib.import_module("pyengine.experiments.attention_dynamics")


def median_ms(fn, repeat: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts))


def parts_ms(m, W, repeat: int) -> dict[str, float]:
    """Median ms of the step's two fused kernel calls alone, on the step's own shapes; the rest is NumPy.

    ``Model.step`` attends over the values seen through W_O, X W_V W_O (T x 8).
    """
    Q, K, V, O = m.attend(W, V=(m.X @ W["W_V"]) @ W["W_O"])
    o = np.empty_like(O)[None]
    d_o = np.random.default_rng(1).standard_normal(o.shape).astype(O.dtype) * 1e-3
    dq, dk, dv = np.empty_like(Q), np.empty_like(K), np.empty_like(V)
    return {"forward_kernel": median_ms(lambda: m.fwd(Q, K, V, 0, m.scale, o, m.lse, m.ent), repeat),
            "backward_kernel": median_ms(lambda: m.bwd(Q, K, V, O[None], d_o, m.lse, 0, m.scale, dq, dk, dv,
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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--T", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args(argv)
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
            out["ms"][f"pyengine_{be}"] = median_ms(lambda: m.step(W), args.repeat)
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
            out["ms"][name] = median_ms(fn, args.repeat)
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
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
