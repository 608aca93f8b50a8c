"""HF ``gemma2`` -> Stack arrays (registered in :data:`._families.FAMILIES`).

Gemma 2 is Gemma (``1 + w`` RMSNorms, GeGLU with the tanh GELU, embeddings scaled by
sqrt(d) in the dtype, a tied read-out of the unscaled table) plus:

- four norms per block: ``input_layernorm`` -> ``norm1``, ``post_attention_layernorm``
  (on the attention output, before the residual add) -> ``norm1_out``,
  ``pre_feedforward_layernorm`` -> ``norm2``, ``post_feedforward_layernorm`` ->
  ``norm2_out``: StackConfig ``placement="peri"``;
- soft-capped attention scores and logits (``attn_logit_softcapping``,
  ``final_logit_softcapping`` -> ``attn_softcap``, ``logit_softcap``);
- the score scale ``query_pre_attn_scalar ** -0.5`` (``attn_scale``);
- a sliding window in the layers ``layer_types`` names "sliding_attention" (by default
  the even ones), full attention in the others (a per-layer ``sliding_window``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._hf import Shards, num
from ._reading import _config, _Reader, _refuse, _rope, llama_dims, llama_layer
from .config import StackConfig

__all__ = ["gemma2"]

#: transformers' Gemma2Config defaults of the fields the reader uses where they differ from other
#: families': a config.json without one means this value (one with null: none).
_HF_DEFAULTS = {"head_dim": 256, "num_key_value_heads": 4, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "max_position_embeddings": 8192,
                "tie_word_embeddings": True}


def _windows(hf: dict[str, Any], where: str, L: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention) as transformers' Gemma2 applies it."""
    kinds = hf.get("layer_types") or ["sliding_attention" if (k + 1) % 2 else "full_attention" for k in range(L)]
    if not isinstance(kinds, list) or len(kinds) != L or set(kinds) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"{where}: config field 'layer_types' = {kinds!r} is not supported (one of "
                         f"'sliding_attention', 'full_attention' per layer, {L} layers)")
    w = 0 if hf.get("sliding_window") is None else num(hf, "sliding_window", where)
    return tuple(w if kind == "sliding_attention" else 0 for kind in kinds)


def _cap(hf: dict[str, Any], key: str, where: str) -> float:
    """A soft-cap (0: none): a positive number or null."""
    if hf.get(key) is None:
        return 0.0
    c = num(hf, key, where, real=True)
    if c <= 0:
        raise ValueError(f"{where}: config field {key!r} must be a positive number or null; got {c!r}")
    return float(c)


def gemma2(hf: dict[str, Any], st: Shards, where: str, dtype: Any, layers: Any = None,
           glob: bool = True) -> tuple[StackConfig, dict[str, np.ndarray]]:
    hf = {**_HF_DEFAULTS, **hf}
    _refuse(hf, where, attention_bias=False, attention_dropout=0.0, use_bidirectional_attention=False,
            hidden_activation="gelu_pytorch_tanh")
    d, H, Hkv, L, n, V, dh = llama_dims(hf, where)
    scalar = num(hf, "query_pre_attn_scalar", where, real=True)
    if scalar <= 0:
        raise ValueError(f"{where}: config field 'query_pre_attn_scalar' must be > 0; got {scalar!r}")
    get = _Reader(st, dtype, ("model.",))
    tied = bool(hf["tie_word_embeddings"])
    cfg = _config(where, d_model=d, n_heads=H, n_kv_heads=Hkv, n_layers=L, d_mlp=n, norm="rmsnorm",
                  placement="peri", activation="gelu_tanh_gated", positions="rotary",
                  eps=num(hf, "rms_norm_eps", where, real=True, default=1e-6),
                  max_seq_len=num(hf, "max_position_embeddings", where), vocab_size=V, bias=False, head_dim=dh,
                  lm_head="separate", sliding_window=_windows(hf, where, L), attn_scale=float(scalar) ** -0.5,
                  attn_softcap=_cap(hf, "attn_logit_softcapping", where),
                  logit_softcap=_cap(hf, "final_logit_softcapping", where), **_rope(hf, where))
    dh = cfg.head_dim
    one = np.asarray(1.0, dtype)
    w: dict[str, np.ndarray] = {}
    if glob:  # embeddings scaled by sqrt(d) rounded to the dtype; the tied head reads the unscaled table
        emb = get("embed_tokens.weight", V, d)
        w["final_norm.gamma"] = get("norm.weight", d) + one
        w["embed.tokens"] = emb * np.asarray(math.sqrt(d), dtype)
        w["lm_head.weight"] = emb if tied else get("lm_head.weight", V, d, prefixed=False)
    if tied and get.has("lm_head.weight", prefixed=False):
        get.known.add("lm_head.weight")
    for k in range(L) if layers is None else layers:
        p, b = f"layers.{k}.", f"blocks.{k}."
        w.update(llama_layer(get, k, d, H, Hkv, dh, n))
        for ours, theirs in (("norm1", "input_layernorm"), ("norm1_out", "post_attention_layernorm"),
                             ("norm2", "pre_feedforward_layernorm"), ("norm2_out", "post_feedforward_layernorm")):
            w[b + ours + ".gamma"] = get(p + theirs + ".weight", d) + one
    return cfg, w
