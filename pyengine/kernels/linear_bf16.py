"""Dense layers with bf16 operands and float32 accumulation: the opt-in reduced-precision products.

``x @ w`` is computed by MKL's ``cblas_gemm_bf16bf16f32`` (AVX512-BF16 / AMX-BF16
instructions): ``w`` is rounded to bf16 and packed by MKL once (:func:`pack`, kept by the
caller next to the float32 weight), each row tile of ``x`` is rounded to bf16 (round to
nearest even) as it is packed, the products are summed in float32, and the epilogue of
:mod:`pyengine.kernels.linear` (bias, residual, activation, coefficient) runs in float32 on
the float32 result (``gelu_tanh`` with float arithmetic throughout, its argument too:
relative error <= 1e-5, at half the cost of ``linear_act``'s, whose argument is in double). Compiled kernels only (``"cpp"``): ``linear_bf16``, ``linear_act_bf16``,
``linear_mul_bf16`` take the float32 arguments of ``linear``, ``linear_act``, ``linear_mul``
with the packed weight in place of ``w``.

Refused, with one line saying why (:func:`unavailable`, :func:`require`), where the CPU has
neither ``avx512_bf16`` nor ``amx_bf16``, where MKL is not the BLAS of the linear kernels
(the ``mkl`` extra, on an Intel CPU), or for float64: there is no silent fallback to an
emulated or float32 product. A bf16 product of k terms has a relative error of about
2^-8 (the operands' rounding), not 2^-24 * sqrt(k): callers measure the error of what
they compute against the float32 path (as :func:`pyengine.propagate` does).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends import available_backends, backend_module

__all__ = ["PackedWeight", "info", "kernel", "pack", "require", "unavailable"]

_KERNELS = ("linear_bf16", "linear_act_bf16", "linear_mul_bf16")


class PackedWeight:
    """A (k, n) float32 weight rounded to bf16 and packed by MKL for the bf16 kernels.

    ``data`` the opaque uint8 buffer (MKL's layout, larger than 2 k n bytes); ``shape`` (k, n).
    """

    __slots__ = ("data", "shape")

    def __init__(self, data: np.ndarray, shape: tuple[int, int]) -> None:
        self.data = data
        self.shape = shape

    def __repr__(self) -> str:
        return f"PackedWeight(shape={self.shape}, {self.data.nbytes} bytes)"


def unavailable(dtype: Any = np.float32) -> str | None:
    """Why bf16 products cannot run for ``dtype`` here, in one line; None when they can."""
    if np.dtype(dtype) != np.float32:
        return f"bf16 products take float32 operands and give float32 results; the compute dtype is {np.dtype(dtype)}"
    cpp = backend_module("cpp")
    if cpp is None:
        return f"the cpp backend is unavailable ({available_backends()['cpp'].reason})"
    if not cpp.linear_blas_ready():
        return f"the linear kernels' BLAS path is off ({cpp.linear_blas_info()})"
    if not cpp.linear_bf16_ready():
        return cpp.linear_bf16_info()
    return None


def require(dtype: Any = np.float32) -> None:
    """Raise ValueError with :func:`unavailable`'s reason unless bf16 products run for ``dtype``."""
    why = unavailable(dtype)
    if why is not None:
        raise ValueError(f"precision='bf16' refused: {why}")


def info() -> str:
    """The bf16 products' library and CPU features, or why they are unavailable."""
    cpp = backend_module("cpp")
    return "cpp backend unavailable" if cpp is None else cpp.linear_bf16_info()


def pack(w: np.ndarray) -> PackedWeight:
    """``w`` (k, n), float32, C-contiguous, rounded to bf16 and packed (call :func:`require` first)."""
    if not (isinstance(w, np.ndarray) and w.dtype == np.float32 and w.ndim == 2 and w.flags.c_contiguous):
        raise TypeError(f"w must be a C-contiguous 2-D float32 array; got {getattr(w, 'dtype', type(w))} "
                        f"{getattr(w, 'shape', '')}")
    return PackedWeight(backend_module("cpp").bf16_pack(w), (int(w.shape[0]), int(w.shape[1])))


def kernel(name: str):
    """The raw compiled kernel ``name`` (no validation; C-contiguous float32 arrays). Signatures::

        linear_bf16(x (N, k), wp: PackedWeight.data, b (n,) | None, r (N, n) | None, out (N, n)) -> int
        linear_act_bf16(x, wp, b | None, activation: str, u (N, n) | None, out (N, n)) -> int
        linear_mul_bf16(x (N, k), wp, coef (M, n), out (N, n)) -> int

    each returning the number of rows of the product holding NaN or Inf.
    """
    if name not in _KERNELS:
        raise ValueError(f"name must be one of {', '.join(_KERNELS)}; got {name!r}")
    require()
    return getattr(backend_module("cpp"), name)
