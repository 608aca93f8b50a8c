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

__all__ = ["SCHEMES", "calculate_gain", "forward_gain", "init_matrices", "init_matrix", "init_needs_blas", "init_variance",
           "init_weights"]

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
    """The Q of a = QR with diag(R) > 0 (a tall, float64 or float32): Haar-distributed columns for Gaussian a.

    CholeskyQR2 (Fukaya et al. 2014): R = chol(aᵀa), Q = a R⁻¹, twice; the same Q as
    Householder QR with the signs of diag(R) fixed (Mezzadri 2007) to rounding, in BLAS-3
    products only, all in scipy's BLAS (about 5x faster at 3072 x 768), in a's precision
    (float32: orthogonal to about 1e-6, half the time of float64). Householder when
    Cholesky breaks down (condition number beyond about 1e8, 1e4 in float32). ``a`` is not
    modified.
    """
    if min(a.shape) <= _ONE_THREAD_MAX:  # block-sized: threaded BLAS only waits on its own barriers
        with one_blas_thread():
            return _cholesky_qr2(a)
    return _cholesky_qr2(a)


#: Up to this short side :func:`_haar_columns` runs single-threaded BLAS (a 1024 x 256 float64
#: factorization, as init_weights draws at d_model 256: 0.42 s threaded, 0.13 s single-threaded,
#: medians on a busy two-core machine).
_ONE_THREAD_MAX = 512


def _cholesky_qr2(a: np.ndarray) -> np.ndarray:
    import scipy.linalg
    from scipy.linalg.blas import get_blas_funcs

    q = a
    syrk, gemm = get_blas_funcs(("syrk", "gemm"), (a,))
    try:
        for step in range(2):
            # Every product here is scipy's BLAS (the Gram by syrk on the F-ordered qᵀ, no copy):
            # mixing in a NumPy product leaves NumPy's OpenBLAS threads spinning while scipy's
            # Cholesky runs, which made it 4x slower on two cores.
            gram = syrk(1.0, q.T)
            with one_blas_thread():  # as fast at these sizes, and no stalls on a busy machine
                r = scipy.linalg.cholesky(gram, lower=False, check_finite=False)
            q = scipy.linalg.solve_triangular(r, q.T, trans="T", lower=False, check_finite=False).T
            if q.dtype == np.float32 and _orthogonality_probe(q, gemm) <= _F32_ONE_PASS:
                return q  # (after pass 1: well conditioned, tall Gaussians; already orthogonal to rounding)
        if q.dtype != np.float32 and np.all(np.isfinite(q)):
            return q  # float32 here: cond(a) beyond about 1e3.5, two passes not orthogonal to rounding
    except np.linalg.LinAlgError:
        pass
    q, r = np.linalg.qr(a.astype(np.float64) if a.dtype == np.float32 else a)
    return (q * np.sign(np.diag(r))).astype(a.dtype, copy=False)


#: float32 schemes by the numbers they consume from their generator: a "normal" scheme's matrix
#: is its standard normal draws rescaled (orthogonal: factored), a "uniform" one's its U[0, 1)
#: draws shifted and rescaled, so one draw serves every scheme of a family (:func:`init_matrices`).
_FAMILY32 = {"gpt2": "normal", "xavier_normal": "normal", "kaiming_normal": "normal", "orthogonal": "normal",
             "xavier_uniform": "uniform", "kaiming_uniform": "uniform", "torch_default": "uniform"}


def _draw_shape(s: str, fan_in: int, fan_out: int) -> tuple[int, int]:
    """The shape of the raw draws of ``s`` (orthogonal: the tall Gaussian it factors)."""
    if s == "orthogonal":
        return max(fan_in, fan_out), min(fan_in, fan_out)
    return int(fan_in), int(fan_out)


def _draw32(rng: np.random.Generator, family: str, shape: tuple[int, int]) -> np.ndarray:
    if family == "normal":
        return rng.standard_normal(shape, dtype=np.float32)
    return rng.random(shape, dtype=np.float32)


def _from_draw32(z: np.ndarray, s: str, fan_in: int, fan_out: int, *, inplace: bool, mode: str = "fan_in",
                 nonlinearity: str = "relu", gain: float | None = None, gpt2_std: float = 0.02) -> np.ndarray:
    """The float32 matrix of scheme ``s`` (of :data:`_FAMILY32`) from its raw draws ``z``
    (:func:`_draw32` of :func:`_draw_shape`); ``z`` is overwritten only if ``inplace``."""
    if s == "orthogonal":
        q = _haar_columns(z)
        g = np.float32(math.sqrt(_gain2(s, gain, nonlinearity)))
        return g * (q if fan_in >= fan_out else q.T)
    w = z if inplace else z.copy()
    if _FAMILY32[s] == "normal":
        std = gpt2_std if s == "gpt2" else math.sqrt(init_variance(s, fan_in, fan_out, mode=mode,
                                                                     nonlinearity=nonlinearity, gain=gain))
        w *= np.float32(std)
        return w
    a = _uniform_bound(s, fan_in, fan_out, mode, nonlinearity, gain)
    w *= np.float32(2 * a)
    w -= np.float32(a)
    return w


def _uniform_bound(s: str, fan_in: int, fan_out: int, mode: str, nonlinearity: str, gain: float | None) -> float:
    if s == "xavier_uniform":
        return math.sqrt(_gain2(s, gain, nonlinearity)) * math.sqrt(6.0 / (fan_in + fan_out))
    if s == "torch_default":
        return 1.0 / math.sqrt(fan_in)
    return math.sqrt(3.0 * init_variance(s, fan_in, fan_out, mode=mode, nonlinearity=nonlinearity, gain=gain))


def init_matrices(
    seed: Any, schemes: Any, shapes: Any, *, dtype: Any = np.float64, mode: str = "fan_in",
    nonlinearity: str = "relu", gain: float | None = None,
) -> dict[str, list[np.ndarray]]:
    """Several schemes' matrices from one seed: scheme -> ``[init_matrix(rng, scheme, fan_in, fan_out,
    gpt2_std=std) for fan_in, fan_out, std in shapes]``, ``rng = np.random.default_rng(seed)`` per scheme.

    Array for array the same as those calls, but in float32 the schemes that consume the
    same numbers (:data:`_FAMILY32`: gpt2, xavier_normal, kaiming_normal and orthogonal
    their standard normals, the uniform schemes their U[0, 1)) draw them once per family.
    """
    dt = _v.float_dtype("dtype", dtype)
    asked = list(dict.fromkeys(schemes))
    canon = {a: _scheme(a) for a in asked}
    names = list(dict.fromkeys(canon.values()))
    shapes = [(int(fi), int(fo), float(std)) for fi, fo, std in shapes]
    opts = {"mode": mode, "nonlinearity": nonlinearity, "gain": gain}
    out: dict[str, list[np.ndarray]] = {s: [] for s in names}
    shared = [s for s in names if dt == np.float32 and s in _FAMILY32]
    for s in names:
        if s not in shared:
            rng = np.random.default_rng(seed)
            out[s] = [init_matrix(rng, s, fi, fo, gpt2_std=std, dtype=dt, **opts) for fi, fo, std in shapes]
    for family in ("normal", "uniform"):
        group = [s for s in shared if _FAMILY32[s] == family]
        if not group:
            continue
        rng = np.random.default_rng(seed)
        for fi, fo, std in shapes:
            z = _draw32(rng, family, (fi, fo))  # orthogonal's tall draws are the same numbers, reshaped
            for i, s in enumerate(group):
                out[s].append(_from_draw32(z.reshape(_draw_shape(s, fi, fo)), s, fi, fo, inplace=i == len(group) - 1,
                                           gpt2_std=std, **opts))
    return {a: out[c] for a, c in canon.items()}  # keyed as asked (an alias and its scheme share the arrays)


#: CholeskyQR's orthogonality error grows as cond(a)² eps: in float32 the second pass is skipped
#: when the probe of :func:`_orthogonality_probe` is at rounding level (tall Gaussians, cond ~ 3:
#: about 5e-7, the same as after two passes; square ones, cond ~ 10³: 1e-4 to 1e-3).
_F32_ONE_PASS = 2e-6


def _orthogonality_probe(q: np.ndarray, gemm: Any) -> float:
    """||(QᵀQ - I) V||_F / ||V||_F for 4 fixed Gaussian probes V: an O(n k) estimate of the RMS
    departure of QᵀQ from I (scipy's BLAS, as the factorization)."""
    v = np.random.default_rng(0x51AB).standard_normal((q.shape[1], 4)).astype(q.dtype)
    e = gemm(1.0, q, gemm(1.0, q, v), trans_a=1) - v
    return float(np.linalg.norm(e) / np.linalg.norm(v))


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
    and rounding; a different, equally reproducible stream). Float32 orthogonal matrices
    are factored in float32 (CholeskyQR2: QᵀQ = I to about 1e-6); spectral ones in
    float64 and rounded.
    """
    s = _scheme(scheme)
    dt = _v.float_dtype("dtype", dtype)
    shape = (int(fan_in), int(fan_out))
    opts = {"mode": mode, "nonlinearity": nonlinearity, "gain": gain, "gpt2_std": gpt2_std}
    if dt == np.float32 and s in _FAMILY32:
        init_variance(s, fan_in, fan_out, **opts)  # checks mode, nonlinearity, gain
        z = _draw32(rng, _FAMILY32[s], _draw_shape(s, *shape))
        return _from_draw32(z, s, *shape, inplace=True, **opts)
    if s not in ("orthogonal", "spectral"):
        return _draw64(rng, s, fan_in, fan_out, shape, **opts)
    g = math.sqrt(_gain2(s, gain, nonlinearity))
    if s == "orthogonal":
        q = _haar_columns(rng.standard_normal(_draw_shape(s, *shape)))
        return g * (q if shape[0] >= shape[1] else q.T)
    w = rng.standard_normal(shape, dtype=dt).astype(np.float64, copy=False)  # spectral
    return (w * (g * math.sqrt(fan_out / fan_in) / _sigma_max(w, rng))).astype(dt, copy=False)


#: float64 entries drawn at a time by :func:`init_weights` (4 MiB): an elementwise scheme's
#: draws are cast into the stored array chunk by chunk, never held whole in float64.
_DRAW_CHUNK = 1 << 19


def _draw64(rng: np.random.Generator, s: str, fan_in: int, fan_out: int, shape: tuple[int, ...], *,
            mode: str = "fan_in", nonlinearity: str = "relu", gain: float | None = None, gpt2_std: float = 0.02
            ) -> np.ndarray:
    """``shape`` float64 entries of the elementwise scheme ``s`` of a (fan_in, fan_out) matrix."""
    if s == "gpt2":
        return rng.normal(0.0, gpt2_std, shape)
    opts = {"mode": mode, "nonlinearity": nonlinearity, "gain": gain}
    if s in ("xavier_normal", "kaiming_normal"):
        return rng.normal(0.0, math.sqrt(init_variance(s, fan_in, fan_out, **opts)), shape)
    a = _uniform_bound(s, fan_in, fan_out, mode, nonlinearity, gain)
    return rng.uniform(-a, a, shape)


def _fill(out: np.ndarray, rng: np.random.Generator, s: str, **opts: Any) -> None:
    """``out[...] = init_matrix(rng, s, *out.shape, **opts)`` (float64, rounded to out's dtype).
    Elementwise schemes draw row chunks: the generator consumes its stream in order, so the
    values are those of one draw of the whole matrix, without its float64 transient."""
    fan_in, fan_out = out.shape
    if s in ("orthogonal", "spectral"):
        out[...] = init_matrix(rng, s, fan_in, fan_out, **opts)
        return
    rows = max(1, _DRAW_CHUNK // max(fan_out, 1))
    for r in range(0, fan_in, rows):
        out[r:r + rows] = _draw64(rng, s, fan_in, fan_out, (min(rows, fan_in - r), fan_out), **opts)


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

    arrays: dict[str, np.ndarray] = {}
    for name, shape in expected_arrays(c).items():
        rng = np.random.default_rng([int(seed), zlib.crc32(name.encode())])
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("gamma", "q_norm", "k_norm"):
            arrays[name] = (1.0 + gamma_jitter * rng.standard_normal(shape)).astype(dt)
            continue
        if leaf == "beta" or leaf.startswith("b_"):
            arrays[name] = (bias_std * rng.standard_normal(shape)).astype(dt)
            continue
        a = arrays[name] = np.empty(shape, dt)
        if name.startswith("embed."):
            _fill(a, rng, "gpt2", gpt2_std=std)
        elif name == "lm_head.weight":  # a (d -> vocab) projection, stored (vocab, d)
            _fill(a.T, rng, scheme, gpt2_std=std, **opts)
        else:  # w_qkv (q, k, v drawn in turn), w_in (gated: gate, then up), w_o, w_out
            parts = ((H * dh, Hkv * dh, Hkv * dh) if leaf == "w_qkv" else (c.d_mlp, c.d_mlp)
                     if leaf == "w_in" and c.activation == "silu_gated" else (shape[1],))
            sd = std_res if leaf in ("w_o", "w_out") else std
            for j0, j1 in zip(np.cumsum((0,) + parts[:-1]), np.cumsum(parts)):
                _fill(a[:, j0:j1], rng, scheme, gpt2_std=sd, **opts)
    new = Stack.__new__(Stack)
    new._init(c, _check_arrays(c, arrays, "init_weights", copy=False))
    return new
