"""One position that holds the variance: its detection, the without-first and per-token normalized
variants against direct NumPy, the warning of the report, the token-norm companions, the
position-only run and the attention pattern against the query-key offset."""

from __future__ import annotations

import numpy as np
import pytest

import pyengine
from pyengine.analysis.placement import token_norms
from pyengine.analysis.positions import normalize_tokens, positional_decomposition
from pyengine.analysis.positions_model import PatternMoments, attention_distance, position_only
from pyengine.experiments._positions_findings import dominance_warnings, extra_findings
from pyengine.experiments.positions import format_positions, positions_report


def _naive_share_and_rank(h):
    """Positional share and effective rank of one layer (C, T, d), written out directly."""
    C = h.shape[0]
    x = h - h.mean(axis=(0, 1))
    pos = x.mean(axis=0)
    s = np.linalg.svd(pos, compute_uv=False)
    p = s / s.sum()
    p = p[p > 0]
    return np.sqrt(C) * np.linalg.norm(pos) / np.linalg.norm(x), np.exp(-(p * np.log(p)).sum())


def _stream(C=30, T=10, d=24, sink=0.0, seed=0):
    """(2, C, T, d): positional part + context part + noise; position 0 moved by a fixed vector of
    norm ~ ``sink`` plus a per-context one of norm ~ sink / 10 (a huge token, nearly the same in
    every context)."""
    rng = np.random.default_rng(seed)
    pos = rng.standard_normal((T, d))
    h = pos[None] + rng.standard_normal((C, 1, d)) + 0.3 * rng.standard_normal((C, T, d))
    h[:, 0] += 0.1 * sink * rng.standard_normal((C, d)) / np.sqrt(d) + sink * rng.standard_normal(d) / np.sqrt(d)
    return np.stack([h, 1.5 * h + 0.1])


def test_normalized_variant_equals_direct_numpy():
    h = _stream() * np.random.default_rng(5).uniform(0.2, 5.0, (1, 30, 10, 1))  # tokens of unequal norm
    before = h.copy()
    dec = positional_decomposition(h, k=3, normalize=True)
    np.testing.assert_array_equal(h, before)
    for l in range(2):
        x = h[l] / np.sqrt((h[l] ** 2).mean(axis=-1, keepdims=True))
        share, rank = _naive_share_and_rank(x)
        assert dec.rel_norm[l] == pytest.approx(share, rel=1e-12)
        assert dec.effective_rank[l] == pytest.approx(rank, rel=1e-12)
    assert dec.normalized and positional_decomposition(h, k=3).rel_norm[0] != pytest.approx(dec.rel_norm[0], rel=1e-3)
    n = normalize_tokens(h)
    assert np.sqrt((n ** 2).mean(axis=-1)) == pytest.approx(np.ones(h.shape[:-1]), rel=1e-12)
    assert np.all(normalize_tokens(np.zeros((2, 3))) == 0)


def test_exclude_first_equals_the_cut_stream_and_counts_original_positions():
    h = _stream(sink=60.0)
    dec = positional_decomposition(h, k=3, exclude_first=2)
    ref = positional_decomposition(h[:, :, 2:], k=3)
    np.testing.assert_array_equal(dec.rel_norm, ref.rel_norm)
    np.testing.assert_array_equal(dec.effective_rank, ref.effective_rank)
    np.testing.assert_array_equal(dec.top_position, ref.top_position + 2)
    assert dec.exclude_first == 2 and dec.to_dict()["exclude_first"] == 2
    with pytest.raises(ValueError, match="exclude_first"):
        positional_decomposition(h, exclude_first=9)
    with pytest.raises(ValueError, match="exclude_first"):
        positional_decomposition(h, exclude_first=-1)
    with pytest.raises(TypeError, match="normalize"):
        positional_decomposition(h, normalize="yes")


def test_a_dominating_position_is_detected_and_only_then():
    sunk = positional_decomposition(_stream(sink=60.0), k=3)
    assert list(sunk.dominant_position) == [0, 0] and np.all(sunk.top_share > 0.7)
    x = _stream(sink=60.0)[0]
    x = x - x.mean(axis=(0, 1))
    e = (x ** 2).sum(axis=(0, 2))
    assert sunk.top_share[0] == pytest.approx(e[0] / e.sum(), rel=1e-12)
    assert sunk.rel_norm[0] > 0.9  # the one token is the "positional" part
    assert positional_decomposition(_stream(sink=60.0), k=3, exclude_first=1).rel_norm[0] < 0.9
    plain = positional_decomposition(_stream(), k=3)
    assert list(plain.dominant_position) == [-1, -1] and np.all(plain.top_share < 0.5)
    assert plain.to_dict()["dominant_position"] == [None, None]


def _sink_stack(scale):
    """A pre-LN stack with learned positions whose position-0 vector has norm ``scale`` * sqrt(d)."""
    cfg = pyengine.StackConfig(d_model=32, n_heads=4, n_layers=3, d_mlp=64, norm="layernorm", placement="pre",
                               positions="learned", vocab_size=64, lm_head="tied", max_seq_len=16)
    w = pyengine.init_weights(cfg, "xavier_normal", seed=1).weights
    w["embed.tokens"] = w["embed.tokens"] / w["embed.tokens"].std()
    w["embed.positions"] = w["embed.positions"] / w["embed.positions"].std()
    w["embed.positions"][0] *= scale
    return pyengine.Stack(cfg, w)


def _report(scale, **kw):
    return positions_report([("m", _sink_stack(scale))], length=8, max_contexts=24, ablation_contexts=4, **kw)


def test_report_warns_and_excludes_the_dominating_position():
    rep = _report(100.0)
    m = rep.models[0]
    assert m.to_dict()["dominant_position"] == [0, 0, 0, 0]
    assert m.variants["without_first"].exclude_first == 1
    assert m.variants["without_first"].rel_norm.max() < 0.9 < m.decomposition.rel_norm.min()
    text = format_positions(rep)
    warn = [s for s in text.splitlines() if s.startswith("WARNING")]
    assert len(warn) == 1 and "position 0 holds" in warn[0] and "hidden states 0-3" in warn[0]
    assert "where one position dominates (hidden states 0-3)" in text and "without position 0" in text
    assert text.count("protocol: uniform random ids (seed 0): 24 contexts x 8 tokens") == 1
    doc = m.to_dict()
    assert set(doc["variants"]) == {"all", "without_first", "normalized"}
    assert doc["variants"]["all"]["rel_norm"] == doc["decomposition"]["rel_norm"]
    assert doc["position_only"]["alignment"][0] > 0.99  # position 0 alone in both runs at the input


def test_report_without_a_dominating_position_does_not_warn():
    rep = _report(1.0, exclude_first=0)
    m = rep.models[0]
    assert m.to_dict()["dominant_position"] == [None] * 4
    assert set(m.variants) == {"all", "normalized"}
    text = format_positions(rep)
    assert "WARNING" not in text and "no position dominates (hidden states 0-3)" in text
    assert dominance_warnings(m) == []
    assert any(s.startswith("position-only run") for s in extra_findings(m))
    assert set(_report(1.0, exclude_first=3).models[0].variants) == {"all", "without_first", "normalized"}
    with pytest.raises(ValueError, match="exclude_first"):
        _report(1.0, exclude_first=7)


def test_token_norms_name_the_large_token_and_keep_the_median():
    rng = np.random.default_rng(2)
    h = rng.standard_normal((3, 20, 6, 16))
    med0 = token_norms(h)[0]
    h[1:, :, 2] *= 100.0
    med, top, ratio = token_norms(h)
    assert list(top[1:]) == [2, 2] and np.all(ratio[1:] > 50) and ratio[0] < 2
    assert med[1] == pytest.approx(med0[1], rel=0.3)  # one position of six moves the median little
    n = np.linalg.norm(h[1], axis=-1)
    per = np.median(n, axis=0)
    assert ratio[1] == pytest.approx(per[2] / np.median(np.delete(per, 2)), rel=1e-12)


def test_position_only_run_matches_a_stream_built_from_it():
    cfg = pyengine.StackConfig(d_model=32, n_heads=4, n_layers=2, d_mlp=64, norm="layernorm", placement="pre",
                               positions="sinusoidal", vocab_size=64, lm_head="tied", max_seq_len=64)
    s = pyengine.init_weights(cfg, "xavier_normal", seed=3, dtype=np.float64)
    T = 8
    q = s.hidden_states(np.zeros((T, 32)))  # (3, T, d)
    ctx = np.random.default_rng(0).standard_normal((5, 32))
    h = q[:, None] + ctx[None, :, None]  # positional part exactly q centred over positions
    po = position_only(s, h, [0, 1, 2], k=T)
    assert po.alignment == pytest.approx(np.ones(3), abs=1e-10)
    assert po.alignment_median == pytest.approx(np.ones(3), abs=1e-10)
    assert po.captured == pytest.approx(np.ones(3), abs=1e-10)
    assert po.rel_norm == pytest.approx(np.ones(3), rel=1e-10)
    assert position_only(s, 2 * h[1:], [1, 2], k=2).rel_norm == pytest.approx([0.5, 0.5], rel=1e-10)
    with pytest.raises(ValueError, match="rotary"):
        position_only(s.replace(positions="rotary"), h, [0, 1, 2])
    with pytest.raises(ValueError, match="layers"):
        position_only(s, h, [0, 1])


def _naive_r2(a, valid, group):
    """Per-head one-way R^2 of a (C, H, T, T) over the valid entries grouped by ``group`` (T, T)."""
    out = []
    for hd in range(a.shape[1]):
        v = a[:, hd][:, valid]  # (C, m)
        g = np.broadcast_to(group[valid], v.shape)
        fit = np.zeros_like(v)
        for x in np.unique(g):
            fit[g == x] = v[g == x].mean()
        out.append(1 - ((v - fit) ** 2).sum() / ((v - v.mean()) ** 2).sum())
    return np.mean(out)


def test_attention_distance_against_direct_numpy_and_in_chunks():
    rng = np.random.default_rng(4)
    C, H, T = 12, 3, 7
    i, j = np.indices((T, T))
    s = rng.standard_normal((C, H, T, T)) - 0.8 * (i - j)[None, None]  # a recency bias plus noise
    s = np.where(j <= i, s, -np.inf)
    a = np.exp(s - s.max(axis=-1, keepdims=True))
    a /= a.sum(axis=-1, keepdims=True)
    p = np.stack([a, a[:, ::-1]])  # (L = 2, C, H, T, T)
    ad = attention_distance(p)
    valid = j <= i
    assert ad.r2_distance[0] == pytest.approx(_naive_r2(a, valid, i - j), rel=1e-10)
    assert ad.r2_key[0] == pytest.approx(_naive_r2(a, valid, j), rel=1e-10)
    assert ad.r2_distance_no_first[0] == pytest.approx(_naive_r2(a, valid & (j >= 1), i - j), rel=1e-10)
    assert ad.sink[0] == pytest.approx(a[:, :, 1:, 0].mean(), rel=1e-12)
    assert ad.profile[0, T - 1 + 1] == pytest.approx(np.mean([a[:, :, t, t - 1] for t in range(1, T)]), rel=1e-12)
    assert np.isnan(ad.profile[0, 0])  # offset -(T - 1): above the diagonal, no causal entry
    mom = PatternMoments()
    mom.add(p[:, :5])
    mom.add(p[:, 5:])
    chunked = attention_distance(mom)
    assert chunked.r2_distance == pytest.approx(ad.r2_distance, rel=1e-12) and chunked.contexts == C
    # a pure previous-token head is all offset; a pure sink head is all key position
    prev = np.zeros((1, 1, T, T))
    prev[0, 0, 0, 0] = 1.0
    prev[0, 0, np.arange(1, T), np.arange(T - 1)] = 1.0
    sink = np.zeros((1, 1, T, T))
    sink[0, 0, :, 0] = 1.0
    assert attention_distance(prev).r2_distance_no_first[0] == pytest.approx(1.0)
    assert attention_distance(sink).r2_key[0] == pytest.approx(1.0) and attention_distance(sink).sink[0] == 1.0
    with pytest.raises(ValueError, match="patterns"):
        attention_distance(np.ones((2, 3, 4)))
