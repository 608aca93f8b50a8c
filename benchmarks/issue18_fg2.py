"""Issue 18 (helper fg2) measurements, one process; for a quiet machine:

    python benchmarks/issue18_fg2.py            (imports the installed pyengine)

Prints, each a median of repeated runs:
1. the float32 forward activations and the softmax against the same kernels on float64
   (the algorithm float32 input used before: double arithmetic), ns per element, C++
   and Numba, at (2048, 3072) and (128, 128, 128);
2. Numba / C++ of layer_norm, layer_norm_jvp, layer_norm_vjp at (8192, 4096) float32 with out=;
3. spectral_radius of I + W J_LN at d = 768 (random W: the complex-pair case), seconds per
   operator for 1 and 4 operators, with the dense LAPACK path and with ARPACK (the path
   before, forced by setting the dense range empty);
4. method="lanczos" on LayerNorm Jacobians, 256 tokens, d = 768: ms per token;
5. the Arnoldi path of spectral_radius (forced) asked for 1 eigenvalue (ncv 20, as before
   2026-12-05) and for ARNOLDI_WANTED (ncv ARNOLDI_NCV) on 40 random I + W J_LN at d = 768:
   how often it misses the radius numpy.linalg.eigvals gives, products and seconds
   (``python benchmarks/issue18_fg2.py arnoldi`` runs this part alone; pass a width to change d).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import pyengine as pe
from pyengine.bench import time_alternated
from pyengine.kernels import activations as pa
from pyengine.linalg import _dense_radius


def med(f, n):
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def activations() -> None:
    rng = np.random.default_rng(0)
    for be in ("cpp", "numba"):
        for name, shape in (("gelu", (2048, 3072)), ("gelu_tanh", (2048, 3072)), ("silu_gated", (2048, 6144)),
                            ("softmax", (128, 128, 128))):
            t = {}
            for dt in (np.float32, np.float64):
                x = (3.0 * rng.standard_normal(shape)).astype(dt)
                k = pa.kernel(name, be)
                if name == "softmax":
                    out = np.empty_like(x)
                    t[dt] = med(lambda: k(x, 10**9, out), 15) / x.size
                else:
                    out = np.empty((shape[0], shape[1] // 2 if name == "silu_gated" else shape[1]), dt)
                    t[dt] = med(lambda: k(x, out), 15) / out.size
            print(f"{be:5s} {name:10s} {str(shape):16s} float32 {t[np.float32] * 1e9:6.2f} ns/elt, "
                  f"float64 (the old float32 arithmetic) {t[np.float64] * 1e9:6.2f} ns/elt, "
                  f"speed-up {t[np.float64] / t[np.float32]:.2f}x")


def numba_vs_cpp() -> None:
    rng = np.random.default_rng(0)
    x = (1.0 + rng.standard_normal((8192, 4096))).astype(np.float32)
    g = rng.uniform(0.5, 1.5, 4096).astype(np.float32)
    v = rng.standard_normal(x.shape).astype(np.float32)
    out = np.empty_like(x)
    for k in ("layer_norm", "layer_norm_jvp", "layer_norm_vjp"):
        args = (x, v, g) if k != "layer_norm" else (x, g, np.zeros(4096, np.float32))
        fn = getattr(pe, k)
        ts = time_alternated({be: (lambda be=be: fn(*args, backend=be, out=out)) for be in ("numba", "cpp")}, 10)
        m = {be: statistics.median(t) for be, t in ts.items()}
        print(f"(8192, 4096) f32 out= {k:15s} numba {m['numba'] * 1e3:6.1f} ms, cpp {m['cpp'] * 1e3:6.1f} ms, "
              f"numba/cpp = {m['numba'] / m['cpp']:.2f}")


def ln_block(seed: int, d: int, batch: int, scale: float = 1.0):
    """I + W J_LN at ``batch`` random tokens, W random with entries of scale / sqrt(d): the operator
    and its dense matrices (batch, d, d) as a function (formed only where a reference is needed)."""
    rng = np.random.default_rng(seed)
    x, g = rng.standard_normal((batch, d)), rng.uniform(0.5, 1.5, d)
    W = scale * rng.standard_normal((d, d)) / np.sqrt(d)
    op = pe.Identity(d) + pe.DenseOperator(W) @ pe.LayerNormJacobian(x, g)
    return op, lambda: np.eye(d)[None] + W[None] @ pe.layer_norm_jacobian(x, g)


def radius() -> None:
    op, _ = ln_block(0, 768, 4)
    for label, hi in (("dense LAPACK", _dense_radius.DENSE_RADIUS_MAX), ("ARPACK", 0)):
        old = _dense_radius.DENSE_RADIUS_MAX
        _dense_radius.DENSE_RADIUS_MAX = hi
        try:
            for b in (1, 4):
                sub = op.take(np.arange(b))
                r = pe.spectral_radius(sub, tol=1e-8)
                t = med(lambda: pe.spectral_radius(sub, tol=1e-8), 3 if hi else 1)
                print(f"spectral_radius I + W J_LN d=768, {b} operator(s), {label:12s}: {t / b:.3f} s/operator, "
                      f"methods {sorted(set(r.method.tolist()))}, converged {r.all_converged}")
        finally:
            _dense_radius.DENSE_RADIUS_MAX = old


def lanczos() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 768)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, 768).astype(np.float32)
    t = med(lambda: pe.layer_norm_spectral_norm(x, g, method="lanczos"), 3)
    print(f"lanczos LN Jacobian d=768, 256 tokens: {t / 256 * 1e3:.2f} ms/token")


def arnoldi(d: int = 768, seeds: int = 20) -> None:
    from pyengine.linalg import _solvers

    settings = ((1, 20), (_solvers.ARNOLDI_WANTED, _solvers.ARNOLDI_NCV))
    stats = {s: ([], [], []) for s in settings}  # misses, products, seconds
    old = _dense_radius.DENSE_RADIUS_MAX, _solvers.ARNOLDI_WANTED, _solvers.ARNOLDI_NCV
    _dense_radius.DENSE_RADIUS_MAX = 0
    try:
        for seed in range(seeds):
            for scale in (1.0, 3.0):
                op, dense = ln_block(100 + seed, d, 1, scale)
                exact = np.abs(np.linalg.eigvals(dense()[0])).max()
                for s in settings:
                    _solvers.ARNOLDI_WANTED, _solvers.ARNOLDI_NCV = s
                    t = time.perf_counter()
                    r = pe.spectral_radius(op, tol=1e-8)
                    stats[s][2].append(time.perf_counter() - t)
                    stats[s][0].append(abs(r.rho[0] - exact) > 1e-9 * exact)
                    stats[s][1].append(int(r.iterations[0]))
    finally:
        _dense_radius.DENSE_RADIUS_MAX, _solvers.ARNOLDI_WANTED, _solvers.ARNOLDI_NCV = old
    for (k, ncv), (miss, prods, secs) in stats.items():
        print(f"spectral_radius by Arnoldi, d={d}, k={k:2d} ncv={ncv}: missed the radius on {sum(miss)} of "
              f"{len(miss)} operators; products median {statistics.median(prods):.0f} (max {max(prods)}), "
              f"seconds median {statistics.median(secs):.3f} (max {max(secs):.3f})")


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["arnoldi"]:
        arnoldi(*(int(a) for a in sys.argv[2:3]))
    else:
        activations()
        numba_vs_cpp()
        radius()
        lanczos()
        arnoldi()
