"""Reference dense-layer kernels: ``linear``, ``linear_act``, ``linear_mul``.

The contract every backend follows, for x (N, k), w (k, n), of one dtype (float32 or
float64), C-contiguous, and out (N, n):

- ``linear(x, w, b, r, out)``: out = x @ w (+ b) (+ r); b (n,) or None, r (N, n) or None.
  ``r`` may be ``out`` itself (the product is added to it); no other overlap with out.
- ``linear_act(x, w, b, activation, u, out)``: u = x @ w (+ b), out = activation(u), with
  activation one of "none", "gelu" (exact), "gelu_tanh", "relu" (the kernels of
  :mod:`pyengine.kernels._reference.activations`). ``u`` (N, n) keeps the pre-activation,
  or is None (not kept). u and out must not overlap each other or the inputs.
- ``linear_mul(x, w, coef, out)``: out = (x @ w) * coef, coef (M, n) with M dividing N:
  row i uses coef[i % M] (an activation's JVP du = (dx @ w) * f'(u), for N = K*T rows
  of K tangents against the M = T rows of the base).

Each returns the number of rows of the product (after b and r, before the activation
or coefficient) holding NaN or Inf; those rows of out are unspecified. Products in the
dtype of x (BLAS); the sums b, then r, in that order, in that dtype; the compiled kernels
agree with this to the rounding of the product (their BLAS calls are tiled differently).
"""

from __future__ import annotations

import numpy as np

from ...backends import register
from . import activations as _act

__all__ = ["ACTIVATIONS", "linear", "linear_act", "linear_mul"]

#: activation name -> the reference kernel (None: identity).
ACTIVATIONS = {"none": None, "gelu": _act.gelu, "gelu_tanh": _act.gelu_tanh, "relu": _act.relu}


def _bad_rows(p: np.ndarray) -> int:
    return int(np.count_nonzero(~np.isfinite(p).all(axis=1))) if p.size else 0


@register("linear", "numpy")
def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, r: np.ndarray | None, out: np.ndarray) -> int:
    """out = x @ w (+ b) (+ r); the rows of the result with NaN/Inf."""
    p = x @ w
    if b is not None:
        p += b
    if r is not None:
        p += r
    out[...] = p
    return _bad_rows(p)


@register("linear_act", "numpy")
def linear_act(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, activation: str, u: np.ndarray | None,
               out: np.ndarray) -> int:
    """u = x @ w (+ b) (kept in u unless None), out = activation(u); the rows of u with NaN/Inf."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")
    p = x @ w
    if b is not None:
        p += b
    if u is not None:
        u[...] = p
    fn = ACTIVATIONS[activation]
    if fn is None:
        out[...] = p
    else:
        fn(p, out)
    return _bad_rows(p)


@register("linear_mul", "numpy")
def linear_mul(x: np.ndarray, w: np.ndarray, coef: np.ndarray, out: np.ndarray) -> int:
    """out = (x @ w) * coef; the rows of x @ w with NaN/Inf."""
    p = x @ w
    m, n = coef.shape
    np.multiply(p.reshape(-1, m, n), coef, out=out.reshape(-1, m, n))
    return _bad_rows(p)
