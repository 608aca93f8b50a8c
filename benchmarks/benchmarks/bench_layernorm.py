"""asv suites for the normalization kernels: one class per kernel id, backend x dtype x shape.

``time_<kernel>`` times one call with ``out=`` preallocated (the steady state of a
scan; a fresh output would mostly time page faults). ``track_bandwidth_fraction``
reports the kernel's bytes moved per second as a fraction of the machine's
all-threads streaming copy bandwidth, both measured in the same process: this is
the figure the speed targets of the norm kernels are stated in, and it travels across
machines better than seconds.
"""

from __future__ import annotations

import functools

import numpy as np

import pyengine as pe

from .common import BACKENDS, DTYPES, SHAPES, KernelBenchmark, copy_bandwidth, median_time, shape_of

#: tokens x d for the dense Jacobians (d x d per token: the streaming sizes would need terabytes).
JAC_SHAPES = ["512x128", "64x768", "2x4096"]


@functools.lru_cache(maxsize=None)
def _copy_bandwidth(nbytes: int) -> float:
    return copy_bandwidth(nbytes)


class _Norm(KernelBenchmark):
    """Base: the kernel ``kernel`` with ``out=`` on seeded rows (common.KernelBenchmark)."""

    kernel = ""
    params = [BACKENDS, DTYPES, SHAPES]

    def make(self, rng, backend, dtype, shape):
        tokens, d = shape_of(shape)
        x = (1.0 + rng.standard_normal((tokens, d))).astype(dtype)
        w = rng.standard_normal((tokens, d)).astype(dtype)
        gamma = rng.uniform(0.5, 1.5, d).astype(dtype)
        beta = rng.standard_normal(d).astype(dtype)
        fn = getattr(pe, self.kernel)
        kind = self.kernel.rsplit("_", 1)[-1]
        if kind in ("jvp", "vjp"):
            args, streams = (x, w, gamma), 3
        elif kind == "jacobian":
            args, streams = (x, gamma), d + 1
        elif self.kernel == "layer_norm":
            args, streams = (x, gamma, beta), 2
        else:
            args, streams = (x, gamma), 2
        out = np.empty((tokens, d, d) if kind == "jacobian" else (tokens, d), dtype=dtype)
        self.bytes = streams * x.nbytes
        return functools.partial(fn, *args, backend=backend, out=out)

    def track_bandwidth_fraction(self, backend, dtype, shape):
        t = median_time(self.call, 3 if backend == "numpy" else 10)
        return self.bytes / t / _copy_bandwidth(max(self.bytes // 2, 1 << 26))

    track_bandwidth_fraction.unit = "fraction of copy bandwidth"


class _Jacobian(_Norm):
    params = [BACKENDS, DTYPES, JAC_SHAPES]


class LayerNorm(_Norm):
    kernel = "layer_norm"

    def time_layer_norm(self, *params):
        self.call()


class LayerNormJvp(_Norm):
    kernel = "layer_norm_jvp"

    def time_layer_norm_jvp(self, *params):
        self.call()


class LayerNormVjp(_Norm):
    kernel = "layer_norm_vjp"

    def time_layer_norm_vjp(self, *params):
        self.call()


class LayerNormJacobian(_Jacobian):
    kernel = "layer_norm_jacobian"

    def time_layer_norm_jacobian(self, *params):
        self.call()


class RmsNorm(_Norm):
    kernel = "rms_norm"

    def time_rms_norm(self, *params):
        self.call()


class RmsNormJvp(_Norm):
    kernel = "rms_norm_jvp"

    def time_rms_norm_jvp(self, *params):
        self.call()


class RmsNormVjp(_Norm):
    kernel = "rms_norm_vjp"

    def time_rms_norm_vjp(self, *params):
        self.call()


class RmsNormJacobian(_Jacobian):
    kernel = "rms_norm_jacobian"

    def time_rms_norm_jacobian(self, *params):
        self.call()
