"""Issue 14 speed figures: weight drawing of the stability report (old: float64 draws rounded, Householder
orthogonal; new: float32 draws, CholeskyQR2), the whole ``pyengine stability`` default run, and Newton-Schulz
at 768x768, 768x3072, 4096x4096 float32 against its own matrix products alone and numpy.linalg.svd's polar
factor at 4096. Run on a quiet machine: ``python benchmarks/stability_speed.py [--skip-report] [--skip-svd]``.
Prints wall-clock medians (and CPU seconds) of repeats.

``--only parts`` times each part of the default report in one process (the MLP signal propagation,
the transformer stacks, the all-MiniLM-L6-v2 spectra, the descent demo; the model load apart), and
``--only ab`` the MLP signal-propagation part before and after the issue-14 speed work (before: one
draw per scheme, float32 orthogonal factored in float64 by CholeskyQR2, one run per norm setting;
after: :func:`pyengine.experiments.stability.stability`'s shared draws and batched settings), at
``--depth`` layers (default 48).
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


def parts():
    from pyengine.experiments.stability import STACK_PLACEMENTS, stability
    from pyengine.models.pretrained import load_pretrained

    t = time.perf_counter()
    try:
        model = load_pretrained("all-MiniLM-L6-v2")
    except (FileNotFoundError, ImportError) as e:
        print(f"all-MiniLM-L6-v2 not available ({e}): no spectra part")
        model = None
    print(f"load all-MiniLM-L6-v2: {time.perf_counter() - t:.2f} s")
    last = [time.perf_counter(), time.process_time()]

    def stage(name, result):
        now, cpu = time.perf_counter(), time.process_time()
        print(f"  {name:<20} {now - last[0]:6.2f} s (cpu {cpu - last[1]:.2f} s)", flush=True)
        last[:] = [now, cpu]

    rep = stability(model=model, placements=STACK_PLACEMENTS, on_stage=stage)
    print(f"stability(): {rep.seconds:.2f} s in all")


def _old_layers(depth, width, scheme, residual):
    """The weights as before: per scheme its own draws, float32 orthogonal factored in float64."""
    import math

    from pyengine.models import initialization as ini

    out = []
    for k in range(depth):
        rng = np.random.default_rng([0, k])
        shapes = [(width, 4 * width, 0.02), (4 * width, width, 0.02 / math.sqrt(2 * depth))] if residual else \
            [(width, width, 0.02)]
        mats = []
        for fi, fo, std in shapes:
            if scheme == "orthogonal":
                z = rng.standard_normal((max(fi, fo), min(fi, fo)), dtype=np.float32).astype(np.float64)
                q = ini._cholesky_qr2(z)
                mats.append((q if fi >= fo else q.T).astype(np.float32))
            else:
                mats.append(ini.init_matrix(rng, scheme, fi, fo, gpt2_std=std, dtype=np.float32))
        out.append(tuple(mats))
    return out


def ab(depth):
    from pyengine.analysis.stability import signal_propagation
    from pyengine.experiments.stability import SCHEMES, SETTINGS, stability

    def old():
        for r in (False, True):
            for s in SCHEMES:
                layers = _old_layers(depth, 768, s, r)
                for n in ("none", "layernorm"):
                    signal_propagation(s, depth, 768, 128, norm=n, residual=r, dtype=np.float32, layers=layers)

    def new():
        stability(depth=depth, settings=SETTINGS, demo=False, gelu_check=False)

    for name, f in (("before", old), ("after", new), ("before", old), ("after", new)):
        w, c = med(f, 1)
        print(f"MLP signal propagation {depth} x 768, T 128, 4 schemes x 4 settings, {name}: {w:.2f} s "
              f"(cpu {c:.2f} s)", flush=True)


def report():
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "pyengine", "stability", "--out", d], check=True, cwd=d,
                             stdout=subprocess.PIPE, text=True, env={**os.environ}).stdout
        inside = [ln for ln in out.splitlines() if ln.startswith("(") and ln.endswith(" s)")]
        print(f"pyengine stability, defaults (48 x 768 MLP stacks, T 128; 12 x 256 transformer stacks; "
              f"all-MiniLM-L6-v2 spectra; descent demo): {time.perf_counter() - t:.1f} s wall, "
              f"{inside[-1] if inside else '?'} inside the command")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-report", action="store_true")
    ap.add_argument("--skip-svd", action="store_true")
    ap.add_argument("--only", choices=("draws", "ns", "report", "parts", "ab"))
    ap.add_argument("--depth", type=int, default=48, help="layers of the --only ab stacks")
    a = ap.parse_args()
    if a.only == "parts":
        parts()
    if a.only == "ab":
        ab(a.depth)
    if a.only in (None, "draws"):
        draws()
    if a.only in (None, "ns"):
        newton_schulz(a.skip_svd)
    if a.only in (None, "report") and not a.skip_report:
        report()
