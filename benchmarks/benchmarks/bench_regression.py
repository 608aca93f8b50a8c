"""asv suite for regression checks with ``asv continuous``: small, quick, robust to load.

The per-family suites time the streaming shapes (8192 x 4096 and more) on every backend
and dtype; one ``asv continuous`` over one of them takes more than half an hour on the
2-core development machine, because ``--interleave-rounds`` reinstalls each build every
round. This suite times five kernels on every backend at one shape (2048 x 768 float32,
``out=`` preallocated). The recommended command (README, "Benchmarks (asv)"):

    asv continuous --interleave-rounds --factor 1.25 --split -b '^bench_regression\\.' A B

Why a ``track_`` figure and not asv's ``time_``: asv summarizes a ``time_`` benchmark by
the median of its samples. On a loaded 2-core host the samples of a multi-threaded kernel
are bimodal (0.6-0.9 ms when both threads run, 3-8 ms when one is descheduled), so the
median moves with the neighbours' load: a self-comparison of ``time_`` here flagged
``layer_norm`` cpp at x3.72. ``track_fastest`` reports what ``pyengine bench`` uses: the
fastest of 30 samples of calibrated length (loops doubled until a sample lasts 5 ms),
per call. A burst only ever adds time, so the fastest sample is the figure least
disturbed by the host. Each round (``rounds = 2``, interleaved between the builds)
measures it afresh; ``setup`` fixes glibc's malloc thresholds as ``pyengine bench``'s
processes do (see ``pyengine._bench.measure.steady_allocator``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

import numpy as np

import pyengine as pe

from .common import BACKENDS, require_backend

TOKENS, D = 2048, 768
#: Samples per round and the length a sample is calibrated to (seconds).
SAMPLES, SAMPLE_S = 30, 0.005


def _steady_allocator() -> None:
    """glibc's malloc thresholds pinned at their defaults (every block above 128 KiB mmapped)
    and no huge pages asked for, as pyengine bench's processes do (by hand here, so older
    builds are timed alike)."""
    from numpy._core import multiarray

    multiarray._set_madvise_hugepage(False)
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
    mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD


def _call(kernel: str, backend: str):
    rng = np.random.default_rng(0)
    x = (1.0 + rng.standard_normal((TOKENS, D))).astype(np.float32)
    v = rng.standard_normal((TOKENS, D)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, D).astype(np.float32)
    b = rng.standard_normal(D).astype(np.float32)
    out = np.empty_like(x)
    return {
        "layer_norm": lambda: pe.layer_norm(x, g, b, backend=backend, out=out),
        "layer_norm_jvp": lambda: pe.layer_norm_jvp(x, v, g, backend=backend, out=out),
        "rms_norm": lambda: pe.rms_norm(x, g, backend=backend, out=out),
        "softmax": lambda: pe.softmax(v, backend=backend, out=out),
        "gelu": lambda: pe.activation("gelu", v, backend=backend, out=out),
    }[kernel]


def _fastest(call) -> float:
    """Seconds per call: the fastest of SAMPLES samples of ``loops`` back-to-back calls,
    ``loops`` doubled until one sample lasts SAMPLE_S."""
    loops = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(loops):
            call()
        if time.perf_counter() - t0 >= SAMPLE_S or loops >= 1 << 16:
            break
        loops *= 2
    best = float("inf")
    for _ in range(SAMPLES):
        t0 = time.perf_counter()
        for _ in range(loops):
            call()
        best = min(best, (time.perf_counter() - t0) / loops)
    return best


class Kernels:
    params = [["layer_norm", "layer_norm_jvp", "rms_norm", "softmax", "gelu"], BACKENDS]
    param_names = ["kernel", "backend"]
    rounds = 2
    timeout = 300

    def setup(self, kernel, backend):
        require_backend(backend)
        _steady_allocator()
        self.call = _call(kernel, backend)
        self.call()  # JIT compilation and first-touch page faults are not timed

    def track_fastest(self, kernel, backend):
        return _fastest(self.call)

    track_fastest.unit = "seconds"
