"""bf16_transpose_into: the widened transpose of every bf16 bit pattern, bit for bit the NumPy path
(uint32 shift, float32 view, cast, transpose), in float32 and float64, into columns of a larger array."""

from __future__ import annotations

import numpy as np
import pytest

from pyengine.kernels.widen import bf16_transpose_into


def numpy_widen(bits, dtype):
    with np.errstate(invalid="ignore"):  # signalling NaNs are quieted by the cast, as in the kernel
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(dtype).T


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(256, 256), (67, 131), (1, 5), (130, 1)])
def test_every_pattern_bit_for_bit(dtype, shape):
    rng = np.random.default_rng(0)
    every = np.arange(1 << 16, dtype=np.uint16)
    finite = every[(every & 0x7F80) != 0x7F80]
    pool = every if shape == (256, 256) else finite  # the 256 x 256 case holds each pattern once
    bits = (every if shape == (256, 256) else rng.choice(pool, shape)).reshape(shape)
    before = bits.copy()
    o, i = shape
    out = np.full((i, o + 7), -1.5, dtype)
    ok = bf16_transpose_into(bits, out, col=3)
    uint = np.uint32 if dtype == np.float32 else np.uint64
    assert np.array_equal(out[:, 3:3 + o].view(uint), np.ascontiguousarray(numpy_widen(bits, dtype)).view(uint))
    assert np.all(out[:, :3] == -1.5) and np.all(out[:, 3 + o:] == -1.5)  # other columns untouched
    assert np.array_equal(bits, before)
    assert ok is (shape != (256, 256))


@pytest.mark.parametrize("bad", [0x7F80, 0xFF80, 0x7FC1])
def test_non_finite_reported(bad):
    bits = np.full((70, 140), 0x3F80, np.uint16)  # 1.0
    bits[69, 139] = bad
    assert bf16_transpose_into(bits, np.empty((140, 70), np.float32)) is False
    bits[69, 139] = 0x0001  # a subnormal is finite
    assert bf16_transpose_into(bits, np.empty((140, 70), np.float32)) is True


def test_bad_arguments():
    bits = np.zeros((4, 3), np.uint16)
    with pytest.raises(TypeError, match="bits"):
        bf16_transpose_into(bits.astype(np.int16), np.empty((3, 4), np.float32))
    with pytest.raises(TypeError, match="bits"):
        bf16_transpose_into(np.zeros((3, 4), np.uint16).T, np.empty((3, 4), np.float32))
    with pytest.raises(TypeError, match="out"):
        bf16_transpose_into(bits, np.empty((3, 4), np.float16))
    with pytest.raises(TypeError, match="out"):
        bf16_transpose_into(bits, np.empty((4, 3), np.float32).T)
    with pytest.raises(ValueError, match="columns"):
        bf16_transpose_into(bits, np.empty((3, 6), np.float32), col=3)
    with pytest.raises(ValueError, match="columns"):
        bf16_transpose_into(bits, np.empty((4, 4), np.float32))
