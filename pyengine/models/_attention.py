"""Multi-head (grouped-query) causal self-attention of one block, forward and JVP.

Part of the block engine :mod:`pyengine.models._blocks` (its conventions hold here:
validated C-contiguous input, a batch axis on every stream, a base cache with a
leading axis of 1 for JVPs). Scores go through the raw softmax kernels of the "auto"
backend; :func:`check` turns a kernel's bad-row count into a ValueError.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ..kernels.activations import kernel

if TYPE_CHECKING:
    from ._blocks import Cache, Context, Weights

__all__ = ["attn", "attn_jvp", "check"]


def _split_heads(qkv: np.ndarray, B: int, T: int, cfg: Any) -> tuple[np.ndarray, ...]:
    """(B*T, (H+2Hkv) dh) -> q (B, H, T, dh), k and v (B, Hkv, T, dh), as strided views."""
    H, Hkv = cfg.n_heads, cfg.n_kv_heads
    x = qkv.reshape(B, T, H + 2 * Hkv, cfg.head_dim)
    return (x[:, :, :H].transpose(0, 2, 1, 3), x[:, :, H : H + Hkv].transpose(0, 2, 1, 3),
            x[:, :, H + Hkv :].transpose(0, 2, 1, 3))


def _rotate(x: np.ndarray, table: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Half-split rotary embedding (GPT-NeoX / Llama): pairs (i, i + dh/2) rotate by angle_i."""
    cos, sin = table
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = np.empty(x.shape, x.dtype)
    o1, o2 = out[..., :half], out[..., half:]
    np.multiply(x1, cos, out=o1)
    o1 -= x2 * sin
    np.multiply(x2, cos, out=o2)
    o2 += x1 * sin
    return out


def _qk(ctx: Context, q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rotate q and k (if rotary) and fold 1/sqrt(dh) into q; q comes back C-contiguous."""
    if ctx.rope_q is not None:
        return _rotate(q, ctx.rope_q), _rotate(k, ctx.rope_k)
    return np.multiply(q, 1.0 / math.sqrt(q.shape[-1]), out=np.empty(q.shape, q.dtype)), k


def check(nbad: int, what: str) -> None:
    if nbad:
        raise ValueError(f"{what}: {nbad} row(s) hold NaN or Inf (overflow in the block; are the inputs huge?)")


def _softmax_(s: np.ndarray, ctx: Context) -> np.ndarray:
    """Row softmax of the scores s (..., Tq, Tk) in place, causal rows j <= start + i."""
    tq, tk = s.shape[-2:]
    s3 = s.reshape(-1, tq, tk)
    check(kernel("softmax")(s3, ctx.start if ctx.cfg.causal else tk - 1, s3), "attention scores")
    return s


def _heads_out(B: int, T: int, cfg: Any, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """A (B, T, H, dh) buffer and its (B, Hkv, g, T, dh) view, so P @ V lands in GEMM layout."""
    H, Hkv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    buf = np.empty((B, T, H, dh), dtype)
    return buf, buf.reshape(B, T, Hkv, H // Hkv, dh).transpose(0, 2, 3, 1, 4)


def attn(w: Weights, ctx: Context, a: np.ndarray, cache: Cache) -> np.ndarray:
    """Multi-head (grouped-query) self-attention of a (B, T, d) -> (B, T, d).

    With ``ctx.start`` = s > 0, ``a`` holds rows s..T-1 only and the keys and
    values of rows < s come from ``cache["attn.past"]`` (the base sequence's cache
    of this block, batch 1): causal attention cannot change those rows.
    """
    cfg = ctx.cfg
    B, T, d = a.shape
    H, Hkv = cfg.n_heads, cfg.n_kv_heads
    qkv = a.reshape(B * T, d) @ w["attn.w_qkv"]
    if cfg.bias:
        qkv += w["attn.b_qkv"]
    q, k, v = _split_heads(qkv, B, T, cfg)
    q, k = _qk(ctx, q, k)
    # Query heads h = j*g + i share key/value head j: (B, Hkv, g, T, dh) against (B, Hkv, 1, T, dh).
    q5 = q.reshape(B, Hkv, H // Hkv, T, cfg.head_dim)
    k5, v5 = k[:, :, None], v[:, :, None]
    s = ctx.start
    if s:
        past = cache.pop("attn.past")
        k5, v5 = (_prepend(p[..., :s, :], x) for p, x in zip((past["attn.k"], past["attn.v"]), (k5, v5)))
    p = _softmax_(np.matmul(q5, k5.swapaxes(-1, -2)), ctx)
    buf, view = _heads_out(B, T, cfg, a.dtype)
    np.matmul(p, v5, out=view)
    out = buf.reshape(B * T, H * cfg.head_dim) @ w["attn.w_o"]
    if cfg.bias:
        out += w["attn.b_o"]
    cache.update({"attn.q": q5, "attn.k": k5, "attn.v": v5, "attn.p": p})
    return out.reshape(B, T, d)


def _prepend(head: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """(1, ..., s, dh) rows before (B, ..., T', dh) rows, along the row axis, for every batch entry."""
    out = np.empty(tail.shape[:-2] + (head.shape[-2] + tail.shape[-2], tail.shape[-1]), tail.dtype)
    out[..., : head.shape[-2], :] = head
    out[..., head.shape[-2] :, :] = tail
    return out


def attn_jvp(w: Weights, ctx: Context, da: np.ndarray, cache: Cache) -> np.ndarray:
    """Tangent of :func:`attn`: (K, T, d) -> (K, T, d), including the softmax JVP.

    With ``ctx.start`` = s the tangent rows are s..T-1 (zero before); with
    ``ctx.rows`` the per-token diagonal blocks (see :func:`diagonal`).
    """
    cfg = ctx.cfg
    K, T, d = da.shape
    H, Hkv = cfg.n_heads, cfg.n_kv_heads
    dq, dk, dv = _split_heads(da.reshape(K * T, d) @ w["attn.w_qkv"], K, T, cfg)
    dq, dk = _qk(ctx, dq, dk)  # rotation and scaling are linear
    q5, k5, v5, p = cache["attn.q"], cache["attn.k"], cache["attn.v"], cache["attn.p"]
    dk5, dv5 = dk[:, :, None], dv[:, :, None]
    ds = np.matmul(dq.reshape(K, Hkv, H // Hkv, T, cfg.head_dim), k5.swapaxes(-1, -2))
    if ctx.rows is not None:
        # Token r's tangent moves only its own key: score (r, rows[r]) gains q_r . dk_r.
        r = np.arange(T)
        ds[..., r, ctx.rows] += np.einsum("...rd,...rd->...r", q5, dk5)
    else:
        ds[..., ctx.start :] += np.matmul(q5, dk5.swapaxes(-1, -2))
    # dP = P * (dS - sum_j P dS): masked entries have P = 0, so they drop out exactly.
    tq, tk = ds.shape[-2:]
    ds4 = ds.reshape(K, -1, tq, tk)
    check(kernel("softmax_jvp")(p.reshape(-1, tq, tk), ds4, ds4), "attention score tangents")
    buf, view = _heads_out(K, T, cfg, da.dtype)
    np.matmul(ds, v5, out=view)
    if ctx.rows is not None:
        view += p[..., np.arange(T), ctx.rows][..., None] * dv5
    else:
        view += np.matmul(p[..., ctx.start :], dv5)
    return (buf.reshape(K * T, H * cfg.head_dim) @ w["attn.w_o"]).reshape(K, T, d)
