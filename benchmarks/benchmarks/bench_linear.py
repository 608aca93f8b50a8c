"""asv suite of the dense-layer kernels, one class per kernel id.

GPT-2-small's MLP product at the exact propagation's size, (65 x 128, 768) @ (768, 3072),
and one sequence (128 rows), float32/float64, with each kernel's epilogue:
``time_*``: the kernel; ``track_gemm_ratio``: the kernel over ``numpy.matmul`` alone on
the same operands (the product without any epilogue; target about 1: the epilogue is
free while the tile is in cache, and no BLAS pool spins next to pyengine's threads).
"""

from __future__ import annotations

import numpy as np

from pyengine import backends

from .common import BACKENDS, KernelBenchmark, median_time

ROWS = [8320, 128]


class _Linear(KernelBenchmark):
    params = (BACKENDS, ["float32", "float64"], ROWS)
    param_names = ["backend", "dtype", "rows"]
    timeout = 300
    kernel = ""

    def make(self, rng, backend, dtype, rows):
        self.x = rng.standard_normal((rows, 768)).astype(dtype)
        self.w = (rng.standard_normal((768, 3072)) / 28).astype(dtype)
        self.b = rng.standard_normal(3072).astype(dtype)
        self.r = rng.standard_normal((rows, 3072)).astype(dtype)
        self.out = np.empty((rows, 3072), dtype)
        self.fn = backends.resolve(self.kernel, backend)
        return self.call

    def call(self):
        raise NotImplementedError

    def track_gemm_ratio(self, backend, dtype, rows):
        return median_time(self.call, 5) / median_time(lambda: np.matmul(self.x, self.w, out=self.out), 5)


class Linear(_Linear):
    kernel = "linear"

    def call(self):
        self.fn(self.x, self.w, self.b, self.r, self.out)

    def time_linear(self, backend, dtype, rows):
        self.call()


class LinearAct(_Linear):
    kernel = "linear_act"

    def call(self):
        self.fn(self.x, self.w, self.b, "gelu_tanh", None, self.out)

    def time_linear_act(self, backend, dtype, rows):
        self.call()


class LinearMul(_Linear):
    kernel = "linear_mul"

    def call(self):
        self.fn(self.x, self.w, self.r, self.out)

    def time_linear_mul(self, backend, dtype, rows):
        self.call()


class _LinearAttention(KernelBenchmark):
    """A block's causal attention heads at GPT-2 small's shape: 12 heads of 64, T = 128, 8 sequences
    (forward) or 8 tangents of one (JVP)."""

    params = (BACKENDS, ["float32", "float64"])
    param_names = ["backend", "dtype"]
    timeout = 300
    kernel = ""

    def make(self, rng, backend, dtype):
        rand = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
        qkv, out, fn = rand(8, 128, 36, 64), np.empty((8, 128, 12, 64), dtype), backends.resolve(self.kernel, backend)
        if self.kernel == "linear_attention_forward":
            past = np.empty((12, 0, 64), dtype)
            return lambda: fn(qkv, past, past, 12, 0, 0.125, out)
        q, k, v, p = rand(12, 1, 128, 64), rand(12, 128, 64), rand(12, 128, 64), np.empty((12, 1, 128, 128), dtype)
        backends.resolve("softmax", "numpy")(rand(12, 128, 128), 0, p.reshape(12, 128, 128))
        return lambda: fn(qkv, q, k, v, p, 0, 0.125, out)


class LinearAttentionForward(_LinearAttention):
    kernel = "linear_attention_forward"

    def time_linear_attention_forward(self, backend, dtype):
        self.call()


class LinearAttentionJvp(_LinearAttention):
    kernel = "linear_attention_jvp"

    def time_linear_attention_jvp(self, backend, dtype):
        self.call()
