"""Text, JSON, CSV and figure output of an :class:`~pyengine.experiments.AttentionDynamics` report."""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Any

import numpy as np

from .._figures import COLUMN, PAGE, check_format, heatmap_grid, layer_axis, save, styled, subplots
from ..provenance import provenance as gather
from .attention_dynamics import METRICS, AttentionDynamics

__all__ = ["format_attention_table", "write_attention_report"]


def _f(v: float, fmt: str = ".4f") -> str:
    return "-" if v is None or not math.isfinite(v) else format(v, fmt)


def format_attention_table(rep: AttentionDynamics) -> str:
    """Per arm (mean over seeds): final loss, entropies, accuracy, the Bayes floor, steps and the paired test."""
    c = rep.config
    lines = [
        f"sticky Markov chain: {c['n_symbols']} symbols, stay {c['stay']:g} (effective stay probability "
        f"{rep.effective_stay:.4f}); T = {c['T']}; {c['steps']} steps; seeds {', '.join(map(str, rep.seeds))}"
        + (" (interrupted: finished seeds only)" if rep.interrupted else ""),
        f"Bayes floor H(Y_t | Y_t-1) = {rep.bayes_entropy:.4f} nats; log {c['n_symbols']} = "
        f"{math.log(c['n_symbols']):.4f}; {rep.seconds['per_step_ms']:.2f} ms per training step ({c['dtype']})",
        f"{'arm':<10}{'loss':>9}{'-floor':>9}{'pred H':>9}{'attn H':>9}{'acc':>8}{'adv spr':>9}"
        f"{'steps*':>8}{'ratio':>8}{'d loss':>10}{'t':>8}{'wins':>6}{'PC1':>7}{'PC2':>7}",
    ]
    for arm in rep.arms:
        m = {k: rep.metrics[arm][k][:, -1].mean() for k in METRICS}
        steps = rep.steps_to_gd_final(arm)
        pair = rep.paired(arm) if arm != "gd" else {"mean_diff": 0.0, "t": float("nan"), "wins": 0,
                                                      "n": len(rep.seeds), "step_ratio_mean": 1.0}
        pca = rep.value_pca[arm].mean(axis=0)
        lines.append(
            f"{arm:<10}{_f(m['loss']):>9}{_f(m['loss'] - rep.bayes_entropy):>9}{_f(m['pred_entropy']):>9}"
            f"{_f(m['attn_entropy']):>9}{_f(m['accuracy'], '.3f'):>8}{_f(m['adv_spread'], '.3g'):>9}"
            f"{_f(float(np.nanmean(steps)) if np.isfinite(steps).any() else float('nan'), '.0f'):>8}"
            f"{_f(pair['step_ratio_mean'], '.1f'):>8}{_f(pair['mean_diff'], '+.4f'):>10}{_f(pair['t'], '.2f'):>8}"
            f"{pair['wins']:>3}/{pair['n']:<2}{_f(pca[0], '.3f'):>7}{_f(pca[1], '.3f'):>7}"
        )
    lines.append("steps*: first step at which the arm's loss reaches the gd arm's final loss (mean over seeds); "
                 "ratio: gd's steps / the arm's; d loss, t, wins: final loss minus gd's, paired over seeds")
    if rep.m_step_skipped.size:
        lines.append(f"m_step: Newton steps skipped by the line search (no decrease): "
                     f"{int(rep.m_step_skipped.sum())} of {rep.m_step_skipped.size * c['steps']}")
    return "\n".join(lines)


def _clean(o: Any) -> Any:
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, np.ndarray):
        return _clean(o.tolist())
    if isinstance(o, (np.floating, float)):
        return float(o) if math.isfinite(o) else None
    if isinstance(o, np.integer):
        return int(o)
    return o


def to_dict(rep: AttentionDynamics) -> dict[str, Any]:
    return _clean({
        "config": rep.config, "chain": rep.chain, "effective_stay": rep.effective_stay,
        "bayes_entropy": rep.bayes_entropy, "seeds": rep.seeds, "arms": rep.arms, "interrupted": rep.interrupted,
        "seconds": rep.seconds, "m_step_skipped": rep.m_step_skipped,
        "final": {a: {m: rep.metrics[a][m][:, -1] for m in METRICS} for a in rep.arms},
        "steps_to_gd_final": {a: rep.steps_to_gd_final(a) for a in rep.arms},
        "paired": {a: rep.paired(a) for a in rep.arms if a != "gd"},
        "value_pca": rep.value_pca,
        "metrics": {a: {m: rep.metrics[a][m] for m in METRICS} for a in rep.arms},
    })


def write_attention_report(rep: AttentionDynamics, folder: str, plots: bool = True, fmt: str = "png",
                           provenance: dict[str, Any] | None = None) -> list[str]:
    """Write attention.json, attention.csv (one row per arm, seed, step) and, with plots, three
    figures in ``fmt`` (png, pdf or svg): attention_loss, attention_heatmaps, attention_value_pca.
    ``provenance``: attention.json's block (default :func:`pyengine.provenance.provenance` now)."""
    check_format(fmt)
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, "attention.json"), os.path.join(folder, "attention.csv")]
    with open(paths[0], "w") as f:
        json.dump({**to_dict(rep), "provenance": provenance or gather(seeds=rep.seeds)}, f, indent=1)
    with open(paths[1], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "seed", "step", *METRICS])
        for arm in rep.arms:
            for si, seed in enumerate(rep.seeds):
                cols = [rep.metrics[arm][m][si] for m in METRICS]
                for step in range(cols[0].size):
                    w.writerow([arm, seed, step, *(f"{c[step]:.6g}" for c in cols)])
    if plots:
        paths += _plots(rep, folder, fmt)
    return paths


@styled
def _plots(rep: AttentionDynamics, folder: str, fmt: str) -> list[str]:
    out = []
    fig, axes = subplots(1, 3, size=(PAGE, 2.5))
    for arm in rep.arms:
        for ax, key, label in zip(axes, ("loss", "pred_entropy", "attn_entropy"),
                                  ("cross-entropy (nats)", "predictive entropy (nats)",
                                   "attention entropy (nats)")):
            mean = rep.metrics[arm][key].mean(axis=0)
            lo, hi = rep.metrics[arm][key].min(axis=0), rep.metrics[arm][key].max(axis=0)
            line, = ax.plot(mean, label=arm)
            ax.fill_between(np.arange(mean.size), lo, hi, color=line.get_color(), alpha=0.2, lw=0)
            ax.set_xlabel("training step")
            ax.set_ylabel(label)
            layer_axis(ax)
    for ax in axes[:2]:
        ax.axhline(rep.bayes_entropy, color="k", ls="--", lw=0.8, label=r"Bayes floor $H(Y_t \mid Y_{t-1})$")
    fig.legend(handles=axes[0].get_legend_handles_labels()[0], loc="outside lower center",
               ncols=len(rep.arms) + 1, frameon=False)
    fig.suptitle(f"sticky Markov chain: mean over {len(rep.seeds)} seed(s), band: min to max")
    out.append(save(fig, os.path.join(folder, "attention_loss"), fmt))

    steps = sorted(rep.heatmaps[rep.arms[0]])
    fig, axes = subplots(len(rep.arms), len(steps), size=(PAGE, 0.3 + 2.0 * len(rep.arms)), squeeze=False,
                         sharex=True, sharey=True)
    heatmap_grid(fig, axes, [rep.heatmaps[arm][step] for arm in rep.arms for step in steps],
                 label=r"attention weight $\alpha_{ij}$")
    for r, arm in enumerate(rep.arms):
        for c, step in enumerate(steps):
            ax = axes[r][c]
            ax.set_title(f"{arm}, step {step}")
            if r == len(rep.arms) - 1:
                ax.set_xlabel("key position $j$")
            if c == 0:
                ax.set_ylabel("query position $i$")
    fig.suptitle(f"attention weights of the first tokens, seed {rep.seeds[0]} (grey: masked, 0)")
    out.append(save(fig, os.path.join(folder, "attention_heatmaps"), fmt))

    fig, ax = subplots(size=(COLUMN, 2.4))
    x = np.arange(len(rep.arms))
    pca = np.stack([rep.value_pca[a].mean(axis=0) for a in rep.arms])
    ax.bar(x - 0.2, pca[:, 0], 0.4, label="PC1")
    ax.bar(x + 0.2, pca[:, 1], 0.4, label="PC2")
    ax.set_xticks(x, rep.arms)
    ax.set_xlabel("arm")
    ax.set_ylabel("fraction of variance explained")
    ax.set_ylim(0, 1.15)
    ax.set_title(r"PCA of the value vectors' trajectory ($\mu_k W_V$ over steps)")
    ax.legend(loc="upper right", ncols=2)
    out.append(save(fig, os.path.join(folder, "attention_value_pca"), fmt))
    return out
