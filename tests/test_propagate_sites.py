"""propagate at named sites: inside a block (exact = an explicit intervention run, linearized =
central differences of the exact one), resid_pre / resid_post = hidden-state indices, errors."""

import numpy as np
import pytest

import pyengine as pe
from pyengine.models.site_blocks import injection_sites, site_width

IDS = np.array([3, 14, 15, 9, 26, 5, 35, 8])
POS = [4, 6]
CASES = [
    dict(),
    dict(placement="post"),
    dict(layout="parallel2"),
    dict(layout="parallel", placement="post"),
    dict(norm="rmsnorm", positions="rotary", activation="silu_gated", n_kv_heads=2, bias=False),
    dict(causal=False),
    dict(norm="rmsnorm", positions="rotary", n_kv_heads=2, qk_norm=True, head_dim=6),  # H dh = 24 != d = 16
    dict(head_dim=2),
]


def _stack(**kw):
    base = dict(d_model=16, n_heads=4, n_layers=3, d_mlp=24, vocab_size=50, max_seq_len=16)
    base.update(kw)
    return pe.init_weights(pe.StackConfig(**base), seed=3, dtype=np.float64, gamma_jitter=0.2, bias_std=0.05)


def _inner_sites(st):
    return [s for s in injection_sites(st.config) if s not in ("resid_pre", "resid_post")]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_site_injection_equals_an_intervention_run_and_its_linearization(kw):
    st = _stack(**kw)
    h = st.hidden_states(IDS)
    sites = _inner_sites(st)
    assert "mlp.hidden" in sites and "attn.out" in sites
    assert ("resid_mid" in sites) == (st.config.layout == "sequential")
    for site in sites:
        name = f"blocks.1.{site}"
        w = site_width(st.config, site)
        V = np.random.default_rng(1).standard_normal((2, w))
        Vn = V / np.linalg.norm(V, axis=1)[:, None]
        sc = np.array([1e-3, 0.5])
        r = pe.propagate(st, IDS, V, sc, name, POS, return_deltas=True)
        assert r.site == name and r.layer == 1
        np.testing.assert_array_equal(r.layers, [1.5, 2, 3])
        # the explicit intervention run: all 4 perturbations as one batch
        delta = (sc[None, :, None] * Vn[:, None, :]).reshape(4, 1, w)
        if site == "attn.head_out":
            delta = delta.reshape(4, 1, st.config.n_heads, st.config.head_dim)
        _, c = st.run_with_cache(np.broadcast_to(IDS, (4, IDS.size)), "blocks.*.resid_post",
                                 interventions=[pe.Intervention(name, "add", delta, positions=POS)])
        ref = c.stack("blocks.*.resid_post")  # hidden states 1 .. L
        np.testing.assert_allclose(r.deltas[1:], ref[1:] - h[2:, None], rtol=0, atol=1e-12, err_msg=site)
        # row 0 is the site itself: delta there is exactly scale * v at the injected positions
        proj0 = np.zeros((4, IDS.size))
        proj0[:, POS] = np.repeat(sc[None], 2, axis=0).reshape(4, 1)
        np.testing.assert_allclose(r.projection[0], proj0, atol=1e-15)
        np.testing.assert_allclose(r.delta_norm[0], np.abs(proj0), atol=1e-15)
        if site not in ("mlp.hidden", "attn.head_out"):
            np.testing.assert_allclose(r.projection[1:], np.einsum("lntd,nd->lnt", r.deltas[1:],
                                                                   np.repeat(Vn, 2, axis=0)), atol=1e-12)
            assert r.write_directions is None
        else:  # projected on where the sublayer writes v
            assert r.write_directions.shape == (2, st.config.d_model)
            assert np.isnan(r.deltas[0]).all()
        # linearized = central differences of the exact propagation
        eps = 1e-5
        ex = pe.propagate(st, IDS, V, [eps, -eps], name, POS, return_deltas=True)
        lin = pe.propagate(st, IDS, V, [eps], name, POS, return_deltas=True, linearized=True)
        cd = (ex.deltas[1:, 0::2] - ex.deltas[1:, 1::2]) / 2
        assert np.abs(cd).max() > 1e-5 * eps, site  # the perturbation reaches the stream
        np.testing.assert_allclose(lin.deltas[1:], cd, rtol=0, atol=1e-6 * np.abs(cd).max(), err_msg=site)


def test_norm_input_is_not_resid_pre_in_a_pre_ln_block():
    """In a pre-LN block the norm input is resid_pre, but injecting there leaves the skip alone."""
    st = _stack()
    v = np.random.default_rng(2).standard_normal(16)
    a = pe.propagate(st, IDS, v, 0.3, "blocks.1.norm1.input", POS, return_deltas=True)
    b = pe.propagate(st, IDS, v, 0.3, 1, POS, return_deltas=True)
    assert np.abs(a.deltas[1:] - b.deltas[1:]).max() > 1e-3


@pytest.mark.parametrize("linearized", [False, True])
def test_resid_pre_and_resid_post_are_hidden_state_indices(linearized):
    st = _stack()
    V = np.random.default_rng(3).standard_normal((2, 16))
    for name, k in (("blocks.1.resid_pre", 1), ("blocks.0.resid_post", 1), ("blocks.-1.resid_pre", 2)):
        a = pe.propagate(st, IDS, V, [0.1, 1.0], name, POS, linearized=linearized, return_deltas=True)
        b = pe.propagate(st, IDS, V, [0.1, 1.0], k, POS, linearized=linearized, return_deltas=True)
        assert a.layer == b.layer == k and a.site == name and b.site is None
        np.testing.assert_array_equal(a.layers, b.layers)
        for f in ("cosine", "projection", "norm_ratio", "delta_norm", "base_norm", "deltas"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)


def test_site_propagation_with_float32_and_a_padded_batch():
    st = _stack()
    v = np.random.default_rng(4).standard_normal(16)
    one = pe.propagate(st, IDS, v, 0.5, "blocks.0.resid_mid", "last")
    ids = np.stack([np.r_[IDS, 0, 0], np.r_[0, 0, IDS]])
    mask = np.stack([np.r_[np.ones(8), 0, 0], np.r_[0, 0, np.ones(8)]])
    both = pe.propagate(st, ids, v, 0.5, "blocks.0.resid_mid", "last", attention_mask=mask)
    for r in both:
        np.testing.assert_allclose(r.projection, one.projection, atol=1e-12)
    f32 = pe.propagate(st, IDS, v, 0.5, "blocks.0.resid_mid", "last", dtype=np.float32)
    np.testing.assert_allclose(f32.projection, one.projection, atol=2e-5)
    assert "site blocks.0.resid_mid (between hidden states 0 and 1)" in repr(one)


def test_sites_where_injection_is_not_meaningful_are_rejected():
    st = _stack()
    for bad in ("blocks.1.attn.pattern", "blocks.1.attn.scores", "blocks.1.norm1.scale", "blocks.1.nothing",
                "final_norm.input", "embed"):
        with pytest.raises(ValueError, match="resid_mid.*mlp.hidden"):
            pe.propagate(st, IDS, np.ones(16), 0.1, bad)
    with pytest.raises(ValueError, match="block index must lie in"):
        pe.propagate(st, IDS, np.ones(16), 0.1, "blocks.3.resid_mid")
    with pytest.raises(ValueError, match="last hidden state"):
        pe.propagate(st, IDS, np.ones(16), 0.1, "blocks.2.resid_post")
    with pytest.raises(ValueError, match=r"direction must have shape \(24,\)"):
        pe.propagate(st, IDS, np.ones(16), 0.1, "blocks.1.mlp.hidden")
    with pytest.raises(ValueError, match="resid_mid"):  # a parallel block has no stream between its sublayers
        pe.propagate(_stack(layout="parallel"), IDS, np.ones(16), 0.1, "blocks.1.resid_mid")
