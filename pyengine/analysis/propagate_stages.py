"""The stages of :func:`pyengine.propagate`, each callable and testable on its own.

1. :func:`check_request` checks every argument but the sequence, before any kernel runs,
   into a :class:`Request`; :func:`baseline` runs the baseline forward of the sequence
   and prepares what the next stages read (:class:`Baseline`).
2. :func:`sweep` pushes the perturbations through the blocks in batches, exact or
   linearized, and yields the delta of every row of the metrics (:class:`Step`). The
   blocks run without per-block checks: their inputs are the checked injection and
   their own outputs. NaN or Inf in the stream is found once, at the end of a batch (or
   when a kernel refuses a non-finite row), and raised as :class:`NonFinite`.
3. :class:`Metrics` accumulates the metrics (and the kept deltas) of every step;
   :meth:`Metrics.nonfinite` turns a :class:`NonFinite` into the error that names the
   block where NaN or Inf first appeared, read from the metrics already accumulated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from .. import _validate as _v
from ..models.site_blocks import site_forward, site_jvp, site_value, site_width, write_matrix
from .propagate_inputs import Injection, resolve_positions

__all__ = ["Baseline", "Metrics", "NonFinite", "Request", "Step", "baseline", "base_stream", "check_request",
           "kept_positions", "sweep"]

#: Bytes of activations one propagation chunk may hold (sets the default batch size).
CHUNK_BYTES = 1 << 30


class Request(NamedTuple):
    """The checked arguments of one propagation (all but the sequence): what
    :func:`check_request` returns. ``V`` (K, width) unit rows, float64; ``S`` (S,) float64
    finite; ``layer`` a hidden-state index (the site's block when ``site`` is set);
    ``name`` the site name as given (None for an int); ``dt`` the compute dtype;
    ``batch_size`` None for the default."""

    layer: int
    site: str | None
    name: str | None
    V: np.ndarray
    S: np.ndarray
    linearized: bool
    mode: str
    dt: np.dtype
    batch_size: int | None
    progress: Callable[[int, int], None] | None


def check_request(model: Any, inj: Injection, direction: Any, scale: Any, *, linearized: Any, mode: str,
                  dtype: Any, batch_size: Any, progress: Any) -> Request:
    """Every argument of :func:`pyengine.propagate` but the sequence, checked (the
    messages name the arguments of propagate); ``inj`` from ``resolve_injection``."""
    cfg = model.config
    layer = _v.index_of("layer", inj.layer, cfg.n_layers, "a hidden-state index: the input of a block")
    width = cfg.d_model if inj.site is None else site_width(cfg, inj.site)
    V = _v.unit_rows("direction", direction, width)
    S = _v.reals("scale", scale)
    _v.frozen(mode)
    linearized = _v.flag("linearized", linearized)
    progress = _v.callback(progress, "progress")
    dt = model.dtype if dtype is None else _v.float_dtype("dtype", dtype)
    batch_size = _v.count("batch_size", batch_size, allow_none=True)
    return Request(layer, inj.site, inj.name, V, S, bool(linearized), mode, dt, batch_size, progress)


@dataclasses.dataclass(frozen=True, eq=False)
class Baseline:
    """The baseline run of one sequence (T tokens), what the sweep and the metrics read.

    ``h`` (n_layers + 1, T, d) hidden states in the compute dtype, ``caches`` the blocks
    from ``layer`` on; ``hf`` / ``sq`` the hidden states in float64 and ``|h_k|^2`` (n_layers +
    1, T). Rows ``s``.. (T' of them) can move: ``hb0`` (T', width) float64 is row 0's base
    (hidden state ``layer``, or the site's activation), ``hb2`` (L', T') ``|base|^2`` of every
    row, ``base_norm`` (L', T). ``Vw`` (K, d_model): for a site of another width, the unit
    directions it writes into the stream; ``V_dt`` the directions projected on in the
    stream rows, in the compute dtype.
    """

    h: np.ndarray
    caches: list[Any]
    pos: np.ndarray
    s: int
    batch_size: int
    hf: np.ndarray
    sq: np.ndarray
    hb0: np.ndarray
    hb2: np.ndarray
    base_norm: np.ndarray
    Vw: np.ndarray | None
    V_dt: np.ndarray


def baseline(model: Any, req: Request, input_ids: Any, positions: Any) -> Baseline:
    """The baseline forward of ``input_ids`` (checked there) and the injected ``positions``."""
    cfg, layer, dt = model.config, req.layer, req.dt
    h, caches = model.forward(input_ids, dt, cache_from=layer)
    T, d = h.shape[1:]
    pos = resolve_positions(positions, T)
    s = int(pos[0]) if cfg.causal else 0
    batch_size = req.batch_size
    if batch_size is None:
        per = (T - s) * (4 * d + cfg.n_heads * T + 3 * cfg.d_mlp) * dt.itemsize * 2
        batch_size = max(1, CHUNK_BYTES // max(per, 1))
    hf = h.astype(np.float64)
    sq = np.einsum("ktd,ktd->kt", hf, hf)  # |h_k|^2 per position
    hb0, hb2, base_norm, Vw = hf[layer, s:], sq[layer:, s:], np.sqrt(sq[layer:]), None
    if req.site is not None:  # row 0 is the site's activation, not hidden state ``layer``
        b0 = site_value(model, caches[0], req.site).astype(np.float64)
        sq0 = np.einsum("td,td->t", b0, b0)
        hb0, hb2 = b0[s:], np.concatenate([sq0[None, s:], hb2[1:]])
        base_norm = np.concatenate([np.sqrt(sq0)[None], base_norm[1:]])
        Vw = _written(model, req)
    V_dt = (req.V if Vw is None else Vw).astype(dt)
    return Baseline(h, caches, pos, s, batch_size, hf, sq, hb0, hb2, base_norm, Vw, V_dt)


def _written(model: Any, req: Request) -> np.ndarray | None:
    """(K, d_model) unit rows v @ W of a site of another width (None for the others)."""
    W = write_matrix(model, req.layer, req.site)
    if W is None:
        return None
    Vw = req.V @ W.astype(np.float64)
    nw = np.linalg.norm(Vw, axis=1)
    if (nw == 0).any():
        raise ValueError(f"direction {int(np.argmin(nw))} is in the kernel of the weights after {req.site!r}: "
                         "it writes nothing into the stream")
    return Vw / nw[:, None]


def kept_positions(return_deltas: Any, T: int) -> np.ndarray | None:
    """The positions whose deltas are kept: None (False), all (True) or a positions spec."""
    if not isinstance(return_deltas, (bool, np.bool_)):
        return resolve_positions(return_deltas, T)
    return np.arange(T) if return_deltas else None


class Step(NamedTuple):
    """Row ``i`` of the metrics (hidden state layer + i; row 0 the injected state or site)
    for the sweep rows ``rows`` (perturbations; directions when linearized): ``delta``
    (n, T', width) on rows s.., ``base`` (T', width) the baseline there, ``v`` (n, width)
    the directions projected on. Row 0 in float64 (exact, not rounded), the others in the
    compute dtype."""

    i: int
    rows: np.ndarray
    delta: np.ndarray
    base: np.ndarray
    v: np.ndarray


class NonFinite(Exception):
    """The stream of the batch ``rows`` holds NaN or Inf at row ``upto`` of the metrics (or before)."""

    def __init__(self, rows: np.ndarray, upto: int) -> None:
        super().__init__(f"NaN or Inf by row {upto}")
        self.rows, self.upto = rows, upto


def sweep(model: Any, req: Request, base: Baseline) -> Iterator[Step]:
    """The batched exact / linearized sweep: a :class:`Step` per batch and row of the metrics.

    Exact: every perturbation (direction i at scale j is row i * S + j) runs through the
    blocks. Linearized: one tangent per direction (the metrics scale it). Calls
    ``req.progress(done, total)`` after every block of every batch. Raises
    :class:`NonFinite` when the stream holds NaN or Inf.
    """
    layer, s, dt, S, nS = req.layer, base.s, req.dt, req.S, req.S.size
    L, T = base.h.shape[0] - layer, base.h.shape[1]
    n_rows = req.V.shape[0] * (1 if req.linearized else nS)
    inj_rows = np.zeros((T - s, 1), bool)
    inj_rows[base.pos - s] = True
    total, done = -(-n_rows // base.batch_size) * (L - 1), 0
    for b in range(0, n_rows, base.batch_size):
        rows = np.arange(b, min(b + base.batch_size, n_rows))
        dirs, amp = (rows, np.ones(rows.size)) if req.linearized else (rows // nS, S[rows % nS])
        delta0 = (amp[:, None, None] * req.V[dirs][:, None, :]) * inj_rows  # (n, T', width), float64
        yield Step(0, rows, delta0, base.hb0, req.V[dirs])
        x = (delta0 if req.site is not None or req.linearized else base.h[layer, s:] + delta0).astype(dt)
        for i in range(1, L):
            try:
                x = _block(model, req, base.caches[i - 1], x, i == 1, s)
            except ValueError:  # a kernel refused a row: NaN or Inf in the stream, or a real error
                if np.isfinite(x).all():
                    raise
                raise NonFinite(rows, i - 1) from None
            done += 1
            if req.progress is not None:
                req.progress(done, total)
            hbi = base.h[layer + i, s:]  # dot products in the compute dtype (BLAS-speed)
            yield Step(i, rows, x if req.linearized else x - hbi, hbi, base.V_dt[dirs])
        if not np.isfinite(x).all():  # the one check of the batch: NaN and Inf reach the last block
            raise NonFinite(rows, L - 1)


def _block(model: Any, req: Request, c: Any, x: np.ndarray, at_site: bool, s: int) -> np.ndarray:
    """Block ``c.block`` on the rows s.. of the stream (exact) or tangent (linearized) ``x``;
    from the site on when ``at_site`` (then ``x`` is the delta added at the site)."""
    if at_site and req.site is not None:
        return (site_jvp(model, c, req.site, x, req.mode, start=s) if req.linearized
                else site_forward(model, c, req.site, x, start=s))
    x = np.ascontiguousarray(x)
    return model.jvp_rows(c, x, req.mode, s) if req.linearized else model.forward_rows(c, x)


class Metrics:
    """The metrics (float64, (L', N, T)) of :class:`~pyengine.Propagation`, accumulated
    from the :class:`Step` s of a sweep, and the deltas at the positions ``keep``.

    ``hb2`` (L', T'): ``|base|^2`` of every row on rows s.. (T' = T - s); ``S`` the scales
    (the linearized steps are scaled by each); ``width_differs``: row 0 lives in another
    space than the stream (its deltas are NaN).
    """

    def __init__(self, hb2: np.ndarray, S: np.ndarray, linearized: bool, K: int, T: int, *,
                 keep: np.ndarray | None = None, d: int = 0, dt: Any = np.float64, width_differs: bool = False
                 ) -> None:
        L, self.s = hb2.shape[0], T - hb2.shape[1]
        shape = (L, K * S.size, T)
        self.hb2, self.S, self.linearized, self.width_differs = hb2, S, linearized, width_differs
        self.cosine, self.projection = np.ones(shape), np.zeros(shape)
        self.norm_ratio, self.delta_norm = np.ones(shape), np.zeros(shape)
        self.deltas = None if keep is None else np.zeros((L, shape[1], keep.size, d), dt)
        if self.deltas is not None and width_differs:
            self.deltas[0] = np.nan  # the site's delta lives in another space
        self.kin = None if keep is None else np.flatnonzero(keep >= self.s)  # kept positions that can move
        self.rel = None if keep is None else keep[self.kin] - self.s

    def add(self, step: Step) -> None:
        """The metrics (and kept deltas) of one step."""
        i, rows, delta = step.i, step.rows, step.delta
        dot = np.einsum("ntd,td->nt", delta, step.base).astype(np.float64)
        dd = np.einsum("ntd,ntd->nt", delta, delta).astype(np.float64)
        proj = np.einsum("ntd,nd->nt", delta, step.v).astype(np.float64)
        store = self.deltas is not None and (i or not self.width_differs)
        if self.linearized:  # delta(alpha) = alpha * tangent, for every scale
            for j, a in enumerate(self.S):
                sel = rows * self.S.size + j
                self.put(i, sel, a * dot, a * a * dd, a * proj)
                if store:
                    self.deltas[i][np.ix_(sel, self.kin)] = (a * delta[:, self.rel]).astype(self.deltas.dtype)
        else:
            self.put(i, slice(rows[0], rows[-1] + 1), dot, dd, proj)
            if store:
                self.deltas[i][np.ix_(rows, self.kin)] = delta[:, self.rel].astype(self.deltas.dtype)

    def put(self, i: int, n: Any, dot: np.ndarray, dd: np.ndarray, proj: np.ndarray) -> None:
        """Row i, perturbations n, rows s..: ``delta . h_b``, ``|delta|^2``, ``delta . v`` (n, T')."""
        nb2 = self.hb2[i]
        ni2 = np.maximum(nb2 + 2.0 * dot + dd, 0.0)
        nb, ni = np.sqrt(nb2), np.sqrt(ni2)
        s = self.s
        with np.errstate(divide="ignore", invalid="ignore"):
            self.cosine[i, n, s:] = np.clip((nb2 + dot) / (nb * ni), -1.0, 1.0)
            self.norm_ratio[i, n, s:] = ni / nb
        self.projection[i, n, s:] = proj
        self.delta_norm[i, n, s:] = np.sqrt(dd)

    def nonfinite(self, err: NonFinite, req: Request, base: Baseline) -> ValueError:
        """The error for ``err``: the first row of its batch whose ``|delta|`` is not finite
        (row 0 when none is: the injection itself, rounded to the compute dtype)."""
        nS = self.S.size
        cols = (err.rows[:, None] * nS + np.arange(nS)).ravel() if self.linearized else err.rows
        bad = ~np.isfinite(self.delta_norm[: err.upto + 1, cols]).all(axis=(1, 2))
        i = int(np.argmax(bad)) if bad.any() else 0
        if i == 0:
            at = (f"site {req.name!r}" if req.site is not None else f"hidden state {req.layer}")
            at = f"the injection at {at} (scale * v added, in {req.dt})"
        else:
            at = f"hidden state {req.layer + i} (the output of block {base.caches[i - 1].block + 1}, counted from 1)"
        what = "tangent" if self.linearized else "perturbed stream"
        return ValueError(f"the {what} holds NaN or Inf, first in {at}: {req.dt} overflowed (is the scale "
                          "too large?)")


def base_stream(hf: np.ndarray, sq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n_layers, T) ``cos(h_k, h_{k+1})`` and ``|h_{k+1} - h_k|`` of the baseline (float64 states)."""
    a, b = hf[:-1], hf[1:]
    with np.errstate(divide="ignore", invalid="ignore"):
        adj = np.einsum("ktd,ktd->kt", a, b) / np.sqrt(sq[:-1] * sq[1:])
    return adj, np.linalg.norm(b - a, axis=-1)
