"""Signal propagation through a full transformer :class:`~pyengine.models.stack.Stack`.

:func:`stack_signal_propagation` measures, per hidden state h_0 .. h_L of one sequence,
the forward RMS of h_l (:meth:`Stack.forward`) and the backward RMS of dL/dh_l for a
random cotangent dL/dh_L ~ N(0, 1) (the loss <u, h_L>), pulled back block by block with
:meth:`Stack.block_vjp` at the caches of that forward (the chain that :meth:`Stack.vjp`
runs; the test checks them against ``Stack.vjp(from_layer=L, to_layer=l)``).

Prediction (mean field, the MLP-only formulas of :mod:`pyengine.analysis.stability`
extended by the attention branch). Per block, with q = mean square of h, r = that of
dL/dh, V_x = Var of matrix x (the scheme's formula if ``scheme`` is given, else the
mean square of the stored matrix), m = the mean square of N(h) (1 with a norm of gamma 1):

    attention branch  a = d V_v · d_att V_o · κ m,  κ = mean_i Σ_j α_ij² for uniform α
                      (causal: H_T / T, H_T the harmonic number; bidirectional: 1/T)
    MLP branch        f = d_mlp V_out E[φ(z)²],  z ~ N(0, d V_in m)
    pre, residual     q' = q + a + f (sequential: f at m of h + a)
    post              q' = 1 (the block ends with its norm), backward gain λ(q + a + f)
    no residual       q' = the branches chained

and backward the same branches' gains (d_att V_v d V_o κ for attention, d V_in E[φ'(z)²]
d_mlp V_out for the MLP), times the norm's gain λ = (d - 2)/(d c) (LayerNorm;
(d - 1)/(d c) RMSNorm) at the variance c of the normed input. The assumptions that break
(attention probabilities uniform, tokens uncorrelated, branch and stream uncorrelated,
the score path's gradient ignored) are what :meth:`SignalPropagation.departure` measures.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import _validate as _v
from ..models.initialization import init_variance
from .stability import SignalPropagation, _gauss

__all__ = ["stack_signal_propagation"]


def _act(name: str):
    """(φ, φ') of the stack's MLP activation (gelu_tanh ~ gelu in the mean field)."""
    from scipy import special

    if name == "relu":
        return (lambda u: np.maximum(u, 0)), (lambda u: (u > 0).astype(float))
    if name == "silu_gated":  # the gate's silu; the up projection multiplies it (handled by the caller)
        sig = special.expit
        return (lambda u: u * sig(u)), (lambda u: sig(u) * (1 + u * (1 - sig(u))))
    return ((lambda u: u * special.ndtr(u)),
            (lambda u: special.ndtr(u) + u * np.exp(-0.5 * u * u) / math.sqrt(2 * math.pi)))


def _variances(stack: Any, scheme: str | None) -> list[dict[str, float]]:
    """Per block: Var of q, k, v, o, in (gate/up), out, by the scheme's formula or measured."""
    c = stack.config
    d, dh, H, Hkv, n = c.d_model, c.head_dim, c.n_heads, c.n_kv_heads, c.n_layers
    out = []
    for k in range(n):
        w = stack.block_weights(k, np.float64)
        if scheme is None:
            qkv = w["attn.w_qkv"]
            v = {"v": float(np.mean(qkv[:, (H + Hkv) * dh:] ** 2)), "o": float(np.mean(w["attn.w_o"] ** 2)),
                 "in": float(np.mean(w["mlp.w_in"] ** 2)), "out": float(np.mean(w["mlp.w_out"] ** 2))}
        else:
            res = 0.02 / math.sqrt(2 * n)
            v = {"v": init_variance(scheme, d, Hkv * dh), "o": init_variance(scheme, H * dh, d, gpt2_std=res),
                 "in": init_variance(scheme, d, c.d_mlp), "out": init_variance(scheme, c.d_mlp, d, gpt2_std=res)}
        out.append(v)
    return out


def _predict(stack: Any, scheme: str | None, q0: float, r_last: float, T: int) -> tuple[np.ndarray, np.ndarray]:
    c = stack.config
    d, dm, datt = c.d_model, c.d_mlp, c.n_heads * c.head_dim
    kappa = (sum(1.0 / (i + 1) for i in range(T)) / T) if c.causal else 1.0 / T
    phi, dphi = _act(c.activation)
    gated = c.activation == "silu_gated"
    normed = True  # every StackConfig block has its norms
    lam_k = (d - 2) / d if c.norm == "layernorm" else (d - 1) / d

    def branch_attn(m: float, v: dict) -> tuple[float, float]:  # (forward mean square, backward gain)
        return d * v["v"] * datt * v["o"] * kappa * m, datt * v["v"] * d * v["o"] * kappa

    def branch_mlp(m: float, v: dict) -> tuple[float, float]:
        s = d * v["in"] * m
        e2 = _gauss(lambda z: phi(z) ** 2, s)
        de2 = _gauss(lambda z: dphi(z) ** 2, s)
        if gated:  # silu(a) * b, a and b independent N(0, s)
            return dm * v["out"] * e2 * s, d * v["in"] * dm * v["out"] * (de2 * s + e2)
        return dm * v["out"] * e2, d * v["in"] * de2 * dm * v["out"]

    eps = c.eps
    q, fwd, gains = q0, [q0], []  # gains: per block, list of (norm input variance, branch gains) to chain back
    for v in _variances(stack, scheme):
        if c.placement == "post":
            a, ga = branch_attn(q, v)
            keep = 1.0 if c.residual else 0.0
            if c.layout == "parallel":
                f, gf = branch_mlp(q, v)
                gains.append([("post", keep * q + a + f, ga + gf)])
            else:
                f, gf = branch_mlp(1.0, v)
                gains.append([("post", keep + f, gf), ("post", keep * q + a, ga)])
            q = 1.0
        else:
            m = 1.0 if normed else q
            a, ga = branch_attn(m, v)
            if c.layout == "parallel":
                f, gf = branch_mlp(m, v)
                gains.append([("pre", q, ga + gf)])
                q = q + a + f if c.residual else a + f
            else:
                mid = q + a if c.residual else a
                f, gf = branch_mlp(1.0, v)
                gains.append([("pre", mid, gf), ("pre", q, ga)])
                q = mid + f if c.residual else f
        fwd.append(q)
    r, bwd = r_last, [r_last]
    for steps in reversed(gains):
        for kind, cvar, g in steps:  # the block's sub-blocks, last first
            lam = lam_k / (cvar + eps)
            if kind == "post":
                r = r * lam * (1.0 + g) if c.residual else r * lam * g
            else:
                r = r * (1.0 + lam * g) if c.residual else r * lam * g
        bwd.append(r)
    return np.sqrt(np.array(fwd)), np.sqrt(np.array(bwd[::-1]))


def stack_signal_propagation(stack: Any, tokens: int = 128, *, scheme: str | None = None, seed: int = 0,
                             h0: Any = None, cotangent: Any = None, dtype: Any = None) -> SignalPropagation:
    """Forward RMS of h_l and backward RMS of dL/dh_l through every block of ``stack``.

    Parameters
    ----------
    stack : Stack
        Any architecture :class:`~pyengine.models.config.StackConfig` supports.
    tokens : int
        T, the length of the input sequence h_0 (rows N(0, 1), seeded), unless ``h0``.
    scheme : str, optional
        The scheme the stack was initialized with: the prediction then uses its formula
        (:func:`~pyengine.models.initialization.init_variance`); default the measured
        mean square of every stored matrix.
    h0 : array_like, (T, d_model), optional
        The input stream instead of random tokens (learned/sinusoidal positions are added).
    cotangent : array_like, (T, d_model), optional
        dL/dh_L instead of N(0, 1) entries.
    dtype : float32 or float64, optional
        Compute dtype (default the stack's).

    Returns
    -------
    SignalPropagation
        ``forward_rms[l]`` = RMS of hidden state l, ``backward_rms[l]`` = RMS of dL/dh_l,
        beside the mean-field predictions of the module docstring.
    """
    from ..models.stack import Stack

    if not isinstance(stack, Stack):
        raise TypeError(f"stack must be a pyengine Stack; got {type(stack).__name__}")
    c = stack.config
    dt = stack.dtype if dtype is None else _v.float_dtype("dtype", dtype)
    rng = np.random.default_rng([_v.int_seed(seed), 1 << 30])
    if h0 is None:
        h0 = rng.standard_normal((_v.count("tokens", tokens), c.d_model)).astype(dt)
    x, batched = stack.as_stream(h0, "h0", dt)
    if batched:
        raise ValueError(f"h0 must have shape (T, {c.d_model}): one sequence; got {np.shape(h0)}")
    T = x.shape[1]
    if cotangent is None:
        g = rng.standard_normal((T, c.d_model)).astype(dt)
    else:
        g, gb = stack.as_stream(cotangent, "cotangent", dt)
        if gb or g.shape[1] != T:
            raise ValueError(f"cotangent must have shape ({T}, {c.d_model}); got {np.shape(cotangent)}")
        g = g[0]
    hidden, caches = stack.forward(x[0], cache_from=0)
    gs = _pull_back(stack, caches, g)

    def rms(a: np.ndarray) -> float:
        return float(np.sqrt(np.mean(np.square(a, dtype=np.float64))))

    fwd = np.array([rms(h) for h in hidden])
    bwd = np.array([rms(a) for a in gs[::-1]])
    fp, bp = _predict(stack, scheme, fwd[0] ** 2, bwd[-1] ** 2, T)
    arch = (f"{c.placement}-{c.norm} {c.layout}{'' if c.residual else ' no-residual'} "
            f"{'causal' if c.causal else 'bidir'} attn")
    return SignalPropagation(scheme or "stored", c.activation, c.norm, c.residual, c.d_model, fwd, bwd, fp, bp,
                             arch=arch)


def _pull_back(stack: Any, caches: list[Any], g: np.ndarray) -> list[np.ndarray]:
    """dL/dh_l for l = n_layers .. 0, from the checked cotangent ``g`` (T, d_model) of the
    last hidden state: the block VJPs run unchecked, and NaN or Inf is looked for once, at
    the end (or when a kernel refuses a row), and reported at the block it came from."""
    gs = [g]
    for c in reversed(caches):
        try:
            gs.append(stack.vjp_rows(c, gs[-1][None], "full")[0])
        except ValueError:  # a kernel refused a row: NaN or Inf in the cotangent, or a real error
            if np.isfinite(gs[-1]).all():
                raise
            break
    if len(gs) == len(caches) + 1 and np.isfinite(gs[-1]).all():
        return gs
    i = next(i for i, a in enumerate(gs) if not np.isfinite(a).all())  # > 0: the cotangent given is finite
    k = len(caches) - i  # the block (0-based) whose VJP gave gs[i]
    raise ValueError(f"the cotangent holds NaN or Inf, first in dL/dh_{k} (the VJP of block {k}, 0-based): "
                     f"{gs[0].dtype} overflowed")
