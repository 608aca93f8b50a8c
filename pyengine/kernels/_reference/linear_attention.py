"""Reference attention heads of the block engine: ``linear_attention_forward`` and ``linear_attention_jvp``.

The whole attention of one block, every query head against its key/value head (grouped
queries: head h = j g + i uses key/value head j), in the layouts of the block engine's
projections, so that no per-head copies are made. Arrays are C-contiguous of one dtype
(float32 or float64); everything is computed in float64 and cast to the output's dtype.
The compiled kernels (``"cpp"``) return -1 and leave ``out`` untouched where their BLAS
path is off (no BLAS found, or forced off); the caller then takes another path.

Forward, ``linear_attention_forward(qkv, kp, vp, n_heads, offset, scale, out)``: ``qkv``
(B, tq, H + 2 Hkv, dh) the projections [q heads | k heads | v heads] of B sequences,
``kp``, ``vp`` (Hkv, s, dh) the keys and values of s past positions shared by every
sequence (s may be 0), ``n_heads`` = H, a multiple of Hkv; ``out`` (B, tq, H, dh) =
softmax_j(scale q_t . k_j) v_j over the keys j <= offset + t of the s + tq keys (the
past ones first). A row is bad, and its output NaN, when the maximum or the sum of its
visible scores is not finite.

JVP, ``linear_attention_jvp(dqkv, q, k, v, p, start, scale, out)``: the tangent of the
head outputs for K tangents ``dqkv`` (K, tq, H + 2 Hkv, dh) of the projections, at the base
q (Hkv, g, tq, dh) (rotated and scaled as the base used it), k, v (Hkv, tk, dh) and the
probabilities p (Hkv, g, tq, tk), tk = start + tq (a causal span from ``start``: the
tangents move the last tq keys only). Per tangent r and query head h:
dS = scale dQ K^T, dS[:, start:] += Q dK^T, dP = P (dS - rowsum(P dS)),
out[r, :, h] = dP V + P[:, start:] dV. A row is bad when its sum rowsum(P dS) is not finite.
"""

from __future__ import annotations

import numpy as np

from ...backends import register

__all__ = ["linear_attention_forward", "linear_attention_jvp"]


@register("linear_attention_forward", "numpy")
def linear_attention_forward(qkv: np.ndarray, kp: np.ndarray, vp: np.ndarray, n_heads: int, offset: int,
                             scale: float, out: np.ndarray) -> int:
    """out = softmax(scale q k^T, keys j <= offset + t) v per sequence and head; the bad rows."""
    B, tq, _, dh = qkv.shape
    Hkv, s = kp.shape[:2]
    H, g = n_heads, n_heads // Hkv
    x, kp, vp = (a.astype(np.float64) for a in (qkv, kp, vp))
    masked = np.arange(s + tq)[None, :] > offset + np.arange(tq)[:, None]
    nbad = 0
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(B):
            for h in range(H):
                j = h // g
                keys = np.concatenate([kp[j], x[b, :, H + j]])
                values = np.concatenate([vp[j], x[b, :, H + Hkv + j]])
                sc = scale * (x[b, :, h] @ keys.T)
                sc[masked] = -np.inf
                e = np.exp(sc - sc.max(axis=1, keepdims=True))
                total = e.sum(axis=1, keepdims=True)
                bad = ~(total[:, 0] >= 1.0)  # NaN, +Inf or no finite score among the visible ones
                o = (e / total) @ values
                o[bad] = np.nan
                out[b, :, h] = o
                nbad += int(np.count_nonzero(bad))
    return nbad


@register("linear_attention_jvp", "numpy")
def linear_attention_jvp(dqkv: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, p: np.ndarray, start: int,
                         scale: float, out: np.ndarray) -> int:
    """out = dP V + P[:, start:] dV per tangent and head (see the module docstring); the bad rows."""
    K, tq, _, dh = dqkv.shape
    Hkv, g = q.shape[:2]
    H = Hkv * g
    dqkv, q, k, v, p = (a.astype(np.float64) for a in (dqkv, q, k, v, p))
    nbad = 0
    with np.errstate(invalid="ignore", over="ignore"):
        for r in range(K):
            for h in range(H):
                j, i = divmod(h, g)
                dq, dk, dv = dqkv[r, :, h], dqkv[r, :, H + j], dqkv[r, :, H + Hkv + j]
                ph = p[j, i]
                ds = scale * (dq @ k[j].T)
                ds[:, start:] += q[j, i] @ dk.T
                rowsum = (ph * ds).sum(axis=1, keepdims=True)
                dp = ph * (ds - rowsum)
                out[r, :, h] = dp @ v[j] + ph[:, start:] @ dv
                nbad += int(np.count_nonzero(~np.isfinite(rowsum)))
    return nbad
