"""Machine-normalized benchmarks: ``pyengine bench``.

Absolute times mean little across machines (and a shared machine is noisy); a
kernel's speed as a fraction of what the machine can do, measured in the same run,
travels. :func:`run` therefore measures the machine's limits first (all-core
streaming copy bandwidth, BLAS GEMM throughput in float32 and float64), then every
registered kernel on every available backend, and reports for each: the median
time and its spread, the throughput, the fraction of the relevant limit, and the
speed-up over the NumPy reference.

Kernels are called at the kernel level (``backends.resolve(id, backend)``) on
C-contiguous arrays with preallocated outputs, the same contract every backend
shares; their arguments are built from the reference's parameter names
(:data:`ARGUMENTS`), so a newly registered kernel is benchmarked without new code,
and one with an unknown parameter name fails loudly here.

Downstream packages add their own cases with :func:`register_case`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _validate as _v
from . import backends
from ._progress import Progress

__all__ = ["Case", "compare", "copy_bandwidth", "load_baseline", "machine_limits", "register_case", "run", "time_call"]

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
#: Default relative drop of a normalized figure that counts as a regression.
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
    if kernel.endswith("_sigma_max"):
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
    if kernel in backends.ACTIVATION_KERNELS:
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
    activation = kernel in backends.ACTIVATION_KERNELS and not attention

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
        "x": x, "v": row, "v0": row,
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
                backends=tuple(b for b in backends.BACKENDS if backends.provides(kernel, b)))


def _kernel_case(kernel: str) -> Case:
    if kernel in backends.ATTENTION_KERNELS:
        return _attention_case(kernel)
    if kernel in backends.ORTHOGONALIZE_KERNELS:
        return _newton_schulz_case(kernel)
    names = tuple(inspect.signature(backends.resolve(kernel, "numpy")).parameters)
    unknown = set(names) - ARGUMENTS
    if unknown:
        raise KeyError(f"pyengine bench cannot build arguments {sorted(unknown)} of kernel {kernel!r}")
    power = kernel.endswith("_power_iteration")

    def setup(backend: str, dtype: str, size: tuple[int, int]):
        pool = _kernel_arrays(kernel, np.dtype(dtype), size)
        args = [pool[name]() for name in names]
        fn = backends.resolve(kernel, backend)
        moved = sum(a.nbytes for a in args if isinstance(a, np.ndarray))
        return (lambda: fn(*args)), moved, 0.0

    return Case(
        kernel, setup, limit="none" if power else "bandwidth", per_call=POWER_ITERATIONS if power else 1,
        backends=tuple(b for b in backends.BACKENDS if backends.provides(kernel, b)),
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
                backends=tuple(b for b in backends.BACKENDS if backends.provides(kernel, b)))


def time_call(call: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """(median seconds, relative spread (max - min)/median) of ``repeat`` timed calls after
    one untimed warm-up call (JIT compilation, page faults)."""
    call()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    med = float(np.median(times))
    return med, float((max(times) - min(times)) / med)


def copy_bandwidth(nbytes: int, repeat: int = 5) -> float:
    """The machine's all-core streaming copy bandwidth: bytes moved (read + write) per second.

    Uses the C++ backend's ``stream_copy`` (all threads, non-temporal stores); without
    it, NumPy's one-thread copy, which understates the limit (fractions come out high).
    """
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros_like(src)
    if backends.available_backends()["cpp"].available:
        from . import _core

        copy = lambda: _core.stream_copy(src, dst)  # noqa: E731
    else:
        copy = lambda: np.copyto(dst, src)  # noqa: E731
    t, _ = time_call(copy, repeat)
    return 2 * nbytes / t


def machine_limits(quick: bool = False) -> dict[str, float]:
    """All-core streaming copy bandwidth (bytes moved/s) and GEMM flop/s, measured now."""
    limits = {"copy_bytes_per_s": copy_bandwidth((64 if quick else 256) << 20)}
    n = 1024 if quick else 2048
    for dt in ("float32", "float64"):
        a = np.random.default_rng(0).standard_normal((n, n)).astype(dt)
        t, _ = time_call(lambda: a @ a, 3)
        limits[f"gemm_{dt}_flop_per_s"] = 2 * n**3 / t
    return limits


def run(quick: bool = False, repeat: int | None = None, dtypes: tuple[str, ...] = ("float32",)) -> dict[str, Any]:
    """Measure the machine's limits, then every case x available backend x size x dtype.

    Returns a JSON-ready dict: ``{"machine": limits, "results": [row, ...]}``; each row
    has kernel, backend, dtype, size, time_s, spread, gb_per_s, fraction (of the
    case's limit, or None), speedup_vs_numpy.
    """
    repeat = repeat or (3 if quick else 7)
    limits = machine_limits(quick)
    cases = {k: _kernel_case(k) for k in backends.KERNELS} | _CASES
    avail = [n for n, i in backends.available_backends().items() if i.available]
    plan = [
        (case, b, dt, size)
        for case in cases.values()
        for dt in dtypes
        for size in SIZES["quick" if quick else "standard"]
        for b in reversed(avail)  # numpy first: the speed-up column needs it
        if b in case.backends
    ]
    rows: list[dict[str, Any]] = []
    ref_time: dict[tuple[str, str, tuple[int, int]], float] = {}
    bar = Progress("auto")  # a bar on a terminal only
    for i, (case, b, dt, size) in enumerate(plan):
        bar.step(i, len(plan), f"{case.name} {b} {dt} {size[0]}x{size[1]}")
        call, moved, flops = case.setup(b, dt, size)
        # The reference is slow: fewer runs, but at least two, so its spread is measured.
        t, spread = time_call(call, max(2, repeat // 2) if b == "numpy" else repeat)
        t /= case.per_call
        key = (case.name, dt, size)
        if b == "numpy":
            ref_time[key] = t
        fraction = None
        if case.limit == "bandwidth":
            fraction = moved / t / limits["copy_bytes_per_s"]
        elif case.limit == "gemm":
            fraction = flops / t / limits[f"gemm_{dt}_flop_per_s"]
        rows.append({
            "kernel": case.name, "backend": b, "dtype": dt, "size": case.size_label(size),
            "time_s": t, "spread": spread, "gb_per_s": moved / case.per_call / t / 1e9 if moved else None,
            "fraction": fraction, "speedup_vs_numpy": ref_time[key] / t if key in ref_time else None,
        })
    bar.step(len(plan), len(plan), "done")
    return {"machine": limits, "repeat": repeat, "results": rows}


def format_table(report: dict[str, Any]) -> str:
    """The report as a text table."""
    m = report["machine"]
    lines = [
        f"machine: copy {m['copy_bytes_per_s'] / 1e9:.1f} GB/s (all cores), GEMM "
        f"{m['gemm_float32_flop_per_s'] / 1e9:.0f} GFLOP/s float32, {m['gemm_float64_flop_per_s'] / 1e9:.0f} float64",
        f"{'kernel':<28}{'backend':<8}{'dtype':<9}{'size':<15}{'time':>11}{'spread':>8}"
        f"{'GB/s':>8}{'of limit':>10}{'vs numpy':>10}",
    ]
    for r in report["results"]:
        t = r["time_s"]
        tt = f"{t * 1e3:.3f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"
        fmt = lambda v, spec: "" if v is None else format(v, spec)  # noqa: E731
        lines.append(
            f"{r['kernel']:<28}{r['backend']:<8}{r['dtype']:<9}{r['size']:<15}{tt:>11}"
            f"{r['spread']:>7.0%} {fmt(r['gb_per_s'], '8.1f'):>8}{fmt(r['fraction'], '10.1%'):>10}"
            f"{fmt(r['speedup_vs_numpy'], '9.1f') + ('x' if r['speedup_vs_numpy'] else ''):>10}"
        )
    return "\n".join(lines)


def compare(report: dict[str, Any], baseline: dict[str, Any], threshold: float = THRESHOLD) -> list[str]:
    """Regressions of the normalized figures (fraction of limit, speed-up over NumPy).

    A figure regresses when it falls below ``baseline * (1 - threshold)`` by more
    than the larger of the two runs' spreads allows (for the speed-up, a ratio, the
    NumPy reference's spreads count too): noise alone must not fail it.
    Returns one line per regression (empty when none). ``threshold``: in [0, 1);
    ``baseline`` is checked as :func:`load_baseline` checks a file.
    """
    threshold = _v.real("threshold", threshold, low=0, high=1, high_open=True)
    baseline = _v.bench_report("baseline", baseline)
    key_of = lambda r, backend: (r["kernel"], backend, r["dtype"], r["size"])  # noqa: E731
    base = {key_of(r, r["backend"]): r for r in baseline.get("results", [])}
    mine = {key_of(r, r["backend"]): r for r in report["results"]}
    found = []
    for r in report["results"]:
        b = base.get(key_of(r, r["backend"]))
        if b is None or r["backend"] == "numpy":
            continue
        for key in ("fraction", "speedup_vs_numpy"):
            spreads = [r["spread"], b["spread"]]
            if key == "speedup_vs_numpy":  # a ratio: the reference's noise is in it too
                spreads += [t[key_of(r, "numpy")]["spread"] for t in (mine, base) if key_of(r, "numpy") in t]
            slack = threshold + max(spreads) / 2
            if r.get(key) is not None and b.get(key) and r[key] < b[key] * (1 - slack):
                found.append(
                    f"{r['kernel']} {r['backend']} {r['dtype']} {r['size']}: {key} {r[key]:.3g} "
                    f"< baseline {b[key]:.3g} (allowed drop {slack:.0%})"
                )
    return found


def load_baseline(path: str) -> dict[str, Any]:
    """A ``pyengine bench --json`` report read from ``path`` and checked row by row
    (:func:`pyengine._validate.bench_report`), before any benchmark runs; every error names the file."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except UnicodeDecodeError:
        raise ValueError(f"baseline {path} is not a text (UTF-8 JSON) file: not a `pyengine bench --json` file") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"baseline {path} is not valid JSON: {exc}") from None
    return _v.bench_report(f"baseline {path}", doc)


def main(quick: bool, json_path: str | None, compare_path: str | None, threshold: float, dtypes: tuple[str, ...]) -> int:
    """The ``pyengine bench`` command; exit status 1 on a regression against the baseline."""
    threshold = _v.real("threshold", threshold, low=0, high=1, high_open=True)
    baseline = None if compare_path is None else load_baseline(compare_path)
    report = run(quick=quick, dtypes=dtypes)
    print(format_table(report))
    if json_path is not None:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {json_path}")
    if baseline is not None:
        regressions = compare(report, baseline, threshold)
        for line in regressions:
            print(f"REGRESSION {line}")
        print(f"compared with {compare_path}: {len(regressions)} regression(s)")
        return 1 if regressions else 0
    return 0

