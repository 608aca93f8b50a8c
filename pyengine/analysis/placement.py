"""LayerNorm placement side by side: norm growth, adjacent cosine, step ratio, block removal.

For hidden states h_0 .. h_L (:meth:`Stack.hidden_states`, batched over contexts), per layer:

- ``norm`` = RMS over tokens of |h_l| / sqrt(d) (post-LN keeps it near 1 at init, pre-LN
  grows with depth: Xiong et al. 2020);
- ``cosine`` = mean over tokens of cos(h_l, h_{l+1}) (block l+1's "Block Influence" is
  1 - cosine, ShortGPT arXiv 2403.03853);
- ``step_ratio`` = mean over tokens of |h_{l+1} - h_l| / |h_l|;
- ``norm_median`` = median over tokens of |h_l| / sqrt(d), the companion of ``norm`` that one
  token cannot decide (a causal LM's first token can be 100x the others), and the token
  that would: ``top_norm_position``, the position with the largest median (over contexts)
  |h_l|, and ``top_norm_ratio``, that median over the median |h_l| of the other positions.

Removing block k (its output := its input, the later blocks unchanged) gives
``removal_change`` = mean over tokens of |h_L' - h_L| / |h_L| of the final hidden state
(after the final norm if the stack has one) and, for a stack with a language-model head,
``removal_kl`` = mean over tokens of KL(p || p') of the next-token distributions and
``removal_top1`` = the share of tokens whose argmax is unchanged. All L removals run
batched: at block j the streams of every removal k < j go through one block call.

``spearman`` is the rank correlation between the Block Influence 1 - cosine and the removal
effect (KL for language models, the hidden change otherwise): low or negative where the
cosine ranking misleads (Hinostroza et al.).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from scipy import stats

from .. import _validate as _v
from ..models import Stack

__all__ = ["PlacementProfile", "block_removal", "placement_profile", "stream_profile", "token_norms"]


@dataclasses.dataclass(frozen=True, eq=False)
class PlacementProfile:
    """What :func:`placement_profile` measured (L = n_layers blocks)."""

    norm: np.ndarray  # (L + 1,)
    cosine: np.ndarray  # (L,)
    step_ratio: np.ndarray  # (L,)
    removal_change: np.ndarray  # (L,)
    removal_kl: np.ndarray | None  # (L,)
    removal_top1: np.ndarray | None  # (L,)
    spearman: float
    contexts: int
    ablation_contexts: int
    norm_median: np.ndarray  # (L + 1,)
    top_norm_position: np.ndarray  # (L + 1,) int
    top_norm_ratio: np.ndarray  # (L + 1,)

    @property
    def influence(self) -> np.ndarray:
        """Block Influence 1 - cos(h_{k-1}, h_k) per block."""
        return 1.0 - self.cosine

    @property
    def removal_effect(self) -> np.ndarray:
        return self.removal_kl if self.removal_kl is not None else self.removal_change

    def disagreements(self, top: int = 3) -> dict[str, list[int]]:
        """Block indices among the ``top`` least influential by cosine but not by removal, and back."""
        top = min(top, self.cosine.size)
        by_cos = set(np.argsort(self.influence)[:top].tolist())
        by_abl = set(np.argsort(self.removal_effect)[:top].tolist())
        return {"least_by_cosine": sorted(by_cos), "least_by_removal": sorted(by_abl),
                "cosine_only": sorted(by_cos - by_abl), "removal_only": sorted(by_abl - by_cos)}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.tolist() if isinstance(v, np.ndarray) else v
        out["disagreements"] = self.disagreements()
        return out


def stream_profile(h: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(norm (L+1,), cosine (L,), step_ratio (L,)) of hidden states (L+1, ..., d); see the module."""
    a = _v.float_array("h", h)
    if a.ndim < 2 or a.shape[0] < 2:
        raise ValueError(f"h must have shape (L + 1, ..., d) with L >= 1; got {a.shape}")
    _v.finite("h", a)
    x = a.reshape(a.shape[0], -1, a.shape[-1]).astype(np.float64)
    n = np.linalg.norm(x, axis=-1)  # (L+1, N)
    safe = np.where(n > 0, n, 1.0)
    norm = np.sqrt((n ** 2).mean(axis=1) / a.shape[-1])
    cos = (np.einsum("lnd,lnd->ln", x[:-1], x[1:]) / (safe[:-1] * safe[1:])).mean(axis=1)
    step = (np.linalg.norm(x[1:] - x[:-1], axis=-1) / safe[:-1]).mean(axis=1)
    return norm, cos, step


def token_norms(h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(norm_median, top_norm_position, top_norm_ratio), each (L+1,), of hidden states
    ``h`` (L+1, C, T, d); see the module (one position: ratio 1)."""
    n = np.linalg.norm(h.astype(np.float64), axis=-1)  # (L+1, C, T)
    med = np.median(n.reshape(n.shape[0], -1), axis=1) / np.sqrt(h.shape[-1])
    per_pos = np.median(n, axis=1)  # (L+1, T)
    top = per_pos.argmax(axis=1)
    others = np.array([np.median(np.delete(per_pos[l], top[l])) if n.shape[2] > 1 else per_pos[l, 0]
                       for l in range(n.shape[0])])
    ratio = per_pos[np.arange(n.shape[0]), top] / np.where(others > 0, others, np.inf)
    return med, top, ratio


def _readout(model: Stack, hL: np.ndarray) -> np.ndarray:
    return model.apply_final_norm(hL) if model.config.final_norm else hL


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def block_removal(model: Stack, h: np.ndarray, *, progress: Callable[[int, int], None] | None = None
                  ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(change, kl, top1), each (L,), of removing each block, from the hidden states
    ``h`` (L+1, B, T, d) of the full run (kl, top1 None without a language-model head)."""
    L = model.config.n_layers
    streams = np.empty((0,) + h.shape[1:], h.dtype)  # removal k < j, stacked
    for j in range(L):
        if streams.shape[0]:
            out = model.block_forward(j, streams.reshape((-1,) + h.shape[2:]))
            streams = out.reshape(streams.shape)
        streams = np.concatenate([streams, h[j][None]])  # removal j: block j's output := its input
        if progress is not None:
            progress(j + 1, L)
    ref = _readout(model, h[-1]).astype(np.float64)
    abl = _readout(model, streams).astype(np.float64)  # (L, B, T, d)
    rn = np.linalg.norm(ref, axis=-1)
    change = (np.linalg.norm(abl - ref, axis=-1) / np.where(rn > 0, rn, 1.0)).mean(axis=(1, 2))
    if model.config.lm_head == "none":
        return change, None, None
    lp = _log_softmax(model.logits(h[-1]))  # (B, T, V)
    p, top = np.exp(lp), lp.argmax(axis=-1)
    kl, top1 = np.zeros(L), np.zeros(L)
    for k in range(L):  # one removal at a time: (B, T, V) logits each
        lq = _log_softmax(model.logits(streams[k]))
        kl[k] = (p * (lp - lq)).sum(axis=-1).mean()
        top1[k] = (lq.argmax(axis=-1) == top).mean()
    return change, kl, top1


def placement_profile(model: Any, inputs: Any, *, ablation_contexts: int | None = 32, chunk: int = 64,
                      hidden: np.ndarray | None = None,
                      progress: Callable[[float, str], None] | None = None) -> PlacementProfile:
    """Norm growth, adjacent cosine, step ratio and block removal of ``model`` on ``inputs``.

    Parameters
    ----------
    model : Stack
    inputs : array_like
        Token ids (C, T) or float streams (C, T, d_model): C contexts of one length.
    ablation_contexts : int or None
        Contexts (the first ones) used for the removals (all if None): removal costs
        about L/2 forwards.
    chunk : int
        Contexts per batched forward.
    hidden : ndarray (L + 1, C, T, d), optional
        ``model.hidden_states(inputs)`` if the caller has it already (not recomputed).
    progress : callable(fraction, stage), optional
    """
    if not isinstance(model, Stack):
        raise TypeError(f"model must be a pyengine Stack or pretrained model; got {type(model).__name__}")
    x = np.asarray(inputs)
    if x.ndim != (2 if x.dtype.kind in "iu" else 3) or x.shape[0] < 1:
        raise ValueError(f"inputs must be token ids (C, T) or streams (C, T, d_model); got shape {x.shape}")
    chunk = _v.count("chunk", chunk)
    na = _v.count("ablation_contexts", ablation_contexts, allow_none=True)
    progress = _v.callback(progress, "progress")
    C = x.shape[0]
    na = C if na is None else min(na, C)
    L = model.config.n_layers
    if hidden is not None:
        if hidden.shape[:3] != (L + 1, C, x.shape[1]):
            raise ValueError(f"hidden must have shape ({L + 1}, {C}, {x.shape[1]}, d); got {hidden.shape}")
    hs = [] if hidden is None else [hidden]
    for i in range(0, C if hidden is None else 0, chunk):
        hs.append(model.hidden_states(x[i:i + chunk]))
        if progress is not None:
            progress(0.4 * min(i + chunk, C) / C, f"forward {min(i + chunk, C)}/{C} contexts")
    h = np.concatenate(hs, axis=1)
    norm, cos, step = stream_profile(h)
    cb = None if progress is None else (lambda j, n: progress(0.4 + 0.6 * j / n, f"block removal {j}/{n}"))
    change, kl, top1 = block_removal(model, h[:, :na], progress=cb)
    eff = kl if kl is not None else change
    rho = float(stats.spearmanr(1.0 - cos, eff).statistic) if L >= 3 else float("nan")
    return PlacementProfile(norm, cos, step, change, kl, top1, rho, C, na, *token_norms(h))
