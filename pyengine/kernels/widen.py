"""bf16 weights widened, transposed and placed in one pass: the reader of streamed checkpoints.

A bf16 number is the top 16 bits of the float32 with the same value, so widening is a
shift and exact (and so is the float32 -> float64 step after it). An HF ``Linear`` weight
is stored (out, in); a Stack stores its transpose, with several such weights side by side
(``w_qkv`` = [q | k | v], ``w_in`` = [gate | up]). :func:`bf16_transpose_into` writes the
widened transpose of one stored weight straight into its columns of the final array, so
no uint32, float32, concatenated or transposed intermediate is made. The NumPy
specification is ``out[:, col:col + o] = (bits.astype(np.uint32) << 16).view(np.float32).T``.
"""

from __future__ import annotations

import numpy as np

from ._numba._jit import nogil_jit

__all__ = ["bf16_transpose_into"]

#: Tile (rows of the stored weight x its columns): the tile's source rows stay in L1 while
#: its transpose is written out row by row.
_ROWS, _COLS = 64, 128
#: The exponent bits of a bf16 number; all ones: Inf or NaN.
_EXPONENT = 0x7F80


@nogil_jit
def _widen_t(bits, out, col):  # pragma: no cover - compiled; NUMBA_DISABLE_JIT runs it as Python
    """Each tile widened to float32 (the shift), transposed in L1, then written (converted to float64
    exactly if ``out`` is float64). Returns the largest exponent field seen."""
    o, i = bits.shape
    tile = np.empty(_ROWS * _COLS, np.uint32)
    wide = tile.view(np.float32)
    top = np.uint32(0)
    for r0 in range(0, o, _ROWS):
        r1 = min(r0 + _ROWS, o)
        for q0 in range(0, i, _COLS):
            q1 = min(q0 + _COLS, i)
            for r in range(r0, r1):
                for q in range(q0, q1):
                    u = np.uint32(bits[r, q])
                    top = max(top, u & np.uint32(_EXPONENT))
                    tile[(q - q0) * _ROWS + (r - r0)] = u << np.uint32(16)
            for q in range(q0, q1):
                for r in range(r0, r1):
                    out[q, col + r] = wide[(q - q0) * _ROWS + (r - r0)]
    return top


def bf16_transpose_into(bits: np.ndarray, out: np.ndarray, col: int = 0) -> bool:
    """Write the widened transpose of a bf16 matrix into columns of ``out``; whether it is all finite.

    Parameters
    ----------
    bits : ndarray of uint16, shape (o, i), C-contiguous
        The bf16 numbers as stored (for example a memory map of a safetensors tensor). Not modified.
    out : ndarray of float32 or float64, shape (i, n), C-contiguous, writeable
        Receives ``out[:, col:col + o]``, bit for bit the NumPy widening of ``bits.T``;
        its other columns are left as they are.
    col : int
        First column of ``out`` to write, ``0 <= col <= n - o``.

    Returns
    -------
    bool
        True when no entry of ``bits`` is Inf or NaN (the caller decides what else means).
    """
    if not (isinstance(bits, np.ndarray) and bits.dtype == np.uint16 and bits.ndim == 2
            and bits.flags.c_contiguous):
        raise TypeError(f"bits must be a C-contiguous 2-D uint16 array; got {getattr(bits, 'dtype', type(bits))}")
    if not (isinstance(out, np.ndarray) and out.dtype in (np.float32, np.float64) and out.ndim == 2
            and out.flags.c_contiguous and out.flags.writeable):
        raise TypeError("out must be a writeable C-contiguous 2-D float32 or float64 array")
    o, i = bits.shape
    if out.shape[0] != i or not 0 <= col <= out.shape[1] - o:
        raise ValueError(f"out of shape {out.shape} has no columns {col}..{col + o} of {i} rows for bits {bits.shape}")
    top = _widen_t(bits.view(np.ndarray), out, col)  # a np.memmap as a plain array (what it is compiled for)
    return bool(top < _EXPONENT)
