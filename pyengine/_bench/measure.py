"""Timing on a noisy host: calibrated loop counts, rounds of short samples, the
machine's limits re-measured next to each kernel, and the test-only slowdown switch.

Imports are absolute so the A/B worker can load this file against another build.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fractions
import importlib
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


#: glibc mallopt parameters (malloc.h) and glibc's default for both thresholds (128 KiB).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _THRESHOLD = -1, -3, 128 << 10


def steady_allocator() -> bool:
    """Pin this (benchmark) process's memory placement rules for the rest of its life:
    glibc's malloc thresholds and NumPy's huge-page requests. True if glibc's were pinned.

    Both are per-process state that made two identical A/B workers differ for a whole run:

    - glibc adapts its mmap threshold as blocks are freed (up to 32 MB), so whether a block
      of a few MB is mmapped (page-aligned, faulted afresh on every use) or carved from the
      heap (reused, at an address that depends on the process's history) differs between
      processes. Seen here: the NumPy layer_norm at 512 x 256 (1 MB temporaries) ran
      1.2-2x slower in one worker than in its twin, every round above 1.2. Setting the
      thresholds explicitly turns the adaptation off: every block above 128 KiB is mmapped
      in every process alike, so temporaries cost the same page faults on both sides and
      every kernel's arrays sit at the same offsets within their pages.
    - NumPy asks for transparent huge pages on arrays of 4 MB and more; whether the kernel
      grants them depends on memory fragmentation when the pages are first touched, so one
      worker's 2048 x 768 float32 arrays may be on huge pages and the other's not (seen:
      rms_norm numba x1.42 [1.19, 2.14] on a self-comparison). The bench processes ask for
      none, so every array is on 4 KiB pages in both.
    """
    try:
        from numpy._core import multiarray
    except ImportError:  # NumPy < 2
        from numpy.core import multiarray
    if hasattr(multiarray, "_set_madvise_hugepage"):
        multiarray._set_madvise_hugepage(False)
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _THRESHOLD))


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


def time_alternated(calls: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each of ``rounds`` calls of every entry of ``calls``, the entries called in
    turn (the order reversed every other round) after one untimed warm-up call each, so that a
    slow spell of the machine falls on all of them: for ratios measured side by side."""
    for call in calls.values():
        call()
    names = list(calls)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            calls[k]()
            times[k].append(time.perf_counter() - t0)
    return times


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


def _cpp_backend() -> Any:
    """The "cpp" backend's module (its ``stream_copy``), or None. An older build under A/B has no
    ``backends.backend_module``: its backend module is then imported by name, as the registry does."""
    find = getattr(backends, "backend_module", None)
    if find is not None:
        return find("cpp")
    return importlib.import_module("pyengine.kernels._cpp") if backends.available_backends()["cpp"].available else None


def limit_probe(limit: str, dtype: str, quick: bool) -> Callable[[], float] | None:
    """A short measurement of the machine limit a case is normalized by, to run right next to
    it (``limit`` = "bandwidth": copy bytes/s; "gemm": flop/s in ``dtype``; "none": None).
    Each probe call takes the best of 3 short timings (a limit is a best case)."""
    if limit == "bandwidth":
        src = np.ones((16 if quick else 64) << 20, np.uint8)
        dst = np.zeros_like(src)
        cpp = _cpp_backend()
        copy = (lambda: cpp.stream_copy(src, dst)) if cpp is not None else (lambda: np.copyto(dst, src))
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
