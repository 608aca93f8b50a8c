"""What the family readers of :mod:`._families` and :mod:`._phi3` share: the tensor reader,
config refusals, rope fields, and the dimensions of Llama-shaped configs."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._hf import Shards, num
from .config import StackConfig


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


def llama_dims(hf: dict[str, Any], where: str) -> tuple[int, ...]:
    """``(d, H, Hkv, L, n, V, dh)`` of a Llama-shaped config (hidden size, heads, key/value heads,
    layers, MLP width, vocabulary, head dim: None where the config leaves it to d // H)."""
    d, H, L, n, V = (num(hf, k, where) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                                                   "intermediate_size", "vocab_size"))
    Hkv = num(hf, "num_key_value_heads", where, default=H)
    dh = num(hf, "head_dim", where) if hf.get("head_dim") is not None else None
    return d, H, Hkv, L, n, V, dh


def llama_layer(get: _Reader, k: int, d: int, H: int, Hkv: int, dh: int, n: int) -> dict[str, np.ndarray]:
    """Layer k's attention (q, k, v, o) and gated MLP (gate, up, down) projections as block k's arrays."""
    p, b = f"layers.{k}.", f"blocks.{k}."
    return {b + "attn.w_qkv": get.linear(*((p + f"self_attn.{x}_proj.weight", m * dh, d)
                                           for x, m in (("q", H), ("k", Hkv), ("v", Hkv)))),
            b + "attn.w_o": get.linear((p + "self_attn.o_proj.weight", d, H * dh)),
            b + "mlp.w_in": get.linear((p + "mlp.gate_proj.weight", n, d), (p + "mlp.up_proj.weight", n, d)),
            b + "mlp.w_out": get.linear((p + "mlp.down_proj.weight", d, n))}


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
