"""Timing on a noisy host: calibrated loop counts, rounds of short samples, the
machine's limits re-measured next to each kernel, and the test-only slowdown switch.

Imports are absolute so the A/B worker can load this file against another build.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fractions
import math
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pyengine import backends

from . import stats as _stats

__all__ = ["SLOWDOWN_ENV", "calibrate", "limit_probe", "sample", "slowdown", "slowed", "steady_allocator", "time_call"]

#: Test-only switch read by the bench harness (never by the kernels): make one kernel
#: slower by a factor, e.g. ``layer_norm:cpp=1.5`` or ``layer_norm:cpp=1.5,softmax:numba=1.2``.
SLOWDOWN_ENV = "PYENGINE_BENCH_SLOWDOWN"
#: Loop counts stop doubling here (a sample of a trivially fast call stays bounded).
MAX_LOOPS = 1 << 16


#: glibc mallopt parameters (malloc.h): M_TRIM_THRESHOLD, M_MMAP_THRESHOLD; and the largest
#: mmap threshold glibc accepts on 64-bit (its dynamic threshold never exceeds it either).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _MMAP_MAX = -1, -3, 32 << 20


def steady_allocator() -> bool:
    """Fix glibc's malloc thresholds for the rest of this (benchmark) process; True if done.

    glibc adapts its mmap threshold per process as blocks are freed, so two processes
    running the same code can differ for their whole life in whether a NumPy temporary of
    a few MB is carved from the reused heap or mmapped and page-faulted afresh on every
    call. Measured here on the NumPy layer_norm at 512 x 256 under load: one A/B worker
    ran 1.2-2x slower than the other, identical, one for a whole run (a false "regression"
    with every round above 1.2), and calls took 5 ms instead of 0.3-1 ms. With the mmap
    threshold fixed at glibc's maximum (32 MB: larger blocks are mmapped in every process
    alike) and the heap never trimmed, both workers allocate alike and the bias is gone.
    A no-op (False) where the C library has no ``mallopt`` (not glibc).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def slowdown(env: dict[str, str] | None = None) -> dict[tuple[str, str], float]:
    """``{(kernel, backend): factor}`` parsed from :data:`SLOWDOWN_ENV`; a ValueError naming
    the variable on a malformed entry or a factor that is not a finite number >= 1."""
    text = (os.environ if env is None else env).get(SLOWDOWN_ENV, "").strip()
    out: dict[tuple[str, str], float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            key, factor = item.split("=")
            kernel, backend = key.split(":")
            value = float(factor)
        except ValueError:
            raise ValueError(f"{SLOWDOWN_ENV} entries must be kernel:backend=factor; got {item!r}") from None
        if not (math.isfinite(value) and value >= 1):
            raise ValueError(f"{SLOWDOWN_ENV} factor must be a finite number >= 1; got {item!r}")
        out[(kernel.strip(), backend.strip())] = value
    return out


def slowed(call: Callable[[], Any], factor: float) -> Callable[[], Any]:
    """``call`` made ``factor`` times slower by the harness: every call runs the kernel once
    more for each whole unit that (factor - 1) accumulates (so factor 1.5 runs it twice on
    every other call). The kernel is untouched and the extra work is its own (same memory
    traffic, same threads), unlike a spin or a sleep, whose cost depends on the host's load.
    The result's ``multiple`` is the smallest loop count over which the extra work is exact
    (:func:`calibrate` uses multiples of it)."""
    if factor == 1:
        return call
    extra = fractions.Fraction(factor - 1).limit_denominator(100)
    acc = [fractions.Fraction(0)]

    def run():
        result = call()
        acc[0] += extra
        while acc[0] >= 1:
            call()
            acc[0] -= 1
        return result

    run.multiple = extra.denominator
    return run


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


def calibrate(call: Callable[[], Any], target: float | None = None) -> int:
    """Loops per sample (pyperf's calibration): double until ``loops`` calls last >= ``target``.
    ``target`` defaults to :data:`pyengine._bench.stats.SAMPLE_S`, read at call time. The first call
    is a warm-up (JIT compilation) and is not timed."""
    target = _stats.SAMPLE_S if target is None else target
    call()
    loops = getattr(call, "multiple", 1)
    while loops < MAX_LOOPS:
        t0 = time.perf_counter()
        for _ in range(loops):
            call()
        if time.perf_counter() - t0 >= target:
            break
        loops *= 2
    return loops


def sample(call: Callable[[], Any], loops: int, n: int) -> list[float]:
    """``n`` samples, each the mean per-call time of ``loops`` back-to-back calls."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        for _ in range(loops):
            call()
        out.append((time.perf_counter() - t0) / loops)
    return out


def limit_probe(limit: str, dtype: str, quick: bool) -> Callable[[], float] | None:
    """A short measurement of the machine limit a case is normalized by, to run right next to
    it (``limit`` = "bandwidth": copy bytes/s; "gemm": flop/s in ``dtype``; "none": None).
    Each probe call takes the best of 3 short timings (a limit is a best case)."""
    if limit == "bandwidth":
        src = np.ones((16 if quick else 64) << 20, np.uint8)
        dst = np.zeros_like(src)
        core = None
        if backends.available_backends()["cpp"].available:
            from pyengine import _core as core
        copy = (lambda: core.stream_copy(src, dst)) if core is not None else (lambda: np.copyto(dst, src))
        work = 2.0 * src.nbytes
    elif limit == "gemm":
        k = 384 if quick else 768
        a = np.random.default_rng(0).standard_normal((k, k)).astype(dtype)
        copy, work = (lambda: a @ a), 2.0 * k**3
    elif limit == "none":
        return None
    else:
        raise ValueError(f"limit must be 'bandwidth', 'gemm' or 'none'; got {limit!r}")
    copy()

    def probe() -> float:
        return work / min(sample(copy, 1, 3))

    return probe
