"""TransformerLens aliases, the sites attn.q|k|v, attn.result and mlp.pre, the cache and run's logits."""

import numpy as np
import pytest

import pyengine as pe
from pyengine.models.interventions import Intervention, ablate_head
from pyengine.models.tl_names import BLOCK_ALIASES, GLOBAL_ALIASES

IDS = np.array([3, 1, 4, 1, 5, 9, 2, 6])


def make(**kw):
    cfg = pe.StackConfig(d_model=16, n_heads=4, n_layers=2, d_mlp=24, vocab_size=40, max_seq_len=32,
                         lm_head="tied", **kw)
    return pe.init_weights(cfg, seed=2, gamma_jitter=0.3, bias_std=0.1).astype(np.float64)


ROPE = dict(norm="rmsnorm", positions="rotary", activation="silu_gated", bias=False, n_kv_heads=2)


@pytest.fixture(scope="module")
def s():
    return make()


@pytest.fixture(scope="module")
def rope():
    return make(**ROPE)


@pytest.fixture(scope="module")
def peri():  # Gemma 2's norms of the sublayer outputs
    return make(placement="peri", **ROPE)


def _silu(x):
    return x / (1 + np.exp(-x))


def _gelu(x):
    from scipy.special import erf
    return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def _rotate(x, cfg):
    """Half-split rotary (positions 0..T-1) of x (T, heads, dh), written out from the formula."""
    T, dh = x.shape[0], x.shape[-1]
    f = cfg.rope_base ** (-np.arange(0, dh, 2) / dh)
    ang = np.arange(T)[:, None, None] * f[None, None, :]
    x1, x2 = x[..., : dh // 2], x[..., dh // 2 :]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)


@pytest.mark.parametrize("kind", ["learned_gelu", "rope_gqa_swiglu"])
def test_new_sites_equal_numpy(kind, s, rope):
    m = s if kind == "learned_gelu" else rope
    cfg, T, H, Hkv, dh = m.config, IDS.size, m.config.n_heads, m.config.n_kv_heads, m.config.head_dim
    _, c = m.run_with_cache(IDS)
    for k in range(cfg.n_layers):
        w = m.block_weights(k)
        g = lambda n: c[f"blocks.{k}.{n}"]  # noqa: E731
        qkv = g("norm1.output") @ w["attn.w_qkv"] + w.get("attn.b_qkv", 0)
        q = qkv[:, : H * dh].reshape(T, H, dh)
        kk = qkv[:, H * dh : (H + Hkv) * dh].reshape(T, Hkv, dh)
        v = qkv[:, (H + Hkv) * dh :].reshape(T, Hkv, dh)
        if cfg.positions == "rotary":
            q, kk = _rotate(q, cfg), _rotate(kk, cfg)
        np.testing.assert_allclose(g("attn.q"), q, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(g("attn.k"), kk, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(g("attn.v"), v, rtol=1e-12, atol=1e-13)
        # the forward's own scores, pattern and head outputs come from these q, k, v
        rep = H // Hkv
        sc = np.einsum("qhd,khd->hqk", q, np.repeat(kk, rep, axis=1)) / np.sqrt(dh)
        np.testing.assert_allclose(g("attn.scores"), sc, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(g("attn.head_out"), np.einsum("hqk,khd->qhd", g("attn.pattern"),
                                                                   np.repeat(v, rep, axis=1)), atol=1e-13)
        res = np.einsum("thd,hde->the", g("attn.head_out"), w["attn.w_o"].reshape(H, dh, -1))
        np.testing.assert_allclose(g("attn.result"), res, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(g("attn.result").sum(1) + w.get("attn.b_o", 0), g("attn.out"), atol=1e-13)
        pre = g("norm2.output") @ w["mlp.w_in"] + w.get("mlp.b_in", 0)
        np.testing.assert_allclose(g("mlp.pre"), pre, rtol=1e-12, atol=1e-13)
        n = cfg.d_mlp
        act = _silu(pre[:, :n]) * pre[:, n:] if cfg.activation == "silu_gated" else _gelu(pre)
        np.testing.assert_allclose(g("mlp.hidden"), act, rtol=1e-10, atol=1e-13)


def test_reading_new_sites_keeps_the_output(rope):
    for m in (rope, rope.astype(np.float32)):
        out, _ = m.run_with_cache(IDS, ["blocks.*.attn.q", "blocks.*.attn.result", "blocks.*.mlp.pre"])
        np.testing.assert_array_equal(out, m.logits(IDS))


def test_interventions_on_new_sites(rope):
    base, c0 = rope.run_with_cache(IDS, "blocks.1.*")
    same = [Intervention("blocks.1.attn.q", "scale", 1.0), Intervention("blocks.1.attn.k", "scale", 1.0),
            Intervention("blocks.1.attn.v", "scale", 1.0), Intervention("blocks.1.mlp.pre", "scale", 1.0),
            Intervention("blocks.1.attn.result", "scale", 1.0)]
    for iv in same:
        np.testing.assert_allclose(rope.run(IDS, [iv]), base, rtol=1e-12, atol=1e-12, err_msg=iv.site)
    # zero queries: uniform causal attention
    _, c = rope.run_with_cache(IDS, "blocks.1.attn.pattern", interventions=[Intervention("blocks.1.attn.q", "zero")])
    np.testing.assert_allclose(c["blocks.1.attn.pattern"][0], np.tril(np.ones((8, 8))) / np.arange(1, 9)[:, None])
    # zeroing a head's result equals ablating that head's P V
    a = rope.run(IDS, [Intervention("blocks.1.attn.result", "zero", heads=2)])
    np.testing.assert_allclose(a, rope.run(IDS, [ablate_head(1, 2)]), rtol=1e-12, atol=1e-12)
    # value heads: zero key/value head 0 = zero the query heads that read it (GQA: heads 0, 1)
    _, c = rope.run_with_cache(IDS, "blocks.1.attn.head_out", interventions=[Intervention("blocks.1.attn.v", "zero",
                                                                                          heads=0)])
    assert (c["blocks.1.attn.head_out"][:, :2] == 0).all() and (c["blocks.1.attn.head_out"][:, 2:] != 0).all()
    _, c = rope.run_with_cache(IDS, "blocks.1.mlp.hidden", interventions=[Intervention("blocks.1.mlp.pre", "zero")])
    assert (c["blocks.1.mlp.hidden"] == 0).all()


@pytest.mark.parametrize("tl", list(BLOCK_ALIASES) + list(GLOBAL_ALIASES))
def test_each_alias_is_its_pyengine_site(tl, s, rope, peri):
    for m in (peri,) if "_post." in tl else (s, rope, peri):
        tl_name = tl if tl in GLOBAL_ALIASES else f"blocks.1.{tl}"
        name = GLOBAL_ALIASES.get(tl) or f"blocks.1.{BLOCK_ALIASES[tl]}"
        _, c = m.run_with_cache(IDS, tl_name)
        _, ref = m.run_with_cache(IDS, name)
        assert list(c) == [name]
        np.testing.assert_array_equal(c[tl_name], ref[name])
        assert c[tl_name] is c[name] and tl_name in c
        if not name.endswith(".scale") and not name.startswith("final_norm"):  # read-only sites
            doubled = m.run(IDS, [Intervention(tl_name, "scale", 2.0)])
            np.testing.assert_array_equal(doubled, m.run(IDS, [Intervention(name, "scale", 2.0)]))


def test_alias_globs_stack_and_refusals(s):
    _, c = s.run_with_cache(IDS, "blocks.*.hook_resid_post")
    assert list(c) == ["blocks.0.resid_post", "blocks.1.resid_post"]
    st = c.stack("blocks.*.hook_resid_post")
    np.testing.assert_array_equal(st, s.hidden_states(IDS)[1:])
    np.testing.assert_array_equal(c.stack("blocks.*.resid_post"), st)
    with pytest.raises(ValueError, match="hook_pos_embed.*no pyengine equivalent"):
        s.run_with_cache(IDS, "hook_pos_embed")
    par = make(layout="parallel")
    with pytest.raises(ValueError, match=r"'blocks.0.hook_resid_mid' is TransformerLens for 'blocks.0.resid_mid'"):
        par.run_with_cache(IDS, "blocks.0.hook_resid_mid")
    with pytest.raises(KeyError, match="not in this cache"):
        c["blocks.0.resid_pre"]
    with pytest.raises(KeyError, match="matches no cached site"):
        c.stack("blocks.*.mlp.out")
    _, c2 = s.run_with_cache(IDS, ["blocks.0.resid_post", "blocks.0.attn.pattern"])
    with pytest.raises(ValueError, match="different shapes"):
        c2.stack("blocks.0.*")


def test_unknown_names_suggest_close_ones(s):
    for call in (lambda: s.run_with_cache(IDS, "blocks.1.resid_psot"),
                 lambda: s.run(IDS, [Intervention("blocks.1.resid_psot", "zero")]),
                 lambda: pe.propagate(s, IDS, np.ones(16), [1.0], layer="blocks.1.resid_psot")):
        with pytest.raises(ValueError, match=r"Closest valid names: blocks\.1\.resid_post") as e:
            call()
        assert "\n" not in str(e.value)


def test_propagate_layer_takes_aliases(s):
    v = np.random.default_rng(0).standard_normal((1, 16))
    a = pe.propagate(s, IDS, v, [1.0], layer="blocks.0.hook_resid_mid")
    b = pe.propagate(s, IDS, v, [1.0], layer="blocks.0.resid_mid")
    np.testing.assert_array_equal(a.projection, b.projection)


def test_run_logits_and_encoder_output(s):
    ids = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    mask = np.array([[1, 1, 1, 1], [0, 0, 1, 1]])
    iv = [Intervention("blocks.0.mlp.out", "zero")]
    lg = s.logits(ids, interventions=iv, attention_mask=mask)
    assert lg.shape == (2, 4, 40)
    np.testing.assert_array_equal(lg, s.run(ids, iv, attention_mask=mask))
    out, _ = s.run_with_cache(ids, "embed", attention_mask=mask, interventions=iv)
    np.testing.assert_array_equal(out, lg)
    np.testing.assert_allclose(lg[1, 2:], s.logits(ids[1, 2:], interventions=iv), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="go with token ids"):
        s.logits(s.hidden_states(IDS)[-1], interventions=iv)
    enc = s.replace(lm_head="none")
    out, _ = enc.run_with_cache(IDS, "embed")
    np.testing.assert_array_equal(out, enc.hidden_states(IDS)[-1])
    np.testing.assert_array_equal(enc.run(IDS), out)


@pytest.mark.fidelity
def test_qkv_and_mlp_pre_match_transformers_gpt2(tmp_path):
    torch = pytest.importorskip("torch")
    tr = pytest.importorskip("transformers")
    cfg = tr.GPT2Config(n_embd=16, n_head=2, n_layer=2, n_positions=32, vocab_size=64)
    torch.manual_seed(0)
    model = tr.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager").double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path, safe_serialization=True)
    ours = pe.load_pretrained(tmp_path, dtype="float64")
    got = {}
    blk = model.transformer.h[1]
    blk.attn.c_attn.register_forward_hook(lambda mod, i, o: got.__setitem__("qkv", o[0].numpy()))
    blk.mlp.c_fc.register_forward_hook(lambda mod, i, o: got.__setitem__("pre", o[0].numpy()))
    ids = np.array([3, 17, 5, 60, 1, 42, 9, 33])
    with torch.no_grad():
        model(torch.tensor(ids)[None])
    _, c = ours.run_with_cache(ids, ["blocks.1.attn.hook_q", "blocks.1.attn.hook_k", "blocks.1.attn.hook_v",
                                     "blocks.1.mlp.hook_pre"])
    q, k, v = (x.reshape(8, 2, 8) for x in np.split(got["qkv"], 3, axis=-1))
    for name, ref in (("attn.q", q), ("attn.k", k), ("attn.v", v), ("mlp.pre", got["pre"])):
        np.testing.assert_allclose(c[f"blocks.1.{name}"], ref, rtol=1e-10, atol=1e-12, err_msg=name)


def test_tl_name_inverts_canonical():
    from pyengine.models.tl_names import BLOCK_ALIASES, GLOBAL_ALIASES, canonical, tl_name

    for tl in [f"blocks.3.{a}" for a in BLOCK_ALIASES] + list(GLOBAL_ALIASES):
        assert tl_name(canonical(tl)) == tl
    assert tl_name("blocks.0.norm1.input") is None and tl_name("embed.norm.output") is None
