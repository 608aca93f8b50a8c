"""Side by side: pyengine.propagate injected at a hidden state against a site inside the same block.

    python benchmarks/scripts/propagate_sites.py [--repeats 5] [--d 256] [--layers 6] [--T 64] [--K 8]

Prints the median wall time (s) of exact and linearized propagation at hidden state 2
(``layer=2``), at ``blocks.2.resid_mid`` and at ``blocks.2.mlp.hidden``, on a seeded
GPT-2-shaped float32 stack, injected on the last 8 tokens. The site runs do the same
blocks after block 2, plus block 2 from the site on and one extra pass for the site's
baseline value, so they should cost about as much as the index run.
"""

import argparse

import numpy as np
from _common import median_s

import pyengine as pe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--K", type=int, default=8)
    a = ap.parse_args()
    cfg = pe.StackConfig(d_model=a.d, n_heads=max(1, a.d // 64), n_layers=a.layers, d_mlp=4 * a.d, vocab_size=256,
                         max_seq_len=max(a.T, 16), positions="learned")
    st = pe.init_weights(cfg, scheme="gpt2", seed=0)
    ids = np.random.default_rng(0).integers(0, 256, a.T)
    rng = np.random.default_rng(1)
    cases = [("hidden state 2", 2, a.d), ("blocks.2.resid_mid", "blocks.2.resid_mid", a.d),
             ("blocks.2.mlp.hidden", "blocks.2.mlp.hidden", 4 * a.d)]
    print(f"d={a.d} layers={a.layers} T={a.T} K={a.K} S=2, float32, median of {a.repeats}")
    for label, where, w in cases:
        V = rng.standard_normal((a.K, w))
        for lin in (False, True):
            t = median_s(lambda: pe.propagate(st, ids, V, [1.0, 4.0], where, slice(-8, None), linearized=lin),
                         a.repeats)
            print(f"  {label:<22} {'linearized' if lin else 'exact':<10} {t:.4f} s")


if __name__ == "__main__":
    main()
