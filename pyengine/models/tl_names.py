"""TransformerLens hook names as aliases of pyengine's sites, and "did you mean" suggestions.

Every place that takes a site name (``run_with_cache``, ``run``/interventions, the cache's
lookups, ``propagate(layer=)``, ``spectral --sites``) passes it through :func:`canonical`,
which rewrites a TransformerLens name (or glob, e.g. ``blocks.*.hook_resid_post``) to the
pyengine name. The arrays are pyengine's, in pyengine's one batch convention (see
docs/guide/sites.md for the table): streams (B, T, d), per-head vectors (B, T, H, d_head),
patterns and scores (B, H, T, T); a single sequence drops the B axis.
"""

from __future__ import annotations

import difflib
import re

__all__ = ["BLOCK_ALIASES", "GLOBAL_ALIASES", "REFUSED", "canonical", "did_you_mean", "tl_name", "unknown_hint"]

#: ``blocks.{k}.<TransformerLens suffix>`` -> ``blocks.{k}.<pyengine suffix>``.
BLOCK_ALIASES: dict[str, str] = {
    "hook_resid_pre": "resid_pre",
    "hook_resid_mid": "resid_mid",
    "hook_resid_post": "resid_post",
    "attn.hook_q": "attn.q",
    "attn.hook_k": "attn.k",
    "attn.hook_v": "attn.v",
    "attn.hook_z": "attn.head_out",
    "attn.hook_pattern": "attn.pattern",
    "attn.hook_attn_scores": "attn.scores",
    "attn.hook_result": "attn.result",
    "hook_attn_out": "attn.out",
    "hook_mlp_out": "mlp.out",
    "mlp.hook_pre": "mlp.pre",
    "mlp.hook_post": "mlp.hidden",
    "ln1.hook_normalized": "norm1.output",
    "ln1.hook_scale": "norm1.scale",
    "ln2.hook_normalized": "norm2.output",
    "ln2.hook_scale": "norm2.scale",
    "ln1_post.hook_normalized": "norm1_out.output",  # Gemma 2: the norms of the sublayer outputs
    "ln1_post.hook_scale": "norm1_out.scale",
    "ln2_post.hook_normalized": "norm2_out.output",
    "ln2_post.hook_scale": "norm2_out.scale",
}

#: Names outside the blocks.
GLOBAL_ALIASES: dict[str, str] = {
    "hook_embed": "embed",
    "ln_final.hook_normalized": "final_norm.output",
    "ln_final.hook_scale": "final_norm.scale",
}

#: TransformerLens names with no pyengine site, and why.
REFUSED: dict[str, str] = {
    "hook_pos_embed": "pyengine has no site for the positional embedding alone (learned positions are "
                      "added in the forward: blocks.0.resid_pre - embed without an embedding norm; "
                      "rotary models have none)",
}

_BLOCK_RE = re.compile(r"^blocks\.([^.]+)\.(.+)$")


def canonical(name: str) -> str:
    """The pyengine site name (or glob) for ``name``: TransformerLens names rewritten, any
    other string unchanged; ValueError for a TransformerLens name that has no pyengine site."""
    if not isinstance(name, str):
        return name
    if name in REFUSED:
        raise ValueError(f"site {name!r} (TransformerLens) has no pyengine equivalent: {REFUSED[name]}")
    if name in GLOBAL_ALIASES:
        return GLOBAL_ALIASES[name]
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in BLOCK_ALIASES:
        return f"blocks.{m.group(1)}.{BLOCK_ALIASES[m.group(2)]}"
    return name


def tl_name(site: str) -> str | None:
    """The TransformerLens name of the pyengine site ``site`` (e.g. ``blocks.3.hook_resid_post``
    for ``blocks.3.resid_post``), or None where TransformerLens has no name for it."""
    for tl, ours in GLOBAL_ALIASES.items():
        if site == ours:
            return tl
    m = _BLOCK_RE.match(site)
    if m:
        for tl, ours in BLOCK_ALIASES.items():
            if m.group(2) == ours:
                return f"blocks.{m.group(1)}.{tl}"
    return None


def did_you_mean(name: object, names: list[str]) -> str:
    """`` Closest valid names: a, b, c.`` (difflib) for an unknown ``name``, or ``""``."""
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    return f" Closest valid names: {', '.join(close)}." if close else ""


def unknown_hint(given: str, name: str, names: list[str]) -> str:
    """The tail of a "matches no site" message: which pyengine name a TransformerLens
    ``given`` stands for (``name``), then the closest valid names."""
    alias = f" ({given!r} is TransformerLens for {name!r}, which this stack has not)" if name != given else ""
    return alias + did_you_mean(given, names)
