"""Spectral solvers and the float32 kernels they run on, in one process; for a quiet machine.

    python benchmarks/scripts/spectra.py [PART ...]      PART: activations, norms, radius, lanczos, arnoldi
    python benchmarks/scripts/spectra.py arnoldi --d 768 --seeds 20

Prints, each a median of repeated calls after a warm-up call:

- ``activations``: the float32 forward activations and the softmax against the same kernels on
  float64 input, ns per element, C++ and Numba, at (2048, 3072) and (128, 128, 128);
- ``norms``: Numba / C++ of layer_norm, layer_norm_jvp, layer_norm_vjp at (8192, 4096) float32
  with out= (alternated calls);
- ``radius``: spectral_radius of I + W J_LN at d = 768 (random W: the complex-pair case),
  seconds per operator for 1 and 4 operators, by the dense LAPACK path and by ARPACK (forced
  by setting the dense range empty);
- ``lanczos``: method="lanczos" on LayerNorm Jacobians, 256 tokens, d = 768: ms per token;
- ``arnoldi``: the Arnoldi path of spectral_radius (forced) asked for 1 eigenvalue (ncv 20) and
  for ARNOLDI_WANTED (ncv ARNOLDI_NCV) on 2 x ``--seeds`` random I + W J_LN at width ``--d``:
  how often it misses the radius numpy.linalg.eigvals gives, products and seconds.

Without PART, all five run.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from _common import median_s

import pyengine as pe
from pyengine.bench import time_alternated
from pyengine.kernels import activations as pa
from pyengine.linalg import _dense_radius

PARTS = ("activations", "norms", "radius", "lanczos", "arnoldi")


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
                    t[dt] = median_s(lambda: k(x, 10**9, out), 15) / x.size
                else:
                    out = np.empty((shape[0], shape[1] // 2 if name == "silu_gated" else shape[1]), dt)
                    t[dt] = median_s(lambda: k(x, out), 15) / out.size
            print(f"{be:5s} {name:10s} {str(shape):16s} float32 {t[np.float32] * 1e9:6.2f} ns/elt, "
                  f"float64 {t[np.float64] * 1e9:6.2f} ns/elt, "
                  f"speed-up {t[np.float64] / t[np.float32]:.2f}x")


def norms() -> None:
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
                t = median_s(lambda: pe.spectral_radius(sub, tol=1e-8), 3 if hi else 1)
                print(f"spectral_radius I + W J_LN d=768, {b} operator(s), {label:12s}: {t / b:.3f} s/operator, "
                      f"methods {sorted(set(r.method.tolist()))}, converged {r.all_converged}")
        finally:
            _dense_radius.DENSE_RADIUS_MAX = old


def lanczos() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 768)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, 768).astype(np.float32)
    t = median_s(lambda: pe.layer_norm_spectral_norm(x, g, method="lanczos"), 3)
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
                    out = {}

                    def call(op=op):
                        out["r"] = pe.spectral_radius(op, tol=1e-8)

                    stats[s][2].append(median_s(call, 1))
                    r = out["r"]
                    stats[s][0].append(abs(r.rho[0] - exact) > 1e-9 * exact)
                    stats[s][1].append(int(r.iterations[0]))
    finally:
        _dense_radius.DENSE_RADIUS_MAX, _solvers.ARNOLDI_WANTED, _solvers.ARNOLDI_NCV = old
    for (k, ncv), (miss, prods, secs) in stats.items():
        print(f"spectral_radius by Arnoldi, d={d}, k={k:2d} ncv={ncv}: missed the radius on {sum(miss)} of "
              f"{len(miss)} operators; products median {statistics.median(prods):.0f} (max {max(prods)}), "
              f"seconds median {statistics.median(secs):.3f} (max {max(secs):.3f})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("parts", nargs="*", metavar="PART", help=f"any of {', '.join(PARTS)} (default: all)")
    ap.add_argument("--d", type=int, default=768, help="width of the arnoldi part")
    ap.add_argument("--seeds", type=int, default=20, help="random blocks per scale of the arnoldi part")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    for part in args.parts or PARTS:
        if part == "arnoldi":
            arnoldi(args.d, args.seeds)
        else:
            globals()[part]()


if __name__ == "__main__":
    main()
