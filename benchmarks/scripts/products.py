"""The weight products of exact propagation (K = 64, T = 128, GPT-2-small: 8320 rows): the ``linear``
kernel (per-tile single-threaded BLAS in pyengine's threads, tiled as ``csrc/linear.hpp`` says)
against numpy.matmul (NumPy's threaded OpenBLAS) on the same operands, ``out=`` preallocated,
GFLOP/s best / median of --rounds alternated calls. ``PYENGINE_BLAS=mkl`` or ``openblas`` picks
the kernels' library. Run on a quiet machine: ``python benchmarks/scripts/products.py [--rounds 9]``."""

import argparse

import numpy as np

from pyengine.backends import resolve
from pyengine.bench import time_alternated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    lin, act = resolve("linear", "cpp"), resolve("linear_act", "cpp")
    rng = np.random.default_rng(0)
    for m, k, n in [(8320, 768, 3072), (8320, 3072, 768), (8320, 768, 2304), (8320, 768, 768)]:
        a = rng.standard_normal((m, k), dtype=np.float32)
        w = rng.standard_normal((k, n), dtype=np.float32) * 0.03
        c = np.empty((m, n), np.float32)
        fl = 2 * m * k * n
        bias = np.zeros(n, np.float32)
        calls = {"numpy": lambda: np.matmul(a, w, out=c), "linear": lambda: lin(a, w, None, None, c)}
        if n == 3072:
            calls["linear_act gelu_tanh"] = lambda: act(a, w, bias, "gelu_tanh", None, c)
        ts = time_alternated(calls, args.rounds)
        row = "   ".join(f"{name} {fl / min(t) / 1e9:6.1f} / {fl / float(np.median(t)) / 1e9:6.1f}"
                         for name, t in ts.items())
        print(f"{m}x{k} @ {k}x{n}: {row} GFLOP/s (best / median)", flush=True)


if __name__ == "__main__":
    main()
