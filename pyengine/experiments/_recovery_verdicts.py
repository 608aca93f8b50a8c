"""The verdicts of :func:`~pyengine.experiments.recovery` and its evaluation protocol.

Every verdict is :func:`decide` applied to the 95 % interval of a difference of rates:
SUPPORTED, CONTRADICTED or NOT RESOLVED, never a label its numbers do not imply.

1. **spectra**: the decay rate equals ``-mean log rho(A_k)`` (within a margin);
2. **residual**: without the residual connection the perturbation decays faster
   (``rate_without - rate_with > 0``; a growth without it contradicts this);
3. **norm eps / gamma scale**: the norm parameter sets the rate (two values of the sweep
   whose rates differ by more than a margin).

An interval of a difference of two fits is the difference plus and minus the sum of
their half-widths: it excludes 0 exactly when the two intervals separate.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ..analysis import DecayFit

#: A :class:`~pyengine.experiments.Recovery` (not imported: its module imports this one).
Recovery = Any

__all__ = ["CONTRADICTED", "NOT_RESOLVED", "SUPPORTED", "decide", "protocol", "verdicts"]

SUPPORTED, CONTRADICTED, NOT_RESOLVED = "SUPPORTED", "CONTRADICTED", "NOT RESOLVED"

#: Prediction (1) accepts |rate + mean log rho| up to SPECTRA_ABS + SPECTRA_REL * |mean log rho|.
SPECTRA_ABS, SPECTRA_REL = 0.05, 0.25
#: Prediction (3): a change of the rate smaller than this (per layer) is no effect.
SWEEP_MARGIN = 0.02


def decide(lo: float, hi: float, predicted: str, margin: float = 0.0) -> str:
    """The verdict on a prediction about a difference, from the difference's 95 % interval.

    ==========  ========================  ======================  ======================  =============
    predicted   the prediction            SUPPORTED               CONTRADICTED            NOT RESOLVED
    ==========  ========================  ======================  ======================  =============
    ``">"``     difference > 0            lo > 0                  hi < 0                  otherwise
    ``"<"``     difference < 0            hi < 0                  lo > 0                  otherwise
    ``"="``     abs(difference) <= m      -m <= lo and hi <= m    hi < -m or lo > m       otherwise
    ``"!="``    abs(difference) > m       hi < -m or lo > m       -m <= lo and hi <= m    otherwise
    ==========  ========================  ======================  ======================  =============

    ``m`` is ``margin`` (>= 0). "Otherwise" is an interval that holds both sides (0, or the
    edge of the margin); an interval with a NaN or infinite bound is NOT RESOLVED.

    Parameters
    ----------
    lo, hi : float
        The interval, lo <= hi.
    predicted : {">", "<", "=", "!="}
    margin : float

    Returns
    -------
    str
        :data:`SUPPORTED`, :data:`CONTRADICTED` or :data:`NOT_RESOLVED`.
    """
    if predicted not in (">", "<", "=", "!="):
        raise ValueError(f"predicted must be one of '>', '<', '=', '!='; got {predicted!r}")
    if not (margin >= 0):
        raise ValueError(f"margin must be >= 0; got {margin!r}")
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return NOT_RESOLVED
    if lo > hi:
        raise ValueError(f"the interval must have lo <= hi; got [{lo}, {hi}]")
    if predicted in (">", "<"):
        above, below = lo > 0, hi < 0
        if not (above or below):
            return NOT_RESOLVED
        return SUPPORTED if above == (predicted == ">") else CONTRADICTED
    inside, outside = -margin <= lo and hi <= margin, hi < -margin or lo > margin
    if not (inside or outside):
        return NOT_RESOLVED
    return SUPPORTED if inside == (predicted == "=") else CONTRADICTED


def _solid(f: DecayFit) -> bool:
    """A fit with a finite rate and a finite 95 % interval (at least 3 layers)."""
    return f.n_points >= 3 and all(math.isfinite(v) for v in (f.rate, *f.rate_ci))


def _half(f: DecayFit) -> float:
    return (f.rate_ci[1] - f.rate_ci[0]) / 2


def _ci(f: DecayFit, digits: int = 3) -> str:
    """The rate's 95 % interval, or why there is none."""
    if not all(math.isfinite(v) for v in f.rate_ci):
        return "[no interval: fewer than 3 layers]"
    return f"[{f.rate_ci[0]:+.{digits}f}, {f.rate_ci[1]:+.{digits}f}]"


def _fmt_fit(f: DecayFit) -> str:
    return f"{f.rate:+.3f} {_ci(f)} per layer (R^2 {f.r2:.2f}, {f.n_points} layers)"


def _diff(a: DecayFit, b: DecayFit) -> tuple[float, float, float]:
    """``a.rate - b.rate`` and its interval (the sum of the half-widths)."""
    d, h = a.rate - b.rate, _half(a) + _half(b)
    return d, d - h, d + h


def _spectra(r: Recovery) -> str:
    cfg, fit = r.config, r.fit_exact
    g = r.gain_linear
    gains = (f"linearized gain along v, v.A_k delta / v.delta: geometric mean {math.exp(np.nanmean(np.log(g))):.4f} "
             f"per block (range {np.nanmin(g):.4f}-{np.nanmax(g):.4f})" if np.isfinite(g).any() else
             "linearized gain along v: undefined (zero projection)")
    what = "predicted: the decay rate is -mean log rho(A_k) over the blocks passed"
    if r.spectra_skipped:
        return f"(1) spectra: {NOT_RESOLVED} (spectra skipped): {what}; measured {_fmt_fit(fit)}; {gains}."
    formed = ~np.isnan(r.rho).all(axis=1)  # spectra_layers may leave blocks out (NaN rows)
    if not formed.all():
        what += f" whose spectra were formed ({int(formed.sum())} of {formed.size})"
    rho, sigma, ones = r.rho[formed], r.sigma[formed], r.ones_residual[formed]
    pred = float(-np.log(rho.max(axis=1)).mean())
    rho_min, sig, one = float(rho.min()), sigma.max(axis=1), float(ones.max())
    if cfg.placement == "pre" and cfg.residual and cfg.norm == "layernorm":
        bound = (f"rho(A_k) >= 1 for every pre-LN residual block: each LayerNorm Jacobian annihilates the "
                 f"all-ones vector, so A_k 1 = 1 (measured max |A_k 1 - 1| = {one:.1e}); measured min rho = "
                 f"{rho_min:.4f}, so -log rho <= 0 predicts no decay")
    else:
        bound = (f"this stack ({cfg.placement}-{cfg.norm}, residual {'on' if cfg.residual else 'off'}) has no "
                 f"structural eigenvalue 1 (max |A_k 1 - 1| = {one:.2e}): the bound is measured, min rho = "
                 f"{rho_min:.4f}")
    if not cfg.causal:
        bound += ("; attention is not causal here, so the full Jacobian is not block-triangular and these "
                  "per-token blocks do not carry its eigenvalues")
    how = r.spectra_how
    if how is not None and not (how["rho_converged"].all() and how["sigma_converged"].all()):
        bound += (f"; NOT CONVERGED: rho at {int((~how['rho_converged']).sum())} and sigma_max at "
                  f"{int((~how['sigma_converged']).sum())} of {how['rho_converged'].size} (block, token) pairs "
                  f"(the solvers' last iterates, marked ? in the table, not exact)")
    tol = SPECTRA_ABS + SPECTRA_REL * abs(pred)
    if _solid(fit):
        head = decide(fit.rate_ci[0] - pred, fit.rate_ci[1] - pred, "=", tol)
        why = (f"rate - ({pred:+.3f}) = {fit.rate - pred:+.3f}, interval [{fit.rate_ci[0] - pred:+.3f}, "
               f"{fit.rate_ci[1] - pred:+.3f}] against the margin +-{tol:.3f}")
    else:
        head, why = f"{NOT_RESOLVED} (the fit has no interval: fewer than 3 layers)", "no interval"
    return (f"(1) spectra: {head}: {what} = {pred:+.3f}; measured {_fmt_fit(fit)}; {why}; "
            f"sigma_max {sig.min():.3f}-{sig.max():.3f}; {gains}. {bound}.")


def _residual(r: Recovery) -> str:
    fit, nr = r.fit_exact, r.no_residual
    what = "predicted: without the residual connection the perturbation decays faster (rate without - with > 0)"
    nums = f"with residual {_fmt_fit(fit)}, without {_fmt_fit(nr)}"
    if not (_solid(nr) and _solid(fit)):
        return f"(2) residual: {NOT_RESOLVED} (a fit has no interval: fewer than 3 layers): {what}; {nums}."
    d, lo, hi = _diff(nr, fit)
    head = decide(lo, hi, ">")
    sign = "grows" if nr.rate < 0 else "decays"
    return (f"(2) residual: {head}: {what}; {nums}; without it the perturbation {sign}; difference {d:+.3f}, "
            f"interval [{lo:+.3f}, {hi:+.3f}].")


def _sweep(name: str, sweep: list[tuple[float, DecayFit]]) -> str:
    what = f"predicted: the {name} sets the rate (two values whose rates differ by more than {SWEEP_MARGIN}/layer)"
    vals = ", ".join(f"{v:.3g}: {_fmt_fit(f)}" for v, f in sweep)
    if len(sweep) < 2 or not all(_solid(f) for _, f in sweep):
        return f"(3) {name}: {NOT_RESOLVED} (fewer than two values or a fit without an interval): {what}; {vals}."
    pairs = [((v1, f1), (v2, f2)) for (v1, f1), (v2, f2) in itertools.combinations(sweep, 2)]
    heads = [decide(*_diff(f2, f1)[1:], "!=", SWEEP_MARGIN) for (_, f1), (_, f2) in pairs]
    head = (SUPPORTED if SUPPORTED in heads else CONTRADICTED if all(h == CONTRADICTED for h in heads)
            else NOT_RESOLVED)
    # the pair quoted: the one furthest from no effect
    (v1, f1), (v2, f2) = max(pairs, key=lambda p: abs(p[1][1].rate - p[0][1].rate) - _half(p[0][1]) - _half(p[1][1]))
    d, lo, hi = _diff(f2, f1)
    return (f"(3) {name}: {head}: {what}; rate at {v2:.3g} - at {v1:.3g} = {d:+.3f}, interval [{lo:+.3f}, "
            f"{hi:+.3f}]; {vals}.")


def verdicts(r: Recovery, tol: float) -> list[str]:
    """One line per prediction of ``r`` (see the module docstring), and the linear regime
    (``tol``: the relative gap that still counts as linear)."""
    out = [_spectra(r), _residual(r)]
    out += [_sweep(name, sweep) for name, sweep in (("eps", r.eps_sweep), ("gamma scale", r.gamma_sweep))]
    lr = r.linear_regime
    span = (f"only at scale {lr[0]:g} (of those tried)" if lr and lr[0] == lr[1] else
            f"for scales {lr[0]:g} to {lr[1]:g}" if lr else "")
    out.append("linear regime: " + (f"exact and linearized delta agree within {tol:.0%} (|d_ex - d_lin| / "
                                    f"|d_lin| at the read-out, every layer) {span}"
                                    if lr else f"no scale tried keeps exact and linearized delta within "
                                    f"{tol:.0%}") + ".")
    return out


def protocol(r: Recovery, default_weights: bool, directions_given: bool) -> str:
    """The evaluation protocol of ``r`` in one line."""
    ex, fe = r.exact, r.fit_exact
    dirs = f"{ex.K} given directions" if directions_given else f"{ex.K} random directions seeded by seed {r.seed}"
    weights = (f"the default model, weights seeded by seed {r.seed}" if default_weights else
               f"model {r.model}, its given weights")
    sc = r.scaling
    lin = ("linear model: exact (d basis JVPs)" if sc is not None and sc.exact else
           f"linear model: {sc.n_probes} Rademacher probes seeded by seed {r.seed}, +- 1 standard error"
           if sc is not None else "linear model: not run")
    return (f"protocol: one sequence of {ex.T} tokens, in-sample (nothing is trained or held out); {weights}; "
            f"{dirs}; rate: least-squares slope of log mean |projection| ({r.read}) over {fe.n_points} layers, "
            f"interval: its 95 % Student t interval; a difference of two rates: +- the sum of their "
            f"half-widths; {lin}")
