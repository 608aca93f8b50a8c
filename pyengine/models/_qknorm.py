"""RMSNorm of each query and key head before rotary (Qwen3's ``q_norm``, ``k_norm``): forward, JVP, VJP.

Part of the block engine (:mod:`pyengine.models._attention`). The projections
``x`` (B, T, H + 2 Hkv, dh) are normalized in place on their first H + Hkv heads:
``y = gamma * xhat``, ``xhat = x / r``, ``r = sqrt(mean(x**2) + eps)`` over each head's dh
features, with the weights ``attn.q_norm`` (dh,) on the query heads and ``attn.k_norm`` (dh,)
on the key heads (values untouched). The base cache keeps ``attn.qkn`` = (xhat, 1/r),
(1, T, H + Hkv, dh) and (1, T, H + Hkv, 1), for the exact JVP and VJP:
``dy = gamma / r * (dx - xhat * mean(xhat * dx))``, and its transpose.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["qk_norm_", "qk_norm_jvp_", "qk_norm_vjp_"]


def _gammas(w: dict[str, np.ndarray], H: int, Hkv: int) -> np.ndarray:
    """(H + Hkv, dh): the query heads' gamma, then the key heads'."""
    q, k = w["attn.q_norm"], w["attn.k_norm"]
    return np.concatenate([np.broadcast_to(q, (H, q.shape[-1])), np.broadcast_to(k, (Hkv, k.shape[-1]))])


def qk_norm_(x: np.ndarray, w: dict[str, np.ndarray], cfg: Any) -> tuple[np.ndarray, np.ndarray]:
    """Normalize the query and key heads of ``x`` (B, T, H + 2 Hkv, dh) in place; (xhat, 1/r)."""
    n = cfg.n_heads + cfg.n_kv_heads
    xs = x[:, :, :n]
    inv = 1.0 / np.sqrt(np.mean(xs * xs, axis=-1, keepdims=True) + x.dtype.type(cfg.eps))
    xhat = xs * inv
    np.multiply(xhat, _gammas(w, cfg.n_heads, cfg.n_kv_heads), out=xs)
    return xhat, inv


def qk_norm_jvp_(dx: np.ndarray, w: dict[str, np.ndarray], cfg: Any, base: tuple[np.ndarray, np.ndarray]) -> None:
    """The tangents ``dx`` (K, T, H + 2 Hkv, dh) of the projections through the norm, in place;
    ``base`` the cache's (xhat, 1/r) of the same rows."""
    xhat, inv = base
    ds = dx[:, :, : cfg.n_heads + cfg.n_kv_heads]
    u = ds - xhat * np.mean(xhat * ds, axis=-1, keepdims=True)
    np.multiply(u * inv, _gammas(w, cfg.n_heads, cfg.n_kv_heads), out=ds)


def qk_norm_vjp_(g: np.ndarray, w: dict[str, np.ndarray], cfg: Any, base: tuple[np.ndarray, np.ndarray],
                 grads: dict[str, np.ndarray] | None) -> None:
    """Transpose of :func:`qk_norm_jvp_` on the cotangents ``g`` (K, T, H + 2 Hkv, dh), in place;
    with ``grads``, the gradients of ``attn.q_norm`` and ``attn.k_norm`` (summed over the K rows)."""
    H = cfg.n_heads
    xhat, inv = base
    gs = g[:, :, : H + cfg.n_kv_heads]
    if grads is not None:
        gx = np.einsum("ktnd,tnd->nd", gs, xhat[0])
        grads["attn.q_norm"], grads["attn.k_norm"] = gx[:H].sum(axis=0), gx[H:].sum(axis=0)
    u = gs * _gammas(w, H, cfg.n_kv_heads)
    np.multiply(u - xhat * np.mean(xhat * u, axis=-1, keepdims=True), inv, out=gs)
