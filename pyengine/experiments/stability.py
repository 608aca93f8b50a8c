"""Forward/backward stability report (``pyengine stability``): signal propagation by scheme, the
spectral condition of a real model, and steepest descent under three norms and training-time
gradient rules on a toy task (:mod:`~pyengine.experiments.stability_descent`).

:func:`stability` returns a :class:`Stability` report; :func:`format_stability` prints it,
:func:`write_stability` saves the figures ``stability`` (forward and backward RMS against
depth, log scale, one panel per (norm, residual) setting, one line per scheme, the mean-field
prediction dashed), ``stack_stability``, ``weight_spectra``, ``descent`` and ``descent_sigma``
(png, pdf or svg) and ``stability.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import textwrap
from typing import Any

import numpy as np

from .._figures import PAGE, check_format, layer_axis, log_axis, save, styled, subplots
from ..analysis.stability import (SignalPropagation, gelu_second_moment, mlp_stacks, signal_propagation,
                                  signal_propagations)
from ..analysis.stack_stability import stack_signal_propagation
from ..analysis.weight_spectra import WeightSpectra, weight_spectra
from ..provenance import provenance as gather
from .stability_descent import Descent, descent_demo, format_descent, plot_descent

__all__ = ["SETTINGS", "Stability", "descent_demo", "format_stability", "stability", "write_stability"]

#: (norm, residual) settings of the report.
SETTINGS = (("none", False), ("layernorm", False), ("none", True), ("layernorm", True))
SCHEMES = ("kaiming_normal", "xavier_normal", "torch_default", "orthogonal")
#: Transformer-stack placements of the report (pre-LN and post-LN, residual, sequential, causal).
STACK_PLACEMENTS = ("pre", "post")


@dataclasses.dataclass
class Stability:
    runs: list[SignalPropagation]
    spectra: WeightSpectra | None = None
    model: str = ""
    #: The descent demonstration (:func:`~pyengine.experiments.stability_descent.descent_demo`).
    descent: Descent | None = None
    seconds: float = 0.0
    #: The same schemes in full transformer stacks (attention + MLP blocks, LayerNorm, residual).
    stack_runs: list[SignalPropagation] = dataclasses.field(default_factory=list)
    #: Kaiming GELU runs (no norm, plain) for the GELU departure of :func:`departures`.
    gelu_runs: list[SignalPropagation] = dataclasses.field(default_factory=list)


def stability(
    schemes: tuple[str, ...] = SCHEMES, depth: int = 48, width: int = 768, tokens: int = 128, *,
    activation: str = "relu", settings: tuple[tuple[str, bool], ...] = SETTINGS, model: Any = None,
    demo: bool = True, seed: int = 0, dtype: Any = np.float32, progress: Any = None,
    stack_depth: int = 12, stack_width: int = 256, stack_tokens: int | None = None,
    placements: tuple[str, ...] = (), gelu_check: bool = True, on_stage: Any = None,
) -> Stability:
    """Signal propagation of every scheme x setting; weight spectra of ``model`` (a Stack or a
    load_pretrained name) if given; the descent demo if ``demo``.

    The transformer part (:func:`~pyengine.analysis.stack_signal_propagation`) runs every
    scheme in GELU stacks of ``stack_depth`` blocks of width ``stack_width`` (heads of 64,
    or 1 head if narrower), ``stack_tokens`` tokens (default ``tokens``), one stack per
    placement of ``placements`` (default none; ``pyengine stability`` runs
    :data:`STACK_PLACEMENTS`); its forward and backward go through
    Stack.forward and Stack.block_vjp. ``gelu_check`` adds a plain Kaiming GELU stack
    (the same weights as the ReLU one) for the GELU line of :func:`departures`.
    ``on_stage(stage, result)``, if given, gets each finished part as plain data (the
    signal-propagation runs, the transformer stacks, the spectra, the descent demo).
    """
    import time

    t0 = time.perf_counter()
    plan = [(s, n, r) for n, r in settings for s in schemes]
    done: dict[tuple[str, str, bool], SignalPropagation] = {}
    gelu_runs = []
    for r in dict.fromkeys(r for _, r in settings):
        # One scheme's stack at a time, shared by the norm settings (which run as one batch) and
        # freed before the next: holding every scheme's residual stack at once cost 0.9 GB per
        # scheme at the defaults. mlp_stacks gives each scheme, array for array, the weights of a
        # shared draw, at about the same CPU time.
        norms = list(dict.fromkeys(n for n, rr in settings if rr == r))
        for s in schemes:
            layers = mlp_stacks(depth, width, (s,), residual=r, seed=seed, dtype=dtype)[s]
            if progress:
                progress(len(done), len(plan), f"{s} {'/'.join(norms)} {'residual' if r else 'plain'}")
            for run in signal_propagations(s, depth, width, tokens, activation=activation, norms=norms, residual=r,
                                           seed=seed, dtype=dtype, layers=layers):
                done[s, run.norm, r] = run
            if gelu_check and not r and s == "kaiming_normal" and not gelu_runs:
                if progress:
                    progress(len(done), len(plan), "kaiming_normal gelu")
                gelu_runs.append(signal_propagation("kaiming_normal", depth, width, tokens, activation="gelu",
                                                    seed=seed, dtype=dtype, layers=layers))
            del layers
    if gelu_check and "kaiming_normal" in schemes and not gelu_runs:  # no plain setting asked: its own draw
        gelu_runs.append(signal_propagation("kaiming_normal", depth, width, tokens, activation="gelu", seed=seed,
                                            dtype=dtype))
    runs = [done[s, n, r] for s, n, r in plan]
    keep = on_stage or (lambda stage, result: None)
    keep("signal propagation", {"runs": [_run_dict(r) for r in runs + gelu_runs]})
    stack_runs = []
    if placements:
        from ..models.config import StackConfig
        from ..models.initialization import init_weights

        heads = max(1, stack_width // 64) if stack_width % max(1, stack_width // 64) == 0 else 1
        splan = [(s, p) for p in placements for s in schemes]
        for i, (s, p) in enumerate(splan):
            if progress:
                progress(i, len(splan), f"stack {s} {p}-LN")
            cfg = StackConfig(d_model=stack_width, n_heads=heads, n_layers=stack_depth, placement=p,
                              positions="none", bias=False)
            st = init_weights(cfg, s, seed=seed, dtype=dtype)
            stack_runs.append(stack_signal_propagation(st, stack_tokens or tokens, scheme=s, seed=seed))
        keep("transformer stacks", {"stack_runs": [_run_dict(r) for r in stack_runs]})
    spectra, name = None, ""
    if model is not None:
        if isinstance(model, str):
            from ..models.pretrained import load_pretrained

            name, model = model, load_pretrained(model)
        else:
            name = str(getattr(model, "name", ""))
        spectra = weight_spectra(model)
        keep("weight spectra", {"model": name, "spectra": spectra.to_dict()})
    descent = descent_demo() if demo else None
    if descent is not None:
        keep("descent demo", descent.to_dict())
    return Stability(runs, spectra, name, descent, time.perf_counter() - t0, stack_runs, gelu_runs)


def _run_dict(r: Any) -> dict[str, Any]:
    return {"label": r.label, **{k: getattr(r, k).tolist() for k in
                                 ("forward_rms", "backward_rms", "forward_pred", "backward_pred")}}


def _naive(r: SignalPropagation) -> float:
    """RMS h_L / h_0 of the init formula alone: per layer sqrt(n_in Var W · ½) (He's ReLU half), no norm, no
    residual: 1 for Kaiming ReLU, sqrt(1/2) for Xavier, sqrt(1/6) for torch_default, 1/sqrt 2 orthogonal."""
    from ..models.initialization import forward_gain

    return math.sqrt(0.5 * forward_gain(r.scheme, r.width, r.width)) ** r.depth


def departures(rep: Stability) -> list[str]:
    """Where and by how much LayerNorm, the residual and GELU depart from the init formula, measured."""
    rows = ["Departures from the init formula (forward RMS h_L / h_0; formula = per layer sqrt(n_in Var W / 2), "
            "no norm, no residual):"]
    for r in rep.runs:
        if r.scheme != "kaiming_normal":
            continue
        meas = r.forward_rms[-1] / r.forward_rms[0]
        bw = r.backward_rms[0] / r.backward_rms[-1]
        why = {("none", False): "the formula's own case (finite width only)",
               ("layernorm", False): "LN resets the mean square to 1 per layer; ReLU output mean is "
                                     "removed, so the formula's 1/2 is not what reaches the next layer",
               ("none", True): "the residual adds the branch: q_{l+1} = q_l (1 + d_mlp V2 d V1 / 2) compounds",
               ("layernorm", True): "pre-LN residual: q grows linearly, q_l = 1 + l (branch), gradients "
                                    "shrink by the LN gain 1/sqrt(q_l) on the way back"}[(r.norm, r.residual)]
        rows.append(f"  {r.label:<40} measured {meas:.3g} (backward {bw:.3g}) vs formula {_naive(r):.3g}: "
                    f"x{meas / _naive(r):.3g}; mean field {r.forward_pred[-1] / r.forward_pred[0]:.3g}. {why}")
    for r in rep.gelu_runs:
        per = r.forward_rms[1:] / r.forward_rms[:-1]
        pp = r.forward_pred[1:] / r.forward_pred[:-1]
        rows.append(f"  {r.label:<40} measured {r.forward_rms[-1] / r.forward_rms[0]:.3g} vs He formula 1 "
                    f"(mean field with the exact GELU gain {r.forward_pred[-1] / r.forward_pred[0]:.3g}): GELU is "
                    f"not ReLU. Exact E[gelu(z)^2] = q/4 + (q/2pi) asin(q/(1+q)) + q^2/(pi (1+q) sqrt(1+2q)), "
                    f"gain E[gelu(z)^2]/q = {gelu_second_moment(1.0):.4f} at q = 1 (ReLU 0.5), falling to 1/4 as "
                    f"q -> 0. Per layer: x{pp[0]:.4f} predicted / x{per[0]:.4f} measured at layer 1, "
                    f"x{pp[-1]:.4f} / x{per[-1]:.4f} at layer {r.depth}")
    return rows


def format_stability(rep: Stability) -> str:
    rows = ["Signal propagation (MLP-only stacks; RMS of h_L and of dL/dh_0, measured vs mean-field prediction)",
            f"{'setting':<46} {'fwd RMS h_L':>11} {'pred':>9} {'bwd RMS g_0':>11} {'pred':>9} {'dep fwd':>7} {'dep bwd':>7}"]
    for r in rep.runs:
        f, b = r.departure()
        rows.append(f"{r.label:<46} {r.forward_rms[-1]:>11.3g} {r.forward_pred[-1]:>9.3g} {r.backward_rms[0]:>11.3g} "
                    f"{r.backward_pred[0]:>9.3g} {f:>7.2f} {b:>7.2f}")
    rows.append("dep = max over layers |log(measured/predicted)| (0: the formula holds)")
    if any(r.scheme == "kaiming_normal" for r in rep.runs) or rep.gelu_runs:
        rows += [""] + departures(rep)
    if rep.stack_runs:
        rows += ["", "Signal propagation (transformer stacks: attention + GELU MLP blocks, residual; Stack.forward and "
                 "Stack.block_vjp)", f"{'setting':<46} {'fwd RMS h_L':>11} {'pred':>9} {'bwd RMS g_0':>11} "
                 f"{'pred':>9} {'dep fwd':>7} {'dep bwd':>7}"]
        for r in rep.stack_runs:
            f, b = r.departure()
            rows.append(f"{r.label:<46} {r.forward_rms[-1]:>11.3g} {r.forward_pred[-1]:>9.3g} "
                        f"{r.backward_rms[0]:>11.3g} {r.backward_pred[0]:>9.3g} {f:>7.2f} {b:>7.2f}")
    if rep.spectra is not None:
        rows += ["", f"Spectral condition of {rep.model or 'the model'} (sqrt(d_in/d_out) sigma_max, target Theta(1))",
                 rep.spectra.to_text()]
    if rep.descent is not None:
        rows += [""] + format_descent(rep.descent)
    rows.append(f"({rep.seconds:.1f} s)")
    return "\n".join(rows)


def _propagation_figure(groups: dict[str, list[Any]], title: str, unit: str) -> Any:
    """Forward and backward RMS against depth: one column per group, one colour per scheme."""
    from matplotlib.lines import Line2D

    fig, axes = subplots(2, len(groups), size=(min(PAGE, 1.2 + 1.6 * len(groups)), 3.9), squeeze=False,
                         sharex="col")
    schemes: dict[str, str] = {}
    for j, (name, runs) in enumerate(groups.items()):
        for r in runs:
            color = schemes.setdefault(r.scheme, f"C{len(schemes)}")
            layers = np.arange(r.depth + 1)
            for row, (meas, pred) in enumerate(((r.forward_rms, r.forward_pred), (r.backward_rms, r.backward_pred))):
                axes[row, j].plot(layers, meas, color=color)
                axes[row, j].plot(layers, pred, color=color, ls="--", lw=0.8)
        axes[0, j].set_title(textwrap.fill(name, 22))
        axes[1, j].set_xlabel(f"{unit} $\\ell$")
        for row in range(2):
            log_axis(axes[row, j])
            layer_axis(axes[row, j])
    axes[0, 0].set_ylabel(r"forward RMS of $h_\ell$")
    axes[1, 0].set_ylabel(r"backward RMS of $\partial L / \partial h_\ell$")
    handles = [Line2D([], [], color=c, label=s) for s, c in schemes.items()]
    handles += [Line2D([], [], color="0.3", label="measured"),
                Line2D([], [], color="0.3", ls="--", lw=0.8, label="mean-field prediction")]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 5), frameon=False)
    fig.suptitle(title)
    return fig


@styled
def write_stability(rep: Stability, outdir: str, fmt: str = "png",
                    provenance: dict[str, Any] | None = None) -> list[str]:
    """Save the figures (in ``fmt``: png, pdf or svg) and stability.json under ``outdir``; the paths
    written. ``provenance``: stability.json's block (default :func:`pyengine.provenance.provenance` now)."""
    check_format(fmt)
    os.makedirs(outdir, exist_ok=True)
    settings: dict[str, list[Any]] = {}
    for r in rep.runs:
        name = f"{'pre-' + r.norm if r.norm != 'none' else 'no norm'}{', residual' if r.residual else ''}"
        settings.setdefault(name, []).append(r)
    fig = _propagation_figure(settings, "MLP stacks: forward and backward signal by initialization", "layer")
    paths = [save(fig, os.path.join(outdir, "stability"), fmt)]
    if rep.stack_runs:
        places: dict[str, list[Any]] = {}
        for r in rep.stack_runs:
            places.setdefault(r.arch, []).append(r)
        fig = _propagation_figure(places, "transformer stacks: forward and backward signal", "block")
        paths.append(save(fig, os.path.join(outdir, "stack_stability"), fmt))
    if rep.spectra is not None:
        paths.append(rep.spectra.plot(os.path.join(outdir, "weight_spectra"), rep.model, fmt=fmt))
    if rep.descent is not None:
        paths += plot_descent(rep.descent, outdir, fmt)
    doc = {"runs": [_run_dict(r) for r in rep.runs],
           "spectra": rep.spectra.to_dict() if rep.spectra is not None else None,
           "stack_runs": [_run_dict(r) for r in rep.stack_runs],
           "descent": {}, **(rep.descent.to_dict() if rep.descent is not None else {}), "seconds": rep.seconds,
           "provenance": provenance or gather()}
    paths.append(os.path.join(outdir, "stability.json"))
    with open(paths[-1], "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return paths
