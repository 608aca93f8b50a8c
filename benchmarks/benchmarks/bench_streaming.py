"""asv suite of streamed weights (``load_pretrained(folder, weights="mmap")``), small shapes.

The target: a streamed block runs its forward and its K-tangent JVP within 1.5x of the same
block on weights loaded as float32 (``track_forward_streamed_over_loaded``,
``track_jvp_streamed_over_loaded``; the two models side by side, alternated). The checkpoint is
Llama-shaped bf16 with d = 1024, GQA 8/2, d_mlp = 4096 and 4 blocks (about 50 MB of float32
weights a block); the 8B-shaped figures come from ``benchmarks/scripts/streaming_8b.py``.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import numpy as np

from .common import interleaved_ratio

TOKENS, TANGENTS = 128, 8


def _settled() -> None:
    """Wait for a read still running ahead, so that it is not timed with the other model."""
    for t in threading.enumerate():
        if t.name.startswith("pyengine-read-ahead"):
            t.join()


class Streaming:
    timeout = 600

    def setup_cache(self):
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
        from test_streaming import write_bf16_llama

        return write_bf16_llama(os.path.abspath("streaming-llama-bf16"), d=1024, H=8, Hkv=2, L=4, n=4096, V=64)

    def setup(self, folder):
        from pyengine.models.pretrained import load_pretrained

        self.full, self.lazy = load_pretrained(folder), load_pretrained(folder, weights="mmap")
        self.hs = self.full.hidden_states(np.arange(TOKENS) % 64)
        self.u = np.random.default_rng(0).standard_normal((TANGENTS,) + self.hs[0].shape).astype(np.float32)

    def _forward(self, m):
        def run():
            h = self.hs[0]
            for k in range(len(self.hs) - 1):
                h = m.block_forward(k, h)
            _settled()
        return run

    def _jvp(self, m):
        def run():
            for k in range(len(self.hs) - 1):
                m.block_jvp(k, self.hs[k], self.u)
            _settled()
        return run

    def track_forward_streamed_over_loaded(self, folder):
        return interleaved_ratio(self._forward(self.lazy), self._forward(self.full), rounds=5)

    def track_jvp_streamed_over_loaded(self, folder):
        return interleaved_ratio(self._jvp(self.lazy), self._jvp(self.full), rounds=5)
