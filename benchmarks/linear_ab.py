"""Same-process A/B of the linear kernels (issue 18): OpenBLAS per tile in pyengine's threads vs the
forced numpy.matmul fallback (NumPy's BLAS threads + a separate epilogue pass), interleaved rounds.

One GPT-2-small block, K tangents / K+1 sequences of T = 128, float32, and the MLP's first product alone.
Usage: python benchmarks/linear_ab.py [K] [ROUNDS]
"""
import sys, time
import numpy as np
import pyengine as pe
from pyengine import _core

K = int(sys.argv[1]) if len(sys.argv) > 1 else 32
R = int(sys.argv[2]) if len(sys.argv) > 2 else 5
T = 128
cfg = pe.StackConfig(d_model=768, n_heads=12, d_mlp=3072, n_layers=2, vocab_size=256,
                     activation="gelu_tanh", positions="learned", max_seq_len=T)
stack = pe.init_weights(cfg, "gpt2", seed=0, dtype=np.float32, bias_std=0.02)
rng = np.random.default_rng(0)
h1 = stack.hidden_states(rng.integers(0, 256, T))[1]
hb = (h1[None] + 0.1 * rng.standard_normal((K + 1, T, 768))).astype(np.float32)
tang = rng.standard_normal((K, T, 768)).astype(np.float32)
_, cache = stack.block_forward(1, h1, return_cache=True)
fw = lambda: stack.block_forward(1, hb)
jv = lambda: stack.block_jvp(1, h1, tang, cache=cache)
ref_f, ref_j = fw(), jv()
res = {(m, w): [] for m in ("linear", "fallback") for w in ("forward", "jvp")}
for _ in range(R):
    for mode in ("linear", "fallback"):
        _core.linear_force_fallback(mode == "fallback")
        for what, f in (("forward", fw), ("jvp", jv)):
            t = time.perf_counter(); f(); res[mode, what].append(time.perf_counter() - t)
_core.linear_force_fallback(False)
for (m, w), ts in res.items():
    print(f"{m:<9} {w:<8} min {1e3*min(ts)/K:7.2f}  median {1e3*np.median(ts)/K:7.2f} ms per sequence/tangent")
x = rng.standard_normal(((K + 1) * T, 768)).astype(np.float32)
w, b = stack.weights["blocks.1.mlp.w_in"], stack.weights["blocks.1.mlp.b_in"]
out = np.empty((x.shape[0], w.shape[1]), np.float32)
t_kernel, t_numpy = [], []
for _ in range(R):
    t = time.perf_counter(); _core.linear_act(x, w, b, "gelu_tanh", None, out); t_kernel.append(time.perf_counter() - t)
    t = time.perf_counter(); u = x @ w; u += b; _core.gelu_tanh(u, out); t_numpy.append(time.perf_counter() - t)
print(f"MLP product {x.shape} @ {w.shape} + bias + gelu_tanh: linear_act median {1e3*np.median(t_kernel):.1f} ms, "
      f"numpy matmul + bias + gelu_tanh {1e3*np.median(t_numpy):.1f} ms")
