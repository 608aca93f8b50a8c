"""Numba/C++ time ratio of the six norm kernels at (8192, 4096) float32 with out=, interleaved call by call
(issue 18: the target is <= 1.5). Run on a quiet machine: python benchmarks/numba_vs_cpp_norms.py"""
import numpy as np
from pyengine.backends import resolve
from pyengine.bench import time_alternated
rng = np.random.default_rng(0)
n, d = 8192, 4096
x = (1 + rng.standard_normal((n, d))).astype(np.float32); v = rng.standard_normal((n, d)).astype(np.float32)
g = rng.uniform(0.5, 1.5, d).astype(np.float32); b = rng.standard_normal(d).astype(np.float32)
o1, o2 = np.empty_like(x), np.empty_like(x)
args = {"layer_norm": (x, g, b, 1e-5), "layer_norm_jvp": (x, v, g, 1e-5, False), "layer_norm_vjp": (x, v, g, 1e-5, False),
        "rms_norm": (x, g, 1e-5), "rms_norm_jvp": (x, v, g, 1e-5, False), "rms_norm_vjp": (x, v, g, 1e-5, False)}
for k, a in args.items():
    nb, cp = resolve(k, "numba"), resolve(k, "cpp")
    ts = time_alternated({"numba": lambda: nb(*a, o1), "cpp": lambda: cp(*a, o2)}, 15)
    tn, tc = ts["numba"], ts["cpp"]
    mn, mc = np.median(tn), np.median(tc)
    print(f"{k:16s} numba {mn*1e3:6.2f} ms  cpp {mc*1e3:6.2f} ms  numba/cpp = {mn/mc:.2f} (minima {min(tn)/min(tc):.2f})", flush=True)
