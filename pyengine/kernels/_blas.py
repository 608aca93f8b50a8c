"""Finds the BLAS of the C++ linear kernels (:mod:`pyengine.kernels._cpp` calls :func:`find` once and hands it over).

The compiled dense-layer kernels call a CBLAS ``sgemm``/``dgemm`` single-threaded in each of
their own OpenMP threads: MKL's, from the optional ``mkl`` package (the ``mkl`` extra;
Linux x86-64), with its threading layer set to sequential, when it is installed and the CPU
is Intel's (on AMD's its gemm measured slower than OpenBLAS's, see :func:`find`); otherwise
that of the OpenBLAS NumPy already loaded (``openblas_set_num_threads_local``, OpenBLAS >=
0.3.27), so nothing is linked. threadpoolctl names NumPy's library; ctypes gives the
addresses. Anything else (NumPy on MKL, Accelerate or BLIS, an older OpenBLAS, symbols not
found) returns null pointers and the reason, and the kernels fall back to ``numpy.matmul``
plus a separate epilogue pass. ``PYENGINE_BLAS=openblas`` (or ``mkl``) forces the choice.

:func:`find_bf16` gives MKL's bf16 gemm (``cblas_gemm_bf16bf16f32`` pack and compute) for the
opt-in bf16 kernels, only where MKL is the library found here and the CPU has AVX512-BF16 or
AMX-BF16; otherwise the reason, which the bf16 kernels raise with.

:func:`matmul_one_thread` is ``numpy.matmul`` with NumPy's OpenBLAS held to one thread for
the call, for the block engine's small products between pyengine kernels.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import threading
from typing import Any

import numpy as np

__all__ = ["cpu_flags", "find", "find_bf16", "matmul_one_thread"]

#: (sgemm, dgemm, ILP64) symbol names, in the order tried: NumPy >= 2's scipy_openblas64,
#: the openblas64_ of NumPy 1.2x wheels, then LP64 builds.
_NAMES = (
    ("scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_", True),
    ("cblas_sgemm64_", "cblas_dgemm64_", True),
    ("scipy_cblas_sgemm", "scipy_cblas_dgemm", False),
    ("cblas_sgemm", "cblas_dgemm", False),
)
_LOCAL = ("openblas_set_num_threads_local", "scipy_openblas_set_num_threads_local")
#: The environment variable that picks the library (see :func:`find`).
ENV = "PYENGINE_BLAS"


def _address(lib: ctypes.CDLL, name: str) -> int:
    try:
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0
    except AttributeError:
        return 0


def _numpy_openblas() -> tuple[ctypes.CDLL, dict, int] | str:
    """NumPy's OpenBLAS (library, threadpoolctl's info, openblas_set_num_threads_local), or why not."""
    import numpy  # (loads the library)
    import threadpoolctl

    infos = [i for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas"]
    if not infos:
        return "no BLAS library found in the process"
    # NumPy's own library first, whatever else is loaded (SciPy ships a second OpenBLAS):
    # the products the block engine replaces are NumPy's, and the choice must not depend
    # on import order.
    here = os.path.dirname(os.path.abspath(numpy.__file__))
    ours = (here + os.sep, os.path.join(os.path.dirname(here), "numpy.libs") + os.sep)
    info = min(infos, key=lambda i: not os.path.abspath(i["filepath"]).startswith(ours))
    if info.get("internal_api") != "openblas":
        return f"NumPy's BLAS is {info.get('internal_api')}, not OpenBLAS"
    path = info["filepath"]
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:  # pragma: no cover - the library is loaded already
        return f"{path}: {exc}"
    local = next((a for a in map(lambda n: _address(lib, n), _LOCAL) if a), 0)
    if not local:
        return f"OpenBLAS {info.get('version')} has no openblas_set_num_threads_local"
    return lib, info, local


def _mkl_path() -> str | None:
    """libmkl_rt of the ``mkl`` package (PyPI), if installed."""
    try:
        dist = importlib.metadata.distribution("mkl")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name.startswith("libmkl_rt.so"):
            path = str(dist.locate_file(f))
            if os.path.exists(path):
                return path
    return None


def _find_mkl() -> tuple[int, int, int, bool, str] | str:
    """MKL's LP64 CBLAS gemms, its threading layer set to sequential, or why not."""
    path = _mkl_path()
    if path is None:
        return "the mkl package is not installed"
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        return f"{path}: {exc}"
    layer = getattr(lib, "MKL_Set_Threading_Layer", None)
    s, d, local = (_address(lib, n) for n in ("cblas_sgemm", "cblas_dgemm", "MKL_Set_Num_Threads_Local"))
    if layer is None or not (s and d and local):
        return f"{path} lacks MKL_Set_Threading_Layer, cblas_sgemm/dgemm or MKL_Set_Num_Threads_Local"
    layer.argtypes, layer.restype = [ctypes.c_int], ctypes.c_int
    layer(1)  # MKL_THREADING_SEQUENTIAL (before MKL's first call): each call runs in its caller's thread
    buf = ctypes.create_string_buffer(256)
    getattr(lib, "MKL_Get_Version_String", lambda b, n: None)(buf, 256)
    text = buf.value.decode(errors="replace")  # "Intel(R) oneAPI Math Kernel Library Version 2026.2-Product ..."
    version = text.split("Version ", 1)[1].split("-")[0].split()[0] if "Version " in text else "?"
    return s, d, local, False, f"MKL {version} ({os.path.basename(path)}, sequential per tile in pyengine's threads)"


def _cpuinfo(field: str) -> str:
    """The first ``field : value`` of /proc/cpuinfo (``vendor_id``, ``flags``), or ``""`` if unknown."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(field):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def _cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``, ...), or ``""`` if unknown."""
    return _cpuinfo("vendor_id")


def find() -> tuple[int, int, int, bool, str]:
    """(sgemm, dgemm, set_num_threads_local addresses, ILP64, description); zeros if not usable.

    ``PYENGINE_BLAS`` (read here, once per process): ``auto`` (default) takes MKL from the
    ``mkl`` package when it is installed (the ``mkl`` extra) *and the CPU is Intel's*, else
    NumPy's OpenBLAS; ``openblas`` and ``mkl`` ask for one. MKL is the default on Intel
    only: on AMD its single-threaded sgemm measured slower than OpenBLAS's (docs/design.md). Either way only while NumPy's own BLAS is OpenBLAS (NumPy on MKL or
    Accelerate keeps ``numpy.matmul``: two copies of MKL in one process are not worth the risk).
    """
    none = "numpy matmul + separate epilogue"
    raw = os.environ.get(ENV, "auto")
    choice = raw.strip().lower() or "auto"
    if choice not in ("auto", "mkl", "openblas"):
        raise ValueError(f"{ENV} must be 'auto', 'mkl' or 'openblas'; got {raw!r}")
    got = _numpy_openblas()
    if isinstance(got, str):
        return 0, 0, 0, False, f"{none} ({got})"
    note = ""
    vendor = _cpu_vendor()
    if choice == "auto" and vendor != "GenuineIntel" and _mkl_path() is not None:
        note = f"; MKL installed but not used: CPU vendor {vendor or 'unknown'}, not GenuineIntel ({ENV}=mkl takes it)"
    elif choice != "openblas":
        mkl = _find_mkl()
        if not isinstance(mkl, str):
            return mkl
        if choice == "mkl":
            note = f"; {ENV}=mkl: {mkl}"
    lib, info, local = got
    for s, d, ilp64 in _NAMES:
        sa, da = _address(lib, s), _address(lib, d)
        if sa and da:
            return sa, da, local, ilp64, (
                f"OpenBLAS {info.get('version')} ({s}, single-threaded per tile in pyengine's threads{note})")
    return 0, 0, 0, False, f"{none} (no CBLAS gemm symbols in {info['filepath']})"


#: MKL's bf16 gemm (LP64, as the sgemm handed over): pack size, pack, compute.
_BF16_NAMES = ("cblas_gemm_bf16bf16f32_pack_get_size", "cblas_gemm_bf16bf16f32_pack",
               "cblas_gemm_bf16bf16f32_compute")
#: CPU flags (/proc/cpuinfo) of the hardware bf16 dot products; one of them is required.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty if unreadable)."""
    return set(_cpuinfo("flags").split())


def find_bf16(blas: str) -> tuple[int, int, int, str]:
    """(pack_get_size, pack, compute addresses, description) of MKL's bf16 gemm; zeros and the reason if refused.

    ``blas`` is :func:`find`'s description of the BLAS handed over: bf16 products need MKL
    to be that BLAS (its sequential threading layer and per-thread count are what the
    kernels rely on) and a CPU with AVX512-BF16 or AMX-BF16 (emulated bf16 would be slower
    than float32, so it is refused rather than used).
    """
    if not blas.startswith("MKL"):
        return 0, 0, 0, f"MKL is not the BLAS in use ({blas}); install the mkl extra on an Intel CPU"
    flags = cpu_flags()
    have = [f for f in BF16_FLAGS if f in flags]
    if not have:
        return 0, 0, 0, "the CPU has neither avx512_bf16 nor amx_bf16 (no hardware bf16 dot products)"
    path = _mkl_path()
    lib = ctypes.CDLL(path) if path else None
    addr = [_address(lib, n) for n in _BF16_NAMES] if lib is not None else [0, 0, 0]
    if not all(addr):
        return 0, 0, 0, f"{path} lacks {', '.join(_BF16_NAMES)}"
    return addr[0], addr[1], addr[2], f"{blas.split(' (')[0]} cblas_gemm_bf16bf16f32, packed weights ({', '.join(have)})"


_lock = threading.Lock()
_state: dict[str, Any] = {"set": None, "depth": 0, "saved": 0}


def _setter() -> Any:
    """``openblas_set_num_threads_local`` of NumPy's OpenBLAS as a ctypes function, or False."""
    if _state["set"] is None:
        got = _numpy_openblas()
        _state["set"] = False if isinstance(got, str) else ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(got[2])
    return _state["set"]


def matmul_one_thread(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``numpy.matmul(a, b, out=out)`` with NumPy's OpenBLAS on one thread for the call.

    Why: after a threaded product NumPy's OpenBLAS keeps its pthread pool spinning for a
    while, and the pyengine OpenMP kernels that follow share the two cores with it. In a
    cached one-sequence forward (T = 128, GPT-2 small) the scores ``q k^T`` woke the pool
    in every block and the weight products after them ran at ~90 instead of ~200 GFLOP/s:
    the forward took twice as long (docs/design.md). Meant for products too small to
    gain from a second thread. The float32 head products of the block engine come out bit
    for bit as with two threads (OpenBLAS splits a product by rows and columns); in general
    a product may round differently on one thread, as with any change of thread count.

    In NumPy's pthreads OpenBLAS the "local" count is the library's global one, so
    concurrent callers share one count: the first one in sets it, the last one out
    restores it (the same holds for the C++ kernels' ``blas_region``). Without NumPy's
    OpenBLAS this is ``numpy.matmul``.
    """
    setter = _setter()
    if not setter:
        return np.matmul(a, b, out=out)
    with _lock:
        if _state["depth"] == 0:
            _state["saved"] = setter(1)
        _state["depth"] += 1
    try:
        return np.matmul(a, b, out=out)
    finally:
        with _lock:
            _state["depth"] -= 1
            if _state["depth"] == 0:
                setter(_state["saved"])
