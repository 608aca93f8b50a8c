"""GGUF tensor types that llama.cpp files commonly use (Q4_K, Q5_K, Q6_K, Q8_0, F16) read through
pyengine's GGUF reader, written with gguf's own writer. Q8_0 and F16 are quantized by gguf's
quantize(); gguf cannot quantize the K types, so their blocks are random bytes with finite f16
scales (every bit pattern of the other fields is a valid block)."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

from pyengine.models._gguf import GGUFFile  # noqa: E402

ROWS, COLS = 4, 512  # two 256-value super-blocks per row
#: byte offsets of the f16 scale fields in each K block (d, and dmin where there is one)
_F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _raw(kind, rng):
    T = gguf.GGMLQuantizationType[kind]
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    if kind in ("Q8_0", "F16"):
        return T, x, quantize(x, T)
    block, nbytes = gguf.GGML_QUANT_SIZES[T]
    raw = rng.integers(0, 256, (ROWS, COLS // block, nbytes), dtype=np.uint8)
    for off in _F16_FIELDS[kind]:
        scale = (0.01 + 0.02 * rng.random((ROWS, COLS // block))).astype(np.float16)
        raw[..., off: off + 2] = scale.view(np.uint8).reshape(ROWS, COLS // block, 2)
    return T, None, raw.reshape(ROWS, -1)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16"])
def test_gguf_types_dequantize(tmp_path, kind):
    rng = np.random.default_rng(0)
    T, x, raw = _raw(kind, rng)
    path = str(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_shape=raw.shape if kind == "F16" else None, raw_dtype=T)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = GGUFFile(path)
    assert g.tensors["blk.0.ffn_up.weight"][0] == (ROWS, COLS)
    a = g.tensor("blk.0.ffn_up.weight", (ROWS, COLS))
    assert a.dtype == np.float32 and a.shape == (ROWS, COLS) and np.all(np.isfinite(a))
    assert np.array_equal(a, dequantize(raw, T).astype(np.float32))
    assert np.std(a) > 0
    if x is not None:  # the quantization error of the type, against the original values
        assert np.max(np.abs(a - x)) <= (1e-3 if kind == "F16" else 0.05) * np.max(np.abs(x))
    with pytest.raises(ValueError, match="shape"):
        g.tensor("blk.0.ffn_up.weight", (COLS, ROWS))
