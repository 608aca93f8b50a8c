"""asv suites for the spectral kernels: one class per kernel id, backend x dtype x shape.

The kernels are called through the registry with preallocated outputs (the steady state
of a scan). ``time_<kernel>`` times one call over the batch; the ``track_*`` figures are
the ones the speed targets are stated in, measured in the same process:

* exact sigma_max: microseconds per token (targets, float32 on 2 cores: <= 5 at
  d = 768, <= 20 at d = 4096);
* fused power iteration: microseconds per token and iteration (a fixed ``ITERS``
  products, ``tol`` < 0 so that no token stops early); its speed-up over a NumPy
  batched power iteration is ``SpectralNormPower.track_speedup_vs_numpy_batched`` in
  bench_operators.py.

The NumPy reference takes seconds per call at these sizes (it is the specification:
bisection to one ulp, and a JVP/VJP pair per iteration over the whole batch).
"""

from __future__ import annotations

import numpy as np

from pyengine import backends

from .common import BACKENDS, DTYPES, KernelBenchmark, median_time, shape_of

#: tokens x d_model: a long sequence at GPT-2 width, and a shorter one at 4096.
SPECTRAL_SHAPES = ["8192x768", "1024x4096"]
#: Products J^T J per token in the power-iteration timings.
ITERS = 10
EPS = 1e-5


def _data(rng: np.random.Generator, tokens: int, d: int, dtype: str):
    x = (1.0 + rng.standard_normal((tokens, d))).astype(dtype)
    gamma = rng.uniform(0.5, 1.5, d).astype(dtype)
    v0 = rng.standard_normal((tokens, d)).astype(dtype)
    return x, gamma, v0


class _SigmaMax(KernelBenchmark):
    """Base: exact sigma_max of every token, full linearization."""

    kernel = ""
    params = [BACKENDS, DTYPES, SPECTRAL_SHAPES]

    def make(self, rng, backend, dtype, shape):
        tokens, d = shape_of(shape)
        x, gamma, _ = _data(rng, tokens, d, dtype)
        out = np.empty(tokens)
        fn = backends.resolve(self.kernel, backend)
        self.tokens = tokens
        return lambda: fn(x, gamma, EPS, False, out)

    def track_us_per_token(self, backend, dtype, shape):
        return median_time(self.call, 3 if backend == "numpy" else 10) / self.tokens * 1e6

    track_us_per_token.unit = "us/token"


class _PowerIteration(KernelBenchmark):
    """Base: ITERS products J^T J per token (tol < 0: no token stops early)."""

    kernel = ""
    params = [BACKENDS, DTYPES, SPECTRAL_SHAPES]

    def make(self, rng, backend, dtype, shape):
        tokens, d = shape_of(shape)
        x, gamma, v0 = _data(rng, tokens, d, dtype)
        sigma, residual = np.empty(tokens), np.empty(tokens)
        iterations = np.empty(tokens, dtype=np.int64)
        fn = backends.resolve(self.kernel, backend)
        self.tokens = tokens
        return lambda: fn(x, gamma, EPS, False, v0, -1.0, ITERS, sigma, residual, iterations)

    def track_us_per_token_iteration(self, backend, dtype, shape):
        t = median_time(self.call, 3 if backend == "numpy" else 10)
        return t / (self.tokens * ITERS) * 1e6

    track_us_per_token_iteration.unit = "us/(token*iteration)"


class LayerNormSigmaMax(_SigmaMax):
    kernel = "layer_norm_sigma_max"

    def time_layer_norm_sigma_max(self, *params):
        self.call()


class RmsNormSigmaMax(_SigmaMax):
    kernel = "rms_norm_sigma_max"

    def time_rms_norm_sigma_max(self, *params):
        self.call()


class LayerNormPowerIteration(_PowerIteration):
    kernel = "layer_norm_power_iteration"

    def time_layer_norm_power_iteration(self, *params):
        self.call()


class RmsNormPowerIteration(_PowerIteration):
    kernel = "rms_norm_power_iteration"

    def time_rms_norm_power_iteration(self, *params):
        self.call()


class _Lanczos(KernelBenchmark):
    """Base: the fused per-token Lanczos to tol = 1e-6 at d = 768 over 256 tokens:
    milliseconds per token (target <= 1 on 2 cores, float32), and the products it took. The
    NumPy reference loops over tokens in Python; ``track_ms_per_token`` of ``numpy`` is the
    generic batched solver that backend="numpy" runs instead."""

    kernel = ""
    norm = ""
    params = [BACKENDS, DTYPES]
    param_names = ["backend", "dtype"]

    def make(self, rng, backend, dtype):
        import pyengine as pe

        x, gamma, _ = _data(rng, 256, 768, dtype)
        fn = getattr(pe, self.norm + "_spectral_norm")
        return lambda: fn(x, gamma, method="lanczos", tol=1e-6, backend=backend)

    def track_ms_per_token(self, backend, dtype):
        return median_time(self.call, 1 if backend == "numpy" else 3) / 256 * 1e3

    track_ms_per_token.unit = "ms/token"

    def track_median_products(self, backend, dtype):
        return float(np.median(self.result.iterations))


class LayerNormLanczos(_Lanczos):
    kernel = "layer_norm_lanczos"
    norm = "layer_norm"

    def time_layer_norm_lanczos(self, *params):
        self.call()


class RmsNormLanczos(_Lanczos):
    kernel = "rms_norm_lanczos"
    norm = "rms_norm"

    def time_rms_norm_lanczos(self, *params):
        self.call()
