"""One transformer block, exact forward and Jacobian-vector product, in NumPy + BLAS.

This is the engine behind :mod:`pyengine.models.stack`; it assumes validated, C-contiguous
float32/float64 input and computes in that dtype. Residual streams here always
carry a batch axis: ``(B, T, d)``. Every weight product sees ``(B*T, d)`` rows, so
B sequences (forward) or K tangents (JVP) make one large GEMM. Normalization,
softmax and activations run in the raw kernels of the "auto" backend, called directly:
the Stack checked the inputs once, and the weights when it was made.

A JVP linearizes at one sequence: its cached base activations have a leading axis
of 1 and broadcast against the K tangents' leading axis. Attention is in
:mod:`pyengine.models._attention`; norms, MLP and the block assembly are here.

Weight names inside a block (the public layer strips the ``blocks.<k>.`` prefix):
``norm1.gamma``, ``norm1.beta`` (LayerNorm only), ``norm2.*`` (sequential layout
only), ``attn.w_qkv`` (d, (H + 2 Hkv) dh) with columns [q heads | k heads | v heads],
``attn.b_qkv``, ``attn.w_o`` (H dh, d), ``attn.b_o``, ``mlp.w_in`` (d, n_in) with
n_in = d_mlp, or 2 d_mlp as [gate | up] for ``silu_gated``, ``mlp.b_in``,
``mlp.w_out`` (d_mlp, d), ``mlp.b_out``. Biases exist when ``config.bias``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from .. import _validate as _v
from ..kernels.activations import kernel
from ..kernels.layernorm import kernel as norm_kernel
from ._attention import attn, attn_jvp, check
from ._context import Cache, Context, Weights
from ._fast import DISCARD
from ._linear import FUSED_ACTIVATIONS, dense, dense_act, dense_mul, workspace


def site(ctx: Context, name: str, x: np.ndarray) -> np.ndarray:
    """``x`` at the named site of a block: the context's hook sees it (and may replace it)."""
    return x if ctx.hook is None else ctx.hook(name, x)


def make_context(cfg: Any, T: int, dtype: np.dtype, start: int = 0, block: int = 0) -> Context:
    """The context of block ``block`` (its sliding window) on T rows, of which rows start.. are computed."""
    if start and not cfg.causal:
        raise ValueError("only a causal stack can skip the rows before a span (start > 0)")
    rope_q = rope_k = None
    if cfg.positions == "rotary":
        cos, sin = rotary_tables(cfg, T, dtype)
        cos, sin = cos[start:], sin[start:]
        scale = cfg.score_scale
        rope_q, rope_k = (cos * scale, sin * scale), (cos, sin)
    return Context(cfg, rope_q, rope_k, start, window=cfg.window(block))


def for_block(ctx: Context, k: int) -> Context:
    """``ctx`` (of any block) for block k: its sliding window."""
    return ctx._replace(window=ctx.cfg.window(k))


def _take_rows(cache: Cache, idx: Any) -> Cache:
    """The base cache restricted to the query rows ``idx`` (keys and values stay whole)."""
    out: Cache = {}
    for name, a in cache.items():
        if name in ("attn.k", "attn.v"):
            out[name] = a
        elif name in ("attn.q", "attn.p", "attn.capd"):  # (1, Hkv, g, T, .); the softmax JVP kernel wants P
            out[name] = np.ascontiguousarray(a[..., idx, :]) if name == "attn.p" else a[..., idx, :]  # contiguous
        elif name == "mlp.u":  # (T, n_in)
            out[name] = a[idx]
        elif name in ("mlp.coef", "attn.qkn"):  # tuples of (1, T, ...)
            out[name] = tuple(c[:, idx] for c in a)
        elif name.startswith("norm"):  # (1, T, d)
            out[name] = a[:, idx]
    return out


def suffix(ctx: Context, cache: Cache, start: int) -> tuple[Context, Cache]:
    """Context and base cache for a JVP whose tangent is zero on rows < start (causal).

    The tangents then carry only rows start..T-1, and so does the result (the
    earlier rows of the output tangent are exactly zero).
    """
    T = cache["attn.k"].shape[-2]
    return (make_context(ctx.cfg, T, cache["attn.k"].dtype, start)._replace(window=ctx.window),
            _take_rows(cache, slice(start, None)))


def diagonal(ctx: Context, cache: Cache, rows: Any) -> tuple[Context, Cache]:
    """Context and base cache for the per-token diagonal blocks d out_t / d h_t, t in ``rows``.

    A JVP with them maps tangents (K, R, d), row r perturbing only token rows[r],
    to the output at token rows[r]: the diagonal block of the block Jacobian. With
    a causal mask the Jacobian over all tokens is block lower-triangular, so its
    eigenvalues are those of these blocks.
    """
    rows = np.asarray(rows, dtype=np.intp)
    T = cache["attn.k"].shape[-2]
    c = make_context(ctx.cfg, T, cache["attn.k"].dtype)._replace(window=ctx.window)
    if c.rope_q is not None:
        c = c._replace(rope_q=tuple(a[rows] for a in c.rope_q), rope_k=tuple(a[rows] for a in c.rope_k))
    return c._replace(rows=rows), _take_rows(cache, rows)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def inv_freq(cfg: Any, T: int = 0) -> tuple[float, ...]:
    """Rotary frequency of each of the head_dim/2 half-split pairs (i, i + dh/2), float64.

    base**(-2i/r) for i < r/2 with r = ``rotary_dim`` (0: head_dim); 0 (no rotation) for
    the pairs beyond (partial rotary: the loader orders the head's features so that the
    rotated ones are pairs 0..r/2-1). ``rope_scaling="llama3"`` rescales them as HF's
    ``_compute_llama3_parameters`` does; "longrope" as ``_compute_longrope_parameters``,
    with the long factors when the sequence length ``T`` exceeds ``rope_original_max_len``
    (as transformers' Phi-3 picks them from the positions of each call).
    """
    dh = cfg.head_dim
    r = cfg.rotary_dim or dh
    f = np.zeros(dh // 2)
    f[: r // 2] = cfg.rope_base ** (-np.arange(0, r, 2, dtype=np.float64) / r)
    if cfg.rope_scaling == "llama3":
        fac, lo, hi, old = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, \
            cfg.rope_original_max_len
        g = f[: r // 2]
        wavelen = 2 * math.pi / g
        scaled = np.where(wavelen > old / lo, g / fac, g)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / fac + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        f[: r // 2] = np.where(medium, smoothed, scaled)
    elif cfg.rope_scaling == "longrope":
        ext = cfg.rope_long_factor if T > cfg.rope_original_max_len else cfg.rope_short_factor
        f[: r // 2] = 1.0 / (np.asarray(ext) * cfg.rope_base ** (np.arange(0, r, 2, dtype=np.float64) / r))
    return tuple(float(x) for x in f)


@functools.lru_cache(maxsize=64)
def rope_tables(T: int, freqs: tuple[float, ...], dtype: np.dtype, scale: float = 1.0
                ) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of the rotary angles pos * freqs[i] (see :func:`inv_freq`), each (T, head_dim/2),
    times ``scale`` on the rotated pairs (freqs[i] != 0; the others keep cos 1 and sin 0)."""
    ang = np.arange(T, dtype=np.float64)[:, None] * np.asarray(freqs, dtype=np.float64)[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    if scale != 1.0:
        rot = np.asarray(freqs) != 0
        cos[:, rot] *= scale
        sin[:, rot] *= scale
    return _readonly(cos.astype(dtype)), _readonly(sin.astype(dtype))


def rotary_tables(cfg: Any, T: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The (cos, sin) tables of a T-token sequence under ``cfg``'s rotary settings, each (T, head_dim/2)."""
    return rope_tables(T, inv_freq(cfg, T), np.dtype(dtype), cfg.rope_attention_factor)


@functools.lru_cache(maxsize=64)
def sinusoidal_positions(T: int, d: int, dtype: np.dtype) -> np.ndarray:
    """(T, d) Vaswani et al. table: sin on even features, cos on odd, wavelength 10000**(2i/d)."""
    ang = np.arange(T, dtype=np.float64)[:, None] / 10000.0 ** (np.arange(0, d, 2) / d)[None, :]
    pe = np.empty((T, d), np.float64)
    pe[:, 0::2] = np.sin(ang)
    pe[:, 1::2] = np.cos(ang[:, : d // 2])
    return _readonly(pe.astype(dtype))


# --------------------------------------------------------------------------- norms
# Called through these two module-level names (tests replace ``norm`` to freeze scales). A
# kernel's bad-row count becomes the message of pyengine.layer_norm & co.

_KERNEL = {"layernorm": "layer_norm", "rmsnorm": "rms_norm"}
#: JVP tangents of at least this many rows go to the kernel one by one, against the base
#: rows as they are; smaller ones (many of them) at once, against a broadcast copy.
_ROWS_PER_CALL = 8


def norm(kind: str, x: np.ndarray, gamma: np.ndarray, beta: np.ndarray | None, eps: float) -> np.ndarray:
    """The norm of x (..., d) in x's dtype (beta None: zeros; LayerNorm only)."""
    name = _KERNEL[kind]
    x2 = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
    out = np.empty(x.shape, x.dtype)
    args = (x2, gamma) if kind == "rmsnorm" else (x2, gamma, np.zeros_like(gamma) if beta is None else beta)
    _v.raise_bad_rows(norm_kernel(name)(*args, eps, out.reshape(x2.shape)), x2, x.shape, eps, name)
    return out


def norm_jvp(kind: str, x: np.ndarray, v: np.ndarray, gamma: np.ndarray, eps: float, mode: str,
             product: str = "_jvp") -> np.ndarray:
    """The norm's JVP at x, (1, T, d) or v's shape, for the tangents v (K, T, d), in v's dtype.

    ``product="_vjp"``: the VJP (its transpose) for the cotangents v instead.
    """
    name = _KERNEL[kind]
    fn, frozen, d = norm_kernel(name + product), mode == "frozen_scale", v.shape[-1]
    v2 = np.ascontiguousarray(v).reshape(-1, d)
    out = np.empty(v.shape, v.dtype)
    tile = lambda: np.ascontiguousarray(np.broadcast_to(x, v.shape)).reshape(-1, d)  # noqa: E731
    if x.shape == v.shape or v.shape[-2] < _ROWS_PER_CALL:  # one base row per tangent row
        nbad = fn(tile(), v2, gamma, eps, frozen, out.reshape(-1, d))
    else:  # one call per tangent, on the (T, d) base rows: no copies of the base
        x2 = np.ascontiguousarray(x).reshape(-1, d)
        v3, o3 = v2.reshape((-1,) + x2.shape), out.reshape((-1,) + x2.shape)
        nbad = sum(fn(x2, v3[j], gamma, eps, frozen, o3[j]) for j in range(v3.shape[0]))
    if nbad:
        _v.raise_bad_rows(nbad, tile(), v.shape, eps, name, "v", v2)
    return out


def _norm(w: Weights, cfg: Any, name: str, x: np.ndarray, cache: Cache) -> np.ndarray:
    cache[name] = x
    return norm(cfg.norm, x, w[name + ".gamma"], w.get(name + ".beta"), cfg.eps)


def _norm_jvp(w: Weights, cfg: Any, name: str, dx: np.ndarray, cache: Cache, mode: str) -> np.ndarray:
    return norm_jvp(cfg.norm, cache[name], dx, w[name + ".gamma"], cfg.eps, mode)


# --------------------------------------------------------------------------- MLP


def _act(name: str, u: np.ndarray, n: int) -> np.ndarray:
    """Activation of the (N, n_in) pre-activations u (C-contiguous): (N, n_in), or (N, n) if gated."""
    if name == "gelu_tanh_gated":  # GeGLU: gelu_tanh(gate) * up
        y = np.empty((u.shape[0], n), u.dtype)
        check(kernel("gelu_tanh")(np.ascontiguousarray(u[:, :n]), y), "MLP pre-activations")
        y *= u[:, n:]
        return y
    y = np.empty((u.shape[0], n if name == "silu_gated" else u.shape[1]), u.dtype)
    check(kernel(name)(u, y), "MLP pre-activations")
    return y


def _act_coef(name: str, u: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """Coefficients of the activation's JVP at u: dz = c * du, or A dgate + B dup if gated."""
    if name == "gelu_tanh_gated":  # d(g(x) y) = g'(x) y dx + g(x) dy
        gate = np.ascontiguousarray(u[:, :n])
        a, b = np.empty_like(gate), np.empty_like(gate)
        check(kernel("gelu_tanh_grad")(gate, a), "MLP pre-activations")
        a *= u[:, n:]
        check(kernel("gelu_tanh")(gate, b), "MLP pre-activations")
        return a, b
    if name == "silu_gated":
        a, b = np.empty((u.shape[0], n), u.dtype), np.empty((u.shape[0], n), u.dtype)
        check(kernel("silu_gated_grad")(u, a, b), "MLP pre-activations")
        return a, b
    c = np.empty_like(u)
    check(kernel(name + "_grad")(u, c), "MLP pre-activations")
    return (c,)


def mlp(w: Weights, ctx: Context, a: np.ndarray, cache: Cache, r: np.ndarray | None = None) -> np.ndarray:
    """Two-layer MLP of a (B, T, d) -> (B, T, d), plus ``r`` (the residual) if given (one fused add)."""
    cfg = ctx.cfg
    B, T, d = a.shape
    a2, bias = a.reshape(B * T, d), cfg.bias
    shape = (B * T, w["mlp.w_in"].shape[1])
    pre = ctx.hook is not None and getattr(ctx.hook, "wants", lambda n: False)("mlp.pre")
    if pre:  # site mlp.pre (B, T, n_in): the pre-activations, read or changed
        u = site(ctx, "mlp.pre", dense(a2, w["mlp.w_in"], w["mlp.b_in"] if bias else None).reshape(B, T, -1))
        u = np.ascontiguousarray(u).reshape(B * T, -1)
        z = _act(cfg.activation, u, cfg.d_mlp)
    elif cfg.activation in FUSED_ACTIVATIONS:  # bias and activation fused (models/_linear.py)
        u = None if cache.get(DISCARD) else np.empty(shape, a.dtype)  # only a JVP reads u
        z = np.empty(shape, a.dtype) if ctx.hook is not None else workspace("mlp.z", shape, a.dtype)
        check(dense_act(a2, w["mlp.w_in"], w["mlp.b_in"] if bias else None, cfg.activation, u, z),
              "MLP pre-activations")
    else:
        u = dense(a2, w["mlp.w_in"], w["mlp.b_in"] if bias else None)
        z = _act(cfg.activation, u, cfg.d_mlp)
    if ctx.hook is not None:
        z = site(ctx, "mlp.hidden", z.reshape(B, T, -1)).reshape(B * T, -1)
    y = dense(np.ascontiguousarray(z), w["mlp.w_out"], w["mlp.b_out"] if bias else None,
              None if r is None else r.reshape(B * T, d))
    cache["mlp.u"], cache["mlp.in"] = u, a
    return y.reshape(B, T, d)


def mlp_coef(ctx: Context, cache: Cache, T: int) -> tuple[np.ndarray, ...]:
    """The activation's JVP coefficients at the base, each (B, T, n); computed once per cache."""
    if "mlp.coef" not in cache:
        cfg = ctx.cfg
        cache["mlp.coef"] = tuple(c.reshape(-1, T, c.shape[-1])
                                  for c in _act_coef(cfg.activation, cache["mlp.u"], cfg.d_mlp))
    return cache["mlp.coef"]


def mlp_jvp(w: Weights, ctx: Context, da: np.ndarray, cache: Cache, r: np.ndarray | None = None) -> np.ndarray:
    """Tangent of :func:`mlp`: (K, T, d) -> (K, T, d), plus ``r`` if given."""
    K, T, d = da.shape
    n = ctx.cfg.d_mlp
    coef = mlp_coef(ctx, cache, T)
    da2 = da.reshape(K * T, d)
    if len(coef) == 1:  # du = (da W) * f'(u), fused; a workspace
        shape = (K * T, coef[0].shape[-1])  # coef (1 or K, T, n): row i of du uses row i % len
        dz = dense_mul(da2, w["mlp.w_in"], coef[0].reshape(-1, shape[1]), workspace("mlp.dz", shape, da.dtype))
    else:
        du = dense(da2, w["mlp.w_in"], None).reshape(K, T, -1)
        dz = du[..., :n] * coef[0]
        dz += du[..., n:] * coef[1]
        dz = dz.reshape(K * T, n)
    return dense(dz, w["mlp.w_out"], None, None if r is None else r.reshape(K * T, d)).reshape(K, T, d)


# --------------------------------------------------------------------------- blocks

_SUB = {"attn": (attn, attn_jvp), "mlp": (mlp, mlp_jvp)}


def _sublayer(w: Weights, ctx: Context, h: np.ndarray, sub: str, nname: str, cache: Cache) -> np.ndarray:
    cfg, f = ctx.cfg, _SUB[sub][0]
    if cfg.placement == "peri":  # h + N_out(F(N(h))) (Gemma 2)
        a = site(ctx, nname + ".output", _norm(w, cfg, nname, site(ctx, nname + ".input", h), cache))
        y = site(ctx, sub + ".out", f(w, ctx, a, cache))
        o = nname + "_out"
        y = site(ctx, o + ".output", _norm(w, cfg, o, site(ctx, o + ".input", y), cache))
        if cfg.residual:
            y += h
        return y
    if cfg.placement == "pre":  # h + F(N(h))
        a = site(ctx, nname + ".output", _norm(w, cfg, nname, site(ctx, nname + ".input", h), cache))
        if cfg.residual and ctx.hook is None:  # the residual added in the last product's epilogue
            return f(w, ctx, a, cache, h)
        y = site(ctx, sub + ".out", f(w, ctx, a, cache))
        if cfg.residual:
            y += h
        return y
    y = site(ctx, sub + ".out", f(w, ctx, h, cache))  # N(h + F(h))
    if cfg.residual:
        y += h
    return site(ctx, nname + ".output", _norm(w, cfg, nname, site(ctx, nname + ".input", y), cache))


def _sublayer_jvp(
    w: Weights, ctx: Context, dh: np.ndarray, sub: str, nname: str, cache: Cache, mode: str
) -> np.ndarray:
    cfg, f = ctx.cfg, _SUB[sub][1]
    if cfg.placement == "peri":
        dy = _norm_jvp(w, cfg, nname + "_out", f(w, ctx, _norm_jvp(w, cfg, nname, dh, cache, mode), cache), cache,
                       mode)
        if cfg.residual:
            dy += dh
        return dy
    if cfg.placement == "pre":
        return f(w, ctx, _norm_jvp(w, cfg, nname, dh, cache, mode), cache, dh if cfg.residual else None)
    dy = f(w, ctx, dh, cache)
    if cfg.residual:
        dy += dh
    return _norm_jvp(w, cfg, nname, dy, cache, mode)


def block_forward(w: Weights, ctx: Context, h: np.ndarray, cache: Cache) -> np.ndarray:
    """One block on h (B, T, d) -> (B, T, d); fills ``cache`` with what the JVP needs."""
    cfg = ctx.cfg
    if cfg.layout == "sequential":
        h1 = site(ctx, "resid_mid", _sublayer(w, ctx, h, "attn", "norm1", cache))
        return _sublayer(w, ctx, h1, "mlp", "norm2", cache)
    if cfg.layout == "parallel2":  # GPT-NeoX: h + Attn(N1(h)) + MLP(N2(h))
        a1 = site(ctx, "norm1.output", _norm(w, cfg, "norm1", site(ctx, "norm1.input", h), cache))
        y = site(ctx, "attn.out", attn(w, ctx, a1, cache))
        a2 = site(ctx, "norm2.output", _norm(w, cfg, "norm2", site(ctx, "norm2.input", h), cache))
        y += site(ctx, "mlp.out", mlp(w, ctx, a2, cache))
        if cfg.residual:
            y += h
        return y
    # parallel (GPT-J): both branches read the same input; one norm
    if cfg.placement == "pre":
        a = site(ctx, "norm1.output", _norm(w, cfg, "norm1", site(ctx, "norm1.input", h), cache))
    else:
        a = h
    y = site(ctx, "attn.out", attn(w, ctx, a, cache))
    y += site(ctx, "mlp.out", mlp(w, ctx, a, cache))
    if cfg.residual:
        y += h
    if cfg.placement == "pre":
        return y
    return site(ctx, "norm1.output", _norm(w, cfg, "norm1", site(ctx, "norm1.input", y), cache))


def block_jvp(w: Weights, ctx: Context, dh: np.ndarray, cache: Cache, mode: str) -> np.ndarray:
    """Directional derivative (K, T, d) -> (K, T, d) at the base point ``cache`` holds (B = 1)."""
    cfg = ctx.cfg
    if cfg.layout == "sequential":
        dh1 = _sublayer_jvp(w, ctx, dh, "attn", "norm1", cache, mode)
        return _sublayer_jvp(w, ctx, dh1, "mlp", "norm2", cache, mode)
    if cfg.layout == "parallel2":
        dy = attn_jvp(w, ctx, _norm_jvp(w, cfg, "norm1", dh, cache, mode), cache)
        dy += mlp_jvp(w, ctx, _norm_jvp(w, cfg, "norm2", dh, cache, mode), cache)
        if cfg.residual:
            dy += dh
        return dy
    da = _norm_jvp(w, cfg, "norm1", dh, cache, mode) if cfg.placement == "pre" else dh
    dy = attn_jvp(w, ctx, da, cache)
    dy += mlp_jvp(w, ctx, da, cache)
    if cfg.residual:
        dy += dh
    return dy if cfg.placement == "pre" else _norm_jvp(w, cfg, "norm1", dy, cache, mode)
