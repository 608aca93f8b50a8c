"""NumPy reference of the attention backward kernels and of the fused attention head.

The kernel contract is that of :mod:`pyengine.kernels._reference.layernorm` (C-contiguous
arrays of one dtype, float32 or float64, validated by the public layer
:mod:`pyengine.kernels.attention`; outputs preallocated and written in full; the return
value is the number of *bad rows*, whose outputs are unspecified). Everything is computed
in float64 and cast to the dtype of the output; the compiled backends must match this to
rounding. The mask is the one of the softmax kernel
(:mod:`pyengine.kernels._reference.activations`): key j is visible to query i when
j <= i + offset (offset >= 0; ``offset >= Tk - 1`` masks nothing, ``offset = 0`` with
Tq = Tk is the causal mask). Masked entries of an input are never read (any value, NaN
included); masked entries of an output are written as exactly 0.

One head (DESIGN.md): s_ij = scale q_i.k_j, p_ij = softmax_j(s_ij), o_i = sum_j p_ij v_j,
u_i = dL/do_i, b_ij = u_i.v_j, A_ij = b_ij - sum_k p_ik b_ik (the advantage) and
dL/ds_ij = p_ij A_ij, whose rows sum to 0.

Score gradient, ``attention_score_grad(p, u, v, offset, out)``: ``p`` (N, Tq, Tk) the
attention probabilities, ``u`` (N, Tq, dv) the upstream gradient of the head's output,
``v`` (N, Tk, dv) the values, ``out`` (N, Tq, Tk) = dL/ds. Each b_ij is formed once
(kept for the row, then used for both the row sum and the output). A row is bad if its
sum c_i = sum_j p_ij b_ij is not finite (NaN/Inf in a visible p, in u or in v).

``attention_advantage(p, u, v, offset, out, advantage)``: the same, and also writes the
advantage A (N, Tq, Tk) into ``advantage`` in the same pass (0 where masked). A
separate kernel id rather than an optional argument: every backend's signature stays
one fixed list of arrays, and the plain gradient does not pay for the second store.

Fused head, forward, ``attention_forward(q, k, v, offset, scale, out, lse, entropy)``:
``q`` (N, Tq, dk), ``k`` (N, Tk, dk), ``v`` (N, Tk, dv), ``scale`` > 0 (usually
1/sqrt(dk)); ``out`` (N, Tq, dv) = o; the row statistics ``lse`` (N, Tq) float64 =
log sum_j exp(s_ij) over the visible keys (the log-partition, which the backward pass
needs to recompute p) and ``entropy`` (N, Tq) float64 = -sum_j p_ij log p_ij
= lse_i - sum_j p_ij s_ij. The compiled backends never store a (Tq, Tk) matrix: they
stream the rows. A row is bad if its lse or output is not finite.

Fused head, backward, ``attention_backward(q, k, v, d_o, lse, offset, scale, dq, dk, dv,
spread)``: ``d_o`` (N, Tq, dv) = dL/do and ``lse`` (N, Tq) float64 from the forward
pass; outputs dq (N, Tq, dk) = sum_j g_ij scale k_j, dk (N, Tk, dk) = sum_i g_ij scale q_i,
dv (N, Tk, dv) = sum_i p_ij d_o_i with g = dL/ds = p ⊙ A, and the row statistic
``spread`` (N, Tq) float64 = sqrt(sum_j p_ij A_ij^2), the attention-weighted standard
deviation of row i of b (sum_j p_ij A_ij = 0). p is recomputed from q, k and lse; the
compiled backends never store a (Tq, Tk) matrix. A row is bad if its dq or spread is
not finite; NaN/Inf that reaches only dk or dv (a key no query sees) is counted as one
bad row too.
"""

from __future__ import annotations

import numpy as np

from ...backends import register

__all__ = ["attention_advantage", "attention_backward", "attention_forward", "attention_score_grad"]


def _visible(tq, tk, offset):
    """(Tq, Tk): True where key j is visible to query i (j <= i + offset)."""
    return np.arange(tk)[None, :] <= np.arange(tq)[:, None] + offset


def _score_grad(p, u, v, offset):
    """(g = p * A, A, bad-row count) in float64; masked entries 0."""
    _, tq, tk = p.shape
    vis = _visible(tq, tk, offset)
    with np.errstate(invalid="ignore", over="ignore"):
        pd = np.where(vis, p.astype(np.float64), 0.0)  # masked p never read
        b = np.where(vis, u.astype(np.float64) @ v.astype(np.float64).transpose(0, 2, 1), 0.0)
        c = (pd * b).sum(axis=-1, keepdims=True)
        adv = np.where(vis, b - c, 0.0)
        g = pd * adv
    return g, adv, int((~np.isfinite(c)).sum())


@register("attention_score_grad", "numpy")
def attention_score_grad(p, u, v, offset, out):
    """dL/ds = p * (b - sum_j p b), b = u v^T; p, out : (N, Tq, Tk), u : (N, Tq, dv), v : (N, Tk, dv)."""
    g, _, nbad = _score_grad(p, u, v, offset)
    out[...] = g
    return nbad


@register("attention_advantage", "numpy")
def attention_advantage(p, u, v, offset, out, advantage):
    """out = dL/ds and advantage = b - sum_j p b, in one pass; shapes as attention_score_grad."""
    g, adv, nbad = _score_grad(p, u, v, offset)
    out[...] = g
    advantage[...] = adv
    return nbad


def _scores(q, k, offset, scale):
    """(scaled scores with -inf where masked, visible mask), float64 (N, Tq, Tk)."""
    _, tq, _ = q.shape
    tk = k.shape[1]
    vis = _visible(tq, tk, offset)
    s = scale * (q.astype(np.float64) @ k.astype(np.float64).transpose(0, 2, 1))
    return np.where(vis, s, -np.inf), vis


@register("attention_forward", "numpy")
def attention_forward(q, k, v, offset, scale, out, lse, entropy):
    """o = softmax(scale q k^T, masked) v with the row log-partition and entropy (materialized)."""
    with np.errstate(invalid="ignore", over="ignore"):
        s, vis = _scores(q, k, offset, scale)
        m = s.max(axis=-1, keepdims=True)
        e = np.exp(s - m)
        z = e.sum(axis=-1, keepdims=True)
        p = e / z
        o = p @ v.astype(np.float64)
        lse[...] = (m + np.log(z))[..., 0]
        entropy[...] = lse - np.where(vis, p * s, 0.0).sum(axis=-1)
        out[...] = o
        bad = ~(np.isfinite(lse) & np.isfinite(o).all(axis=-1))
    return int(bad.sum())


@register("attention_backward", "numpy")
def attention_backward(q, k, v, d_o, lse, offset, scale, dq, dk, dv, spread):
    """dq, dk, dv of the head from d_o = dL/do, p recomputed from lse; spread = sqrt(sum_j p A^2)."""
    with np.errstate(invalid="ignore", over="ignore"):
        s, _ = _scores(q, k, offset, scale)
        p = np.exp(s - lse[..., None])
        vd = v.astype(np.float64)
        g, adv, _ = _score_grad(p, d_o, vd, offset)  # p is 0 where masked
        dq[...] = scale * (g @ k.astype(np.float64))
        dk[...] = scale * (g.transpose(0, 2, 1) @ q.astype(np.float64))
        dv[...] = p.transpose(0, 2, 1) @ d_o.astype(np.float64)
        spread[...] = np.sqrt((p * adv * adv).sum(axis=-1))
        bad = ~(np.isfinite(spread) & np.isfinite(dq).all(axis=-1))
        extra = not (np.isfinite(dk).all() and np.isfinite(dv).all())
    nbad = int(bad.sum())
    return nbad if nbad or not extra else 1
