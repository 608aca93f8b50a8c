"""Named activation sites of a :class:`~pyengine.Stack`, ``run_with_cache``, ``run`` and padded batches.

One naming scheme for every Stack (synthetic and pretrained). ``k`` is a block index
(0 .. n_layers - 1). Shapes are for a batch (B, T); a single sequence drops the B axis.

====================================  ===================  ==========================================
site                                  shape                what it is
====================================  ===================  ==========================================
``embed``                             (B, T, d)            token embedding (+ BERT token type), before positions
``embed.norm.input|scale|output``     (B,T,d) (B,T) (B,T,d)  BERT's embedding norm (``embed_norm`` only)
``blocks.k.resid_pre``                (B, T, d)            input of block k = ``hidden_states()[k]``
``blocks.k.norm1.input``              (B, T, d)            input of the first norm (pre-LN: = resid_pre)
``blocks.k.norm1.scale``              (B, T)               1/sigma of that input (read only)
``blocks.k.norm1.output``             (B, T, d)            the norm's output (gamma, beta applied)
``blocks.k.attn.q``                   (B, T, H, dh)        queries after rotary, before 1/sqrt(dh)
``blocks.k.attn.k|v``                 (B, T, Hkv, dh)      keys (after rotary) and values
``blocks.k.attn.scores``              (B, H, T, T)         q.k/sqrt(dh) (soft-capped if attn_softcap), before the masks
``blocks.k.attn.pattern``             (B, H, T, T)         softmax of the masked scores
``blocks.k.attn.head_out``            (B, T, H, dh)        per-head outputs P V (input of w_o)
``blocks.k.attn.result``              (B, T, H, d)         each head's contribution after w_o (no bias)
``blocks.k.attn.out``                 (B, T, d)            attention sublayer output (after w_o, bias)
``blocks.k.norm1_out.input|scale|output``                  the norm of attn.out (placement "peri" only)
``blocks.k.resid_mid``                (B, T, d)            between the sublayers (sequential layout only)
``blocks.k.norm2.input|scale|output``                      the second norm (sequential and parallel2 layouts)
``blocks.k.mlp.pre``                  (B, T, n_in)         MLP pre-activation (gated: [gate, up], n_in = 2 d_mlp)
``blocks.k.mlp.hidden``               (B, T, d_mlp)        MLP activation (gated: act(gate) * up)
``blocks.k.mlp.out``                  (B, T, d)            MLP sublayer output (after w_out, bias)
``blocks.k.norm2_out.input|scale|output``                  the norm of mlp.out (placement "peri" only)
``blocks.k.resid_post``               (B, T, d)            output of block k = ``hidden_states()[k + 1]``
``final_norm.input|scale|output``                          the final norm (``final_norm`` only; read only)
====================================  ===================  ==========================================

Identities: pre-LN ``resid_mid`` = ``norm2.input``, ``norm1.input`` = ``resid_pre``;
post-LN ``resid_mid`` = ``norm1.output`` and ``resid_post`` = ``norm2.output``.
The sites are what the block forward computes (``_blocks.site`` hook points): nothing is
recomputed except the ``*.scale`` sites (1/sqrt(var + eps), RMSNorm 1/sqrt(mean x^2 + eps),
from the captured input, in the compute dtype), the ``final_norm`` sites and ``attn.result``
(``head_out`` through each head's rows of w_o). TransformerLens hook names are aliases
(:mod:`pyengine.models.tl_names`; docs/guide/sites.md has the table).

Memory: :meth:`Sites.run_with_cache` keeps a copy of each site asked for, nothing
else: B*T*d values per residual-type site, B*T*H*d per ``attn.result``, B*H*T^2 per
``scores``/``pattern``, B*T*d_mlp per ``mlp.pre``/``mlp.hidden``; ``sites="*"`` on all L
blocks costs about L*((15 + H) d + 3 d_mlp + 2 H T) B*T values. :meth:`Sites.site_names` lists the sites of a stack; patterns are ``fnmatch`` globs.

Padded batches: ``attention_mask`` (B, T) (1 = real token, 0 = padding; each row's real
tokens one contiguous run, i.e. left or right padding) masks padding keys and gives each
real token its position among the real ones, so every real position equals a separate
run of that sequence (to rounding). Values at padding positions are finite but
meaningless. Analyses that linearize at one sequence (``forward(cache_from=)``,
``propagate``) take one sequence: :meth:`Sites.unpad` splits a padded batch into them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _blocks
from ._attention import softcap_
from .. import _validate as _v
from ._stacklike import StackLike
from .activation_cache import ActivationCache
from .interventions import Intervention, hook_interventions, parse_interventions
from .tl_names import canonical, unknown_hint

__all__ = ["Sites", "as_input", "block_site_names", "match_sites", "padded_context", "padding"]

_BLOCK = ("resid_pre", "norm1.input", "norm1.scale", "norm1.output", "attn.q", "attn.k", "attn.v",
          "attn.scores", "attn.pattern", "attn.head_out", "attn.result", "attn.out", "resid_mid",
          "norm2.input", "norm2.scale", "norm2.output", "mlp.pre", "mlp.hidden", "mlp.out", "resid_post")
_NORM = ("input", "scale", "output")


def match_sites(names: list[str], sites: Any, no_match: Callable[[str], str]) -> list[str]:
    """The names of ``names`` that the site names or globs ``sites`` (a str or a list) match,
    in the order of the patterns, each once; TransformerLens names are accepted
    (:mod:`pyengine.models.tl_names`). A pattern that is not a str is a TypeError, and one
    that matches nothing a ValueError: ``no_match(pattern)`` and the closest valid names."""
    pats = [sites] if isinstance(sites, str) else list(sites)
    out: list[str] = []
    for p in pats:
        if not isinstance(p, str):
            raise TypeError(f"sites must be site names or globs (str); got {type(p).__name__}")
        c = canonical(p)
        hit = [n for n in names if fnmatch.fnmatchcase(n, c)]
        if not hit:
            raise ValueError(no_match(p) + unknown_hint(p, c, names))
        out += [n for n in hit if n not in out]
    return out


def block_site_names(cfg: Any) -> tuple[str, ...]:
    """The per-block site names (without ``blocks.<k>.``) of a config."""
    if cfg.placement == "peri":  # sequential; each sublayer's output normed before the residual add
        i, j = _BLOCK.index("attn.out") + 1, _BLOCK.index("mlp.out") + 1
        return (_BLOCK[:i] + tuple(f"norm1_out.{n}" for n in _NORM) + _BLOCK[i:j]
                + tuple(f"norm2_out.{n}" for n in _NORM) + _BLOCK[j:])
    if cfg.layout == "sequential":
        return _BLOCK
    if cfg.layout == "parallel2":  # GPT-NeoX: two norms of the same input, no stream between sublayers
        return tuple(n for n in _BLOCK if n != "resid_mid")
    return tuple(n for n in _BLOCK if n != "resid_mid" and not n.startswith("norm2"))


def as_input(x: Any, name: str = "input_ids") -> Any:
    """``x`` as NumPy sees it: ndarrays and ``__array__`` objects as they are (zero-copy
    where NumPy can), DLPack producers through ``np.from_dlpack``; TypeError for text.

    A torch tensor is read without importing torch: one that requires grad is detached
    (the graph is not followed), one on another device is copied to the host, and float16
    or bfloat16 values are widened to float32 exactly; then it is shared through DLPack.
    NumPy float16 and (ml_dtypes) bfloat16 arrays are widened to float32 exactly too.
    """
    if isinstance(x, (str, bytes)) or (isinstance(x, (list, tuple)) and x and isinstance(x[0], str)):
        raise TypeError(f"{name} must be integer token ids or a float residual stream, not text; "
                        "tokenize first: model.tokenize(text)")
    if type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach") and hasattr(x, "__dlpack__"):
        t = x.detach()
        t = t if str(t.device) == "cpu" else t.cpu()
        if str(t.dtype) in ("torch.bfloat16", "torch.float16"):
            t = t.float()
        return np.from_dlpack(t)
    if not isinstance(x, np.ndarray) and not hasattr(x, "__array__") and hasattr(x, "__dlpack__"):
        return np.from_dlpack(x)
    return _v.widened(x)


def check_not_float_ids(x: np.ndarray, d_model: int, shapes: str = "(T, {d}) or (B, T, {d})") -> None:
    """ValueError for a float ``input_ids`` that cannot be a residual stream of ``shapes``:
    float token ids are not taken for anything else."""
    stream = x.ndim >= 1 and x.shape[-1] == d_model and (x.ndim in (2, 3) or "..." in shapes)
    if x.dtype.kind == "f" and not stream:
        raise ValueError(f"input_ids must have shape {shapes.format(d=d_model)} as a float residual stream (passed "
                         f"as input_ids), or be integer token ids; got a {x.dtype} array of shape {x.shape} "
                         "(cast token ids with .astype(np.int64))")


def _scale(kind: str, x: np.ndarray, eps: float) -> np.ndarray:
    if kind == "layernorm":
        return 1.0 / np.sqrt(x.var(axis=-1) + x.dtype.type(eps))
    return 1.0 / np.sqrt(np.mean(x * x, axis=-1) + x.dtype.type(eps))


def _check_mask(mask: Any, shape: tuple[int, ...]) -> np.ndarray:
    m = np.asarray(as_input(mask, "attention_mask"))
    if m.shape != shape:
        raise ValueError(f"attention_mask must have the shape of the ids, {shape}; got {m.shape}")
    if m.dtype != bool:
        if m.dtype.kind not in "iuf" or not np.isin(m, (0, 1)).all():
            raise ValueError("attention_mask must hold 0 (padding) and 1 (real token) only")
        m = m.astype(bool)
    m2 = m.reshape(-1, shape[-1])
    n = m2.sum(axis=1)
    if (n == 0).any():
        raise ValueError(f"attention_mask row {int(np.argmin(n))} has no real token")
    first = np.argmax(m2, axis=1)
    if not all(m2[i, first[i]: first[i] + n[i]].all() for i in range(m2.shape[0])):
        raise ValueError("attention_mask: each row's real tokens must be one contiguous run (left or right padding)")
    return m2


def padding(attention_mask: Any, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Each token's position among the real ones, (B, T) int, and the checked mask, (B, T) bool."""
    m = _check_mask(attention_mask, shape)
    return np.maximum(np.cumsum(m, axis=1) - 1, 0), m


def padded_context(ctx: Any, pos: np.ndarray, mask: np.ndarray, dtype: np.dtype) -> Any:
    """A block context for a padded batch: padding keys masked, rotary tables at the positions ``pos``."""
    cfg = ctx.cfg
    ctx = ctx._replace(key_mask=~mask[:, None, None, None, :])
    if cfg.positions == "rotary":
        cos, sin = (t[pos][:, None] for t in _blocks.rotary_tables(cfg, mask.shape[1], dtype))
        scale = cfg.score_scale
        ctx = ctx._replace(rope_q=(cos * scale, sin * scale), rope_k=(cos, sin))
    return ctx


class _Hooks:
    """Interventions and recording at the sites, for one run."""

    def __init__(self, stack: Any, want: set[str], ivs: dict[str, list[Intervention]]) -> None:
        self.stack, self.want, self.ivs, self.got = stack, want, ivs, {}
        self.active = bool(want or ivs)

    def at(self, name: str, x: np.ndarray) -> np.ndarray:
        for iv in self.ivs.get(name, ()):
            x = iv.apply(x, name)
        if name in self.want:
            self.got[name] = np.array(x)
        if name.endswith(".input"):
            sname = name[: -len("input")] + "scale"
            if sname in self.want:
                self.got[sname] = _scale(self.stack.config.norm, x, self.stack.config.eps)
        return x

    def block(self, k: int) -> Callable[[str, np.ndarray], np.ndarray] | None:
        pre = f"blocks.{k}."
        if not any(n.startswith(pre) for n in self.want) and not any(n.startswith(pre) for n in self.ivs):
            return None
        return _BlockHook(self, pre)


#: Sites inside the attention heads: only the unfused products expose them.
_HEAD_SITES = ("attn.q", "attn.k", "attn.v", "attn.scores", "attn.pattern", "attn.head_out", "attn.result")
#: Sites wider than d_model or split by head: no logit lens.
_NOT_STREAM = _HEAD_SITES + ("mlp.pre", "mlp.hidden")


class _BlockHook:
    """The hook of one block: ``hook(name, x)``. ``heads``: a site inside the attention heads is
    read or changed; ``heads_changed``: changed by an intervention, so attention must run
    unfused (models/_attention.py); reading alone keeps the forward's own (fused) output.
    ``wants(name)``: the site is read or changed (sites that cost extra work ask first)."""

    def __init__(self, hooks: _Hooks, pre: str) -> None:
        self.hooks, self.pre = hooks, pre
        self.heads = any(self.wants(n) for n in _HEAD_SITES)
        self.heads_changed = any(pre + n in hooks.ivs for n in _HEAD_SITES)

    def wants(self, name: str) -> bool:
        return self.pre + name in self.hooks.want or self.pre + name in self.hooks.ivs

    def __call__(self, name: str, x: np.ndarray) -> np.ndarray:
        return self.hooks.at(self.pre + name, x)


class Sites:
    """Sites, caching, interventions, padding, read-out (logits, logit lens): a base class of
    :class:`~pyengine.Stack` (``self`` is typed by :class:`~pyengine.models._stacklike.StackLike`)."""

    def site_names(self: StackLike) -> list[str]:
        """Every site name of this stack, in forward order (see the module's table)."""
        cfg = self.config
        out = ["embed"] + ([f"embed.norm.{n}" for n in _NORM] if cfg.embed_norm else [])
        for k in range(cfg.n_layers):
            out += [f"blocks.{k}.{n}" for n in block_site_names(cfg)]
        return out + ([f"final_norm.{n}" for n in _NORM] if cfg.final_norm else [])

    def _match_sites(self: StackLike, sites: Any) -> list[str]:
        return match_sites(self.site_names(), sites,
                           lambda p: f"sites: {p!r} matches no site of this stack (see site_names(); e.g. "
                                     f"'blocks.0.resid_mid', 'blocks.*.attn.pattern').")

    def _prepare(self: StackLike, x: Any, sites: Any, interventions: Any, dtype: Any, attention_mask: Any,
                 token_type_ids: Any) -> tuple[_Hooks, tuple]:
        """Every argument checked (input, mask, sites, interventions) before any forward."""
        pre = self._embed_input(x, dtype, attention_mask, token_type_ids)
        want = set(self._match_sites(sites)) if sites is not None else set()
        B, T = pre[0].shape[:2]
        return _Hooks(self, want, parse_interventions(self, interventions, B, T)), pre

    def run_with_cache(self: StackLike, input_ids: Any, sites: Any = "*", *, attention_mask: Any = None,
                       token_type_ids: Any = None, dtype: Any = None, interventions: Any = None
                       ) -> tuple[np.ndarray, ActivationCache]:
        """The model's output and the activations at ``sites`` (names or globs; default all).

        Returns ``(out, cache)``. ``out``: the logits (B, T, vocab_size) (as :meth:`logits`)
        when the stack has a language-model head; for an encoder without one
        (``config.lm_head == "none"``), the last hidden state (B, T, d_model)
        (``hidden_states()[-1]``). ``cache``: an :class:`ActivationCache` site -> array (the
        module's table; no batch axis for one sequence), copies, only the sites asked for;
        lookups also take TransformerLens names, and ``cache.stack("blocks.*.resid_post")``
        stacks sites in block order. ``sites`` may be TransformerLens names too.
        ``interventions`` as in :meth:`run` (the cache then holds the changed values). Every
        argument is checked before the forward runs.
        """
        hooks, pre = self._prepare(input_ids, sites, interventions, dtype, attention_mask, token_type_ids)
        out, batched, _, _ = self._run(input_ids, hooks=hooks, pre=pre)
        order = {n: i for i, n in enumerate(self.site_names())}
        cache = {n: (a if batched else a[0]) for n, a in sorted(hooks.got.items(), key=lambda kv: order[kv[0]])}
        return self._output(out[-1] if batched else out[-1, 0]), ActivationCache(cache)

    def run(self: StackLike, input_ids: Any, interventions: Any = None, *, attention_mask: Any = None,
            token_type_ids: Any = None, dtype: Any = None) -> np.ndarray:
        """The forward with interventions (see :mod:`pyengine.models.interventions`).

        Returns the logits (T, vocab_size) or (B, T, vocab_size) (as :meth:`logits`); for an
        encoder without a language-model head, the last hidden state (T, d_model) or
        (B, T, d_model).
        """
        hooks, pre = self._prepare(input_ids, None, interventions, dtype, attention_mask, token_type_ids)
        out, batched, _, _ = self._run(input_ids, hooks=hooks, pre=pre)
        return self._output(out[-1] if batched else out[-1, 0])

    def run_with_hooks(self: StackLike, input_ids: Any, fwd_hooks: Any = (), *, attention_mask: Any = None,
                       token_type_ids: Any = None, dtype: Any = None) -> np.ndarray:
        """The forward with TransformerLens-style hook functions: :meth:`run` with one
        callable intervention per hook (:func:`~pyengine.models.interventions.hook_interventions`).

        Parameters
        ----------
        input_ids : array_like, (T,) or (B, T) int, or a float residual stream
            As in :meth:`run`.
        fwd_hooks : sequence of (name, fn)
            ``name``: a site name or glob, pyengine's (``blocks.2.attn.pattern``) or
            TransformerLens's (``blocks.2.attn.hook_pattern``), or a predicate on names;
            ``fn(activation, hook)``: ``activation`` a copy of the site's array with the batch
            axis first (B, ...) even for one sequence, ``hook`` a
            :class:`~pyengine.models.interventions.HookPoint` (``hook.name``, ``hook.layer()``);
            it returns the replacement (same shape) or None (keeping the copy, which it may
            have changed in place). Hooks run in the order given. Read-only sites
            (``*.scale``, ``final_norm.*``) are refused.
        attention_mask, token_type_ids, dtype
            As in :meth:`run`.

        Returns
        -------
        ndarray
            As :meth:`run`: the logits (T, vocab_size) or (B, T, vocab_size), or without a
            language-model head the last hidden state (T, d_model) or (B, T, d_model).
        """
        return self.run(input_ids, hook_interventions(self, fwd_hooks), attention_mask=attention_mask,
                        token_type_ids=token_type_ids, dtype=dtype)

    def _output(self: StackLike, h: np.ndarray) -> np.ndarray:
        """The logits of the last hidden state ``h``, or ``h`` itself without an LM head."""
        return h if self._config.lm_head == "none" else self._read_out(h)

    def _read_out(self: StackLike, h: np.ndarray) -> np.ndarray:
        """Final norm (if any) and the read-out ``@ W.T`` of a stream (..., d_model), in h's dtype."""
        cfg = self._config
        glob = self._params(h.dtype)[1]
        if cfg.final_norm:
            h = self._norm(glob, "final_norm", h)
        w = glob["lm_head.weight" if cfg.lm_head == "separate" else "embed.tokens"]
        out = h.reshape(-1, cfg.d_model) @ w.T
        if cfg.logit_softcap:  # Gemma 2: cap * tanh(logits / cap)
            softcap_(out, cfg.logit_softcap)
        return out.reshape(h.shape[:-1] + (cfg.vocab_size,))

    def unpad(self, input_ids: Any, attention_mask: Any) -> list[np.ndarray]:
        """The real tokens of each row of a padded batch (B, T) (or (B, T, d) streams)."""
        x = np.asarray(as_input(input_ids))
        if x.ndim < 2:
            raise ValueError(f"input_ids must be a batch (B, T) or (B, T, d); got shape {x.shape}")
        m = _check_mask(attention_mask, x.shape[:2])
        return [x[i][m[i]] for i in range(x.shape[0])]

    def apply_final_norm(self: StackLike, h: Any) -> np.ndarray:
        """The final norm (gamma scaled by gamma_scale) of a stream (..., d_model), in h's dtype."""
        if not self._config.final_norm:
            raise ValueError("this stack has no final norm (config.final_norm is False)")
        x = _v.float_array("h", h)
        if x.ndim < 1 or x.shape[-1] != self._config.d_model:
            raise ValueError(f"h must have shape (..., {self._config.d_model}); got {x.shape}")
        return self._norm(self._params(x.dtype)[1], "final_norm", x)

    def logits(self: StackLike, input_ids: Any, dtype: Any = None, *, interventions: Any = None,
               attention_mask: Any = None, token_type_ids: Any = None) -> np.ndarray:
        """Language-model logits: the final norm (if any), then the read-out ``@ W.T``.

        Parameters
        ----------
        input_ids : array_like
            Integer token ids (T,) or (B, T): the whole stack runs first and its last
            hidden state is read out. Or a float residual stream (..., d_model),
            read out as it is (final norm, then W: the "logit lens" of any layer).
        dtype : {None, float32, float64}
            Compute dtype; default the input's dtype (float input) or the stack's (ids).
        interventions : optional
            As in :meth:`run` (token ids only).
        attention_mask, token_type_ids : array_like (B, T), optional
            As in :meth:`hidden_states` (token ids only).

        Returns
        -------
        ndarray, (T, vocab_size), (B, T, vocab_size) or (..., vocab_size)
            W is ``lm_head.weight`` (lm_head "separate") or ``embed.tokens`` ("tied").

        Raises
        ------
        ValueError
            If the stack has no language-model head (config.lm_head == "none"), for
            interventions or a mask with a float stream, and for the input errors of
            :meth:`hidden_states`.
        """
        cfg = self._config
        if cfg.lm_head == "none":
            raise ValueError("this stack has no language-model head (config.lm_head is 'none')")
        x = as_input(input_ids)
        if np.asarray(x).dtype.kind in "iu":
            return self.run(x, interventions, attention_mask=attention_mask, token_type_ids=token_type_ids,
                            dtype=dtype)
        if interventions is not None or attention_mask is not None or token_type_ids is not None:
            raise ValueError("interventions, attention_mask and token_type_ids go with token ids; a float "
                             "input_ids is a residual stream read out as it is")
        check_not_float_ids(np.asarray(x), cfg.d_model, "(..., {d})")
        h = _v.float_array("input_ids", x)
        if h.ndim < 1 or h.shape[-1] != cfg.d_model:
            raise ValueError(f"input_ids must have shape (..., {cfg.d_model}) (or be integer token ids); got {h.shape}")
        h = np.ascontiguousarray(h, dtype=h.dtype if dtype is None else _v.float_dtype("dtype", dtype))
        _v.finite("input_ids", h)
        return self._read_out(h)

    def logit_lens(self: StackLike, input_ids: Any, sites: Any = "blocks.*.resid_post", *, attention_mask: Any = None,
                   dtype: Any = None) -> Any:
        """Final norm + read-out of a residual stream (the "logit lens").

        A float array (..., d_model) is read out as it is (one array back); token ids run
        the stack and every residual-type site matched by ``sites`` is read out (a dict
        site -> (T, vocab) or (B, T, vocab)). ValueError without an LM head.
        """
        if self.config.lm_head == "none":
            raise ValueError("this stack has no language-model head (config.lm_head is 'none')")
        x = as_input(input_ids)
        if np.asarray(x).dtype.kind not in "iu":
            return self.logits(x, dtype)
        names = [n for n in self._match_sites(sites) if n.rsplit(".", 1)[-1] not in ("scale",)
                 and not n.endswith(_NOT_STREAM)]
        if not names:
            raise ValueError(f"sites: {sites!r} matches no residual-type site (d_model wide)")
        _, cache = self.run_with_cache(x, names, attention_mask=attention_mask, dtype=dtype)
        return {n: self.logits(a) for n, a in cache.items()}
