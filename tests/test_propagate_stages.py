"""The stages of pyengine.propagate on their own: request, sweep, metrics, NaN/Inf reporting."""

import numpy as np
import pytest

import pyengine as pe
from pyengine.analysis.propagate import propagate_request
from pyengine.analysis.propagate_inputs import resolve_injection
from pyengine.analysis.propagate_stages import (Metrics, NonFinite, Step, baseline, check_request, sweep)
from pyengine.models import Stack

IDS = np.array([3, 14, 15, 9, 26, 5, 35, 8, 9, 7])


def _stack(dtype=np.float64, **kw):
    base = dict(d_model=16, n_heads=4, n_layers=4, d_mlp=24, vocab_size=50, max_seq_len=16)
    base.update(kw)
    return pe.init_weights(pe.StackConfig(**base), seed=3, dtype=dtype, gamma_jitter=0.2, bias_std=0.05)


def _request(st, layer=1, V=None, S=(0.5, 2.0), **kw):
    V = np.random.default_rng(0).standard_normal((3, 16)) if V is None else V
    args = dict(linearized=False, mode="full", dtype=None, batch_size=None, progress=None)
    args.update(kw)
    return check_request(st, resolve_injection(layer, st.config), V, S, **args)


def test_check_request_holds_the_checked_arguments():
    st = _stack(np.float32)
    req = _request(st, layer=-1 + 4, S=3.0, linearized=np.True_, dtype="float64", batch_size=2)
    assert req.layer == 3 and req.site is None and req.name is None
    np.testing.assert_allclose(np.linalg.norm(req.V, axis=1), 1.0, rtol=1e-15)
    assert req.S.dtype == np.float64 and req.S.shape == (1,) and req.linearized is True
    assert req.dt == np.float64 and req.batch_size == 2
    site = _request(st, layer="blocks.1.mlp.hidden", V=np.ones(24))
    assert (site.layer, site.site, site.name) == (1, "mlp.hidden", "blocks.1.mlp.hidden")
    with pytest.raises(ValueError, match="direction must have shape"):
        _request(st, V=np.ones(15))


@pytest.mark.parametrize("s", [0, 3])
def test_metrics_match_a_direct_computation(s):
    rng = np.random.default_rng(1)
    T, d, n = 7, 5, 4
    base, delta, v = rng.standard_normal((T - s, d)), rng.standard_normal((n, T - s, d)), rng.standard_normal((n, d))
    hb2 = np.stack([np.einsum("td,td->t", base, base)] * 2)
    m = Metrics(hb2, np.array([1.0, 2.0]), False, 2, T)
    m.add(Step(1, np.arange(n), delta, base, v))
    inj = base + delta
    norm = np.linalg.norm
    np.testing.assert_allclose(m.cosine[1, :, s:],
                               np.einsum("ntd,td->nt", inj, base) / (norm(inj, axis=-1) * norm(base, axis=-1)))
    np.testing.assert_allclose(m.projection[1, :, s:], np.einsum("ntd,nd->nt", delta, v))
    np.testing.assert_allclose(m.norm_ratio[1, :, s:], norm(inj, axis=-1) / norm(base, axis=-1))
    np.testing.assert_allclose(m.delta_norm[1, :, s:], norm(delta, axis=-1))
    # rows before s cannot move, and row 0 was not given: the values of an unperturbed stream
    assert (m.cosine[:, :, :s] == 1).all() and (m.delta_norm[:, :, :s] == 0).all() and (m.cosine[0] == 1).all()


def test_linearized_metrics_scale_the_tangent_and_keep_deltas():
    rng = np.random.default_rng(2)
    T, d, K = 6, 4, 2
    S = np.array([0.5, 3.0])
    base, t, v = rng.standard_normal((T, d)), rng.standard_normal((K, T, d)), rng.standard_normal((K, d))
    hb2 = np.einsum("td,td->t", base, base)[None].repeat(2, axis=0)
    keep = np.array([1, 4])
    lin = Metrics(hb2, S, True, K, T, keep=keep, d=d)
    lin.add(Step(1, np.arange(K), t, base, v))
    ex = Metrics(hb2, S, False, K, T)
    ex.add(Step(1, np.arange(K * S.size), np.repeat(t, 2, axis=0) * np.tile(S, K)[:, None, None], base,
                np.repeat(v, 2, axis=0)))
    for name in ("cosine", "projection", "norm_ratio", "delta_norm"):
        np.testing.assert_allclose(getattr(lin, name), getattr(ex, name), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(lin.deltas[1, 3], S[1] * t[1][keep])
    assert (lin.deltas[0] == 0).all()


@pytest.mark.parametrize("linearized", [False, True])
@pytest.mark.parametrize("kw", [dict(), dict(causal=False)])
def test_sweep_matches_a_loop_over_perturbations(linearized, kw):
    """Every step of the batched sweep against one perturbation at a time through the public blocks."""
    st, layer, pos = _stack(**kw), 1, np.array([4, 6])
    req = _request(st, layer=layer, linearized=linearized, batch_size=2)
    base = baseline(st, req, IDS, pos)
    s, S = base.s, req.S
    assert s == (4 if st.config.causal else 0)
    h = st.hidden_states(IDS, dtype=np.float64)
    steps = list(sweep(st, req, base))
    n_rows = req.V.shape[0] * (1 if linearized else S.size)
    assert sorted((p.i, int(r)) for p in steps for r in p.rows) == [(i, r) for i in range(4) for r in range(n_rows)]
    for p in steps:
        for r_at, r in enumerate(p.rows):
            k, a = (r, 1.0) if linearized else (r // S.size, S[r % S.size])
            x = np.zeros_like(h[layer]) if linearized else h[layer].copy()
            x[pos] += a * req.V[k]
            for blk in range(layer, layer + p.i):
                x = st.block_jvp(blk, h[blk], x) if linearized else st.block_forward(blk, x)
            want = x if linearized else x - h[layer + p.i]
            np.testing.assert_allclose(p.delta[r_at], want[s:], rtol=1e-10, atol=1e-12)
            np.testing.assert_array_equal(p.v[r_at], req.V[k])


def test_the_blocks_run_unchecked(monkeypatch):
    """The arguments are checked once: no block of the sweep checks its input again."""
    st = _stack()

    def refuse(*a, **k):
        raise AssertionError("a block input was checked again")

    monkeypatch.setattr(Stack, "as_stream", refuse)
    monkeypatch.setattr(Stack, "_linearize", refuse)
    for linearized in (False, True):
        r = pe.propagate(st, IDS, np.ones(16), [1.0, 2.0], 1, [3, 5], linearized=linearized)
        assert np.isfinite(r.cosine).all()


def test_overflow_at_the_injection_names_it():
    st = _stack(np.float32)
    with pytest.warns(RuntimeWarning, match="overflow"):
        with pytest.raises(ValueError, match=r"first in the injection at hidden state 2 \(scale \* v added, in "
                                             r"float32\): float32 overflowed"):
            pe.propagate(st, IDS, np.ones(16), 1e40, 2)


@pytest.mark.parametrize("linearized", [False, True])
@pytest.mark.parametrize("bad", [2, 3])
def test_nan_in_a_block_names_the_block(monkeypatch, linearized, bad):
    """NaN from block ``bad`` (0-based): a middle block (the next kernel refuses it) or the last
    (found by the check at the end)."""
    st = _stack()
    name = "jvp_rows" if linearized else "forward_rows"
    real = getattr(Stack, name)

    def spoiled(self, c, *args):
        out = real(self, c, *args)
        return out * np.nan if c.block == bad else out

    monkeypatch.setattr(Stack, name, spoiled)
    what = "tangent" if linearized else "perturbed stream"
    with pytest.raises(ValueError, match=rf"the {what} holds NaN or Inf, first in hidden state {bad + 1} "
                                         rf"\(the output of block {bad + 1}, counted from 1\)"):
        pe.propagate(st, IDS, np.ones(16), [1.0, 2.0], 1, linearized=linearized, batch_size=1)


def test_nonfinite_reads_the_first_bad_row_of_its_batch():
    st = _stack()
    req = _request(st, layer=0)
    base = baseline(st, req, IDS, "all")
    m = Metrics(base.hb2, req.S, False, 3, IDS.size)
    m.delta_norm[2:, 1] = np.inf  # perturbation 1 from row 2 on
    m.delta_norm[1, 4] = np.nan  # another batch's row
    msg = str(m.nonfinite(NonFinite(np.array([0, 1]), 4), req, base))
    assert "first in hidden state 2 (the output of block 2, counted from 1)" in msg
    assert "first in the injection at hidden state 0" in str(m.nonfinite(NonFinite(np.array([2, 3]), 4), req, base))


def test_propagate_request_equals_propagate():
    st = _stack(np.float32)
    V = np.random.default_rng(4).standard_normal((2, 16))
    req = _request(st, layer="blocks.1.resid_mid", V=V, linearized=True)
    a = propagate_request(st, IDS, req, slice(2, 5), True)
    b = pe.propagate(st, IDS, V, (0.5, 2.0), "blocks.1.resid_mid", slice(2, 5), linearized=True, return_deltas=True)
    for f in ("cosine", "projection", "norm_ratio", "delta_norm", "deltas", "base_norm", "layers"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    assert a.site == b.site == "blocks.1.resid_mid"
