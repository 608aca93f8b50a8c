"""Interventions at named activation sites: add, replace, scale or zero, or any callable.

Design. An :class:`Intervention` names one site (see :mod:`pyengine.models.sites`), an
operation and where: ``positions`` (token rows; int, slice or sequence, default all)
and, on the per-head sites (``attn.scores``, ``attn.pattern``, ``attn.q|k|v``,
``attn.head_out``, ``attn.result``), ``heads``. TransformerLens names are accepted
(:mod:`pyengine.models.tl_names`). The forward hands the site's array (batch axis first) to the intervention,
which returns a changed copy that the rest of the forward uses: so an intervention at
``blocks.2.resid_pre`` changes block 2's input and everything after, one at
``blocks.2.attn.pattern`` the mixing of block 2's values. Several interventions run in
the order given. ``value`` broadcasts against the selected part, shape
(B, P, ...) with P the number of positions (heads selected: (B, H', P, ...) or
(B, P, H', ...) in the site's axis order), so a (d,) vector is added at every selected
position of every sequence.

Batched like ``propagate``: to run K perturbations of one sequence at once, tile the ids
to (K, T) (``np.broadcast_to(ids, (K, T))``) and give the value a leading K axis, e.g.
``Intervention("blocks.2.resid_pre", "add", deltas[:, None, :], positions=span)``.

``op`` may also be a callable ``f(x, site) -> array | None``: it gets a copy of the
site's array (batch axis first) and returns the replacement (or changes the copy and
returns None). Head ablation is one line: ``model.run(ids, [ablate_head(3, 5)])``.

Sites that are read only: ``*.scale`` and ``final_norm.*``. Arguments are checked
(site, op, positions and heads in range, value shape and finiteness) before the forward.

TransformerLens's ``run_with_hooks(ids, fwd_hooks=[(name, fn), ...])`` is built on the same
machinery: :func:`hook_interventions` turns each pair into one callable intervention per
matched site, calling ``fn(activation, hook)`` with a :class:`HookPoint` (``hook.name``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .. import _validate as _v
from .config import GATED
from .tl_names import canonical, did_you_mean, tl_name, unknown_hint

__all__ = ["OPS", "HookPoint", "Intervention", "ablate_head", "hook_interventions", "parse_interventions"]

OPS = ("add", "replace", "scale", "zero")


@dataclasses.dataclass(frozen=True, eq=False)
class Intervention:
    """Change the activation at ``site`` (a name or glob) in the forward pass."""

    site: str
    op: str | Callable[[np.ndarray, str], Any]
    value: Any = None
    positions: Any = None
    heads: Any = None

    def apply(self, x: np.ndarray, site: str) -> np.ndarray:
        """A changed copy of the site's array x (batch axis first)."""
        y = np.array(x)
        if callable(self.op):
            r = self.op(y, site)
            if r is not None:
                r = np.asarray(r)
                if r.shape != x.shape:
                    raise ValueError(f"intervention at {site!r}: the callable returned shape {r.shape}, "
                                     f"the site has {x.shape}")
                y = np.array(r, dtype=x.dtype)
            if not np.isfinite(y).all() and np.isfinite(x).all():
                raise ValueError(f"intervention at {site!r}: the callable returned NaN or Inf")
            return y
        ix = _index(site, y.shape, self.positions, self.heads)
        value = _v.widened(np.asarray(self.value))  # float16, bfloat16: exactly as float32
        if self.op == "zero":
            y[ix] = 0
        elif self.op == "replace":
            y[ix] = value
        elif self.op == "add":
            y[ix] += value.astype(y.dtype, copy=False)
        else:
            y[ix] *= value.astype(y.dtype, copy=False)
        return y


def ablate_head(block: int, head: Any) -> Intervention:
    """Zero the output of attention head(s) ``head`` of block ``block`` (before ``w_o``)."""
    return Intervention(f"blocks.{block}.attn.head_out", "zero", heads=head)


#: The per-head sites laid out (B, T, H, ...).
_TOKEN_HEAD = ("attn.q", "attn.k", "attn.v", "attn.head_out", "attn.result")


def _axes(site: str) -> tuple[int, int | None]:
    """(position axis, head axis) of a site's array (batch axis first)."""
    if site.endswith(("attn.scores", "attn.pattern")):
        return 2, 1
    if site.endswith(_TOKEN_HEAD):
        return 1, 2
    return 1, None


def _sel(name: str, sel: Any, n: int) -> np.ndarray:
    if sel is None:
        return np.arange(n)
    if isinstance(sel, slice):
        return np.arange(n)[sel]
    a = np.asarray(sel)
    if a.dtype.kind not in "iu" or a.ndim > 1:
        raise TypeError(f"{name} must be an int, a slice or a 1-d sequence of ints; got {sel!r}")
    a = a.reshape(-1)
    if a.size and (a.min() < -n or a.max() >= n):
        raise ValueError(f"{name} must lie in [-{n}, {n}); got {sel!r}")
    return a % n


def _index(site: str, shape: tuple[int, ...], positions: Any, heads: Any) -> tuple[np.ndarray, ...]:
    pa, ha = _axes(site)
    sels = [np.arange(n) for n in shape]
    sels[pa] = _sel("positions", positions, shape[pa])
    if heads is not None:
        if ha is None:
            raise ValueError(f"heads= goes with the per-head sites (attn.scores, attn.pattern, attn.q|k|v, "
                             f"attn.head_out, attn.result), "
                             f"not {site!r}")
        sels[ha] = _sel("heads", heads, shape[ha])
    return np.ix_(*sels)


def _site_shape(stack: Any, site: str, B: int, T: int) -> tuple[int, ...]:
    c = stack.config
    if site.endswith(("attn.scores", "attn.pattern")):
        return (B, c.n_heads, T, T)
    if site.endswith(("attn.q", "attn.head_out")):
        return (B, T, c.n_heads, c.head_dim)
    if site.endswith(("attn.k", "attn.v")):
        return (B, T, c.n_kv_heads, c.head_dim)
    if site.endswith("attn.result"):
        return (B, T, c.n_heads, c.d_model)
    if site.endswith("mlp.hidden"):
        return (B, T, c.d_mlp)
    if site.endswith("mlp.pre"):
        return (B, T, c.d_mlp * (2 if c.activation in GATED else 1))
    return (B, T, c.d_model)


def parse_interventions(stack: Any, interventions: Any, B: int, T: int) -> dict[str, list[Intervention]]:
    """Checked interventions, by concrete site name, for a run on B sequences of T tokens."""
    if interventions is None:
        return {}
    if isinstance(interventions, Intervention):
        items = [interventions]
    elif isinstance(interventions, Mapping):
        items = [Intervention(s, f) for s, f in interventions.items()]
    elif isinstance(interventions, (list, tuple)):
        items = list(interventions)
    else:
        raise TypeError(f"interventions must be an Intervention, a list of them or a dict site -> callable; "
                        f"got {type(interventions).__name__}")
    names, out = stack.site_names(), {}
    for iv in items:
        if not isinstance(iv, Intervention):
            raise TypeError(f"interventions must be Intervention objects (or a dict site -> callable); "
                            f"got {type(iv).__name__}")
        if not callable(iv.op) and iv.op not in OPS:
            raise ValueError(f"intervention op must be one of {', '.join(OPS)} or a callable; got {iv.op!r}")
        site = canonical(iv.site)
        hit = [n for n in names if isinstance(site, str) and fnmatch.fnmatchcase(n, site)]
        if not hit:
            raise ValueError(f"intervention site {iv.site!r} matches no site of this stack (see site_names())."
                             + did_you_mean(iv.site, names))
        for n in hit:
            if n.endswith(".scale") or n.startswith("final_norm."):
                raise ValueError(f"intervention site {n!r} is read only (*.scale and final_norm.* sites)")
            shape = _site_shape(stack, n, B, T)
            ix = _index(n, shape, iv.positions, iv.heads)
            if iv.op in ("add", "replace", "scale"):
                v = _v.widened(np.asarray(iv.value))
                if iv.value is None or v.dtype.kind not in "iuf":
                    raise TypeError(f"intervention at {n!r}: op {iv.op!r} needs a numeric value; got {iv.value!r}")
                if not np.isfinite(v).all():
                    raise ValueError(f"intervention at {n!r}: value holds NaN or Inf")
                sel = tuple(len(i.reshape(-1)) for i in ix)
                try:
                    ok = np.broadcast_shapes(v.shape, sel) == sel
                except ValueError:
                    ok = False
                if not ok:
                    raise ValueError(f"intervention at {n!r}: value of shape {v.shape} does not broadcast to "
                                     f"the selected part {sel}")
            out.setdefault(n, []).append(iv)
    return out


@dataclasses.dataclass(frozen=True)
class HookPoint:
    """The second argument of a :meth:`~pyengine.Stack.run_with_hooks` hook function, as
    TransformerLens's ``hook``: ``name`` is the site's TransformerLens name where the hook
    was named in TransformerLens's terms, else its pyengine name."""

    name: str

    def layer(self) -> int | None:
        """The block index of the site (None outside the blocks)."""
        parts = self.name.split(".")
        return int(parts[1]) if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit() else None


@dataclasses.dataclass(frozen=True)
class _Call:
    """An intervention callable that calls a hook function as TransformerLens does."""

    fn: Callable[[np.ndarray, HookPoint], Any]
    hook: HookPoint

    def __call__(self, x: np.ndarray, site: str) -> Any:
        return self.fn(x, self.hook)


def hook_interventions(stack: Any, fwd_hooks: Any) -> list[Intervention]:
    """``fwd_hooks`` (a sequence of ``(name, fn)`` pairs) as callable interventions, in order.

    ``name`` is a site name or glob, pyengine's or TransformerLens's, or a predicate
    ``name(str) -> bool`` asked of each site's pyengine and TransformerLens names; ``fn(activation,
    hook)`` gets a copy of the site's array (batch axis first) and a :class:`HookPoint`, and
    returns the replacement or None (the copy, changed in place or not, is kept). TypeError or
    ValueError naming ``fwd_hooks[i]`` before any forward.
    """
    if isinstance(fwd_hooks, (str, bytes)) or not isinstance(fwd_hooks, (list, tuple)):
        raise TypeError(f"fwd_hooks must be a list of (name, fn) pairs; got {type(fwd_hooks).__name__}")
    names, out = stack.site_names(), []
    for i, pair in enumerate(fwd_hooks):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise TypeError(f"fwd_hooks[{i}] must be a (name, fn) pair; got {pair!r}")
        name, fn = pair
        if not callable(fn):
            raise TypeError(f"fwd_hooks[{i}]: the hook function must be callable; got {type(fn).__name__}")
        if callable(name):  # (site, the name the hook sees): pyengine's if it matches, else TransformerLens's
            both = [(n, tl_name(n)) for n in names]
            hit = [(n, n) if name(n) else (n, tl) for n, tl in both if name(n) or (tl is not None and name(tl))]
        elif isinstance(name, str):
            site = canonical(name)  # a TransformerLens name (or glob) shows the sites by their TransformerLens names
            hit = [(n, (tl_name(n) or n) if site != name else n) for n in names if fnmatch.fnmatchcase(n, site)]
        else:
            raise TypeError(f"fwd_hooks[{i}]: the name must be a site name, a glob or a predicate; "
                            f"got {type(name).__name__}")
        if not hit:
            raise ValueError(f"fwd_hooks[{i}]: {name!r} matches no site of this stack (see site_names())."
                             + (unknown_hint(name, canonical(name), names) if isinstance(name, str) else ""))
        out += [Intervention(n, _Call(fn, HookPoint(shown))) for n, shown in hit]
    return out
