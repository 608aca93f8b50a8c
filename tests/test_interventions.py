"""Interventions at named sites: add / replace / scale / zero / callables, heads, batches."""

import numpy as np
import pytest

import pyengine as pe
from pyengine.models.interventions import Intervention, ablate_head


@pytest.fixture(scope="module")
def s():
    cfg = pe.StackConfig(d_model=16, n_heads=4, n_layers=3, d_mlp=24, vocab_size=40, norm="rmsnorm",
                         positions="rotary", activation="silu_gated", bias=False, n_kv_heads=2, lm_head="tied")
    return pe.init_weights(cfg, seed=3).astype(np.float64)


IDS = np.array([3, 1, 4, 1, 5, 9, 2, 6])


def test_add_at_resid_pre_equals_block_forward(s):
    rng = np.random.default_rng(0)
    delta = rng.normal(size=16)
    h0 = s.hidden_states(IDS)
    h = s.run(IDS, [Intervention("blocks.1.resid_pre", "add", delta, positions=[2, 3])])
    np.testing.assert_array_equal(h[:1], h0[:1])
    x = h0[1].copy()
    x[2:4] += delta
    np.testing.assert_array_equal(h[1], x)  # hidden state 1 is block 1's (changed) input
    for k in (1, 2):  # the rest of the stack from the changed stream, through the public block API
        x = s.block_forward(k, x)
        np.testing.assert_allclose(h[k + 1], x, rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(h[2, :2], h0[2, :2])  # causal: earlier rows unchanged


def test_replace_scale_zero_and_callable(s):
    h0, c0 = s.run_with_cache(IDS, "blocks.0.resid_mid")
    mid = c0["blocks.0.resid_mid"]
    # replace with itself: nothing changes; scale by 1: nothing changes
    np.testing.assert_array_equal(s.run(IDS, [Intervention("blocks.0.resid_mid", "replace", mid)]), h0)
    np.testing.assert_array_equal(s.run(IDS, [Intervention("blocks.0.resid_mid", "scale", 1.0)]), h0)
    # zero the MLP output of block 2: resid_post = resid_mid there
    h, c = s.run_with_cache(IDS, "blocks.2.resid_mid", interventions=[Intervention("blocks.2.mlp.out", "zero")])
    np.testing.assert_array_equal(h[3], c["blocks.2.resid_mid"])
    # a callable doubling mlp.hidden equals scale 2
    dbl = s.run(IDS, {"blocks.1.mlp.hidden": lambda x, site: 2 * x})
    np.testing.assert_array_equal(dbl, s.run(IDS, [Intervention("blocks.1.mlp.hidden", "scale", 2.0)]))
    seen = []
    s.run(IDS, {"blocks.*.attn.pattern": lambda x, site: seen.append((site, x.shape))})
    assert seen == [(f"blocks.{k}.attn.pattern", (1, 4, 8, 8)) for k in range(3)]
    # the cache shows the changed value
    _, c = s.run_with_cache(IDS, "blocks.0.resid_mid", interventions=[Intervention("blocks.0.resid_mid", "zero")])
    assert (c["blocks.0.resid_mid"] == 0).all()


def test_head_ablation_one_line(s):
    h, c = s.run_with_cache(IDS, "blocks.1.attn.*", interventions=[ablate_head(1, 2)])
    ho = c["blocks.1.attn.head_out"]
    assert (ho[:, 2] == 0).all() and (ho[:, [0, 1, 3]] != 0).any()
    w = s.block_weights(1)
    np.testing.assert_allclose(ho.reshape(8, -1) @ w["attn.w_o"], c["blocks.1.attn.out"], atol=1e-13)
    assert not np.allclose(h, s.hidden_states(IDS))
    # zeroing every head = zeroing attn.out
    np.testing.assert_allclose(s.run(IDS, [ablate_head(1, [0, 1, 2, 3])]),
                               s.run(IDS, [Intervention("blocks.1.attn.out", "zero")]), atol=1e-13)


def test_batched_directions_like_propagate(s):
    K = 3
    rng = np.random.default_rng(1)
    deltas = rng.normal(size=(K, 16))
    ids = np.broadcast_to(IDS, (K, IDS.size))
    hb = s.run(ids, [Intervention("blocks.2.resid_pre", "add", deltas[:, None, :], positions=slice(4, 6))])
    for i in range(K):
        h1 = s.run(IDS, [Intervention("blocks.2.resid_pre", "add", deltas[i], positions=slice(4, 6))])
        np.testing.assert_allclose(hb[:, i], h1, rtol=1e-12, atol=1e-12)


def test_intervention_errors_before_forward(s):
    bad = [
        (Intervention("blocks.7.resid_pre", "add", np.ones(16)), ValueError, "matches no site"),
        (Intervention("blocks.0.resid_pre", "shift", 1.0), ValueError, "op must be"),
        (Intervention("blocks.0.resid_pre", "add", np.ones(5)), ValueError, "does not broadcast"),
        (Intervention("blocks.0.resid_pre", "add", None), TypeError, "numeric value"),
        (Intervention("blocks.0.resid_pre", "add", np.full(16, np.nan)), ValueError, "NaN"),
        (Intervention("blocks.0.resid_pre", "zero", positions=[8]), ValueError, "positions must lie"),
        (Intervention("blocks.0.resid_pre", "zero", heads=1), ValueError, "per-head"),
        (Intervention("blocks.0.attn.head_out", "zero", heads=4), ValueError, "heads must lie"),
        (Intervention("blocks.0.norm1.scale", "zero"), ValueError, "read only"),
    ]
    for iv, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            s.run(IDS, [iv])
    with pytest.raises(TypeError, match="interventions must be"):
        s.run(IDS, "blocks.0.resid_pre")
    with pytest.raises(ValueError, match="callable returned shape"):
        s.run(IDS, {"blocks.0.resid_pre": lambda x, site: x[0]})


def test_logit_lens(s):
    h = s.hidden_states(IDS)
    np.testing.assert_allclose(s.logit_lens(h[-1]), s.logits(IDS), rtol=1e-12, atol=1e-12)
    lens = s.logit_lens(IDS)
    assert list(lens) == [f"blocks.{k}.resid_post" for k in range(3)]
    np.testing.assert_allclose(lens["blocks.2.resid_post"], s.logits(IDS), rtol=1e-12, atol=1e-12)
    mid = s.logit_lens(IDS, "blocks.1.resid_mid")["blocks.1.resid_mid"]
    _, c = s.run_with_cache(IDS, "blocks.1.resid_mid")
    np.testing.assert_allclose(mid, s.logits(c["blocks.1.resid_mid"]), rtol=1e-13)
    assert mid.shape == (8, 40)
    with pytest.raises(ValueError, match="residual-type"):
        s.logit_lens(IDS, "blocks.*.attn.pattern")
    with pytest.raises(ValueError, match="language-model head"):
        s.replace(lm_head="none").logit_lens(IDS)
