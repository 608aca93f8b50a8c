"""The weight products of exact propagation (K = 64, T = 128, GPT-2-small: 8320 rows): the ``linear``
kernel (per-tile single-threaded OpenBLAS in pyengine's threads) against numpy.matmul (NumPy's
threaded OpenBLAS) on the same operands, ``out=`` preallocated, GFLOP/s best / median of 9.
Issue 18, stop 25: the tiling of ``csrc/linear.hpp``. Run on a quiet machine:
``python benchmarks/linear_tiles.py``."""

import time

import numpy as np

from pyengine.backends import resolve


def best(f, n=9):
    f()
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        t.append(time.perf_counter() - t0)
    return min(t), float(np.median(t))


def main() -> None:
    lin, act = resolve("linear", "cpp"), resolve("linear_act", "cpp")
    rng = np.random.default_rng(0)
    for m, k, n in [(8320, 768, 3072), (8320, 3072, 768), (8320, 768, 2304), (8320, 768, 768)]:
        a = rng.standard_normal((m, k), dtype=np.float32)
        w = rng.standard_normal((k, n), dtype=np.float32) * 0.03
        c = np.empty((m, n), np.float32)
        fl = 2 * m * k * n
        t1 = best(lambda: np.matmul(a, w, out=c))
        t2 = best(lambda: lin(a, w, None, None, c))
        row = (f"{m}x{k} @ {k}x{n}: numpy {fl / t1[0] / 1e9:6.1f} / {fl / t1[1] / 1e9:6.1f}   "
               f"linear {fl / t2[0] / 1e9:6.1f} / {fl / t2[1] / 1e9:6.1f}")
        if n == 3072:
            bias = np.zeros(n, np.float32)
            t3 = best(lambda: act(a, w, bias, "gelu_tanh", None, c))
            row += f"   linear_act gelu_tanh {fl / t3[0] / 1e9:6.1f} / {fl / t3[1] / 1e9:6.1f}"
        print(row + " GFLOP/s (best / median)", flush=True)


if __name__ == "__main__":
    main()
