"""Padded batches: attention_mask (left or right padding) equals separate runs at every real position."""

import numpy as np
import pytest

import pyengine as pe

CONFIGS = {
    "llama_like": dict(norm="rmsnorm", positions="rotary", activation="silu_gated", bias=False, n_kv_heads=2,
                       placement="pre", causal=True),
    "bert_like": dict(placement="post", causal=False, final_norm=False, embed_norm=True, positions="learned"),
    "gpt2_like": dict(positions="learned", causal=True),
    "sinusoidal_parallel": dict(positions="sinusoidal", layout="parallel", causal=True),
    "neox_like": dict(layout="parallel2", positions="rotary", rotary_dim=2, causal=True),
    "llama3_rope": dict(norm="rmsnorm", positions="rotary", rope_scaling="llama3", rope_factor=8.0,
                        rope_original_max_len=16, bias=False),
    "qwen3_sliding": dict(norm="rmsnorm", positions="rotary", activation="silu_gated", bias=False, n_kv_heads=2,
                          sliding_window=3, qk_norm=True),
}


def make(name):
    cfg = pe.StackConfig(d_model=16, n_heads=4, n_layers=3, d_mlp=24, vocab_size=40, max_seq_len=32,
                         **CONFIGS[name])
    return pe.init_weights(cfg, seed=2).astype(np.float64)


SEQS = [np.array([5, 3, 9, 1, 7, 2, 8]), np.array([4, 4, 6]), np.array([11, 12, 13, 14, 15])]


def pad(seqs, side, fill=0):
    T = max(len(s) for s in seqs)
    ids, mask = np.full((len(seqs), T), fill), np.zeros((len(seqs), T), int)
    for i, s in enumerate(seqs):
        sl = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[i, sl], mask[i, sl] = s, 1
    return ids, mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_padded_equals_separate(name, side):
    s = make(name)
    ids, mask = pad(SEQS, side, fill=39)
    h = s.hidden_states(ids, attention_mask=mask)
    _, c = s.run_with_cache(ids, ["blocks.*.attn.pattern", "blocks.*.attn.out"], attention_mask=mask)
    assert np.isfinite(h).all()
    for i, seq in enumerate(SEQS):
        real = mask[i].astype(bool)
        ref = s.hidden_states(seq)
        np.testing.assert_allclose(h[:, i, real], ref, rtol=1e-11, atol=1e-12)
        _, c1 = s.run_with_cache(seq, ["blocks.*.attn.pattern", "blocks.*.attn.out"])
        for n, a in c1.items():
            if n.endswith("pattern"):  # real query rows, real keys; padding keys get exactly 0
                np.testing.assert_allclose(c[n][i][:, real][:, :, real], a, rtol=1e-11, atol=1e-13)
                assert (c[n][i][:, real][:, :, ~real] == 0).all()
            else:
                np.testing.assert_allclose(c[n][i][real], a, rtol=1e-11, atol=1e-12)
    # the mask changes nothing when every token is real
    full = np.stack([SEQS[0][:3], SEQS[1]])
    np.testing.assert_allclose(s.hidden_states(full, attention_mask=np.ones((2, 3))), s.hidden_states(full),
                               rtol=1e-13, atol=1e-13)


def test_padded_float32_and_unpad():
    s = make("llama_like").astype(np.float32)
    ids, mask = pad(SEQS, "left")
    h = s.hidden_states(ids, attention_mask=mask)
    assert h.dtype == np.float32
    for i, seq in enumerate(s.unpad(ids, mask)):
        np.testing.assert_array_equal(seq, SEQS[i])
        np.testing.assert_allclose(h[:, i, mask[i] == 1], s.hidden_states(seq), rtol=2e-5, atol=2e-5)
    # residual streams (T, d) with a mask: positions come from the mask as for ids
    x = s.embed(ids)
    np.testing.assert_allclose(s.hidden_states(x, attention_mask=mask), h, rtol=1e-6, atol=1e-6)


def test_mask_errors_before_forward():
    s = make("gpt2_like")
    ids, mask = pad(SEQS, "right")
    with pytest.raises(ValueError, match="attention_mask must have the shape"):
        s.hidden_states(ids, attention_mask=mask[:, :-1])
    with pytest.raises(ValueError, match="0 .padding. and 1"):
        s.hidden_states(ids, attention_mask=mask * 2)
    bad = mask.copy()
    bad[0, 3] = 0
    with pytest.raises(ValueError, match="contiguous"):
        s.hidden_states(ids, attention_mask=bad)
    bad = mask.copy()
    bad[1] = 0
    with pytest.raises(ValueError, match="row 1 has no real token"):
        s.hidden_states(ids, attention_mask=bad)
    with pytest.raises(ValueError, match="cache"):
        s.forward(SEQS[0], cache_from=0, attention_mask=np.ones(7))
    with pytest.raises(ValueError, match="token_type_ids"):
        s.hidden_states(ids, token_type_ids=np.zeros_like(ids))
    with pytest.raises(ValueError, match="batch"):
        s.unpad(SEQS[0], np.ones(7))
