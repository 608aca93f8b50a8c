"""Signal propagation through depth: forward RMS of h_l and backward RMS of dL/dh_l, measured and predicted.

The network is an MLP-only stack (the transformer's MLP path without attention), built
here from :func:`pyengine.models.initialization.init_matrix`, with exact NumPy forward
and backward passes (the norms by pyengine's kernels, every VJP the exact adjoint):

- ``residual=False``: ``h_{l+1} = φ(N(h_l) W_l)``, W_l (d, d) — the plain deep net of
  Glorot & Bengio and He et al.;
- ``residual=True``: ``h_{l+1} = h_l + φ(N(h_l) W1_l) W2_l``, W1 (d, d_mlp), W2 (d_mlp, d)
  — a pre-norm transformer block's MLP branch;

with N = LayerNorm, RMSNorm (gamma 1, beta 0, eps 1e-5) or nothing, φ = relu, gelu, tanh
or linear. Inputs h_0 are N(0, 1) tokens; the backward pass starts from a random
cotangent dL/dh_L ~ N(0, 1) (the loss <u, h_L>).

Prediction (mean field, infinite width; q_l = mean square of h_l, r_l = that of dL/dh_l,
V = Var W of the scheme's formula, :func:`~pyengine.models.initialization.init_variance`;
E over z ~ N(0, s), s = d_in V m_l, m_l the mean square of N(h_l): 1 with a norm, q_l
without; expectations by Gauss–Hermite quadrature):

    plain:     q_{l+1} = E[φ(z)²]                 r_l = r_{l+1} d_out V E[φ'(z)²] λ_l
    residual:  q_{l+1} = q_l + d_mlp V2 E[φ(z)²]  r_l = r_{l+1} (1 + d V2 E[φ'(z)²] d_mlp V1 λ_l)

where λ_l = 1 without a norm and, with one, the norm's backward gain (d - 2)/(d c_l)
for LayerNorm ((d - 1)/(d c_l) for RMSNorm), c_l the variance (mean square) of h_l
that the norm divides by. The assumptions (W independent of h, pre-activations
Gaussian, branch and stream uncorrelated, LayerNorm's mean subtraction ignored in
the forward mean-field term) are what the measurement tests: :attr:`SignalPropagation.departure`.
"""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from scipy import special

from .. import _validate as _v
from ..kernels.layernorm import layer_norm, layer_norm_vjp, rms_norm, rms_norm_vjp
from ..backends import get_num_threads, one_blas_thread
from ..models.initialization import init_matrices, init_variance

__all__ = ["ACTIVATIONS", "SignalPropagation", "gelu_second_moment", "mlp_stack", "mlp_stacks",
           "signal_propagation", "signal_propagations"]

ACTIVATIONS = ("relu", "gelu", "tanh", "linear")
NORMS = ("none", "layernorm", "rmsnorm")
_GH_X, _GH_W = np.polynomial.hermite.hermgauss(80)


def _phi(name: str, u: np.ndarray) -> np.ndarray:
    if name == "relu":
        return np.maximum(u, 0)
    if name == "gelu":
        return u * special.ndtr(u)
    if name == "tanh":
        return np.tanh(u)
    return u


def _dphi(name: str, u: np.ndarray) -> np.ndarray:
    if name == "relu":
        return (u > 0).astype(u.dtype)
    if name == "gelu":
        return special.ndtr(u) + u * np.exp(-0.5 * u * u) / math.sqrt(2 * math.pi)
    if name == "tanh":
        return 1 - np.tanh(u) ** 2
    return np.ones_like(u)


def gelu_second_moment(q: float) -> float:
    """E[gelu(z)²] for z ~ N(0, q), gelu(z) = z Φ(z), exactly.

    With Φ = ½ + ½ erf(z/√2), E[erf(z/√2)²] = (2/π) arcsin(q/(1 + q)) and Stein's
    E[z² f(z)] = q F(q) + 2 q² F'(q) (F(q) = E f(z)):

        E[gelu(z)²] = q/4 + (q/2π) arcsin(q/(1 + q)) + q² / (π (1 + q) √(1 + 2q)).

    Unlike ReLU's q/2 this is not homogeneous in q: the gain E[gelu(z)²]/q rises from 1/4
    (q -> 0: gelu ≈ z/2) through 0.4252 at q = 1 to 1/2 (q -> ∞: gelu ≈ relu), so He's
    factor 2 (exact for ReLU) under-corrects GELU and a plain GELU stack decays, at a rate
    that grows as the signal shrinks.
    """
    q = _v.nonnegative("q", q)
    return q / 4 + q / (2 * math.pi) * math.asin(q / (1 + q)) + q * q / (math.pi * (1 + q) * math.sqrt(1 + 2 * q))


def _gauss(f, s: float) -> float:
    """E f(z), z ~ N(0, s)."""
    return float(np.sum(_GH_W * f(math.sqrt(2.0 * max(s, 0.0)) * _GH_X)) / math.sqrt(math.pi))


@dataclasses.dataclass(frozen=True)
class SignalPropagation:
    """Forward and backward RMS per layer of one stack; arrays of length depth + 1 (h_0 .. h_L)."""

    scheme: str
    activation: str
    norm: str
    residual: bool
    width: int
    forward_rms: np.ndarray
    backward_rms: np.ndarray
    forward_pred: np.ndarray
    backward_pred: np.ndarray
    #: The architecture of a transformer stack (:func:`~pyengine.analysis.stack_stability.stack_signal_propagation`).
    arch: str = ""

    @property
    def depth(self) -> int:
        return len(self.forward_rms) - 1

    @property
    def label(self) -> str:
        if self.arch:
            return f"{self.scheme} {self.activation} {self.arch}"
        return f"{self.scheme} {self.activation} {'pre-' + self.norm if self.norm != 'none' else 'no norm'}" \
               f"{' residual' if self.residual else ''}"

    def ratio(self) -> tuple[np.ndarray, np.ndarray]:
        """Per layer: forward rms_{l+1}/rms_l and backward rms_l/rms_{l+1}."""
        with np.errstate(all="ignore"):
            return self.forward_rms[1:] / self.forward_rms[:-1], self.backward_rms[:-1] / self.backward_rms[1:]

    def departure(self) -> tuple[float, float]:
        """max over layers of ``|log(measured / predicted)|`` (forward, backward): 0 = the formula holds."""
        with np.errstate(all="ignore"):
            f = np.abs(np.log(self.forward_rms / self.forward_pred))
            b = np.abs(np.log(self.backward_rms / self.backward_pred))
        return float(np.nanmax(f)), float(np.nanmax(b))

    def to_text(self, every: int = 0) -> str:
        every = every or max(1, self.depth // 10)
        rows = [self.label, f"{'layer':>5} {'fwd rms':>10} {'predicted':>10} {'bwd rms':>10} {'predicted':>10}"]
        for k in range(0, self.depth + 1, every):
            rows.append(f"{k:>5} {self.forward_rms[k]:>10.4g} {self.forward_pred[k]:>10.4g} "
                        f"{self.backward_rms[k]:>10.4g} {self.backward_pred[k]:>10.4g}")
        f, b = self.departure()
        rows.append(f"max |log(measured/predicted)|: forward {f:.3g}, backward {b:.3g}")
        return "\n".join(rows)


def mlp_stack(depth: int, width: int, scheme: str, *, residual: bool = False, d_mlp: int | None = None,
              seed: int = 0, dtype: Any = np.float64, **init: Any) -> list[tuple[np.ndarray, ...]]:
    """The weights of an MLP-only stack: per layer (W,) (d, d), or (W1, W2) if ``residual``.

    ``init`` goes to :func:`~pyengine.models.initialization.init_matrix` (mode,
    nonlinearity, gain). Each layer's matrices come from their own seeded stream, drawn
    in ``dtype`` directly (float32 weights are not float64 draws rounded).
    """
    return mlp_stacks(depth, width, (scheme,), residual=residual, d_mlp=d_mlp, seed=seed, dtype=dtype,
                      **init)[scheme]


def mlp_stacks(depth: int, width: int, schemes: Any, *, residual: bool = False, d_mlp: int | None = None,
               seed: int = 0, dtype: Any = np.float64, **init: Any) -> dict[str, list[tuple[np.ndarray, ...]]]:
    """:func:`mlp_stack` of several schemes at once: scheme -> its layers, array for array the same.

    Every scheme's layer k comes from the stream (seed, k), so in float32 the schemes that
    consume the same numbers (the normal schemes and orthogonal; the uniform ones) share
    one draw per layer (:func:`~pyengine.models.initialization.init_matrices`). Layers are
    drawn in parallel threads (NumPy's generators release the GIL while filling; the
    orthogonal factorizations run single-threaded BLAS each): the same result for any
    thread count.
    """
    depth, width = _v.count("depth", depth), _v.count("width", width)
    dm = _v.count("d_mlp", d_mlp) if d_mlp is not None else 4 * width
    dt = _v.float_dtype("dtype", dtype)
    seed = _v.int_seed(seed)
    schemes = tuple(schemes)
    res_std = 0.02 / math.sqrt(2 * depth)
    shapes = [(width, dm, 0.02), (dm, width, res_std)] if residual else [(width, width, 0.02)]

    def layer(k: int) -> dict[str, tuple[np.ndarray, ...]]:
        return {s: tuple(m) for s, m in init_matrices([seed, k], schemes, shapes, dtype=dt, **init).items()}

    threads = get_num_threads()
    if threads < 2 or depth < 2:
        per = [layer(k) for k in range(depth)]
    else:
        with one_blas_thread(), ThreadPoolExecutor(min(threads, depth)) as pool:
            per = list(pool.map(layer, range(depth)))
    return {s: [p[s] for p in per] for s in schemes}


def _norm_fwd(norm: str, h: np.ndarray) -> np.ndarray:
    if norm == "layernorm":
        return layer_norm(h)
    return rms_norm(h) if norm == "rmsnorm" else h


def _norm_vjp(norm: str, h: np.ndarray, g: np.ndarray) -> np.ndarray:
    if norm == "layernorm":
        return layer_norm_vjp(h, g)
    return rms_norm_vjp(h, g) if norm == "rmsnorm" else g


def _rms(a: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(a, dtype=np.float64))))


def _predict(layers, scheme: str, activation: str, norm: str, residual: bool, width: int, init: dict):
    """The mean-field RMS of h_l and of dL/dh_l (module docstring), from the scheme's variances."""
    depth = len(layers)
    fin, fout = layers[0][0].shape
    v1 = init_variance(scheme, fin, fout, **init)
    v2 = init_variance(scheme, fout, fin, gpt2_std=0.02 / math.sqrt(2 * depth), **init) if residual else v1
    q, mean, s = [1.0], [0.0], []  # mean square and mean of the entries of h_l; pre-activation variances
    for _ in range(depth):
        s.append(fin * v1 * (1.0 if norm != "none" else q[-1]))
        e_phi2 = _gauss(lambda z: _phi(activation, z) ** 2, s[-1])
        if residual:
            q.append(q[-1] + fout * v2 * e_phi2)
            mean.append(mean[-1])
        else:
            q.append(e_phi2)
            mean.append(_gauss(lambda z: _phi(activation, z), s[-1]))
    r, d = [1.0], width
    for k in range(depth - 1, -1, -1):
        e_dphi2 = _gauss(lambda z: _dphi(activation, z) ** 2, s[k])
        lam = 1.0
        if norm == "layernorm":  # J_LN = (1/sigma)(I - 11ᵀ/d - x̂x̂ᵀ/d): rank d - 2
            lam = (d - 2) / (d * (q[k] - mean[k] ** 2 + 1e-5))
        elif norm == "rmsnorm":
            lam = (d - 1) / (d * (q[k] + 1e-5))
        r.append(r[-1] * (1.0 + fin * v2 * e_dphi2 * fout * v1 * lam if residual else fout * v1 * e_dphi2 * lam))
    return np.sqrt(np.array(q)), np.sqrt(np.array(r[::-1]))


def signal_propagation(
    scheme: str = "kaiming_normal", depth: int = 50, width: int = 256, tokens: int = 128, *,
    activation: str = "relu", norm: str = "none", residual: bool = False, d_mlp: int | None = None,
    seed: int = 0, dtype: Any = np.float64, layers: list[tuple[np.ndarray, ...]] | None = None, **init: Any,
) -> SignalPropagation:
    """Measure forward and backward RMS per layer of an MLP-only stack, beside the mean-field prediction.

    Parameters
    ----------
    scheme : str
        An initialization scheme of :mod:`pyengine.models.initialization` (``init``:
        its mode, nonlinearity, gain).
    depth, width, tokens : int
        Layers, d, and the number of N(0, 1) input tokens.
    activation : {"relu", "gelu", "tanh", "linear"}
    norm : {"none", "layernorm", "rmsnorm"}
        Applied before each layer (pre-norm).
    residual : bool
        A residual MLP block per layer (d -> d_mlp -> d, default d_mlp = 4 d) instead of
        one (d, d) layer.
    layers : list, optional
        The weights, as :func:`mlp_stack` returns them for the same scheme, depth, width,
        residual, d_mlp, seed, dtype and ``init`` (to share them between settings).
    """
    return signal_propagations(scheme, depth, width, tokens, activation=activation, norms=(norm,), residual=residual,
                               d_mlp=d_mlp, seed=seed, dtype=dtype, layers=layers, **init)[0]


def signal_propagations(
    scheme: str = "kaiming_normal", depth: int = 50, width: int = 256, tokens: int = 128, *,
    activation: str = "relu", norms: Any = ("none",), residual: bool = False, d_mlp: int | None = None,
    seed: int = 0, dtype: Any = np.float64, layers: list[tuple[np.ndarray, ...]] | None = None, **init: Any,
) -> list[SignalPropagation]:
    """:func:`signal_propagation` for each norm of ``norms`` on the same weights, inputs and cotangents.

    The settings run as one batch: their token rows are stacked, so each layer's weights
    are read once per pass for all of them (each row is normalized and propagated as in its
    own run; the same results to float32 rounding).
    """
    activation = _v.choice("activation", activation, ACTIVATIONS)
    norms = [_v.choice("norm", n, NORMS) for n in norms]
    if not norms:
        raise ValueError("norms must name at least one norm")
    tokens = _v.count("tokens", tokens)
    if layers is None:
        layers = mlp_stack(depth, width, scheme, residual=residual, d_mlp=d_mlp, seed=seed, dtype=dtype, **init)
    dt = layers[0][0].dtype
    rng = np.random.default_rng([_v.int_seed(seed), 1 << 30])
    h0 = rng.standard_normal((tokens, width)).astype(dt)
    g0 = rng.standard_normal((tokens, width)).astype(dt)
    blocks = [slice(i * tokens, (i + 1) * tokens) for i in range(len(norms))]

    def each(fn, a: np.ndarray, *more: np.ndarray) -> np.ndarray:  # fn(norm, rows of a, rows of more) per setting
        if len(norms) == 1:
            return fn(norms[0], a, *more)
        return np.concatenate([fn(n, a[b], *(m[b] for m in more)) for n, b in zip(norms, blocks)])

    def fwd(n, h):
        return _norm_fwd(n, h) if np.all(np.isfinite(h)) else h

    def bwd(n, h, gz):
        return _norm_vjp(n, h, gz) if np.all(np.isfinite(gz)) and np.all(np.isfinite(h)) else gz

    h = np.concatenate([h0] * len(norms)) if len(norms) > 1 else h0
    hs, pre = [h], []
    with np.errstate(over="ignore", invalid="ignore"):
        for ws in layers:
            u = each(fwd, h) @ ws[0]
            pre.append(u)
            a = _phi(activation, u)
            h = h + a @ ws[1] if residual else a
            hs.append(h)
        g = np.concatenate([g0] * len(norms)) if len(norms) > 1 else g0
        gs = [g]
        for k in range(len(layers) - 1, -1, -1):
            ws, u = layers[k], pre[k]
            gb = g @ ws[1].T if residual else g
            gz = (gb * _dphi(activation, u)) @ ws[0].T
            gh = each(bwd, hs[k], gz)
            g = g + gh if residual else gh
            gs.append(g)
    out = []
    for n, b in zip(norms, blocks):
        fw = np.array([_rms(x[b]) for x in hs])
        bw = np.array([_rms(x[b]) for x in gs[::-1]])
        fp, bp = _predict(layers, scheme, activation, n, residual, width, dict(init))
        out.append(SignalPropagation(scheme, activation, n, bool(residual), width, fw, bw, fp, bp))
    return out
