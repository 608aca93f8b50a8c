"""Transformer block stacks: configuration, seeded weights, exact forward and block JVP.

A :class:`StackConfig` describes every design choice that the residual-stream
literature switches (norm, placement, residual, layout, activation, causal mask,
positions, grouped-query attention, a global gamma scale). :func:`init_weights`
builds a :class:`Stack` (config + named arrays) with a seeded scheme; a Stack saves
to and loads from ``.npz`` with its config inside. (The code of both lives in
private modules: ``_init.py`` and ``_npz.py``.)

Arrays of a Stack (d = d_model, H = n_heads, Hkv = n_kv_heads, dh = d / H):

- ``embed.tokens`` (vocab_size, d) if vocab_size > 0; ``embed.positions``
  (max_seq_len, d) if positions == "learned"; ``embed.norm.gamma`` (d,) and
  ``embed.norm.beta`` (d,) (LayerNorm only) if embed_norm;
- per block k, prefix ``blocks.<k>.``: ``norm1.gamma`` (d,), ``norm1.beta`` (d,)
  (LayerNorm only), the same for ``norm2`` (sequential layout only; the parallel
  layout has one norm per block), ``attn.w_qkv`` (d, (H + 2 Hkv) dh) with columns
  [q heads | k heads | v heads], ``attn.w_o`` (H dh, d), ``mlp.w_in`` (d, d_mlp)
  or (d, 2 d_mlp) as [gate | up] for "silu_gated", ``mlp.w_out`` (d_mlp, d), and
  if ``bias``: ``attn.b_qkv``, ``attn.b_o``, ``mlp.b_in``, ``mlp.b_out``;
- ``final_norm.gamma`` / ``final_norm.beta`` if final_norm;
- ``lm_head.weight`` (vocab_size, d) if lm_head == "separate" ("tied" reads out
  with ``embed.tokens``).

Products are ``x @ W`` (weights stored (in, out)). Every norm uses
``gamma_scale * gamma``: gamma_scale is applied at run time, so ``stack.replace(
gamma_scale=0.5)`` is an ablation of the same weights.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _blocks, _npz
from .. import _validate as _v
from ..kernels.layernorm import layer_norm, rms_norm

__all__ = ["BlockCache", "Stack", "StackConfig", "expected_arrays"]

_CHOICES = {
    "norm": ("layernorm", "rmsnorm"),
    "placement": ("pre", "post"),
    "layout": ("sequential", "parallel"),
    "activation": ("gelu", "gelu_tanh", "relu", "silu_gated"),
    "positions": ("learned", "sinusoidal", "rotary", "none"),
    "lm_head": ("none", "tied", "separate"),
}
_INTS = {"d_model": 2, "n_heads": 1, "n_kv_heads": 1, "d_mlp": 1, "n_layers": 1, "max_seq_len": 1, "vocab_size": 0}
_BOOLS = ("residual", "causal", "final_norm", "bias", "embed_norm")


@dataclasses.dataclass(frozen=True)
class StackConfig:
    """Description of a transformer stack; frozen, validated, JSON round-trippable.

    Parameters
    ----------
    d_model : int >= 2
    n_heads : int, divides d_model
    n_layers : int >= 1
    d_mlp : int, optional
        MLP hidden width (default 4 d_model); for "silu_gated" the width of gate and up each.
    n_kv_heads : int, optional
        Key/value heads for grouped-query attention; divides n_heads (default n_heads).
    norm : {"layernorm", "rmsnorm"}
    placement : {"pre", "post"}
        pre: ``h + F(N(h))``; post: ``N(h + F(h))``.
    residual : bool
        False drops the ``h +``.
    layout : {"sequential", "parallel"}
        sequential (GPT-2, BERT): attention then MLP, each with its own norm;
        parallel (GPT-J): ``h + Attn(N(h)) + MLP(N(h))`` with one shared norm
        (post: ``N(h + Attn(h) + MLP(h))``).
    activation : {"gelu", "gelu_tanh", "relu", "silu_gated"}
        "silu_gated" is Llama's SwiGLU: ``W_down(silu(W_gate x) * W_up x)``.
    causal : bool
    positions : {"learned", "sinusoidal", "rotary", "none"}
        learned/sinusoidal are added to the stream before block 0; rotary rotates
        q and k per head (half-split, base ``rope_base``, over the full head dim).
    eps : float >= 0
    final_norm : bool
        Whether the stack has a final norm (see :meth:`Stack.apply_final_norm`).
    gamma_scale : float
        Global multiplier of every norm's gamma, applied at run time (ablations).
    max_seq_len : int
        Longest sequence with learned positions.
    vocab_size : int >= 0
        Token embedding rows; 0 means no embedding (feed residual streams).
    bias : bool
        Whether attention and MLP projections have biases.
    rope_base : float > 0
    embed_norm : bool
        A norm (of kind ``norm``, arrays ``embed.norm.*``) applied to the embedding
        output (tokens + learned/sinusoidal positions) before block 0 (BERT).
    lm_head : {"none", "tied", "separate"}
        Language-model read-out of :meth:`Stack.logits`: none, the token embedding
        (tied; needs vocab_size > 0) or its own ``lm_head.weight`` (vocab_size, d).
    """

    d_model: int
    n_heads: int
    n_layers: int
    d_mlp: int | None = None
    n_kv_heads: int | None = None
    norm: str = "layernorm"
    placement: str = "pre"
    residual: bool = True
    layout: str = "sequential"
    activation: str = "gelu"
    causal: bool = True
    positions: str = "learned"
    eps: float = 1e-5
    final_norm: bool = True
    gamma_scale: float = 1.0
    max_seq_len: int = 1024
    vocab_size: int = 0
    bias: bool = True
    rope_base: float = 10000.0
    embed_norm: bool = False
    lm_head: str = "none"

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.d_mlp is None and isinstance(self.d_model, numbers.Integral):
            put("d_mlp", 4 * int(self.d_model))
        if self.n_kv_heads is None:
            put("n_kv_heads", self.n_heads)
        for name, low in _INTS.items():
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, numbers.Integral):
                raise TypeError(f"StackConfig.{name} must be an int; got {val!r}")
            if val < low:
                raise ValueError(f"StackConfig.{name} must be >= {low}; got {val}")
            put(name, int(val))
        for name in _BOOLS:
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"StackConfig.{name} must be True or False; got {getattr(self, name)!r}")
            put(name, bool(getattr(self, name)))
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"StackConfig.{name} must be one of {', '.join(map(repr, allowed))}; got {getattr(self, name)!r}"
                )
        for name, positive in (("eps", False), ("gamma_scale", None), ("rope_base", True)):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, numbers.Real) or not math.isfinite(val):
                raise TypeError(f"StackConfig.{name} must be a finite real number; got {val!r}")
            if (positive is False and val < 0) or (positive and val <= 0):
                raise ValueError(f"StackConfig.{name} must be {'> 0' if positive else '>= 0'}; got {val}")
            put(name, float(val))
        if self.d_model % self.n_heads:
            raise ValueError(f"StackConfig.n_heads = {self.n_heads} must divide d_model = {self.d_model}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"StackConfig.n_kv_heads = {self.n_kv_heads} must divide n_heads = {self.n_heads}")
        if self.lm_head != "none" and self.vocab_size == 0:
            raise ValueError(f"StackConfig.lm_head = {self.lm_head!r} needs vocab_size > 0 (a vocabulary to read out)")
        if self.positions == "rotary" and self.head_dim % 2:
            raise ValueError(
                f"StackConfig.positions = 'rotary' needs an even head dim d_model/n_heads; got {self.head_dim}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_json(self) -> str:
        """The config as a JSON object (every field, defaults resolved)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> StackConfig:
        """Parse and validate :meth:`to_json` output; ValueError/TypeError naming the field."""
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
            raise ValueError(f"StackConfig JSON is malformed: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"StackConfig JSON must be an object; got {type(obj).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(obj) - names)
        if unknown:
            raise ValueError(f"StackConfig JSON has unknown field(s) {unknown}; known: {sorted(names)}")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in obj]
        if missing:
            raise ValueError(f"StackConfig JSON lacks required field(s) {missing}")
        return cls(**obj)


def expected_arrays(config: StackConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every array a Stack with ``config`` holds, in a fixed order."""
    c = config
    d, dh = c.d_model, c.head_dim
    n_qkv = (c.n_heads + 2 * c.n_kv_heads) * dh
    n_in = 2 * c.d_mlp if c.activation == "silu_gated" else c.d_mlp
    out: dict[str, tuple[int, ...]] = {}
    if c.vocab_size:
        out["embed.tokens"] = (c.vocab_size, d)
    if c.positions == "learned":
        out["embed.positions"] = (c.max_seq_len, d)

    def norm(prefix: str) -> None:
        out[prefix + ".gamma"] = (d,)
        if c.norm == "layernorm":
            out[prefix + ".beta"] = (d,)

    if c.embed_norm:
        norm("embed.norm")

    for k in range(c.n_layers):
        p = f"blocks.{k}."
        norm(p + "norm1")
        if c.layout == "sequential":
            norm(p + "norm2")
        out[p + "attn.w_qkv"] = (d, n_qkv)
        out[p + "attn.w_o"] = (c.n_heads * dh, d)
        out[p + "mlp.w_in"] = (d, n_in)
        out[p + "mlp.w_out"] = (c.d_mlp, d)
        if c.bias:
            out[p + "attn.b_qkv"] = (n_qkv,)
            out[p + "attn.b_o"] = (d,)
            out[p + "mlp.b_in"] = (n_in,)
            out[p + "mlp.b_out"] = (d,)
    if c.final_norm:
        norm("final_norm")
    if c.lm_head == "separate":
        out["lm_head.weight"] = (c.vocab_size, d)
    return out


def _check_arrays(
    config: StackConfig, arrays: Mapping[str, Any], where: str, copy: bool = True
) -> dict[str, np.ndarray]:
    """Every expected array present, nothing else, right shape, one float dtype, finite.

    The arrays come back C-contiguous and read-only: copies, or with ``copy=False``
    (for arrays the caller just made and hands over) the same arrays where possible.
    """
    expected = expected_arrays(config)
    missing = [n for n in expected if n not in arrays]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"{where}: missing array(s) {missing[:3]}{more} required by the config")
    extra = sorted(set(arrays) - set(expected))
    if extra:
        raise ValueError(f"{where}: unexpected array(s) {extra[:3]} that the config does not use")
    out: dict[str, np.ndarray] = {}
    dtype = None
    for name, shape in expected.items():
        a = np.asarray(arrays[name])
        if a.dtype.kind != "f" or a.dtype.itemsize not in (4, 8):
            raise TypeError(f"{where}: array {name!r} must be float32 or float64; got dtype {a.dtype}")
        a = a.astype(a.dtype.newbyteorder("="), copy=False)
        if dtype is None:
            dtype = a.dtype
        elif a.dtype != dtype:
            raise TypeError(f"{where}: array {name!r} has dtype {a.dtype}, but the others are {dtype}")
        if a.shape != shape:
            raise ValueError(f"{where}: array {name!r} must have shape {shape}; got {a.shape}")
        if not np.isfinite(a).all():
            i = tuple(int(j) for j in np.argwhere(~np.isfinite(a))[0])
            raise ValueError(f"{where}: array {name!r} contains NaN or Inf (first at {i}: {a[i]})")
        a = np.array(a, order="C", copy=True) if copy else np.ascontiguousarray(a)
        a.flags.writeable = False
        out[name] = a
    return out


class BlockCache:
    """Activations of one block's forward at one sequence, for :meth:`Stack.block_jvp`."""

    __slots__ = ("block", "ctx", "data", "h", "stack")

    def __init__(self, stack: Stack, block: int, h: np.ndarray, ctx: Any, data: dict[str, Any]) -> None:
        self.stack, self.block, self.h, self.ctx, self.data = stack, block, h, ctx, data

    def __repr__(self) -> str:
        return f"BlockCache(block={self.block}, h={self.h.shape} {self.h.dtype})"


class Stack:
    """A transformer stack: a :class:`StackConfig` and its named weight arrays.

    Parameters
    ----------
    config : StackConfig
    weights : mapping str -> array
        Exactly the arrays that the config requires (see the module docstring),
        all float32 or all float64, finite. They are copied and kept read-only.

    Computation runs in the dtype of the input stream (or ``dtype=``); weights are
    converted once per dtype and kept. Inputs are never modified.
    """

    def __init__(self, config: StackConfig, weights: Mapping[str, Any]) -> None:
        if not isinstance(config, StackConfig):
            raise TypeError(f"config must be a StackConfig; got {type(config).__name__}")
        self._init(config, _check_arrays(config, weights, "weights"))

    def _init(self, config: StackConfig, weights: dict[str, np.ndarray]) -> None:
        self._config = config
        self._weights = weights
        self._prepared: dict[np.dtype, tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray]]] = {}

    @property
    def config(self) -> StackConfig:
        return self._config

    @property
    def weights(self) -> dict[str, np.ndarray]:
        """The stored arrays (a new dict of read-only arrays)."""
        return dict(self._weights)

    @property
    def dtype(self) -> np.dtype:
        return next(iter(self._weights.values())).dtype

    def __repr__(self) -> str:
        c = self._config
        return (f"Stack(n_layers={c.n_layers}, d_model={c.d_model}, n_heads={c.n_heads}, "
                f"norm={c.norm!r}, placement={c.placement!r}, layout={c.layout!r}, dtype={self.dtype})")

    def replace(self, **changes: Any) -> Stack:
        """A Stack with config fields changed and the same weights (e.g. ``gamma_scale``, ``causal``).

        The new config must need exactly the same arrays (ValueError otherwise).
        """
        cfg = dataclasses.replace(self._config, **changes)
        same = expected_arrays(cfg) == {n: a.shape for n, a in self._weights.items()}
        # The arrays are read-only and already checked: share them.
        return self._with(cfg, self._weights if same else _check_arrays(cfg, self._weights, "weights"))

    def astype(self, dtype: Any) -> Stack:
        """A copy with the weights stored in ``dtype`` (float32 or float64)."""
        dt = _float_dtype(dtype)
        return self._with(self._config, _check_arrays(
            self._config, {n: a.astype(dt) for n, a in self._weights.items()}, "weights", copy=False))

    def _with(self, config: StackConfig, weights: dict[str, np.ndarray]) -> Stack:
        """A shallow copy (same class and extra attributes, e.g. a tokenizer) with new config and weights."""
        new = copy.copy(self)
        new._init(config, weights)
        return new

    # ------------------------------------------------------------------ internals

    def _params(self, dtype: np.dtype) -> tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray]]:
        """Per-block weight dicts (prefix stripped) and the globals, in ``dtype``, gamma scaled."""
        if dtype not in self._prepared:
            gs = self._config.gamma_scale
            blocks: list[dict[str, np.ndarray]] = [{} for _ in range(self._config.n_layers)]
            glob: dict[str, np.ndarray] = {}
            for name, a in self._weights.items():
                a = a.astype(dtype, copy=False)
                if name.endswith(".gamma") and gs != 1.0:
                    a = a * dtype.type(gs)
                if a.flags.writeable:
                    a.flags.writeable = False
                if name.startswith("blocks."):
                    _, k, rest = name.split(".", 2)
                    blocks[int(k)][rest] = a
                else:
                    glob[name] = a
            self._prepared[dtype] = (blocks, glob)
        return self._prepared[dtype]

    def _block_index(self, k: Any) -> int:
        L = self._config.n_layers
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not -L <= k < L:
            raise ValueError(f"k must be a block index in [0, {L}) (negative counts from the end); got {k!r}")
        return int(k) % L

    def _stream(self, name: str, h: Any, dtype: Any = None) -> tuple[np.ndarray, bool]:
        """Validate a residual stream (T, d) or (B, T, d): C-contiguous (B, T, d) copy-free view."""
        arr = _v.float_array(name, h)
        d = self._config.d_model
        if arr.ndim not in (2, 3) or arr.shape[-1] != d or arr.shape[-2] < 1 or (arr.ndim == 3 and arr.shape[0] < 1):
            raise ValueError(f"{name} must have shape (T, {d}) or (B, T, {d}) with T, B >= 1; got {arr.shape}")
        dt = arr.dtype if dtype is None else _float_dtype(dtype)
        arr = np.ascontiguousarray(arr, dtype=dt)
        _finite(name, arr)
        return (arr if arr.ndim == 3 else arr[None]), arr.ndim == 3

    # ------------------------------------------------------------------ public API

    def embed(self, input_ids: Any, dtype: Any = None) -> np.ndarray:
        """Token embeddings (no positions) of ``input_ids`` (T,) or (B, T).

        Returns (T, d_model) or (B, T, d_model) in ``dtype`` (default the stack's).
        ValueError if the stack has no embedding (vocab_size = 0) or an id is out of range.
        """
        V = self._config.vocab_size
        if V == 0:
            raise ValueError("this stack has no token embedding (vocab_size = 0); pass residual streams instead")
        ids = np.asarray(input_ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"input_ids must be an integer array; got dtype {ids.dtype}")
        if ids.ndim not in (1, 2) or ids.shape[-1] < 1:
            raise ValueError(f"input_ids must have shape (T,) or (B, T) with T >= 1; got {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= V):
            bad = ids[(ids < 0) | (ids >= V)].flat[0]
            raise ValueError(f"input_ids must lie in [0, vocab_size = {V}); got {bad}")
        dt = self.dtype if dtype is None else _float_dtype(dtype)
        return self._params(dt)[1]["embed.tokens"][ids]

    def hidden_states(self, input_ids: Any, dtype: Any = None) -> np.ndarray:
        """The residual stream before and after every block.

        Parameters
        ----------
        input_ids : array_like
            Integer token ids (T,) or (B, T) (needs vocab_size > 0; see :meth:`embed`),
            or a float residual-stream input (T, d_model) or (B, T, d_model) that
            takes the place of the token embeddings.
        dtype : {None, float32, float64}
            Compute dtype; default the input's dtype (float input) or the stack's (ids).

        Returns
        -------
        ndarray, (n_layers + 1, T, d_model) or (n_layers + 1, B, T, d_model)
            Index 0 is the input after learned/sinusoidal positions are added
            (and the embedding norm applied, if ``embed_norm``: BERT); index k
            the stream after block k (post-LN: after the block's last norm).
            The final norm is not applied (see :meth:`apply_final_norm`).

        Raises
        ------
        TypeError, ValueError
            Wrong dtype or shape, NaN/Inf input, more tokens than max_seq_len
            (learned positions), ids out of range.
        """
        return self._forward(input_ids, dtype)[0]

    def _forward(self, input_ids: Any, dtype: Any = None, cache_from: int | None = None) -> tuple[np.ndarray, list]:
        """:meth:`hidden_states`, and the block caches (what a JVP needs) of blocks
        ``cache_from``.. (none if None), for engines that linearize at this run."""
        cfg = self._config
        x = input_ids
        if np.asarray(x).dtype.kind in "iu":
            emb = self.embed(x, dtype)
            h, batched = (emb if emb.ndim == 3 else emb[None]), emb.ndim == 3
        else:
            h, batched = self._stream("input_ids", x, dtype)
        T = h.shape[1]
        blocks, glob = self._params(h.dtype)
        out = np.empty((cfg.n_layers + 1,) + h.shape, h.dtype)
        if cfg.positions == "learned":
            if T > cfg.max_seq_len:
                raise ValueError(f"input_ids has T = {T} tokens, more than max_seq_len = {cfg.max_seq_len} learned positions")
            np.add(h, glob["embed.positions"][:T], out=out[0])
        elif cfg.positions == "sinusoidal":
            np.add(h, _blocks.sinusoidal_positions(T, cfg.d_model, h.dtype), out=out[0])
        else:
            out[0] = h
        if cfg.embed_norm:
            out[0] = self._norm(glob, "embed.norm", out[0])
        ctx = _blocks.make_context(cfg, T, h.dtype)
        caches: list[dict[str, Any]] = []
        for k in range(cfg.n_layers):
            cache: dict[str, Any] = {}
            out[k + 1] = _blocks.block_forward(blocks[k], ctx, out[k], cache)
            if cache_from is not None and k >= cache_from:
                caches.append(cache)
        return (out if batched else out[:, 0]), caches

    def block_forward(self, k: int, h: Any, return_cache: bool = False) -> Any:
        """Block k applied to the stream ``h`` (T, d_model) or (B, T, d_model), in h's dtype.

        Positions other than rotary are not added here (they enter before block 0).

        Returns
        -------
        ndarray of h's shape, or ``(out, cache)`` if ``return_cache``; the cache
        (for (T, d_model) input only) makes :meth:`block_jvp` skip the forward.
        """
        k = self._block_index(k)
        x, batched = self._stream("h", h)
        if return_cache and batched:
            raise ValueError("return_cache needs h of shape (T, d_model): a JVP linearizes at one sequence")
        ctx = _blocks.make_context(self._config, x.shape[1], x.dtype)
        data: dict[str, Any] = {}
        out = _blocks.block_forward(self._params(x.dtype)[0][k], ctx, x, data)
        out = out if batched else out[0]
        if not return_cache:
            return out
        base = x.copy()
        base.flags.writeable = False
        return out, BlockCache(self, k, base, ctx, data)

    def block_jvp(self, k: int, h: Any, dh: Any, mode: str = "full", cache: BlockCache | None = None) -> np.ndarray:
        """Exact directional derivative of block k at ``h`` in direction(s) ``dh``.

        Parameters
        ----------
        k : int
            Block index.
        h : array_like, (T, d_model), float32 or float64
            Point of linearization (the block's input).
        dh : array_like, (T, d_model) or (K, T, d_model)
            One tangent or K tangents (computed together: one GEMM per weight);
            converted to h's dtype.
        mode : {"full", "frozen_scale"}
            Norm linearization: the true derivative, or every norm's scale held fixed.
        cache : BlockCache, optional
            From ``block_forward(k, h, return_cache=True)`` with the same h; reused
            (also across calls: activation derivatives are kept in it).

        Returns
        -------
        ndarray, dh's shape, h's dtype
        """
        k = self._block_index(k)
        _v.frozen(mode)
        x, batched = self._stream("h", h)
        if batched:
            raise ValueError(f"h must have shape (T, d_model) = (T, {self._config.d_model}); got {x.shape}")
        t = _v.float_array("dh", dh)
        if t.ndim not in (2, 3) or t.shape[-2:] != x.shape[1:] or t.shape[0] < 1:
            raise ValueError(f"dh must have shape {x.shape[1:]} or (K,) + {x.shape[1:]}; got {t.shape}")
        t = np.ascontiguousarray(t, dtype=x.dtype)
        _finite("dh", t)
        if cache is None:
            cache = self.block_forward(k, x[0], return_cache=True)[1]
        elif not isinstance(cache, BlockCache):
            raise TypeError(
                f"cache must be a BlockCache from block_forward(..., return_cache=True); got {type(cache).__name__}"
            )
        elif cache.stack is not self or cache.block != k:
            owner = "this stack" if cache.stack is self else "another stack"
            raise ValueError(f"cache belongs to block {cache.block} of {owner}, not to block {k} of this stack")
        elif cache.h.shape != x.shape or cache.h.dtype != x.dtype or not np.array_equal(cache.h, x):
            raise ValueError("cache was computed at a different h (or dtype) than the one given")
        w = self._params(x.dtype)[0][k]
        out = _blocks.block_jvp(w, cache.ctx, t if t.ndim == 3 else t[None], cache.data, mode)
        return out if t.ndim == 3 else out[0]

    def apply_final_norm(self, h: Any) -> np.ndarray:
        """The final norm (gamma scaled by gamma_scale) of a stream (..., d_model), in h's dtype."""
        if not self._config.final_norm:
            raise ValueError("this stack has no final norm (config.final_norm is False)")
        x = _v.float_array("h", h)
        if x.ndim < 1 or x.shape[-1] != self._config.d_model:
            raise ValueError(f"h must have shape (..., {self._config.d_model}); got {x.shape}")
        return self._norm(self._params(x.dtype)[1], "final_norm", x)

    def _norm(self, glob: dict[str, np.ndarray], name: str, x: np.ndarray) -> np.ndarray:
        """The global norm ``name`` ("final_norm", "embed.norm") of x in x's dtype (weights from ``glob``)."""
        if self._config.norm == "layernorm":
            return layer_norm(x, glob[name + ".gamma"], glob[name + ".beta"], self._config.eps)
        return rms_norm(x, glob[name + ".gamma"], self._config.eps)

    def logits(self, input_ids: Any, dtype: Any = None) -> np.ndarray:
        """Language-model logits: the final norm (if any), then the read-out ``@ W.T``.

        Parameters
        ----------
        input_ids : array_like
            Integer token ids (T,) or (B, T): the whole stack runs first and its last
            hidden state is read out. Or a float residual stream (..., d_model),
            read out as it is (final norm, then W: the "logit lens" of any layer).
        dtype : {None, float32, float64}
            Compute dtype; default the input's dtype (float input) or the stack's (ids).

        Returns
        -------
        ndarray, (T, vocab_size), (B, T, vocab_size) or (..., vocab_size)
            W is ``lm_head.weight`` (lm_head "separate") or ``embed.tokens`` ("tied").

        Raises
        ------
        ValueError
            If the stack has no language-model head (config.lm_head == "none"),
            and for the input errors of :meth:`hidden_states`.
        """
        cfg = self._config
        if cfg.lm_head == "none":
            raise ValueError("this stack has no language-model head (config.lm_head is 'none')")
        x = input_ids
        if np.asarray(x).dtype.kind in "iu":
            h = self.hidden_states(x, dtype)[-1]
        else:
            h = _v.float_array("input_ids", x)
            if h.ndim < 1 or h.shape[-1] != cfg.d_model:
                raise ValueError(f"input_ids must have shape (..., {cfg.d_model}) (or be integer token ids); got {h.shape}")
            h = np.ascontiguousarray(h, dtype=h.dtype if dtype is None else _float_dtype(dtype))
            _finite("input_ids", h)
        glob = self._params(h.dtype)[1]
        if cfg.final_norm:
            h = self._norm(glob, "final_norm", h)
        w = glob["lm_head.weight" if cfg.lm_head == "separate" else "embed.tokens"]
        return (h.reshape(-1, cfg.d_model) @ w.T).reshape(h.shape[:-1] + (cfg.vocab_size,))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write an uncompressed ``.npz`` (the arrays and the config JSON), atomically."""
        _npz.save(path, self._config.to_json(), self._weights)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Stack:
        """Read a file written by :meth:`save`.

        Every array's presence, shape, dtype and finiteness is checked, and each
        member's header against the bytes actually present, before anything is
        allocated. A truncated or malformed file raises ValueError (TypeError for a
        wrong dtype) naming the file; a missing file raises FileNotFoundError.
        """
        path = os.fspath(path)
        config, arrays = _npz.load(path, StackConfig.from_json, expected_arrays)
        new = cls.__new__(cls)
        new._init(config, _check_arrays(config, arrays, f"weights file {path!r}"))
        return new


def _float_dtype(dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in _v.FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32 or float64; got {dtype!r}")
    return dt


def _finite(name: str, a: np.ndarray) -> None:
    if not np.isfinite(a).all():
        i = tuple(int(j) for j in np.argwhere(~np.isfinite(a))[0])
        raise ValueError(f"{name} contains NaN or Inf (first at {i}: {a[i]})")
