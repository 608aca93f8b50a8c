"""Named activation sites and run_with_cache: each site equals what the forward computes."""

import numpy as np
import pytest

import pyengine as pe

CONFIGS = {
    "pre_ln_rope": dict(norm="rmsnorm", positions="rotary", activation="silu_gated", bias=False, n_kv_heads=2),
    "pre_ln": dict(),
    "post_ln": dict(placement="post", causal=False, final_norm=False),
    "parallel": dict(layout="parallel"),
    "parallel2": dict(layout="parallel2", positions="rotary", rotary_dim=2, activation="gelu_tanh_gated"),
}


def make(name, dtype=np.float64):
    cfg = pe.StackConfig(d_model=16, n_heads=4, n_layers=3, d_mlp=24, vocab_size=40, max_seq_len=32,
                         **CONFIGS[name])
    return pe.init_weights(cfg, seed=1).astype(dtype)


def naive_norm(stack, x, g, b):
    if stack.config.norm == "layernorm":
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + stack.config.eps) * g + b
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + stack.config.eps) * g


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sites_equal_forward(name):
    s = make(name)
    cfg = s.config
    ids = np.array([3, 1, 4, 1, 5, 9, 2, 6])
    T, H, dh = ids.size, cfg.n_heads, cfg.head_dim
    out, c = s.run_with_cache(ids)
    h = s.hidden_states(ids)
    np.testing.assert_array_equal(out, h[-1])  # no LM head: the last hidden state
    assert set(c) == set(s.site_names())
    for k in range(cfg.n_layers):
        g = lambda n: c[f"blocks.{k}.{n}"]  # noqa: E731
        w = s.block_weights(k)
        np.testing.assert_array_equal(g("resid_pre"), h[k])
        np.testing.assert_array_equal(g("resid_post"), h[k + 1])
        np.testing.assert_allclose(g("norm1.output"), naive_norm(s, g("norm1.input"), w["norm1.gamma"],
                                                                   w.get("norm1.beta", 0)), atol=1e-12)
        x = g("norm1.input")
        sd = x.std(-1) if cfg.norm == "layernorm" else np.sqrt((x * x).mean(-1))
        np.testing.assert_allclose(g("norm1.scale"), 1 / np.sqrt(sd ** 2 + cfg.eps), rtol=1e-12)
        # pattern = masked softmax of the scores; rows sum to one
        sc, p = g("attn.scores"), g("attn.pattern")
        assert sc.shape == p.shape == (H, T, T)
        if cfg.causal:
            sc = np.where(np.tril(np.ones((T, T), bool)), sc, -np.inf)
        e = np.exp(sc - sc.max(-1, keepdims=True))
        np.testing.assert_allclose(p, e / e.sum(-1, keepdims=True), atol=1e-14)
        # head outputs -> attn.out through w_o
        ho = g("attn.head_out")
        assert ho.shape == (T, H, dh)
        np.testing.assert_allclose(ho.reshape(T, H * dh) @ w["attn.w_o"] + w.get("attn.b_o", 0), g("attn.out"),
                                   atol=1e-13)
        np.testing.assert_allclose(g("mlp.hidden") @ w["mlp.w_out"] + w.get("mlp.b_out", 0), g("mlp.out"), atol=1e-13)
        if cfg.layout.startswith("parallel"):
            assert f"blocks.{k}.resid_mid" not in c
            np.testing.assert_allclose(g("resid_pre") + g("attn.out") + g("mlp.out"), g("resid_post"), atol=1e-13)
            if cfg.layout == "parallel2":
                np.testing.assert_array_equal(g("norm2.input"), g("resid_pre"))
                np.testing.assert_allclose(g("norm2.output"), naive_norm(s, g("resid_pre"), w["norm2.gamma"],
                                                                           w.get("norm2.beta", 0)), atol=1e-12)
        elif cfg.placement == "pre":
            np.testing.assert_array_equal(g("norm1.input"), g("resid_pre"))
            np.testing.assert_array_equal(g("norm2.input"), g("resid_mid"))
            np.testing.assert_allclose(g("resid_pre") + g("attn.out"), g("resid_mid"), atol=1e-13)
            np.testing.assert_allclose(g("resid_mid") + g("mlp.out"), g("resid_post"), atol=1e-13)
        else:
            np.testing.assert_allclose(g("resid_pre") + g("attn.out"), g("norm1.input"), atol=1e-13)
            np.testing.assert_array_equal(g("norm1.output"), g("resid_mid"))
            np.testing.assert_array_equal(g("norm2.output"), g("resid_post"))
    if cfg.final_norm:
        np.testing.assert_array_equal(c["final_norm.input"], h[-1])
        np.testing.assert_array_equal(c["final_norm.output"], s.apply_final_norm(h[-1]))


def test_only_asked_sites_globs_and_batches():
    s = make("pre_ln_rope", np.float32)
    ids = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    out, c = s.run_with_cache(ids, ["blocks.*.attn.pattern", "blocks.1.resid_mid"])
    assert list(c) == ["blocks.0.attn.pattern", "blocks.1.attn.pattern", "blocks.1.resid_mid",
                       "blocks.2.attn.pattern"]
    assert c["blocks.0.attn.pattern"].shape == (2, 4, 4, 4) and c["blocks.1.resid_mid"].dtype == np.float32
    np.testing.assert_array_equal(out, s.hidden_states(ids)[-1])
    for i in range(2):  # a batch row equals the single run
        _, c1 = s.run_with_cache(ids[i], "blocks.1.resid_mid")
        np.testing.assert_allclose(c1["blocks.1.resid_mid"], c["blocks.1.resid_mid"][i], rtol=1e-5, atol=1e-6)
    # float stream input
    x = s.embed(ids[0])
    _, c2 = s.run_with_cache(x, "embed")
    np.testing.assert_array_equal(c2["embed"], x)


def test_site_errors_before_forward():
    s = make("pre_ln")
    with pytest.raises(ValueError, match="matches no site"):
        s.run_with_cache(np.arange(4), "blocks.9.resid_pre")
    with pytest.raises(ValueError, match="matches no site"):
        s.run_with_cache(np.arange(4), ["blocks.0.resid_mid", "nope"])
    with pytest.raises(TypeError, match="sites"):
        s.run_with_cache(np.arange(4), [3])
    with pytest.raises(ValueError, match="input_ids"):
        s.run_with_cache(np.arange(40, 44), "blocks.0.resid_pre")
    assert "blocks.0.resid_mid" not in make("parallel").site_names()
    assert s.site_names()[0] == "embed" and s.site_names()[-1] == "final_norm.output"


def test_cache_is_a_copy_and_input_untouched():
    s = make("post_ln")
    x = s.embed(np.arange(6))
    x0 = x.copy()
    _, c = s.run_with_cache(x, "blocks.*.resid_*")
    np.testing.assert_array_equal(x, x0)
    c["blocks.0.resid_post"][:] = 0
    np.testing.assert_array_equal(s.run_with_cache(x, "blocks.0.resid_post")[1]["blocks.0.resid_post"],
                                  s.hidden_states(x0)[1])
