"""Shared asv machinery: the backend/dtype grid, seeded data, warm-up, timing helpers."""

from __future__ import annotations

import time

import numpy as np

from pyengine import backends

BACKENDS = list(backends.BACKENDS)
DTYPES = ["float32", "float64"]
#: tokens x d_model of the streaming kernels (issue #2).
SHAPES = ["8192x768", "8192x4096", "512x16384"]


def shape_of(text: str) -> tuple[int, int]:
    tokens, d = text.split("x")
    return int(tokens), int(d)


def require_backend(name: str) -> None:
    """Skip (asv: NotImplementedError in setup) a backend that cannot load."""
    if not backends.available_backends()[name].available:
        raise NotImplementedError(f"backend {name} unavailable")


def median_time(fn, repeat: int = 10) -> float:
    """Median wall time of ``repeat`` calls after a warm-up (for track_* ratios measured in one process)."""
    from pyengine.bench import time_call

    return time_call(fn, repeat)[0]


def interleaved_ratio(num, den, rounds: int = 30) -> float:
    """median time of ``num`` / median time of ``den``, the two called alternately
    (``pyengine.bench.time_alternated``). For short calls whose ratio is a target: timed in
    blocks (``median_time`` of one, then of the other), the Numba/C++ (8192, 768)
    ``layer_norm`` row read 1.1-1.5 in ten blocks in a row, and 1.94 in one run of
    ``benchmarks/issue18_fg.py``, where 200 alternated calls gave 1.18-1.20 (2026-12-05)."""
    from pyengine.bench import time_alternated

    ts = time_alternated({"num": num, "den": den}, rounds)
    return float(np.median(ts["num"]) / np.median(ts["den"]))


def copy_bandwidth(nbytes: int, repeat: int = 10) -> float:
    """The machine's all-threads streaming copy bandwidth, bytes moved (read + write) per second."""
    from pyengine.bench import copy_bandwidth as probe

    return probe(nbytes, repeat)


def camel(kernel: str) -> str:
    return "".join(part.capitalize() for part in kernel.split("_"))


def fastest_per_call(call, samples: int, loops: int | None = None, sample_s: float = 0.005,
                     row_s: float | None = None, min_samples: int = 5) -> float:
    """Seconds per call: the fastest of ``samples`` samples of ``loops`` back-to-back calls.

    ``loops=None`` calibrates it as ``pyengine bench`` does: doubled until one sample lasts
    ``sample_s`` (at most 2^16 calls); then, with ``row_s``, a call so slow that a sample
    takes longer gets only as many samples as fit in ``row_s`` (at least ``min_samples``).
    A burst of other work only ever adds time, so the fastest sample is the figure least
    disturbed by the host. Written out here rather than taken from ``pyengine._bench``:
    asv also times older builds, which lack it.
    """
    if loops is None:
        loops = 1
        while True:
            t0 = time.perf_counter()
            for _ in range(loops):
                call()
            took = time.perf_counter() - t0
            if took >= sample_s or loops >= 1 << 16:
                break
            loops *= 2
        if row_s is not None:
            samples = max(min_samples, min(samples, int(row_s / took)))
    best = float("inf")
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(loops):
            call()
        best = min(best, (time.perf_counter() - t0) / loops)
    return best
