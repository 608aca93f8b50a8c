"""NumPy reference of the batched Newton–Schulz orthogonalization (kernel id ``newton_schulz``).

``newton_schulz(g, coeffs, out) -> int``: ``g`` and ``out`` of shape (B, m, n), one dtype
(float32 or float64), C-contiguous; ``coeffs`` (S, 3) float64, one row (a, b, c) per
step. For each matrix G = g[k]:

    X_0 = G / ||G||_F                               (||G||_F accumulated in float64)
    X_{s+1} = a_s X_s + (b_s A_s + c_s A_s²) X_s,   A_s = X_s X_sᵀ   (m <= n)
    X_{s+1} = a_s X_s + X_s (b_s A_s + c_s A_s²),   A_s = X_sᵀ X_s   (m > n)

and ``out[k] = X_S``. Both forms are the same odd polynomial p(X) = a X + b X Xᵀ X +
c X (XᵀX)², applied to every singular value: X_s = U p_s(...p_1(Σ/||G||_F)) Vᵀ for
G = U Σ Vᵀ, so the iteration keeps the singular vectors and moves the singular values
toward 1; the Gram matrix A is formed on the short side (s x s, s = min(m, n)). A step
with c = 0 skips the product A².

Per step that is s² l + s³ (when c != 0) + 2 s² l flops (l = max(m, n); A and A² = A Aᵀ
are symmetric, so BLAS syrk computes one triangle at half a gemm's flops): the
products are the whole cost, and every backend hands them to BLAS in the dtype of g
(float32 products in float32). The scalings, the norm and the sums are the only other
work; the compiled backends must agree with this reference to the rounding of the
products (about 1e-5 relative in float32 after 5 steps, 1e-12 in float64).

A matrix whose norm is 0 gives 0. A matrix whose norm is not finite (NaN or Inf in G,
or overflow) is *bad*: its ``out`` is unspecified, and the return value counts them.

Schedules (public layer, :mod:`pyengine.kernels.orthogonalize`): Muon's quintic
(a, b, c) = (3.4445, -4.7750, 2.0315) for 5 steps maps every singular value with
sigma/||G||_F in [3e-3, 1] into about [0.68, 1.13] (a + b + c = 0.701: 1 is not a
fixed point); the cubic (1.5, -0.5, 0) converges (quadratically near 1) for every
sigma in (0, sqrt 3), so after normalization for all of them, but slowly from small sigma.
"""

from __future__ import annotations

import numpy as np

from ...backends import register

__all__ = ["newton_schulz"]


@register("newton_schulz", "numpy")
def newton_schulz(g: np.ndarray, coeffs: np.ndarray, out: np.ndarray) -> int:
    """Newton–Schulz steps ``coeffs`` (S, 3) on each G = g[k] / ||g[k]||_F into ``out``; bad matrices."""
    bad = 0
    _, m, n = g.shape
    wide = m <= n
    cf = coeffs.astype(g.dtype)  # products and scalings in the dtype of g
    for k in range(g.shape[0]):
        nrm = float(np.sqrt(np.sum(np.square(g[k], dtype=np.float64))))
        if not np.isfinite(nrm):
            bad += 1
            continue
        if nrm == 0.0:
            out[k] = 0
            continue
        x = (g[k] * (1.0 / nrm)).astype(g.dtype)
        for a, b, c in cf:
            gram = x @ x.T if wide else x.T @ x
            poly = b * gram + c * (gram @ gram.T) if c != 0 else b * gram  # A Aᵀ = A²: numpy's syrk
            x = a * x + (poly @ x if wide else x @ poly)
        out[k] = x
    return bad
