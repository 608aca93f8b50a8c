"""asv suites for the public spectral API on batched operators.

* ``SpectralNormPower``: power iteration on per-token LayerNorm Jacobians through
  :func:`pyengine.layer_norm_spectral_norm` (the fused kernel of each backend), a
  fixed 50 iterations per token (``tol`` unreachable), so the time is the cost of
  50 iterations; ``track_speedup_vs_numpy_batched`` is the target's figure: seconds
  per token-iteration of the NumPy reference (a power iteration batched over
  tokens in NumPy) over the backend's fused kernel's.
* ``SpectralNormLanczos``: ``method="lanczos"`` to 1e-10 on LayerNorm Jacobians
  with a realistic (lognormal) gamma; ``track_products_vs_arpack`` is the ratio of
  the products ARPACK's ``eigsh`` on J^T J needs for the same tolerance to ours
  (>= 1 means we need no more).
* ``SpectralRadius``: ``spectral_radius`` of pre-LN residual blocks I + W J_LN
  (one shared W, per-token J): power iteration with the Arnoldi fall-back.
"""

from __future__ import annotations

import numpy as np

import pyengine as pe

from .common import BACKENDS, DTYPES, KernelBenchmark, median_time, shape_of

#: Fixed work for the power-iteration timings: tol is unreachable, every token runs MAX_ITER.
POWER_ITERS = 50


def _tokens(tokens: int, d: int, dtype: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = (0.3 + rng.standard_normal((tokens, d)) * rng.lognormal(0, 0.5, d)).astype(dtype)
    gamma = rng.lognormal(0, 0.3, d).astype(dtype)
    return x, gamma


class SpectralNormPower(KernelBenchmark):
    params = [BACKENDS, DTYPES, ["1024x768", "128x4096"]]

    def make(self, rng, backend, dtype, shape):
        tokens, d = shape_of(shape)
        self.x, self.gamma = _tokens(tokens, d, dtype)
        return self.run

    def run(self):
        return pe.layer_norm_spectral_norm(self.x, self.gamma, method="power", tol=1e-15,
                                           max_iter=POWER_ITERS, backend=self.backend)

    def time_spectral_norm_power(self, *params):
        self.run()

    def track_speedup_vs_numpy_batched(self, backend, dtype, shape):
        """Seconds per token-iteration of the NumPy reference (batched over tokens) / of this backend."""
        sub = self.x[:64]
        ref = median_time(lambda: pe.layer_norm_spectral_norm(
            sub, self.gamma, method="power", tol=1e-15, max_iter=5, backend="numpy"), 3) / (5 * len(sub))
        fused = median_time(self.run, 3) / (POWER_ITERS * len(self.x))
        return ref / fused

    track_speedup_vs_numpy_batched.unit = "x (per iteration)"


class SpectralNormLanczos(KernelBenchmark):
    params = [["numpy", "numba", "cpp"], ["256x768", "32x4096"]]
    param_names = ["backend", "shape"]

    def make(self, rng, backend, shape):
        tokens, d = shape_of(shape)
        self.x, self.gamma = _tokens(tokens, d, "float64")
        return self.run

    def run(self):
        return pe.layer_norm_spectral_norm(self.x, self.gamma, method="lanczos", tol=1e-10,
                                           backend=self.backend)

    def time_spectral_norm_lanczos(self, *params):
        self.run()

    def track_products_vs_arpack(self, backend, shape):
        import scipy.sparse.linalg as sla

        ours = 2 * self.run().iterations[:4]
        J = pe.LayerNormJacobian(self.x[:4], self.gamma)
        theirs = []
        for i in range(4):
            L = pe.as_linear_operator(J, i)
            count = [0]

            def mv(v, L=L, count=count):
                count[0] += 2
                return L.rmatvec(L.matvec(v))

            AtA = sla.LinearOperator(L.shape, matvec=mv, dtype=L.dtype)
            sla.eigsh(AtA, k=1, tol=1e-10, v0=np.random.default_rng(i).standard_normal(L.shape[0]),
                      return_eigenvectors=False)
            theirs.append(count[0])
        return float(np.sum(theirs) / np.sum(ours))

    track_products_vs_arpack.unit = "ARPACK products / ours"


class SpectralRadius:
    params = [[64, 256, 768]]
    param_names = ["d_model"]
    timeout = 600

    def setup(self, d):
        x, gamma = _tokens(16, d, "float64")
        W = np.random.default_rng(1).standard_normal((d, d)) / np.sqrt(d)
        self.op = pe.Identity(d) + pe.DenseOperator(W) @ pe.LayerNormJacobian(x, gamma)
        pe.spectral_radius(self.op.take(np.arange(2)), tol=1e-8)

    def time_spectral_radius(self, d):
        pe.spectral_radius(self.op, tol=1e-8)
