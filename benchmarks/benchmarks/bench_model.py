"""asv suites for transformer stacks (pyengine.models.stack), GPT-2-small shaped, float32.

The stack's speed targets are ratios measured in one process: a batched forward costs at
most 1.3x its own matrix products executed alone with NumPy/BLAS, as the stack calls
it, into reused outputs (``track_forward_over_gemms``, :func:`gemms_alone`), and a block JVP over K tangents at most 1.5x the
block forward of K sequences (``track_jvp_over_forward``); a block VJP over K
cotangents at most 1.5x that forward (``track_vjp_over_forward``). The targets' K = 64 and
12 layers are cut to K = 8 and 2 layers here to keep a run short; the ratios are
per layer and barely depend on either.
"""

from __future__ import annotations

import numpy as np

import pyengine as pe

from .common import median_time

#: GPT-2 small: d_model, heads, d_mlp; sequences x tokens per forward.
D_MODEL, N_HEADS, D_MLP = 768, 12, 3072
SEQUENCES, TOKENS, N_BLOCKS = 8, 128, 2


def _stack(n_blocks: int) -> pe.Stack:
    cfg = pe.StackConfig(d_model=D_MODEL, n_heads=N_HEADS, d_mlp=D_MLP, n_layers=n_blocks,
                         activation="gelu_tanh", positions="learned", max_seq_len=TOKENS)
    return pe.init_weights(cfg, "gpt2", seed=0, dtype=np.float32, bias_std=0.02)


def gemm_operands(stack: pe.Stack, sequences: int, tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random operands of every matrix product of a forward, with the forward's shapes and layouts."""
    cfg = stack.config
    rng = np.random.default_rng(0)
    n, dh = sequences * tokens, cfg.head_dim

    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    ops = []
    for k in range(cfg.n_layers):
        w = stack.weights
        p = f"blocks.{k}."
        ops += [
            (r(n, cfg.d_model), w[p + "attn.w_qkv"]),
            (r(sequences, cfg.n_heads, 1, tokens, dh), r(sequences, cfg.n_heads, 1, dh, tokens)),  # q k^T
            (r(sequences, cfg.n_heads, 1, tokens, tokens), r(sequences, cfg.n_heads, 1, tokens, dh)),  # P v
            (r(n, cfg.d_model), w[p + "attn.w_o"]),
            (r(n, cfg.d_model), w[p + "mlp.w_in"]),
            (r(n, cfg.d_mlp), w[p + "mlp.w_out"]),
        ]
    return ops


def gemms_alone(ops: list[tuple[np.ndarray, np.ndarray]]):
    """A callable running the products of :func:`gemm_operands` the way the stack runs them.

    The weight products through pyengine's ``linear`` kernel (NumPy's OpenBLAS,
    single-threaded per row tile in pyengine's threads, as the block engine calls it), the
    batched attention products by ``numpy.matmul``; every output allocated once here and
    reused. ``np.matmul(a, b)`` with a fresh (K*T, n) output each time measured up
    to 2x slower than this, and up to 3.7x right after a pyengine kernel: its page faults
    on fresh memory, and NumPy's BLAS threads competing with pyengine's still-spinning
    OpenMP threads; neither is a cost of the stack's own products.
    """
    from pyengine.kernels.linear import kernel

    lin = kernel("linear")
    outs = [np.empty(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), a.dtype)
            for a, b in ops]

    def run() -> None:
        for (a, b), o in zip(ops, outs):
            if a.ndim == 2:
                lin(a, b, None, None, o)
            else:
                np.matmul(a, b, out=o)

    return run


class StackForward:
    """hidden_states of SEQUENCES x TOKENS through N_BLOCKS GPT-2-small blocks vs its GEMMs alone."""

    timeout = 600

    def setup(self):
        self.stack = _stack(N_BLOCKS)
        self.h0 = np.random.default_rng(1).standard_normal((SEQUENCES, TOKENS, D_MODEL), dtype=np.float32)
        self.ops = gemm_operands(self.stack, SEQUENCES, TOKENS)
        self._gemms = gemms_alone(self.ops)
        self.stack.hidden_states(self.h0)  # warm-up: kernels compiled, weights prepared

    def time_forward(self):
        self.stack.hidden_states(self.h0)

    def time_gemms_only(self):
        self._gemms()

    def track_forward_over_gemms(self):
        forward = median_time(self.time_forward, 5)
        gemms = median_time(self.time_gemms_only, 5)
        return forward / gemms

    track_forward_over_gemms.unit = "ratio"


class BlockJvp:
    """block_jvp of SEQUENCES tangents at one sequence vs block_forward of SEQUENCES sequences."""

    timeout = 600

    def setup(self):
        self.stack = _stack(1)
        rng = np.random.default_rng(2)
        self.hb = rng.standard_normal((SEQUENCES, TOKENS, D_MODEL), dtype=np.float32)
        self.h = self.hb[0].copy()
        self.dh = rng.standard_normal((SEQUENCES, TOKENS, D_MODEL), dtype=np.float32)
        _, self.cache = self.stack.block_forward(0, self.h, return_cache=True)
        self.stack.block_jvp(0, self.h, self.dh, cache=self.cache)  # warm-up; fills the cache

    def time_block_forward(self):
        self.stack.block_forward(0, self.hb)

    def time_block_jvp(self):
        self.stack.block_jvp(0, self.h, self.dh, cache=self.cache)

    def time_block_jvp_uncached(self):
        self.stack.block_jvp(0, self.h, self.dh)

    def track_jvp_over_forward(self):
        return median_time(self.time_block_jvp, 5) / median_time(self.time_block_forward, 5)

    track_jvp_over_forward.unit = "ratio"


class BlockVjp:
    """block_vjp of SEQUENCES cotangents at one sequence vs block_forward of SEQUENCES sequences.

    Target: ``track_vjp_over_forward`` <= 1.5 (K = 64 there; cut to K = 8 here,
    as for BlockJvp). ``time_block_vjp_weights`` adds the block's weight gradients.
    """

    timeout = 600

    def setup(self):
        self.stack = _stack(1)
        rng = np.random.default_rng(3)
        self.hb = rng.standard_normal((SEQUENCES, TOKENS, D_MODEL), dtype=np.float32)
        self.h = self.hb[0].copy()
        self.g = rng.standard_normal((SEQUENCES, TOKENS, D_MODEL), dtype=np.float32)
        _, self.cache = self.stack.block_forward(0, self.h, return_cache=True)
        self.stack.block_vjp(0, self.h, self.g, cache=self.cache, weights=True)  # warm-up; fills the cache

    def time_block_forward(self):
        self.stack.block_forward(0, self.hb)

    def time_block_vjp(self):
        self.stack.block_vjp(0, self.h, self.g, cache=self.cache)

    def time_block_vjp_weights(self):
        self.stack.block_vjp(0, self.h, self.g, cache=self.cache, weights=True)

    def track_vjp_over_forward(self):
        return median_time(self.time_block_vjp, 5) / median_time(self.time_block_forward, 5)

    track_vjp_over_forward.unit = "ratio"
