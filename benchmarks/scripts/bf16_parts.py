"""Where the time of pyengine's bf16 path goes, each part timed alternated in one process.

    python -u benchmarks/scripts/bf16_parts.py [--rows 4096] [--rounds 7] [--k 64] [--no-propagate]

1. One dense layer of GPT-2 small (x (rows, 768) @ w (768, 3072)) on one thread:
   MKL's ``cblas_gemm_bf16bf16f32_compute`` alone on bf16 rows already converted, called
   on row tiles of 128 .. 1024 rows (the kernels' fixed tile is ``kPackedTileRows`` in
   csrc/linear.hpp), against pyengine's ``linear_bf16`` (conversion of each tile, compute,
   the row check) and MKL's float32 ``cblas_sgemm`` of the whole product.
2. The epilogue of the MLP's first layer on two threads: ``linear_act_bf16`` with
   ``gelu_tanh`` against no activation (both with the bias).
3. ``propagate(..., precision="bf16")`` split into its two runs (K directions at scale 6,
   GPT-2-small stack, T = 128): the bf16 run and its float32 check of direction 0 (the
   baseline forward and one perturbed sequence), all positions and the span from T/2.

Needs MKL as the linear kernels' BLAS and a CPU with AVX512-BF16 or AMX-BF16.
"""

from __future__ import annotations

import argparse
import ctypes

import numpy as np
from _common import gpt2_small

import pyengine as pe
from pyengine.bench import time_alternated
from pyengine.kernels import _blas, linear_bf16

ROW_MAJOR, NO_TRANS, PACKED, B_MATRIX = 101, 111, 151, 162
_GEMM_ARGS = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                   ctypes.c_float, ctypes.c_void_p, ctypes.c_int]


def _report(title: str, times: dict[str, list[float]], unit: float = 1e3) -> None:
    print(title)
    for name, v in times.items():
        print(f"  {name:<28} {unit * np.median(v):9.2f} ms (median; {unit * min(v):.2f}-{unit * max(v):.2f})")


def kernel_parts(rows: int, rounds: int) -> None:
    """Part 1: MKL's bf16 compute alone per tile height, pyengine's kernel, MKL's sgemm (one thread)."""
    lib = ctypes.CDLL(_blas._mkl_path())
    compute, sgemm = lib.cblas_gemm_bf16bf16f32_compute, lib.cblas_sgemm
    compute.argtypes = sgemm.argtypes = _GEMM_ARGS
    size, pack = lib.cblas_gemm_bf16bf16f32_pack_get_size, lib.cblas_gemm_bf16bf16f32_pack
    size.argtypes, size.restype = [ctypes.c_int] * 4, ctypes.c_size_t
    pack.argtypes = [ctypes.c_int] * 6 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    k, n = 768, 3072
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((k, n)) * 0.03).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    wb = (w.view(np.uint32) >> 16).astype(np.uint16)  # truncation: the timing does not depend on it
    xb = (x.view(np.uint32) >> 16).astype(np.uint16)
    wp = np.empty(size(B_MATRIX, 1, n, k), np.uint8)
    pack(ROW_MAJOR, B_MATRIX, NO_TRANS, 1, n, k, wb.ctypes.data, n, wp.ctypes.data)
    out = np.empty((rows, n), np.float32)

    def mkl_tiles(m):
        def call():
            for r0 in range(0, rows, m):
                mm = min(m, rows - r0)
                compute(ROW_MAJOR, NO_TRANS, PACKED, mm, n, k, 1.0, xb.ctypes.data + 2 * r0 * k, k, wp.ctypes.data, n,
                        0.0, out.ctypes.data + 4 * r0 * n, n)
        return call

    wpe = linear_bf16.pack(w).data
    f = linear_bf16.kernel("linear_bf16")
    calls = {f"MKL bf16 compute, {m}-row tiles": mkl_tiles(m) for m in (128, 256, 512, 1024)}
    calls["pyengine linear_bf16"] = lambda: f(x, wpe, None, None, out)
    calls["MKL sgemm (float32)"] = lambda: sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, rows, n, k, 1.0, x.ctypes.data, k,
                                                 w.ctypes.data, n, 0.0, out.ctypes.data, n)
    lib.MKL_Set_Num_Threads(1)
    with pe.num_threads(1):
        _report(f"1. x ({rows}, {k}) @ w ({k}, {n}), one thread", time_alternated(calls, rounds))


def epilogue(rows: int, rounds: int) -> None:
    """Part 2: the gelu_tanh epilogue of linear_act_bf16 (the threads pyengine uses)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, 768)).astype(np.float32)
    w = (rng.standard_normal((768, 3072)) * 0.03).astype(np.float32)
    b = rng.standard_normal(3072).astype(np.float32)
    wp, out = linear_bf16.pack(w).data, np.empty((rows, 3072), np.float32)
    f = linear_bf16.kernel("linear_act_bf16")
    calls = {act: (lambda act=act: f(x, wp, b, act, None, out)) for act in ("none", "gelu_tanh")}
    _report(f"2. linear_act_bf16 ({rows} rows, {pe.get_num_threads()} threads), bias + activation",
            time_alternated(calls, rounds))


def propagate_parts(K: int, rounds: int) -> None:
    """Part 3: the bf16 run and its float32 check, as propagate_request runs them."""
    from pyengine.analysis.propagate import propagate_request
    from pyengine.analysis.propagate_inputs import resolve_injection
    from pyengine.analysis.propagate_stages import check_request
    from pyengine.models import bf16_products

    stack, T = gpt2_small(), 128
    ids = np.random.default_rng(0).integers(0, 256, T)
    V = np.random.default_rng(1).standard_normal((K, 768))
    req = check_request(stack, resolve_injection(0, stack.config), V, 6.0, linearized=False, mode="full", dtype=None,
                        batch_size=None, progress=None)

    def run_bf16(pos):
        def call():
            with bf16_products():
                propagate_request(stack, ids, req, pos)
        return call

    def check(pos):
        return lambda: propagate_request(stack, ids, req._replace(V=req.V[:1], progress=None), pos)

    calls = {}
    for label, pos in (("all", "all"), ("span", slice(T // 2, None))):
        calls[f"bf16 run ({label})"] = run_bf16(pos)
        calls[f"float32 check ({label})"] = check(pos)
    times = time_alternated(calls, rounds)
    _report(f"3. propagate precision='bf16', K = {K}, T = {T}: the run and its check", times)
    for label in ("all", "span"):
        share = np.median(times[f"float32 check ({label})"]) / np.median(times[f"bf16 run ({label})"])
        print(f"  check / run ({label}): {share:.2f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--k", type=int, default=64, help="directions of the propagation (part 3)")
    ap.add_argument("--no-propagate", action="store_true", help="skip part 3 (the slowest)")
    args = ap.parse_args(argv)
    linear_bf16.require()
    print("bf16 products:", linear_bf16.info())
    kernel_parts(args.rows, args.rounds)
    epilogue(2 * args.rows, args.rounds)
    if not args.no_propagate:
        propagate_parts(args.k, max(2, args.rounds // 3))


if __name__ == "__main__":
    main()
