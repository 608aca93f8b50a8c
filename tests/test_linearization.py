"""The engine methods of pyengine.Stack that the analyses use: forward with block caches,
block_forward on the rows after a span (past=), block_jvp on those rows (start=),
block_jvp_diagonal, block_weights, block_index and as_stream; each against the plain
public calls it shortcuts."""

from __future__ import annotations

import numpy as np
import pytest

from pyengine.models import BlockCache, StackConfig, init_weights

D, T = 16, 7


def _stack(**kw):
    base = dict(d_model=D, n_heads=2, n_layers=3, d_mlp=24, max_seq_len=8)
    base.update(kw)
    return init_weights(StackConfig(**base), "xavier", seed=2, dtype=np.float64, gamma_jitter=0.3, bias_std=0.1)


def _h(shape, seed=1):
    return 0.3 + np.random.default_rng(seed).standard_normal(shape)


CASES = [dict(), dict(norm="rmsnorm", positions="rotary", activation="silu_gated", n_kv_heads=1),
         dict(layout="parallel", placement="post")]


@pytest.mark.parametrize("kw", CASES, ids=["pre-ln", "rms-rotary-gqa", "parallel-post"])
def test_forward_keeps_the_caches_of_the_blocks_asked_for(kw):
    st = _stack(**kw)
    x = _h((T, D))
    hs, caches = st.forward(x, cache_from=1)
    np.testing.assert_array_equal(hs, st.hidden_states(x))
    assert not hs.flags.writeable  # the caches refer to it
    assert [c.block for c in caches] == [1, 2] and all(isinstance(c, BlockCache) for c in caches)
    assert st.forward(x)[1] == [] and st.forward(x, cache_from=-1)[1][0].block == 2
    dh = _h((3, T, D), seed=2)
    for c in caches:
        np.testing.assert_array_equal(c.h, hs[c.block])
        np.testing.assert_allclose(st.block_jvp(c.block, c.h, dh, cache=c), st.block_jvp(c.block, hs[c.block], dh),
                                   rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("kw", CASES, ids=["pre-ln", "rms-rotary-gqa", "parallel-post"])
def test_rows_after_a_span_and_diagonal_blocks(kw):
    st = _stack(**kw)
    h, s = _h((T, D)), 3
    _, c = st.block_forward(1, h, return_cache=True)
    # past=: sequences equal to h before row s, only rows s.. computed
    x = np.repeat(h[None], 2, axis=0)
    x[:, s:] += 0.1 * _h((2, T - s, D), seed=3)
    np.testing.assert_allclose(st.block_forward(1, x[:, s:], past=c), st.block_forward(1, x)[:, s:],
                               rtol=1e-12, atol=1e-12)
    # start=: a tangent zero before s; the output is zero there too
    dh = _h((4, T, D), seed=4)
    dh[:, :s] = 0.0
    full = st.block_jvp(1, h, dh, cache=c)
    np.testing.assert_array_equal(full[:, :s], 0.0)
    np.testing.assert_allclose(st.block_jvp(1, c.h, dh[:, s:], cache=c, start=s), full[:, s:], rtol=1e-12, atol=1e-13)
    # diagonal blocks: row r perturbs token tokens[r] only, read at that token
    tokens = np.array([5, 0, 5, 2])
    t = _h((2, tokens.size, D), seed=5)
    got = st.block_jvp_diagonal(1, h, t, tokens)
    for r, tok in enumerate(tokens):
        one = np.zeros((2, T, D))
        one[:, tok] = t[:, r]
        np.testing.assert_allclose(got[:, r], st.block_jvp(1, h, one)[:, tok], rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(st.block_jvp_diagonal(1, c.h, t[0], tokens, cache=c), got[0])


def test_block_weights_index_and_stream():
    st = _stack(gamma_scale=0.5)
    w = st.block_weights(-1, np.float32)
    assert w["attn.w_qkv"].dtype == np.float32 and not w["attn.w_qkv"].flags.writeable
    np.testing.assert_array_equal(w["norm1.gamma"], (0.5 * st.weights["blocks.2.norm1.gamma"]).astype(np.float32))
    assert sorted(w) == sorted(n[len("blocks.2."):] for n in st.weights if n.startswith("blocks.2."))
    assert st.block_index(-3) == 0 and st.block_index(2) == 2
    x, batched = st.as_stream(_h((T, D)).astype(np.float32), dtype=np.float64)
    assert x.shape == (1, T, D) and x.dtype == np.float64 and not batched
    with pytest.raises(ValueError, match=r"k must be an integer in \[0, 3\) \(a block index"):
        st.block_index(3)
    with pytest.raises(ValueError, match=r"h must have shape \(T, 16\)"):
        st.as_stream(np.ones((2, 3, 4, D)))
    with pytest.raises(ValueError, match=r"x contains NaN or Inf \(first at index \(1, 0\): nan\)"):
        st.as_stream(np.where(np.eye(T, D, -1) > 0, np.nan, 1.0), name="x")


def test_engine_methods_refuse_bad_calls():
    st = _stack()
    h = _h((T, D))
    hs, caches = st.forward(h, cache_from=0)
    c = caches[1]
    with pytest.raises(ValueError, match="one sequence"):
        st.forward(_h((2, T, D)), cache_from=0)
    with pytest.raises(ValueError, match=r"cache_from must be an integer in \[0, 3\)"):
        st.forward(h, cache_from=3)
    with pytest.raises(ValueError, match="past belongs to block 1 of this stack, not to block 0"):
        st.block_forward(0, h[2:], past=c)
    with pytest.raises(TypeError, match="past must be a BlockCache"):
        st.block_forward(1, h[2:], past=c.data)
    with pytest.raises(ValueError, match=r"T' <= 7, and dtype float64"):
        st.block_forward(1, h[2:].astype(np.float32), past=c)
    with pytest.raises(ValueError, match="return_cache needs a whole sequence"):
        st.block_forward(1, h[2:], return_cache=True, past=c)
    nc = st.replace(causal=False)
    _, nc_cache = nc.block_forward(1, h, return_cache=True)
    with pytest.raises(ValueError, match="needs a causal stack"):
        nc.block_forward(1, h[2:], past=nc_cache)
    with pytest.raises(ValueError, match="start > 0 needs a causal stack"):
        nc.block_jvp(1, h, h[2:], start=2)
    with pytest.raises(ValueError, match=r"start must be an integer in \[0, 7\) \(a row of h\); got 7"):
        st.block_jvp(1, c.h, h, cache=c, start=7)
    with pytest.raises(ValueError, match=r"dh must have shape \(4, 16\)"):
        st.block_jvp(1, c.h, h, cache=c, start=3)
    with pytest.raises(IndexError, match=r"tokens must lie in \[0, 7\)"):
        st.block_jvp_diagonal(1, h, h[:1], [7])
    with pytest.raises(TypeError, match="tokens must be a 1-D array of integer indices"):
        st.block_jvp_diagonal(1, h, h[:1], [0.5])
    with pytest.raises(ValueError, match="tokens selects no token"):
        st.block_jvp_diagonal(1, h, h[:0], np.array([], int))
    with pytest.raises(ValueError, match=r"dh must have shape \(2, 16\)"):
        st.block_jvp_diagonal(1, h, h[:3], [0, 1])
    np.testing.assert_array_equal(h, _h((T, D)))  # nothing was modified
