"""Fast paths of the block engine: the fused attention head, and the JVP by GEMMs.

The batched ``q k^T``, softmax and ``P v`` products of :func:`pyengine.models._attention.attn`
run at a fraction of GEMM speed on GPT-2-small shapes (780 products of 128 x 64 x 128 for
65 sequences: under a third of the speed of the weight GEMMs, plus a (B, H, T, T) score
array written and read three times). The fused kernel ``attention_forward`` of
:mod:`pyengine.kernels.attention` streams each query row over its visible keys instead
and never stores the scores: on (65 x 128, 768) float32 it takes about a quarter of the
time of the three passes it replaces (docs/design.md).

Used for float32 only: float64 keeps the batched products, bit for bit as before. The
float32 fused head accumulates its sums in float64, so its outputs are at least as
accurate as the float32 BLAS products they replace. The base-sequence forward that keeps a
cache for JVPs also takes the fused head for its output (so the exact propagation's
perturbed and base runs compute the same function, and unperturbed rows cancel exactly),
and additionally the probabilities P the JVP needs.

The float32 attention JVP (:func:`attn_jvp_gemm`) shares the base's keys, values and P
between its K tangents, so each product is one 2-D GEMM per key/value head over all K
tangents instead of K x H small batched ones (grouped-query heads included). The JVP on
per-token diagonal blocks (``ctx.rows``) keeps the generic path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels.attention import kernel as attention_kernel
from ..kernels.linear import attention_forward_kernel, attention_jvp_kernel

__all__ = ["DISCARD", "attn_blas", "attn_jvp_blas", "attn_jvp_gemm", "forward_path", "fused_dtype", "fused_heads",
           "jvp_path"]


def fused_dtype(dtype: np.dtype) -> bool:
    """Whether the forward pass of a block in ``dtype`` takes the fused attention head."""
    return dtype == np.float32


def forward_path(ctx: Any, dtype: np.dtype, changed: bool, tk: int) -> str:
    """Which path computes the heads of :func:`pyengine.models._attention.attn`, from the call's form.

    ``changed``: a hook may replace the scores, the pattern or the head outputs; ``tk`` the
    number of keys (the sequence length).

    ==========  ===========================================================================
    path        serves
    ==========  ===========================================================================
    "blas"      float32, nothing changed inside the heads, no padding mask, no rotary
                positions, and the compiled ``linear_attention_forward`` active
                (:func:`attn_blas`; P by a separate product where the cache or a site wants it)
    "fused"     the other float32 calls without changes inside the heads or a padding mask
                (rotary positions, or no compiled kernel): the fused ``attention_forward``
                head (:func:`fused_heads`), P by a separate product where wanted
    "unfused"   float64, interventions inside the heads, padding masks, a sliding window
                shorter than the sequence, soft-capped scores (the compiled heads know the
                causal mask and plain scores only): batched products, each site read (and
                replaced) in turn
    ==========  ===========================================================================
    """
    w = ctx.window
    if changed or ctx.key_mask is not None or not fused_dtype(dtype) or (w and tk > w) or ctx.cfg.attn_softcap:
        return "unfused"
    if ctx.rope_q is None and attention_forward_kernel() is not None:
        return "blas"
    return "fused"


def jvp_path(ctx: Any, dtype: np.dtype) -> str:
    """Which path computes the heads' tangent in :func:`pyengine.models._attention.attn_jvp`.

    ==========  ===========================================================================
    path        serves
    ==========  ===========================================================================
    "blas"      float32 whole rows or spans (no ``ctx.rows``), the compiled
                ``linear_attention_jvp`` active, scores not soft-capped (:func:`attn_jvp_blas`)
    "gemm"      the other float32 whole rows or spans: one 2-D GEMM per key/value head over
                all tangents (:func:`attn_jvp_gemm`; it applies the soft-cap's derivative)
    "generic"   float64, and the per-token diagonal blocks (``ctx.rows``): batched products
    ==========  ===========================================================================
    """
    if ctx.rows is not None or not fused_dtype(dtype):
        return "generic"
    return "blas" if attention_jvp_kernel() is not None and not ctx.cfg.attn_softcap else "gemm"


def _per_head(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """(B, Hkv, 1 or g, T, dh) -> a C-contiguous (B*H, T, dh) array (GQA: keys copied per query head)."""
    if x.shape != shape:
        x = np.broadcast_to(x, shape)
    return np.ascontiguousarray(x).reshape(-1, shape[-2], shape[-1])


def fused_heads(cfg: Any, start: int, q5: np.ndarray, k5: np.ndarray, v5: np.ndarray, view: np.ndarray) -> int:
    """softmax(q k^T, causal from ``start``) v into ``view`` (B, Hkv, g, T, dh); the bad-row count.

    ``q5`` (B, Hkv, g, Tq, dh) carries the 1/sqrt(dh) scale already; ``k5``, ``v5``
    (B, Hkv, 1, Tk, dh). Query row i sees keys j <= start + i (causal), all keys otherwise.
    """
    B, Hkv, g, tq, dh = q5.shape
    tk = k5.shape[-2]
    q = _per_head(q5, q5.shape)
    k = _per_head(k5, (B, Hkv, g, tk, dh))
    v = _per_head(v5, (B, Hkv, g, tk, v5.shape[-1]))
    out = np.empty((q.shape[0], tq, v.shape[-1]), q.dtype)
    lse, ent = np.empty(q.shape[:2]), np.empty(q.shape[:2])
    offset = start if cfg.causal else tk - 1
    nbad = attention_kernel("attention_forward")(q, k, v, offset, 1.0, out, lse, ent)
    np.copyto(view, out.reshape(view.shape))
    return nbad


#: A key of a block's cache dict set by callers that discard the cache: the forward then
#: skips what only a JVP or VJP would read (the attention probabilities of the fused path).
DISCARD = "fast.discard"


def attn_jvp_gemm(ctx: Any, dq: np.ndarray, dk: np.ndarray, dv: np.ndarray, cache: dict, softmax_jvp: Any,
                  check: Any) -> np.ndarray:
    """The head outputs' tangent of a float32 attention JVP by 2-D GEMMs, (K, T', H, dh).

    ``dq``, ``dk`` (H or Hkv, K, T', dh): the query and key tangents in head-major order,
    already rotated and scaled like the base; ``dv`` (K, T', Hkv, dh) (a view). The
    batched (K x H) products of 128 x 64 x 128 that the generic path multiplies run
    several times slower per flop than one GEMM per key/value head over all K tangents
    (the base's keys, values and probabilities are shared by the K tangents):

    dS = dQ K^T + Q dK^T (causal keys from ``start``), times the soft-cap's derivative
    ``cache["attn.capd"]`` where the scores are capped, dP = P (dS - rowsum(P dS)),
    dO = dP V + P dV. Masked entries have P = 0 and drop out exactly.
    """
    cfg, s = ctx.cfg, ctx.start
    H, Hkv = cfg.n_heads, cfg.n_kv_heads
    g = H // Hkv
    q5, k5, v5, p = cache["attn.q"], cache["attn.k"], cache["attn.v"], cache["attn.p"]
    capd = cache.get("attn.capd")
    K, tq, _, dh = dv.shape
    tk = k5.shape[-2]
    dq3, dk3 = dq.reshape(Hkv, g * K * tq, dh), dk.reshape(Hkv, K * tq, dh)
    ds = np.empty((Hkv, g, K, tq, tk), dq.dtype)
    oh = np.empty((Hkv, g, K, tq, dh), dq.dtype)
    pdv = np.empty((Hkv, g, tq, K, dh), dq.dtype)
    dvh = np.ascontiguousarray(dv.transpose(2, 1, 0, 3)).reshape(Hkv, tq, K * dh)  # (Hkv, T', K dh)
    tmp = np.empty((g * tq, K * tq), dq.dtype)
    for j in range(Hkv):
        kj, vj = np.ascontiguousarray(k5[0, j, 0]), np.ascontiguousarray(v5[0, j, 0])  # (Tk, dh), BLAS layout
        qj = q5[0, j].reshape(g * tq, dh)
        dsj = ds[j].reshape(g * K * tq, tk)
        np.matmul(dq3[j], kj.T, out=dsj)
        np.matmul(qj, dk3[j].T, out=tmp)  # (g T', K T'): q_i . dk_j for every tangent
        ds[j][..., s:] += tmp.reshape(g, tq, K, tq).transpose(0, 2, 1, 3)
        if capd is not None:
            ds[j] *= capd[0, j][:, None]
        for i in range(g):
            h5 = ds[j, i].reshape(K, 1, tq, tk)
            check(softmax_jvp(p[0, j, i][None], h5, h5), "attention score tangents")
        np.matmul(dsj, vj, out=oh[j].reshape(g * K * tq, dh))
        np.matmul(p[0, j].reshape(g * tq, tk)[:, s:], dvh[j], out=pdv[j].reshape(g * tq, K * dh))
    buf = np.empty((K, tq, H, dh), dq.dtype)
    np.add(oh.reshape(H, K, tq, dh).transpose(1, 2, 0, 3), pdv.reshape(H, tq, K, dh).transpose(2, 1, 0, 3), out=buf)
    return buf


def _jvp_operands(cache: dict) -> tuple[np.ndarray, ...]:
    """The base's q (Hkv, g, tq, dh), k, v (Hkv, tk, dh), p (Hkv, g, tq, tk), C-contiguous; kept in the cache."""
    ops = cache.get("fast.jvp_operands")
    if ops is None:
        q5, k5, v5, p = cache["attn.q"], cache["attn.k"], cache["attn.v"], cache["attn.p"]
        ops = cache["fast.jvp_operands"] = tuple(np.ascontiguousarray(a[0]) for a in (q5, k5[:, :, 0], v5[:, :, 0], p))
    return ops


def attn_jvp_blas(ctx: Any, x: np.ndarray, cache: dict, qk: Any, check: Any) -> np.ndarray:
    """The head outputs' tangent (K, T', H, dh) by the compiled ``linear_attention_jvp`` (path "blas").

    ``x`` (K, T', H + 2 Hkv, dh): the projections' tangents (a workspace of the caller,
    overwritten here with the rotated query and key tangents under rotary positions);
    ``qk`` the caller's rotation and scaling (``_attention._qk``). One OpenMP region with
    single-threaded BLAS per (head, tangents) tile instead of NumPy's threaded products and
    the strided passes between them.
    """
    fn = attention_jvp_kernel()
    cfg = ctx.cfg
    H, Hkv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    K, tq = x.shape[:2]
    scale = cfg.score_scale
    if ctx.rope_q is not None:  # rotate (and scale q) into the workspace: the kernel takes dqkv as is
        dq, dk = qk(ctx, x[:, :, :H].transpose(2, 0, 1, 3), x[:, :, H : H + Hkv].transpose(2, 0, 1, 3))
        x[:, :, :H] = dq.transpose(1, 2, 0, 3)
        x[:, :, H : H + Hkv] = dk.transpose(1, 2, 0, 3)
        scale = 1.0
    q, k, v, p = _jvp_operands(cache)
    out = np.empty((K, tq, H, dh), x.dtype)
    check(_ran(fn(x, q, k, v, p, ctx.start, scale, out)), "attention score tangents")
    return out


def attn_blas(cfg: Any, start: int, qkv: np.ndarray, past: dict | None, check: Any) -> np.ndarray:
    """The head outputs (B, T', H, dh) by the compiled ``linear_attention_forward`` (path "blas").

    ``qkv`` (B, T', H + 2 Hkv, dh): the projections (no rotary positions); ``past`` the
    base cache whose first ``start`` keys and values come before these rows (start > 0).
    Per (sequence, head) single-threaded BLAS for the scores and P V, the softmax between
    them in cache; no prepended copies of the past keys, no per-head copies of q, k, v.
    """
    fn = attention_forward_kernel()
    B, tq, _, dh = qkv.shape
    H, Hkv = cfg.n_heads, cfg.n_kv_heads
    if start:
        kp, vp = (np.ascontiguousarray(past[n][0, :, 0, :start]) for n in ("attn.k", "attn.v"))
    else:
        kp = vp = np.empty((Hkv, 0, dh), qkv.dtype)
    out = np.empty((B, tq, H, dh), qkv.dtype)
    nbad = fn(np.ascontiguousarray(qkv), kp, vp, H, start if cfg.causal else start + tq - 1, cfg.score_scale, out)
    check(_ran(nbad), "attention scores")
    return out


def _ran(nbad: int) -> int:
    """A compiled kernel's bad-row count; -1 (its BLAS path turned off after the path was chosen) raises."""
    if nbad < 0:
        raise RuntimeError("the compiled attention kernel's BLAS path was turned off while a block ran")
    return nbad
