"""The text of :mod:`pyengine.experiments.positions` that reads the variants, the token norms,
the position-only run and the attention by offset: every number and every choice of words
comes from the measurements (tests drive each branch with constructed data)."""

from __future__ import annotations

from typing import Any

import numpy as np

#: A :class:`~pyengine.experiments.positions.ModelPositions` (not imported: its module imports this one).
ModelPositions = Any

__all__ = ["dominance_warnings", "extra_findings", "variant_cells", "variant_header"]


def _spans(idx: list[int]) -> str:
    """Consecutive runs of sorted ints: [1, 2, 3, 7] -> "1-3, 7"."""
    out, start = [], None
    for a, b in zip(idx, idx[1:] + [None]):
        start = a if start is None else start
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = None
    return ", ".join(out)


def _without_label(m: ModelPositions) -> str:
    n = m.variants["without_first"].exclude_first
    return "without position 0" if n == 1 else f"without positions 0-{n - 1}"


def dominance_warnings(m: ModelPositions) -> list[str]:
    """One WARNING line per position that holds more than half of |h - mu|^2 at some layer."""
    d = m.decomposition
    dom = d.dominant_position
    out = []
    for p in sorted(set(dom[dom >= 0].tolist())):
        at = dom == p
        where = _spans([int(x) for x in m.layers[at]])
        alt = [s for s, k in ((_without_label(m), "without_first"), ("per-token normalized", "normalized"))
               if k in m.variants and (k != "without_first" or m.variants[k].exclude_first > p)]
        out.append(f"WARNING: position {p} holds {100 * d.top_share[at].min():.1f}-{100 * d.top_share[at].max():.1f}% "
                   f"of |h - mu|^2 at hidden states {where}: the all-position statistics there are that one "
                   f"token's" + (f"; read the {' and '.join(alt)} columns" if alt else ""))
    return out


def variant_header(m: ModelPositions) -> str:
    head = f" {'top pos':>10}"
    if "without_first" in m.variants:
        n = m.variants["without_first"].exclude_first
        head += f" {f'share t>={n}':>11} {'rank':>5}"
    return head + f" {'share norm':>10} {'rank':>5}"


def variant_cells(m: ModelPositions, i: int) -> str:
    d = m.decomposition
    row = f" {f'{d.top_position[i]}:{d.top_share[i]:.2f}':>10}"
    if "without_first" in m.variants:
        w = m.variants["without_first"]
        row += f" {w.rel_norm[i]:>11.3f} {w.effective_rank[i]:>5.2f}"
    n = m.variants["normalized"]
    return row + f" {n.rel_norm[i]:>10.3f} {n.effective_rank[i]:>5.2f}"


def _range(x: np.ndarray) -> str:
    return f"{x.min():.3f}" if np.isclose(x.min(), x.max(), rtol=0, atol=5e-4) else f"{x.min():.3f}-{x.max():.3f}"


def _variant_lines(m: ModelPositions) -> list[str]:
    d = m.decomposition
    labels = {"all": "all positions"}
    if "without_first" in m.variants:
        labels["without_first"] = _without_label(m)
    labels["normalized"] = "each token at unit RMS"
    dom = d.dominant_position >= 0
    out = []
    if dom.any():
        where = _spans([int(x) for x in m.layers[dom]])
        out.append(f"where one position dominates (hidden states {where}): positional share "
                   + "; ".join(f"{lab} {_range(m.variants[k].rel_norm[dom])}" for k, lab in labels.items())
                   + "; effective rank "
                   + "; ".join(f"{lab} {_range(m.variants[k].effective_rank[dom])}" for k, lab in labels.items()))
    if (~dom).any():
        where = _spans([int(x) for x in m.layers[~dom]])
        out.append(f"{'elsewhere' if dom.any() else 'no position dominates'} (hidden states {where}): positional "
                   "share " + "; ".join(f"{lab} {_range(m.variants[k].rel_norm[~dom])}" for k, lab in labels.items()))
    return out


def _norm_line(m: ModelPositions) -> str:
    pr = m.placement_profile
    j = int(np.argmax(pr.top_norm_ratio))
    big = np.flatnonzero(pr.top_norm_ratio >= 10)
    return (f"token norms: median |h|/sqrt(d) {pr.norm_median[0]:.2f} -> {pr.norm_median[-1]:.2f} (RMS over tokens "
            f"{pr.norm[0]:.2f} -> {pr.norm[-1]:.2f}); the largest position is {int(pr.top_norm_position[j])} at "
            f"{pr.top_norm_ratio[j]:.1f}x the median of the others (hidden state {j})"
            + (f"; >= 10x at hidden states {_spans(big.tolist())}" if big.size else "; never >= 10x"))


def _position_only_line(m: ModelPositions) -> list[str]:
    q = m.position_only
    if q is None:
        return []
    a, b = m.layers[0], m.layers[-1]
    return [f"position-only run (token embeddings zeroed, {m.positions} positions kept): alignment with the "
            f"positional part {q.alignment[0]:.2f} at hidden state {a} -> {q.alignment[-1]:.2f} at {b} (median over "
            f"positions {q.alignment_median[0]:.2f} -> {q.alignment_median[-1]:.2f}); its top-{q.k} subspace holds "
            f"{100 * q.captured[0]:.0f}% -> {100 * q.captured[-1]:.0f}% of |pos|^2; |q|/|pos| "
            f"{q.rel_norm[0]:.2f} -> {q.rel_norm[-1]:.2f}"]


def _attention_lines(m: ModelPositions) -> list[str]:
    out = []
    if m.positions == "rotary":
        out.append("rotary positions: no position vector is added to the stream; the positional signal lives in "
                   "the attention (q.k depends on the offset i - j), measured here on the patterns")
    a = m.attention
    if a is None:
        return out + ["attention by offset: not measured (fewer than 3 positions)"]
    j = int(np.argmax(a.r2_distance))
    kind = "offset i - j" if a.r2_distance.mean() >= a.r2_key.mean() else "absolute key position j"
    out.append(f"attention pattern, share of its variance per head explained by the offset i - j: mean "
               f"{a.r2_distance.mean():.2f} over blocks (max {a.r2_distance[j]:.2f} at block {j}); without key 0: "
               f"{a.r2_distance_no_first.mean():.2f}; by the key position j: {a.r2_key.mean():.2f}, so the "
               f"{kind} explains more; weight on key 0 from queries i >= 1: {a.sink[0]:.2f} at block 0 -> "
               f"{a.sink[-1]:.2f} at block {a.sink.size - 1} (max {a.sink.max():.2f})")
    return out


def extra_findings(m: ModelPositions) -> list[str]:
    """The finding lines on the variants, the token norms, the position-only run and the attention."""
    return _variant_lines(m) + [_norm_line(m)] + _position_only_line(m) + _attention_lines(m)
