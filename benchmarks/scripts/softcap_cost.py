"""What soft-capped attention scores (Gemma 2's ``attn_softcap``) cost, in one process; for a quiet machine.

    python benchmarks/scripts/softcap_cost.py [--tokens 128] [--batch 8] [--tangents 8] [--rounds 15]

A soft-capped stack computes its attention heads by the batched products (the compiled and fused
heads do not cap) and its float32 JVP by the per-head GEMM path (not the compiled
``linear_attention_jvp``). Prints, for Gemma-2-like blocks at GPT-2-small width (d = 768, 12
heads, d_mlp = 3072, RMSNorm, peri norms, rotary, GeGLU, float32, 4 blocks): the median seconds
of a forward of ``--batch`` sequences and of a block JVP with ``--tangents`` tangents, with the
cap (50) and without it (the same weights), the calls alternated, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

import pyengine as pe
from pyengine.bench import time_alternated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tangents", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    T = args.tokens
    cfg = pe.StackConfig(d_model=768, n_heads=12, d_mlp=3072, n_layers=4, norm="rmsnorm", placement="peri",
                         activation="gelu_tanh_gated", positions="rotary", bias=False, max_seq_len=T,
                         attn_softcap=50.0)
    capped = pe.init_weights(cfg, "gpt2", seed=0, dtype=np.float32)
    plain = capped.replace(attn_softcap=0.0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, T, 768)).astype(np.float32)
    h = x[0]
    dh = rng.standard_normal((args.tangents, T, 768)).astype(np.float32)
    caches = {name: s.block_forward(1, h, return_cache=True)[1] for name, s in (("capped", capped), ("plain", plain))}
    rows = {
        "forward": {name: (lambda s=s: s.hidden_states(x)) for name, s in (("capped", capped), ("plain", plain))},
        "block JVP": {name: (lambda s=s, c=caches[name]: s.block_jvp(1, h, dh, cache=c))
                      for name, s in (("capped", capped), ("plain", plain))},
    }
    print(f"T = {T}, batch {args.batch}, {args.tangents} tangents, float32, d = 768, medians of {args.rounds}")
    for what, calls in rows.items():
        t = {k: statistics.median(v) for k, v in time_alternated(calls, args.rounds).items()}
        print(f"{what:10s} capped {t['capped'] * 1e3:8.2f} ms  plain {t['plain'] * 1e3:8.2f} ms  "
              f"capped/plain = {t['capped'] / t['plain']:.2f}")


if __name__ == "__main__":
    main()
