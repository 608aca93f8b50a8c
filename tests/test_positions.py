"""analysis.positions and analysis.placement: planted positional components, the probe and its
control, removal of an identity block, pre/post norm growth on seeded stacks."""

from __future__ import annotations

import numpy as np
import pytest

import pyengine
from pyengine.analysis.placement import placement_profile, stream_profile
from pyengine.analysis.positions import position_probe, positional_decomposition, positional_propagation, sincos_targets
from pyengine.experiments.positions import synthetic_pair


def _planted(C=40, T=12, d=32, r=3, pos_scale=2.0, noise=0.05, seed=0):
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    U, _ = np.linalg.qr(rng.standard_normal((T, r)))
    U -= U.mean(axis=0)  # a positional part has zero mean over positions
    s = pos_scale * np.array([3.0, 2.0, 1.0])[:r]
    P = (U * s) @ Q[:, :r].T  # rank r, in span(Q[:, :r])
    ctx = rng.standard_normal((C, 4)) @ Q[:, r:r + 4].T  # context part, orthogonal to the positions
    ctx -= ctx.mean(axis=0)
    h = 5.0 + P[None] + ctx[:, None] + noise * rng.standard_normal((C, T, d))
    return h, P, ctx, Q


def test_decomposition_recovers_planted_rank_norm_and_subspace():
    h, P, ctx, Q = _planted()
    C, T, d = h.shape
    dec = positional_decomposition(np.stack([h, h]), k=3)
    x = h - h.mean(axis=(0, 1))
    expect = np.sqrt(C) * np.linalg.norm(P) / np.linalg.norm(x)
    assert dec.rel_norm[0] == pytest.approx(expect, rel=0.02)
    sv = np.linalg.svd(P, compute_uv=False)
    assert dec.stable_rank[0] == pytest.approx((sv ** 2).sum() / sv[0] ** 2, rel=0.05)
    assert dec.singular_values[0, :3] == pytest.approx(sv[:3], rel=0.03)
    assert dec.singular_values[0, 3] < 0.05 * sv[2]  # nothing beyond the planted rank
    assert 2.0 < dec.effective_rank[0] < 4.0
    assert np.all(dec.angles[1] < 1e-6)  # the same layer again: zero angles
    assert dec.incoherence[0] < 0.1  # planted orthogonal to the context part
    # the positional directions span the planted subspace
    proj = np.linalg.norm(dec.directions @ Q[:, :3], axis=1)
    assert np.all(proj > 0.99)


def test_angles_see_a_rotated_positional_subspace():
    h, P, ctx, Q = _planted(noise=0.0)
    rot = P @ Q[:, :3] @ Q[:, 10:13].T  # the same positions moved to an orthogonal subspace
    h2 = 5.0 + rot[None] + ctx[:, None]
    dec = positional_decomposition(np.stack([h, h2]), k=3)
    assert np.degrees(dec.angles[1]) == pytest.approx([90, 90, 90], abs=1e-3)
    assert dec.rel_norm[1] == pytest.approx(dec.rel_norm[0], rel=1e-9)


def test_probe_reads_sinusoidal_positions_and_not_shuffled_labels():
    rng = np.random.default_rng(3)
    C, T, d = 60, 16, 64
    t = np.arange(T)[:, None]
    freq = 10000.0 ** (-np.arange(0, d, 2) / d)
    pe = np.zeros((T, d))
    pe[:, 0::2], pe[:, 1::2] = np.sin(t * freq), np.cos(t * freq)
    h = pe[None] + 0.3 * rng.standard_normal((C, T, d))
    pr = position_probe(h, folds=5)
    assert pr.r2[0] > 0.95
    assert abs(pr.r2_shuffled[0]) < 0.05
    # sin/cos targets: every feature read out when the stream carries them linearly
    feats = sincos_targets(T) @ rng.standard_normal((8, d))
    pr = position_probe(feats[None] + 0.3 * rng.standard_normal((C, T, d)), target="sincos", folds=5)
    assert pr.r2[0] > 0.95 and abs(pr.r2_shuffled[0]) < 0.05
    noise = position_probe(rng.standard_normal((C, T, d)), folds=5)
    assert noise.r2[0] < 0.05


def _seeded(placement="pre", n_layers=6):
    cfg = pyengine.StackConfig(d_model=32, n_heads=4, n_layers=n_layers, d_mlp=64, norm="layernorm",
                               placement=placement, positions="sinusoidal", vocab_size=64, lm_head="tied",
                               max_seq_len=64)
    return pyengine.init_weights(cfg, "xavier_normal", seed=1, dtype=np.float64)


def test_removing_an_identity_block_changes_nothing():
    s = _seeded()
    w = s.weights
    w["blocks.2.attn.w_o"] = np.zeros_like(w["blocks.2.attn.w_o"])  # pre-LN residual block -> identity
    w["blocks.2.mlp.w_out"] = np.zeros_like(w["blocks.2.mlp.w_out"])
    s = pyengine.Stack(s.config, w)
    ids = np.random.default_rng(0).integers(0, 64, (10, 8))
    before = ids.copy()
    pr = placement_profile(s, ids, ablation_contexts=None, chunk=4)
    np.testing.assert_array_equal(ids, before)
    assert pr.removal_change[2] < 1e-12 and pr.removal_kl[2] < 1e-12 and pr.removal_top1[2] == 1.0
    assert pr.cosine[2] == pytest.approx(1.0, abs=1e-12)
    others = np.delete(np.arange(6), 2)
    assert np.all(pr.removal_change[others] > 1e-3) and np.all(pr.removal_kl[others] > 1e-4)
    # removal by batching equals removal one block at a time
    h = s.hidden_states(ids)
    x = h[4].copy()  # block 4 removed: its input goes on to block 5
    x = s.block_forward(5, x)
    ref = s.apply_final_norm(h[-1])
    got = np.linalg.norm(s.apply_final_norm(x) - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert pr.removal_change[4] == pytest.approx(got.mean(), rel=1e-10)


def test_pre_ln_norm_grows_post_ln_stays_at_one():
    pre, post = synthetic_pair(n_layers=8, d_model=32, seed=2)
    ids = np.random.default_rng(1).integers(0, 512, (16, 10))
    n_pre, c_pre, _ = stream_profile(pre.hidden_states(ids))
    n_post, c_post, _ = stream_profile(post.hidden_states(ids))
    assert np.all(np.diff(n_pre) > 0) and n_pre[-1] > 2 * n_pre[1]
    assert n_post[1:] == pytest.approx(np.ones(8), abs=1e-3)
    # the squared norm grows roughly linearly with depth in pre-LN
    slope = np.diff(n_pre ** 2)
    assert slope.min() > 0.2 * slope.mean()
    assert c_pre[-4:].mean() > c_post[-4:].mean()  # cosine saturates in pre-LN


def test_positional_propagation_through_identity_blocks_keeps_the_projection():
    s = _seeded(n_layers=3)
    w = s.weights
    for k in range(3):
        w[f"blocks.{k}.attn.w_o"] = np.zeros_like(w[f"blocks.{k}.attn.w_o"])
        w[f"blocks.{k}.mlp.w_out"] = np.zeros_like(w[f"blocks.{k}.mlp.w_out"])
    s = pyengine.Stack(s.config, w)
    v = np.eye(32)[:2]
    pp = positional_propagation(s, np.arange(8), v, [0.5, 2.0])
    assert pp.projection == pytest.approx(np.tile([0.5, 2.0], (4, 1)), rel=1e-10)
    assert pp.projection_linearized == pytest.approx(pp.projection, rel=1e-10)
    assert pp.projection_median == pytest.approx(pp.projection, rel=1e-10)


def test_positional_propagation_median_over_positions():
    s = _seeded(n_layers=2)
    v = np.eye(32)[:1]
    pp = positional_propagation(s, np.arange(8), v, [0.5])
    p = pyengine.propagate(s, np.arange(8), v[0], 0.5, 0, "all")
    per = np.abs(p.view("projection", "all", reduce=None)[:, 0])  # (L', T)
    assert pp.projection_median[:, 0] == pytest.approx(np.median(per, axis=-1), rel=1e-12)
    assert pp.projection[:, 0] == pytest.approx(per.mean(axis=-1), rel=1e-12)
    assert not np.allclose(pp.projection_median[1:], pp.projection[1:])  # a real stack: not every position alike


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="h must have shape"):
        positional_decomposition(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="k must be"):
        positional_decomposition(np.ones((3, 4, 5)), k=9)
    with pytest.raises(ValueError, match="h"):
        positional_decomposition(np.full((3, 4, 5), np.nan))
    with pytest.raises(ValueError, match="folds"):
        position_probe(np.ones((3, 4, 5)), folds=5)
    with pytest.raises(ValueError, match="target"):
        position_probe(np.ones((3, 4, 5)), target="rope")
    with pytest.raises(ValueError, match="inputs"):
        placement_profile(_seeded(), np.zeros(5, dtype=np.int64))
    with pytest.raises(TypeError, match="model"):
        placement_profile(object(), np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="scales"):
        positional_propagation(_seeded(), np.arange(4), np.eye(32)[:2], [1.0])
