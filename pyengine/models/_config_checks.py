"""The field checks of :class:`~pyengine.models.config.StackConfig`.

Private to :mod:`pyengine.models.config`: ``StackConfig.__post_init__`` hands the config
being built and its setter to :func:`check_fields`, which fills the defaults that depend on
other fields (d_mlp, n_kv_heads, head_dim), converts every field to its canonical type, and
raises a TypeError or ValueError naming the field (``StackConfig.<name>``) for a bad one or a
bad combination. This module does not import :mod:`~pyengine.models.config` (that would be an
import cycle), so the config is typed ``Any`` here.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _validate as _v

_CHOICES = {
    "norm": ("layernorm", "rmsnorm"),
    "placement": ("pre", "post", "peri"),
    "layout": ("sequential", "parallel", "parallel2"),
    "activation": ("gelu", "gelu_tanh", "relu", "silu_gated", "gelu_tanh_gated"),
    "positions": ("learned", "sinusoidal", "rotary", "none"),
    "lm_head": ("none", "tied", "separate"),
    "rope_scaling": ("none", "llama3", "longrope"),
}
_INTS = {"d_model": 2, "n_heads": 1, "n_kv_heads": 1, "d_mlp": 1, "n_layers": 1, "max_seq_len": 1, "vocab_size": 0,
         "rotary_dim": 0, "rope_original_max_len": 1, "head_dim": 1}
_BOOLS = ("residual", "causal", "final_norm", "bias", "embed_norm", "qk_norm")


def check_fields(cfg: Any, put: Callable[[str, Any], None]) -> None:
    """Check and canonicalize every field of ``cfg`` (a StackConfig in ``__post_init__``),
    writing each through ``put(name, value)``."""
    if cfg.d_mlp is None and isinstance(cfg.d_model, numbers.Integral):
        put("d_mlp", 4 * int(cfg.d_model))
    if cfg.n_kv_heads is None:
        put("n_kv_heads", cfg.n_heads)
    given = cfg.head_dim is not None
    for name, low in _INTS.items():
        val = getattr(cfg, name)
        if name == "head_dim" and not given:
            continue
        if isinstance(val, bool) or not isinstance(val, numbers.Integral):
            raise TypeError(f"StackConfig.{name} must be an int; got {val!r}")
        if val < low:
            raise ValueError(f"StackConfig.{name} must be >= {low}; got {val}")
        put(name, int(val))
    put("sliding_window", _windows(cfg.sliding_window, cfg.n_layers))
    for name in _BOOLS:
        if not isinstance(getattr(cfg, name), (bool, np.bool_)):
            raise TypeError(f"StackConfig.{name} must be True or False; got {getattr(cfg, name)!r}")
        put(name, bool(getattr(cfg, name)))
    for name, allowed in _CHOICES.items():
        _v.choice(f"StackConfig.{name}", getattr(cfg, name), allowed)
    for name, positive in (("eps", False), ("gamma_scale", None), ("rope_base", True), ("rope_factor", True),
                           ("rope_low_freq_factor", True), ("rope_high_freq_factor", True),
                           ("rope_attention_factor", True), ("attn_scale", False),
                           ("attn_softcap", False), ("logit_softcap", False)):
        val = getattr(cfg, name)
        if isinstance(val, bool) or not isinstance(val, numbers.Real) or not math.isfinite(val):
            raise TypeError(f"StackConfig.{name} must be a finite real number; got {val!r}")
        if (positive is False and val < 0) or (positive and val <= 0):
            raise ValueError(f"StackConfig.{name} must be {'> 0' if positive else '>= 0'}; got {val}")
        put(name, float(val))
    if not given:
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"StackConfig.n_heads = {cfg.n_heads} must divide d_model = {cfg.d_model} "
                             "(or give head_dim)")
        put("head_dim", cfg.d_model // cfg.n_heads)
    if cfg.n_heads % cfg.n_kv_heads:
        raise ValueError(f"StackConfig.n_kv_heads = {cfg.n_kv_heads} must divide n_heads = {cfg.n_heads}")
    if cfg.lm_head != "none" and cfg.vocab_size == 0:
        raise ValueError(f"StackConfig.lm_head = {cfg.lm_head!r} needs vocab_size > 0 (a vocabulary to read out)")
    if cfg.positions == "rotary" and cfg.head_dim % 2:
        raise ValueError(f"StackConfig.positions = 'rotary' needs an even head dim (head_dim); got {cfg.head_dim}")

    if cfg.rotary_dim and (cfg.rotary_dim % 2 or cfg.rotary_dim > cfg.head_dim):
        raise ValueError(f"StackConfig.rotary_dim = {cfg.rotary_dim} must be even and <= the head dim "
                         f"{cfg.head_dim} (0: the whole head)")
    if cfg.rope_scaling == "llama3" and cfg.rope_high_freq_factor <= cfg.rope_low_freq_factor:
        raise ValueError("StackConfig.rope_high_freq_factor must exceed rope_low_freq_factor for 'llama3'")
    _check_longrope(cfg, put)
    if any(cfg.window(k) for k in range(cfg.n_layers)) and not cfg.causal:
        raise ValueError("StackConfig.sliding_window > 0 needs causal = True")
    if cfg.layout == "parallel2" and cfg.placement != "pre":
        raise ValueError("StackConfig.layout = 'parallel2' (two norms, GPT-NeoX) needs placement = 'pre'")
    if cfg.placement == "peri" and cfg.layout != "sequential":
        raise ValueError("StackConfig.placement = 'peri' (a norm on each sublayer's output) needs layout = "
                         "'sequential'")


def _check_longrope(cfg: Any, put: Callable[[str, Any], None]) -> None:
    """The two factor lists: tuples of rotary_dim/2 positive numbers for "longrope", else empty."""
    pairs = (cfg.rotary_dim or cfg.head_dim) // 2
    for name in ("rope_short_factor", "rope_long_factor"):
        val = getattr(cfg, name)
        if not isinstance(val, (tuple, list)) or not all(
                isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and x > 0
                for x in val):
            raise TypeError(f"StackConfig.{name} must be a tuple of finite numbers > 0; got {val!r}")
        want = pairs if cfg.rope_scaling == "longrope" else 0
        if len(val) != want:
            raise ValueError(f"StackConfig.{name} must hold {want} factor(s) (one per rotated pair for "
                             f"rope_scaling 'longrope', none otherwise); got {len(val)}")
        put(name, tuple(float(x) for x in val))


def _windows(value: Any, n_layers: int) -> int | tuple[int, ...]:
    """``sliding_window`` checked: an int >= 0, or a tuple (a JSON list) of n_layers of them (one
    value for all collapses to that int, so equal models have equal configs)."""
    def one(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"StackConfig.sliding_window must be an int or a tuple of ints; got {value!r}")
        if v < 0:
            raise ValueError(f"StackConfig.sliding_window must be >= 0; got {value!r}")
        return int(v)

    if not isinstance(value, (tuple, list)):
        return one(value)
    ws = tuple(one(v) for v in value)
    if len(ws) != n_layers:
        raise ValueError(f"StackConfig.sliding_window must have one window per layer ({n_layers}); got {len(ws)}")
    return ws[0] if len(set(ws)) == 1 else ws

