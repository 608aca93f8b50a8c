"""Issue 14 speed figures: weight drawing of the stability report (old: float64 draws rounded, Householder
orthogonal; new: float32 draws, CholeskyQR2), the whole ``pyengine stability`` default run, and Newton-Schulz
at 768x768, 768x3072, 4096x4096 float32 against its own matrix products alone and numpy.linalg.svd's polar
factor at 4096. Run on a quiet machine: ``python benchmarks/stability_speed.py [--skip-report] [--skip-svd]``.
Prints wall-clock medians (and CPU seconds) of repeats.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import numpy as np


def med(f, n=3):
    ws, cs = [], []
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time()
        f()
        ws.append(time.perf_counter() - t)
        cs.append(time.process_time() - c)
    return float(np.median(ws)), float(np.median(cs))


def draws():
    from pyengine.models.initialization import init_matrix

    for scheme in ("kaiming_normal", "torch_default", "orthogonal"):
        old = med(lambda: _old(scheme))
        new = med(lambda: init_matrix(np.random.default_rng(0), scheme, 768, 3072, dtype=np.float32))
        print(f"draw 768x3072 {scheme:<15} old {old[0]:.3f} s  new {new[0]:.3f} s  ({old[0] / new[0]:.1f}x; cpu "
              f"{old[1] / max(new[1], 1e-9):.1f}x)")


def _old(scheme):
    rng = np.random.default_rng(0)
    if scheme == "orthogonal":
        q, r = np.linalg.qr(rng.standard_normal((3072, 768)))
        return (q * np.sign(np.diag(r))).T.astype(np.float32)
    if scheme == "torch_default":
        return rng.uniform(-1 / np.sqrt(768), 1 / np.sqrt(768), (768, 3072)).astype(np.float32)
    return rng.normal(0.0, np.sqrt(2 / 768), (768, 3072)).astype(np.float32)


def newton_schulz(skip_svd):
    from pyengine.kernels.orthogonalize import orthogonalize

    for m, n in ((768, 768), (768, 3072), (4096, 4096)):
        g = np.random.default_rng(0).standard_normal((m, n)).astype(np.float32)
        orthogonalize(g)
        ns = med(lambda: orthogonalize(g), 5)

        def products():  # the same five quintic steps' products alone: A = X Xᵀ, A², (bA + cA²) X
            x = g / np.linalg.norm(g)
            for _ in range(5):
                a = x @ x.T if m <= n else x.T @ x
                p = -4.775 * a + 2.0315 * (a @ a)
                x = 3.4445 * x + (p @ x if m <= n else x @ p)
            return x

        mm = med(products, 5)
        line = f"newton_schulz {m}x{n} float32: {ns[0] * 1e3:.1f} ms, its products alone {mm[0] * 1e3:.1f} ms " \
               f"({ns[0] / mm[0]:.2f}x)"
        if m == 4096 and not skip_svd:
            def polar():
                u, _, vt = np.linalg.svd(g, full_matrices=False)
                return u @ vt

            sv = med(polar, 1)
            line += f"; numpy.linalg.svd polar factor {sv[0]:.2f} s ({sv[0] / ns[0]:.1f}x slower)"
        print(line, flush=True)


def report():
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pyengine", "stability", "--no-demo", "--out", d], check=True, cwd=d,
                       stdout=subprocess.DEVNULL, env={**os.environ})
        print(f"pyengine stability --no-demo (48 x 768 MLP stacks, T 128; 12 x 256 transformer stacks): "
              f"{time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-report", action="store_true")
    ap.add_argument("--skip-svd", action="store_true")
    ap.add_argument("--only", choices=("draws", "ns", "report"))
    a = ap.parse_args()
    if a.only in (None, "draws"):
        draws()
    if a.only in (None, "ns"):
        newton_schulz(a.skip_svd)
    if a.only in (None, "report") and not a.skip_report:
        report()
