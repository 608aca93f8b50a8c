"""Multi-head (grouped-query) causal self-attention of one block, forward, JVP and VJP.

Part of the block engine :mod:`pyengine.models._blocks` (its conventions hold here:
validated C-contiguous input, a batch axis on every stream, a base cache with a
leading axis of 1 for JVPs). Scores go through the raw softmax kernels of the "auto"
backend, the score gradient of the VJP through the raw ``attention_score_grad`` kernel;
:func:`check` turns a kernel's bad-row count into a ValueError.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..kernels.activations import kernel
from ..kernels.attention import kernel as attention_kernel
from ..kernels.linear import matmul_one_thread
from ._fast import DISCARD, attn_blas, attn_jvp_blas, attn_jvp_gemm, forward_path, fused_heads, jvp_path
from ._linear import dense, workspace
from ._qknorm import qk_norm_, qk_norm_jvp_, qk_norm_vjp_

if TYPE_CHECKING:
    from ._context import Cache, Context, Weights

__all__ = ["attn", "attn_jvp", "attn_vjp", "check", "softcap_"]


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
    """Rotate q and k (if rotary) and fold the score scale (1/sqrt(dh)) into q; q comes back C-contiguous."""
    if ctx.rope_q is not None:
        return _rotate(q, ctx.rope_q), _rotate(k, ctx.rope_k)
    return np.multiply(q, ctx.cfg.score_scale, out=np.empty(q.shape, q.dtype)), k


def softcap_(x: np.ndarray, cap: float) -> np.ndarray:
    """Soft-capping ``cap * tanh(x / cap)`` of x in place (Gemma 2); returns its derivative
    ``1 - tanh(x / cap)^2`` at x, x's shape, for the JVP and VJP."""
    t = np.tanh(np.divide(x, x.dtype.type(cap), out=x), out=x)
    d = 1 - t * t
    t *= x.dtype.type(cap)
    return d


def _head_sites(ctx: Context, q: np.ndarray, k: np.ndarray, v: np.ndarray, hook: Any) -> tuple[np.ndarray, ...]:
    """:func:`_qk` with the sites ``attn.q|k|v`` (B, T, heads, dh) in between: q and k after
    rotary, q before the 1/sqrt(dh) that _qk folds in; a changed site replaces the array."""
    qs, ks = _qk(ctx, q, k)
    qr = q if ctx.rope_q is None else _rotate(q, ctx.rope_k)
    sites = [x.transpose(0, 2, 1, 3) for x in (qr, ks, v)]
    new = [hook(n, x) for n, x in zip(("attn.q", "attn.k", "attn.v"), sites)]
    if new[0] is not sites[0]:
        q2 = np.asarray(new[0]).transpose(0, 2, 1, 3)
        qs = np.multiply(q2, ctx.cfg.score_scale, out=np.empty(q2.shape, q2.dtype))
    k2, v2 = (np.asarray(n).transpose(0, 2, 1, 3) if n is not s else x for n, s, x in zip(new[1:], sites[1:], (ks, v)))
    return qs, k2, v2


def check(nbad: int, what: str) -> None:
    if nbad:
        raise ValueError(f"{what}: {nbad} row(s) hold NaN or Inf (overflow in the block; are the inputs huge?)")


def _softmax_(s: np.ndarray, ctx: Context) -> np.ndarray:
    """Row softmax of the scores s (..., Tq, Tk) in place, causal rows j <= start + i; with the
    block's sliding window w also j > start + i - w (the keys before it get exactly P = 0, so the
    JVP and VJP, which multiply by P, need no mask of their own)."""
    tq, tk = s.shape[-2:]
    w = ctx.window
    if w and ctx.start + tq > w:  # scores far below any other: exp underflows to exactly 0
        far = np.arange(tk) <= (ctx.start + np.arange(tq))[:, None] - w
        np.copyto(s, np.finfo(s.dtype).min / 2, where=far)
    s3 = s.reshape(-1, tq, tk)
    check(kernel("softmax")(s3, ctx.start if ctx.cfg.causal else tk - 1, s3), "attention scores")
    return s


def _heads_out(B: int, T: int, cfg: Any, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """A (B, T, H, dh) buffer and its (B, Hkv, g, T, dh) view, so P @ V lands in GEMM layout."""
    H, Hkv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    buf = np.empty((B, T, H, dh), dtype)
    return buf, buf.reshape(B, T, Hkv, H // Hkv, dh).transpose(0, 2, 3, 1, 4)


def attn(w: Weights, ctx: Context, a: np.ndarray, cache: Cache, r: np.ndarray | None = None) -> np.ndarray:
    """Multi-head (grouped-query) self-attention of a (B, T, d) -> (B, T, d), plus ``r`` if given.

    With ``ctx.start`` = s > 0, ``a`` holds rows s..T-1 only and the keys and
    values of rows < s come from ``cache["attn.past"]`` (the base sequence's cache
    of this block, batch 1): causal attention cannot change those rows. The heads take
    the path :func:`~pyengine.models._fast.forward_path` picks.
    """
    cfg = ctx.cfg
    B, T, d = a.shape
    discard, hook = cache.get(DISCARD, False), ctx.hook
    # The projections live in a workspace when nothing keeps them (no cache, no hook)
    shape = (B * T, w["attn.w_qkv"].shape[1])
    qkv = dense(a.reshape(B * T, d), w["attn.w_qkv"], w["attn.b_qkv"] if cfg.bias else None,
                out=workspace("attn.qkv", shape, a.dtype) if discard and hook is None else None)
    if cfg.qk_norm:  # RMSNorm of each query and key head (Qwen3), before rotary
        cache["attn.qkn"] = qk_norm_(qkv.reshape(B, T, -1, cfg.head_dim), w, cfg)
    # Sites inside the heads (models/sites.py: scores and pattern as (B, H, T, Tk), head_out as
    # (B, T, H, dh)): read, or changed by an intervention (which needs the unfused products).
    read = hook is not None and getattr(hook, "heads", True)
    changed = hook is not None and getattr(hook, "heads_changed", True)
    site = hook if read else None
    past = cache.pop("attn.past") if ctx.start else None
    path = forward_path(ctx, a.dtype, changed, ctx.start + T)
    if path == "blas":
        buf = attn_blas(cfg, ctx.start, qkv.reshape(B, T, -1, cfg.head_dim), past, check)
        if discard and not read:  # nothing else wanted: no q, k, v arrays, no P
            return _project(w, cfg, buf, r)
    q5, k5, v5 = _heads_in(ctx, qkv, past, B, T, site)
    if path == "blas":  # the cache and the sites still want q, k, v and P
        p = _pattern(ctx, q5, k5, site, buf)
    elif path == "fused":
        buf, p = _fused(ctx, q5, k5, v5, site, read or not discard)
    else:
        buf, p = _unfused(ctx, q5, k5, v5, site, cache)
    out = _project(w, cfg, buf, r)
    if site is not None and getattr(site, "wants", lambda n: False)("attn.result"):
        out = _result_site(w, cfg, buf, r, site, out)
    cache.update({"attn.q": q5, "attn.k": k5, "attn.v": v5, "attn.p": p, "attn.in": a})
    return out


def _result_site(w: Weights, cfg: Any, buf: np.ndarray, r: np.ndarray | None, site: Any, out: np.ndarray
                 ) -> np.ndarray:
    """The site ``attn.result``: each head's contribution (B, T, H, d) through its rows of w_o, the
    bias excluded. Read only, the output stays ``out``; changed, the output is the sum of the changed
    contributions plus the bias (and ``r``)."""
    B, T, H, dh = buf.shape
    d = out.shape[-1]
    res = np.einsum("btha,had->bthd", buf, w["attn.w_o"].reshape(H, dh, d))
    res2 = site("attn.result", res)
    if res2 is res:
        return out
    summed = np.asarray(res2).sum(axis=2) + (w["attn.b_o"] if cfg.bias else 0)
    return summed if r is None else summed + r.reshape(B, T, d)


def _project(w: Weights, cfg: Any, buf: np.ndarray, r: np.ndarray | None) -> np.ndarray:
    """The output projection of the head outputs buf (B, T, H, dh) -> (B, T, d), plus ``r`` if given."""
    B, T, d = buf.shape[0], buf.shape[1], w["attn.w_o"].shape[1]
    return dense(buf.reshape(B * T, cfg.n_heads * cfg.head_dim), w["attn.w_o"], w["attn.b_o"] if cfg.bias else None,
                 None if r is None else r.reshape(B * T, d)).reshape(B, T, d)


def _heads_in(ctx: Context, qkv: np.ndarray, past: Cache | None, B: int, T: int, site: Any
              ) -> tuple[np.ndarray, ...]:
    """q (B, Hkv, g, T, dh), rotated and scaled, and k, v (B, Hkv, 1, Tk, dh), the past keys first;
    the sites ``attn.q|k|v`` read (and may change) them on the way when ``site`` is given."""
    cfg = ctx.cfg
    H, Hkv, s = cfg.n_heads, cfg.n_kv_heads, ctx.start
    q, k, v = _split_heads(qkv, B, T, cfg)
    q, k, v = _head_sites(ctx, q, k, v, site) if site is not None else (*_qk(ctx, q, k), v)
    # Query heads h = j*g + i share key/value head j: (B, Hkv, g, T, dh) against (B, Hkv, 1, T, dh).
    q5 = q.reshape(B, Hkv, H // Hkv, T, cfg.head_dim)
    k5, v5 = k[:, :, None], v[:, :, None]
    if s:
        k5, v5 = (_prepend(p[..., :s, :], x) for p, x in zip((past["attn.k"], past["attn.v"]), (k5, v5)))
    return q5, k5, v5


def _pattern(ctx: Context, q5: np.ndarray, k5: np.ndarray, site: Any, buf: np.ndarray) -> np.ndarray:
    """P by a separate product next to heads computed already (``buf``), for the cache and the sites
    (read only: the output stays the heads')."""
    B, Hkv, g, T = q5.shape[:4]
    sc = matmul_one_thread(q5, k5.swapaxes(-1, -2))  # no BLAS pool spinning next to the kernels
    if site is not None:
        site("attn.scores", sc.reshape(B, Hkv * g, T, -1))
    p = _softmax_(sc, ctx)
    if site is not None:
        site("attn.pattern", p.reshape(B, Hkv * g, T, -1))
        site("attn.head_out", buf)
    return p


def _fused(ctx: Context, q5: np.ndarray, k5: np.ndarray, v5: np.ndarray, site: Any, want_p: bool
           ) -> tuple[np.ndarray, np.ndarray | None]:
    """Path "fused": the heads by the fused head (models/_fast.py), and P if ``want_p`` (the JVP, the sites)."""
    B, T = q5.shape[0], q5.shape[3]
    buf, view = _heads_out(B, T, ctx.cfg, q5.dtype)
    check(fused_heads(ctx.cfg, ctx.start, q5, k5, v5, view), "attention scores")
    return buf, (_pattern(ctx, q5, k5, site, buf) if want_p else None)


def _unfused(ctx: Context, q5: np.ndarray, k5: np.ndarray, v5: np.ndarray, site: Any, cache: Cache
             ) -> tuple[np.ndarray, np.ndarray]:
    """Path "unfused" (float64, interventions inside the heads, padding masks, soft-capped scores):
    the batched products, each site read and replaced in turn. The scores' soft-cap derivative
    goes to ``cache["attn.capd"]`` (Hkv, g, T, Tk per sequence), for the JVP and VJP."""
    B, Hkv, g, T = q5.shape[:4]
    H = Hkv * g
    buf, view = _heads_out(B, T, ctx.cfg, q5.dtype)
    sc = np.matmul(q5, k5.swapaxes(-1, -2))
    if ctx.cfg.attn_softcap:
        cache["attn.capd"] = softcap_(sc, ctx.cfg.attn_softcap)
    if site is not None:
        sc = np.ascontiguousarray(site("attn.scores", sc.reshape(B, H, T, -1))).reshape(sc.shape)
    if ctx.key_mask is not None:  # padding keys: exp underflows to exactly 0 (uniform if all are padding)
        np.copyto(sc, np.finfo(sc.dtype).min / 2, where=ctx.key_mask)
    p = _softmax_(sc, ctx)
    if site is not None:
        p = np.ascontiguousarray(site("attn.pattern", p.reshape(B, H, T, -1))).reshape(p.shape)
    np.matmul(p, v5, out=view)
    if site is not None:
        buf = np.ascontiguousarray(site("attn.head_out", buf))
    return buf, p


def _prepend(head: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """(1, ..., s, dh) rows before (B, ..., T', dh) rows, along the row axis, for every batch entry."""
    out = np.empty(tail.shape[:-2] + (head.shape[-2] + tail.shape[-2], tail.shape[-1]), tail.dtype)
    out[..., : head.shape[-2], :] = head
    out[..., head.shape[-2] :, :] = tail
    return out


def attn_jvp(w: Weights, ctx: Context, da: np.ndarray, cache: Cache, r: np.ndarray | None = None) -> np.ndarray:
    """Tangent of :func:`attn`: (K, T, d) -> (K, T, d), including the softmax JVP; plus ``r`` if given.

    With ``ctx.start`` = s the tangent rows are s..T-1 (zero before); with
    ``ctx.rows`` the per-token diagonal blocks (see :func:`diagonal`). The heads take the
    path :func:`~pyengine.models._fast.jvp_path` picks.
    """
    cfg = ctx.cfg
    K, T, d = da.shape
    H, Hkv = cfg.n_heads, cfg.n_kv_heads
    dqkv = dense(da.reshape(K * T, d), w["attn.w_qkv"], None,
                 out=workspace("attn.dqkv", (K * T, w["attn.w_qkv"].shape[1]), da.dtype))  # used here only
    if cfg.qk_norm:
        qk_norm_jvp_(dqkv.reshape(K, T, -1, cfg.head_dim), w, cfg, cache["attn.qkn"])
    path = jvp_path(ctx, da.dtype)
    if path == "generic":
        buf = _jvp_generic(ctx, dqkv, cache, K, T)
    else:  # head-major products (models/_fast.py)
        x = dqkv.reshape(K, T, H + 2 * Hkv, cfg.head_dim)
        if path == "blas":
            buf = attn_jvp_blas(ctx, x, cache, _qk, check)
        else:
            dq, dk = _qk(ctx, x[:, :, :H].transpose(2, 0, 1, 3), x[:, :, H : H + Hkv].transpose(2, 0, 1, 3))
            buf = attn_jvp_gemm(ctx, dq, np.ascontiguousarray(dk), x[:, :, H + Hkv :], cache,
                                kernel("softmax_jvp"), check)
    return dense(buf.reshape(K * T, H * cfg.head_dim), w["attn.w_o"], None,
                 None if r is None else r.reshape(K * T, d)).reshape(K, T, d)


def _jvp_generic(ctx: Context, dqkv: np.ndarray, cache: Cache, K: int, T: int) -> np.ndarray:
    """Path "generic" (float64, diagonal blocks): the head outputs' tangent (K, T, H, dh) by batched products."""
    cfg = ctx.cfg
    H, Hkv = cfg.n_heads, cfg.n_kv_heads
    dq, dk, dv = _split_heads(dqkv, K, T, cfg)
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
    if "attn.capd" in cache:  # soft-capped scores: the cap's derivative, 1 - tanh^2
        ds *= cache["attn.capd"]
    # dP = P * (dS - sum_j P dS): masked entries have P = 0, so they drop out exactly.
    tq, tk = ds.shape[-2:]
    ds4 = ds.reshape(K, -1, tq, tk)
    check(kernel("softmax_jvp")(p.reshape(-1, tq, tk), ds4, ds4), "attention score tangents")
    buf, view = _heads_out(K, T, cfg, dqkv.dtype)
    np.matmul(ds, v5, out=view)
    if ctx.rows is not None:
        view += p[..., np.arange(T), ctx.rows][..., None] * dv5
    else:
        view += np.matmul(p[..., ctx.start :], dv5)
    return buf


def _qk_t(ctx: Context, dq: np.ndarray, dk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Transpose of :func:`_qk` (linear): rotate back by the negative angles, scale q by the score scale.

    Without rotary positions dq is scaled in place (the caller's fresh array).
    """
    if ctx.rope_q is not None:
        (cq, sq), (ck, sk) = ctx.rope_q, ctx.rope_k
        return _rotate(dq, (cq, -sq)), _rotate(dk, (ck, -sk))
    return np.multiply(dq, dq.dtype.type(ctx.cfg.score_scale), out=dq), dk


def heads(ctx: Context, cache: Cache) -> np.ndarray:
    """The base's concatenated head outputs P V, (B*T, H*dh): the input of ``w_o``; kept in the cache."""
    if "attn.o" not in cache:
        cfg, p = ctx.cfg, cache["attn.p"]
        B, T = p.shape[0], p.shape[-2]
        buf, view = _heads_out(B, T, cfg, p.dtype)
        np.matmul(p, cache["attn.v"], out=view)
        cache["attn.o"] = buf.reshape(B * T, cfg.n_heads * cfg.head_dim)
    return cache["attn.o"]


def attn_vjp(w: Weights, ctx: Context, gy: np.ndarray, cache: Cache, grads: dict[str, np.ndarray] | None = None
             ) -> np.ndarray:
    """Transpose of :func:`attn_jvp`: cotangents (K, T, d) of the output -> (K, T, d) of the input.

    With ``grads`` (a dict) also the weight gradients of sum_r <gy[r], attn>, added
    under ``attn.w_qkv``, ``attn.w_o`` (and the biases): the weights' VJP is linear in
    the cotangent, so the K rows are summed first. Whole sequences only (no ``start``
    or ``rows``). Every product is a BLAS GEMM; dL/dS comes from the score-gradient
    kernel, one call per cotangent row against the base P (never copied K times).
    """
    cfg = ctx.cfg
    K, T, d = gy.shape
    H, Hkv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    g = H // Hkv
    q5, k5, v5, p = cache["attn.q"], cache["attn.k"], cache["attn.v"], cache["attn.p"]
    # u = dL/d(head outputs), (K, Hkv, g, T, dh) contiguous (the kernel's layout)
    go = gy.reshape(K * T, d) @ w["attn.w_o"].T
    u = np.ascontiguousarray(go.reshape(K, T, Hkv, g, dh).transpose(0, 2, 3, 1, 4))
    if "attn.vh" not in cache:  # the values per query head (GQA shares them), contiguous; once per cache
        cache["attn.vh"] = np.ascontiguousarray(np.broadcast_to(v5, (1, Hkv, g, T, dh))).reshape(H, T, dh)
    vh, ph = cache["attn.vh"], p.reshape(H, T, T)
    ds = np.empty((K, Hkv, g, T, T), gy.dtype)
    fn, off = attention_kernel("attention_score_grad"), 0 if cfg.causal else T - 1
    nbad = 0
    for r in range(K):  # dS = P * (U V^T - rowsum(P * U V^T)), masked entries 0
        nbad += fn(ph, u[r].reshape(H, T, dh), vh, off, ds[r].reshape(H, T, T))
    check(nbad, "attention score cotangents")
    if "attn.capd" in cache:  # soft-capped scores: the cap's derivative, 1 - tanh^2
        ds *= cache["attn.capd"]
    ds4 = ds.reshape(K, Hkv, g * T, T)
    dq = np.matmul(ds4, k5.reshape(1, Hkv, T, dh)).reshape(K, H, T, dh)
    dk = np.matmul(ds4.swapaxes(-1, -2), q5.reshape(1, Hkv, g * T, dh))  # sum over the group's queries
    dv = np.matmul(p.reshape(1, Hkv, g * T, T).swapaxes(-1, -2), u.reshape(K, Hkv, g * T, dh))
    dq, dk = _qk_t(ctx, dq, dk)
    dqkv = np.empty((K, T, H + 2 * Hkv, dh), gy.dtype)
    dqkv[:, :, :H] = dq.transpose(0, 2, 1, 3)
    dqkv[:, :, H : H + Hkv] = dk.transpose(0, 2, 1, 3)
    dqkv[:, :, H + Hkv :] = dv.transpose(0, 2, 1, 3)
    if cfg.qk_norm:
        qk_norm_vjp_(dqkv, w, cfg, cache["attn.qkn"], grads)
    dqkv2 = dqkv.reshape(K * T, -1)
    if grads is not None:
        gsum, dsum = gy.sum(axis=0), dqkv2.reshape(K, T, -1).sum(axis=0)
        grads["attn.w_o"] = heads(ctx, cache).T @ gsum
        grads["attn.w_qkv"] = cache["attn.in"].reshape(T, d).T @ dsum
        if cfg.bias:
            grads["attn.b_o"], grads["attn.b_qkv"] = gsum.sum(axis=0), dsum.sum(axis=0)
    return (dqkv2 @ w["attn.w_qkv"].T).reshape(K, T, d)
