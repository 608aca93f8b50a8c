"""The scaffolding of the scans of :mod:`pyengine.linalg.spectral`: start vectors, chunks, result arrays.

Private to :mod:`pyengine.linalg.spectral`. Start vectors are drawn from a counter-based
generator (Philox) keyed by ``seed`` and positioned by the *global* index of the operator
(token), so the results do not depend on how a scan is split into chunks, and a seed
reproduces them bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import _validate as _v
from .operators import BatchedOperator


def _seed_key(seed: Any) -> np.ndarray:
    """The Philox key of ``seed`` (None: fresh entropy; otherwise a non-negative int)."""
    return np.random.SeedSequence(_v.seed(seed)).generate_state(2, np.uint64)


def _start_vectors(key: np.ndarray, first: int, count: int, n: int) -> np.ndarray:
    """Unit Gaussian start vectors of operators ``first .. first+count-1``, (count, n) float64.

    Each operator i owns a fixed stretch of the Philox stream (counter offset
    ``i * per``), so its vector depends only on (seed, i), not on the chunk it is in.
    """
    raw_per = 4 * (-(-(n + (n & 1)) // 4))  # n rounded up to even, then to whole Philox blocks
    bg = np.random.Philox(key=key, counter=first * (raw_per // 4))
    raw = bg.random_raw(count * raw_per).reshape(count, raw_per)[:, : n + (n & 1)]
    u = (raw >> np.uint64(11)).astype(np.float64) * 2.0**-53  # [0, 1)
    rad = np.sqrt(-2.0 * np.log1p(-u[:, 0::2]))  # Box-Muller on (0, 1]
    ang = 2.0 * np.pi * u[:, 1::2]
    z = np.empty((count, n + (n & 1)))
    z[:, 0::2], z[:, 1::2] = rad * np.cos(ang), rad * np.sin(ang)
    z = z[:, :n]
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    return z


def _empty_result(shape, tol, method) -> dict[str, np.ndarray]:
    return {
        "sigma": np.zeros(shape), "lower": np.zeros(shape), "upper": np.full(shape, np.inf),
        "residual": np.full(shape, np.inf), "iterations": np.zeros(shape, np.int64),
        "converged": np.zeros(shape, bool), "method": np.full(shape, method, dtype="<U7"),
    }


def _chunks(total: int, size: int) -> Iterator[tuple[int, int]]:
    for lo in range(0, total, size):
        yield lo, min(total, lo + size)


def _slice_op(op: BatchedOperator, lo: int, hi: int) -> BatchedOperator:
    return op if (lo, hi) == (0, op.batch) else op.take(np.arange(lo, hi))
