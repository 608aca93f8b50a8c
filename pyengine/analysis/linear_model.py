"""The scaling model of a composed Jacobian, matrix-free: :func:`scaling_fit`, :func:`uniform_split`.

``P = 11^T/d`` and ``I - P`` are orthogonal projectors (``<I - P, P>_F = 0``), so the
least-squares fit of a (d, d) Jacobian ``J`` by ``alpha I + beta 11^T/d`` is::

    a = (tr J - 1^T J 1 / d) / (d - 1),   b = 1^T J 1 / d,   alpha = a,   beta = b - a,
    unexplained = 1 - (a^2 (d - 1) + b^2) / |J|_F^2      (the fraction of |J|_F^2 the fit leaves).

``1^T J 1`` takes one JVP with the all-ones vector. ``tr J`` and ``|J|_F^2`` take either d
JVPs with the basis vectors (exact) or K with Rademacher probes z (Hutchinson:
``E z^T J z = tr J`` and ``E |J z|^2 = |J|_F^2``), whose standard errors come from the
spread of the K samples (for the unexplained fraction, a ratio: the jackknife over the probes).

``J`` here is the diagonal block, at one token, of the Jacobian from hidden state ``layer``
to each later hidden state: every tangent sits at that token only and is pushed through
the block JVPs of :mod:`pyengine.analysis.propagate_stages`, all of them in one batch.
Every LayerNorm Jacobian annihilates ``1``, so for a pre-LN residual stack ``J 1 = 1``
(``b = 1``): the uniform part ``mean(delta) 1`` of a perturbation passes every block on the
residual alone. :func:`uniform_split` measures that part of a propagated delta.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .. import _validate as _v
from .propagate_stages import Request, baseline, sweep

__all__ = ["ScalingFit", "scaling_fit", "scaling_terms", "uniform_split"]


@dataclasses.dataclass(frozen=True, eq=False)
class ScalingFit:
    """Per hidden state k >= ``layer`` (L of them): the fit of the composed Jacobian J_k.

    ``alpha``, ``beta``, ``unexplained`` (L,) float64 and their standard errors
    ``alpha_se`` (also beta's: ``1^T J 1`` is exact), ``unexplained_se``; ``trace``,
    ``frob2`` (``|J_k|_F^2``) and their standard errors; ``ones_drift`` ``|J_k 1 - 1|_inf``.
    ``n_probes`` Rademacher probes, or 0 when tr and ``|J|_F^2`` are exact (d basis
    vectors; every standard error 0). ``token`` the position, ``d`` the width. The standard
    errors are first order: they hold where alpha is resolved (``alpha_se << |alpha|``).
    """

    layer: int
    token: int
    d: int
    n_probes: int
    alpha: np.ndarray
    beta: np.ndarray
    unexplained: np.ndarray
    alpha_se: np.ndarray
    unexplained_se: np.ndarray
    trace: np.ndarray
    trace_se: np.ndarray
    frob2: np.ndarray
    frob2_se: np.ndarray
    ones_drift: np.ndarray

    @property
    def exact(self) -> bool:
        return self.n_probes == 0

    def to_dict(self) -> dict[str, Any]:
        """Plain lists and numbers; ``layers`` the hidden states k."""
        out: dict[str, Any] = {"layers": list(range(self.layer, self.layer + self.alpha.size)),
                               "token": self.token, "d": self.d, "n_probes": self.n_probes,
                               "estimator": "exact (d basis JVPs)" if self.exact else "Hutchinson (Rademacher)"}
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if isinstance(val, np.ndarray):
                out[f.name] = val.tolist()
        return out


def scaling_terms(trace: Any, frob2: Any, ones_sum: Any, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(alpha, beta, unexplained)`` of the fit ``J ~ alpha I + beta 11^T/d`` from ``tr J``,
    ``|J|_F^2`` and ``1^T J 1`` (array_like of one shape, float64; see the module docstring)."""
    tr, f2, s = (np.asarray(x, dtype=np.float64) for x in (trace, frob2, ones_sum))
    b = s / d
    a = (tr - b) / (d - 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return a, b - a, 1.0 - (a * a * (d - 1) + b * b) / f2


def scaling_fit(model: Any, input_ids: Any, layer: int, token: int, *, n_probes: int = 64, seed: int = 0,
                dtype: Any = np.float64, mode: str = "full") -> ScalingFit:
    """Fit ``alpha I + beta 11^T/d`` to the composed Jacobian from hidden state ``layer`` to
    every later one, at ``token``, matrix-free (see the module docstring).

    Parameters
    ----------
    model : Stack
    input_ids : array_like
        One sequence, as :meth:`pyengine.Stack.hidden_states` takes it.
    layer : int
        The hidden state the Jacobians start from (negative counts from the end).
    token : int
        The position (negative from the end) of the tangents and the read-out.
    n_probes : int
        Rademacher probes for tr J and ``|J|_F^2``; when ``n_probes >= d`` the d basis
        vectors are used instead (exact, fewer JVPs).
    seed : int
        Seeds the probes.
    dtype : float32 or float64
        Compute dtype of the JVPs.
    mode : {"full", "frozen_scale"}

    Returns
    -------
    ScalingFit
        Rows for hidden states ``layer`` .. n_layers (row 0 is J = I).
    """
    cfg = model.config
    layer = _v.index_of("layer", layer, cfg.n_layers, "a hidden-state index: the input of a block")
    n_probes = _v.count("n_probes", n_probes)
    seed = _v.int_seed(seed)
    dt = _v.float_dtype("dtype", dtype)
    _v.frozen(mode)
    d = cfg.d_model
    exact = n_probes >= d
    Z = np.eye(d) if exact else np.random.default_rng(seed).choice([-1.0, 1.0], size=(n_probes, d))
    V = np.vstack([Z, np.ones((1, d))]) / np.sqrt(d)  # unit rows: the probes, then 1/sqrt(d)
    req = Request(layer, None, None, V, np.ones(1), True, mode, dt, None, None)
    base = baseline(model, req, input_ids, [token])
    t = int(base.pos[0]) - base.s
    L = cfg.n_layers + 1 - layer
    Y = np.empty((L, V.shape[0], d))  # J_k (V rows) at the token
    for step in sweep(model, req, base):
        Y[step.i, step.rows] = step.delta[:, t]
    Y *= np.sqrt(d)  # J_k Z and J_k 1
    JZ, J1 = Y[:, :-1], Y[:, -1]
    ones_sum, ones_drift = J1.sum(axis=1), np.abs(J1 - 1.0).max(axis=1)
    tz = np.einsum("knd,nd->kn", JZ, Z)  # z^T J z (exact: the diagonal)
    fz = np.einsum("knd,knd->kn", JZ, JZ)  # |J z|^2
    if exact:
        trace, frob2 = tz.sum(axis=1), fz.sum(axis=1)
        zero = np.zeros(L)
        alpha, beta, unexplained = scaling_terms(trace, frob2, ones_sum, d)
        return ScalingFit(layer, int(base.pos[0]), d, 0, alpha, beta, unexplained, zero, zero, trace, zero,
                          frob2, zero.copy(), ones_drift)
    trace, frob2 = tz.mean(axis=1), fz.mean(axis=1)
    alpha, beta, unexplained = scaling_terms(trace, frob2, ones_sum, d)
    K = n_probes
    var_t, var_f = tz.var(axis=1, ddof=1) / K, fz.var(axis=1, ddof=1) / K
    # unexplained is a ratio: its standard error by the jackknife over the probes
    loo_t = (tz.sum(axis=1, keepdims=True) - tz) / (K - 1)
    loo_f = (fz.sum(axis=1, keepdims=True) - fz) / (K - 1)
    loo_u = scaling_terms(loo_t, loo_f, ones_sum[:, None], d)[2]
    var_u = (K - 1) / K * ((loo_u - loo_u.mean(axis=1, keepdims=True)) ** 2).sum(axis=1)
    return ScalingFit(layer, int(base.pos[0]), d, K, alpha, beta, unexplained, np.sqrt(var_t) / (d - 1),
                      np.sqrt(np.maximum(var_u, 0.0)), trace, np.sqrt(var_t), frob2, np.sqrt(var_f), ones_drift)


def uniform_split(deltas: Any) -> tuple[np.ndarray, np.ndarray]:
    """Norms of the uniform part ``mean(delta) 1`` and of the rest ``delta - mean(delta) 1``.

    Parameters
    ----------
    deltas : array_like, (..., d), float
        Perturbations, the last axis the stream.

    Returns
    -------
    uniform, rest : ndarray, (...), float64
        ``|mean(delta)| sqrt(d)`` and ``|delta - mean(delta) 1|``; their squares sum to
        ``|delta|^2``.
    """
    x = np.asarray(deltas, dtype=np.float64)
    if x.ndim < 1 or x.shape[-1] < 2:
        raise ValueError(f"deltas must have a last axis of width d >= 2; got shape {x.shape}")
    m = x.mean(axis=-1)
    return np.abs(m) * np.sqrt(x.shape[-1]), np.linalg.norm(x - m[..., None], axis=-1)
