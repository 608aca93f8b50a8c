"""Text, JSON, CSV and figure output of a :class:`~pyengine.experiments.Recovery`.

The verdicts (one line per prediction of :mod:`pyengine.experiments.recovery`) and the
thresholds they use are in ``pyengine.experiments._recovery_verdicts``.
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from .._figures import PAGE, check_format, layer_axis, log_axis, save, styled, subplots
from ..provenance import provenance as gather
from ._recovery_verdicts import _ci

if TYPE_CHECKING:
    from ..analysis import DecayFit

#: A :class:`~pyengine.experiments.Recovery` (not imported: recovery.py imports this module).
Recovery = Any

__all__ = ["LINEAR_TOL", "format_table", "write"]

#: Relative disagreement of exact and linearized projections that still counts as linear.
LINEAR_TOL = 0.10

_COLS = [  # key, header, width, format
    ("layer", "k", 3, "g"),  # g: a site row inside a block is k + 0.5
    ("h_norm", "|h|", 10, ".3g"),
    ("delta_norm", "|delta|", 10, ".3g"),
    ("projection", "proj", 10, ".3g"),
    ("projection_linear", "proj lin", 10, ".3g"),
    ("cosine", "cos", 9, ".4f"),
    ("norm_ratio", "|h'|/|h|", 10, ".4f"),
    ("gain_linear", "gain", 9, ".4f"),
    ("rho", "rho", 9, ".4f"),
    ("sigma_max", "sig_max", 9, ".3f"),
    ("adjacent_cosine", "cos(h,h+)", 10, ".4f"),
]
#: The column after _COLS: which solver gave rho / sig_max ("dense" for both: the formed matrix).
_HOW_WIDTH = 18
#: Appended to a rho or sig_max cell whose solver did not converge (a lower bound, not exact).
UNCONVERGED = "?"
_CONVERGED = {"rho": "rho_converged", "sigma_max": "sigma_converged"}


def _how(row: dict[str, Any]) -> str:
    r, s = row.get("rho_method"), row.get("sigma_method")
    if r is None:
        return f"{'-':>{_HOW_WIDTH}}"
    return f"{r if r == s else f'{r}/{s}':>{_HOW_WIDTH}}"


def _row(row: dict[str, Any]) -> str:
    cells = []
    for key, _, w, f in _COLS:
        if key in _CONVERGED and row[_CONVERGED[key]] is False:
            cells.append(f"{format(row[key], f) + UNCONVERGED:>{w}}")
        else:
            cells.append(_cell(w, f, row[key]))
    return "".join(cells) + _how(row)


def _cell(width: int, fmt: str, v: Any) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return f"{'-':>{width}}"
    return f"{v:>{width}{fmt}}"


def format_table(rep: Recovery) -> str:
    """The per-layer table and the verdicts, as printed by ``pyengine recovery``."""
    ex = rep.exact
    lines = [
        f"model: {rep.model}",
        f"tokens: T = {ex.T}; injected at {_where(rep)} on "
        f"{ex.positions.size} position(s); K = {ex.K} directions x S = {ex.S} scales; read-out: {rep.read} token(s); "
        f"table at scale {rep.protocol_scale:g}, mean over directions",
        "gain (v.A delta / v.delta, linearized) and cos(h,h+) = cos(h_k-1, h_k): the block arriving at k; "
        "rho, sig_max: the diagonal Jacobian block (float64) of the block leaving k; solver: rho's/sig_max's "
        f"(dense: the formed matrix); {UNCONVERGED}: the solver did not converge (the last iterate, not exact)",
        "".join(f"{h:>{w}}" for _, h, w, _f in _COLS) + f"{'solver':>{_HOW_WIDTH}}",
    ]
    for row in rep.layer_table():
        lines.append(_row(row))
    fe, fl = rep.fit_exact, rep.fit_linear
    lines.append(f"decay of |projection| ({rep.read}; rate > 0 decays, < 0 grows): exact {fe.rate:+.4f}/layer "
                 f"{_ci(fe, 4)}, R^2 {fe.r2:.3f}, {fe.timescale()}; linearized {fl.rate:+.4f}/layer, "
                 f"R^2 {fl.r2:.3f}")
    lines.extend(_linear_model_lines(rep))
    if rep.spectra_skipped:
        lines.append("block Jacobian spectra: skipped (--no-spectra): rho, sig_max and verdict (1) are not computed")
    lines.extend(rep.verdicts)
    if rep.protocol:
        lines.append(rep.protocol)
    return "\n".join(lines)


def _ones_line(cfg: Any, drift: float) -> str:
    """What the stack's structure says about J_k 1, and the measured drift."""
    if cfg.placement == "pre" and cfg.residual and cfg.norm == "layernorm":
        return ("every LayerNorm Jacobian annihilates 1, so in a pre-LN residual stack J_k 1 = 1: a uniform "
                f"delta passes every branch unseen (measured max |J_k 1 - 1| = {drift:.1e})")
    return (f"this stack ({cfg.placement}-{cfg.norm}, residual {'on' if cfg.residual else 'off'}) does not "
            f"annihilate 1 by construction: measured max |J_k 1 - 1| = {drift:.1e}")


def _linear_model_lines(rep: Recovery) -> list[str]:
    """The linear model's table: the scaling fit of J_k and the uniform split of delta."""
    sc, un = rep.scaling, rep.uniform
    if sc is None or un is None:
        return []
    est = ("exact: d basis JVPs" if sc.exact else
           f"Hutchinson, {sc.n_probes} Rademacher probes; +- 1 standard error")
    lines = [f"linear model: J_k = d h_k / d h_{sc.layer} at token {sc.token} (diagonal block, d = {sc.d}) fitted by "
             f"alpha I + beta 11^T/d ({est}); unexpl: the fraction of |J_k|_F^2 the fit leaves; "
             f"|unif|, |rest|: norms of mean(delta) 1 and delta - mean(delta) 1 (exact, scale "
             f"{rep.protocol_scale:g}, read-out); {_ones_line(rep.config, float(np.nanmax(sc.ones_drift)))}",
             f"{'k':>3}{'alpha':>18}{'beta':>18}{'unexpl':>20}{'|unif|':>11}{'|rest|':>11}"]
    u, r = (x.copy() for x in un["exact"])
    if not float(rep.exact.layers[0]).is_integer():  # row 0 of a site injection is the site, not h_layer
        u[0] = r[0] = np.nan

    def pm(v: float, se: float, fmt: str) -> str:
        return f"{v:{fmt}}" + (" " * 9 if sc.exact else f" +-{se:.1e}")

    for i in range(sc.alpha.size):
        lines.append(f"{sc.layer + i:>3}{pm(sc.alpha[i], sc.alpha_se[i], '>9.5f')}{pm(sc.beta[i], sc.alpha_se[i], '>9.5f')}"
                     f"{pm(sc.unexplained[i], sc.unexplained_se[i], '>11.3e')}"
                     f"{_cell(11, '.3g', float(u[i]))}{_cell(11, '.3g', float(r[i]))}")
    return lines


def _clean(o: Any) -> Any:
    """Plain JSON values: NumPy scalars and arrays become Python ones, NaN and inf None."""
    if isinstance(o, np.ndarray):
        if o.dtype.kind in "biu" or (o.dtype.kind == "f" and np.isfinite(o).all()):
            return o.tolist()  # nothing to clean: Python numbers, all finite
        o = o.tolist()
    elif isinstance(o, np.generic):
        o = o.item()
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def write(rep: Recovery, folder: str, plots: bool = True, fmt: str = "png",
          provenance: dict[str, Any] | None = None) -> list[str]:
    """Write recovery.json, layers.csv, metrics.csv and (if ``plots``) the figures
    recovery.<fmt> and recovery_linear_model.<fmt> (``fmt``: png, pdf or svg); return the
    paths. ``provenance``: recovery.json's block (default :func:`pyengine.provenance.provenance` now)."""
    check_format(fmt)
    os.makedirs(folder, exist_ok=True)
    paths = []
    p = os.path.join(folder, "recovery.json")
    with open(p, "w") as f:
        json.dump(_clean({**rep.to_dict(), "provenance": provenance or gather(model=rep.model)}), f,
                  indent=1, allow_nan=False)
    paths.append(p)
    p = os.path.join(folder, "layers.csv")
    rows = rep.layer_table()
    with open(p, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    paths.append(p)
    p = os.path.join(folder, "metrics.csv")
    with open(p, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "layer", "direction", "scale", "position", "token", "injected",
                    "cosine", "projection", "norm_ratio", "delta_norm"])
        for run in (rep.exact, rep.linear):
            name = "linearized" if run.linearized else "exact"
            inj = run.position_mask("injected")
            tok = rep.tokens if rep.tokens is not None else [""] * run.T
            # the metrics formatted column by column from Python floats (rows in C order of (L', N, T))
            cols = [[f"{x:.9g}" for x in m.ravel().tolist()]
                    for m in (run.cosine, run.projection, run.norm_ratio, run.delta_norm)]
            S = run.S
            keys = [(name, f"{k:g}", n // S, f"{run.scales[n % S]:g}", t, tok[t], int(inj[t]))
                    for k in run.layers for n in range(run.N) for t in range(run.T)]
            w.writerows([*key, *vals] for key, *vals in zip(keys, *cols))
    paths.append(p)
    if plots:
        paths.append(save(figure(rep), os.path.join(folder, "recovery"), fmt))
        if rep.scaling is not None:
            paths.append(save(linear_model_figure(rep), os.path.join(folder, "recovery_linear_model"), fmt))
    return paths


@styled
def linear_model_figure(rep: Recovery) -> Any:
    """The linear model's figure: alpha and beta of the scaling fit of J_k, the fraction of
    ``|J_k|_F^2`` it leaves, and the uniform split of delta (x: the hidden state k)."""
    sc, (u, r) = rep.scaling, rep.uniform["exact"]
    k = np.arange(sc.layer, sc.layer + sc.alpha.size)
    fig, ax = subplots(1, 3, size=(PAGE, 2.6))
    se = None if sc.exact else sc.alpha_se
    ax[0].errorbar(k, sc.alpha, yerr=se, fmt="o-", capsize=2, label=r"$\alpha$ ($I$)")
    ax[0].errorbar(k, sc.beta, yerr=se, fmt="s--", capsize=2, label=r"$\beta$ ($\mathbf{1}\mathbf{1}^\top/d$)")
    ax[0].axhline(0.0, color="k", lw=0.6)
    ax[0].set(title=r"$J_k \approx \alpha I + \beta\,\mathbf{1}\mathbf{1}^\top/d$", ylabel="coefficient")
    ax[1].errorbar(k[1:], sc.unexplained[1:], yerr=None if se is None else sc.unexplained_se[1:], fmt="o-",
                   capsize=2)
    ax[1].set(title=r"unexplained share of $\|J_k\|_F^2$", ylabel="unexplained")
    if (sc.unexplained[1:] > 0).all():
        log_axis(ax[1])
    x = rep.exact.layers
    for y, style, lab in ((u, "o-", r"$\|\bar\delta\,\mathbf{1}\|$ (uniform)"),
                          (r, "s-", r"$\|\delta - \bar\delta\,\mathbf{1}\|$")):
        ax[2].plot(x, np.where(y > 0, y, np.nan), style, label=lab)
        _zeros(ax[2], x, y, ax[2].lines[-1].get_color())
    log_axis(ax[2])
    ax[2].set(title=f"uniform split of $\\delta$ (exact, $\\alpha$ = {rep.protocol_scale:g})", ylabel="norm")
    for a in ax:
        a.set_xlabel("hidden state $k$")
        layer_axis(a)
    ax[0].legend(frameon=False)
    ax[2].legend(frameon=False)
    est = "exact" if sc.exact else f"Hutchinson, {sc.n_probes} probes, $\\pm$1 s.e."
    fig.suptitle(f"linear model from $h_{{{sc.layer}}}$ at token {sc.token} ({est}); "
                 f"max $|J_k \\mathbf{{1}} - \\mathbf{{1}}|$ = {float(np.nanmax(sc.ones_drift)):.1e}")
    return fig


def _zeros(a: Any, x: np.ndarray, y: np.ndarray, color: Any = None) -> None:
    """Where y is 0 (not drawable on a log axis): a hollow triangle on the bottom edge."""
    from matplotlib.transforms import blended_transform_factory

    z = np.isfinite(y) & (y <= 0)
    if z.any():
        a.plot(np.asarray(x)[z], np.zeros(int(z.sum())), "v", mfc="none", color=color, clip_on=False,
               transform=blended_transform_factory(a.transData, a.transAxes), label="0 (off the log axis)")


def _span(pos: np.ndarray) -> str:
    if pos.size > 1 and np.all(np.diff(pos) == 1):
        return f"{pos[0]}-{pos[-1]}"
    return ",".join(map(str, pos[:8])) + (",..." if pos.size > 8 else "")


#: Mathtext of the quantities on the recovery figure, and the two runs' line styles.
INJ, BASE = r"h_{\mathrm{inj}}", r"h_{\mathrm{base}}"
EXACT = dict(color="C0", marker="o", ls="-", label="exact")
LINEAR = dict(color="C1", marker="s", ls="--", mfc="none", label="linearized")
RHO = dict(color="0.15", marker="^", ls="-", label=r"$\rho$ (spectral radius)")
SIGMA = dict(color="0.55", marker="v", ls=":", label=r"$\sigma_{\max}$ (spectral norm)")
GAP = dict(color="C2", marker="D", ls="-", label="linearization error")


def _legend(fig: Any, zeros: bool) -> None:
    """One legend for the whole figure, below the panels (it covers no data)."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], **EXACT), Line2D([], [], **LINEAR),
               Line2D([], [], color="0.4", ls=":", label=r"fit $|p_k| \propto e^{-\lambda k}$ ($\lambda$ > 0 decays)"),
               Line2D([], [], color="k", lw=1.6, label=r"$\|%s\|$" % BASE),
               Line2D([], [], **RHO), Line2D([], [], **SIGMA),
               Line2D([], [], **GAP), Line2D([], [], color="k", lw=0.6, ls="--", label=f"{LINEAR_TOL:.0%} error")]
    if zeros:
        handles.append(Line2D([], [], color="0.4", marker="v", mfc="none", ls="none", label="0 (off the log axis)"))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 5), frameon=False)


@styled
def figure(rep: Recovery) -> Any:
    """The report's figure (six panels, x always the hidden state k except the scale sweep)."""
    ex, li, j = rep.exact, rep.linear, rep.scale_index
    k = ex.layers
    fig, ax = subplots(2, 3, size=(PAGE, 5.0))

    def mean(p: Any, metric: str) -> np.ndarray:
        return p.view(metric, rep.read).reshape(-1, p.K, p.S)[:, :, j].mean(axis=1)

    a = ax[0, 0]
    for p, fit, style in ((ex, rep.fit_exact, EXACT), (li, rep.fit_linear, LINEAR)):
        y = mean(p, "projection")
        a.plot(k, np.where(y > 0, y, np.nan), **style)
        if math.isfinite(fit.rate):
            a.plot(k, np.exp(fit.intercept - fit.rate * k), ":", color=style["color"])
        _zeros(a, k, y, style["color"])
    log_axis(a)
    a.set(title=f"projection on $v$ ($\\alpha$ = {rep.protocol_scale:g})\n$\\lambda$ per layer: "
                f"exact {rep.fit_exact.rate:+.3f}, linearized {rep.fit_linear.rate:+.3f}",
          ylabel=r"$|p_k| = |(%s - %s)\cdot v|$" % (INJ, BASE))
    for a, metric, title, ylabel in (
            (ax[0, 1], "cosine", "direction", r"$\cos(%s, %s)$" % (INJ, BASE)),
            (ax[0, 2], "norm_ratio", "norm", r"$\|%s\| / \|%s\|$" % (INJ, BASE))):
        a.plot(k, mean(ex, metric), **EXACT)
        a.plot(k, mean(li, metric), **LINEAR)
        a.set(title=title, ylabel=ylabel)
    a = ax[1, 0]
    m = ex.position_mask(rep.read)
    for p, style in ((ex, EXACT), (li, LINEAR)):
        y = mean(p, "delta_norm")
        a.plot(k, np.where(y > 0, y, np.nan), **style)
        _zeros(a, k, y, style["color"])
    a.plot(k, ex.base_norm[:, m].mean(axis=1), "k-", lw=1.6)
    log_axis(a)
    a.set(title=r"perturbation $\delta_k = %s - %s$" % (INJ, BASE), ylabel=r"$\|\delta_k\|$, $\|%s\|$" % BASE)
    a = ax[1, 1]
    if rep.spectra_skipped:
        a.text(0.5, 0.5, "spectra skipped (--no-spectra)", transform=a.transAxes, ha="center", va="center")
        a.set(xlim=(k[0], k[-1]), yticks=[])
    else:
        ks = np.arange(rep.layer, rep.layer + rep.rho.shape[0])  # block k + 1 leaves hidden state k
        a.plot(ks, rep.rho.max(axis=1), **RHO)
        a.plot(ks, rep.sigma.max(axis=1), **SIGMA)
        a.axhline(1.0, color="k", lw=0.6)
        log_axis(a)
    a.set(title="Jacobian of block $k+1$ at the read token", ylabel=r"$\rho$, $\sigma_{\max}$")
    for a in (*ax[0], ax[1, 0], ax[1, 1]):
        a.set_xlabel("hidden state $k$")
        layer_axis(a)
    a = ax[1, 2]
    gap = rep.linear_gap
    a.plot(ex.scales, np.where(gap > 0, gap, np.nan), **GAP)
    _zeros(a, ex.scales, gap, GAP["color"])
    a.axhline(LINEAR_TOL, color="k", lw=0.6, ls="--")
    log_axis(a, "x")
    log_axis(a, "y")
    a.set(title="linearization error", xlabel=r"injection scale $\alpha$",
          ylabel=r"$\max_k \|\delta_k^{\mathrm{ex}} - \delta_k^{\mathrm{lin}}\| / \|\delta_k^{\mathrm{lin}}\|$")
    _legend(fig, any(line.get_marker() == "v" and line.get_linestyle() == "None" for x in ax.flat for line in x.lines))
    text = rep.text if rep.text is None or len(rep.text) <= 60 else rep.text[:57] + "..."
    fig.suptitle(f"pyengine recovery: {rep.model}; text {text!r}\ninjected at {_where(rep)}, "
                 f"positions {_span(ex.positions)} of T = {ex.T}; read-out: {rep.read}")
    return fig


def _where(rep: Any) -> str:
    """Where a recovery run injected: the hidden state, or the site inside a block."""
    if getattr(rep, "site", None) and "resid_p" not in rep.site:
        return f"site {rep.site} (inside block {rep.layer + 1})"
    return f"hidden state {rep.layer} (input of block {rep.layer + 1})"
