"""Speed of the stability report and of the kernels it leans on, for a quiet machine.

    python benchmarks/scripts/stability_speed.py [--skip-report] [--skip-svd] [--only PART] [--depth 48]

Default (all but ``parts`` and ``ab``): weight drawing, 768 x 3072 float32, by
``init_matrix`` (float32 draws, CholeskyQR2 for the orthogonal scheme) against float64 draws
rounded to float32 and a Householder QR; Newton-Schulz at 768x768, 768x3072 and 4096x4096
float32 against its own matrix products alone and numpy.linalg.svd's polar factor at 4096; the
whole ``pyengine stability`` default run in a subprocess.

``--only parts`` times each stage of the default report in one process (the MLP signal
propagation, the transformer stacks, the all-MiniLM-L6-v2 spectra, the descent demo; the
model load apart). ``--only ab`` the MLP signal-propagation stage as the report runs it
(:func:`pyengine.experiments.stability.stability`: shared draws, batched settings) against one
draw per scheme and one run per norm setting, at ``--depth`` layers.

Prints wall-clock medians of repeated calls after a warm-up call (``pyengine.bench.time_call``)
and the mean CPU seconds of those calls.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import numpy as np

from pyengine.bench import time_call


def med(f, n=3):
    """(median wall seconds, mean CPU seconds) of ``n`` calls after a warm-up call."""
    c = time.process_time()
    wall = time_call(f, n)[0]
    return wall, (time.process_time() - c) / (n + 1)


def draws():
    from pyengine.models.initialization import init_matrix

    for scheme in ("kaiming_normal", "torch_default", "orthogonal"):
        old = med(lambda: _float64_draw(scheme))
        new = med(lambda: init_matrix(np.random.default_rng(0), scheme, 768, 3072, dtype=np.float32))
        print(f"draw 768x3072 {scheme:<15} float64 + Householder {old[0]:.3f} s  init_matrix {new[0]:.3f} s  "
              f"({old[0] / new[0]:.1f}x; cpu {old[1] / max(new[1], 1e-9):.1f}x)")


def _float64_draw(scheme):
    """The draw in float64, rounded to float32; the orthogonal factor by Householder QR."""
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


def _per_scheme_layers(depth, width, scheme, residual):
    """Per scheme its own draws, the float32 orthogonal factor computed in float64."""
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

    def per_setting():
        for r in (False, True):
            for s in SCHEMES:
                layers = _per_scheme_layers(depth, 768, s, r)
                for n in ("none", "layernorm"):
                    signal_propagation(s, depth, 768, 128, norm=n, residual=r, dtype=np.float32, layers=layers)

    def batched():
        stability(depth=depth, settings=SETTINGS, demo=False, gelu_check=False)

    for name, f in (("per setting", per_setting), ("batched", batched), ("per setting", per_setting),
                    ("batched", batched)):
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-report", action="store_true", help="skip the pyengine stability run")
    ap.add_argument("--skip-svd", action="store_true", help="skip numpy.linalg.svd at 4096")
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
