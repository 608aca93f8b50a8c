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
2. **Residual connections.** The same weights with the residual removed.
3. **Norm parameters.** Sweeps of the norm epsilon and of the global gamma scale.

Every prediction gets a one-line verdict with its numbers; the engine reports what it
measures, also when that contradicts the hypothesis.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import _validate as _v
from ..models import Stack, StackConfig, init_weights
from ..analysis import DecayFit, Propagation, position_mask, propagate, resolve_positions, token_jacobians
from ..analysis.propagate_inputs import resolve_injection
from ..models.site_blocks import site_width
from ._report import LINEAR_TOL, _clean, _verdicts

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


@dataclasses.dataclass(eq=False)
class Recovery:
    """Everything :func:`recovery` measured (see the module docstring).

    ``exact`` / ``linear``: the two :class:`~pyengine.Propagation` runs (K directions x
    S scales). ``fit_exact`` / ``fit_linear``: decay fits of the mean ``|projection|`` at
    the read-out (``read``) and the protocol scale. ``spectral``: per block passed,
    rho and sigma_max of the diagonal Jacobian block at each token of
    ``spectral_tokens`` and ``|A 1 - 1|_inf``. ``linear_gap`` (S,): the largest, over the
    layers after the injection, of ``|delta_ex - delta_lin| / |delta_lin|`` at the read-out
    positions (summed over directions); ``linear_regime`` the longest run of scales
    where it stays within 10 %. ``gain_linear``: the gain along v of each block. ``no_residual``, ``eps_sweep``,
    ``gamma_sweep``: decay fits of the ablations. ``verdicts``: one line per prediction.
    """

    model: str
    config: StackConfig
    text: str | None
    ids: np.ndarray
    layer: int
    read: str
    protocol_scale: float
    exact: Propagation
    linear: Propagation
    fit_exact: DecayFit
    fit_linear: DecayFit
    spectral_tokens: np.ndarray
    rho: np.ndarray  # (n_blocks, R)
    sigma: np.ndarray  # (n_blocks, R)
    ones_residual: np.ndarray  # (n_blocks, R)
    linear_gap: np.ndarray  # (S,)
    linear_regime: tuple[float, float] | None
    no_residual: DecayFit
    eps_sweep: list[tuple[float, DecayFit]]
    gamma_sweep: list[tuple[float, DecayFit]]
    verdicts: list[str]
    seconds: dict[str, float]
    tokens: list[str] | None = None  # the text of each token id (the model's detokenize, or the bytes)
    site: str | None = None  # the site name when injected at one (``layer`` is then its block)

    @property
    def scale_index(self) -> int:
        return int(np.argmin(np.abs(self.exact.scales - self.protocol_scale)))

    @property
    def gain_linear(self) -> np.ndarray:
        """(n_blocks,): v.A_k delta / v.delta of the linearized run (scale-free), geometric
        mean over directions of its magnitude averaged over the read-out positions."""
        li = self.linear
        g = np.abs(li.gain[..., li.position_mask(self.read)])
        with np.errstate(divide="ignore", invalid="ignore"):
            g = _finite_mean(g, axis=-1).reshape(-1, li.K, li.S)[:, :, 0]
            return np.exp(_finite_mean(np.log(g), axis=1))

    def layer_table(self) -> list[dict[str, float]]:
        """One row per hidden state k >= layer: the protocol read-out, mean over directions."""
        j, ex, li = self.scale_index, self.exact, self.linear
        m = ex.position_mask(self.read)

        def at(p: Propagation, metric: str) -> np.ndarray:
            return p.view(metric, self.read).reshape(-1, p.K, p.S)[:, :, j].mean(axis=1)

        gain = self.gain_linear
        rows = []
        for i, k in enumerate(ex.layers):
            whole = float(k).is_integer()  # row 0 of a site inside block k is labelled k + 0.5
            k = int(k) if whole else float(k)
            row = {
                "layer": k,
                "h_norm": float(ex.base_norm[i][m].mean()),
                "delta_norm": float(at(ex, "delta_norm")[i]),
                "projection": float(at(ex, "projection")[i]),
                "projection_linear": float(at(li, "projection")[i]),
                "cosine": float(at(ex, "cosine")[i]),
                "norm_ratio": float(at(ex, "norm_ratio")[i]),
                "gain_linear": float(gain[i - 1]) if i else float("nan"),
                "rho": float(self.rho[i].max()) if i < self.rho.shape[0] else float("nan"),
                "sigma_max": float(self.sigma[i].max()) if i < self.sigma.shape[0] else float("nan"),
                "adjacent_cosine": float(ex.base_adjacent_cosine[k - 1][m].mean()) if whole and k else float("nan"),
                "step_norm": float(ex.base_step[k - 1][m].mean()) if whole and k else float("nan"),
            }
            rows.append(row)
        return rows

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: settings, table, fits, spectra, ablations, verdicts and both runs."""
        return {
            "model": self.model, "config": dataclasses.asdict(self.config), "text": self.text,
            "ids": self.ids.tolist(), "tokens": self.tokens, "layer": self.layer, "site": self.site,
            "read": self.read,
            "protocol_scale": self.protocol_scale, "table": self.layer_table(),
            "fit_exact": self.fit_exact.to_dict(), "fit_linear": self.fit_linear.to_dict(),
            "spectral": {"blocks": list(range(self.layer, self.layer + self.rho.shape[0])),
                         "tokens": self.spectral_tokens.tolist(), "rho": self.rho.tolist(),
                         "sigma_max": self.sigma.tolist(), "ones_residual": self.ones_residual.tolist()},
            "linear_gap": dict(zip(map(float, self.exact.scales), map(float, self.linear_gap))),
            "linear_regime": list(self.linear_regime) if self.linear_regime else None,
            "no_residual": self.no_residual.to_dict(),
            "eps_sweep": [{"eps": e, **f.to_dict()} for e, f in self.eps_sweep],
            "gamma_sweep": [{"gamma_scale": g, **f.to_dict()} for g, f in self.gamma_sweep],
            "verdicts": self.verdicts, "seconds": self.seconds,
            "exact": self.exact.to_dict(), "linear": self.linear.to_dict(),
        }


def _finite_mean(a: np.ndarray, axis: int) -> np.ndarray:
    """The mean of the finite entries along ``axis``; NaN (silently) where there are none
    (a read-out token that was not injected has no gain at the injected state)."""
    ok = np.isfinite(a)
    n = ok.sum(axis=axis)
    total = np.where(ok, a, 0.0).sum(axis=axis)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n > 0, total / np.maximum(n, 1), np.nan)


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


def _linear_gap(ex: Propagation, li: Propagation) -> np.ndarray:
    """(S,): max over the layers after the injection of |delta_ex - delta_lin| / |delta_lin|,
    both summed over the directions and the kept (read-out) positions; NaN where
    delta_lin is 0 at every such layer."""
    L = ex.deltas.shape[0]
    de = ex.deltas[1:].reshape(L - 1, ex.K, ex.S, -1).astype(np.float64)
    dl = li.deltas[1:].reshape(L - 1, li.K, li.S, -1).astype(np.float64)
    num = np.sqrt(((de - dl) ** 2).sum(axis=(1, 3)))
    den = np.sqrt((dl**2).sum(axis=(1, 3)))
    with np.errstate(divide="ignore", invalid="ignore"):
        gap = np.where(den > 0, num / den, np.nan)
    out = np.full(ex.S, np.nan)
    ok = np.isfinite(gap).any(axis=0)
    out[ok] = np.nanmax(gap[:, ok], axis=0)
    return out


def _regime(scales: np.ndarray, gap: np.ndarray) -> tuple[float, float] | None:
    """The longest run of consecutive scales (sorted) whose gap is within LINEAR_TOL."""
    order = np.argsort(scales)
    ok = np.nan_to_num(gap[order], nan=np.inf) <= LINEAR_TOL
    best, run = None, None
    for i, good in enumerate(ok):
        run = (run[0], i) if good and run else ((i, i) if good else None)
        if run and (best is None or run[1] - run[0] > best[1] - best[0]):
            best = run
    return None if best is None else (float(scales[order][best[0]]), float(scales[order][best[1]]))


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
    eps_values: Sequence[float] | None = None,
    gamma_values: Sequence[float] = (0.5, 1.0, 2.0),
    seed: int = 0,
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
    dtype : float32 or float64
        Compute dtype of the propagations.
    progress : callable(fraction, stage), optional
    on_stage : callable(stage, result), optional
        Called when a stage has finished, with its name and its result as plain JSON-ready
        values, NaN and inf as None (``pyengine recovery`` writes each to the output folder at once, so an
        interrupted run keeps every stage already done).
    """
    t_start = time.perf_counter()
    # Every argument is checked here, before the first (expensive) propagation.
    seed = _v.int_seed(seed)
    say = _v.callback(progress, "progress") or (lambda f, s: None)
    keep = _v.callback(on_stage, "on_stage") or (lambda stage, result: None)
    protocol_scale = _v.real("protocol_scale", protocol_scale, low=0, low_open=True)
    scales = _v.as_array("scales", scales, np.float64)
    if scales.ndim != 1 or not np.isfinite(scales).all():
        raise ValueError(f"scales must be a 1-D sequence of finite numbers; got {scales!r}")
    if eps_values is not None:
        eps_values = [_v.real("eps_values", e, low=0) for e in np.atleast_1d(_v.as_array("eps_values", eps_values))]
    gamma_values = [_v.real("gamma_values", g) for g in np.atleast_1d(_v.as_array("gamma_values", gamma_values))]
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None; got {name!r}")
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
    if directions is None:
        n = _v.count("n_directions", n_directions)
        directions = np.random.default_rng(seed).standard_normal((n, width))
    directions = _v.unit_rows("directions", directions, width)  # checked before the first stage
    j = int(np.argmin(np.abs(sc - protocol_scale)))
    seconds: dict[str, float] = {}

    def timed(stage: str, frac0: float, frac1: float, fn: Callable[[Callable[[int, int], None]], Any],
              dump: Callable[[Any], dict[str, Any]] = lambda out: {}) -> Any:
        t0 = time.perf_counter()
        say(frac0, stage)
        out = fn(lambda d, t: say(frac0 + (frac1 - frac0) * d / max(t, 1), stage))
        seconds[stage] = time.perf_counter() - t0
        keep(stage, _clean({"stage": stage, "seconds": seconds[stage], **dump(out)}))
        return out

    tokens = token_strings(model, ids)

    def prop(p: Propagation) -> dict[str, Any]:
        return {"ids": ids.tolist() if ids.ndim == 1 else None, "tokens": tokens, "propagation": dataclasses.replace(p, deltas=None, delta_positions=None).to_dict(),
                "fit": p.fit(read, j).to_dict()}

    def sweep(name: str) -> Callable[[list[tuple[float, DecayFit]]], dict[str, Any]]:
        return lambda out: {"sweep": [{name: v, **f.to_dict()} for v, f in out]}

    run = dict(positions=positions, dtype=dtype)
    ex = timed("exact propagation", 0.0, 0.35,
               lambda cb: propagate(model, ids, directions, sc, layer, return_deltas=read_at, progress=cb, **run), prop)
    li = timed("linearized propagation", 0.35, 0.45,
               lambda cb: propagate(model, ids, directions, sc, layer, linearized=True, return_deltas=read_at,
                                    progress=cb, **run), prop)

    def spectra(cb: Callable[[int, int], None]) -> tuple[np.ndarray, ...]:
        h = model.hidden_states(ids, dtype=np.float64)
        n = cfg.n_layers - block
        rho, sig, one = (np.empty((n, toks.size)) for _ in range(3))
        for i, k in enumerate(range(block, cfg.n_layers)):
            A = token_jacobians(model, h[k], k, toks)
            for r in range(toks.size):
                rho[i, r] = np.abs(np.linalg.eigvals(A[r])).max()
                sig[i, r] = np.linalg.norm(A[r], 2)
                one[i, r] = np.abs(A[r] @ np.ones(cfg.d_model) - 1.0).max()
            cb(i + 1, n)
        return rho, sig, one

    rho, sig, one = timed("block Jacobian spectra", 0.45, 0.7, spectra,
                          lambda out: {"blocks": list(range(block + 1, cfg.n_layers + 1)), "tokens": toks.tolist(),
                                       "rho": out[0].tolist(), "sigma_max": out[1].tolist(),
                                       "ones_residual": out[2].tolist()})

    def fit_of(m: Stack) -> DecayFit:
        return propagate(m, ids, directions, sc[j], layer, **run).fit(read)

    no_res = timed("ablation: no residual", 0.7, 0.75, lambda cb: fit_of(model.replace(residual=False)),
                   lambda out: {"fit": out.to_dict()})
    if eps_values is None:  # the model's eps, and eps comparable to the stream's mean square
        ms = float(np.median(ex.base_norm**2)) / cfg.d_model
        eps_values = sorted({cfg.eps, 1e-2 * ms, 1e-1 * ms, ms})
    eps_sweep = timed("sweep: norm eps", 0.75, 0.9,
                      lambda cb: [(float(e), fit_of(model.replace(eps=float(e)))) for e in eps_values], sweep("eps"))
    gamma_sweep = timed("sweep: gamma scale", 0.9, 1.0,
                        lambda cb: [(float(g), fit_of(model.replace(gamma_scale=float(g)))) for g in gamma_values],
                        sweep("gamma_scale"))
    gap = _linear_gap(ex, li)
    rep = Recovery(
        model=name or type(model).__name__, config=cfg, text=text, ids=ids, layer=ex.layer, read=read,
        protocol_scale=float(sc[j]), exact=dataclasses.replace(ex, deltas=None, delta_positions=None),
        linear=dataclasses.replace(li, deltas=None, delta_positions=None),
        fit_exact=ex.fit(read, j), fit_linear=li.fit(read, j),
        spectral_tokens=toks, rho=rho, sigma=sig, ones_residual=one, linear_gap=gap,
        linear_regime=_regime(sc, gap), no_residual=no_res, eps_sweep=eps_sweep, gamma_sweep=gamma_sweep,
        verdicts=[], seconds=seconds, tokens=tokens, site=ex.site,
    )
    rep.verdicts = _verdicts(rep)
    seconds["total"] = time.perf_counter() - t_start
    say(1.0, "done")
    return rep
