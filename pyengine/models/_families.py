"""HF decoder families -> Stack arrays: GPT-2, GPT-NeoX/Pythia, Llama (incl. Llama 3 rope scaling), Mistral,
Qwen2, Qwen3, Gemma.

Each reader takes the parsed ``config.json``, a :class:`._hf.Shards` and the storage
dtype, and returns ``(StackConfig, arrays)``. A config field that would change the
model but has no mapping raises ValueError naming it (never a silently different
model); so does a tensor in the files that the mapping does not use.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._hf import Shards, num
from .config import StackConfig

__all__ = ["FAMILIES", "check_tensors", "read_family"]

_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def _config(where: str, **kw: Any) -> StackConfig:
    try:
        return StackConfig(**kw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def _refuse(hf: dict[str, Any], where: str, **defaults: Any) -> None:
    """ValueError naming the first field whose value differs from the one the mapping assumes."""
    for key, ok in defaults.items():
        if key in hf and hf[key] is not None and hf[key] != ok:
            raise ValueError(f"{where}: config field {key!r} = {hf[key]!r} is not supported (only {ok!r})")


def _rope(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """rope_theta and rope_scaling (``rope_scaling`` or transformers 5's ``rope_parameters``)."""
    sc = hf.get("rope_scaling") or {}
    params = hf.get("rope_parameters") or {}
    if not isinstance(sc, dict) or not isinstance(params, dict):
        raise ValueError(f"{where}: rope_scaling must be an object; got {sc!r}")
    sc = {**params, **sc}
    base = sc.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    out: dict[str, Any] = {"rope_base": num({"rope_theta": base}, "rope_theta", where, real=True)}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "llama3":
        out.update(rope_scaling="llama3", rope_factor=num(sc, "factor", where, real=True),
                   rope_low_freq_factor=num(sc, "low_freq_factor", where, real=True),
                   rope_high_freq_factor=num(sc, "high_freq_factor", where, real=True),
                   rope_original_max_len=num(sc, "original_max_position_embeddings", where))
    elif kind != "default":
        raise ValueError(f"{where}: rope_scaling type {kind!r} is not supported (only 'llama3' or none)")
    return out


def _t(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.T)


class _Reader:
    def __init__(self, st: Shards, dtype: Any, prefixes: tuple[str, ...]) -> None:
        # the names used (read, or skipped on purpose as a tied lm_head): check_tensors's record
        self.st, self.dtype, self.known = st, dtype, st.read if isinstance(st, _Names) else set()
        self.pre = next((p for p in prefixes if any(n.startswith(p) for n in st.names)), prefixes[-1])

    def __call__(self, name: str, *shape: int, prefixed: bool = True) -> np.ndarray:
        full = self.pre + name if prefixed else name
        self.known.add(full)
        return self.st.get(full, shape, self.dtype)

    def linear(self, *parts: tuple[str, int, int]) -> np.ndarray:
        """HF Linear weights ``(name, out, in)`` stacked along their outputs, in a Stack's (in, out) layout."""
        full = [(self.pre + name, (o, i)) for name, o, i in parts]
        self.known.update(name for name, _ in full)
        if hasattr(self.st, "linear"):  # one pass, no intermediate copies (safetensors files)
            return self.st.linear(full, self.dtype)
        return _t(np.concatenate([self.st.get(name, s, self.dtype) for name, s in full]))

    def has(self, name: str, prefixed: bool = True) -> bool:
        return (self.pre + name if prefixed else name) in self.st.names


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


def _rotary_fraction(hf: dict[str, Any], where: str) -> float:
    """The rotary fraction of a head: ``partial_rotary_factor`` (in ``rope_parameters`` or the
    config) or ``rotary_pct``, default 1; ValueError naming the field unless a number in [0, 1]."""
    params = hf.get("rope_parameters") or {}
    src, key = next(((d, k) for d, k in ((params, "partial_rotary_factor"), (hf, "partial_rotary_factor"),
                                          (hf, "rotary_pct")) if k in d), ({}, "rotary_pct"))
    pct = num(src, key, where, real=True, default=1.0)
    if not 0 <= pct <= 1:
        raise ValueError(f"{where}: {key!r} must be a number in [0, 1]; got {pct!r}")
    return pct


def _partial_perm(dh: int, r: int) -> np.ndarray:
    """Head-feature order putting NeoX's rotary pairs (j, j + r/2), j < r/2, at (j, j + dh/2)."""
    half = (dh - r) // 2
    return np.concatenate([np.arange(r // 2), r + np.arange(half), r // 2 + np.arange(r // 2),
                           r + half + np.arange(half)])


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


def _window(hf: dict[str, Any], where: str, L: int) -> int:
    """The sliding window of every block (0: none) as transformers applies it: Mistral slides in
    every layer when ``sliding_window`` is set; Qwen2 and Qwen3 only with ``use_sliding_window``, in the
    layers that ``layer_types`` (or, without it, ``max_window_layers``: layers >= it) name
    "sliding_attention". A window in some layers but not all is refused (one window per Stack)."""
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
    if len(set(kinds)) > 1:
        raise ValueError(f"{where}: config field 'layer_types' = {kinds!r} mixes sliding and full attention "
                         "layers; not supported (only all of one kind)")
    return num(hf, "sliding_window", where) if kinds[0] == "sliding_attention" else 0


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
    d, H, L, n, V = (num(hf, k, where) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                                                   "intermediate_size", "vocab_size"))
    Hkv = num(hf, "num_key_value_heads", where, default=H)
    dh = hf.get("head_dim") or d // H
    if dh * H != d:
        raise ValueError(f"{where}: head_dim {dh} * num_attention_heads {H} != hidden_size {d} is not supported")
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
                  qk_norm=family == "qwen3",
                  **_rope(hf, where))
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
        w[b + "attn.w_qkv"] = get.linear(*((p + f"self_attn.{x}_proj.weight", m * dh, d)
                                            for x, m in (("q", H), ("k", Hkv), ("v", Hkv))))
        w[b + "attn.w_o"] = get.linear((p + "self_attn.o_proj.weight", d, H * dh))
        if family == "qwen3":  # RMSNorm of each query and key head (dh,)
            w[b + "attn.q_norm"], w[b + "attn.k_norm"] = (get(p + f"self_attn.{x}_norm.weight", dh) for x in "qk")
        w[b + "mlp.w_in"] = get.linear((p + "mlp.gate_proj.weight", n, d), (p + "mlp.up_proj.weight", n, d))
        w[b + "mlp.w_out"] = get.linear((p + "mlp.down_proj.weight", d, n))
        w[b + "norm1.gamma"] = norm(get(p + "input_layernorm.weight", d))
        w[b + "norm2.gamma"] = norm(get(p + "post_attention_layernorm.weight", d))
        if qkv_bias:  # Qwen2 (or attention_bias): biases on q, k, v only; the Stack's other biases are exact zeros
            w[b + "attn.b_qkv"] = np.concatenate([get(p + f"self_attn.{x}_proj.bias", m * dh)
                                                  for x, m in (("q", H), ("k", Hkv), ("v", Hkv))])
            w[b + "attn.b_o"] = np.zeros(d, dtype)
            w[b + "mlp.b_in"], w[b + "mlp.b_out"] = np.zeros(2 * n, dtype), np.zeros(d, dtype)
    return cfg, w


FAMILIES = {"gpt2": gpt2, "gpt_neox": gpt_neox, "llama": llama_like, "mistral": llama_like, "qwen2": llama_like,
            "qwen3": llama_like, "gemma": llama_like}


def read_family(hf: dict[str, Any], st: Shards, where: str, dtype: Any, layers: Any = None,
                glob: bool = True) -> tuple[StackConfig, dict[str, np.ndarray]]:
    """Config and arrays; ``layers`` (block indices) and ``glob`` restrict which arrays are read.
    It reads what the config asks for: :func:`check_tensors` refuses the files' other tensors."""
    return FAMILIES[hf["model_type"]](hf, st, where, dtype, layers, glob)


class _Names:
    """Shards that read nothing: ``get`` records the name (which must exist) and returns zeros
    of the asked shape as a zero-stride view, so a reader runs on names only."""

    def __init__(self, st: Shards) -> None:
        self.st, self.names, self.read = st, st.names, set()

    def get(self, name: str, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        if name not in self.names:
            raise self.st.lacks(name)
        self.read.add(name)
        return np.broadcast_to(np.zeros((), dtype), shape)

    def linear(self, parts: list[tuple[str, tuple[int, int]]], dtype: Any = np.float32) -> np.ndarray:
        for name, s in parts:
            self.get(name, s, dtype)
        return np.broadcast_to(np.zeros((), dtype), (parts[0][1][1], sum(s[0] for _, s in parts)))


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
