"""Per-call cost of small kernel calls, in one process; for a quiet machine.

    python benchmarks/scripts/small_calls.py [--no-lanczos]

Prints: per-call time of each public kernel on one d=768 float32 token (min of 7 means
of 2000 calls); the Numba/C++ ratio of every row of the asv suite
``bench_small_calls.NumbaVsCpp`` (the norm kernels at (8192, d), their sigma_max at (256, d),
d = 768 and 4096, the attention softmax and its JVP; float32, out=, medians of 30 alternated
calls; measured before torch is imported); pe.layer_norm against torch F.layer_norm at
(2048, 768) float32, both allocating (median of 300 alternated calls; then with one thread
each), when torch is installed; Lanczos ms/token over 256 tokens at d = 768 for the fused
kernels (cpp, numba; median of 3) and the generic solver (numpy, once; it takes minutes).
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from _common import median_s, use_suites

import pyengine as pe
from pyengine.bench import time_alternated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-lanczos", action="store_true", help="skip the Lanczos rows (the numpy solver takes minutes)")
    args = ap.parse_args()
    use_suites()
    from benchmarks import bench_small_calls as b

    s = b.SmallCall()
    for k in b.SmallCall.params[0]:
        s.setup(k)
        print(f"one token d=768 {k:16s} {s.track_us_per_call(k):6.2f} us/call")
    # The Numba/C++ rows before torch is imported: after it, the first of them read up to
    # 1.5x higher than in a process of its own.
    n = b.NumbaVsCpp()
    for k in b.NumbaVsCpp.params[0]:
        for d in b.NumbaVsCpp.params[1]:
            try:
                n.setup(k, d)
            except NotImplementedError:  # the asv suite's skip: a kernel without this d
                continue
            shape = "(768, 128, 128)" if k.startswith("softmax") else f"({256 if 'sigma' in k else 8192}, {d})"
            print(f"{shape:16s} f32 out= {k:22s} numba/cpp = {n.track_ratio(k, d):.2f}")
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("torch not installed: layer_norm vs torch skipped")
    else:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((2048, 768)).astype(np.float32)
        g = rng.uniform(0.5, 1.5, 768).astype(np.float32)
        bb = rng.standard_normal(768).astype(np.float32)
        tx, tg, tb = (torch.from_numpy(a) for a in (x, g, bb))
        calls = {"pe.layer_norm": lambda: pe.layer_norm(x, g, bb),
                 "F.layer_norm": lambda: F.layer_norm(tx, (768,), tg, tb)}
        ts = time_alternated(calls, 300)
        med = {k: statistics.median(v) for k, v in ts.items()}
        print(f"(2048, 768) f32 pe {med['pe.layer_norm'] * 1e3:.3f} ms, torch "
              f"{med['F.layer_norm'] * 1e3:.3f} ms, torch/pe = {med['F.layer_norm'] / med['pe.layer_norm']:.2f}")
        # The same with one thread each (the per-core speed of the two kernels), medians
        # and minima of 300 interleaved calls.
        nt = torch.get_num_threads()
        torch.set_num_threads(1)
        with pe.num_threads(1):
            ts = time_alternated(calls, 300)
        torch.set_num_threads(nt)
        med = {k: statistics.median(v) for k, v in ts.items()}
        mn = {k: min(v) for k, v in ts.items()}
        print(f"(2048, 768) f32, 1 thread each: pe {med['pe.layer_norm'] * 1e3:.3f} ms, torch "
              f"{med['F.layer_norm'] * 1e3:.3f} ms, torch/pe = {med['F.layer_norm'] / med['pe.layer_norm']:.2f} "
              f"(minima: {mn['F.layer_norm'] / mn['pe.layer_norm']:.2f})")
    if args.no_lanczos:
        return
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 768)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, 768).astype(np.float32)
    # The fused per-token Lanczos kernels (C++, Numba) and the generic batched solver
    # (backend="numpy"), 256 tokens at d = 768, default threads; median of 3 (1 for numpy).
    for be, reps in (("cpp", 3), ("numba", 3), ("numpy", 1)):
        out = {}

        def call(be=be):
            out["r"] = pe.layer_norm_spectral_norm(x, g, method="lanczos", backend=be)

        t = median_s(call, reps)
        r = out["r"]
        print(f"lanczos LN Jacobian d=768, 256 tokens, {be:5s}: {t / 256 * 1e3:.2f} ms/token "
              f"(median {int(np.median(r.iterations))} products, all converged: {bool(r.converged.all())})")


if __name__ == "__main__":
    main()
