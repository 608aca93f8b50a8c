"""asv suite of the Newton–Schulz orthogonalization kernel (one class per kernel id).

``time_newton_schulz``: Muon's 5 quintic steps on one float32/float64 matrix of
GPT-2-small's and a large model's shapes (768x768, 768x3072, 4096x4096); ``track_products_ratio``: the kernel's
time over that of its own matrix products executed alone with the same BLAS
(``scipy.linalg.blas`` 2 syrk + 1 gemm per step on the same arrays; target <= 1.3);
``track_svd_speedup``: the exact polar factor by ``numpy.linalg.svd`` over the kernel
(target >= 5 at 4096x4096).
"""

from __future__ import annotations

import numpy as np

from pyengine import backends

from .common import BACKENDS, KernelBenchmark, median_time

SHAPES = ["768x768", "768x3072", "4096x4096"]
QUINTIC = np.array([(3.4445, -4.7750, 2.0315)] * 5)


def products(x: np.ndarray, steps: int = 5):
    """The Newton–Schulz step's BLAS calls alone (the C++ kernel's: syrk, syrk, gemm) on x (m, n)."""
    from scipy.linalg import blas

    xc = x.T if x.shape[0] <= x.shape[1] else x  # F-contiguous, l x s: the Gram matrix is s x s
    syrk, gemm = (blas.ssyrk, blas.sgemm) if x.dtype == np.float32 else (blas.dsyrk, blas.dgemm)
    a = np.asfortranarray(syrk(1.0, xc, trans=1))
    p = np.asfortranarray(syrk(1.0, a))

    def run():
        for _ in range(steps):
            gram = syrk(1.0, xc, trans=1, c=a, overwrite_c=1)  # Xᵀ-side Gram, one triangle
            syrk(1.0, gram, c=p, overwrite_c=1)  # A Aᵀ = A²
            gemm(1.0, xc, p)
    return run


class NewtonSchulz(KernelBenchmark):
    params = (BACKENDS, ["float32", "float64"], SHAPES)

    def make(self, rng, backend, dtype, shape):
        m, n = (int(s) for s in shape.split("x"))
        if backend != "cpp" and m * n > 768 * 3072:
            raise NotImplementedError("the 4096x4096 case is timed on the cpp backend only")
        self.g = rng.standard_normal((1, m, n)).astype(dtype)
        self.out = np.zeros_like(self.g)
        self.fn = backends.resolve("newton_schulz", backend)
        return lambda: self.fn(self.g, QUINTIC, self.out)

    def time_newton_schulz(self, backend, dtype, shape):
        self.fn(self.g, QUINTIC, self.out)

    def track_products_ratio(self, backend, dtype, shape):
        run = products(np.ascontiguousarray(self.g[0] / np.linalg.norm(self.g[0])))
        return median_time(lambda: self.fn(self.g, QUINTIC, self.out), 3) / median_time(run, 3)

    def track_svd_speedup(self, backend, dtype, shape):
        def polar():
            u, _, vt = np.linalg.svd(self.g[0], full_matrices=False)
            return u @ vt
        return median_time(polar, 1) / median_time(lambda: self.fn(self.g, QUINTIC, self.out), 3)
