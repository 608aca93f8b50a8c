"""Shared asv machinery: the backend/dtype grid, seeded data, warm-up, timing helpers."""

from __future__ import annotations

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


def copy_bandwidth(nbytes: int, repeat: int = 10) -> float:
    """The machine's all-threads streaming copy bandwidth, bytes moved (read + write) per second."""
    from pyengine.bench import copy_bandwidth as probe

    return probe(nbytes, repeat)


def camel(kernel: str) -> str:
    return "".join(part.capitalize() for part in kernel.split("_"))
