"""Seeded weight initialization: the schemes, their formulas, and :func:`init_weights` of a Stack.

Re-exported as :func:`pyengine.init_weights`. Every matrix is stored (fan_in, fan_out)
and applied as ``y = x @ W`` (pyengine's layout). The schemes, for a matrix with
fan_in = n_in inputs and fan_out = n_out outputs (gain g, see :func:`calculate_gain`):

=================  =====================================================  ==========================
scheme             entries                                                Var W_ij
=================  =====================================================  ==========================
gpt2               N(0, s²), s = 0.02 (residual outputs 0.02/sqrt(2 L))   s²
xavier_normal      N(0, g² 2/(n_in + n_out))  (Glorot & Bengio 2010)      2 g²/(n_in + n_out)
xavier_uniform     U(-a, a), a = g sqrt(6/(n_in + n_out)); alias "xavier" 2 g²/(n_in + n_out)
kaiming_normal     N(0, g²/n), n = n_in ("fan_in") or n_out ("fan_out")   g²/n
                   (He et al. 2015; alias "kaiming": relu, fan_in)
kaiming_uniform    U(-a, a), a = g sqrt(3/n)                              g²/n
torch_default      U(-1/sqrt(n_in), 1/sqrt(n_in)): torch.nn.Linear's      1/(3 n_in)
                   kaiming_uniform(a=sqrt(5)), which is *not* He init
orthogonal         g Q, Q semi-orthogonal (Q Qᵀ = I or QᵀQ = I), from the  g²/max(n_in, n_out)
                   QR of a Gaussian with the signs of diag(R) fixed            (exactly, on average)
spectral           G / sigma_max(G) * g sqrt(n_out/n_in), G Gaussian:      ≈ g² n_out / (n_in
                   sigma_max = g sqrt(n_out/n_in) exactly (Yang, Simon &     (sqrt n_in + sqrt n_out)²)
                   Bernstein 2023, arXiv 2310.17813)                         (Marchenko–Pastur edge)
=================  =====================================================  ==========================

Forward prediction (:func:`forward_gain`): for x with i.i.d. entries independent of W,
``E[y_j²] = n_in Var(W) E[x_i²]``, so the mean square of ``x @ W`` is that of x times
``n_in Var(W)``; a ReLU halves a zero-mean symmetric pre-activation's mean square
(He's factor 1/2, which g = sqrt(2) undoes). The backward pass multiplies by
``n_out Var(W)`` (``mode="fan_out"`` makes it 1 for Kaiming).
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

from .config import StackConfig, _check_arrays, expected_arrays
from .stack import Stack
from .. import _validate as _v
from ..backends import one_blas_thread

__all__ = ["SCHEMES", "calculate_gain", "forward_gain", "init_matrix", "init_needs_blas", "init_variance", "init_weights"]

#: The schemes of :func:`init_matrix` and :func:`init_weights` (plus the aliases of :data:`ALIASES`).
SCHEMES = ("gpt2", "xavier_normal", "xavier_uniform", "kaiming_normal", "kaiming_uniform", "torch_default",
           "orthogonal", "spectral")
#: Older names, kept: "xavier" is Glorot uniform, "kaiming" He normal (fan_in, relu).
ALIASES = {"xavier": "xavier_uniform", "kaiming": "kaiming_normal"}
#: Nonlinearities of :func:`calculate_gain` (torch.nn.init.calculate_gain's values).
GAINS = {"linear": 1.0, "identity": 1.0, "sigmoid": 1.0, "tanh": 5.0 / 3.0, "relu": math.sqrt(2.0),
         "selu": 0.75}
#: Their squares, exact (so that kaiming relu is N(0, 2/fan_in) to the last bit).
_GAINS2 = {"linear": 1.0, "identity": 1.0, "sigmoid": 1.0, "tanh": 25.0 / 9.0, "relu": 2.0, "selu": 0.5625}
#: Above this short side the spectral scheme finds sigma_max by Lanczos (scipy svds), not a dense SVD.
SPECTRAL_SVD_MAX = 256


def calculate_gain(nonlinearity: str = "relu", param: float | None = None) -> float:
    """The recommended gain g of an activation, as torch.nn.init.calculate_gain.

    linear/identity/sigmoid 1, tanh 5/3, relu sqrt(2), leaky_relu sqrt(2/(1 + a²))
    (a = ``param``, default 0.01), selu 3/4.
    """
    if nonlinearity == "leaky_relu":
        a = 0.01 if param is None else _v.nonnegative("param", param)
        return math.sqrt(2.0 / (1.0 + a * a))
    return GAINS[_v.choice("nonlinearity", nonlinearity, (*GAINS, "leaky_relu"))]


def _scheme(scheme: Any) -> str:
    if isinstance(scheme, str) and scheme in ALIASES:
        return ALIASES[scheme]
    return _v.choice("scheme", scheme, SCHEMES + tuple(ALIASES))


def _gain2(scheme: str, gain: float | None, nonlinearity: str) -> float:
    """The squared gain g² of a scheme (checks ``gain`` and ``nonlinearity``)."""
    calculate_gain(nonlinearity)
    if gain is not None:
        return _v.nonnegative("gain", gain) ** 2
    if scheme.startswith("kaiming"):
        return _GAINS2.get(nonlinearity, calculate_gain(nonlinearity) ** 2)
    return 1.0


def init_variance(
    scheme: str, fan_in: int, fan_out: int, *, mode: str = "fan_in", nonlinearity: str = "relu",
    gain: float | None = None, gpt2_std: float = 0.02,
) -> float:
    """Var(W_ij) of a scheme by its formula (the table of the module docstring).

    ``gain`` defaults to :func:`calculate_gain` (``nonlinearity``) for the Kaiming
    schemes and to 1 otherwise; it does not apply to gpt2 and torch_default. For
    "spectral" the value is the Marchenko–Pastur approximation (sigma_max of an
    n_in x n_out standard Gaussian is about sqrt(n_in) + sqrt(n_out)).
    """
    s = _scheme(scheme)
    g2 = _gain2(s, gain, nonlinearity)
    _v.choice("mode", mode, ("fan_in", "fan_out"))
    n = fan_in if mode == "fan_in" else fan_out
    if s == "gpt2":
        return gpt2_std**2
    if s.startswith("xavier"):
        return g2 * 2.0 / (fan_in + fan_out)
    if s.startswith("kaiming"):
        return g2 / n
    if s == "torch_default":
        return 1.0 / (3.0 * fan_in)
    if s == "orthogonal":
        return g2 / max(fan_in, fan_out)
    return g2 * (fan_out / fan_in) / (math.sqrt(fan_in) + math.sqrt(fan_out)) ** 2  # spectral


def forward_gain(scheme: str, fan_in: int, fan_out: int, **kwargs: Any) -> float:
    """Predicted mean square of ``x @ W`` over that of x: ``fan_in * init_variance(...)``.

    Exact in expectation for x independent of W with i.i.d. zero-mean entries (for
    orthogonal W with fan_in <= fan_out it is exact for every x: ``g² fan_in / fan_out``).
    """
    return fan_in * init_variance(scheme, fan_in, fan_out, **kwargs)


def _sigma_max(a: np.ndarray, rng: np.random.Generator) -> float:
    import scipy.linalg

    if min(a.shape) <= SPECTRAL_SVD_MAX:
        return float(scipy.linalg.svdvals(a, check_finite=False)[0])
    from scipy.sparse.linalg import svds

    v0 = rng.standard_normal(min(a.shape))
    return float(svds(a, k=1, v0=v0, return_singular_vectors=False, tol=1e-12)[0])


def _haar_columns(a: np.ndarray) -> np.ndarray:
    """The Q of a = QR with diag(R) > 0 (a tall, float64): Haar-distributed columns for Gaussian a.

    CholeskyQR2 (Fukaya et al. 2014): R = chol(aᵀa), Q = a R⁻¹, twice; the same Q as
    Householder QR with the signs of diag(R) fixed (Mezzadri 2007) to rounding, in BLAS-3
    products only, all in scipy's BLAS (about 5x faster at 3072 x 768). Householder when
    Cholesky breaks down (condition number beyond about 1e8).
    """
    import scipy.linalg
    from scipy.linalg.blas import dsyrk

    q = a
    try:
        for _ in range(2):
            # Every product here is scipy's BLAS (the Gram by syrk on the F-ordered qᵀ, no copy):
            # mixing in a NumPy product leaves NumPy's OpenBLAS threads spinning while scipy's
            # Cholesky runs, which made it 4x slower on two cores.
            gram = dsyrk(1.0, q.T)
            with one_blas_thread():  # as fast at these sizes, and no stalls on a busy machine
                r = scipy.linalg.cholesky(gram, lower=False, check_finite=False)
            q = scipy.linalg.solve_triangular(r, q.T, trans="T", lower=False, check_finite=False).T
        if np.all(np.isfinite(q)):
            return q
    except np.linalg.LinAlgError:
        pass
    q, r = np.linalg.qr(a)
    return q * np.sign(np.diag(r))


def init_needs_blas(scheme: str) -> bool:
    """Whether ``scheme`` factors its draws (orthogonal, spectral) rather than only drawing them."""
    return _scheme(scheme) in ("orthogonal", "spectral")


def init_matrix(
    rng: np.random.Generator, scheme: str, fan_in: int, fan_out: int, *, mode: str = "fan_in",
    nonlinearity: str = "relu", gain: float | None = None, gpt2_std: float = 0.02, dtype: Any = np.float64,
) -> np.ndarray:
    """One (fan_in, fan_out) matrix of ``scheme`` drawn from ``rng`` (see the module table).

    ``dtype`` float64 (default) or float32: float32 entries are drawn in float32 directly
    (NumPy's float32 ziggurat and uniforms: about half the time and memory of drawing float64
    and rounding; a different, equally reproducible stream). Orthogonal and spectral
    matrices are factored in float64 and rounded.
    """
    s = _scheme(scheme)
    dt = _v.float_dtype("dtype", dtype)
    shape = (int(fan_in), int(fan_out))
    f32 = dt == np.float32

    def normal(std: float) -> np.ndarray:
        if f32:
            w = rng.standard_normal(shape, dtype=np.float32)
            w *= np.float32(std)
            return w
        return rng.normal(0.0, std, shape)

    if s == "gpt2":
        return normal(gpt2_std)
    if s in ("xavier_normal", "kaiming_normal"):
        return normal(math.sqrt(init_variance(s, fan_in, fan_out, mode=mode, nonlinearity=nonlinearity, gain=gain,
                                              gpt2_std=gpt2_std)))
    if s in ("xavier_uniform", "kaiming_uniform", "torch_default"):
        if s == "xavier_uniform":
            a = math.sqrt(_gain2(s, gain, nonlinearity)) * math.sqrt(6.0 / (fan_in + fan_out))
        elif s == "torch_default":
            a = 1.0 / math.sqrt(fan_in)
        else:
            a = math.sqrt(3.0 * init_variance(s, fan_in, fan_out, mode=mode, nonlinearity=nonlinearity, gain=gain))
        if f32:
            w = rng.random(shape, dtype=np.float32)
            w *= np.float32(2 * a)
            w -= np.float32(a)
            return w
        return rng.uniform(-a, a, shape)
    g = math.sqrt(_gain2(s, gain, nonlinearity))
    if s == "orthogonal":
        big, small = max(shape), min(shape)
        q = _haar_columns(rng.standard_normal((big, small), dtype=dt).astype(np.float64, copy=False))
        return (g * (q if shape[0] >= shape[1] else q.T)).astype(dt, copy=False)
    w = rng.standard_normal(shape, dtype=dt).astype(np.float64, copy=False)  # spectral
    return (w * (g * math.sqrt(fan_out / fan_in) / _sigma_max(w, rng))).astype(dt, copy=False)


def init_weights(
    config: StackConfig, scheme: str = "gpt2", seed: int = 0, dtype: Any = np.float32,
    *, gamma_jitter: float = 0.0, bias_std: float = 0.0, mode: str = "fan_in", nonlinearity: str = "relu",
    gain: float | None = None,
) -> Stack:
    """A Stack with seeded random weights.

    Parameters
    ----------
    config : StackConfig
    scheme : str
        One of :data:`SCHEMES` (formulas in the module docstring) or an alias of
        :data:`ALIASES`. gpt2: every matrix N(0, 0.02²), the residual output
        projections (attn.w_o, mlp.w_out) N(0, (0.02/sqrt(2 n_layers))²). q, k, v
        (and gate, up) count as separate matrices. Embeddings are N(0, 0.02²) in
        every scheme; a separate lm_head.weight is drawn as a (d_model, vocab_size)
        matrix of the scheme.
    seed : int
        Each array is drawn from its own stream seeded by (seed, its name), so a
        change of config that keeps an array's shape keeps its values.
    dtype : float32 or float64
        Arrays are drawn in float64 and rounded.
    gamma_jitter : float
        Stored gamma = 1 + gamma_jitter * N(0, 1) (the effective gamma is then
        multiplied by config.gamma_scale).
    bias_std : float
        Biases and LayerNorm betas are bias_std * N(0, 1) (default zero).
    mode : {"fan_in", "fan_out"}
        The fan of the Kaiming schemes (fan_out preserves the backward pass).
    nonlinearity : str
        Sets the Kaiming gain through :func:`calculate_gain` (default "relu": sqrt 2).
    gain : float, optional
        Overrides the gain of every scheme but gpt2 and torch_default.
    """
    if not isinstance(config, StackConfig):
        raise TypeError(f"config must be a StackConfig; got {type(config).__name__}")
    scheme = _scheme(scheme)
    _v.choice("mode", mode, ("fan_in", "fan_out"))
    _gain2(scheme, gain, nonlinearity)  # checks nonlinearity and gain
    seed = _v.int_seed(seed)
    gamma_jitter, bias_std = _v.nonnegative("gamma_jitter", gamma_jitter), _v.nonnegative("bias_std", bias_std)
    dt = _v.float_dtype("dtype", dtype)
    c = config
    dh, H, Hkv = c.head_dim, c.n_heads, c.n_kv_heads
    std, std_res = 0.02, 0.02 / math.sqrt(2 * c.n_layers)
    opts = {"mode": mode, "nonlinearity": nonlinearity, "gain": gain}

    def mat(rng: np.random.Generator, fan_in: int, fan_out: int, s: float = std) -> np.ndarray:
        return init_matrix(rng, scheme, fan_in, fan_out, gpt2_std=s, **opts)

    arrays: dict[str, np.ndarray] = {}
    for name, shape in expected_arrays(c).items():
        rng = np.random.default_rng([int(seed), zlib.crc32(name.encode())])
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "gamma":
            a = 1.0 + gamma_jitter * rng.standard_normal(shape)
        elif leaf == "beta" or leaf.startswith("b_"):
            a = bias_std * rng.standard_normal(shape)
        elif name.startswith("embed."):
            a = rng.normal(0.0, std, shape)
        elif name == "lm_head.weight":  # a (d -> vocab) projection, stored (vocab, d)
            a = mat(rng, c.d_model, c.vocab_size).T
        elif leaf == "w_qkv":
            a = np.concatenate([mat(rng, c.d_model, n * dh) for n in (H, Hkv, Hkv)], axis=1)
        elif leaf == "w_in" and c.activation == "silu_gated":
            a = np.concatenate([mat(rng, c.d_model, c.d_mlp) for _ in range(2)], axis=1)
        else:  # w_o, w_in, w_out
            a = mat(rng, shape[0], shape[1], std_res if leaf in ("w_o", "w_out") else std)
        arrays[name] = a.astype(dt)
    new = Stack.__new__(Stack)
    new._init(c, _check_arrays(c, arrays, "init_weights"))
    return new
