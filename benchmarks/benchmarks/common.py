"""Shared asv machinery: the backend/dtype grid, the base class of the kernel suites (seeded
data, warm-up, unavailable backends skipped) and timing helpers."""

from __future__ import annotations

import time

import numpy as np

from pyengine import backends

BACKENDS = list(backends.BACKENDS)
DTYPES = ["float32", "float64"]
#: tokens x d_model of the streaming kernels.
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
    (``pyengine.bench.time_alternated``), so that a slow spell of the machine falls on both. For
    short calls whose ratio is a target: timed in blocks (``median_time`` of one, then of the
    other), the same ratio spread several times wider."""
    from pyengine.bench import time_alternated

    ts = time_alternated({"num": num, "den": den}, rounds)
    return float(np.median(ts["num"]) / np.median(ts["den"]))


class KernelBenchmark:
    """Base of the suites whose first parameter is the backend (then, mostly, dtype and size).

    A subclass sets ``params`` / ``param_names`` (these defaults: backend x dtype x
    :data:`SHAPES`) and implements :meth:`make`. ``setup`` skips a backend that cannot load
    (asv: ``NotImplementedError``), builds the data from ``default_rng(seed)`` through
    :meth:`make`, which returns the call to time, and makes one warm-up call (kept as
    ``self.result``), so that JIT compilation and first-touch page faults are not timed.
    """

    params = [BACKENDS, DTYPES, SHAPES]
    param_names = ["backend", "dtype", "shape"]
    timeout = 600
    seed = 0

    def make(self, rng: np.random.Generator, backend: str, *params):
        """The call to time, without arguments; may raise ``NotImplementedError`` to skip a case."""
        raise NotImplementedError

    def setup(self, backend, *params):
        require_backend(backend)
        self.backend = backend
        self.call = self.make(np.random.default_rng(self.seed), backend, *params)
        self.result = self.call()  # warm-up: JIT compilation and first-touch page faults are not timed


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
