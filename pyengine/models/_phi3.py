"""HF Phi-3 (``model_type`` "phi3") -> Stack arrays: Llama-shaped, with fused projections,
partial rotary and LongRoPE.

``self_attn.qkv_proj`` ((H + 2 Hkv) dh, d) holds the rows [q heads | k heads | v heads] and
``mlp.gate_up_proj`` (2 n, d) the rows [gate | up]: transposed, they are a Stack's
``attn.w_qkv`` and ``mlp.w_in``. With ``partial_rotary_factor`` < 1 the rotary part is the
first r = int(dh * factor) features of each head, half-split within them (pairs (j, j + r/2)),
as in GPT-NeoX: the q and k features are reordered as there. ``rope_scaling`` "longrope"
(and its old names "su", "yarn", which transformers reads as "longrope") becomes the Stack's
"longrope" rotary; any other type is refused by name.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._hf import Shards, num
from ._reading import _config, _partial_perm, _Reader, _refuse, _rope, _rotary_fraction, _t, llama_dims
from .config import StackConfig

__all__ = ["phi3"]

_LONGROPE = ("longrope", "su", "yarn")


def _phi3_rope(hf: dict[str, Any], where: str, pairs: int) -> dict[str, Any]:
    """The StackConfig rotary fields of a Phi-3 config: base, and LongRoPE's factors as
    transformers' ``_compute_longrope_parameters`` reads them."""
    sc = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind not in _LONGROPE:
        if kind != "default":
            raise ValueError(f"{where}: rope_scaling type {kind!r} is not supported (only 'longrope' or none)")
        return _rope(hf, where)
    plain = {k: v for k, v in sc.items() if k not in ("rope_type", "type")}
    out = _rope({**hf, "rope_scaling": plain, "rope_parameters": None}, where)
    factors = {}
    for key in ("short_factor", "long_factor"):
        val = sc.get(key)
        if not isinstance(val, (list, tuple)) or len(val) != pairs:
            raise ValueError(f"{where}: rope_scaling {key!r} must be a list of {pairs} numbers; got {val!r}")
        factors[key] = tuple(num({key: x}, key, where, real=True) for x in val)
    old = num({**hf, **sc}, "original_max_position_embeddings", where)
    factor = sc.get("factor")
    factor = num(hf, "max_position_embeddings", where) / old if factor is None else num(sc, "factor", where, real=True)
    att = sc.get("attention_factor")
    if att is None:  # the paper's default, as transformers sets it
        att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
    else:
        att = num(sc, "attention_factor", where, real=True)
    out.update(rope_scaling="longrope", rope_short_factor=factors["short_factor"],
               rope_long_factor=factors["long_factor"], rope_attention_factor=att, rope_original_max_len=old)
    return out


def phi3(hf: dict[str, Any], st: Shards, where: str, dtype: Any, layers: Any = None,
         glob: bool = True) -> tuple[StackConfig, dict[str, np.ndarray]]:
    """Phi-3 (fused q/k/v and gate/up projections, partial rotary, LongRoPE, a sliding window
    in every layer when ``sliding_window`` is set)."""
    _refuse(hf, where, attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attention_bias=False,
            mlp_bias=False)
    d, H, Hkv, L, n, V, dh = llama_dims(hf, where)
    dh = d // H if dh is None else dh  # transformers' Phi-3: config.head_dim, else d // H
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} is not supported (silu)")
    r = int(dh * _rotary_fraction(hf, where))
    if r % 2:
        raise ValueError(f"{where}: 'partial_rotary_factor' gives an odd rotary width {r} of the head dim {dh}; "
                         "not supported")
    get = _Reader(st, dtype, ("model.",))
    tied = bool(hf.get("tie_word_embeddings", not get.has("lm_head.weight", prefixed=False)))
    window = hf.get("sliding_window")
    cfg = _config(where, d_model=d, n_heads=H, n_kv_heads=Hkv, n_layers=L, d_mlp=n, norm="rmsnorm",
                  placement="pre", activation="silu_gated", positions="rotary" if r else "none",
                  eps=num(hf, "rms_norm_eps", where, real=True, default=1e-5),
                  max_seq_len=num(hf, "max_position_embeddings", where, default=4096), vocab_size=V, bias=False,
                  lm_head="tied" if tied else "separate", rotary_dim=r, head_dim=dh,
                  sliding_window=0 if window is None else num(hf, "sliding_window", where),
                  **(_phi3_rope(hf, where, r // 2) if r else {}))
    # q and k features of each head reordered so that the rotated pairs (j, j + r/2) sit at (j, j + dh/2)
    perm = _partial_perm(dh, r)
    w: dict[str, np.ndarray] = {}
    if glob:
        w = {"embed.tokens": get("embed_tokens.weight", V, d), "final_norm.gamma": get("norm.weight", d),
             **({} if tied else {"lm_head.weight": get("lm_head.weight", V, d, prefixed=False)})}
    if tied and get.has("lm_head.weight", prefixed=False):  # a tied copy in the files is known, not read
        get.known.add("lm_head.weight")
    for k in range(L) if layers is None else layers:
        p, b = f"layers.{k}.", f"blocks.{k}."
        qkv = get(p + "self_attn.qkv_proj.weight", (H + 2 * Hkv) * dh, d)
        q = qkv[: H * dh].reshape(H, dh, d)[:, perm]
        kk = qkv[H * dh: (H + Hkv) * dh].reshape(Hkv, dh, d)[:, perm]
        w[b + "attn.w_qkv"] = _t(np.concatenate([q.reshape(H * dh, d), kk.reshape(Hkv * dh, d),
                                             qkv[(H + Hkv) * dh:]]))
        w[b + "attn.w_o"] = _t(get(p + "self_attn.o_proj.weight", d, H * dh))
        w[b + "mlp.w_in"] = _t(get(p + "mlp.gate_up_proj.weight", 2 * n, d))  # rows [gate | up], as a Stack's
        w[b + "mlp.w_out"] = _t(get(p + "mlp.down_proj.weight", d, n))
        w[b + "norm1.gamma"] = get(p + "input_layernorm.weight", d)
        w[b + "norm2.gamma"] = get(p + "post_attention_layernorm.weight", d)
    return cfg, w
