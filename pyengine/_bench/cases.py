"""Benchmark cases: what ``pyengine bench`` times, built from the kernel registry.

Kernels are called at the kernel level (``backends.resolve(id, backend)``) on
C-contiguous arrays with preallocated outputs; their arguments are built from the
reference's parameter names (:data:`ARGUMENTS`), so a newly registered kernel is
benchmarked without new code, and one with an unknown parameter name fails loudly.

Imports are absolute (``pyengine.backends``) and registry names absent from an older
build are read with defaults: the A/B worker (:mod:`pyengine._bench.worker`) loads this
file by path against *another revision's* installed pyengine, so both builds are timed
on exactly the same arguments.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from pyengine import backends

__all__ = ["ARGUMENTS", "Case", "SIZES", "THRESHOLD", "all_cases", "register_case"]

_ATTENTION = frozenset(getattr(backends, "ATTENTION_KERNELS", ()))
_ORTHOGONALIZE = frozenset(getattr(backends, "ORTHOGONALIZE_KERNELS", ()))
_ACTIVATION = frozenset(getattr(backends, "ACTIVATION_KERNELS", ()))
_LINEAR = frozenset(getattr(backends, "LINEAR_KERNELS", ()))
_LINEAR_ATTENTION = frozenset(getattr(backends, "LINEAR_ATTENTION_KERNELS", ()))


def _provides(kernel: str, backend: str) -> bool:
    provides = getattr(backends, "provides", None)
    return provides(kernel, backend) if provides else True


#: Shapes (tokens, d): the standard run and ``--quick``.
SIZES = {"standard": [(8192, 768), (2048, 4096)], "quick": [(2048, 768)]}
#: Dense Jacobians write d x d per token: far fewer tokens.
JACOBIAN_TOKENS = 16
#: The exact sigma_max reference bisects to full precision (seconds per thousand
#: tokens): its kernels are timed on this many tokens, on every backend alike.
SIGMA_MAX_TOKENS = 256
#: Power iterations per timed call of a *_power_iteration kernel (tol = 0: all run).
POWER_ITERATIONS = 10
#: The softmax kernels read a size (tokens, d) as a model's attention: B = tokens / T
#: sequences of T = ATTENTION_T tokens, d / HEAD_DIM heads, causal score matrices
#: (B * heads, T, T); the JVP's p is one sequence's (heads, T, T), shared by B tangents.
ATTENTION_T = 128
HEAD_DIM = 64
#: The activation kernels read a size (tokens, d) as an MLP's pre-activations
#: (tokens, MLP_RATIO * d); for silu_gated that is [gate | up], of width 2 * d each.
MLP_RATIO = 4
#: Default relative drop of a normalized figure (vs a stored baseline) that counts as a regression.
THRESHOLD = 0.25


@dataclasses.dataclass
class Case:
    """One benchmark: ``setup(backend, dtype, size) -> (call, bytes_moved, flops)``.

    ``limit`` is ``"bandwidth"`` (memory-bound: report bytes/s over the copy
    bandwidth), ``"gemm"`` (report flop/s over the GEMM throughput) or ``"none"``.
    ``per_call`` divides the measured time (e.g. iterations per call).
    """

    name: str
    setup: Callable[[str, str, tuple[int, int]], tuple[Callable[[], Any], int, float]]
    limit: str = "bandwidth"
    per_call: int = 1
    backends: tuple[str, ...] = backends.BACKENDS
    tokens: Callable[[int], int] = int  # tokens actually used for a requested size
    #: The size as reported, from the requested (tokens, d); default "<tokens used>x<d>".
    label: Callable[[tuple[int, int]], str] | None = None

    def size_label(self, size: tuple[int, int]) -> str:
        return self.label(size) if self.label else f"{self.tokens(size[0])}x{size[1]}"


_CASES: dict[str, Case] = {}


def register_case(case: Case) -> Case:
    """Add a benchmark case (a downstream package's kernel, say) to ``pyengine bench``."""
    if case.limit not in ("bandwidth", "gemm", "none"):
        raise ValueError(f"case.limit must be 'bandwidth', 'gemm' or 'none'; got {case.limit!r}")
    _CASES[case.name] = case
    return case


def _tokens(kernel: str, n: int) -> int:
    """Tokens a kernel is timed on: fewer for the dense Jacobians and the exact sigma_max."""
    if kernel.endswith("_jacobian"):
        return JACOBIAN_TOKENS
    if kernel.endswith(("_sigma_max", "_lanczos")):  # the Lanczos reference loops over tokens
        return min(n, SIGMA_MAX_TOKENS)
    return n


def _attention_shape(size: tuple[int, int]) -> tuple[int, int, int]:
    """(sequences B, heads H, tokens per sequence T) of a size, for the softmax kernels."""
    n, d = size
    t = max(1, min(ATTENTION_T, n))
    return max(1, n // t), max(1, d // HEAD_DIM), t


def _shape_label(kernel: str, size: tuple[int, int]) -> str:
    """The size of the arrays a kernel is timed on, as the report shows it."""
    if kernel.startswith("softmax"):
        b, h, t = _attention_shape(size)
        return f"{b}x{h}x{t}x{t}"
    if kernel in _ACTIVATION:
        return f"{size[0]}x{MLP_RATIO * size[1]}"
    return f"{_tokens(kernel, size[0])}x{size[1]}"


def _kernel_arrays(kernel: str, dtype: np.dtype, size: tuple[int, int]) -> dict[str, Callable[[], Any]]:
    """Seeded arguments of ``kernel`` by the reference's parameter names, built on demand.

    Shapes depend on the kernel's family: (tokens, d) rows for the normalization and
    spectral kernels, causal score matrices for the softmax kernels (see
    :data:`ATTENTION_T`), MLP pre-activations for the activations (:data:`MLP_RATIO`).
    """
    n, d = _tokens(kernel, size[0]), size[1]
    rng = np.random.default_rng(0)
    row = lambda: (1.0 + rng.standard_normal((n, d))).astype(dtype)  # noqa: E731
    per_token = lambda t=np.float64: np.zeros(n, dtype=t)  # noqa: E731
    b, h, t = _attention_shape(size)
    mlp = MLP_RATIO * d
    attention = kernel.startswith("softmax")
    activation = kernel in _ACTIVATION and not attention

    def x():
        if attention:  # scores of the size softmax sees after the 1/sqrt(head_dim) scaling
            return (3.0 * rng.standard_normal((b * h, t, t))).astype(dtype)
        if activation:
            return (2.0 * rng.standard_normal((n, mlp))).astype(dtype)
        return row()

    def p():  # one sequence's causal attention probabilities, (heads, T, T)
        out = np.empty((h, t, t), dtype)
        backends.resolve("softmax", "numpy")((3.0 * rng.standard_normal((h, t, t))).astype(dtype), 0, out)
        return out

    def out():
        if kernel.endswith("_sigma_max"):
            return np.zeros(n, np.float64)
        if kernel.endswith("_jacobian"):
            return np.zeros((n, d, d), dtype)
        if kernel == "softmax":
            return np.zeros((b * h, t, t), dtype)
        if kernel == "softmax_jvp":
            return np.zeros((b, h, t, t), dtype)
        if activation:
            return np.zeros((n, mlp // 2 if kernel.startswith("silu_gated") else mlp), dtype)
        return np.zeros((n, d), dtype)

    return {
        "x": x, "v": row, "v0": (lambda: row().astype(np.float64)) if kernel.endswith("_lanczos") else row,
        "u": lambda: (2.0 * rng.standard_normal((n, mlp))).astype(dtype) if activation else row(),
        "gamma": lambda: rng.uniform(0.5, 1.5, d).astype(dtype),
        "beta": lambda: rng.standard_normal(d).astype(dtype),
        "eps": lambda: 1e-5, "frozen": lambda: False, "tol": lambda: 0.0, "max_iter": lambda: POWER_ITERATIONS,
        "offset": lambda: 0,  # causal
        "p": p, "dx": lambda: rng.standard_normal((b, h, t, t)).astype(dtype),
        "out": out, "out_a": lambda: np.zeros((n, mlp // 2), dtype), "out_b": lambda: np.zeros((n, mlp // 2), dtype),
        "sigma": per_token, "residual": per_token, "iterations": lambda: per_token(np.int64),
    }


#: Parameter names a kernel may have, for the generic argument builder.
ARGUMENTS = frozenset(_kernel_arrays("layer_norm", np.dtype(np.float32), (1, 2)))


def _newton_schulz_case(kernel: str) -> Case:
    """Muon's 5 quintic steps on one k x k matrix, k = min(d, 1024): 2 syrk (k³) + 1 gemm (2 k³) per step."""
    def setup(backend: str, dtype: str, size: tuple[int, int]):
        k, fn = min(size[1], 1024), backends.resolve(kernel, backend)
        g, cf = np.random.default_rng(0).standard_normal((1, k, k)).astype(dtype), np.array([(3.4445, -4.775, 2.0315)] * 5)
        return (lambda: fn(g, cf, np.zeros_like(g))), 2 * g.nbytes, 5 * 4.0 * k**3
    return Case(kernel, setup, limit="gemm", label=lambda size: f"{min(size[1], 1024)}x{min(size[1], 1024)}",
                backends=tuple(b for b in backends.BACKENDS if _provides(kernel, b)))


def _linear_case(kernel: str) -> Case:
    """An MLP's first product (tokens, d) @ (d, MLP_RATIO d) with the kernel's epilogue."""
    def setup(backend: str, dtype: str, size: tuple[int, int]):
        (n, d), fn, rng = size, backends.resolve(kernel, backend), np.random.default_rng(0)
        m = MLP_RATIO * d
        x, w = rng.standard_normal((n, d)).astype(dtype), (rng.standard_normal((d, m)) / d**0.5).astype(dtype)
        b, r, out = rng.standard_normal(m).astype(dtype), rng.standard_normal((n, m)).astype(dtype), np.empty((n, m), dtype)
        call = {"linear": lambda: fn(x, w, b, r, out), "linear_act": lambda: fn(x, w, b, "gelu_tanh", None, out),
                "linear_mul": lambda: fn(x, w, r, out)}[kernel]
        return call, x.nbytes + w.nbytes + 2 * out.nbytes, 2.0 * n * d * m
    return Case(kernel, setup, limit="gemm", label=lambda size: f"{size[0]}x{size[1]}x{MLP_RATIO * size[1]}",
                backends=tuple(b for b in backends.BACKENDS if _provides(kernel, b)))


def _linear_attention_case(kernel: str) -> Case:
    """A block's causal attention heads (see _attention_shape; B sequences, or B tangents of one)."""
    def setup(backend: str, dtype: str, size: tuple[int, int]):
        (b, h, t), fn, rng = _attention_shape(size), backends.resolve(kernel, backend), np.random.default_rng(0)
        rand = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
        qkv, out, scale = rand(b, t, 3 * h, HEAD_DIM), np.empty((b, t, h, HEAD_DIM), dtype), HEAD_DIM**-0.5
        if kernel == "linear_attention_forward":
            past = np.empty((h, 0, HEAD_DIM), dtype)
            return (lambda: fn(qkv, past, past, h, 0, scale, out)), qkv.nbytes + out.nbytes, 4.0 * b * h * t * t * HEAD_DIM
        q, k, v, p = rand(h, 1, t, HEAD_DIM), rand(h, t, HEAD_DIM), rand(h, t, HEAD_DIM), np.empty((h, 1, t, t), dtype)
        backends.resolve("softmax", "numpy")(rand(h, t, t), 0, p.reshape(h, t, t))
        return (lambda: fn(qkv, q, k, v, p, 0, scale, out)), qkv.nbytes + out.nbytes, 8.0 * b * h * t * t * HEAD_DIM

    def label(size: tuple[int, int]) -> str:
        b, h, t = _attention_shape(size)
        return f"{b}x{t}x{h}x{HEAD_DIM}"

    return Case(kernel, setup, limit="none", label=label,
                backends=tuple(b for b in backends.BACKENDS if _provides(kernel, b)))


def _kernel_case(kernel: str) -> Case:
    if kernel in _LINEAR:
        return _linear_case(kernel)
    if kernel in _LINEAR_ATTENTION:
        return _linear_attention_case(kernel)
    if kernel in _ATTENTION:
        return _attention_case(kernel)
    if kernel in _ORTHOGONALIZE:
        return _newton_schulz_case(kernel)
    names = tuple(inspect.signature(backends.resolve(kernel, "numpy")).parameters)
    unknown = set(names) - ARGUMENTS
    if unknown:
        raise KeyError(f"pyengine bench cannot build arguments {sorted(unknown)} of kernel {kernel!r}")
    power = kernel.endswith(("_power_iteration", "_lanczos"))

    def setup(backend: str, dtype: str, size: tuple[int, int]):
        pool = _kernel_arrays(kernel, np.dtype(dtype), size)
        args = [pool[name]() for name in names]
        fn = backends.resolve(kernel, backend)
        moved = sum(a.nbytes for a in args if isinstance(a, np.ndarray))
        return (lambda: fn(*args)), moved, 0.0

    return Case(
        kernel, setup, limit="none" if power else "bandwidth", per_call=POWER_ITERATIONS if power else 1,
        backends=tuple(b for b in backends.BACKENDS if _provides(kernel, b)),
        tokens=lambda n: _tokens(kernel, n), label=lambda size: _shape_label(kernel, size),
    )


def _attention_arrays(kernel: str, dtype: np.dtype, size: tuple[int, int]) -> list[Any]:
    """Arguments of an attention kernel: B * H causal heads (see _attention_shape), dk = dv = HEAD_DIM."""
    b, h, t = _attention_shape(size)
    n, rng = b * h, np.random.default_rng(0)
    rand = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    if kernel in ("attention_score_grad", "attention_advantage"):
        p = np.empty((n, t, t), dtype)
        backends.resolve("softmax", "numpy")((3.0 * rng.standard_normal((n, t, t))).astype(dtype), 0, p)
        outs = [np.zeros_like(p) for _ in range(2 if kernel == "attention_advantage" else 1)]
        return [p, rand(n, t, HEAD_DIM), rand(n, t, HEAD_DIM), 0, *outs]
    q, k, v, scale = rand(n, t, HEAD_DIM), rand(n, t, HEAD_DIM), rand(n, t, HEAD_DIM), 1.0 / np.sqrt(HEAD_DIM)
    lse, ent = np.zeros((n, t)), np.zeros((n, t))
    if kernel == "attention_forward":
        return [q, k, v, 0, scale, np.zeros_like(q), lse, ent]
    o = np.zeros_like(q)
    backends.resolve("attention_forward", "numpy")(q, k, v, 0, scale, o, lse, ent)
    return [q, k, v, o, rand(n, t, HEAD_DIM), lse, 0, scale, np.zeros_like(q), np.zeros_like(k), np.zeros_like(v),
            ent]


def _attention_case(kernel: str) -> Case:
    def setup(backend: str, dtype: str, size: tuple[int, int]):
        args = _attention_arrays(kernel, np.dtype(dtype), size)
        fn = backends.resolve(kernel, backend)
        moved = sum(a.nbytes for a in args if isinstance(a, np.ndarray))
        return (lambda: fn(*args)), moved, 0.0

    def label(size: tuple[int, int]) -> str:
        b, h, t = _attention_shape(size)
        return f"{b * h}x{t}x{t}x{HEAD_DIM}"

    limit = "bandwidth" if kernel in ("attention_score_grad", "attention_advantage") else "none"  # fused: compute
    return Case(kernel, setup, limit=limit, label=label,
                backends=tuple(b for b in backends.BACKENDS if _provides(kernel, b)))


def all_cases() -> dict[str, Case]:
    """Every registry kernel's case, then the registered downstream ones."""
    return {k: _kernel_case(k) for k in backends.KERNELS} | _CASES
