"""Steepest-descent directions under a norm: :func:`steepest_descent`, :func:`norm`, :func:`dual_norm`.

For a gradient g and a norm ||.|| with dual norm ||g||† = max_{||t|| = 1} <g, t>,

    argmin_Δ <g, Δ> + (λ/2) ||Δ||²  =  -(||g||† / λ) t*,   t* = argmax_{||t|| = 1} <g, t>

(Bernstein & Newhouse, arXiv 2409.20325), so that <g, Δ*> = -||g||† ||Δ*|| and
||Δ*|| = ||g||†/λ. With ``lr`` = 1/λ, per matrix G = U Σ Vᵀ of shape (d_out, d_in):

=============  ==========================  ==============================  ===============================
norm           ||Δ||                       ||G||†                          Δ*
=============  ==========================  ==============================  ===============================
"l2"           Frobenius ||Δ||_F           ||G||_F                         -lr G
"linf"         max |Δ_ij|                  ||G||_1 = sum |G_ij|            -lr ||G||_1 sign(G) (sign descent)
"spectral"     sigma_max(Δ)                nuclear ||G||_* = tr Σ          -lr ||G||_* U Vᵀ
"rms_to_rms"   sqrt(d_in/d_out) sigma_max  sqrt(d_out/d_in) ||G||_*        -lr (d_out/d_in) ||G||_* U Vᵀ
=============  ==========================  ==============================  ===============================

The spectral directions use the exact polar factor U Vᵀ of an SVD (``method="svd"``) or
the Newton–Schulz kernel (``method="newton_schulz"``, :func:`pyengine.kernels.
orthogonalize.orthogonalize`, its ``schedule`` and ``steps``); with Newton–Schulz's Q
in place of U Vᵀ, ||G||_* is estimated as <G, Q> (exact when Q = U Vᵀ), so the
quintic's Q, whose singular values are only in about [0.68, 1.13], gives a direction
that is close to, not exactly, the argmin. "rms_to_rms" is the spectral condition's
norm (Yang, Simon & Bernstein, arXiv 2310.17813): σ_max measured RMS to RMS.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _validate as _v
from ..kernels.orthogonalize import orthogonalize

__all__ = ["NORMS", "dual_norm", "norm", "steepest_descent"]

NORMS = ("l2", "linf", "spectral", "rms_to_rms")


def _matrices(g: Any, name: str = "g") -> np.ndarray:
    a = _v.float_array(name, g)
    if a.ndim < 2:
        raise ValueError(f"{name} must have at least 2 dimensions (..., d_out, d_in); got shape {a.shape}")
    _v.finite(name, a)
    return a


def _dims(a: np.ndarray, layout: str) -> tuple[int, int]:
    """(d_out, d_in) of the matrices of a."""
    m, n = a.shape[-2:]
    return (m, n) if _v.choice("layout", layout, ("out_in", "in_out")) == "out_in" else (n, m)


def norm(delta: Any, which: str, layout: str = "out_in") -> np.ndarray:
    """||Δ|| of each matrix of ``delta`` (..., m, n) in the norm ``which`` (one of :data:`NORMS`)."""
    a = _matrices(delta, "delta").astype(np.float64)
    which = _v.choice("norm", which, NORMS)
    if which == "l2":
        return np.sqrt(np.sum(a * a, axis=(-2, -1)))
    if which == "linf":
        return np.max(np.abs(a), axis=(-2, -1)) if a.size else np.zeros(a.shape[:-2])
    s = np.linalg.svd(a, compute_uv=False)[..., 0]
    d_out, d_in = _dims(a, layout)
    return s * np.sqrt(d_in / d_out) if which == "rms_to_rms" else s


def dual_norm(g: Any, which: str, layout: str = "out_in") -> np.ndarray:
    """||g||† of each matrix of ``g``: max <g, t> over ||t|| = 1 in the norm ``which``."""
    a = _matrices(g).astype(np.float64)
    which = _v.choice("norm", which, NORMS)
    if which == "l2":
        return np.sqrt(np.sum(a * a, axis=(-2, -1)))
    if which == "linf":
        return np.sum(np.abs(a), axis=(-2, -1))
    nuc = np.linalg.svd(a, compute_uv=False).sum(axis=-1)
    d_out, d_in = _dims(a, layout)
    return nuc * np.sqrt(d_out / d_in) if which == "rms_to_rms" else nuc


def steepest_descent(
    g: Any, norm: str = "spectral", lr: float = 1.0, *, layout: str = "out_in", method: str = "svd",
    schedule: str = "quintic", steps: int | None = None, backend: str = "auto",
) -> np.ndarray:
    """The steepest-descent step Δ* = argmin <g, Δ> + ||Δ||²/(2 lr) under ``norm``, per matrix.

    Parameters
    ----------
    g : array_like, shape (..., m, n), float32 or float64
        Gradients, one matrix per leading index (a stack of layers' weights, say).
    norm : {"l2", "linf", "spectral", "rms_to_rms"}
        See the module docstring for each direction and its dual norm.
    lr : float >= 0
        1/λ.
    layout : {"out_in", "in_out"}
        Which axis is d_out ("out_in": (d_out, d_in), torch's Linear.weight; "in_out":
        pyengine's stored (d_in, d_out)). Only "rms_to_rms" depends on it.
    method : {"svd", "newton_schulz"}
        The polar factor of the spectral norms: exact (LAPACK, float64), or the
        Newton–Schulz kernel with ``schedule`` and ``steps`` on ``backend``.

    Returns
    -------
    ndarray, shape and dtype of g
    """
    a = _matrices(g)
    which = _v.choice("norm", norm, NORMS)
    lr = _v.nonnegative("lr", lr)
    method = _v.choice("method", method, ("svd", "newton_schulz"))
    d_out, d_in = _dims(a, layout)
    if which == "l2":
        return (-lr * a).astype(a.dtype)
    if which == "linf":
        l1 = np.sum(np.abs(a.astype(np.float64)), axis=(-2, -1), keepdims=True)
        return (-lr * l1 * np.sign(a)).astype(a.dtype)
    if method == "svd":
        u, s, vt = np.linalg.svd(a.astype(np.float64), full_matrices=False)
        q = u @ vt
        nuc = s.sum(axis=-1)[..., None, None]
    else:
        q = orthogonalize(a, schedule, steps, backend=backend).astype(np.float64)
        nuc = np.sum(a.astype(np.float64) * q, axis=(-2, -1), keepdims=True)  # <G, Q> = tr Σ if Q = U Vᵀ
    scale = d_out / d_in if which == "rms_to_rms" else 1.0
    return (-lr * scale * nuc * q).astype(a.dtype)
