"""asv suites for perturbation propagation (pyengine.propagate) and `pyengine recovery`.

The propagation targets are ratios measured in one process, GPT-2-small shaped, float32:
exact propagation costs at most 1.3x its own matrix products executed alone
(``track_exact_over_gemms``), linearized at most 1.3x exact
(``track_linearized_over_exact``), and injecting on a span that starts mid-sequence
skips the rows before it (``track_span_speedup``: all positions / span). The
target's K = 64 perturbations and 12 layers are cut to K = 16 and 4 layers to keep
a run short; the ratios are per layer and barely depend on either. The comparison
with PyTorch (which is not a dependency) is ``benchmarks/scripts/torch_compare.py``.
"""

from __future__ import annotations

import numpy as np

import pyengine as pe

from .bench_model import D_MLP, D_MODEL, N_HEADS, gemm_operands
from .common import median_time

PERTURBATIONS, TOKENS, N_BLOCKS = 16, 128, 4


def _setup(self) -> None:
    cfg = pe.StackConfig(d_model=D_MODEL, n_heads=N_HEADS, d_mlp=D_MLP, n_layers=N_BLOCKS, vocab_size=256,
                         activation="gelu_tanh", positions="learned", max_seq_len=TOKENS)
    self.stack = pe.init_weights(cfg, "gpt2", seed=0, dtype=np.float32, bias_std=0.02)
    rng = np.random.default_rng(0)
    self.ids = rng.integers(0, 256, TOKENS)
    self.v = rng.standard_normal((PERTURBATIONS, D_MODEL))
    self.ops = gemm_operands(self.stack, PERTURBATIONS, TOKENS)
    self.time_exact_all()  # warm-up: kernels compiled, weights prepared


class Propagate:
    """K = PERTURBATIONS directions injected at hidden state 0 of a GPT-2-small-shaped stack."""

    timeout = 600
    setup = _setup

    def time_exact_all(self):
        pe.propagate(self.stack, self.ids, self.v, 6.0, 0, "all")

    def time_exact_span(self):
        pe.propagate(self.stack, self.ids, self.v, 6.0, 0, slice(TOKENS // 2, None))

    def time_linearized_all(self):
        pe.propagate(self.stack, self.ids, self.v, 6.0, 0, "all", linearized=True)

    def time_gemms_only(self):
        for a, b in self.ops:
            np.matmul(a, b)

    def track_exact_over_gemms(self):
        return median_time(self.time_exact_all, 3) / median_time(self.time_gemms_only, 3)

    track_exact_over_gemms.unit = "ratio"

    def track_linearized_over_exact(self):
        return median_time(self.time_linearized_all, 3) / median_time(self.time_exact_all, 3)

    track_linearized_over_exact.unit = "ratio"

    def track_span_speedup(self):
        return median_time(self.time_exact_all, 3) / median_time(self.time_exact_span, 3)

    track_span_speedup.unit = "ratio"


class Recovery:
    """`pyengine recovery` on its built-in default model (target: under 60 s)."""

    timeout = 900
    number, repeat, rounds, warmup_time = 1, 1, 1, 0.0

    def setup(self):
        from pyengine.experiments import default_model

        self.model = default_model()

    def time_recovery_default(self):
        from pyengine.experiments import recovery

        recovery(self.model)
