"""Batched perturbation propagation through a stack, exact and linearized, with its metrics.

:func:`propagate` adds delta = scale * v/|v| to one hidden state of a sequence and
follows the injected streams through the remaining blocks, next to the baseline
stream. K directions times S scales go through as one batch (one GEMM per weight
per block). With a causal mask, the rows before the first injected position
cannot change and are not recomputed: their keys and values come from the
baseline. ``linearized=True`` pushes delta through the exact block JVPs at the
baseline instead (one tangent per direction: the result is linear in the scale).

Indexing follows :meth:`pyengine.Stack.hidden_states`: hidden state 0 is the
embedding output, hidden state k the stream after block k (blocks counted from 1);
injecting at ``layer`` perturbs the input of block ``layer + 1``. ``layer`` may also
name a site inside a block, ``"blocks.k.resid_mid"`` and the others of
:mod:`pyengine.analysis.propagate_inputs`: the perturbation is added to that activation
in the forward (exact) or the JVP starts there (linearized). The stages (checks,
baseline, batched sweep, metrics) are in :mod:`pyengine.analysis.propagate_stages`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _validate as _v
from ..kernels import linear_bf16
from ..models import Stack, bf16_products
from .decay import DecayFit, fit_decay
from .propagate_inputs import position_mask, propagate_padded, resolve_injection, resolve_positions
from .propagate_stages import (Metrics, NonFinite, Request, base_stream, baseline, check_request, kept_positions,
                               sweep)

__all__ = ["Propagation", "position_mask", "propagate", "resolve_positions"]


@dataclasses.dataclass(frozen=True, eq=False)
class Propagation:
    """What :func:`propagate` measured. N = K * S perturbations, perturbation ``i * S + j``
    is direction i at scale j; L' = n_layers + 1 - layer hidden states (``layers``).

    Metrics (float64, shape (L', N, T)), at hidden state k, perturbation n, position t,
    with delta = h_inj - h_base:

    - ``cosine``: cos(h_inj, h_base);
    - ``projection``: ``delta . v / |v|`` (v the perturbation's direction);
    - ``norm_ratio``: ``|h_inj| / |h_base|``;
    - ``delta_norm``: ``|delta|``.

    Baseline stream: ``base_norm`` (L', T) = ``|h_k|``; ``base_adjacent_cosine`` and
    ``base_step`` (n_layers, T): ``cos(h_k, h_{k+1})`` and ``|h_{k+1} - h_k|`` for every k.
    ``deltas`` (L', N, P, d) only with ``return_deltas``: delta_k at the positions
    ``delta_positions`` (P of them; all T with ``return_deltas=True``).

    Injected at a site inside block k (``site`` its name, e.g. ``"blocks.2.resid_mid"``):
    ``layer`` = k, and row 0 is the site itself, labelled k + 0.5 in ``layers`` (float:
    k + 0.5, k + 1, ..., n_layers); its metrics compare the site's activation with and
    without delta (``base_norm`` row 0: the site's norm). The directions live in the
    site's space (width d_mlp for ``mlp.hidden``, n_heads * head_dim for
    ``attn.head_out``); for those two, ``projection`` in the hidden states is onto
    ``write_directions`` (v @ w_out resp. v @ w_o, normalized: where the sublayer writes
    v into the stream), and ``deltas`` row 0 is NaN. ``site`` is also set (and ``layers``
    stay integers) for ``resid_pre`` / ``resid_post``, which are hidden states.
    """

    layer: int
    layers: np.ndarray
    directions: np.ndarray  # (K, d) unit, float64
    scales: np.ndarray  # (S,)
    positions: np.ndarray  # (P,) injected positions, sorted
    T: int
    linearized: bool
    mode: str
    causal: bool
    cosine: np.ndarray
    projection: np.ndarray
    norm_ratio: np.ndarray
    delta_norm: np.ndarray
    base_norm: np.ndarray
    base_adjacent_cosine: np.ndarray
    base_step: np.ndarray
    deltas: np.ndarray | None = None
    delta_positions: np.ndarray | None = None
    site: str | None = None
    write_directions: np.ndarray | None = None  # (K, d_model), for sites of another width
    precision: str = "exact"
    precision_error: float | None = None  # bf16: max relative error of the sample (see propagate)

    @property
    def K(self) -> int:
        return int(self.directions.shape[0])

    @property
    def S(self) -> int:
        return int(self.scales.size)

    @property
    def N(self) -> int:
        return self.K * self.S

    @property
    def gain(self) -> np.ndarray:
        """(L' - 1, N, T): projection_{k+1} / projection_k (NaN where projection_k = 0)."""
        p = self.projection
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(p[:-1] != 0, p[1:] / np.where(p[:-1] != 0, p[:-1], 1.0), np.nan)

    def position_mask(self, where: str) -> np.ndarray:
        """(T,) bool: "injected" positions, "downstream" (after the last injected one:
        with causal attention the only other tokens that can move), "last" (the last
        token, the published protocol's read-out) or "all". Without a causal mask
        tokens before the span move too: read them with "all"."""
        return position_mask(where, self.positions, self.T)

    def view(self, metric: str, where: str = "last", reduce: str | None = "mean") -> np.ndarray:
        """A metric at the positions ``where`` selects (see :meth:`position_mask`).

        ``reduce="mean"`` (default): (L', N), the mean over the selected positions;
        ``projection`` is averaged as a magnitude (``|projection|``) there, and the result is
        NaN where the selection is empty (e.g. nothing downstream). ``reduce=None``:
        (L', N, P), the signed values at the P selected positions, nothing averaged
        (``view("projection", "last", reduce=None)[..., 0]`` is the signed last-token
        projection).
        """
        _v.choice("metric", metric, ("cosine", "projection", "norm_ratio", "delta_norm"))
        if reduce is not None:
            _v.choice("reduce", reduce, ("mean",))
        a = getattr(self, metric)
        m = self.position_mask(where)
        if reduce is None:
            return a[..., m].copy()
        if not m.any():
            return np.full(a.shape[:2], np.nan)
        a = a[..., m]
        return (np.abs(a) if metric == "projection" else a).mean(axis=-1)

    def __repr__(self) -> str:
        kind = f"linearized ({self.mode})" if self.linearized else "exact"
        pos = self.positions
        span = (f"{pos[0]}..{pos[-1]}" if pos.size > 1 and np.all(np.diff(pos) == 1) else
                ",".join(map(str, pos[:8])) + (",..." if pos.size > 8 else ""))
        sc = ", ".join(f"{v:g}" for v in self.scales[:6]) + (", ..." if self.S > 6 else "")
        p = np.abs(self.projection[:, :, -1]).mean(axis=1)
        at = (f"hidden state {self.layer}" if self.site is None or self.layers.dtype.kind in "iu"
              else f"site {self.site} (between hidden states {self.layer} and {self.layer + 1})")
        if self.precision != "exact":
            kind += f", {self.precision} (rel. error {self.precision_error:.2g} vs float32 on direction 0)"
        return (f"Propagation({kind}, injected at {at} on {pos.size} of T = {self.T} "
                f"positions ({span}), K = {self.K} directions x S = {self.S} scales [{sc}], hidden states "
                f"{self.layers[0]:g}..{self.layers[-1]:g}, mean |projection| at the last token "
                f"{p[0]:.3g} -> {p[-1]:.3g}{', deltas kept' if self.deltas is not None else ''})")

    def per_direction(self, metric: str) -> np.ndarray:
        """(L', K, S, T): a metric with the perturbation axis split into direction x scale."""
        a = getattr(self, metric)
        return a.reshape(a.shape[0], self.K, self.S, *a.shape[2:])

    def fit(self, where: str = "last", scale_index: int | None = None) -> DecayFit:
        """Decay fit of the mean (over directions) ``|projection|`` at positions ``where``.

        One scale: ``scale_index`` (default the largest). The first point is the
        injected hidden state ``layer`` itself, unless no selected position is injected.
        """
        j = int(np.argmax(self.scales)) if scale_index is None else _v.index("scale_index", scale_index, self.S)
        v = self.view("projection", where).reshape(-1, self.K, self.S)[:, :, j].mean(axis=1)
        return fit_decay(v, self.layers)

    def fits(self, where: str = "last") -> list[list[DecayFit]]:
        """Decay fit per direction and scale: ``fits()[i][j]``."""
        v = self.view("projection", where).reshape(-1, self.K, self.S)
        return [[fit_decay(v[:, i, j], self.layers) for j in range(self.S)] for i in range(self.K)]

    def to_dict(self) -> dict[str, Any]:
        """Plain lists and numbers (JSON-ready); deltas are left out."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if f.name in ("deltas", "delta_positions") or (f.name == "write_directions" and val is None):
                continue
            if f.name in ("precision", "precision_error") and self.precision == "exact":
                continue
            out[f.name] = val.tolist() if isinstance(val, np.ndarray) else val
        return out


def propagate(
    model: Any,
    input_ids: Any,
    direction: Any,
    scale: Any,
    layer: int,
    positions: Any = "all",
    *,
    linearized: bool = False,
    mode: str = "full",
    dtype: Any = None,
    batch_size: int | None = None,
    return_deltas: Any = False,
    progress: Callable[[int, int], None] | None = None,
    attention_mask: Any = None,
    precision: str = "exact",
) -> Propagation:
    """Inject ``scale * v/|v|`` into hidden state ``layer`` and propagate it to the last block.

    Parameters
    ----------
    model : Stack (or a pretrained model)
    input_ids : array_like
        One sequence: token ids (T,) (the stack needs an embedding), or a float
        residual-stream input (T, d_model) (see :meth:`Stack.hidden_states`).
    direction : array_like, (d_model,) or (K, d_model)
        Directions v (normalized here; the zero vector is an error).
    scale : float or array_like (S,)
        The perturbation is ``delta = scale * v/|v|`` (absolute, in the stream's units).
    layer : int in [0, n_layers - 1], or a site name
        Hidden-state index of the injection (the input of block layer + 1), or a site
        ``"blocks.k.<site>"``: ``resid_pre`` (= hidden state k), ``resid_post`` (= k + 1),
        or one inside block k (``resid_mid``, ``norm1.input``, ``norm1.output``,
        ``attn.head_out``, ``attn.out``, ``norm2.*``, ``mlp.hidden``, ``mlp.out``; see
        :class:`Propagation` for the rows and the directions' width). Other sites
        (``*.scale``, ``attn.scores``, ``attn.pattern``) are an error listing the valid ones.
    positions : "all", "last", int, slice or sequence of ints
        Token positions that receive delta (negative count from the end).
    linearized : bool
        Push delta through the block JVPs at the baseline (first order) instead of
        the exact blocks.
    mode : {"full", "frozen_scale"}
        Norm linearization of the JVPs (linearized only).
    dtype : float32 or float64, optional
        Compute dtype (default the model's). Metrics are float64 either way.
    batch_size : int, optional
        Perturbations per batched pass (default: as many as fit in about 1 GiB of
        activations).
    return_deltas : bool or positions
        Also keep delta_k = h_inj - h_base for every k: True keeps all T positions,
        (L', N, T, d_model) in ``dtype``; a positions spec (as ``positions``) keeps
        only those, (L', N, P, d_model).
    progress : callable(done, total), optional
        Called after every block of every batch.
    attention_mask : array_like (T,) or (B, T), optional
        Padding of ``input_ids`` (see :meth:`Stack.hidden_states`): the padding is
        stripped and each sequence propagated on its own (positions count real tokens);
        a batch (B, T) returns a list of B Propagations.
    precision : {"exact", "bf16"}
        "bf16": the weight products take bf16 operands with float32 accumulation
        (:mod:`pyengine.kernels.linear_bf16`; float32 compute dtype only; attention heads,
        norms and activations stay float32). The first direction (all scales) is then
        propagated again in float32 and ``precision_error`` set to the larger of the
        relative errors ``max|a - a_f32| / max|a_f32|`` of ``projection`` and ``delta_norm``
        on it.

    Returns
    -------
    Propagation (a list of them for a padded batch)

    Raises
    ------
    TypeError, ValueError
        A bad argument, named, before the baseline forward (``precision="bf16"`` where it
        is refused: float64, a CPU without avx512_bf16 and amx_bf16, MKL not the BLAS) (``positions``,
        ``return_deltas`` and a site direction that the weights after the site send to
        zero right after it: they need the forward). ValueError when the perturbed
        stream (or the tangent) overflows to NaN or Inf, naming the hidden state and
        block where it first did.
    """
    if not isinstance(model, Stack):
        raise TypeError(f"model must be a pyengine Stack or pretrained model; got {type(model).__name__}")
    inj = resolve_injection(layer, model.config)
    precision = _v.choice("precision", precision, ("exact", "bf16"))
    if attention_mask is not None:
        kw = dict(linearized=linearized, mode=mode, dtype=dtype, batch_size=batch_size, return_deltas=return_deltas,
                  progress=progress, precision=precision)
        return propagate_padded(lambda r: propagate(model, r, direction, scale, layer, positions, **kw),
                                model, input_ids, attention_mask)
    req = check_request(model, inj, direction, scale, linearized=linearized, mode=mode, dtype=dtype,
                        batch_size=batch_size, progress=progress)
    return propagate_request(model, input_ids, req, positions, return_deltas, precision=precision)


def _sample_error(res: Propagation, ref: Propagation) -> float:
    """max over ``projection`` and ``delta_norm`` of ``max|a - a_ref| / max|a_ref|`` on ``ref``'s perturbations.

    ``ref`` propagated the first ``ref.N`` of ``res``'s perturbations (its first direction).
    """
    err = 0.0
    for name in ("projection", "delta_norm"):
        a, b = getattr(res, name)[:, : ref.N], getattr(ref, name)
        scale = float(np.abs(b).max())
        err = max(err, float(np.abs(a - b).max()) / scale if scale > 0 else float(np.abs(a).max()))
    return err


def propagate_request(model: Stack, input_ids: Any, req: Request, positions: Any = "all",
                      return_deltas: Any = False, *, precision: str = "exact") -> Propagation:
    """:func:`propagate` of one sequence, its arguments already checked.

    ``req`` comes from :func:`~pyengine.analysis.propagate_stages.check_request`, or is
    built from arguments checked as it checks them; nothing in it is checked again, so
    ``model`` must be a Stack it fits (the one it was checked against, or one of the same
    shape, e.g. ``model.replace(eps=...)``). ``input_ids`` (checked by the forward),
    ``positions`` and ``return_deltas`` as propagate takes them. NaN or Inf in the
    propagated stream is one ValueError naming the block where it first appeared.
    ``precision`` as :func:`propagate` takes it ("bf16": refused here with one line where
    unavailable, and the result carries ``precision_error``).
    """
    if _v.choice("precision", precision, ("exact", "bf16")) == "bf16":
        linear_bf16.require(req.dt)
        with bf16_products():
            res = propagate_request(model, input_ids, req, positions, return_deltas)
        ref = propagate_request(model, input_ids, req._replace(V=req.V[:1], progress=None), positions)
        return dataclasses.replace(res, precision=precision, precision_error=_sample_error(res, ref))
    base = baseline(model, req, input_ids, positions)
    T, d = base.h.shape[1:]
    keep = kept_positions(return_deltas, T)
    metrics = Metrics(base.hb2, req.S, req.linearized, req.V.shape[0], T, keep=keep, d=d, dt=req.dt,
                      width_differs=base.Vw is not None)
    try:
        for step in sweep(model, req, base):
            metrics.add(step)
    except NonFinite as err:
        raise metrics.nonfinite(err, req, base) from None
    adj, step_norm = base_stream(base.hf, base.sq)
    layers = np.arange(req.layer, model.config.n_layers + 1)
    if req.site is not None:
        layers = np.concatenate([[req.layer + 0.5], layers[1:]]).astype(np.float64)
    return Propagation(
        layer=req.layer, layers=layers, directions=req.V, scales=req.S, positions=base.pos, T=T,
        linearized=req.linearized, mode=req.mode, causal=model.config.causal, cosine=metrics.cosine,
        projection=metrics.projection, norm_ratio=metrics.norm_ratio, delta_norm=metrics.delta_norm,
        base_norm=base.base_norm, base_adjacent_cosine=adj, base_step=step_norm, deltas=metrics.deltas,
        delta_positions=keep, site=req.name, write_directions=base.Vw,
    )
