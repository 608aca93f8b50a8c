"""The residual-recovery experiment: does an injected direction decay, at what rate, and why?

Protocol (after Hahami et al. 2025, arXiv 2512.12411): add scale * v/|v| to hidden
state ``layer`` at the chosen positions of one sentence, run the rest of the model,
and read cosine, projection onto v and norm ratio at the last token. This
experiment does it for K directions x S scales at once, exactly and linearized,
fits the decay rate of |projection|, and tests three predictions:

1. **Spectra.** If the block Jacobians set the decay, the rate should be about
   -mean log rho(A_k) over the blocks passed (A_k the diagonal block of block k's
   Jacobian at the read token; with a causal mask the full Jacobian is block
   lower-triangular, so these carry its eigenvalues). For a pre-LN residual block
   with LayerNorm, A_k 1 = 1 exactly (every LayerNorm Jacobian annihilates the
   all-ones direction), so rho >= 1 and the prediction is "no decay". RMSNorm does
   not annihilate 1: there the bound is measured, not assumed.
2. **Residual connections.** The same weights with the residual removed: without it the
   perturbation should decay faster.
3. **Norm parameters.** Sweeps of the norm epsilon and of the global gamma scale: each
   should set the rate.

Every prediction gets a one-line verdict with its numbers, computed from the signs and
the 95 % intervals (SUPPORTED, CONTRADICTED or NOT RESOLVED; see ``decide`` in
``pyengine.experiments._recovery_verdicts``), and the report states its evaluation
protocol in one line. The linear model of the run: the
least-squares fit ``alpha I + beta 11^T/d`` of the composed Jacobian from the injection to
every later hidden state at the read-out token, matrix-free
(:func:`pyengine.analysis.linear_model.scaling_fit`), and the split of the propagated delta
into its uniform part ``mean(delta) 1`` (which every LayerNorm Jacobian annihilates) and the
rest.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import _validate as _v
from ..models import Stack, StackConfig, init_weights
from ..analysis import DecayFit, Propagation, position_mask, resolve_positions
from ..analysis.propagate import propagate  # noqa: F401  (a name test_reliability's work guard replaces)
from ..analysis.propagate import propagate_request
from ..analysis.linear_model import scaling_fit, uniform_split
from ..analysis.propagate_inputs import resolve_injection
from ..analysis.propagate_stages import Request
from ..analysis.token_spectra import token_jacobian_spectra
from ..models.site_blocks import site_width
from ._recovery_result import Recovery, _linear_gap, _regime
from ._recovery_stages import SPECTRA_PASSES, Stages
from ._recovery_verdicts import protocol as _protocol
from ._recovery_verdicts import verdicts
from ._report import LINEAR_TOL, _clean

__all__ = ["DEFAULT_TEXT", "Recovery", "byte_ids", "default_model", "recovery", "token_strings"]

DEFAULT_TEXT = "The residual stream carries a small push forward through every layer until the last token reads it."
DEFAULT_SCALES = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 6.0, 10.0, 30.0)
PROTOCOL_SCALE = 6.0  # the published protocol injects 6 v/|v|
Progress = Callable[[float, str], None]


def default_model(seed: int = 0) -> Stack:
    """The built-in model: a seeded GPT-2-small-shaped pre-LN stack (no download).

    12 blocks, d_model 768, 12 heads, d_mlp 3072, LayerNorm eps 1e-5, GELU (tanh),
    learned positions, causal, GPT-2 initialization (N(0, 0.02), residual outputs
    scaled by 1/sqrt(2 n_layers)), float32. Its vocabulary is the 256 byte values:
    :func:`byte_ids` tokenizes any text.
    """
    cfg = StackConfig(d_model=768, n_heads=12, n_layers=12, d_mlp=3072, norm="layernorm", placement="pre",
                      activation="gelu_tanh", positions="learned", vocab_size=256, max_seq_len=1024)
    return init_weights(cfg, scheme="gpt2", seed=seed, dtype=np.float32)


def byte_ids(text: str) -> np.ndarray:
    """Token ids of the default model: the UTF-8 bytes of ``text``, (T,) int64."""
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    if ids.size == 0:
        raise ValueError("text must not be empty")
    return ids


def token_strings(model: Any, ids: np.ndarray) -> list[str] | None:
    """The text of each token id: ``model.detokenize([id])`` when the model has a tokenizer,
    the byte (``\\xNN`` when not ASCII) for the default byte-level model, None for a float
    stream input or a model without either."""
    if ids.dtype.kind not in "iu":
        return None
    if hasattr(model, "detokenize") and getattr(model, "tokenizer", None) is not None:
        return [model.detokenize([int(i)]) for i in ids]
    if model.config.vocab_size == 256 and ids.size and 0 <= ids.min() and ids.max() < 256:
        return [bytes([int(i)]).decode("ascii", errors="backslashreplace") for i in ids]
    return None


def recovery(
    model: Stack | None = None,
    ids: Any = None,
    *,
    text: str | None = None,
    layer: int | str = 2,
    scales: Sequence[float] = DEFAULT_SCALES,
    protocol_scale: float = PROTOCOL_SCALE,
    n_directions: int = 4,
    directions: Any = None,
    positions: Any = "all",
    read: str = "last",
    spectral_tokens: Any = "last",
    spectra_layers: Any = "all",
    eps_values: Sequence[float] | None = None,
    gamma_values: Sequence[float] = (0.5, 1.0, 2.0),
    seed: int = 0,
    spectra: bool = True,
    n_probes: int = 64,
    dtype: Any = np.float32,
    name: str | None = None,
    progress: Progress | None = None,
    on_stage: Callable[[str, dict[str, Any]], None] | None = None,
) -> Recovery:
    """Run the residual-recovery experiment (see the module docstring).

    Parameters
    ----------
    model : Stack, optional
        Default :func:`default_model`.
    ids : array_like of int (T,), optional
        Token ids; default ``byte_ids(text)`` for the default model or
        ``model.tokenize(text)`` for a model with a tokenizer.
    text : str, optional
        Default :data:`DEFAULT_TEXT`.
    layer : int or str
        Hidden-state index of the injection (the input of block layer + 1), or a site
        name as :func:`pyengine.propagate` takes it (e.g. ``"blocks.2.resid_mid"``; the
        directions then have the site's width, and the block spectra start at its block).
    scales : sequence of float
        Perturbation sizes (absolute); ``protocol_scale`` is added if missing.
    n_directions : int
        Random unit directions (seeded) when ``directions`` is not given.
    directions : array_like (K, d_model), optional
    positions : see :func:`pyengine.propagate`
    read : {"last", "injected", "downstream", "all"}
        Positions whose mean ``|projection|`` is fitted (the protocol reads "last").
    spectral_tokens : "last", int or sequence of ints
        Tokens whose diagonal Jacobian blocks are formed densely (float64).
    eps_values, gamma_values : sequences
        The sweeps (default eps: the model's own, and 0.01, 0.1 and 1 times the median
        mean square of the stream's entries after the injection, where eps matters).
    seed : int
        Seeds the directions, the linear model's probes (and the default model's weights).
    spectra : bool
        Form the block Jacobians' spectra (prediction 1); when False the stage is skipped,
        and the report says so.
    spectra_layers : "all", "last", int, slice or sequence of ints
        The blocks whose spectra are formed, by the hidden-state index k of their input
        (negative counts from the end, as ``positions``); each must be >= the injection's
        block. Default "all": every block from the injection on. The others' rows of
        ``rho``, ``sigma`` and ``ones_residual`` are NaN, and prediction (1) averages over
        the blocks formed.
    n_probes : int
        Rademacher probes of the linear model (``n_probes >= d_model``: exact, d JVPs).
    dtype : float32 or float64
        Compute dtype of the propagations.
    progress : callable(fraction, stage), optional
        ``fraction``: the estimated share of the run's time done, from the measured time per
        block of each stage (see :mod:`pyengine.experiments._recovery_stages`); it may step
        back when a stage turns out slower than estimated.
    on_stage : callable(stage, result), optional
        Called when a stage has finished, with its name and its result as plain JSON-ready
        values, NaN and inf as None (``pyengine recovery`` writes each to the output folder at once, so an
        interrupted run keeps every stage already done).
    """
    t_start = time.perf_counter()
    # Every argument is checked here, before the first (expensive) propagation.
    seed = _v.int_seed(seed)
    spectra = _v.flag("spectra", spectra)
    n_probes = _v.count("n_probes", n_probes)
    progress, on_stage = _v.callback(progress, "progress"), _v.callback(on_stage, "on_stage")
    protocol_scale = _v.real("protocol_scale", protocol_scale, low=0, low_open=True)
    scales = _v.as_array("scales", scales, np.float64)
    if scales.ndim != 1 or not np.isfinite(scales).all():
        raise ValueError(f"scales must be a 1-D sequence of finite numbers; got {scales!r}")
    if eps_values is not None:
        eps_values = [_v.real("eps_values", e, low=0) for e in np.atleast_1d(_v.as_array("eps_values", eps_values))]
    gamma_values = [_v.real("gamma_values", g) for g in np.atleast_1d(_v.as_array("gamma_values", gamma_values))]
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None; got {name!r}")
    default_weights = model is None
    if model is None:
        model = default_model(seed)
        name = name or "default (seeded GPT-2-small-shaped pre-LN stack)"
    if not isinstance(model, Stack):
        raise TypeError(f"model must be a pyengine Stack or pretrained model; got {type(model).__name__}")
    cfg = model.config
    if ids is None:
        text = DEFAULT_TEXT if text is None else text
        if hasattr(model, "tokenize"):
            ids = model.tokenize(text)
        elif cfg.vocab_size >= 256:
            ids = byte_ids(text)
        else:
            raise ValueError(f"this model has no tokenizer and {cfg.vocab_size} < 256 token ids, so text cannot "
                             "be read as UTF-8 bytes; pass ids")
    ids = np.asarray(ids)
    _v.choice("read", read, ("last", "injected", "downstream", "all"))
    if ids.ndim not in (1, 2) or ids.ndim != (1 if ids.dtype.kind in "iu" else 2):
        raise ValueError(f"ids must be one sequence: token ids (T,) or a float stream (T, d); got shape {ids.shape}")
    T = ids.shape[0]
    if T == 0:
        raise ValueError("ids must hold at least one token; got an empty sequence")
    toks = resolve_positions(spectral_tokens, T)
    read_at = np.flatnonzero(position_mask(read, resolve_positions(positions, T), T))
    if read_at.size == 0:
        raise ValueError(f"read = {read!r} selects no token for positions = {positions!r} (T = {T})")
    sc = np.unique(np.append(np.asarray(scales, dtype=np.float64), protocol_scale))
    inj = resolve_injection(layer, cfg)  # a site name: its block, and the directions' width
    width = cfg.d_model if inj.site is None else site_width(cfg, inj.site)
    block = _v.index_of("layer", inj.layer, cfg.n_layers, "a hidden-state index: the input of a block")
    formed = _blocks_formed(spectra_layers, cfg.n_layers, block)
    given = directions is not None
    if directions is None:
        n = _v.count("n_directions", n_directions)
        directions = np.random.default_rng(seed).standard_normal((n, width))
    directions = _v.unit_rows("directions", directions, width)
    # The propagations take the checked arguments as they are. Their directions are the unit
    # rows of these unit rows (the last bits move), as pyengine.propagate(model, ids,
    # directions, ...) would make them.
    req = Request(block, inj.site, inj.name, _v.normalized_rows(directions), sc, False, "full",
                  _v.float_dtype("dtype", dtype), None, None)
    j = int(np.argmin(np.abs(sc - protocol_scale)))
    tokens = token_strings(model, ids)
    record = functools.partial(_propagation_record, ids if ids.ndim == 1 else None, tokens, read, j)

    n_eps = 3 if eps_values is None else sum(float(e) != cfg.eps for e in eps_values)
    stages = Stages(progress, on_stage, {
        "exact propagation": ("forward", 2), "linearized propagation": ("jvp", 2), "linear model": ("linear", 2),
        "block Jacobian spectra": ("spectra", SPECTRA_PASSES * formed.size if spectra else 0),
        "ablation: no residual": ("forward", 2), "sweep: norm eps": ("forward", 2 * n_eps),
        "sweep: gamma scale": ("forward", 2 * sum(float(g) != cfg.gamma_scale for g in gamma_values))}, t_start)
    cb = stages.start("exact propagation")
    ex = stages.finish(propagate_request(model, ids, req._replace(progress=cb), positions, read_at), record)
    cb = stages.start("linearized propagation")
    li = stages.finish(propagate_request(model, ids, req._replace(linearized=True, progress=cb), positions, read_at),
                       record)
    stages.start("linear model")
    scaling = stages.finish(scaling_fit(model, ids, block, int(read_at[-1]), n_probes=n_probes, seed=seed,
                                        dtype=req.dt, mode=req.mode), _scaling_record)
    split = {run: tuple(x.mean(axis=(1, 2)) for x in uniform_split(p.deltas[:, j::sc.size]))
             for run, p in (("exact", ex), ("linear", li))}  # (L,) each: protocol scale, mean over K and read-out
    cb = stages.start("block Jacobian spectra")
    if spectra:
        rho, sig, one, how = stages.finish(_spectra(model, ids, block, toks, cb, formed),
                                      functools.partial(_spectra_record, block, toks))
    else:
        rho, sig, one = stages.finish(tuple(np.empty((0, toks.size)) for _ in range(3)), _skipped_record)
        how = None

    fit = functools.partial(_fit, ids=ids, req=req._replace(S=sc[j:j + 1]), positions=positions, read=read)
    stages.start("ablation: no residual")
    no_res = stages.finish(fit(model, {"residual": False}), _fit_record)
    if eps_values is None:  # the model's eps, and eps comparable to the stream's mean square
        ms = float(np.median(ex.base_norm**2)) / cfg.d_model
        eps_values = sorted({cfg.eps, 1e-2 * ms, 1e-1 * ms, ms})
    # a sweep value that is the model's own is the exact propagation at the protocol scale: its fit, not a rerun
    fit_exact = ex.fit(read, j)
    eps_values = [float(e) for e in eps_values]
    stages.plan_stage("sweep: norm eps", "forward", 2 * sum(e != cfg.eps for e in eps_values))
    eps_sweep = stages.finish(_sweep(stages.start("sweep: norm eps"), fit, fit_exact, model, "eps", eps_values),
                              functools.partial(_sweep_record, "eps"))
    gamma_sweep = stages.finish(_sweep(stages.start("sweep: gamma scale"), fit, fit_exact, model, "gamma_scale",
                                       [float(g) for g in gamma_values]),
                                functools.partial(_sweep_record, "gamma_scale"))
    gap = _linear_gap(ex, li)
    rep = Recovery(
        model=name or type(model).__name__, config=cfg, text=text, ids=ids, layer=ex.layer, read=read,
        protocol_scale=float(sc[j]), exact=dataclasses.replace(ex, deltas=None, delta_positions=None),
        linear=dataclasses.replace(li, deltas=None, delta_positions=None),
        fit_exact=fit_exact, fit_linear=li.fit(read, j),
        spectral_tokens=toks, rho=rho, sigma=sig, ones_residual=one, spectra_how=how, linear_gap=gap,
        linear_regime=_regime(sc, gap), no_residual=no_res, eps_sweep=eps_sweep, gamma_sweep=gamma_sweep,
        verdicts=[], seconds=stages.seconds, tokens=tokens, site=ex.site, spectra_skipped=not spectra,
        scaling=scaling, uniform=split, seed=seed,
    )
    rep.verdicts = _verdicts(rep)
    rep.protocol = _protocol(rep, default_weights, given)
    stages.seconds["total"] = time.perf_counter() - t_start
    stages.done()
    return rep


# --------------------------------------------------------------------------- the stages


def _blocks_formed(spec: Any, n_layers: int, block: int) -> np.ndarray:
    """The hidden-state indices k (>= ``block``) whose block's spectra ``spectra_layers`` asks for."""
    if isinstance(spec, str) and spec == "all":
        return np.arange(block, n_layers)
    try:
        formed = resolve_positions(spec, n_layers)
    except ValueError as exc:
        msg = str(exc).replace("tokens", "blocks").replace("a sequence of T", "a stack of n_layers").replace(
            "T = ", "n_layers = ")
        raise ValueError(f"spectra_layers {msg[len('positions '):] if msg.startswith('positions ') else msg}") \
            from None
    if formed[0] < block:
        raise ValueError(f"spectra_layers must name blocks from the injection on (hidden-state index >= {block}); "
                         f"got {formed[0]}")
    return formed


def _sweep(progress: Callable[[int, int], None], fit: Callable[..., DecayFit], own: DecayFit, model: Stack,
           field: str, values: list[float]) -> list[tuple[float, DecayFit]]:
    """The fit of ``model.replace(field=v)`` for each value (``own`` where v is the model's own)."""
    out = []
    for i, v in enumerate(values):
        out.append((v, own if v == getattr(model.config, field) else fit(model, {field: v})))
        progress(i + 1, len(values))
    return out


def _propagation_record(ids: np.ndarray | None, tokens: list[str] | None, read: str, j: int, p: Propagation
                        ) -> dict[str, Any]:
    return {"ids": None if ids is None else ids.tolist(), "tokens": tokens,
            "propagation": dataclasses.replace(p, deltas=None, delta_positions=None).to_dict(),
            "fit": p.fit(read, j).to_dict()}


def _spectra(model: Stack, ids: np.ndarray, block: int, toks: np.ndarray, progress: Callable[[int, int], None],
             formed: np.ndarray) -> tuple[Any, ...]:
    """(n_blocks, R) rho and sigma_max of the diagonal Jacobian blocks at ``toks`` (float64)
    of every block from ``block`` on (NaN but for the blocks ``formed``, by hidden-state index),
    ``|A 1 - 1|_inf``, and how each was found: a dict of (n_blocks, R) arrays ``rho_method``,
    ``sigma_method`` (str; "skipped" for the blocks not formed), ``rho_converged`` and
    ``sigma_converged`` (bool); see :func:`pyengine.analysis.token_jacobian_spectra`."""
    h = model.hidden_states(ids, dtype=np.float64)
    n, R = model.config.n_layers - block, toks.size
    rho, sig, one = (np.full((n, R), np.nan) for _ in range(3))
    how = {"rho_method": np.full((n, R), "skipped", dtype=object), "sigma_method": np.full((n, R), "skipped", object),
           "rho_converged": np.ones((n, R), bool), "sigma_converged": np.ones((n, R), bool)}
    for i, k in enumerate(formed):
        p = token_jacobian_spectra(model, h[k], int(k), toks)
        row = k - block
        rho[row], sig[row], one[row] = p.rho, p.sigma, p.ones_residual
        how["rho_method"][row], how["sigma_method"][row] = p.radius.method, p.norm.method
        how["rho_converged"][row], how["sigma_converged"][row] = p.radius.converged, p.norm.converged
        progress(i + 1, formed.size)
    how["rho_method"], how["sigma_method"] = how["rho_method"].astype(str), how["sigma_method"].astype(str)
    return rho, sig, one, how


def _scaling_record(out: Any) -> dict[str, Any]:
    return {"scaling_fit": out.to_dict()}


def _skipped_record(out: Any) -> dict[str, Any]:
    return {"skipped": True, "reason": "spectra skipped (spectra=False, --no-spectra)"}


def _verdicts(r: Recovery) -> list[str]:
    """The verdict lines of ``r`` (``_recovery_verdicts.verdicts``)."""
    return verdicts(r, LINEAR_TOL)


def _spectra_record(block: int, toks: np.ndarray, out: tuple[Any, ...]) -> dict[str, Any]:
    n_layers = block + out[0].shape[0]
    return {"blocks": list(range(block + 1, n_layers + 1)), "tokens": toks.tolist(), "rho": out[0].tolist(),
            "sigma_max": out[1].tolist(), "ones_residual": out[2].tolist(),
            **{key: v.tolist() for key, v in out[3].items()}}


def _fit(model: Stack, change: dict[str, Any], *, ids: np.ndarray, req: Request, positions: Any, read: str
         ) -> DecayFit:
    """The decay fit at ``read`` of the exact propagation ``req`` (one scale) through
    ``model.replace(**change)``. The replaced model is collected at once: a streamed model's
    block cache refers back to its model, a cycle that reference counting leaves, so each
    ablation's last block of weights (872 MB for an 8B block) would otherwise stay in memory."""
    m = model.replace(**change)
    out = propagate_request(m, ids, req, positions).fit(read)
    del m
    gc.collect()
    return out


def _fit_record(out: DecayFit) -> dict[str, Any]:
    return {"fit": out.to_dict()}


def _sweep_record(name: str, out: list[tuple[float, DecayFit]]) -> dict[str, Any]:
    return {"sweep": [{name: v, **f.to_dict()} for v, f in out]}
