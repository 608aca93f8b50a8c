"""The PNG figures of :mod:`pyengine.experiments.positions` (matplotlib, Agg backend).

positions_depth.png: positional share and probe R^2 (with the shuffled control) against depth;
positions_angles.png: principal angles of the positional subspace to layer 0;
placement.png: |h_l|/sqrt(d) and cosine against removal effect, per model (pre and post side by side).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .positions import PositionsReport

__all__ = ["plot_positions"]


def plot_positions(rep: PositionsReport, folder: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    for m in rep.models:
        x = m.layers / max(m.layers.max(), 1)
        (line,) = ax[0].plot(x, m.decomposition.rel_norm, marker="o", ms=3, label=m.name)
        ax[1].plot(x, m.probe.r2, marker="o", ms=3, color=line.get_color(), label=m.name)
        ax[1].plot(x, m.probe.r2_shuffled, ls=":", color=line.get_color())
    ax[0].set(xlabel="relative depth l / L", ylabel=r"$\|pos\| / \|h-\mu\|$", title="positional share")
    ax[1].set(xlabel="relative depth l / L", ylabel=r"CV $R^2$", title="position probe (dotted: shuffled)")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    paths.append(os.path.join(folder, "positions_depth.png"))
    fig.savefig(paths[-1], dpi=150)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.8), constrained_layout=True)
    for m in rep.models:
        a = np.degrees(m.decomposition.angles)
        (line,) = ax.plot(m.layers, a[:, 0], marker="o", ms=3, label=f"{m.name} (smallest)")
        ax.plot(m.layers, a[:, -1], ls="--", color=line.get_color(), label=f"{m.name} (largest)")
    ax.set(xlabel="hidden state l", ylabel="degrees", title="principal angles to layer 0 (top-k positional subspace)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    paths.append(os.path.join(folder, "positions_angles.png"))
    fig.savefig(paths[-1], dpi=150)
    plt.close(fig)

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    for m in rep.models:
        pr = m.placement_profile
        ax[0].plot(np.arange(pr.norm.size), pr.norm, marker="o", ms=3, label=f"{m.name} ({m.placement})")
        ax[1].scatter(pr.influence, pr.removal_effect, s=14, label=f"{m.name}: rho {pr.spearman:+.2f}")
    ax[0].set(xlabel="hidden state l", ylabel=r"$\|h_l\| / \sqrt{d}$", title="norm growth")
    ax[1].set(xlabel="Block Influence 1 - cos", ylabel="removal effect (KL, or final change)",
              title="cosine against removal", xscale="log", yscale="log")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    paths.append(os.path.join(folder, "placement.png"))
    fig.savefig(paths[-1], dpi=150)
    plt.close(fig)
    return paths
