"""Positional signal in the residual stream: decomposition, probe, propagation.

Hidden states ``h[l, c, t]`` (layer l, context c, position t) of C contexts cut to one
length T (:func:`pyengine.corpus.tokenized_corpus`, then :meth:`Stack.hidden_states`).

:func:`positional_decomposition` (Song & Zhong, arXiv 2310.04861), per layer:
mean mu = mean_{c,t} h; positional part pos_t = mean_c h[c, t] - mu (T, d); context part
ctx_c = mean_t h[c, t] - mu (C, d); residual h - mu - pos_t - ctx_c. Reported:

- ``rel_norm`` = sqrt(C) |pos|_F / |h - mu|_F (the share of the centred stream, as a norm,
  that the positional part carries; pos is broadcast over the C contexts);
- ``stable_rank`` |pos|_F^2 / |pos|_2^2 and ``effective_rank`` exp(H(sigma / sum sigma))
  (Roy & Vetterli) of pos;
- ``angles`` (radians, ascending) between the top-k right singular subspace of pos at
  layer l and at layer 0;
- ``incoherence``: max over (t, c) of |cos(pos_t, ctx_c)| (and the mean, ``mean_coherence``);
- ``top_position`` and ``top_share``: the position t holding the largest share
  sum_c |h[c, t] - mu|^2 / |h - mu|_F^2 of the centred stream's energy, and that share.
  In a causal LM the first token (the attention sink, Xiao et al. arXiv 2309.17453) can
  hold nearly all of it, and every statistic above is then that one token's:
  ``dominant_position`` names it where its share exceeds one half.

Two variants take the dominating token out of the statistic: ``exclude_first=N`` drops
positions 0 .. N - 1 before the decomposition, and ``normalize=True`` scales each token
to unit RMS first, x / sqrt(mean_i x_i^2) (pre-LN principal components follow the token
norm, so per-token normalization comes before PCA).

:func:`position_probe`: ridge regression (closed form, via the centred training
rows: the eigendecomposition of their Gram matrix) of the position index t, or of sin/cos features of t, from h_l; K-fold
cross-validation over contexts (a context's tokens are all in one fold), the ridge
strength picked from a grid by pooled held-out R^2, and a shuffled-label control put
through exactly the same procedure.

:func:`positional_propagation`: the top positional directions at layer 0 injected into
one context with :func:`pyengine.propagate` (exact and linearized), their projection and
norm per layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from .. import _validate as _v
from .propagate import propagate

__all__ = ["DOMINANCE", "PositionProbe", "PositionalDecomposition", "PositionalPropagation", "normalize_tokens",
           "position_probe", "positional_decomposition", "positional_propagation", "sincos_targets"]

ALPHAS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # ridge strength relative to mean(sigma^2) of the training rows
DOMINANCE = 0.5  # a position holding more than this share of |h - mu|^2 decides every statistic


def _stream(h: Any, name: str = "h") -> np.ndarray:
    """h as float64 (L, C, T, d); a (C, T, d) array is one layer. Checked before any work."""
    a = _v.float_array(name, h)
    if a.ndim == 3:
        a = a[None]
    if a.ndim != 4 or min(a.shape) < 1:
        raise ValueError(f"{name} must have shape (C, T, d) or (L, C, T, d) with every size >= 1; got {a.shape}")
    if a.shape[1] < 2 or a.shape[2] < 2:
        raise ValueError(f"{name} needs at least 2 contexts and 2 positions; got C = {a.shape[1]}, T = {a.shape[2]}")
    _v.finite(name, a)
    return a.astype(np.float64, copy=False)


@dataclasses.dataclass(frozen=True, eq=False)
class PositionalDecomposition:
    """Per-layer results of :func:`positional_decomposition` (arrays over layers)."""

    rel_norm: np.ndarray  # (L,)
    context_rel_norm: np.ndarray  # (L,) sqrt(T)|ctx|_F / |h - mu|_F
    stable_rank: np.ndarray  # (L,)
    effective_rank: np.ndarray  # (L,)
    angles: np.ndarray  # (L, k) radians, against layer 0
    incoherence: np.ndarray  # (L,)
    mean_coherence: np.ndarray  # (L,)
    singular_values: np.ndarray  # (L, min(T, d)) of pos
    directions: np.ndarray  # (k, d) top-k positional directions at layer 0
    k: int
    top_position: np.ndarray  # (L,) int, index into the original positions
    top_share: np.ndarray  # (L,) its share of |h - mu|_F^2
    exclude_first: int = 0
    normalized: bool = False

    @property
    def dominant_position(self) -> np.ndarray:
        """(L,) int: the position holding more than :data:`DOMINANCE` of ``|h - mu|^2``, or -1."""
        return np.where(self.top_share > DOMINANCE, self.top_position, -1)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: (v.tolist() if isinstance(v, np.ndarray) else v)
               for f in dataclasses.fields(self) if f.name != "directions" for v in [getattr(self, f.name)]}
        out["dominant_position"] = [None if p < 0 else p for p in self.dominant_position.tolist()]
        return out


def _ranks(s: np.ndarray) -> tuple[float, float]:
    if s[0] <= 0:
        return 0.0, 0.0
    p = s / s.sum()
    p = p[p > 0]
    return float((s ** 2).sum() / s[0] ** 2), float(np.exp(-(p * np.log(p)).sum()))


def normalize_tokens(h: Any) -> np.ndarray:
    """Each token vector of ``h`` (..., d) scaled to unit RMS, x / sqrt(mean_i x_i^2), as float64.

    All-zero tokens stay zero. Returns a new array; ``h`` is not modified.
    """
    a = _v.float_array("h", h).astype(np.float64)
    r = np.sqrt((a * a).mean(axis=-1, keepdims=True))
    return a / np.where(r > 0, r, 1.0)


def _first(exclude_first: Any, T: int) -> int:
    if isinstance(exclude_first, bool) or not isinstance(exclude_first, (int, np.integer)) or exclude_first < 0:
        raise ValueError(f"exclude_first must be a non-negative integer; got {exclude_first!r}")
    if T - exclude_first < 2:
        raise ValueError(f"exclude_first must leave at least 2 of the T = {T} positions; got {exclude_first}")
    return int(exclude_first)


def positional_decomposition(h: Any, k: int = 4, *, exclude_first: int = 0,
                             normalize: bool = False) -> PositionalDecomposition:
    """The positional decomposition of hidden states ``h`` (L, C, T, d) or (C, T, d); see the module.

    Parameters
    ----------
    h : array_like, (L, C, T, d) or (C, T, d), float
        Hidden states of C contexts of T tokens at L layers. Not modified.
    k : int
        Dimension (<= min(T - exclude_first, d)) of the positional subspaces compared by
        principal angles.
    exclude_first : int
        Positions 0 .. exclude_first - 1 left out (at least 2 positions must remain).
    normalize : bool
        Scale each token to unit RMS (:func:`normalize_tokens`) before the decomposition.

    Returns
    -------
    PositionalDecomposition
        ``top_position`` counts positions of ``h`` (the excluded ones included).
    """
    a = _stream(h)
    first = _first(exclude_first, a.shape[2])
    normalize = _v.flag("normalize", normalize)
    a = a[:, :, first:]
    L, C, T, d = a.shape
    k = _v.count("k", k)
    if k > min(T, d):
        raise ValueError(f"k must be <= min(T, d) = {min(T, d)}; got {k}")
    n = min(T, d)
    out = {x: np.zeros(L) for x in ("rel", "crel", "sr", "er", "inc", "mc", "top", "share")}
    angles, svals = np.zeros((L, k)), np.zeros((L, n))
    V0 = None
    for l in range(L):
        x = normalize_tokens(a[l]) if normalize else a[l]
        x = x - x.mean(axis=(0, 1))
        energy = (x * x).sum(axis=(0, 2))  # (T,) per position
        out["top"][l] = first + int(np.argmax(energy))
        out["share"][l] = energy.max() / energy.sum() if energy.sum() > 0 else 0.0
        pos, ctx = x.mean(axis=0), x.mean(axis=1)  # (T, d), (C, d)
        tot = np.sqrt((x * x).sum())
        out["rel"][l] = np.sqrt(C) * np.linalg.norm(pos) / tot if tot > 0 else 0.0
        out["crel"][l] = np.sqrt(T) * np.linalg.norm(ctx) / tot if tot > 0 else 0.0
        _, s, vt = np.linalg.svd(pos, full_matrices=False)
        svals[l] = s
        out["sr"][l], out["er"][l] = _ranks(s)
        if V0 is None:
            V0 = vt[:k]
        cosines = np.linalg.svd(V0 @ vt[:k].T, compute_uv=False)
        angles[l] = np.sort(np.arccos(np.clip(cosines, -1.0, 1.0)))
        pn, cn = np.linalg.norm(pos, axis=1), np.linalg.norm(ctx, axis=1)
        ok_p, ok_c = pn > 1e-12 * max(pn.max(), 1e-300), cn > 1e-12 * max(cn.max(), 1e-300)
        if ok_p.any() and ok_c.any():
            cos = np.abs((pos[ok_p] / pn[ok_p, None]) @ (ctx[ok_c] / cn[ok_c, None]).T)
            out["inc"][l], out["mc"][l] = cos.max(), cos.mean()
    return PositionalDecomposition(out["rel"], out["crel"], out["sr"], out["er"], angles, out["inc"], out["mc"],
                                   svals, V0, k, out["top"].astype(np.int64), out["share"], first, normalize)


def sincos_targets(T: int, n_freq: int = 4) -> np.ndarray:
    """(T, 2 n_freq): sin and cos of t * 2 pi / P for periods P = 2T, T, T/2, ... (n_freq of them)."""
    t = np.arange(T, dtype=np.float64)
    w = 2 * np.pi / (2.0 * T / 2.0 ** np.arange(n_freq))
    return np.concatenate([np.sin(t[:, None] * w), np.cos(t[:, None] * w)], axis=1)


@dataclasses.dataclass(frozen=True, eq=False)
class PositionProbe:
    """Per-layer cross-validated R^2 of the position probe (``r2``) and its shuffled control."""

    r2: np.ndarray  # (L,)
    r2_shuffled: np.ndarray  # (L,)
    alpha: np.ndarray  # (L,) chosen relative ridge strength
    target: str
    folds: int

    def to_dict(self) -> dict[str, Any]:
        return {"r2": self.r2.tolist(), "r2_shuffled": self.r2_shuffled.tolist(), "alpha": self.alpha.tolist(),
                "target": self.target, "folds": self.folds}


def _cv_r2(X: np.ndarray, targets: list[np.ndarray], fold_of: np.ndarray, folds: int) -> list[tuple[float, float]]:
    """Per target: the best pooled held-out R^2 over :data:`ALPHAS` and its alpha (ridge on
    centred rows). The per-fold Gram matrices are computed once (one pass over X) and the
    targets share each fold's eigendecomposition."""
    d = X.shape[1]
    parts = [X[fold_of == f] for f in range(folds)]
    grams = [p.T @ p for p in parts]
    sums = [p.sum(axis=0) for p in parts]
    G_all, s_all, n_all = sum(grams), sum(sums), X.shape[0]
    preds = [np.zeros((len(ALPHAS),) + Y.shape) for Y in targets]
    for f in range(folds):
        te = fold_of == f
        n = n_all - parts[f].shape[0]
        mx = (s_all - sums[f]) / n
        G = G_all - grams[f] - n * np.outer(mx, mx)  # centred Gram of the training rows
        with threadpool_limits(1, "blas"):  # a small LAPACK call: threads only contend (5x slower under load)
            w, V = np.linalg.eigh(G)
        w = np.clip(w, 0.0, None)
        scale = w.sum() / d if w.max() > 0 else 1.0
        Xt = (parts[f] - mx) @ V
        for Y, pred in zip(targets, preds):
            my = Y[~te].mean(axis=0)
            vy = V.T @ (X[~te].T @ (Y[~te] - my))  # X^T (y - my) = Xc^T (y - my): sum(y - my) = 0
            for i, al in enumerate(ALPHAS):
                pred[i][te] = Xt @ (vy / (w + al * scale)[:, None]) + my
    out = []
    for Y, pred in zip(targets, preds):
        sst = ((Y - Y.mean(axis=0)) ** 2).sum(axis=0)
        r2 = np.array([np.mean(1.0 - ((Y - p) ** 2).sum(axis=0) / np.where(sst > 0, sst, 1.0)) for p in pred])
        i = int(np.argmax(r2))
        out.append((float(r2[i]), ALPHAS[i]))
    return out


def position_probe(h: Any, *, target: str = "index", folds: int = 5, seed: int = 0,
                   progress: Callable[[int, int], None] | None = None) -> PositionProbe:
    """Cross-validated ridge probe of position from hidden states ``h`` (L, C, T, d) or (C, T, d).

    ``target``: "index" (t) or "sincos" (:func:`sincos_targets`, R^2 averaged over the
    features). Folds split the contexts (C >= folds). The shuffled control permutes the
    target rows (seeded) and is put through the same cross-validation and alpha choice.
    """
    _v.choice("target", target, ("index", "sincos"))
    folds = _v.count("folds", folds)
    progress = _v.callback(progress, "progress")
    a = _stream(h)
    L, C, T, d = a.shape
    if folds < 2 or folds > C:
        raise ValueError(f"folds must be in [2, C = {C}] (contexts are split); got {folds}")
    rng = np.random.default_rng(seed)
    fold_of = np.repeat(rng.permutation(C) % folds, T)
    Y1 = np.arange(T, dtype=np.float64)[:, None] if target == "index" else sincos_targets(T)
    Y = np.tile(Y1, (C, 1))
    Ys = Y[rng.permutation(C * T)]
    r2, r2s, al = np.zeros(L), np.zeros(L), np.zeros(L)
    for l in range(L):
        X = a[l].reshape(C * T, d)
        (r2[l], al[l]), (r2s[l], _) = _cv_r2(X, [Y, Ys], fold_of, folds)
        if progress is not None:
            progress(l + 1, L)
    return PositionProbe(r2, r2s, al, target, folds)


@dataclasses.dataclass(frozen=True, eq=False)
class PositionalPropagation:
    """The layer-0 positional directions pushed through the stack (exact and linearized)."""

    layers: np.ndarray  # (L',)
    scales: np.ndarray  # (K,) |pos| along each direction, per position (RMS over t)
    projection: np.ndarray  # (L', K) mean |delta . v| over positions, exact
    delta_norm: np.ndarray  # (L', K) mean |delta|, exact
    projection_linearized: np.ndarray  # (L', K)
    delta_norm_linearized: np.ndarray  # (L', K)
    projection_median: np.ndarray  # (L', K) median |delta . v| over positions, exact: no one position decides it

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name).tolist() for f in dataclasses.fields(self)}


def positional_propagation(model: Any, input_ids: Any, directions: Any, scales: Any, *,
                           progress: Callable[[int, int], None] | None = None) -> PositionalPropagation:
    """Inject each positional direction (K, d) with its own scale (K,) at every position of one
    context ``input_ids`` at hidden state 0, exact and linearized (:func:`pyengine.propagate`).

    Persistence is then measured the way concept injection is: ``|projection|`` and ``|delta|`` per
    layer, averaged over positions ("all"), and the median ``|projection|`` over positions beside
    the mean. Different scales go through as separate calls.
    """
    V = np.atleast_2d(_v.float_array("directions", directions)).astype(np.float64)
    S = np.atleast_1d(np.asarray(scales, dtype=np.float64))
    if S.shape != (V.shape[0],) or not np.all(np.isfinite(S)) or np.any(S <= 0):
        raise ValueError(f"scales must be {V.shape[0]} positive finite numbers (one per direction); got {S}")
    progress = _v.callback(progress, "progress")
    rows: dict[bool, list[tuple[np.ndarray, np.ndarray]]] = {False: [], True: []}
    medians = []
    layers = None
    for i in range(V.shape[0]):
        for lin in (False, True):
            p = propagate(model, input_ids, V[i], float(S[i]), 0, "all", linearized=lin)
            rows[lin].append((p.view("projection", "all")[:, 0], p.view("delta_norm", "all")[:, 0]))
            layers = p.layers
            if not lin:
                medians.append(np.median(np.abs(p.view("projection", "all", reduce=None)[:, 0]), axis=-1))
        if progress is not None:
            progress(i + 1, V.shape[0])
    ex, li = rows[False], rows[True]
    return PositionalPropagation(np.asarray(layers), S, np.stack([r[0] for r in ex], 1), np.stack([r[1] for r in ex], 1),
                                 np.stack([r[0] for r in li], 1), np.stack([r[1] for r in li], 1), np.stack(medians, 1))
