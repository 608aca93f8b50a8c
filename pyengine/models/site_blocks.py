"""One block from a named site on: the exact forward with a perturbation added at the site,
and the JVP started at the site (what :func:`pyengine.propagate` uses for ``layer="blocks.k.<site>"``).

Injecting at a site changes only what the forward computes from that site on: at
``blocks.k.norm1.input`` of a pre-LN block the norm sees the perturbation, the skip
connection does not (unlike ``resid_pre``). The sites where a perturbation of the
activation is an injection (:func:`injection_sites`): every per-block site of the
table in :mod:`pyengine.models.sites` except the read-only ``*.scale`` and the
attention ``scores`` / ``pattern`` (per-head (T, T) matrices, not a direction in a
stream). ``resid_pre`` and ``resid_post`` are hidden states k and k + 1: the caller
treats them as such. Widths: d_model, ``mlp.hidden`` d_mlp, ``attn.head_out``
n_heads * head_dim (the heads' outputs concatenated, the input of ``w_o``).

Both functions linearize at / start from a :class:`BlockCache` of one base sequence and
work on rows ``start`` .. T-1 (causal stacks: the earlier rows cannot change).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _blocks, _fast
from ._attention import attn_jvp
from .linearization import BlockCache
from .sites import block_site_names

__all__ = ["injection_sites", "site_forward", "site_jvp", "site_value", "site_width", "write_matrix"]

_NOT_INJECTABLE = ("norm1.scale", "norm2.scale", "attn.scores", "attn.pattern", "attn.q", "attn.k", "attn.v",
                   "attn.result", "mlp.pre")
_HEADS = ("attn.scores", "attn.pattern", "attn.head_out")


def injection_sites(cfg: Any) -> tuple[str, ...]:
    """Per-block site names (without ``blocks.<k>.``) where a perturbation can be injected."""
    return tuple(n for n in block_site_names(cfg) if n not in _NOT_INJECTABLE)


def site_width(cfg: Any, name: str) -> int:
    """The width of a per-block site's activation (its last axis; head_out flattened)."""
    if name == "mlp.hidden":
        return int(cfg.d_mlp)
    if name == "attn.head_out":
        return int(cfg.n_heads * cfg.head_dim)
    return int(cfg.d_model)


def write_matrix(stack: Any, k: int, name: str, dtype: Any = np.float64) -> np.ndarray | None:
    """(width, d_model) matrix through which a site of width != d_model writes into the
    sublayer output (``mlp.w_out``, ``attn.w_o``); None for d_model-wide sites."""
    if name not in ("mlp.hidden", "attn.head_out"):
        return None
    w = stack._params(np.dtype(dtype))[0][k]
    return w["mlp.w_out" if name == "mlp.hidden" else "attn.w_o"]


class _Hook:
    """Adds ``delta`` at one site (and records the site's value there)."""

    def __init__(self, name: str, delta: np.ndarray | None) -> None:
        self.name, self.delta, self.value = name, delta, None
        self.heads = self.heads_changed = name in _HEADS

    def wants(self, name: str) -> bool:
        return name == self.name

    def __call__(self, name: str, x: np.ndarray) -> np.ndarray:
        if name != self.name:
            return x
        if self.delta is not None:
            x = x + self.delta.reshape(x.shape).astype(x.dtype, copy=False)
        self.value = x
        return x


def _run(stack: Any, cache: BlockCache, name: str, delta: np.ndarray | None, n: int, start: int
         ) -> tuple[np.ndarray, np.ndarray]:
    cfg, h = stack.config, cache.h
    T = h.shape[0]
    x = np.ascontiguousarray(np.broadcast_to(h[start:], (n,) + h[start:].shape))
    ctx = _blocks.make_context(cfg, T, h.dtype, start, block=cache.block)
    data: dict[str, Any] = {_fast.DISCARD: True}
    if start:
        data["attn.past"] = cache.data
    hook = _Hook(name, delta)
    out = _blocks.block_forward(stack._params(h.dtype)[0][cache.block], ctx._replace(hook=hook), x, data)
    if hook.value is None:
        raise ValueError(f"site {name!r} is not computed by a block of this stack (layout {cfg.layout!r})")
    return out, hook.value


def site_value(stack: Any, cache: BlockCache, name: str, start: int = 0) -> np.ndarray:
    """The site's activation at the base sequence, rows start.., (T - start, width)."""
    v = _run(stack, cache, name, None, 1, start)[1][0]
    return v.reshape(v.shape[0], -1)


def site_forward(stack: Any, cache: BlockCache, name: str, delta: np.ndarray, start: int = 0) -> np.ndarray:
    """Block ``cache.block`` at its base input with ``delta`` (n, T - start, width) added at
    site ``name``: the block's output rows start.., (n, T - start, d_model)."""
    return _run(stack, cache, name, np.asarray(delta), delta.shape[0], start)[0]


def _add(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    if a is None:
        return b
    return a if b is None else a + b


def site_jvp(stack: Any, cache: BlockCache, name: str, t: np.ndarray, mode: str = "full", start: int = 0
             ) -> np.ndarray:
    """Tangent of block ``cache.block``'s output for the tangent ``t`` (K, T - start, width) at
    site ``name``, zero everywhere upstream: (K, T - start, d_model), in t's dtype."""
    cfg = stack.config
    ctx, data = cache._rows(start=start)
    w = stack._params(t.dtype)[0][cache.block]
    K, R = t.shape[:2]
    inner = {"attn": "attn.head_out", "mlp": "mlp.hidden"}
    wout = {"attn": "attn.w_o", "mlp": "mlp.w_out"}
    jvps = {"attn": attn_jvp, "mlp": _blocks.mlp_jvp}

    def at(site: str, dx: np.ndarray | None) -> np.ndarray | None:
        return dx if site != name else _add(dx, np.array(t))

    def sub(kind: str, da: np.ndarray | None) -> np.ndarray | None:  # sublayer F, input to output site
        dy = None if da is None else jvps[kind](w, ctx, da, data)
        if name == inner[kind]:
            dy = _add(dy, (t.reshape(K * R, -1) @ w[wout[kind]]).reshape(K, R, cfg.d_model))
        return at(kind + ".out", dy)

    def nj(nname: str, dx: np.ndarray | None) -> np.ndarray | None:  # a norm, input to output site
        dx = at(nname + ".input", dx)
        dy = None if dx is None else _blocks.norm_jvp(cfg.norm, data[nname], dx, w[nname + ".gamma"], cfg.eps, mode)
        return at(nname + ".output", dy)

    def sublayer(dh: np.ndarray | None, kind: str, nname: str) -> np.ndarray | None:
        if cfg.placement == "peri":  # h + N_out(F(N(h)))
            dy = nj(nname + "_out", sub(kind, nj(nname, dh)))
            return _add(dy, dh) if cfg.residual else dy
        if cfg.placement == "pre":  # h + F(N(h))
            dy = sub(kind, nj(nname, dh))
            return _add(dy, dh) if cfg.residual else dy
        dy = sub(kind, dh)  # N(h + F(h))
        return nj(nname, _add(dy, dh) if cfg.residual else dy)

    if cfg.layout == "sequential":
        out = sublayer(at("resid_mid", sublayer(None, "attn", "norm1")), "mlp", "norm2")
    elif cfg.layout == "parallel2":
        out = _add(sub("attn", nj("norm1", None)), sub("mlp", nj("norm2", None)))
    else:
        da = nj("norm1", None) if cfg.placement == "pre" else None
        out = _add(sub("attn", da), sub("mlp", da))
        out = out if cfg.placement == "pre" else nj("norm1", out)
    if out is None:
        raise ValueError(f"site {name!r} is not computed by a block of this stack (layout {cfg.layout!r})")
    return out
