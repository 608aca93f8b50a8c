"""pyengine propagation against PyTorch, in one process.

K = 64 perturbations x T = 128 tokens x 12 GPT-2-small blocks (d = 768, 12 heads,
d_mlp = 3072), float32, injected at hidden state 0. PyTorch is not a pyengine
dependency: run this where it is installed, e.g.

    python3 -m venv --system-site-packages /tmp/venv-torch
    /tmp/venv-torch/bin/pip install torch==2.13.0
    /tmp/venv-torch/bin/python benchmarks/scripts/torch_compare.py [--threads 2] [--k 64] [--no-fused] [--no-linear] [--no-attn-blas]

It checks that both compute the same hidden states, then times (ms per sequence or tangent;
median of --repeat calls, or, for the calls behind the target ratios, of --rounds rounds in
which they are called in turn, so that a slow spell of the shared machine falls on both
sides of a ratio):

- torch: a batched exact forward of the K + 1 sequences (scaled_dot_product_attention,
  causal); torch.func vmap(jvp) of the whole stack over K tangents;
- pyengine: propagate exact (all positions, and a span from T/2), linearized, and
  the same matrix products executed alone with NumPy's BLAS as the stack calls it, into
  reused outputs (``gemms_alone``; ``gemms_np_fresh``: plain ``numpy.matmul`` with a fresh
  output each, slower for reasons that are not the stack's, see bench_model.gemms_alone); the
  ratios on the same shapes: the stack forward over its GEMMs, one block's JVP over its forward.

``--precision bf16`` times the bf16 paths instead, alternated: torch's forward of the K + 1
sequences in bf16 (``torch.autocast`` and ``.to(torch.bfloat16)``; the faster is the
comparator) against ``pe.propagate(..., precision="bf16")`` (all positions, and the span from
T/2; each includes its float32 check of one direction) and pyengine's float32 exact run, with
both sides' errors against float32 (targets: torch bf16 / pe bf16 >= 1.0 on all positions,
>= 2 on the span).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from _common import cpu_name, gpt2_small, median_s, use_suites

import pyengine as pe
from pyengine.bench import time_alternated


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--threads", type=int, default=0,
                    help="thread count for both libraries; 0 (default): leave both at their defaults")
    ap.add_argument("--repeat", type=int, default=3, help="calls timed for each figure outside the targets")
    ap.add_argument("--rounds", type=int, default=5,
                    help="alternated rounds of the calls behind the target ratios (torch forward, exact all / "
                         "span, vmap(jvp), linearized, the GEMMs alone): a ratio is the quotient of the two "
                         "sides' medians over the rounds")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--precision", choices=("exact", "bf16"), default="exact",
                    help="bf16: time the bf16 paths of both libraries (see above) instead of the float32 ones")
    ap.add_argument("--no-fused", action="store_true",
                    help="float32 forward through the batched q k^T, softmax, P v products (no fused head)")
    ap.add_argument("--no-linear", action="store_true",
                    help="weight products by numpy.matmul (NumPy's BLAS threads) and a separate epilogue pass, "
                         "instead of single-threaded BLAS per row tile in pyengine's threads")
    ap.add_argument("--no-attn-blas", action="store_true",
                    help="float32 attention heads without the compiled linear_attention_forward / _jvp (the "
                         "streaming attention_forward kernel, and numpy.matmul per key/value head for the JVP)")
    return ap.parse_args(argv)


def main() -> None:
    args = parse()
    import torch

    use_suites()
    from benchmarks.bench_model import gemm_operands, gemms_alone
    from benchmarks.bench_propagate_torch import torch_stack

    if args.no_attn_blas:  # an A/B switch for this script only
        import pyengine.models._fast as _fast

        _fast.attention_jvp_kernel = _fast.attention_forward_kernel = lambda: None
    if args.no_linear:  # an A/B switch for this script only
        from pyengine import _core

        _core.linear_force_fallback(True)
    blas, cpu = pe.kernels.linear.blas_info(), cpu_name()
    print("cpu:", cpu)
    print("linear kernels:", blas)
    if args.no_fused:  # an A/B switch for this script only
        import pyengine.models._fast as _fast

        _fast.fused_dtype = lambda dtype: False
    if args.threads:
        torch.set_num_threads(args.threads)
        pe.set_num_threads(args.threads)
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.threads)

    K, T = args.k, args.tokens
    stack = gpt2_small(args.layers, T)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, T)
    V = rng.standard_normal((K, 768))
    Vn = (V / np.linalg.norm(V, axis=1, keepdims=True)).astype(np.float32)
    h = stack.hidden_states(ids)
    fwd, fwd_math = torch_stack(stack), torch_stack(stack, sdpa=False)
    x0 = torch.from_numpy(h[0].copy())
    batch = torch.cat([x0[None], x0[None] + 6.0 * torch.from_numpy(Vn)[:, None, :]])  # (K + 1, T, d)
    tang = torch.from_numpy(np.repeat(Vn[:, None, :], T, axis=1))  # (K, T, d)

    with torch.inference_mode():
        ref = fwd(batch[:1])[0].numpy()
        ref_math = fwd_math(batch[:1])[0].numpy()
    err = max(float(np.abs(r - h[-1]).max() / np.abs(h[-1]).max()) for r in (ref, ref_math))
    print(f"torch vs pyengine hidden state {args.layers}: max rel diff {err:.2e}")

    def t_forward():
        with torch.inference_mode():
            fwd(batch)

    def t_vmap_jvp():
        f = torch.func.vmap(lambda t: torch.func.jvp(fwd_math, (x0[None],), (t[None],))[1])
        with torch.no_grad():
            f(tang)

    if args.precision == "bf16":
        return bf16_section(args, stack, ids, V, batch, fwd, torch_stack(stack, dtype=torch.bfloat16), ref, blas, cpu)
    ops = gemm_operands(stack, K + 1, T)
    h_batch = batch.numpy()
    h1 = stack.hidden_states(ids)[1]
    tang_np = tang.numpy()
    _, cache = stack.block_forward(1, h1, return_cache=True)
    calls = {
        "pe_forward": (lambda: stack.hidden_states(h_batch), K + 1),
        "pe_block_forward": (lambda: stack.block_forward(1, h_batch[:K]), K),
        "pe_block_jvp": (lambda: stack.block_jvp(1, h1, tang_np, cache=cache), K),
        "torch_forward": (t_forward, K + 1),
        "torch_vmap_jvp": (t_vmap_jvp, K),
        "pe_exact_all": (lambda: pe.propagate(stack, ids, V, 6.0, 0, "all"), K + 1),
        "pe_exact_span": (lambda: pe.propagate(stack, ids, V, 6.0, 0, slice(T // 2, None)), K + 1),
        "pe_linearized": (lambda: pe.propagate(stack, ids, V, 6.0, 0, "all", linearized=True), K),
        "gemms_alone": (gemms_alone(ops), K + 1),  # as the stack runs them, outputs reused
        "gemms_np_fresh": (lambda: [np.matmul(a, b) for a, b in ops], K + 1),  # fresh outputs: see gemms_alone
    }
    # The targets' ratios from calls made in turn (pyengine.bench.time_alternated: a slow
    # spell of the shared machine falls on both sides of a ratio); the rest block by block.
    paired = ["torch_forward", "pe_exact_all", "pe_exact_span", "torch_vmap_jvp", "pe_linearized", "gemms_alone"]
    res, alt = {}, {}
    for name, (call, per) in calls.items():  # printed as measured: a long run shows its progress
        if name in paired:
            continue
        res[name] = median_s(call, args.repeat) / per
        print(f"{name:<16} {1e3 * res[name]:9.1f} ms per sequence/tangent", flush=True)
    times = time_alternated({k: calls[k][0] for k in paired}, args.rounds)
    for name in paired:
        alt[name] = np.asarray(times[name]) / calls[name][1]
        res[name] = float(np.median(alt[name]))
        print(f"{name:<16} {1e3 * res[name]:9.1f} ms per sequence/tangent (alternated, "
              f"{1e3 * alt[name].min():.1f}-{1e3 * alt[name].max():.1f} over {args.rounds} rounds)", flush=True)

    def ratio(num: str, den: str, label: str, target: str) -> None:
        r = alt[num] / alt[den]  # round by round, for the spread
        print(f"{label:<30} {res[num] / res[den]:.2f}  ({target}; rounds {r.min():.2f}-{r.max():.2f})")

    print(f"forward / its GEMMs alone      {res['pe_forward'] / res['gemms_alone']:.2f}  (target <= 1.3)")
    print(f"block JVP / block forward      {res['pe_block_jvp'] / res['pe_block_forward']:.2f}  (target <= 1.5)")
    ratio("pe_exact_all", "gemms_alone", "exact / its GEMMs alone", "target <= 1.1")
    ratio("torch_forward", "pe_exact_all", "torch forward / exact (all)", "target >= 1.15")
    ratio("torch_forward", "pe_exact_span", "torch forward / exact (span)", "target >= 2.5")
    print(f"linearized / exact             {res['pe_linearized'] / res['pe_exact_all']:.2f}  (target <= 1.3)")
    ratio("torch_vmap_jvp", "pe_linearized", "vmap(jvp) / linearized", "target >= 1.6")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cpu": cpu, "blas": blas, "max_rel_diff": err, "seconds": res,
                       "alternated_seconds": {k: v.tolist() for k, v in alt.items()}}, f, indent=1)


def bf16_section(args, stack, ids, V, batch, fwd, fwd_bf16, ref, blas, cpu) -> None:
    """The bf16 figures and target ratios (``--precision bf16``), alternated round by round."""
    import torch

    K, T = args.k, args.tokens
    print("bf16 products:", pe.kernels.linear_bf16.info())
    batch_bf16 = batch.to(torch.bfloat16)

    def t_autocast():
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            return fwd(batch)

    def t_to_bf16():
        with torch.inference_mode():
            return fwd_bf16(batch_bf16)

    for name, f in (("autocast", t_autocast), ("to(bfloat16)", t_to_bf16)):
        out = f()[0].float().numpy()
        print(f"torch bf16 {name}: max rel diff to float32 {np.abs(out - ref).max() / np.abs(ref).max():.2e}")
    runs = {}

    def pe_call(name, positions, precision):
        def call():
            runs[name] = pe.propagate(stack, ids, V, 6.0, 0, positions, precision=precision)
        return call

    calls = {"torch_autocast": t_autocast, "torch_to_bf16": t_to_bf16,
             "pe_bf16_all": pe_call("pe_bf16_all", "all", "bf16"),
             "pe_bf16_span": pe_call("pe_bf16_span", slice(T // 2, None), "bf16"),
             "pe_f32_all": pe_call("pe_f32_all", "all", "exact")}
    times = {k: np.asarray(v) / (K + 1) for k, v in time_alternated(calls, args.rounds).items()}
    med = {k: float(np.median(v)) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:<16} {1e3 * med[k]:9.1f} ms per sequence (alternated, {1e3 * v.min():.1f}-{1e3 * v.max():.1f} "
              f"over {args.rounds} rounds)")
    torch_best = "torch_autocast" if med["torch_autocast"] <= med["torch_to_bf16"] else "torch_to_bf16"
    for pe_name, target in (("pe_bf16_all", 1.0), ("pe_bf16_span", 2.0)):
        r = times[torch_best] / times[pe_name]
        print(f"{torch_best} / {pe_name:<13} {med[torch_best] / med[pe_name]:.2f}  (target >= {target}; rounds "
              f"{r.min():.2f}-{r.max():.2f}); pe rel. error vs float32 {runs[pe_name].precision_error:.2e}")
    print(f"pe float32 / pe bf16 (all)     {med['pe_f32_all'] / med['pe_bf16_all']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cpu": cpu, "blas": blas, "bf16": pe.kernels.linear_bf16.info(),
                       "seconds": med, "alternated_seconds": {k: v.tolist() for k, v in times.items()},
                       "precision_error": {k: runs[k].precision_error for k in ("pe_bf16_all", "pe_bf16_span")}},
                      f, indent=1)


if __name__ == "__main__":
    main()
