"""HF decoder families -> Stack arrays: GPT-2, GPT-NeoX/Pythia, Llama (incl. Llama 3 rope scaling), Mistral,
Qwen2, Qwen3, Gemma; Phi-3 in :mod:`._phi3`, Gemma 2 in :mod:`._gemma2`.

Each reader takes the parsed ``config.json``, a :class:`._hf.Shards` and the storage
dtype, and returns ``(StackConfig, arrays)``. A config field that would change the
model but has no mapping raises ValueError naming it (never a silently different
model); so does a tensor in the files that the mapping does not use.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._gemma2 import gemma2
from ._hf import Shards, num
from ._phi3 import phi3
from ._reading import (_config, _Names, _partial_perm, _Reader, _refuse, _rope, _rotary_fraction, _t, llama_dims,
                       llama_layer)
from .config import StackConfig

__all__ = ["FAMILIES", "check_tensors", "read_family"]

_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


# --------------------------------------------------------------------------- GPT-2


def gpt2(hf: dict[str, Any], st: Shards, where: str, dtype: Any, layers: Any = None,
        glob: bool = True) -> tuple[StackConfig, dict[str, np.ndarray]]:
    _refuse(hf, where, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
            reorder_and_upcast_attn=False, add_cross_attention=False)
    d, H, L, P, V = (num(hf, k, where) for k in ("n_embd", "n_head", "n_layer", "n_positions", "vocab_size"))
    n = 4 * d if hf.get("n_inner") is None else num(hf, "n_inner", where)
    act = hf.get("activation_function", "gelu_new")
    if act not in _GPT2_ACT:
        raise ValueError(f"{where}: activation_function {act!r} is not supported ({', '.join(_GPT2_ACT)})")
    get = _Reader(st, dtype, ("transformer.", ""))
    separate = get.has("lm_head.weight", prefixed=False) and not hf.get("tie_word_embeddings", True)
    cfg = _config(where, d_model=d, n_heads=H, n_layers=L, d_mlp=int(n), norm="layernorm", placement="pre",
                  activation=_GPT2_ACT[act], positions="learned", eps=num(hf, "layer_norm_epsilon", where, real=True,
                                                                          default=1e-5),
                  max_seq_len=P, vocab_size=V, bias=True, lm_head="separate" if separate else "tied")
    w = {}
    if glob:
        w = {"embed.tokens": get("wte.weight", V, d), "embed.positions": get("wpe.weight", P, d),
             "final_norm.gamma": get("ln_f.weight", d), "final_norm.beta": get("ln_f.bias", d)}
    for k in range(L) if layers is None else layers:
        p, b = f"h.{k}.", f"blocks.{k}."
        for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
            w[b + ours + ".gamma"], w[b + ours + ".beta"] = get(p + theirs + ".weight", d), get(p + theirs + ".bias", d)
        # Conv1D stores (in, out) and computes x W + b: a Stack's layout already
        for ours, theirs, i, o in (("attn.w_qkv", "attn.c_attn", d, 3 * d), ("attn.w_o", "attn.c_proj", d, d),
                                   ("mlp.w_in", "mlp.c_fc", d, n), ("mlp.w_out", "mlp.c_proj", n, d)):
            w[b + ours] = get(p + theirs + ".weight", i, o)
            w[b + ours.replace(".w_", ".b_")] = get(p + theirs + ".bias", o)
    if separate and glob:
        w["lm_head.weight"] = get("lm_head.weight", V, d, prefixed=False)
    elif get.has("lm_head.weight", prefixed=False):
        get.known.add("lm_head.weight")
    return cfg, w


# --------------------------------------------------------------------------- GPT-NeoX / Pythia


def gpt_neox(hf: dict[str, Any], st: Shards, where: str, dtype: Any, layers: Any = None,
        glob: bool = True) -> tuple[StackConfig, dict[str, np.ndarray]]:
    _refuse(hf, where, attention_bias=True, hidden_dropout=0.0, attention_dropout=0.0)
    d, H, L, n, V, P = (num(hf, k, where) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                                                      "intermediate_size", "vocab_size", "max_position_embeddings"))
    act = hf.get("hidden_act", "gelu")
    if act not in _GPT2_ACT:
        raise ValueError(f"{where}: hidden_act {act!r} is not supported ({', '.join(_GPT2_ACT)})")
    dh = d // H
    rope = _rope(hf, where)
    r = int(dh * _rotary_fraction(hf, where))  # 0: no rotation (as transformers), not the whole head
    parallel = bool(hf.get("use_parallel_residual", True))
    tied = bool(hf.get("tie_word_embeddings", False))
    cfg = _config(where, d_model=d, n_heads=H, n_layers=L, d_mlp=n, norm="layernorm", placement="pre",
                  layout="parallel2" if parallel else "sequential", activation=_GPT2_ACT[act],
                  positions="rotary" if r else "none",
                  eps=num(hf, "layer_norm_eps", where, real=True, default=1e-5), max_seq_len=P, vocab_size=V,
                  bias=True, rotary_dim=r, lm_head="tied" if tied else "separate", **rope)
    get = _Reader(st, dtype, ("gpt_neox.",))
    perm = _partial_perm(dh, r)
    w = {}
    if glob:
        w = {"embed.tokens": get("embed_in.weight", V, d), "final_norm.gamma": get("final_layer_norm.weight", d),
             "final_norm.beta": get("final_layer_norm.bias", d)}
    if not tied and glob:
        w["lm_head.weight"] = get("embed_out.weight", V, d, prefixed=False)
    for k in range(L) if layers is None else layers:
        p, b = f"layers.{k}.", f"blocks.{k}."
        for ours, theirs in (("norm1", "input_layernorm"), ("norm2", "post_attention_layernorm")):
            w[b + ours + ".gamma"], w[b + ours + ".beta"] = get(p + theirs + ".weight", d), get(p + theirs + ".bias", d)
        # rows of query_key_value are (head, {q, k, v}, dh); ours are [q heads | k heads | v heads]
        qkv_w = get(p + "attention.query_key_value.weight", 3 * d, d).reshape(H, 3, dh, d)
        qkv_b = get(p + "attention.query_key_value.bias", 3 * d).reshape(H, 3, dh)
        qkv_w = np.stack([qkv_w[:, 0][:, perm], qkv_w[:, 1][:, perm], qkv_w[:, 2]])  # (3, H, dh, d)
        qkv_b = np.stack([qkv_b[:, 0][:, perm], qkv_b[:, 1][:, perm], qkv_b[:, 2]])
        w[b + "attn.w_qkv"] = _t(qkv_w.reshape(3 * d, d))
        w[b + "attn.b_qkv"] = np.ascontiguousarray(qkv_b.reshape(3 * d))
        for ours, theirs, o, i in (("attn.w_o", "attention.dense", d, d), ("mlp.w_in", "mlp.dense_h_to_4h", n, d),
                                   ("mlp.w_out", "mlp.dense_4h_to_h", d, n)):
            w[b + ours] = _t(get(p + theirs + ".weight", o, i))
            w[b + ours.replace(".w_", ".b_")] = get(p + theirs + ".bias", o)
    return cfg, w


# --------------------------------------------------------------------------- Llama, Mistral, Qwen2, Gemma


def _window(hf: dict[str, Any], where: str, L: int) -> int | tuple[int, ...]:
    """The sliding window of each block (0: none) as transformers applies it: Mistral slides in
    every layer when ``sliding_window`` is set; Qwen2 and Qwen3 only with ``use_sliding_window``, in the
    layers that ``layer_types`` (or, without it, ``max_window_layers``: layers >= it) name
    "sliding_attention"."""
    family, w = hf["model_type"], hf.get("sliding_window")
    if family == "mistral":
        return 0 if w is None else num(hf, "sliding_window", where)
    if family not in ("qwen2", "qwen3") or not hf.get("use_sliding_window") or w is None:
        return 0
    kinds = hf.get("layer_types") or ["sliding_attention" if k >= num(hf, "max_window_layers", where, default=28)
                                      else "full_attention" for k in range(L)]
    unknown = set(kinds) - {"sliding_attention", "full_attention"}
    if unknown or len(kinds) != L:
        raise ValueError(f"{where}: config field 'layer_types' = {kinds!r} is not supported (one of "
                         "'sliding_attention', 'full_attention' per layer)")
    w = num(hf, "sliding_window", where)
    return tuple(w if kind == "sliding_attention" else 0 for kind in kinds)


def llama_like(hf: dict[str, Any], st: Shards, where: str, dtype: Any, layers: Any = None,
        glob: bool = True) -> tuple[StackConfig, dict[str, np.ndarray]]:
    """Llama (and Llama 3's rope scaling), Mistral, Qwen2 and Qwen3 (sliding windows; Qwen2's q/k/v
    biases; Qwen3's q/k norms), Gemma (1 + w norms, GeGLU, sqrt(d) embeddings)."""
    family = hf["model_type"]
    gemma = family == "gemma"
    qkv_bias = family == "qwen2" or bool(hf.get("attention_bias"))
    _refuse(hf, where, mlp_bias=False, attention_dropout=0.0)
    if family in ("llama", "mistral", "qwen3"):
        _refuse(hf, where, pretraining_tp=1, attention_bias=False)
    d, H, Hkv, L, n, V, dh = llama_dims(hf, where)
    act = hf.get("hidden_activation") if gemma and hf.get("hidden_activation") else hf.get("hidden_act", "silu")
    acts = {"silu": "silu_gated", "gelu_pytorch_tanh": "gelu_tanh_gated"}
    if gemma and act == "gelu":
        act = "gelu_pytorch_tanh"  # HF Gemma runs the tanh approximation for a legacy "gelu" config
    if act not in acts:
        raise ValueError(f"{where}: hidden_act {act!r} is not supported ({', '.join(acts)})")
    get = _Reader(st, dtype, ("model.",))
    tied = bool(hf.get("tie_word_embeddings", not get.has("lm_head.weight", prefixed=False)))
    cfg = _config(where, d_model=d, n_heads=H, n_kv_heads=Hkv, n_layers=L, d_mlp=n, norm="rmsnorm", placement="pre",
                  activation=acts[act], positions="rotary", eps=num(hf, "rms_norm_eps", where, real=True, default=1e-6),
                  max_seq_len=num(hf, "max_position_embeddings", where, default=2048), vocab_size=V, bias=qkv_bias,
                  lm_head="tied" if tied and not gemma else "separate", sliding_window=_window(hf, where, L),
                  qk_norm=family == "qwen3", head_dim=dh, **_rope(hf, where))
    dh = cfg.head_dim
    one = np.asarray(1.0, dtype)
    norm = (lambda a: a + one) if gemma else (lambda a: a)  # noqa: E731  Gemma: x_hat * (1 + w)
    w: dict[str, np.ndarray] = {}
    if glob:
        emb = get("embed_tokens.weight", V, d)
        w["final_norm.gamma"] = norm(get("norm.weight", d))
        if gemma:  # embeddings scaled by sqrt(d) rounded to the dtype; the tied head reads the unscaled table
            w["embed.tokens"] = emb * np.asarray(math.sqrt(d), dtype)
            w["lm_head.weight"] = emb if tied else get("lm_head.weight", V, d, prefixed=False)
        else:
            w["embed.tokens"] = emb
            if not tied:
                w["lm_head.weight"] = get("lm_head.weight", V, d, prefixed=False)
    if tied and get.has("lm_head.weight", prefixed=False):
        get.known.add("lm_head.weight")
    for k in range(L) if layers is None else layers:
        p, b = f"layers.{k}.", f"blocks.{k}."
        w.update(llama_layer(get, k, d, H, Hkv, dh, n))
        if family == "qwen3":  # RMSNorm of each query and key head (dh,)
            w[b + "attn.q_norm"], w[b + "attn.k_norm"] = (get(p + f"self_attn.{x}_norm.weight", dh) for x in "qk")
        w[b + "norm1.gamma"] = norm(get(p + "input_layernorm.weight", d))
        w[b + "norm2.gamma"] = norm(get(p + "post_attention_layernorm.weight", d))
        if qkv_bias:  # Qwen2 (or attention_bias): biases on q, k, v only; the Stack's other biases are exact zeros
            w[b + "attn.b_qkv"] = np.concatenate([get(p + f"self_attn.{x}_proj.bias", m * dh)
                                                  for x, m in (("q", H), ("k", Hkv), ("v", Hkv))])
            w[b + "attn.b_o"] = np.zeros(d, dtype)
            w[b + "mlp.b_in"], w[b + "mlp.b_out"] = np.zeros(2 * n, dtype), np.zeros(d, dtype)
    return cfg, w


FAMILIES = {"gpt2": gpt2, "gpt_neox": gpt_neox, "llama": llama_like, "mistral": llama_like, "qwen2": llama_like,
            "qwen3": llama_like, "gemma": llama_like, "phi3": phi3, "gemma2": gemma2}


def read_family(hf: dict[str, Any], st: Shards, where: str, dtype: Any, layers: Any = None,
                glob: bool = True) -> tuple[StackConfig, dict[str, np.ndarray]]:
    """Config and arrays; ``layers`` (block indices) and ``glob`` restrict which arrays are read.
    It reads what the config asks for: :func:`check_tensors` refuses the files' other tensors."""
    return FAMILIES[hf["model_type"]](hf, st, where, dtype, layers, glob)


#: Tensors a checkpoint may carry that no reader uses (buffers: rotary frequencies, causal masks).
_BUFFERS = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias", "attention.bias", "attention.masked_bias")


def check_tensors(hf: dict[str, Any], st: Shards, where: str, dtype: Any) -> None:
    """ValueError naming a tensor of the files that the model of ``hf`` does not use (a layer beyond
    num_hidden_layers, a bias the family has no place for, an unknown name) and its weights file, or
    a tensor it needs that is missing. The one check of both ``weights="load"`` and ``"mmap"``: the
    reader runs block by block on names only (no tensor data is read)."""
    names = _Names(st)
    cfg, _ = read_family(hf, names, where, dtype, layers=(), glob=True)  # type: ignore[arg-type]
    for k in range(cfg.n_layers):  # one block at a time: the placeholders of one block at most
        read_family(hf, names, where, dtype, layers=(k,), glob=False)  # type: ignore[arg-type]
    extra = sorted(n for n in st.names - names.read if not n.endswith(_BUFFERS))
    if extra:
        files = sorted({st.files[st.owner[n]].path for n in extra[:3]})
        raise ValueError(f"{where}: tensor(s) {extra[:3]} in weights file(s) {files} are not part of a "
                         f"{hf['model_type']} model with this config ({cfg.n_layers} layers)")
