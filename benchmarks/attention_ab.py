"""Interleaved same-process A/B of issue 18's propagate jobs: the linear_attention kernels on/off.

    python benchmarks/attention_ab.py LAYERS REPEATS     (e.g. 12 5 on a quiet machine)

K = 64, T = 128, GPT-2-small blocks, float32; medians per sequence (exact) or tangent
(linearized), scaled to 12 layers; "before": the streaming attention_forward head and the
numpy.matmul attention JVP (models/_fast.py without linear_attention_forward / _jvp).
"""
import sys, time
import numpy as np
import pyengine as pe
from pyengine.models import _fast
L = int(sys.argv[1]); R = int(sys.argv[2])
K, T = 64, 128
cfg = pe.StackConfig(d_model=768, n_heads=12, d_mlp=3072, n_layers=L, vocab_size=256,
                     activation="gelu_tanh", positions="learned", max_seq_len=T)
stack = pe.init_weights(cfg, "gpt2", seed=0, dtype=np.float32, bias_std=0.02)
rng = np.random.default_rng(0)
ids = rng.integers(0, 256, T)
V = rng.standard_normal((K, 768))
fw, jv = _fast.attention_forward_kernel, _fast.attention_jvp_kernel
def on(): _fast.attention_forward_kernel, _fast.attention_jvp_kernel = fw, jv
def off(): _fast.attention_forward_kernel = _fast.attention_jvp_kernel = lambda: None
jobs = {"exact all": (lambda: pe.propagate(stack, ids, V, 6.0, 0, "all"), K + 1),
        "exact span": (lambda: pe.propagate(stack, ids, V, 6.0, 0, slice(T // 2, None)), K + 1),
        "linearized": (lambda: pe.propagate(stack, ids, V, 6.0, 0, "all", linearized=True), K)}
res = {}
for f, _ in jobs.values(): f()
for _ in range(R):
    for job, (f, per) in jobs.items():
        for name, sw in (("kernels", on), ("before", off)):
            sw(); t = time.perf_counter(); f(); res.setdefault((job, name), []).append((time.perf_counter() - t) / per)
for job in jobs:
    a, b = np.median(res[job, "kernels"]), np.median(res[job, "before"])
    print(f"{job:<11} kernels {1e3*a*12/L:6.1f}  before {1e3*b*12/L:6.1f} ms/seq-or-tangent (x 12/{L})  before/kernels {b/a:.2f}")
