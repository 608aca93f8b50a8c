"""Positional measurements that run the model: the position-only run and attention by distance.

:func:`position_only` (models with learned or sinusoidal positions): the token embeddings
replaced by zeros, the positions kept, and the result pushed through the stack. At each
analysed layer l its hidden states q_l (T, d), centred over positions, are compared with
the positional part pos_l (T, d) of the real run (:mod:`pyengine.analysis.positions`):

- ``alignment`` = <pos, q_c>_F / (|pos|_F |q_c|_F) (1: the position-only run has the
  positional part's shape), and ``alignment_median``, the median over positions of
  cos(pos_t, q_c,t), which one position cannot decide;
- ``captured`` = |pos V_k V_k^T|_F^2 / |pos|_F^2 with V_k the top-k right singular vectors
  of q_c: the share of the positional part inside the position-only run's subspace;
- ``rel_norm`` = |q_c|_F / |pos|_F.

:func:`attention_distance` (any model; the only positional measurement for rotary
models, whose positions act inside attention and never enter the stream): from attention
patterns a[c, h, i, j] (query i, key j; causal models: j <= i), per layer

- ``profile``: the mean weight as a function of the offset i - j (over heads, contexts
  and queries), indexed by i - j + T - 1;
- ``r2_distance``: per head, the share of the variance of a over (contexts, valid (i, j))
  that the offset i - j explains (a one-way analysis of variance: 1 - SSE/SST about the
  head's mean per offset), averaged over heads; ``r2_key`` the same for the absolute key
  position j; ``r2_distance_no_first`` the offset R^2 over keys j >= 1 (key 0, the sink,
  left out);
- ``sink``: the mean weight on key 0 over queries i >= 1.

:class:`PatternMoments` sums a and a^2 over contexts chunk by chunk, so the patterns of a
large corpus are never held at once; the R^2 follow exactly from those sums.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .. import _validate as _v
from ..models import Stack

__all__ = ["AttentionDistance", "PatternMoments", "PositionOnly", "attention_distance", "position_only"]


@dataclasses.dataclass(frozen=True, eq=False)
class PositionOnly:
    """Per-layer comparison of the position-only run with the positional part (arrays over layers)."""

    alignment: np.ndarray  # (L',)
    alignment_median: np.ndarray  # (L',)
    captured: np.ndarray  # (L',)
    rel_norm: np.ndarray  # (L',)
    k: int

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (v.tolist() if isinstance(v, np.ndarray) else v)
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}


def _cos_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    ok = (na > 0) & (nb > 0)
    return np.where(ok, (a * b).sum(axis=-1) / np.where(ok, na * nb, 1.0), 0.0)


def position_only(model: Any, h: Any, layers: Any, k: int = 4) -> PositionOnly:
    """Compare the position-only run of ``model`` with the positional part of ``h``.

    Parameters
    ----------
    model : Stack
        With ``config.positions`` "learned" or "sinusoidal".
    h : array_like, (L', C, T, d_model), float
        Hidden states of the real run at the hidden-state indices ``layers``.
    layers : sequence of int, (L',)
        Hidden-state indices (0 .. n_layers) of the rows of ``h``.
    k : int
        Dimension of the position-only subspace for ``captured`` (<= T).

    Returns
    -------
    PositionOnly
    """
    if not isinstance(model, Stack):
        raise TypeError(f"model must be a pyengine Stack; got {type(model).__name__}")
    if model.config.positions not in ("learned", "sinusoidal"):
        raise ValueError(f"model must have learned or sinusoidal positions for a position-only run; got "
                         f"{model.config.positions!r} (rotary positions act inside attention: attention_distance)")
    a = _v.float_array("h", h)
    if a.ndim != 4 or a.shape[-1] != model.config.d_model or a.shape[2] < 2:
        raise ValueError(f"h must have shape (L', C, T >= 2, {model.config.d_model}); got {a.shape}")
    lay = _v.indices("layers", layers, model.config.n_layers + 1)
    if lay.shape != (a.shape[0],):
        raise ValueError(f"layers must give one hidden-state index per row of h ({a.shape[0]}); got {lay.size}")
    k = _v.count("k", k)
    T, d = a.shape[2], a.shape[3]
    if k > min(T, d):
        raise ValueError(f"k must be <= min(T, d) = {min(T, d)}; got {k}")
    q = model.hidden_states(np.zeros((T, d), model.dtype)).astype(np.float64)[lay]  # (L', T, d)
    out = {x: np.zeros(lay.size) for x in ("al", "med", "cap", "rel")}
    for i in range(lay.size):
        x = a[i].astype(np.float64)
        pos = x.mean(axis=0) - x.mean(axis=(0, 1))
        qc = q[i] - q[i].mean(axis=0)
        npos, nq = np.linalg.norm(pos), np.linalg.norm(qc)
        if npos == 0 or nq == 0:
            continue
        out["al"][i] = (pos * qc).sum() / (npos * nq)
        out["med"][i] = np.median(_cos_rows(pos, qc))
        vt = np.linalg.svd(qc, full_matrices=False)[2][:k]
        out["cap"][i] = np.linalg.norm(pos @ vt.T) ** 2 / npos ** 2
        out["rel"][i] = nq / npos
    return PositionOnly(out["al"], out["med"], out["cap"], out["rel"], k)


class PatternMoments:
    """Sums over contexts of attention patterns and of their squares, per layer, head and (i, j).

    ``add(p)`` takes one chunk, (L, B, H, T, T) (or (B, H, T, T) for one layer); every chunk
    must have the same L, H and T.
    """

    def __init__(self) -> None:
        self.s1: np.ndarray | None = None
        self.s2: np.ndarray | None = None
        self.n = 0

    def add(self, patterns: Any) -> None:
        p = _v.float_array("patterns", patterns)
        if p.ndim == 4:
            p = p[None]
        if p.ndim != 5 or p.shape[-1] != p.shape[-2] or p.shape[1] < 1:
            raise ValueError(f"patterns must have shape (L, B, H, T, T) or (B, H, T, T); got {p.shape}")
        p = p.astype(np.float64)
        s1, s2 = p.sum(axis=1), (p * p).sum(axis=1)
        if self.s1 is None:
            self.s1, self.s2 = s1, s2
        elif self.s1.shape != s1.shape:
            raise ValueError(f"patterns must match the earlier chunks' (L, H, T, T) = {self.s1.shape}; got {s1.shape}")
        else:
            self.s1 += s1
            self.s2 += s2
        self.n += p.shape[1]


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionDistance:
    """What :func:`attention_distance` measured (L = layers of patterns, T positions)."""

    profile: np.ndarray  # (L, 2T - 1) mean weight at offset i - j (index i - j + T - 1), NaN where none
    r2_distance: np.ndarray  # (L,)
    r2_key: np.ndarray  # (L,)
    r2_distance_no_first: np.ndarray  # (L,)
    sink: np.ndarray  # (L,)
    causal: bool
    contexts: int

    def to_dict(self) -> dict[str, Any]:
        return {"profile": [[None if np.isnan(v) else v for v in row] for row in self.profile.tolist()],
                "r2_distance": self.r2_distance.tolist(), "r2_key": self.r2_key.tolist(),
                "r2_distance_no_first": self.r2_distance_no_first.tolist(), "sink": self.sink.tolist(),
                "causal": self.causal, "contexts": self.contexts}


def _r2(s1: np.ndarray, s2: np.ndarray, n: int, group: np.ndarray, ngroups: int) -> np.ndarray:
    """(H,) one-way R^2 of the entries (columns of s1, s2: (H, m)) grouped by ``group`` (m,)."""
    count = np.bincount(group, minlength=ngroups) * n
    gsum = np.stack([np.bincount(group, weights=r, minlength=ngroups) for r in s1])  # (H, G)
    mean = gsum / np.where(count > 0, count, 1)
    m = mean[:, group]
    sse = (s2 - 2 * m * s1 + n * m * m).sum(axis=1)
    tot = s1.sum(axis=1)
    sst = s2.sum(axis=1) - tot * tot / (n * group.size)
    return np.where(sst > 1e-300, 1.0 - sse / np.where(sst > 1e-300, sst, 1.0), 0.0)


def attention_distance(patterns: Any, *, causal: bool = True) -> AttentionDistance:
    """How the attention pattern depends on the query-key offset; see the module.

    Parameters
    ----------
    patterns : array_like (L, C, H, T, T) or (C, H, T, T), float; or PatternMoments
        Softmax attention weights (``blocks.*.attn.pattern`` of ``run_with_cache``), T >= 3.
    causal : bool
        Only keys j <= i count (the weights above the diagonal are zero by the mask).

    Returns
    -------
    AttentionDistance
    """
    causal = _v.flag("causal", causal)
    mom = patterns if isinstance(patterns, PatternMoments) else PatternMoments()
    if mom is not patterns:
        mom.add(patterns)
    if mom.s1 is None:
        raise ValueError("patterns holds no chunk yet")
    s1, s2, n = mom.s1, mom.s2, mom.n
    L, H, T, _ = s1.shape
    if T < 3:
        raise ValueError(f"patterns need T >= 3 positions; got {T}")
    i, j = np.indices((T, T))
    valid = (j <= i) if causal else np.ones((T, T), bool)
    later = valid & (j >= 1)
    off = (i - j + T - 1)
    prof, r2d, r2k, r2n, sink = np.full((L, 2 * T - 1), np.nan), np.zeros(L), np.zeros(L), np.zeros(L), np.zeros(L)
    cnt = np.bincount(off[valid], minlength=2 * T - 1)
    for l in range(L):
        a1, a2 = s1[l][:, valid], s2[l][:, valid]  # (H, m)
        w = np.bincount(off[valid], weights=a1.sum(axis=0), minlength=2 * T - 1)
        prof[l] = np.where(cnt > 0, w / np.where(cnt > 0, cnt * n * H, 1), np.nan)
        r2d[l] = _r2(a1, a2, n, off[valid], 2 * T - 1).mean()
        r2k[l] = _r2(a1, a2, n, j[valid], T).mean()
        r2n[l] = _r2(s1[l][:, later], s2[l][:, later], n, off[later], 2 * T - 1).mean()
        sink[l] = s1[l][:, 1:, 0].sum() / (n * H * (T - 1))
    return AttentionDistance(prof, r2d, r2k, r2n, sink, causal, n)
