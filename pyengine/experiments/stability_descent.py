"""The descent part of ``pyengine stability``: steepest descent under three norms and the
training-time stability of four gradient rules on one toy task, with σ_max(W_t) tracked.

Task (seeded): L(W) = ½ ||(W - W*) C^½||_F² / ||W* C^½||_F², W* (d_out, d_in) with N(0, 1/d_in)
entries, C^½ = Q diag(10^[-1, 0]) Qᵀ (C's eigenvalues 10^[-2, 0]). L is the population loss
of the regression y = W* x, x ~ N(0, C): there is no sample, so nothing is held out and the
loss reported is the held-out one. W_0 = 0; the gradient is that of the unscaled loss,
g = (W - W*) C, so plain GD is stable for η < 2/λ_max(C) = 2. Step k of ``steps`` uses
η_k = lr (1 - k/steps) (linear decay to 0); each method keeps the lr of its grid with the
smallest final loss.

Methods (``METHODS``):

==============  =================================================================================
"gd"            steepest descent under ℓ2: Δ = η_k t, t = -g rescaled to ||t||_F = √min(d_out, d_in)
"sign"          steepest descent under ℓ∞: t ∝ -sign(g), rescaled the same way
"spectral"      steepest descent under σ_max: t ∝ -U Vᵀ (g = U Σ Vᵀ), rescaled the same way
"plain"         plain gradient descent: Δ = -η g (the base of "clipped" and "weight_decay")
"normalized"    normalized gradient descent: Δ = -η g/||g||_F, a step of norm exactly η
"clipped"       gradient clipping by norm: Δ = -η g min(1, c/||g||_F), so ||Δ||_F <= η c
"weight_decay"  decoupled (AdamW-style) weight decay on plain GD: W <- (1 - ηλ) W - η g
==============  =================================================================================

The three steepest-descent steps have matched Frobenius norms (the same lr grid gives the
same step lengths), which makes "gd" normalized gradient descent with η √min(d_out, d_in):
"normalized" is the same direction in its textbook unit-norm form, ||Δ||_F = η. (The seed
text writes the normalized step as g/||g||²; that is a typo: the unit-norm step is g/||g||.)
Weight decay is decoupled, W <- W - ηλW beside the gradient step (g taken at W_t), as in
AdamW. On plain GD the coupled form (L2 term λ||W||²/2 in the loss) gives the same update;
the two differ once the gradient step is rescaled (Adam, normalized steps, Muon).

The steepest-descent methods search ``lrs``, the training-time ones ``train_lrs``, which by
default extends ``lrs`` past plain GD's stability edge η = 2. Every run records σ_max(W_t)
(exact, ``numpy.linalg.norm(W, 2)``); the verdict of a method reads the peak over its whole
grid against σ_max(W*), the σ_max that the solution itself needs (:func:`sigma_verdict`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import _validate as _v
from ..linalg.steepest import steepest_descent

__all__ = ["BOUND", "CLIP", "Descent", "LRS", "METHODS", "TRAIN_LRS", "WEIGHT_DECAY", "descent_demo",
           "descent_finding", "format_descent", "plot_descent", "sigma_verdict", "training_step"]

#: Steepest-descent methods (name, norm of :func:`~pyengine.linalg.steepest_descent`).
STEEPEST = (("gd", "l2"), ("sign", "linf"), ("spectral", "spectral"))
#: Training-time gradient rules of :func:`training_step`.
TRAINING = ("plain", "normalized", "clipped", "weight_decay")
METHODS = tuple(n for n, _ in STEEPEST) + TRAINING
#: The lr grid of the steepest-descent methods, and that of the training-time rules.
LRS = (0.003, 0.01, 0.03, 0.1, 0.3)
TRAIN_LRS = LRS + (1.0, 3.0)
#: Clipping threshold c (the default task's first gradient has ||g_0||_F = 1.99) and decay λ.
CLIP, WEIGHT_DECAY = 1.0, 0.1
#: σ_max is bounded when it stays <= BOUND σ_max(W*) at every step of every lr of the grid.
BOUND = 2.0
#: A run ends "below the target" when its last σ_max is under (1 - SHRUNK) σ_max(W*).
SHRUNK = 0.1

RULES = {"gd": "steepest descent, l2 (t = -g at fixed Frobenius norm)",
         "sign": "steepest descent, l-inf (t ~ -sign g at fixed Frobenius norm)",
         "spectral": "steepest descent, spectral (t ~ -U V^T at fixed Frobenius norm)",
         "plain": "W <- W - eta g",
         "normalized": "W <- W - eta g / ||g||_F",
         "clipped": "W <- W - eta g min(1, c / ||g||_F)",
         "weight_decay": "W <- (1 - eta lambda) W - eta g (decoupled, AdamW-style)"}


def training_step(w: Any, g: Any, method: str, lr: float, *, clip: float = CLIP,
                  weight_decay: float = WEIGHT_DECAY) -> np.ndarray:
    """One update W -> W + Δ of a training-time rule (module docstring).

    Parameters
    ----------
    w, g : ndarray, shape (d_out, d_in), float64
        The weight and the loss gradient at ``w``.
    method : {"plain", "normalized", "clipped", "weight_decay"}
        "normalized" steps by -η g/||g||_F, of norm η (the seed text's g/||g||² is a typo: that
        step is not unit-norm); a zero gradient gives no step.
    lr : float >= 0
        η of this step.
    clip : float > 0
        c of "clipped": the step's Frobenius norm is at most η c.
    weight_decay : float >= 0
        λ of "weight_decay" (decoupled: W is shrunk by 1 - ηλ and the gradient step added).

    Returns
    -------
    ndarray, shape and dtype of ``w``; ``w`` and ``g`` are not modified.
    """
    method = _v.choice("method", method, TRAINING)
    lr = _v.nonnegative("lr", lr)
    clip = _v.real("clip", clip, low=0, low_open=True)
    weight_decay = _v.nonnegative("weight_decay", weight_decay)
    gn = float(np.linalg.norm(g))
    if method == "plain":
        return w - lr * g
    if method == "normalized":
        return w - (lr / gn) * g if gn > 0 else w.copy()
    if method == "clipped":
        return w - (lr * min(1.0, clip / gn) if gn > 0 else 0.0) * g
    return (1 - lr * weight_decay) * w - lr * g


def sigma_verdict(peaks: Mapping[float, float], target: float, bound: float = BOUND) -> tuple[str, float | None]:
    """("bounded", None), ("unbounded", lr) or ("diverged", lr) of one method.

    ``peaks`` maps each lr of the grid to max_t σ_max(W_t) of its run. "diverged": some
    peak is not finite (the first such lr); "unbounded": some peak exceeds ``bound``
    x ``target`` (the first such lr); "bounded" otherwise.
    """
    lrs = sorted(peaks)
    for lr in lrs:
        if not math.isfinite(peaks[lr]):
            return "diverged", lr
    for lr in lrs:
        if peaks[lr] > bound * target:
            return "unbounded", lr
    return "bounded", None


@dataclasses.dataclass
class Descent:
    """Every method's run at its chosen lr, and the σ_max peaks of its whole grid.

    ``losses[m]`` and ``sigma[m]`` have length ``steps``: L(W_t)/L(W_0) and σ_max(W_t) for
    t = 0 .. steps - 1 (W_t before step t); ``peaks[m][lr]`` = max_t σ_max(W_t) at lr.
    """

    losses: dict[str, np.ndarray]
    sigma: dict[str, np.ndarray]
    peaks: dict[str, dict[float, float]]
    lr: dict[str, float]
    grids: dict[str, tuple[float, ...]]
    target: float
    d_out: int
    d_in: int
    seed: int
    clip: float = CLIP
    weight_decay: float = WEIGHT_DECAY

    @property
    def steps(self) -> int:
        return len(next(iter(self.losses.values())))

    def rms_to_rms(self, method: str) -> np.ndarray:
        """√(d_in/d_out) σ_max(W_t): the RMS -> RMS operator norm of the spectral condition."""
        return math.sqrt(self.d_in / self.d_out) * self.sigma[method]

    def protocol(self) -> str:
        return (f"protocol: population loss of one task (seed {self.seed}; W* {self.d_out}x{self.d_in}, C eigenvalues "
                f"10^[-2,0]), W_0 = 0, {self.steps} steps, lr decaying linearly to 0, the best final loss of each "
                f"method's lr grid; no interval (one deterministic run per lr); bounded = sigma_max(W_t) <= "
                f"{BOUND:g} sigma_max(W*) at every step of every lr of the grid")

    def hyperparameters(self) -> dict[str, dict[str, Any]]:
        out = {}
        for m in self.losses:
            h: dict[str, Any] = {"rule": RULES.get(m, m), "lr_grid": list(self.grids[m]), "lr": self.lr[m],
                                 "schedule": "eta_k = lr (1 - k / steps)"}
            if m in ("gd", "sign", "spectral"):
                h["step_frobenius_norm"] = f"eta sqrt({min(self.d_out, self.d_in)})"
            if m == "clipped":
                h["clip"] = self.clip
            if m == "weight_decay":
                h.update(weight_decay=self.weight_decay, decay="decoupled")
            out[m] = h
        return out

    def to_dict(self) -> dict[str, Any]:
        """The JSON keys ``descent``, ``descent_sigma``, ``descent_methods``, ``descent_finding``."""
        steps = list(range(self.steps))
        sig = {m: {"steps": steps, "lr": self.lr[m],
                   "weights": {"W": {"sigma_max": _finite(self.sigma[m]), "rms_to_rms": _finite(self.rms_to_rms(m))}}}
               for m in self.sigma}
        verdicts = {}
        for m in self.losses:
            v, at = sigma_verdict(self.peaks[m], self.target)
            verdicts[m] = {"verdict": v, "first_lr": at, "loss": _finite([self.losses[m][-1]])[0],
                           "peak_sigma_by_lr": {str(lr): _finite([p])[0] for lr, p in self.peaks[m].items()}}
        return {"descent": {m: _finite(v) for m, v in self.losses.items()}, "descent_sigma": sig,
                "descent_methods": self.hyperparameters(),
                "descent_finding": {"protocol": self.protocol(), "target_sigma_max": self.target,
                                    "target_rms_to_rms": math.sqrt(self.d_in / self.d_out) * self.target,
                                    "bound": BOUND, "methods": verdicts, "lines": descent_finding(self)}}


def _finite(a: Any) -> list[float | None]:
    return [float(x) if math.isfinite(x) else None for x in np.asarray(a, dtype=np.float64).tolist()]


def descent_finding(d: Descent) -> list[str]:
    """The printed conclusion: which methods keep σ_max bounded, which end below the target, the loss reached."""
    verdicts = {m: sigma_verdict(d.peaks[m], d.target) for m in d.losses}
    lines = []
    bounded = [m for m, (v, _) in verdicts.items() if v == "bounded"]
    worse = [m for m, (v, _) in verdicts.items() if v != "bounded"]
    if bounded:
        lines.append(f"sigma_max bounded (<= {BOUND:g} sigma_max(W*) at every lr of its grid): {', '.join(bounded)}")
    if worse:
        lines.append("sigma_max not bounded: " + "; ".join(
            f"{m} {verdicts[m][0]} from lr {verdicts[m][1]:g} (peak {d.peaks[m][verdicts[m][1]] / d.target:.3g} "
            f"sigma_max(W*))" for m in worse))
    else:
        lines.append("no method's sigma_max leaves the bound on its grid")
    chosen = [m for m in worse if not np.max(d.sigma[m]) <= BOUND * d.target]
    if chosen:
        lines.append("the lr chosen by final loss is itself past the bound (an excursion the final loss hides): "
                     + ", ".join(f"{m} (lr {d.lr[m]:g}, peak {np.max(d.sigma[m]) / d.target:.3g})" for m in chosen))
    low = [m for m in d.losses if math.isfinite(d.sigma[m][-1]) and d.sigma[m][-1] < (1 - SHRUNK) * d.target]
    if low:
        lines.append(f"end below sigma_max(W*) by more than {SHRUNK:.0%} at the chosen lr: " + ", ".join(
            f"{m} ({d.sigma[m][-1] / d.target:.3g}, loss {d.losses[m][-1]:.3g})" for m in low))
    ok = [m for m in d.losses if math.isfinite(d.losses[m][-1])]
    if ok:
        best = min(ok, key=lambda m: d.losses[m][-1])
        lines.append(f"lowest final loss: {best} {d.losses[best][-1]:.3g} (lr {d.lr[best]:g}); " + ", ".join(
            f"{m} {d.losses[m][-1]:.3g}" for m in sorted(ok, key=lambda m: d.losses[m][-1]) if m != best))
    else:
        lines.append("no method ends with a finite loss")
    return lines


def descent_demo(steps: int = 100, d_out: int = 32, d_in: int = 64, seed: int = 0, lrs: tuple[float, ...] = LRS,
                 train_lrs: tuple[float, ...] = TRAIN_LRS, *, clip: float = CLIP,
                 weight_decay: float = WEIGHT_DECAY) -> Descent:
    """Run every method of :data:`METHODS` on the task of the module docstring.

    Parameters
    ----------
    steps, d_out, d_in : int
        Steps of each run and the shape of W.
    seed : int
        Seed of W* and C.
    lrs, train_lrs : tuple of float > 0
        The lr grids of the steepest-descent and of the training-time methods.
    clip, weight_decay : float
        c of "clipped" and λ of "weight_decay" (:func:`training_step`).

    Returns
    -------
    Descent
    """
    steps, d_out, d_in = _v.count("steps", steps), _v.count("d_out", d_out), _v.count("d_in", d_in)
    seed = _v.int_seed(seed)
    for name, grid in (("lrs", lrs), ("train_lrs", train_lrs)):
        if not grid:
            raise ValueError(f"{name} must hold at least one learning rate; got {grid!r}")
        for lr in grid:
            _v.real(name, lr, low=0, low_open=True)
    _v.real("clip", clip, low=0, low_open=True)
    _v.nonnegative("weight_decay", weight_decay)
    rng = np.random.default_rng(seed)
    w_star = rng.standard_normal((d_out, d_in)) / np.sqrt(d_in)
    q, _ = np.linalg.qr(rng.standard_normal((d_in, d_in)))
    c_half = (q * np.logspace(-1, 0, d_in)) @ q.T
    scale = 0.5 * np.sum((w_star @ c_half) ** 2)
    norm_f = np.sqrt(min(d_out, d_in))

    def run(update: Any, lr: float) -> tuple[list[float], np.ndarray]:
        w = np.zeros_like(w_star)
        curve, sig = [], np.empty(steps)
        for k in range(steps):
            r = (w - w_star) @ c_half
            curve.append(0.5 * np.sum(r * r) / scale)
            sig[k] = np.linalg.norm(w, 2) if np.all(np.isfinite(w)) else np.inf
            w = update(w, r @ c_half.T, lr * (1 - k / steps))
        return curve, sig

    def steepest(which: str) -> Any:
        def update(w: np.ndarray, g: np.ndarray, eta: float) -> np.ndarray:
            t = steepest_descent(g, which, 1.0)
            t *= norm_f / max(np.linalg.norm(t), 1e-300)
            return w + eta * t
        return update

    def rule(method: str) -> Any:
        return lambda w, g, eta: training_step(w, g, method, eta, clip=clip, weight_decay=weight_decay)

    plan = [(n, steepest(which), tuple(lrs)) for n, which in STEEPEST]
    plan += [(m, rule(m), tuple(train_lrs)) for m in TRAINING]
    losses, sigma, peaks, chosen, grids = {}, {}, {}, {}, {}
    with np.errstate(over="ignore", invalid="ignore"):
        for name, update, grid in plan:
            best = None
            peaks[name] = {}
            for lr in grid:
                curve, sig = run(update, lr)
                peaks[name][lr] = float(np.max(sig))
                if best is None or curve[-1] < best[0][-1]:
                    best = curve, sig, lr
            losses[name], sigma[name], chosen[name] = np.array(best[0]), best[1], best[2]
            grids[name] = grid
    return Descent(losses, sigma, peaks, chosen, grids, float(np.linalg.norm(w_star, 2)), d_out, d_in, seed,
                   float(clip), float(weight_decay))


def format_descent(d: Descent) -> list[str]:
    """The report's rows: the loss curves' milestones, then the σ_max table and the finding."""
    rows = ["Steepest descent and training-time rules on an ill-conditioned matrix regression "
            "(relative loss, best lr of each grid)"]
    rows += [f"  {k:<12} step 0 {v[0]:.3g}  step {len(v) // 2} {v[len(v) // 2]:.3g}  step {len(v) - 1} {v[-1]:.3g}"
             for k, v in d.losses.items()]
    rows += ["", f"Training-time stability: sigma_max(W_t) / sigma_max(W*) (sigma_max(W*) = {d.target:.4g}, "
             f"RMS->RMS = sqrt({d.d_in}/{d.d_out}) sigma_max; c = {d.clip:g}, decoupled lambda = {d.weight_decay:g})",
             f"  {d.protocol()}",
             f"  {'method':<12} {'lr':>6} {'loss':>9} {'sigma end':>9} {'peak':>9} {'grid peak':>9}  verdict"]
    for m in d.losses:
        v, at = sigma_verdict(d.peaks[m], d.target)
        grid_peak = max(d.peaks[m].values())
        rows.append(f"  {m:<12} {d.lr[m]:>6g} {d.losses[m][-1]:>9.3g} {d.sigma[m][-1] / d.target:>9.3g} "
                    f"{np.max(d.sigma[m]) / d.target:>9.3g} {grid_peak / d.target:>9.3g}  "
                    f"{v}{f' from lr {at:g}' if at is not None else ''}")
    rows += ["  Finding:"] + [f"  - {line}" for line in descent_finding(d)]
    return rows


NAMES = {"gd": r"GD ($\ell_2$)", "sign": r"sign ($\ell_\infty$)", "spectral": r"spectral ($\|\cdot\|_{2\to 2}$)",
         "plain": "plain GD", "normalized": "normalized GD", "clipped": "clipped GD", "weight_decay": "weight decay"}


def plot_descent(d: Descent, outdir: str, fmt: str = "png") -> list[str]:
    """Write ``descent.<fmt>`` (loss over steps) and ``descent_sigma.<fmt>`` (σ_max(W_t) over steps), one
    line per method at its chosen lr; call inside :func:`pyengine._figures.style`. The paths written."""
    import os

    from .._figures import COLUMN, layer_axis, log_axis, save, subplots

    paths = []
    fig, ax = subplots(size=(COLUMN, 3.2))
    for k, v in d.losses.items():
        ax.plot(v, label=NAMES.get(k, k), ls="-" if k in dict(STEEPEST) else "--")
    log_axis(ax)
    layer_axis(ax)
    ax.set(xlabel="step $t$", ylabel="relative loss $L(W_t) / L(W_0)$",
           title="steepest descent and training rules (best lr of each)")
    fig.legend(loc="outside lower center", ncols=2, frameon=False)
    paths.append(save(fig, os.path.join(outdir, "descent"), fmt))
    fig, ax = subplots(size=(COLUMN, 3.4))
    t = np.arange(d.steps)
    positive = np.concatenate([s[np.isfinite(s) & (s > 0)] for s in d.sigma.values()] + [np.array([d.target])])
    for k, s in d.sigma.items():
        keep = np.isfinite(s) & (s > 0)  # W_0 = 0: sigma_max 0 has no place on a log axis
        ax.plot(t[keep], s[keep], label=f"{NAMES.get(k, k)} (lr {d.lr[k]:g})",
                ls="-" if k in dict(STEEPEST) else "--")
    ax.axhline(d.target, color="0.3", lw=0.8, ls=":", label=r"$\sigma_{\max}(W^*)$")
    if positive.max() / positive.min() > 10:
        log_axis(ax)
    layer_axis(ax)
    ax.set(xlabel="step $t$", ylabel=r"$\sigma_{\max}(W_t)$", title=r"$\sigma_{\max}$ of the weight over training")
    fig.legend(loc="outside lower center", ncols=2, frameon=False)
    paths.append(save(fig, os.path.join(outdir, "descent_sigma"), fmt))
    return paths
