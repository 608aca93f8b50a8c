"""The float32 fast paths of the block engine (models/_fast.py) against the generic path.

The fused attention head (forward) and the head-major GEMMs (JVP) must compute what the
batched products compute, to float32 rounding, on every attention variant they serve:
causal and not, grouped-query heads, rotary positions, q/k norms, a sliding window, a span that
starts mid-sequence.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyengine as pe
import pyengine.models._fast as fast_module
from pyengine.models._blocks import make_context

CONFIGS = [
    dict(),
    dict(n_kv_heads=2, positions="rotary"),
    dict(n_kv_heads=1),
    dict(causal=False, positions="learned"),
    dict(n_kv_heads=2, positions="rotary", norm="rmsnorm", qk_norm=True),
    dict(qk_norm=True),
    dict(n_kv_heads=2, positions="rotary", head_dim=24),  # H dh = 96 != d_model = 64
    dict(head_dim=8),
]


def _stack(kw):
    cfg = pe.StackConfig(d_model=64, n_heads=4, d_mlp=128, n_layers=2, vocab_size=50, max_seq_len=32, **kw)
    return pe.init_weights(cfg, "gpt2", seed=0, dtype=np.float32)


def _generic(monkeypatch):
    monkeypatch.setattr(fast_module, "fused_dtype", lambda dtype: False)


def _close(a, b):  # float32 rounding of the last bits, relative to the largest entry
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-6 * max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("kw", CONFIGS)
def test_forward_and_jvp_match_the_generic_path(kw, monkeypatch):
    st = _stack(kw)
    rng = np.random.default_rng(1)
    h = st.hidden_states(np.arange(20) % 50)[1]
    hb = (h[None] + 0.1 * rng.standard_normal((3, 20, 64))).astype(np.float32)
    t = rng.standard_normal((5, 20, 64)).astype(np.float32)
    out, cache = st.block_forward(1, h, return_cache=True)
    fast = st.block_forward(1, hb), st.block_jvp(1, h, t, cache=cache)
    np.testing.assert_array_equal(st.block_forward(1, h), out)  # the cache-less forward: same function
    f32 = np.dtype(np.float32)
    ctx = make_context(st.config, 20, f32)
    assert fast_module.forward_path(ctx, f32, False, 20) != "unfused" and fast_module.jvp_path(ctx, f32) != "generic"
    with monkeypatch.context() as m:
        _generic(m)
        assert fast_module.forward_path(ctx, f32, False, 20) == "unfused" and fast_module.jvp_path(ctx, f32) == "generic"
        _, cache_g = st.block_forward(1, h, return_cache=True)
        slow = st.block_forward(1, hb), st.block_jvp(1, h, t, cache=cache_g)
    for a, b in zip(fast, slow):
        _close(a, b)


@pytest.mark.parametrize("kw", CONFIGS[:2])
@pytest.mark.parametrize("linearized", [False, True])
def test_propagate_span_matches_the_generic_path(kw, linearized, monkeypatch):
    st = _stack(kw)
    ids, V = np.arange(20) % 50, np.random.default_rng(2).standard_normal((4, 64))
    fast = pe.propagate(st, ids, V, 1.0, 0, slice(8, None), linearized=linearized)
    _generic(monkeypatch)
    slow = pe.propagate(st, ids, V, 1.0, 0, slice(8, None), linearized=linearized)
    _close(fast.delta_norm, slow.delta_norm)
    np.testing.assert_allclose(fast.cosine, slow.cosine, atol=1e-5)


@pytest.mark.parametrize("linearized", [False, True])
def test_sliding_window_fast_paths_match_the_generic_path(linearized, monkeypatch):
    """A window shorter than the sequence sends the forward to the batched products (the compiled
    heads mask causally only); the JVP's fast paths read the window from P's exact zeros."""
    st = _stack(dict(n_kv_heads=2, positions="rotary", sliding_window=6, qk_norm=True))
    f32 = np.dtype(np.float32)
    assert fast_module.forward_path(make_context(st.config, 6, f32), f32, False, 6) != "unfused"
    assert fast_module.forward_path(make_context(st.config, 20, f32), f32, False, 20) == "unfused"
    rng = np.random.default_rng(1)
    h = st.hidden_states(np.arange(20) % 50)[1]
    t = rng.standard_normal((5, 20, 64)).astype(np.float32)
    ids, V = np.arange(20) % 50, rng.standard_normal((4, 64))
    fast = (st.block_jvp(1, h, t), pe.propagate(st, ids, V, 1.0, 0, slice(8, None), linearized=linearized))
    with monkeypatch.context() as m:  # path "gemm": no compiled JVP kernel
        m.setattr(fast_module, "attention_jvp_kernel", lambda: None)
        gemm = st.block_jvp(1, h, t)
    _generic(monkeypatch)
    slow = (st.block_jvp(1, h, t), pe.propagate(st, ids, V, 1.0, 0, slice(8, None), linearized=linearized))
    _close(fast[0], slow[0])
    _close(gemm, slow[0])
    _close(fast[1].delta_norm, slow[1].delta_norm)
    np.testing.assert_allclose(fast[1].cosine, slow[1].cosine, atol=1e-5)
    assert np.abs(slow[0][:, :6]).max() > 0 and np.abs(slow[0][:, 6:]).max() > 0
