"""What the measurement scripts share: timing through :mod:`pyengine.bench`, the GPT-2-small
stack they time, the CPU's name for the record, and access to the asv suites' helpers.

Run a script from the repository root, ``python benchmarks/scripts/NAME.py --help``; its
folder is then on ``sys.path`` and ``import _common`` finds this module.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pyengine.bench import time_alternated, time_call

#: The folder holding the asv package ``benchmarks`` (benchmarks/benchmarks/).
SUITES = Path(__file__).resolve().parents[1]
#: The repository's tests folder (the synthetic checkpoint writers live there).
TESTS = Path(__file__).resolve().parents[2] / "tests"


def use_suites() -> None:
    """Make ``import benchmarks`` (the asv suites) work from a script."""
    if str(SUITES) not in sys.path:
        sys.path.insert(0, str(SUITES))


def median_s(call: Callable[[], Any], repeat: int) -> float:
    """Median seconds of ``repeat`` calls after one untimed warm-up call (``pyengine.bench.time_call``)."""
    return time_call(call, repeat)[0]


def samples_s(call: Callable[[], Any], repeat: int) -> np.ndarray:
    """Seconds of each of ``repeat`` calls after one untimed warm-up call (``pyengine.bench.time_alternated``
    with one entry), for a median and a minimum."""
    return np.asarray(time_alternated({"call": call}, repeat)["call"])


def gpt2_small(layers: int = 12, tokens: int = 128, vocab: int = 256):
    """A seeded float32 stack of GPT-2-small blocks (d = 768, 12 heads, d_mlp = 3072, gelu_tanh,
    learned positions), the shapes the propagation targets are stated on."""
    import pyengine as pe

    cfg = pe.StackConfig(d_model=768, n_heads=12, d_mlp=3072, n_layers=layers, vocab_size=vocab,
                         activation="gelu_tanh", positions="learned", max_seq_len=tokens)
    return pe.init_weights(cfg, "gpt2", seed=0, dtype=np.float32, bias_std=0.02)


def cpu_name() -> str:
    """The CPU as /proc/cpuinfo names it (vendor and model), for the record: which BLAS is
    fastest, and so the ratios, depend on it."""
    from pyengine.kernels._blas import _cpu_vendor

    model = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            model = next((ln.partition(":")[2].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return " ".join(filter(None, (_cpu_vendor(), model))) or "unknown"
