"""The figures of :mod:`pyengine.experiments.positions` (png, pdf or svg).

positions_depth: positional share (dashed: without the first positions, dotted: each token at unit
RMS) and probe R^2 (with the shuffled control) against depth;
positions_angles: principal angles of the positional subspace to layer 0;
placement: |h_l|/sqrt(d) and cosine against removal effect, per model (pre and post side by side).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .._figures import COLUMN, PAGE, check_format, layer_axis, log_axis, save, styled, subplots

#: A :class:`~pyengine.experiments.positions.PositionsReport` (not imported: positions.py imports this module).
PositionsReport = Any

__all__ = ["plot_positions"]


def _legend(fig: Any, handles: list[Any], ncols: int = 4) -> None:
    """One legend below the panels, where it covers no data."""
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), ncols), frameon=False)


@styled
def plot_positions(rep: PositionsReport, folder: str, fmt: str = "png") -> list[str]:
    """Write the three figures in ``fmt`` (png, pdf or svg) to ``folder``; the paths written."""
    from matplotlib.lines import Line2D

    check_format(fmt)
    paths = []
    models = [Line2D([], [], color=f"C{i}", marker="o", label=m.name) for i, m in enumerate(rep.models)]
    fig, ax = subplots(1, 2, size=(PAGE, 2.6))
    for i, m in enumerate(rep.models):
        x = m.layers / max(m.layers.max(), 1)
        ax[0].plot(x, m.decomposition.rel_norm, marker="o", color=f"C{i}")
        for key, ls in (("without_first", "--"), ("normalized", ":")):
            if key in m.variants:
                ax[0].plot(x, m.variants[key].rel_norm, ls=ls, color=f"C{i}")
        ax[1].plot(x, m.probe.r2, marker="o", color=f"C{i}")
        ax[1].plot(x, m.probe.r2_shuffled, ls=":", color=f"C{i}")
    ax[0].set(xlabel=r"relative depth $\ell / L$", ylabel=r"$\|\mathrm{pos}\|_F \,/\, \|h - \mu\|_F$",
              title="positional share of the centred stream")
    ax[1].set(xlabel=r"relative depth $\ell / L$", ylabel=r"cross-validated $R^2$", title="linear probe of the position")
    for a in ax:
        a.grid(True)
    _legend(fig, models + [Line2D([], [], color="0.4", ls="--", label="left: without the first positions"),
                           Line2D([], [], color="0.4", ls=":", label="left: tokens at unit RMS; right: probe on "
                                  "shuffled positions (control)")])
    paths.append(save(fig, os.path.join(folder, "positions_depth"), fmt))

    fig, ax = subplots(size=(COLUMN, 2.7))
    for i, m in enumerate(rep.models):
        a = np.degrees(m.decomposition.angles)
        ax.plot(m.layers, a[:, 0], marker="o", color=f"C{i}")
        ax.plot(m.layers, a[:, -1], ls="--", color=f"C{i}")
    ax.set(xlabel=r"hidden state $\ell$", ylabel="principal angle (degrees)",
           title="positional subspace against layer 0")
    layer_axis(ax)
    ax.grid(True)
    _legend(fig, models + [Line2D([], [], color="0.4", label="smallest angle"),
                           Line2D([], [], color="0.4", ls="--", label="largest angle")], ncols=2)
    paths.append(save(fig, os.path.join(folder, "positions_angles"), fmt))

    fig, ax = subplots(1, 2, size=(PAGE, 2.6))
    handles = []
    for i, m in enumerate(rep.models):
        pr = m.placement_profile
        ax[0].plot(np.arange(pr.norm.size), pr.norm, marker="o", color=f"C{i}")
        ax[1].scatter(pr.influence, pr.removal_effect, s=12, color=f"C{i}")
        name = m.name if f"{m.placement}-LN" in m.name else f"{m.name} ({m.placement}-LN)"
        handles.append(Line2D([], [], color=f"C{i}", marker="o",
                              label=f"{name} (right: Spearman $\\rho$ = {pr.spearman:+.2f})"))
    ax[0].set(xlabel=r"hidden state $\ell$", ylabel=r"$\|h_\ell\| / \sqrt{d}$", title="norm growth")
    layer_axis(ax[0])
    ax[1].set(xlabel=r"block influence $1 - \cos(h_{\ell-1}, h_\ell)$", ylabel="removal effect (KL, or final change)",
              title="cosine against block removal")
    log_axis(ax[1], "x")
    log_axis(ax[1], "y")
    for a in ax:
        a.grid(True)
    _legend(fig, handles, ncols=2)
    paths.append(save(fig, os.path.join(folder, "placement"), fmt))
    return paths
