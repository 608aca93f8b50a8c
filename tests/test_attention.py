"""Attention backward kernels and the fused head: the reference against finite differences
and the identities, every backend against the reference, awkward and bad input."""

from __future__ import annotations

import numpy as np
import pytest

import pyengine as pe
from pyengine.kernels import attention as pa
import helpers
from helpers import visible_mask as visible

#: (rtol, atol relative to the scale of the result's terms), per dtype. float32 inputs are
#: rounded first, which both sides share; the score gradient is the float64 result rounded
#: once, the C++ fused head computes in float (test_fused_head_float32_compute_accuracy).
TOL = {np.float32: (2e-6, 2e-7), np.float64: (1e-12, 1e-13)}


def assert_close(actual, desired, dtype, scale=None):
    helpers.assert_close(actual, desired, dtype, scale, TOL)


def case(lead, tq, tk, dv, offset, dtype, seed=0, logit_scale=2.0):
    """(p, u, v) with p a masked softmax of random scores."""
    rng = np.random.default_rng(seed)
    x = (logit_scale * rng.standard_normal(lead + (tq, tk))).astype(dtype)
    p = pe.softmax(x, offset=offset, backend="numpy")
    u = rng.standard_normal(lead + (tq, dv)).astype(dtype)
    v = rng.standard_normal(lead + (tk, dv)).astype(dtype)
    return p, u, v


def head(lead, tq, tk, dk, dv, dtype, seed=0, qk_scale=1.0):
    rng = np.random.default_rng(seed)
    q = (qk_scale * rng.standard_normal(lead + (tq, dk))).astype(dtype)
    k = (qk_scale * rng.standard_normal(lead + (tk, dk))).astype(dtype)
    v = rng.standard_normal(lead + (tk, dv)).astype(dtype)
    d_o = rng.standard_normal(lead + (tq, dv)).astype(dtype)
    return q, k, v, d_o


# (lead, Tq, Tk, dv, offset)
SCORE_CASES = [
    ((1,), 1, 1, 1, 0), ((2,), 5, 5, 3, 0), ((3,), 4, 7, 5, 3), ((2, 3), 6, 6, 8, None),
    ((12,), 17, 17, 16, 0), ((1,), 9, 130, 7, 121), ((2,), 33, 33, 64, None),
]
SCORE_IDS = [f"{'x'.join(map(str, c[0]))}-{c[1]}x{c[2]}x{c[3]}-off{c[4]}" for c in SCORE_CASES]


# --------------------------------------------------------------------------- the reference


def loss_of_scores(s, v, w, offset):
    """L = sum(w * softmax(s) v): its gradient in o is w, so u = w."""
    return float((w * (pe.softmax(s, offset=offset, backend="numpy") @ v)).sum())


@pytest.mark.parametrize(("lead", "tq", "tk", "dv", "offset"), SCORE_CASES[:5], ids=SCORE_IDS[:5])
def test_reference_score_grad_is_the_central_difference(lead, tq, tk, dv, offset):
    rng = np.random.default_rng(1)
    s = rng.standard_normal(lead + (tq, tk))
    v = rng.standard_normal(lead + (tk, dv))
    w = rng.standard_normal(lead + (tq, dv))
    p = pe.softmax(s, offset=offset, backend="numpy")
    g = pa.attention_score_grad(p, w, v, offset=offset, backend="numpy")
    h = 1e-6
    fd = np.zeros_like(s)
    for idx in np.ndindex(*s.shape):
        e = np.zeros_like(s)
        e[idx] = h
        fd[idx] = (loss_of_scores(s + e, v, w, offset) - loss_of_scores(s - e, v, w, offset)) / (2 * h)
    np.testing.assert_allclose(g, fd, rtol=1e-7, atol=1e-8)  # FD rounding: eps |L| / h


@pytest.mark.parametrize(("lead", "tq", "tk", "dv", "offset"), SCORE_CASES, ids=SCORE_IDS)
def test_reference_advantage_identities(lead, tq, tk, dv, offset):
    p, u, v = case(lead, tq, tk, dv, offset, np.float64, seed=tq + tk)
    g, a = pa.attention_score_grad(p, u, v, offset=offset, advantage=True, backend="numpy")
    np.testing.assert_allclose(g.sum(-1), 0.0, atol=1e-13 * np.abs(g).max() * tk)  # rows sum to 0
    np.testing.assert_allclose(g, p * a, rtol=1e-15, atol=0)  # dS = P ⊙ A
    np.testing.assert_allclose((p * a).sum(-1), 0.0, atol=1e-12)  # A is centred under p
    b = np.einsum("...id,...jd->...ij", u, v)
    vis = visible(tq, tk, offset)
    np.testing.assert_allclose(np.where(vis, a, 0), np.where(vis, b - (p * b).sum(-1, keepdims=True), 0), atol=1e-12)
    assert (a[..., ~vis] == 0).all() and (g[..., ~vis] == 0).all()


FUSED_CASES = [  # (lead, Tq, Tk, dk, dv, offset)
    ((1,), 1, 1, 1, 1, 0), ((1,), 7, 7, 3, 4, 0), ((2,), 5, 9, 4, 3, 4), ((2, 2), 6, 6, 5, 2, None),
    ((1,), 64, 64, 10, 15, 0), ((3,), 40, 40, 8, 16, None), ((1,), 130, 130, 10, 15, 0),
]
FUSED_IDS = [f"{'x'.join(map(str, c[0]))}-{c[1]}x{c[2]}-dk{c[3]}dv{c[4]}-off{c[5]}" for c in FUSED_CASES]


def head_loss(q, k, v, w, offset, scale):
    return float((w * pa.attention_forward(q, k, v, offset=offset, scale=scale,
                                           backend="numpy").out).sum())


@pytest.mark.parametrize(("lead", "tq", "tk", "dk", "dv", "offset"), FUSED_CASES[:4], ids=FUSED_IDS[:4])
def test_reference_fused_backward_is_the_central_difference(lead, tq, tk, dk, dv, offset):
    q, k, v, w = head(lead, tq, tk, dk, dv, np.float64, seed=3)
    sc = 0.7
    fwd = pa.attention_forward(q, k, v, offset=offset, scale=sc, backend="numpy")
    grads = pa.attention_backward(q, k, v, w, fwd.lse, offset=offset, scale=sc, backend="numpy")
    args = [q, k, v]
    h = 1e-6
    for which, got in zip(range(3), grads[:3]):
        fd = np.zeros_like(args[which])
        for idx in np.ndindex(*fd.shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[which][idx] += h
            minus[which][idx] -= h
            fd[idx] = (head_loss(*plus, w, offset, sc) - head_loss(*minus, w, offset, sc)) / (2 * h)
        np.testing.assert_allclose(got, fd, rtol=1e-7, atol=1e-9)


def test_reference_fused_statistics_are_the_definitions():
    q, k, v, d_o = head((2,), 6, 6, 3, 4, np.float64, seed=5)
    fwd = pa.attention_forward(q, k, v, offset=0, scale=0.5, backend="numpy")
    s = 0.5 * q @ k.transpose(0, 2, 1)
    p = pe.softmax(s, offset=0, backend="numpy")
    vis = visible(6, 6, 0)
    np.testing.assert_allclose(fwd.out, p @ v, rtol=1e-14)
    np.testing.assert_allclose(fwd.lse, np.log(np.where(vis, np.exp(s), 0).sum(-1)), rtol=1e-14)
    ent = -np.where(vis, p * np.log(np.where(vis, p, 1.0)), 0).sum(-1)
    np.testing.assert_allclose(fwd.entropy, ent, rtol=1e-12, atol=1e-15)
    back = pa.attention_backward(q, k, v, d_o, fwd.lse, offset=0, scale=0.5, backend="numpy")
    _, a = pa.attention_score_grad(p, d_o, v, offset=0, advantage=True, backend="numpy")
    np.testing.assert_allclose(back.spread, np.sqrt((p * a * a).sum(-1)), rtol=1e-13)


# --------------------------------------------------------------------------- every backend vs the reference


@pytest.mark.parametrize("advantage", [False, True], ids=["grad", "advantage"])
@pytest.mark.parametrize(("lead", "tq", "tk", "dv", "offset"), SCORE_CASES, ids=SCORE_IDS)
def test_score_grad_matches_the_reference(compiled, dtype, lead, tq, tk, dv, offset, advantage):
    p, u, v = case(lead, tq, tk, dv, offset, dtype, seed=tq * tk)
    before = [a.copy() for a in (p, u, v)]
    want = pa.attention_score_grad(p, u, v, offset=offset, advantage=advantage, backend="numpy")
    got = pa.attention_score_grad(p, u, v, offset=offset, advantage=advantage, backend=compiled)
    scale = float(np.abs(np.einsum("...id,...jd->...ij", u.astype(np.float64), v)).max())
    for g, w in zip(got if advantage else (got,), want if advantage else (want,)):
        assert g.dtype == dtype and g.shape == p.shape
        assert_close(g, w, dtype, scale=scale)
    for a, b in zip((p, u, v), before):
        np.testing.assert_array_equal(a, b)  # inputs unchanged


@pytest.mark.parametrize("kind", ["one_hot", "large_logits", "masked_nan"])
def test_score_grad_awkward_inputs(backend, dtype, kind):
    tq = tk = 9
    p, u, v = case((2,), tq, tk, 5, 0, dtype, seed=7, logit_scale=300.0 if kind == "large_logits" else 2.0)
    if kind == "one_hot":
        p = np.zeros_like(p)
        p[..., np.arange(tq), np.arange(tq) // 2] = 1.0
    if kind == "masked_nan":
        p = p.copy()
        p[..., ~visible(tq, tk, 0)] = np.nan  # masked entries are never read
    g, a = pa.attention_score_grad(p, u, v, offset=0, advantage=True, backend=backend)
    assert np.isfinite(g).all() and np.isfinite(a).all()
    np.testing.assert_allclose(g.sum(-1), 0.0, atol=1e-5 if dtype == np.float32 else 1e-12)
    if kind == "one_hot":  # a one-hot row has no gradient: the advantage of its key is 0
        np.testing.assert_array_equal(g, 0.0)
    want = pa.attention_score_grad(np.nan_to_num(p), u, v, offset=0, backend="numpy")
    assert_close(g, want, dtype, scale=float(np.abs(u).max() * np.abs(v).max() * 5))


@pytest.mark.parametrize(("lead", "tq", "tk", "dk", "dv", "offset"), FUSED_CASES, ids=FUSED_IDS)
def test_fused_head_matches_the_materialized_reference(compiled, dtype, lead, tq, tk, dk, dv, offset):
    q, k, v, d_o = head(lead, tq, tk, dk, dv, dtype, seed=tq + dk)
    before = [a.copy() for a in (q, k, v, d_o)]
    want = pa.attention_forward(q, k, v, offset=offset, backend="numpy")
    got = pa.attention_forward(q, k, v, offset=offset, backend=compiled)
    assert got.out.dtype == dtype and got.lse.dtype == np.float64
    assert_close(got.out, want.out, dtype, scale=float(np.abs(v).max()))
    assert_close(got.lse, want.lse, np.float64 if dtype == np.float64 else dtype)
    assert_close(got.entropy, want.entropy, dtype, scale=max(1.0, float(np.log(tk))))
    wb = pa.attention_backward(q, k, v, d_o, want.lse, o=want.out, offset=offset, backend="numpy")
    gb = pa.attention_backward(q, k, v, d_o, want.lse, o=want.out, offset=offset, backend=compiled)
    for name in ("dq", "dk", "dv", "spread"):
        w = getattr(wb, name)
        assert_close(getattr(gb, name), w, dtype, scale=float(np.abs(w).max()) + 1e-300)
    for a, b in zip((q, k, v, d_o), before):
        np.testing.assert_array_equal(a, b)


def test_fused_head_large_logits_and_one_key(backend, dtype):
    q, k, v, d_o = head((1,), 12, 12, 4, 3, dtype, seed=11, qk_scale=30.0)  # near one-hot rows
    f = pa.attention_forward(q, k, v, offset=0, backend=backend)
    b = pa.attention_backward(q, k, v, d_o, f.lse, offset=0, backend=backend)
    assert all(np.isfinite(a).all() for a in (*f, *b))
    np.testing.assert_allclose(f.out[:, 0], v[:, 0], rtol=1e-6)  # query 0 sees key 0 only
    assert f.entropy[0, 0] == 0.0 and b.spread[0, 0] == 0.0 and (b.dq[0, 0] == 0).all()


# (qk_scale, bound): the C++ fused head computes in float for float32 inputs (row sums,
# lse, entropy and the sum over chunks in double). Measured at T = 2000, dk = 10, dv = 15
# over 3 seeds, max |error| / max |result| against float64 on the same rounded inputs:
# <= 7.8e-7 at qk_scale 1 (scores up to ~5), <= 2.6e-6 at qk_scale 3 (scores up to ~40:
# the error grows with |s|, an ulp of the score moves p by |s| eps). Bounds ~2x that.
FLOAT32_CASES = [(1.0, 1.5e-6), (3.0, 6e-6)]


@pytest.mark.parametrize(("qk_scale", "bound"), FLOAT32_CASES, ids=["s1", "s3"])
def test_fused_head_float32_compute_accuracy(qk_scale, bound):
    q, k, v, d_o = head((1,), 2000, 2000, 10, 15, np.float32, seed=5, qk_scale=qk_scale)
    x64 = [a.astype(np.float64) for a in (q, k, v, d_o)]
    want_f = pa.attention_forward(*x64[:3], offset=0, backend="cpp")
    want_b = pa.attention_backward(*x64[:3], x64[3], want_f.lse, o=want_f.out, offset=0, backend="cpp")
    got_f = pa.attention_forward(q, k, v, offset=0, backend="cpp")
    got_b = pa.attention_backward(q, k, v, d_o, got_f.lse, o=got_f.out, offset=0, backend="cpp")
    for got, want in zip((*got_f, *got_b), (*want_f, *want_b)):
        err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
        assert err <= bound, err


@pytest.mark.parametrize("offset", [0, None, 37], ids=["causal", "bidirectional", "off37"])
def test_fused_head_threads_do_not_change_results(compiled, offset):
    q, k, v, d_o = head((2,), 300, 300, 10, 15, np.float64, seed=2)
    with pe.num_threads(1):
        f1 = pa.attention_forward(q, k, v, offset=offset, backend=compiled)
        b1 = pa.attention_backward(q, k, v, d_o, f1.lse, o=f1.out, offset=offset, backend=compiled)
    for nt in (2, 3):  # 3: the chunks of the backward pass do not divide evenly among threads
        with pe.num_threads(nt):
            f2 = pa.attention_forward(q, k, v, offset=offset, backend=compiled)
            b2 = pa.attention_backward(q, k, v, d_o, f2.lse, o=f2.out, offset=offset, backend=compiled)
        for x, y in zip((*f1, *b1), (*f2, *b2)):
            np.testing.assert_array_equal(x, y)


def test_backward_takes_the_forward_output(backend, dtype):
    q, k, v, d_o = head((3,), 21, 21, 4, 5, dtype, seed=9)
    f = pa.attention_forward(q, k, v, offset=0, backend=backend)
    given = pa.attention_backward(q, k, v, d_o, f.lse, o=f.out, offset=0, backend=backend)
    computed = pa.attention_backward(q, k, v, d_o, f.lse, offset=0, backend=backend)  # o from a forward pass
    for x, y in zip(given, computed):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match=r"o must have shape \(3, 21, 5\)"):
        pa.attention_backward(q, k, v, d_o, f.lse, o=f.out[..., :4], offset=0, backend=backend)
    bad = f.out.copy()
    bad[0, 3, 1] = np.inf
    with pytest.raises(ValueError, match="o contains NaN or Inf"):
        pa.attention_backward(q, k, v, d_o, f.lse, o=bad, offset=0, backend=backend)


# --------------------------------------------------------------------------- bad input


def test_bad_input_messages():
    p, u, v = case((2,), 4, 4, 3, 0, np.float64)
    with pytest.raises(ValueError, match="u must have shape"):
        pa.attention_score_grad(p, u[:, :3], v)
    with pytest.raises(ValueError, match="leading axes"):
        pa.attention_score_grad(p, u[:1], v)
    with pytest.raises(TypeError):
        pa.attention_score_grad(p.astype(int), u, v)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        pa.attention_score_grad(p, u, v, offset=-1)
    bad = u.copy()
    bad[1, 2, 0] = np.nan
    for b in ("numpy", "auto"):
        with pytest.raises(ValueError, match=r"u contains NaN or Inf \(first at \(1, 2, 0\)"):
            pa.attention_score_grad(p, bad, v, offset=0, backend=b)
    q, k, vv, d_o = head((1,), 3, 3, 2, 2, np.float64)
    with pytest.raises(ValueError, match="scale must be a positive"):
        pa.attention_forward(q, k, vv, scale=0.0)
    with pytest.raises(ValueError, match="must agree in dk"):
        pa.attention_forward(q, k[..., :1], vv)
    f = pa.attention_forward(q, k, vv)
    with pytest.raises(ValueError, match="lse must have shape"):
        pa.attention_backward(q, k, vv, d_o, f.lse[:, :2])
    k2 = k.copy()
    k2[0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="k contains NaN or Inf"):
        pa.attention_forward(q, k2, vv)
    with pytest.raises(ValueError, match="backend must be one of"):
        pa.attention_forward(q, k, vv, backend="cuda")
