"""Finds NumPy's BLAS for the C++ linear kernels (``csrc/bind_linear.hpp`` calls :func:`find` once).

The compiled dense-layer kernels call the CBLAS ``sgemm``/``dgemm`` of the library NumPy
already loaded, single-threaded in each of their own OpenMP threads
(``openblas_set_num_threads_local``, OpenBLAS >= 0.3.27), so nothing is linked or
installed. threadpoolctl names the library; ctypes gives the addresses. Anything else
(MKL, Accelerate, BLIS, an older OpenBLAS, symbols not found) returns null pointers and the
reason, and the kernels fall back to ``numpy.matmul`` plus a separate epilogue pass.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["find"]

#: (sgemm, dgemm, ILP64) symbol names, in the order tried: NumPy >= 2's scipy_openblas64,
#: the openblas64_ of NumPy 1.2x wheels, then LP64 builds.
_NAMES = (
    ("scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_", True),
    ("cblas_sgemm64_", "cblas_dgemm64_", True),
    ("scipy_cblas_sgemm", "scipy_cblas_dgemm", False),
    ("cblas_sgemm", "cblas_dgemm", False),
)
_LOCAL = ("openblas_set_num_threads_local", "scipy_openblas_set_num_threads_local")


def _address(lib: ctypes.CDLL, name: str) -> int:
    try:
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0
    except AttributeError:
        return 0


def find() -> tuple[int, int, int, bool, str]:
    """(sgemm, dgemm, set_num_threads_local addresses, ILP64, description); zeros if not usable."""
    import numpy  # (loads the library)
    import threadpoolctl

    none = "numpy matmul + separate epilogue"
    infos = [i for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas"]
    if not infos:
        return 0, 0, 0, False, f"{none} (no BLAS library found in the process)"
    # NumPy's own library first, whatever else is loaded (SciPy ships a second OpenBLAS):
    # the products the block engine replaces are NumPy's, and the choice must not depend
    # on import order.
    here = os.path.dirname(os.path.abspath(numpy.__file__))
    ours = (here + os.sep, os.path.join(os.path.dirname(here), "numpy.libs") + os.sep)
    info = min(infos, key=lambda i: not os.path.abspath(i["filepath"]).startswith(ours))
    if info.get("internal_api") != "openblas":
        return 0, 0, 0, False, f"{none} (NumPy's BLAS is {info.get('internal_api')}, not OpenBLAS)"
    path = info["filepath"]
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:  # pragma: no cover - the library is loaded already
        return 0, 0, 0, False, f"{none} ({path}: {exc})"
    local = next((a for a in map(lambda n: _address(lib, n), _LOCAL) if a), 0)
    if not local:
        return 0, 0, 0, False, f"{none} (OpenBLAS {info.get('version')} has no openblas_set_num_threads_local)"
    for s, d, ilp64 in _NAMES:
        sa, da = _address(lib, s), _address(lib, d)
        if sa and da:
            return sa, da, local, ilp64, (
                f"OpenBLAS {info.get('version')} ({s}, single-threaded per tile in pyengine's threads)")
    return 0, 0, 0, False, f"{none} (no CBLAS gemm symbols in {path})"
