"""The inputs of :func:`pyengine.propagate` that are not arrays of numbers: where to inject
(a hidden-state index or a named site), which positions, and padded batches.

Injection points. An int k is hidden state k (the input of block k, 0-based). A site
name ``"blocks.k.<site>"`` (see :mod:`pyengine.models.sites`): ``resid_pre`` is hidden
state k, ``resid_post`` hidden state k + 1; every other injectable site of block k
(:func:`pyengine.models.site_blocks.injection_sites`: ``resid_mid``, the norms' inputs and
outputs, ``attn.out``, ``attn.head_out``, ``mlp.hidden``, ``mlp.out``) is injected inside
block k, from which the exact forward (or the JVP) starts at that site.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ..models.site_blocks import injection_sites
from ..models.tl_names import canonical, did_you_mean

__all__ = ["Injection", "position_mask", "propagate_padded", "resolve_injection", "resolve_positions"]

_VIEWS = ("last", "injected", "downstream", "all")


class Injection(NamedTuple):
    """Where :func:`propagate` injects: ``layer`` the hidden-state index (site None), or the
    block ``layer`` and the site inside it (``site``, without ``blocks.k.``); ``name`` the
    site name as given (None for an int)."""

    layer: Any
    site: str | None
    name: str | None


def resolve_injection(layer: Any, cfg: Any) -> Injection:
    """An int as it is (checked later), or a site name as hidden state / (block, site)."""
    if not isinstance(layer, str):
        return Injection(layer, None, None)
    given, layer = layer, canonical(layer)  # TransformerLens names (models/tl_names.py)
    n = cfg.n_layers
    valid = ("resid_pre", "resid_post") + tuple(s for s in injection_sites(cfg) if s not in ("resid_pre", "resid_post"))
    parts = layer.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks" and parts[1].lstrip("-").isdigit():
        k = int(parts[1])
        if not -n <= k < n:
            raise ValueError(f"layer {layer!r}: block index must lie in [-{n}, {n}) for a stack of {n} blocks")
        k %= n
        if parts[2] == "resid_pre":
            return Injection(k, None, given)
        if parts[2] == "resid_post":
            if k + 1 == n:
                raise ValueError(f"layer {layer!r} is the last hidden state: nothing is left to propagate through")
            return Injection(k + 1, None, given)
        if parts[2] in valid:
            return Injection(k, parts[2], given)
    raise ValueError(f"layer must be a hidden-state index or a site 'blocks.<k>.<site>' with <site> one of "
                     f"{', '.join(valid)} (layout {cfg.layout!r}, placement {cfg.placement!r}); got {given!r}."
                     + did_you_mean(given, [f"blocks.{parts[1] if len(parts) == 3 else 0}.{v}" for v in valid]))


def position_mask(where: str, positions: np.ndarray, T: int) -> np.ndarray:
    """(T,) bool selection of :meth:`Propagation.position_mask` for injected ``positions``."""
    m = np.zeros(T, bool)
    if where == "injected":
        m[positions] = True
    elif where == "downstream":
        m[positions[-1] + 1 :] = True
    elif where == "last":
        m[-1] = True
    elif where == "all":
        m[:] = True
    else:
        raise ValueError(f"where must be one of {', '.join(map(repr, _VIEWS))}; got {where!r}")
    return m


def resolve_positions(positions: Any, T: int) -> np.ndarray:
    """Sorted unique positions from "all", "last", an int, a slice or a list (negative from the end)."""
    if isinstance(positions, str):
        if positions == "all":
            return np.arange(T)
        if positions == "last":
            return np.array([T - 1])
        raise ValueError(f"positions must be 'all', 'last', an int, a slice or a list of ints; got {positions!r}")
    if isinstance(positions, slice):
        try:
            p = np.unique(np.arange(T)[positions])
        except (ValueError, TypeError, IndexError) as exc:  # step 0, non-integer bounds
            raise ValueError(f"positions must be a slice of integers with a non-zero step; got {positions!r} "
                             f"({exc})") from None
    else:
        p = np.atleast_1d(np.asarray(positions))
        if p.size == 0:
            raise ValueError(f"positions selects no token of the T = {T} tokens")
        if p.dtype.kind not in "iu" or p.ndim != 1:
            raise ValueError(f"positions must be 'all', 'last', an int, a slice or a list of ints; got {positions!r}")
        bad = p[(p < -T) | (p >= T)]
        if bad.size:
            raise ValueError(f"positions must lie in [-{T}, {T}) for a sequence of T = {T} tokens; got {bad[0]}")
        p = np.unique(p % T)
    if p.size == 0:
        raise ValueError(f"positions selects no token of the T = {T} tokens")
    return p.astype(np.intp)


def propagate_padded(run: Callable[[Any], Any], model: Any, input_ids: Any, attention_mask: Any) -> Any:
    """``run(sequence)`` on every real sequence of a padded input: one result for (T,) ids
    (or a (T, d) stream), a list of B for a (B, T) batch."""
    ids, m = np.asarray(input_ids), np.asarray(attention_mask)
    one = ids.ndim == (1 if ids.dtype.kind in "iu" else 2)
    rows = model.unpad(ids[None] if one else ids, m[None] if m.ndim == 1 else m)
    out = [run(r) for r in rows]
    return out[0] if one else out
