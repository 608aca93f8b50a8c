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
