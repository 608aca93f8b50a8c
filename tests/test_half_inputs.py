"""NumPy float16 and ml_dtypes bfloat16 arrays as inputs: widened to float32 bit for bit (every
value of either is a float32), then computed as the float32 array would be; inputs unchanged."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import pyengine as pe
from pyengine import _validate as _v
from pyengine.models.interventions import Intervention

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = ml_dtypes.bfloat16


def test_every_bfloat16_and_float16_value_widens_bit_for_bit():
    bits = np.arange(2**16, dtype=np.uint16)
    bf = bits.view(BF16)
    wide = _v.widened(bf)
    assert wide.dtype == np.float32
    np.testing.assert_array_equal(wide.view(np.uint32), bits.astype(np.uint32) << 16)  # NaNs and Infs too
    h = bits.view(np.float16)
    wide = _v.widened(h)
    fin = np.isfinite(h)
    assert wide.dtype == np.float32 and np.array_equal(wide[fin].astype(np.float16), h[fin])
    np.testing.assert_array_equal(wide[fin], h[fin].astype(np.float64))  # exact: float64 of each value
    assert np.array_equal(np.isnan(wide), np.isnan(h)) and np.array_equal(np.isinf(wide), np.isinf(h))
    # a strided view, and every other dtype untouched
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(_v.widened(x.astype(BF16)[:, ::2]), x[:, ::2])
    assert _v.widened(x) is x and _v.widened(x.astype(np.int64)).dtype == np.int64


@pytest.mark.parametrize("half", [np.float16, BF16], ids=["float16", "bfloat16"])
def test_kernels_and_models_take_half_inputs(half):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 16)).astype(half)
    before = x.copy()
    x32 = x.astype(np.float32)
    np.testing.assert_array_equal(pe.layer_norm(x), pe.layer_norm(x32))
    assert pe.layer_norm(x).dtype == np.float32
    np.testing.assert_array_equal(pe.rms_norm_jvp(x, x[::-1]), pe.rms_norm_jvp(x32, x32[::-1]))
    cfg = pe.StackConfig(d_model=16, n_heads=2, n_layers=2, d_mlp=24, vocab_size=20, lm_head="tied",
                         positions="rotary", norm="rmsnorm", activation="silu_gated", max_seq_len=8)
    m = pe.init_weights(cfg, seed=1)
    np.testing.assert_array_equal(m.hidden_states(x), m.hidden_states(x32))
    np.testing.assert_array_equal(m.hidden_states(x, dtype=np.float64), m.hidden_states(x32, dtype=np.float64))
    np.testing.assert_array_equal(m.logits(x), m.logits(x32))
    ids = np.arange(5)
    v = rng.standard_normal(16).astype(half)
    np.testing.assert_array_equal(m.run(ids, [Intervention("blocks.1.resid_pre", "add", v)]),
                                  m.run(ids, [Intervention("blocks.1.resid_pre", "add", v.astype(np.float32))]))
    assert np.array_equal(x.view(np.uint16), before.view(np.uint16))  # inputs unchanged


def test_pyengine_does_not_import_ml_dtypes():
    code = ("import sys, numpy as np, pyengine as pe\n"
            "pe.layer_norm(np.ones((2, 4), np.float16))\n"
            "assert 'ml_dtypes' not in sys.modules, 'ml_dtypes imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
