"""Transformer block stacks: :class:`Stack` (config + weights), exact forward and block JVP.

A Stack is a :class:`~pyengine.models.config.StackConfig` and the named weight
arrays it requires (listed in :mod:`pyengine.models.config`). :func:`~pyengine.init_weights`
builds one with a seeded scheme; a Stack saves to and loads from ``.npz`` with its
config inside.

A Stack is also the engine of the analyses (:mod:`pyengine.analysis`), through public
methods only: :meth:`Stack.forward` keeps the :class:`BlockCache` of every block of one
run; :meth:`Stack.block_forward` with ``past=`` reruns a block on the rows after a span
(causal stacks), :meth:`Stack.block_jvp` linearizes a block (``start=`` on those rows
only), and :meth:`Stack.block_jvp_diagonal` applies the per-token diagonal blocks of a
block's Jacobian; :meth:`Stack.block_vjp` (its transpose, and the block's weight
gradients) and :meth:`Stack.vjp` (a chain of them) run in reverse mode
(:mod:`pyengine.models.reverse`). Inputs are checked once there; the block code
(``_blocks.py``, ``_blocks_vjp.py``) then runs the kernels directly.

Every forward (:meth:`Stack.forward`, :meth:`Stack.run`, ...) runs ``Stack._run`` here. Named
activation sites, :meth:`Stack.run_with_cache`, interventions (:meth:`Stack.run`), padded batches
(``attention_mask``) and the read-out (:meth:`Stack.logits`, logit lens) come from the base class
:class:`~pyengine.models.sites.Sites` (see :mod:`pyengine.models.sites`).
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _blocks, _fast, _npz
from .. import _validate as _v
from ..kernels.layernorm import layer_norm, rms_norm
from .config import StackConfig, _check_arrays, expected_arrays
from .linearization import BlockCache, Linearization
from .reverse import ReverseMode
from .sites import _Hooks, Sites, as_input, check_not_float_ids, padded_context, padding

__all__ = ["BlockCache", "Stack"]


class Stack(Sites, Linearization, ReverseMode):
    """A transformer stack: a :class:`StackConfig` and its named weight arrays.

    Parameters
    ----------
    config : StackConfig
    weights : mapping str -> array
        Exactly the arrays that the config requires (see :mod:`pyengine.models.config`),
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

        The new config must need exactly the same arrays (ValueError otherwise). A default
        head_dim follows a changed d_model or n_heads (:meth:`StackConfig.replace`).
        """
        cfg = self._config.replace(**changes)
        same = expected_arrays(cfg) == {n: a.shape for n, a in self._weights.items()}
        # The arrays are read-only and already checked: share them.
        return self._with(cfg, self._weights if same else _check_arrays(cfg, self._weights, "weights"))

    def astype(self, dtype: Any) -> Stack:
        """A copy with the weights stored in ``dtype`` (float32 or float64)."""
        dt = _v.float_dtype("dtype", dtype)
        return self._with(self._config, _check_arrays(
            self._config, {n: a.astype(dt) for n, a in self._weights.items()}, "weights", copy=False))

    def _with(self, config: StackConfig, weights: dict[str, np.ndarray]) -> Stack:
        """A shallow copy (same class and extra attributes, e.g. a tokenizer) with new config and weights."""
        new = copy.copy(self)
        new._init(config, weights)
        return new

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

    # ------------------------------------------------------------------ checks the analyses share

    def block_index(self, k: Any) -> int:
        """``k`` as a block index in [0, n_layers) (negative counts from the end); ValueError otherwise."""
        return _v.index_of("k", k, self._config.n_layers, "a block index", negative=True)

    def block_weights(self, k: Any, dtype: Any = None) -> dict[str, np.ndarray]:
        """The arrays block k computes with, names without the ``blocks.<k>.`` prefix.

        In ``dtype`` (default the stack's), read-only, converted once per dtype and kept;
        every ``*.gamma`` is already multiplied by ``config.gamma_scale``.
        """
        k = self.block_index(k)
        return dict(self._params(self.dtype if dtype is None else _v.float_dtype("dtype", dtype))[0][k])

    def as_stream(self, h: Any, name: str = "h", dtype: Any = None) -> tuple[np.ndarray, bool]:
        """Check a residual stream (T, d_model) or (B, T, d_model), T, B >= 1, finite.

        Returns it as a C-contiguous (B, T, d_model) array in ``dtype`` (default h's own;
        a view when nothing needs converting) and whether h had the batch axis. TypeError
        for a non-float dtype, ValueError for a wrong shape or NaN/Inf, naming ``name``.
        """
        arr = _v.float_array(name, as_input(h, name))
        d = self._config.d_model
        if arr.ndim not in (2, 3) or arr.shape[-1] != d or arr.shape[-2] < 1 or (arr.ndim == 3 and arr.shape[0] < 1):
            raise ValueError(f"{name} must have shape (T, {d}) or (B, T, {d}) with T, B >= 1; got {arr.shape}")
        arr = np.ascontiguousarray(arr, dtype=arr.dtype if dtype is None else _v.float_dtype("dtype", dtype))
        _v.finite(name, arr)
        return (arr if arr.ndim == 3 else arr[None]), arr.ndim == 3

    # ------------------------------------------------------------------ forward

    def embed(self, input_ids: Any, dtype: Any = None, token_type_ids: Any = None) -> np.ndarray:
        """Token embeddings (no positions) of ``input_ids`` (T,) or (B, T).

        Returns (T, d_model) or (B, T, d_model) in ``dtype`` (default the stack's).
        BERT: plus the token-type embedding (``token_type_ids``, default 0), summed in
        ``dtype``; so ``hidden_states(embed(ids))`` equals ``hidden_states(ids)``.
        ValueError if the stack has no embedding (vocab_size = 0) or an id is out of range.
        """
        V = self._config.vocab_size
        if V == 0:
            raise ValueError("this stack has no token embedding (vocab_size = 0); pass residual streams instead")
        ids = _v.token_ids("input_ids", as_input(input_ids), V)
        dt = self.dtype if dtype is None else _v.float_dtype("dtype", dtype)
        return self._token_types(self._params(dt)[1]["embed.tokens"][ids], token_type_ids)

    def hidden_states(self, input_ids: Any, dtype: Any = None, *, attention_mask: Any = None,
                      token_type_ids: Any = None, final_norm: bool = False) -> np.ndarray:
        """The residual stream before and after every block.

        Parameters
        ----------
        input_ids : array_like
            Integer token ids (T,) or (B, T) (needs vocab_size > 0; see :meth:`embed`),
            or a float residual-stream input (T, d_model) or (B, T, d_model) that
            takes the place of the token embeddings. Torch tensors are read without
            importing torch: detached if they require grad, float16 and bfloat16
            widened to float32 exactly.
        dtype : {None, float32, float64}
            Compute dtype; default the input's dtype (float input) or the stack's (ids).
            float64 means float64 arithmetic on the stored weights from the first sum.
        attention_mask : array_like (T,) or (B, T), optional
            1 for real tokens, 0 for padding (left or right; see :mod:`pyengine.models.sites`):
            every real position equals a separate run of its sequence.
        token_type_ids : array_like of int, optional
            BERT segment ids (default 0), the shape of the ids.
        final_norm : bool
            False (default): every state is a residual stream; the last one is *before* the
            final norm (apply it with :meth:`apply_final_norm`). True: the last state is
            after the final norm, as transformers' ``output_hidden_states`` gives it (the
            others are unchanged; a stack without a final norm is unchanged).

        Returns
        -------
        ndarray, (n_layers + 1, T, d_model) or (n_layers + 1, B, T, d_model)
            Index 0 is the input after learned/sinusoidal positions are added
            (and the embedding norm applied, if ``embed_norm``: BERT); index k
            the stream after block k (post-LN: after the block's last norm).
            The final norm is applied to the last state only with ``final_norm=True``.

        Raises
        ------
        TypeError, ValueError
            Wrong dtype or shape, NaN/Inf input, more tokens than max_seq_len
            (learned positions; rotary positions warn), ids out of range, float ids
            that cannot be a residual stream.
        """
        if not isinstance(final_norm, (bool, np.bool_)):
            raise TypeError(f"final_norm must be True or False; got {final_norm!r}")
        out = self.forward(input_ids, dtype, attention_mask=attention_mask, token_type_ids=token_type_ids)[0]
        if final_norm and self._config.final_norm:
            out[-1] = self.apply_final_norm(out[-1])
        return out

    def forward(self, input_ids: Any, dtype: Any = None, *, cache_from: int | None = None, attention_mask: Any = None,
                token_type_ids: Any = None) -> tuple[np.ndarray, list[BlockCache]]:
        """:meth:`hidden_states`, and the block caches of the run for analyses that linearize at it.

        Parameters
        ----------
        input_ids, dtype, attention_mask, token_type_ids
            As :meth:`hidden_states`.
        cache_from : int, optional
            Keep the :class:`BlockCache` of blocks ``cache_from`` .. n_layers - 1 (a block
            index; negative counts from the end). Needs one sequence: ids (T,) or a float
            stream (T, d_model). Default: keep none.

        Returns
        -------
        hidden : ndarray, (n_layers + 1, T, d_model) or (n_layers + 1, B, T, d_model)
            As :meth:`hidden_states`; read-only when caches are kept (they refer to it).
        caches : list of BlockCache
            ``caches[i]`` is block ``cache_from + i`` at its input ``hidden[cache_from + i]``.
        """
        first = None if cache_from is None else _v.index_of(
            "cache_from", cache_from, self._config.n_layers, "a block index", negative=True)
        out, batched, ctx, kept = self._run(input_ids, dtype, attention_mask, token_type_ids, first=first)
        if first is None:
            return (out if batched else out[:, 0]), []
        out.flags.writeable = False
        return out[:, 0], [BlockCache(self, first + i, out[first + i, 0], _blocks.for_block(ctx, first + i), d)
                           for i, d in enumerate(kept)]

    def block_forward(self, k: int, h: Any, return_cache: bool = False, *, past: BlockCache | None = None) -> Any:
        """Block k applied to the stream ``h`` (T, d_model) or (B, T, d_model), in h's dtype.

        Positions other than rotary are not added here (they enter before block 0).

        Parameters
        ----------
        k : int
            Block index.
        h : array_like, (T, d_model) or (B, T, d_model), float32 or float64
        return_cache : bool
            Also return the :class:`BlockCache` (for (T, d_model) input only), with which
            :meth:`block_jvp` skips the forward.
        past : BlockCache, optional
            Block k of this stack at a base sequence of T tokens. ``h`` then holds only
            the last T' <= T rows, (T', d_model) or (B, T', d_model), of sequences equal
            to the base before them (T' < T needs a causal stack): the earlier rows cannot
            change, their keys and values come from ``past``, and only the T' rows are
            computed and returned. h must have past's dtype.

        Returns
        -------
        ndarray of h's shape, or ``(out, cache)`` if ``return_cache``.
        """
        k = self.block_index(k)
        x, batched = self.as_stream(h)
        if return_cache and batched:
            raise ValueError("return_cache needs h of shape (T, d_model): a JVP linearizes at one sequence")
        w = self._params(x.dtype)[0][k]
        data: dict[str, Any] = {} if return_cache else {_fast.DISCARD: True}
        if past is None:
            ctx = _blocks.make_context(self._config, x.shape[1], x.dtype, block=k)
        else:
            self._owns(past, k, "past")
            if return_cache:
                raise ValueError("return_cache needs a whole sequence; it does not go with past")
            T, n = past.h.shape[0], x.shape[1]
            if x.dtype != past.h.dtype or n > T:
                raise ValueError(f"with past (T = {T}, {past.h.dtype}) h must have shape (T', d_model) or "
                                 f"(B, T', d_model), T' <= {T}, and dtype {past.h.dtype}; got {x.shape} {x.dtype}")
            if n < T and not self._config.causal:
                raise ValueError("past with fewer rows than its sequence needs a causal stack")
            ctx = _blocks.make_context(self._config, T, x.dtype, T - n, block=k)
            data["attn.past"] = past.data
        out = _blocks.block_forward(w, ctx, x, data)
        out = out if batched else out[0]
        if not return_cache:
            return out
        base = x[0].copy()
        base.flags.writeable = False
        return out, BlockCache(self, k, base, ctx, data)

    def _embed_input(self, x: Any, dtype: Any, attention_mask: Any, token_type_ids: Any
                     ) -> tuple[np.ndarray, bool, np.ndarray | None, np.ndarray | None]:
        """Checked input as (B, T, d) embeddings (no positions), batched?, positions, key mask."""
        x = as_input(x)
        ids = None
        if np.asarray(x).dtype.kind in "iu":
            ids = np.asarray(x)
            emb = self.embed(ids, dtype, token_type_ids)
            h, batched = (emb if emb.ndim == 3 else emb[None]), emb.ndim == 3
        else:
            check_not_float_ids(np.asarray(x), self.config.d_model)
            h, batched = self.as_stream(x, "input_ids", dtype)
        if ids is None and token_type_ids is not None:
            raise ValueError("token_type_ids go with token ids, not with a float residual stream")
        B, T = h.shape[:2]
        pos, mask = (None, None) if attention_mask is None else padding(attention_mask, (B, T) if batched else (T,))
        return h, batched, pos, mask

    def _token_types(self, emb: np.ndarray, token_type_ids: Any) -> np.ndarray:
        """Token embeddings (..., T, d) plus the token-type rows (BERT; HF order: word + type)."""
        table = getattr(self, "token_type_embeddings", None)
        if table is None:
            if token_type_ids is not None:
                raise ValueError("token_type_ids: this stack has no token-type embedding")
            return emb
        if token_type_ids is None:
            return emb + table[0].astype(emb.dtype, copy=False)
        tt = np.asarray(as_input(token_type_ids, "token_type_ids"))
        if tt.dtype.kind not in "iu" or tt.shape != emb.shape[:-1]:
            raise ValueError(f"token_type_ids must be integers of the ids' shape {emb.shape[:-1]}; "
                             f"got {tt.dtype} {tt.shape}")
        if tt.size and (tt.min() < 0 or tt.max() >= table.shape[0]):
            raise ValueError(f"token_type_ids must lie in [0, {table.shape[0]})")
        return emb + table.astype(emb.dtype, copy=False)[tt]

    def _run(self, x: Any, dtype: Any = None, attention_mask: Any = None, token_type_ids: Any = None,
             hooks: _Hooks | None = None, first: int | None = None, pre: tuple | None = None
             ) -> tuple[np.ndarray, bool, Any, list[dict]]:
        """The forward of every entry point: (L+1, B, T, d) states, batched?, context, kept block data.

        ``pre``: the result of :meth:`_embed_input` when the caller checked the input already.
        """
        cfg = self.config
        h, batched, pos, mask = pre if pre is not None else self._embed_input(x, dtype, attention_mask, token_type_ids)
        if first is not None and (batched or mask is not None):
            raise ValueError("input_ids must be one sequence (T,) of ids or (T, d_model) floats, without "
                             "attention_mask, to keep block caches (strip the padding: unpad())")
        B, T = h.shape[:2]
        blocks, glob = self._params(h.dtype)
        hk = hooks if hooks is not None and hooks.active else None
        if hk is not None:
            h = hk.at("embed", h)
        out = np.empty((cfg.n_layers + 1,) + h.shape, h.dtype)
        if cfg.positions == "rotary" and T > cfg.max_seq_len:
            warnings.warn(f"input_ids has T = {T} tokens, more than max_seq_len = {cfg.max_seq_len} positions the "
                          "model was made for; rotary angles are computed for every position, but the model may "
                          "not be reliable there", UserWarning, stacklevel=3)
        if cfg.positions in ("learned", "sinusoidal"):
            n = T if pos is None else int(pos.max()) + 1
            if cfg.positions == "learned" and n > cfg.max_seq_len:
                raise ValueError(f"input_ids has T = {n} tokens, more than max_seq_len = {cfg.max_seq_len} learned positions")
            table = (glob["embed.positions"] if cfg.positions == "learned"
                     else _blocks.sinusoidal_positions(n, cfg.d_model, h.dtype))
            np.add(h, table[:T] if pos is None else table[pos], out=out[0])
        else:
            out[0] = h
        if cfg.embed_norm:
            e = out[0] if hk is None else hk.at("embed.norm.input", out[0])
            e = self._norm(glob, "embed.norm", e)
            out[0] = e if hk is None else hk.at("embed.norm.output", e)
        ctx = _blocks.make_context(cfg, T, h.dtype)
        if mask is not None:
            ctx = padded_context(ctx, pos, mask, h.dtype)
        kept: list[dict[str, Any]] = []
        for k in range(cfg.n_layers):
            # Blocks whose data nobody keeps may skip what only a JVP needs (the fused float32 head).
            data: dict[str, Any] = {} if first is not None and k >= first else {_fast.DISCARD: True}
            bh = None if hk is None else hk.block(k)
            if bh is not None:
                out[k] = bh("resid_pre", out[k])
            c = _blocks.for_block(ctx, k)
            y = _blocks.block_forward(blocks[k], c if bh is None else c._replace(hook=bh), out[k], data)
            out[k + 1] = y if bh is None else bh("resid_post", y)
            if first is not None and k >= first:
                kept.append(data)
        if hk is not None and any(n.startswith("final_norm.") for n in hk.want):
            hk.at("final_norm.output", self._norm(glob, "final_norm", hk.at("final_norm.input", out[-1])))
        return out, batched, ctx, kept

    # ------------------------------------------------------------------ norms and files

    def _norm(self, glob: dict[str, np.ndarray], name: str, x: np.ndarray) -> np.ndarray:
        """The global norm ``name`` ("final_norm", "embed.norm") of x in x's dtype (weights from ``glob``)."""
        if self._config.norm == "layernorm":
            return layer_norm(x, glob[name + ".gamma"], glob[name + ".beta"], self._config.eps)
        return rms_norm(x, glob[name + ".gamma"], self._config.eps)

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
