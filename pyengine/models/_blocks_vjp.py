"""One transformer block in reverse mode: the exact transpose of :func:`._blocks.block_jvp`.

Part of the block engine (conventions of :mod:`pyengine.models._blocks`: validated,
C-contiguous input; the base cache of one sequence with a leading axis of 1; K
cotangent rows ``(K, T, d)`` batched into every GEMM). The pieces, each the transpose
of its JVP in ``_blocks.py`` / ``_attention.py``:

- norm: the norm VJP kernels (``layer_norm_vjp`` / ``rms_norm_vjp``, frozen or full);
- MLP: ``dz = g W_out^T``, ``du = c * dz`` (gated: ``[A dz | B dz]``), ``g_in = du W_in^T``;
- attention: :func:`._attention.attn_vjp` (score gradient kernel, then GEMMs);
- the block: residual branches add their cotangents; post placement applies the norm's
  VJP first.

With ``grads`` (a dict), the gradients of ``L = sum_r <g[r], block(h)>`` with respect
to every array of the block are filled in, under the block's own names (``norm1.gamma``,
``attn.w_qkv``, ...; gamma is the *effective* gamma, gamma_scale already applied). The
weights' VJP is linear in the cotangent and the base is shared, so the K rows are
summed before each weight GEMM.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._attention import attn_vjp
from ._blocks import Cache, Context, Weights, _act, mlp_coef, norm, norm_jvp

__all__ = ["block_vjp"]

Grads = dict[str, np.ndarray] | None


def _norm_vjp(w: Weights, cfg: Any, name: str, g: np.ndarray, cache: Cache, mode: str, grads: Grads) -> np.ndarray:
    """Cotangent of the norm ``name``'s input from the cotangent g (K, T, d) of its output."""
    x = cache[name]
    if grads is not None:
        gsum = g.sum(axis=0)
        d = x.shape[-1]
        xhat = norm(cfg.norm, x, np.ones(d, x.dtype), None, cfg.eps)  # (x - mu)/s or x/r
        grads[name + ".gamma"] = np.einsum("td,td->d", xhat.reshape(gsum.shape), gsum)
        if cfg.norm == "layernorm":
            grads[name + ".beta"] = gsum.sum(axis=0)
    return norm_jvp(cfg.norm, x, g, w[name + ".gamma"], cfg.eps, mode, product="_vjp")


def mlp_vjp(w: Weights, ctx: Context, gy: np.ndarray, cache: Cache, grads: Grads = None) -> np.ndarray:
    """Transpose of :func:`._blocks.mlp_jvp`: (K, T, d) -> (K, T, d)."""
    cfg = ctx.cfg
    K, T, d = gy.shape
    n = cfg.d_mlp
    coef = mlp_coef(ctx, cache, T)
    dz = (gy.reshape(K * T, d) @ w["mlp.w_out"].T).reshape(K, T, n)
    if len(coef) == 1:
        dz *= coef[0]
        du = dz
    else:
        du = np.empty((K, T, 2 * n), gy.dtype)
        np.multiply(dz, coef[0], out=du[..., :n])
        np.multiply(dz, coef[1], out=du[..., n:])
    du2 = du.reshape(K * T, -1)
    if grads is not None:
        if "mlp.z" not in cache:  # the base's activation output, the input of w_out; once per cache
            cache["mlp.z"] = _act(cfg.activation, cache["mlp.u"], n)
        gsum, dusum = gy.sum(axis=0), du.sum(axis=0)
        grads["mlp.w_out"] = cache["mlp.z"].T @ gsum
        grads["mlp.w_in"] = cache["mlp.in"].reshape(T, d).T @ dusum
        if cfg.bias:
            grads["mlp.b_out"], grads["mlp.b_in"] = gsum.sum(axis=0), dusum.sum(axis=0)
    return (du2 @ w["mlp.w_in"].T).reshape(K, T, d)


_SUB = {"attn": attn_vjp, "mlp": mlp_vjp}


def _sublayer_vjp(w: Weights, ctx: Context, g: np.ndarray, sub: str, nname: str, cache: Cache, mode: str,
                  grads: Grads) -> np.ndarray:
    """Transpose of ``_blocks._sublayer_jvp``: pre ``h + F(N(h))``, post ``N(h + F(h))``, peri
    ``h + N_out(F(N(h)))``."""
    cfg, f = ctx.cfg, _SUB[sub]
    if cfg.placement in ("pre", "peri"):  # peri: h + N_out(F(N(h)))
        gy = g if cfg.placement == "pre" else _norm_vjp(w, cfg, nname + "_out", g, cache, mode, grads)
        gh = _norm_vjp(w, cfg, nname, f(w, ctx, gy, cache, grads), cache, mode, grads)
        if cfg.residual:
            gh += g
        return gh
    gy = _norm_vjp(w, cfg, nname, g, cache, mode, grads)
    gh = f(w, ctx, gy, cache, grads)
    if cfg.residual:
        gh += gy
    return gh


def block_vjp(w: Weights, ctx: Context, g: np.ndarray, cache: Cache, mode: str, grads: Grads = None) -> np.ndarray:
    """Cotangent (K, T, d) of the block's output -> (K, T, d) of its input, at the cached base (B = 1)."""
    cfg = ctx.cfg
    if ctx.start or ctx.rows is not None:
        raise ValueError("the block VJP runs on whole sequences (no start or diagonal rows)")
    if cfg.layout == "sequential":
        g1 = _sublayer_vjp(w, ctx, g, "mlp", "norm2", cache, mode, grads)
        return _sublayer_vjp(w, ctx, g1, "attn", "norm1", cache, mode, grads)
    if cfg.layout == "parallel2":  # h + Attn(N1(h)) + MLP(N2(h))
        gh = _norm_vjp(w, cfg, "norm1", attn_vjp(w, ctx, g, cache, grads), cache, mode, grads)
        gh += _norm_vjp(w, cfg, "norm2", mlp_vjp(w, ctx, g, cache, grads), cache, mode, grads)
        if cfg.residual:
            gh += g
        return gh
    gy = g if cfg.placement == "pre" else _norm_vjp(w, cfg, "norm1", g, cache, mode, grads)
    ga = attn_vjp(w, ctx, gy, cache, grads)
    ga += mlp_vjp(w, ctx, gy, cache, grads)
    if cfg.placement == "pre":
        gh = _norm_vjp(w, cfg, "norm1", ga, cache, mode, grads)
        if cfg.residual:
            gh += g
        return gh
    if cfg.residual:
        ga += gy
    return ga
