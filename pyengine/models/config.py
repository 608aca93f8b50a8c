"""Stack configuration: :class:`StackConfig`, the arrays it requires, and their checks.

A :class:`StackConfig` describes every design choice that the residual-stream
literature switches (norm, placement, residual, layout, activation, causal mask,
positions, grouped-query attention, a global gamma scale); :func:`expected_arrays`
names the weight arrays a :class:`~pyengine.models.stack.Stack` with that config
holds, and ``_check_arrays`` (used by the Stack, initialization and the pretrained
readers) checks a set of them. The checks of the fields themselves are in
:mod:`pyengine.models._config_checks`.

Arrays of a Stack (d = d_model, H = n_heads, Hkv = n_kv_heads, dh = head_dim, by default d / H;
H dh may differ from d, as in Qwen3 or Mistral-Nemo):

- ``embed.tokens`` (vocab_size, d) if vocab_size > 0; ``embed.positions``
  (max_seq_len, d) if positions == "learned"; ``embed.norm.gamma`` (d,) and
  ``embed.norm.beta`` (d,) (LayerNorm only) if embed_norm;
- per block k, prefix ``blocks.<k>.``: ``norm1.gamma`` (d,), ``norm1.beta`` (d,)
  (LayerNorm only), the same for ``norm2`` (sequential layout only; the parallel
  layout has one norm per block), ``norm1_out.*`` and ``norm2_out.*`` (placement "peri" only: the
  norms of the sublayers' outputs), ``attn.w_qkv`` (d, (H + 2 Hkv) dh) with columns
  [q heads | k heads | v heads], ``attn.w_o`` (H dh, d), ``attn.q_norm`` and ``attn.k_norm``
  (head_dim,) if qk_norm, ``mlp.w_in`` (d, d_mlp)
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

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import _validate as _v
from . import _config_checks as _checks

__all__ = ["StackConfig", "expected_arrays"]

#: Activations whose ``mlp.w_in`` is [gate | up] (width 2 d_mlp).
GATED = ("silu_gated", "gelu_tanh_gated")
#: Fields written by :meth:`StackConfig.to_dict` only when not 0 (their default, the model without them).
_LATER_ZERO = ("attn_scale", "attn_softcap", "logit_softcap")


@dataclasses.dataclass(frozen=True)
class StackConfig:
    """Description of a transformer stack; frozen, validated, JSON round-trippable.

    Parameters
    ----------
    d_model : int >= 2
    n_heads : int >= 1
        Query heads; must divide d_model unless ``head_dim`` is given.
    n_layers : int >= 1
    d_mlp : int, optional
        MLP hidden width (default 4 d_model); for "silu_gated" the width of gate and up each.
    n_kv_heads : int, optional
        Key/value heads for grouped-query attention; divides n_heads (default n_heads).
    norm : {"layernorm", "rmsnorm"}
    placement : {"pre", "post", "peri"}
        pre: ``h + F(N(h))``; post: ``N(h + F(h))``; peri (Gemma 2, sequential layout only):
        ``h + N_out(F(N(h)))``, a second norm on each sublayer's output (``norm1_out``, ``norm2_out``).
    residual : bool
        False drops the ``h +``.
    layout : {"sequential", "parallel"}
        sequential (GPT-2, BERT): attention then MLP, each with its own norm;
        parallel (GPT-J): ``h + Attn(N(h)) + MLP(N(h))`` with one shared norm
        (post: ``N(h + Attn(h) + MLP(h))``); "parallel2" (GPT-NeoX/Pythia, pre only):
        ``h + Attn(N1(h)) + MLP(N2(h))`` with two norms.
    activation : {"gelu", "gelu_tanh", "relu", "silu_gated", "gelu_tanh_gated"}
        "silu_gated" is Llama's SwiGLU: ``W_down(silu(W_gate x) * W_up x)``;
        "gelu_tanh_gated" Gemma's GeGLU (tanh-approximate GELU on the gate).
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
    rotary_dim : int >= 0
        Rotary on the first ``rotary_dim`` features of each head only (GPT-NeoX's
        partial rotary, half-split within them); 0 means the whole head.
    rope_scaling : {"none", "llama3", "longrope"}
        "llama3": Llama 3.1's frequency rescaling with ``rope_factor``,
        ``rope_low_freq_factor``, ``rope_high_freq_factor`` and
        ``rope_original_max_len`` (HF's ``rope_scaling`` dict; ignored for "none").
        "longrope" (Phi-3): frequency i divided by ``rope_short_factor[i]`` for
        sequences of at most ``rope_original_max_len`` tokens, by ``rope_long_factor[i]``
        for longer ones, and the rotated features' cos and sin multiplied by
        ``rope_attention_factor``.
    rope_short_factor, rope_long_factor : tuple of float > 0
        "longrope" only (empty otherwise): one factor per rotated pair, rotary_dim/2
        (0: head_dim/2) of each.
    rope_attention_factor : float > 0
        "longrope" only: the multiplier of cos and sin.
    sliding_window : int >= 0, or a tuple of n_layers of them
        Sliding-window attention (Mistral): query i sees keys j with
        i - sliding_window < j <= i; 0 means none. Needs ``causal``. A tuple gives each
        block its own window (Gemma 2: the even blocks slide); see :meth:`window`.
    qk_norm : bool
        RMSNorm (eps ``eps``) of each query and key head over its head_dim features before
        rotary (Qwen3), with the arrays ``attn.q_norm`` and ``attn.k_norm`` (head_dim,).
    head_dim : int >= 1, optional
        Width of every query, key and value head (default d_model // n_heads, which then
        must divide exactly). Given, ``n_heads * head_dim`` need not equal d_model: the
        heads are projected from and back to d_model by ``attn.w_qkv`` (d, (H + 2 Hkv) dh)
        and ``attn.w_o`` (H dh, d) (Qwen3, Mistral-Nemo, Gemma). :meth:`to_json` writes
        it only when it differs from the default, and :meth:`replace` recomputes a
        default head_dim from the new d_model and n_heads.
    attn_scale : float >= 0
        The factor of the attention scores ``q.k``; 0 means ``head_dim ** -0.5`` (Gemma 2:
        ``query_pre_attn_scalar ** -0.5``); see :attr:`score_scale`.
    attn_softcap, logit_softcap : float >= 0
        Soft-capping ``c * tanh(x / c)`` of the attention scores (after the scale, before
        the mask and softmax) and of the read-out's logits (Gemma 2); 0 means none.
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
    rotary_dim: int = 0
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    sliding_window: int | tuple[int, ...] = 0
    qk_norm: bool = False
    head_dim: int = None  # type: ignore[assignment]  # None: d_model // n_heads, resolved in __post_init__
    rope_short_factor: tuple[float, ...] = ()
    rope_long_factor: tuple[float, ...] = ()
    rope_attention_factor: float = 1.0
    attn_scale: float = 0.0
    attn_softcap: float = 0.0
    logit_softcap: float = 0.0

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        _checks.check_fields(self, put)

    def window(self, k: int) -> int:
        """The sliding window of block k (0: none)."""
        w = self.sliding_window
        return w if isinstance(w, int) else w[k]

    @property
    def score_scale(self) -> float:
        """The factor of the attention scores: ``attn_scale``, or ``1 / sqrt(head_dim)`` when it is 0."""
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    @property
    def head_dim_is_default(self) -> bool:
        """Whether head_dim is d_model // n_heads with n_heads dividing d_model (H dh = d)."""
        return self.head_dim * self.n_heads == self.d_model

    def replace(self, **changes: Any) -> StackConfig:
        """A validated copy with ``changes``; a default head_dim follows a changed d_model or n_heads.

        (``dataclasses.replace`` would keep the old head_dim as if it had been given.)
        """
        if "head_dim" not in changes and self.head_dim_is_default:
            changes = {**changes, "head_dim": None}
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The config as a JSON-ready dict, in field order (every field, defaults resolved;
        head_dim only if it is not d_model // n_heads, the LongRoPE fields only with rope_scaling
        "longrope", and attn_scale, attn_softcap and logit_softcap only if not 0, so other configs
        read as before these fields existed)."""
        obj = dataclasses.asdict(self)
        if self.head_dim_is_default:
            del obj["head_dim"]
        if self.rope_scaling != "longrope":
            for name in ("rope_short_factor", "rope_long_factor", "rope_attention_factor"):
                del obj[name]
        else:
            obj.update(rope_short_factor=list(self.rope_short_factor), rope_long_factor=list(self.rope_long_factor))
        for name in _LATER_ZERO:
            if not obj[name]:
                del obj[name]
        return obj

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> StackConfig:
        """Validate :meth:`to_dict` output (or an older one, without newer fields); ValueError/TypeError
        naming the field."""
        if not isinstance(obj, Mapping):
            raise ValueError(f"StackConfig data must be an object (a dict); got {type(obj).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(obj) - names)
        if unknown:
            raise ValueError(f"StackConfig data has unknown field(s) {unknown}; known: {sorted(names)}")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in obj]
        if missing:
            raise ValueError(f"StackConfig data lacks required field(s) {missing}")
        return cls(**obj)

    def to_json(self) -> str:
        """:meth:`to_dict` as a JSON object with sorted keys."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> StackConfig:
        """Parse and validate :meth:`to_json` output; ValueError/TypeError naming the field."""
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
            raise ValueError(f"StackConfig JSON is malformed: {exc}") from None
        return cls.from_dict(obj)


def expected_arrays(config: StackConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every array a Stack with ``config`` holds, in a fixed order."""
    c = config
    d, dh = c.d_model, c.head_dim
    n_qkv = (c.n_heads + 2 * c.n_kv_heads) * dh
    n_in = 2 * c.d_mlp if c.activation in GATED else c.d_mlp
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
        if c.layout != "parallel":
            norm(p + "norm2")
        if c.placement == "peri":
            norm(p + "norm1_out")
            norm(p + "norm2_out")
        out[p + "attn.w_qkv"] = (d, n_qkv)
        out[p + "attn.w_o"] = (c.n_heads * dh, d)
        if c.qk_norm:
            out[p + "attn.q_norm"] = out[p + "attn.k_norm"] = (dh,)
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
        _v.finite(f"{where}: array {name!r}", a)
        a = np.array(a, order="C", copy=True) if copy else np.ascontiguousarray(a)
        a.flags.writeable = False
        out[name] = a
    return out
