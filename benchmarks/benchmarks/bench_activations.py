"""asv suites for the softmax and activation kernels: one class per kernel id, backend x dtype x shape.

``time_<kernel>`` times one call of the public function with ``out=`` preallocated
(the activation JVP coefficients allocate theirs: ``activation_jvp_coef`` takes no
``out``). Shapes use the vocabulary of the propagation speed targets, a GPT-2-small batch
of K = 64 sequences of T = 128 tokens: the causal softmax sees (K, heads, T, T) scores
and its JVP K tangents of one sequence's (heads, T, T) probabilities; the MLP
activations see (K * T, d_mlp) pre-activations (for silu_gated, [gate | up] of that
width). ``track_bandwidth_fraction`` reports bytes moved per second as a fraction of
the machine's all-threads streaming copy bandwidth, as in bench_layernorm.
"""

from __future__ import annotations

import functools

import numpy as np

import pyengine as pa

from .common import BACKENDS, DTYPES, KernelBenchmark, copy_bandwidth, median_time

#: sequences x heads x T of the attention kernels.
ATTENTION_SHAPES = ["64x12x128", "4x12x1024"]
#: tokens x width of the MLP activations.
MLP_SHAPES = ["8192x3072", "8192x768"]


@functools.lru_cache(maxsize=None)
def _copy_bandwidth(nbytes: int) -> float:
    return copy_bandwidth(nbytes)


def _dims(shape: str) -> tuple[int, ...]:
    return tuple(int(s) for s in shape.split("x"))


class _Kernel(KernelBenchmark):
    """Base: a call built by :meth:`arrays` on seeded data (common.KernelBenchmark)."""

    params = [BACKENDS, DTYPES, MLP_SHAPES]

    def arrays(self, rng, dtype, shape):
        """(call(backend), bytes moved by one call)."""
        raise NotImplementedError

    def make(self, rng, backend, dtype, shape):
        call, self.bytes = self.arrays(rng, np.dtype(dtype), _dims(shape))
        return functools.partial(call, backend)

    def track_bandwidth_fraction(self, backend, dtype, shape):
        t = median_time(self.call, 3 if backend == "numpy" else 10)
        return self.bytes / t / _copy_bandwidth(max(self.bytes // 2, 1 << 26))

    track_bandwidth_fraction.unit = "fraction of copy bandwidth"


class _Attention(_Kernel):
    params = [BACKENDS, DTYPES, ATTENTION_SHAPES]


class Softmax(_Attention):
    """Causal softmax of (K, heads, T, T) scores, in place as a transformer block runs it."""

    def arrays(self, rng, dtype, shape):
        k, h, t = shape
        x = (3.0 * rng.standard_normal((k, h, t, t))).astype(dtype)
        out = np.empty_like(x)
        # Reads the visible half of x, writes all of out.
        return (lambda backend: pa.softmax(x, offset=0, out=out, backend=backend)), x.nbytes // 2 + out.nbytes

    def time_softmax(self, *params):
        self.call()


class SoftmaxJvp(_Attention):
    """K tangents (K, heads, T, T) through one sequence's softmax (1, heads, T, T)."""

    def arrays(self, rng, dtype, shape):
        k, h, t = shape
        p = pa.softmax((3.0 * rng.standard_normal((1, h, t, t))).astype(dtype), offset=0)
        dx = rng.standard_normal((k, h, t, t)).astype(dtype)
        out = np.empty_like(dx)
        return (lambda backend: pa.softmax_jvp(p, dx, out=out, backend=backend)), 2 * dx.nbytes

    def time_softmax_jvp(self, *params):
        self.call()


class _Activation(_Kernel):
    name = ""
    grad = False

    def arrays(self, rng, dtype, shape):
        n, width = shape
        x = (2.0 * rng.standard_normal((n, width))).astype(dtype)
        n_out = width // 2 if self.name == "silu_gated" else width
        outputs = (2 if self.name == "silu_gated" else 1) if self.grad else 1
        moved = x.nbytes + outputs * n * n_out * x.itemsize
        if self.grad:
            return (lambda backend: pa.activation_jvp_coef(self.name, x, backend=backend)), moved
        out = np.empty((n, n_out), dtype)
        return (lambda backend: pa.activation(self.name, x, out=out, backend=backend)), moved


class Gelu(_Activation):
    name = "gelu"

    def time_gelu(self, *params):
        self.call()


class GeluGrad(_Activation):
    name, grad = "gelu", True

    def time_gelu_grad(self, *params):
        self.call()


class GeluTanh(_Activation):
    name = "gelu_tanh"

    def time_gelu_tanh(self, *params):
        self.call()


class GeluTanhGrad(_Activation):
    name, grad = "gelu_tanh", True

    def time_gelu_tanh_grad(self, *params):
        self.call()


class Relu(_Activation):
    name = "relu"

    def time_relu(self, *params):
        self.call()


class ReluGrad(_Activation):
    name, grad = "relu", True

    def time_relu_grad(self, *params):
        self.call()


class SiluGated(_Activation):
    name = "silu_gated"

    def time_silu_gated(self, *params):
        self.call()


class SiluGatedGrad(_Activation):
    name, grad = "silu_gated", True

    def time_silu_gated_grad(self, *params):
        self.call()
