"""Seeded weight initialization of a :class:`~pyengine.models.stack.Stack` (:func:`init_weights`).

Re-exported as :func:`pyengine.init_weights`.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

from .config import StackConfig, _check_arrays, expected_arrays
from .stack import Stack
from .. import _validate as _v

__all__ = ["init_weights"]


def _init_matrix(rng: np.random.Generator, scheme: str, fan_in: int, fan_out: int, gpt2_std: float) -> np.ndarray:
    if scheme == "gpt2":
        return rng.normal(0.0, gpt2_std, (fan_in, fan_out))
    if scheme == "xavier":  # Glorot uniform
        a = math.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-a, a, (fan_in, fan_out))
    return rng.normal(0.0, math.sqrt(2.0 / fan_in), (fan_in, fan_out))  # Kaiming (He) normal


def init_weights(
    config: StackConfig, scheme: str = "gpt2", seed: int = 0, dtype: Any = np.float32,
    *, gamma_jitter: float = 0.0, bias_std: float = 0.0,
) -> Stack:
    """A Stack with seeded random weights.

    Parameters
    ----------
    config : StackConfig
    scheme : {"gpt2", "xavier", "kaiming"}
        gpt2: every matrix N(0, 0.02), the residual output projections (attn.w_o,
        mlp.w_out) N(0, 0.02/sqrt(2 n_layers)); xavier: Glorot uniform; kaiming: He
        normal N(0, 2/fan_in). q, k, v (and gate, up) count as separate matrices.
        Embeddings are N(0, 0.02) in every scheme; a separate lm_head.weight is
        drawn as a (d_model, vocab_size) matrix of the scheme.
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
    """
    if not isinstance(config, StackConfig):
        raise TypeError(f"config must be a StackConfig; got {type(config).__name__}")
    _v.choice("scheme", scheme, ("gpt2", "xavier", "kaiming"))
    seed = _v.int_seed(seed)
    gamma_jitter, bias_std = _v.nonnegative("gamma_jitter", gamma_jitter), _v.nonnegative("bias_std", bias_std)
    dt = _v.float_dtype("dtype", dtype)
    c = config
    dh, H, Hkv = c.head_dim, c.n_heads, c.n_kv_heads
    std, std_res = 0.02, 0.02 / math.sqrt(2 * c.n_layers)
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
            a = _init_matrix(rng, scheme, c.d_model, c.vocab_size, std).T
        elif leaf == "w_qkv":
            a = np.concatenate([_init_matrix(rng, scheme, c.d_model, n * dh, std) for n in (H, Hkv, Hkv)], axis=1)
        elif leaf == "w_in" and c.activation == "silu_gated":
            a = np.concatenate([_init_matrix(rng, scheme, c.d_model, c.d_mlp, std) for _ in range(2)], axis=1)
        else:  # w_o, w_in, w_out
            a = _init_matrix(rng, scheme, shape[0], shape[1], std_res if leaf in ("w_o", "w_out") else std)
        arrays[name] = a.astype(dt)
    new = Stack.__new__(Stack)
    new._init(c, _check_arrays(c, arrays, "init_weights"))
    return new
