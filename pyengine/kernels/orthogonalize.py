"""Batched Newton–Schulz orthogonalization: the polar factor U Vᵀ of G = U Σ Vᵀ, approximately.

``orthogonalize(g)`` runs the registry kernel ``newton_schulz`` (three backends; the
mathematics is in :mod:`pyengine.kernels._reference.orthogonalize`) on every matrix of
``g`` (..., m, n) after dividing it by its Frobenius norm. Schedules:

- ``"quintic"`` (default, 5 steps): Muon's (a, b, c) = (3.4445, -4.7750, 2.0315). Fast
  and *not convergent*: singular values with sigma/||G||_F >= 3e-3 land in about
  [0.68, 1.13] (a + b + c = 0.701, so 1 is not a fixed point).
- ``"cubic"`` (24 steps): (1.5, -0.5, 0), the classic Newton–Schulz iteration, which
  converges quadratically near 1 for every sigma in (0, sqrt 3); from a small
  sigma/||G||_F it needs about log(||G||_F/sigma)/log(1.5) steps to get there.
- ``"hybrid"`` (12 steps): the first min(5, steps) quintic, the rest cubic: the
  quintic's fast growth, then the cubic's convergence (after 5 + 7 steps the singular
  values with sigma/||G||_F >= 3e-3 are 1 to about 1e-12 in float64).

``coeffs=`` takes any (S, 3) schedule instead. ``return_info=True`` also returns the
singular values of the result and their distance from 1, max |sigma_i - 1| per matrix
(by a dense SVD in float64, so it costs about as much as the exact polar factor).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .. import _validate as _v
from ..backends import resolve

__all__ = ["SCHEDULES", "Orthogonalized", "newton_schulz_coefficients", "orthogonalize"]

#: Per-step coefficients (a, b, c) of p(X) = a X + b X XᵀX + c X (XᵀX)².
QUINTIC = (3.4445, -4.7750, 2.0315)
CUBIC = (1.5, -0.5, 0.0)
#: Schedule name -> default number of steps.
SCHEDULES = {"quintic": 5, "cubic": 24, "hybrid": 12}


class Orthogonalized(NamedTuple):
    """The result of ``orthogonalize(..., return_info=True)``."""

    #: The orthogonalized matrices, shape and dtype of g.
    q: np.ndarray
    #: Their singular values, (..., min(m, n)), descending, float64.
    sigma: np.ndarray
    #: ``max_i |sigma_i - 1|`` per matrix, (...,).
    distance: np.ndarray


def newton_schulz_coefficients(schedule: str = "quintic", steps: int | None = None) -> np.ndarray:
    """The (steps, 3) float64 coefficients of a named schedule (see the module docstring)."""
    _v.choice("schedule", schedule, tuple(SCHEDULES))
    steps = SCHEDULES[schedule] if steps is None else _v.count("steps", steps)
    if schedule == "quintic":
        rows = [QUINTIC] * steps
    elif schedule == "cubic":
        rows = [CUBIC] * steps
    else:
        rows = [QUINTIC] * min(5, steps) + [CUBIC] * max(0, steps - 5)
    return np.array(rows, np.float64).reshape(steps, 3)


def orthogonalize(
    g: Any, schedule: str = "quintic", steps: int | None = None, *, coeffs: Any = None,
    out: np.ndarray | None = None, return_info: bool = False, backend: str = "auto",
) -> np.ndarray | Orthogonalized:
    """Newton–Schulz orthogonalization of every matrix of ``g``.

    Parameters
    ----------
    g : array_like, shape (..., m, n), float32 or float64
        Finite matrices (gradients, say); each is divided by its Frobenius norm first.
        A zero matrix gives zero.
    schedule : {"quintic", "cubic", "hybrid"}
    steps : int >= 0, optional
        Number of steps (default: :data:`SCHEDULES`).
    coeffs : array_like, shape (S, 3), optional
        Per-step (a, b, c), instead of a named schedule.
    out : ndarray, shape and dtype of g, C-contiguous, optional
    return_info : bool
        Also return the singular values of the result and their distance from 1.
    backend : {"auto", "cpp", "numba", "numpy"}

    Returns
    -------
    ndarray, shape and dtype of g; or :class:`Orthogonalized` if ``return_info``.

    Raises
    ------
    TypeError, ValueError
        A non-float g, fewer than 2 dimensions, NaN or Inf in g, bad coeffs or steps,
        a bad ``out``, an unknown or unavailable backend.
    """
    fn = resolve("newton_schulz", backend)
    g0 = g
    ga = _v.float_array("g", g)
    if ga.ndim < 2:
        raise ValueError(f"g must have at least 2 dimensions (..., m, n); got shape {ga.shape}")
    _v.finite("g", ga)
    if coeffs is None:
        cf = newton_schulz_coefficients(schedule, steps)
    else:
        cf = np.ascontiguousarray(_v.float_array("coeffs", coeffs), dtype=np.float64)
        if cf.ndim != 2 or cf.shape[1] != 3:
            raise ValueError(f"coeffs must have shape (S, 3); got {cf.shape}")
        _v.finite("coeffs", cf)
    ga = np.ascontiguousarray(ga)
    res = _v.output(out, ga.shape, ga.dtype, (g0, ga), None)[0]
    m, n = ga.shape[-2:]
    if ga.size:
        g3 = ga.reshape(-1, m, n)
        nbad = fn(g3, cf, res.reshape(g3.shape))
        if nbad:  # only an overflowing norm gets here (finite g was checked)
            raise ValueError(f"g has {nbad} matrices whose Frobenius norm overflows {ga.dtype}")
    if not return_info:
        return res
    sigma = np.linalg.svd(res.astype(np.float64), compute_uv=False) if res.size else np.zeros(ga.shape[:-2] + (0,))
    dist = np.abs(sigma - 1.0).max(axis=-1) if sigma.shape[-1] else np.zeros(ga.shape[:-2])
    return Orthogonalized(res, sigma, dist)
