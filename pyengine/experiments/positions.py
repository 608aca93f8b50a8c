"""``pyengine positions``: how positional signal persists by layer, and pre- against post-LN.

:func:`positions_report` runs, for each model (a pretrained model on a corpus, or the
default synthetic matched pair: the same seeded weights with ``placement="pre"`` and
``"post"``), the measurements of :mod:`pyengine.analysis.positions` (decomposition,
probe with shuffled control, propagation of the layer-0 positional directions, exact and
linearized) and :mod:`pyengine.analysis.placement` (norm growth, adjacent cosine, step
ratio, block removal, Spearman of cosine against removal), and of
:mod:`pyengine.analysis.positions_model` (the position-only run for learned and
sinusoidal positions; the attention pattern against the query-key offset, for every
model and the only positional measurement of a rotary one).

The decomposition comes in three variants: ``all`` positions, ``without_first`` (positions
0 .. N - 1 left out; by default N is one past the last position that dominates, holding
more than half of |h - mu|^2 at some layer, and 1 when none does) and ``normalized``
(each token at unit RMS). :func:`format_positions` gives the tables, the evaluation
protocol, a warning wherever one position dominates, and the findings in words with
numbers; :func:`write_positions` the JSON, CSV and the figures.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _validate as _v
from .._figures import check_format
from ..analysis.placement import PlacementProfile, placement_profile
from ..analysis.positions import (PositionalDecomposition, PositionalPropagation, PositionProbe,
                                  position_probe, positional_decomposition, positional_propagation)
from ..analysis.positions_model import (AttentionDistance, PatternMoments, PositionOnly, attention_distance,
                                        position_only)
from ..corpus import load_corpus, tokenized_corpus
from ..models import Stack, StackConfig, init_weights
from ..provenance import provenance as gather
from ._positions_findings import dominance_warnings, extra_findings, variant_cells, variant_header

__all__ = ["ModelPositions", "PositionsReport", "format_positions", "positions_report", "synthetic_pair",
           "write_positions"]


@dataclasses.dataclass(frozen=True, eq=False)
class ModelPositions:
    """Everything measured on one model. ``layers``: the hidden-state indices analysed."""

    name: str
    placement: str
    positions: str
    layers: np.ndarray
    contexts: int
    length: int
    decomposition: PositionalDecomposition
    probe: PositionProbe
    propagation: PositionalPropagation
    placement_profile: PlacementProfile
    variants: dict[str, PositionalDecomposition] = dataclasses.field(default_factory=dict)
    position_only: PositionOnly | None = None
    attention: AttentionDistance | None = None
    protocol: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "placement": self.placement, "positions": self.positions,
                "layers": self.layers.tolist(), "contexts": self.contexts, "length": self.length,
                "decomposition": self.decomposition.to_dict(), "probe": self.probe.to_dict(),
                "propagation": self.propagation.to_dict(), "placement_profile": self.placement_profile.to_dict(),
                "protocol": self.protocol,
                "dominant_position": [None if p < 0 else p for p in self.decomposition.dominant_position.tolist()],
                "variants": {k: v.to_dict() for k, v in self.variants.items()},
                "position_only": None if self.position_only is None else self.position_only.to_dict(),
                "attention_distance": None if self.attention is None else self.attention.to_dict()}


@dataclasses.dataclass(frozen=True, eq=False)
class PositionsReport:
    models: list[ModelPositions]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"models": [m.to_dict() for m in self.models], "seconds": self.seconds}


def synthetic_pair(n_layers: int = 12, d_model: int = 64, seed: int = 0) -> tuple[Stack, Stack]:
    """The matched pair: one seeded LayerNorm stack (Xavier-normal blocks, sinusoidal positions,
    unit-variance token embeddings, tied read-out) with placement "pre" and "post"."""
    cfg = StackConfig(d_model=d_model, n_heads=4, n_layers=n_layers, d_mlp=4 * d_model, norm="layernorm",
                      placement="pre", positions="sinusoidal", vocab_size=512, lm_head="tied", max_seq_len=512)
    s = init_weights(cfg, "xavier_normal", seed=seed)
    w = s.weights
    w["embed.tokens"] = w["embed.tokens"] / w["embed.tokens"].std()  # tokens on the scale of the positions
    pre = Stack(cfg, w)
    return pre, pre.replace(placement="post")


def _variants(h: np.ndarray, k: int, exclude_first: int | None) -> dict[str, PositionalDecomposition]:
    """The decomposition of all positions, without the first N (N > 0 only) and per-token normalized."""
    T = h.shape[2]
    out = {"all": positional_decomposition(h, k=min(k, *h.shape[2:]))}
    if exclude_first is None:
        dom = out["all"].dominant_position
        exclude_first = min(int(dom.max()) + 1, T - 2) if dom.max() >= 0 else 1
    if exclude_first > 0 and T - exclude_first >= 2:
        out["without_first"] = positional_decomposition(h, k=min(k, T - exclude_first, h.shape[3]),
                                                        exclude_first=exclude_first)
    out["normalized"] = positional_decomposition(h, k=min(k, *h.shape[2:]), normalize=True)
    return out


def _one(model: Stack, name: str, ids: np.ndarray, layers: np.ndarray, k: int, folds: int,
         ablation_contexts: int | None, stage: Callable[[float, str], None], lo: float, hi: float,
         exclude_first: int | None = None, data: str = "") -> ModelPositions:
    def sub(a: float, b: float) -> Callable[[float, str], None]:
        return lambda f, s: stage(lo + (hi - lo) * (a + (b - a) * f), f"{name}: {s}")

    hs, mom = [], PatternMoments()
    sites = [f"blocks.{b}.attn.pattern" for b in range(model.config.n_layers)]
    for i in range(0, ids.shape[0], 64):  # one batched forward per chunk of contexts
        hid, cache = model.run_with_cache(ids[i:i + 64], sites)
        hs.append(hid)
        mom.add(np.stack([cache[s] for s in sites]))
        sub(0.0, 0.3)(min(i + 64, ids.shape[0]) / ids.shape[0], "forward")
    full = np.concatenate(hs, axis=1)  # (L + 1, C, T, d)
    prof = placement_profile(model, ids, ablation_contexts=ablation_contexts, hidden=full, progress=sub(0.3, 0.65))
    h = full[layers]  # (L', C, T, d)
    variants = _variants(h, k, exclude_first)
    dec = variants["all"]
    attn = attention_distance(mom, causal=model.config.causal) if ids.shape[1] >= 3 else None
    pos_only = (position_only(model, h, layers, k=min(k, *h.shape[2:]))
                if model.config.positions in ("learned", "sinusoidal") else None)
    probe = position_probe(h, folds=folds, progress=lambda j, n: sub(0.65, 0.9)(j / n, "position probe"))
    ctx = ids[0]
    sv = dec.singular_values[0][:dec.k] / np.sqrt(ids.shape[1])  # RMS over positions along each direction
    sub(0.9, 1.0)(0.0, "positional propagation")
    prop = positional_propagation(model, ctx, dec.directions, np.maximum(sv, 1e-6))
    C, T = ids.shape
    protocol = (f"{data}: {C} contexts x {T} tokens, in-sample over these contexts, hidden states "
                f"{','.join(str(int(x)) for x in layers)}; probe: {folds}-fold CV over contexts (held-out R^2) with "
                f"a shuffled-label control; removals on the first {prof.ablation_contexts} contexts; point "
                "estimates, no intervals")
    return ModelPositions(name, model.config.placement, model.config.positions, layers, C, T,
                          dec, probe, prop, prof, variants, pos_only, attn, protocol)


def positions_report(models: list[tuple[str, Stack]] | None = None, *, corpus: str | None = None, length: int = 12,
                     max_contexts: int | None = 256, layers: Any = None, k: int = 4, folds: int = 3,
                     ablation_contexts: int | None = 32, seed: int = 0, exclude_first: int | None = None,
                     progress: Callable[[float, str], None] | None = None,
                     on_stage: Callable[[str, dict[str, Any]], None] | None = None) -> PositionsReport:
    """Run the measurements on ``models`` ((name, Stack) pairs; default the synthetic pair).

    Pretrained models (with ``tokenize``) read ``corpus`` (a file; default the built-in one),
    cut to ``length`` tokens; stacks without a tokenizer get seeded random ids (C = max_contexts
    or 256). ``layers``: hidden-state indices for the positional analyses (default all).
    ``exclude_first``: positions left out of the ``without_first`` decomposition (0: no such
    variant; default None: one past the last dominating position, or 1 if none dominates).
    ``on_stage(stage, result)``, if given, gets each model's finished measurements (its
    ``to_dict()``) as soon as they are done.
    """
    import time

    t0 = time.perf_counter()
    length = _v.count("length", length)
    max_contexts = _v.count("max_contexts", max_contexts, allow_none=True)
    if exclude_first is not None and (isinstance(exclude_first, bool) or not isinstance(exclude_first, int)
                                      or not 0 <= exclude_first <= length - 2):
        raise ValueError(f"exclude_first must be an integer in [0, length - 2 = {length - 2}] or None; "
                         f"got {exclude_first!r}")
    progress = _v.callback(progress, "progress") or (lambda f, s: None)
    sentences = load_corpus(corpus)
    if models is None:
        pre, post = synthetic_pair(seed=seed)
        models = [("synthetic pre-LN", pre), ("synthetic post-LN", post)]
    out = []
    for i, (name, m) in enumerate(models):
        if not isinstance(m, Stack):
            raise TypeError(f"models[{i}] must be a pyengine Stack; got {type(m).__name__}")
        L = m.config.n_layers
        try:
            lay = np.arange(L + 1) if layers is None else _v.indices("layers", layers, L + 1)
        except IndexError as e:  # a bad argument, reported as one (ValueError)
            raise ValueError(str(e)) from None
        if hasattr(m, "tokenize"):
            ids = tokenized_corpus(m, length, sentences, max_contexts=max_contexts)
            data = f"corpus {os.path.basename(corpus) if corpus else 'built-in'}"
        else:
            rng = np.random.default_rng(seed)
            ids = rng.integers(0, max(m.config.vocab_size, 1), (max_contexts or 256, length))
            data = f"uniform random ids (seed {seed})"
        out.append(_one(m, name, ids, lay, k, folds, ablation_contexts, progress, i / len(models),
                        (i + 1) / len(models), exclude_first, data))
        if on_stage is not None:
            on_stage(f"model {i + 1} {name}", {"model": out[-1].to_dict()})
    return PositionsReport(out, time.perf_counter() - t0)


def _findings(m: ModelPositions) -> list[str]:
    d, p, pr, g = m.decomposition, m.probe, m.placement_profile, m.propagation
    last = len(m.layers) - 1
    keep = g.projection[-1].mean() / g.projection[0].mean()
    keep_med = g.projection_median[-1].mean() / max(g.projection_median[0].mean(), 1e-300)
    lin = np.abs(g.projection_linearized[-1] - g.projection[-1]).mean() / max(g.projection[-1].mean(), 1e-300)
    dis = pr.disagreements()
    lines = [
        f"positional share |pos|/|h - mu|: {d.rel_norm[0]:.3f} at hidden state {m.layers[0]} -> {d.rel_norm[last]:.3f} "
        f"at {m.layers[last]}; effective rank {d.effective_rank[0]:.1f} -> {d.effective_rank[last]:.1f}; "
        f"largest principal angle to layer 0 at the top {np.degrees(d.angles[last].max()):.0f} deg",
        f"position probe R^2 {p.r2[0]:.3f} -> {p.r2[last]:.3f} (shuffled control max {p.r2_shuffled.max():.3f})",
        f"layer-0 positional directions propagated: {100 * keep:.0f}% of the projection left at the last "
        f"hidden state (median over positions {100 * keep_med:.0f}%); linearized differs by {100 * lin:.1f}%",
        f"|h|/sqrt(d) {pr.norm[0]:.2f} -> {pr.norm[-1]:.2f} ({m.placement}-norm); adjacent cosine "
        f"{pr.cosine.min():.3f} .. {pr.cosine.max():.3f}",
        f"Spearman(1 - cos, removal effect) = {pr.spearman:+.2f}; least important by cosine {dis['least_by_cosine']}, "
        f"by removal {dis['least_by_removal']}" + (f"; cosine alone would drop {dis['cosine_only']}"
                                                   if dis["cosine_only"] else "; the two agree"),
    ]
    return lines + (extra_findings(m) if m.variants else [])


def format_positions(rep: PositionsReport) -> str:
    """The per-layer tables and the findings of every model, as text."""
    out = []
    for m in rep.models:
        pr, d, p = m.placement_profile, m.decomposition, m.probe
        out.append(f"== {m.name} ({m.placement}-norm, {m.positions} positions; {m.contexts} contexts x {m.length} "
                   f"tokens, removals on {pr.ablation_contexts})")
        if m.protocol:
            out.append(f"protocol: {m.protocol}")
        out += dominance_warnings(m)
        var = bool(m.variants)
        out.append(f"{'h':>3} {'pos share':>9} {'eff rank':>8} {'angle1':>7} {'incoh':>6} {'probe R2':>8} {'shuf R2':>8}"
                   + (variant_header(m) if var else ""))
        for i, l in enumerate(m.layers):
            out.append(f"{l:>3} {d.rel_norm[i]:>9.3f} {d.effective_rank[i]:>8.2f} {np.degrees(d.angles[i].min()):>7.1f} "
                       f"{d.incoherence[i]:>6.3f} {p.r2[i]:>8.3f} {p.r2_shuffled[i]:>8.3f}"
                       + (variant_cells(m, i) if var else ""))
        kl = pr.removal_kl is not None
        out.append(f"{'blk':>3} {'|h|/sqrtd':>9} {'median':>7} {'top/med':>7} {'cos':>6} {'step':>6} {'dfinal':>7}"
                   + (f" {'KL':>7} {'top1':>5}" if kl else ""))
        for k in range(pr.cosine.size):
            row = (f"{k:>3} {pr.norm[k + 1]:>9.3f} {pr.norm_median[k + 1]:>7.3f} {pr.top_norm_ratio[k + 1]:>7.1f} "
                   f"{pr.cosine[k]:>6.3f} {pr.step_ratio[k]:>6.3f} {pr.removal_change[k]:>7.3f}")
            out.append(row + (f" {pr.removal_kl[k]:>7.3f} {pr.removal_top1[k]:>5.2f}" if kl else ""))
        out += ["  " + s for s in _findings(m)]
    out.append(f"({rep.seconds:.1f} s)")
    return "\n".join(out)


def write_positions(rep: PositionsReport, folder: str, fmt: str = "png",
                    provenance: dict[str, Any] | None = None) -> list[str]:
    """positions.json, positions.csv (one row per model and layer/block) and the figures in ``folder``
    (``fmt``: png, pdf or svg). ``provenance``: positions.json's block (default
    :func:`pyengine.provenance.provenance` now)."""
    check_format(fmt)
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, "positions.json"), os.path.join(folder, "positions.csv")]
    with open(paths[0], "w") as f:
        json.dump({**rep.to_dict(), "provenance": provenance or gather()}, f, indent=1)
    with open(paths[1], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "kind", "index", "pos_share", "effective_rank", "angle1_deg", "probe_r2", "shuffled_r2",
                    "norm", "cosine", "step_ratio", "removal_change", "removal_kl", "removal_top1", "top_position",
                    "top_share", "pos_share_without_first", "pos_share_normalized", "norm_median", "top_norm_ratio"])
        for m in rep.models:
            d, p, pr = m.decomposition, m.probe, m.placement_profile
            wf, nz = m.variants.get("without_first"), m.variants.get("normalized")
            for i, l in enumerate(m.layers):
                w.writerow([m.name, "hidden", int(l), d.rel_norm[i], d.effective_rank[i],
                            np.degrees(d.angles[i].min()), p.r2[i], p.r2_shuffled[i], "", "", "", "", "", "",
                            int(d.top_position[i]), d.top_share[i], "" if wf is None else wf.rel_norm[i],
                            "" if nz is None else nz.rel_norm[i], "", ""])
            for k in range(pr.cosine.size):
                w.writerow([m.name, "block", k, "", "", "", "", "", pr.norm[k + 1], pr.cosine[k], pr.step_ratio[k],
                            pr.removal_change[k], "" if pr.removal_kl is None else pr.removal_kl[k],
                            "" if pr.removal_top1 is None else pr.removal_top1[k], "", "", "", "",
                            pr.norm_median[k + 1], pr.top_norm_ratio[k + 1]])
    from ._positions_plots import plot_positions

    return paths + plot_positions(rep, folder, fmt)
