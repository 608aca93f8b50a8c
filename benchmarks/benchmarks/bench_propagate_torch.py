"""asv suite of pyengine propagation against PyTorch, as ratios measured in one process.

The shapes of ``benchmarks/scripts/torch_compare.py`` (GPT-2-small blocks, T = 128, float32),
cut to K = 16 directions and 4 blocks to keep a run short (the ratios are per block
and barely depend on either), with both libraries at their default thread settings:

- ``track_torch_over_exact_all``: PyTorch's batched forward (SDPA) of the K + 1
  sequences over ``pe.propagate`` exact at all positions (>= 1.15);
- ``track_torch_over_exact_span``: the same over exact propagation from T/2 (>= 2.5);
- ``track_vmap_jvp_over_linearized``: ``torch.func`` vmap(jvp) over linearized (>= 1.6);
- ``track_exact_over_gemms``: exact over its own matrix products executed alone (<= 1.1).

Each ratio is the quotient of the two sides' median times over ``ROUNDS`` rounds in which
they are called in turn (``common.interleaved_ratio``).

PyTorch is optional (the ``test`` extra has it): without it the suite is skipped.
:func:`torch_stack` is also what ``benchmarks/scripts/torch_compare.py`` runs.
"""

from __future__ import annotations

import numpy as np

import pyengine as pe

from .bench_model import gemm_operands
from .common import interleaved_ratio

PERTURBATIONS, TOKENS, N_BLOCKS = 16, 128, 4
ROUNDS = 7  # alternated calls of each side of a ratio


def torch_stack(stack: pe.Stack, sdpa: bool = True, dtype=None):
    """A PyTorch forward of a pre-LN GPT-2-style Stack (learned positions already in h).

    ``sdpa``: fused scaled_dot_product_attention (fastest; no forward-mode AD on the
    CPU), else explicit softmax(q k^T / sqrt(dh) + mask) v, which torch.func.jvp can
    differentiate. ``dtype``: the weights' torch dtype (default float32; ``torch.bfloat16``
    for a forward wholly in bf16, the input then in bf16 as well).
    """
    import torch
    import torch.nn.functional as F

    cfg = stack.config
    d, H, dh = cfg.d_model, cfg.n_heads, cfg.head_dim
    dtype = dtype or torch.float32
    W = {n: torch.from_numpy(np.array(a)).to(dtype) for n, a in stack.weights.items()}
    mask = torch.triu(torch.full((cfg.max_seq_len, cfg.max_seq_len), float("-inf")), diagonal=1).to(dtype)

    def forward(h):  # (B, T, d) -> (B, T, d)
        B, T, _ = h.shape
        for k in range(cfg.n_layers):
            p = f"blocks.{k}."
            a = F.layer_norm(h, (d,), W[p + "norm1.gamma"], W[p + "norm1.beta"], cfg.eps)
            qkv = (a @ W[p + "attn.w_qkv"] + W[p + "attn.b_qkv"]).view(B, T, 3, H, dh).permute(2, 0, 3, 1, 4)
            if sdpa:
                o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
            else:
                s = (qkv[0] @ qkv[1].transpose(-1, -2)) * dh**-0.5 + mask[:T, :T]
                o = torch.softmax(s, dim=-1) @ qkv[2]
            h = h + o.transpose(1, 2).reshape(B, T, d) @ W[p + "attn.w_o"] + W[p + "attn.b_o"]
            a = F.layer_norm(h, (d,), W[p + "norm2.gamma"], W[p + "norm2.beta"], cfg.eps)
            u = F.gelu(a @ W[p + "mlp.w_in"] + W[p + "mlp.b_in"], approximate="tanh")
            h = h + u @ W[p + "mlp.w_out"] + W[p + "mlp.b_out"]
        return h

    return forward


class PropagateVsTorch:
    """K = PERTURBATIONS directions injected at hidden state 0; PyTorch on the same stack."""

    timeout = 900
    number, repeat, rounds, warmup_time = 1, 1, 1, 0.0

    def setup(self):
        try:
            import torch
        except ImportError as e:  # asv: skip
            raise NotImplementedError("torch is not installed") from e
        K, T = PERTURBATIONS, TOKENS
        cfg = pe.StackConfig(d_model=768, n_heads=12, d_mlp=3072, n_layers=N_BLOCKS, vocab_size=256,
                             activation="gelu_tanh", positions="learned", max_seq_len=T)
        self.stack = pe.init_weights(cfg, "gpt2", seed=0, dtype=np.float32, bias_std=0.02)
        rng = np.random.default_rng(0)
        self.ids = rng.integers(0, 256, T)
        v = rng.standard_normal((K, 768))
        self.v = v
        vn = torch.from_numpy((v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32))
        x0 = torch.from_numpy(self.stack.hidden_states(self.ids)[0].copy())
        self.x0, self.batch = x0, torch.cat([x0[None], x0[None] + 6.0 * vn[:, None, :]])
        self.tang = vn[:, None, :].expand(K, T, 768).contiguous()
        self.fwd, self.fwd_math = torch_stack(self.stack), torch_stack(self.stack, sdpa=False)
        self.ops = gemm_operands(self.stack, K + 1, T)

    def _torch_forward(self):
        import torch

        with torch.inference_mode():
            self.fwd(self.batch)

    def _vmap_jvp(self):
        import torch

        f = torch.func.vmap(lambda t: torch.func.jvp(self.fwd_math, (self.x0[None],), (t[None],))[1])
        with torch.no_grad():
            f(self.tang)

    def _exact(self, positions="all"):
        pe.propagate(self.stack, self.ids, self.v, 6.0, 0, positions)

    def _linearized(self):
        pe.propagate(self.stack, self.ids, self.v, 6.0, 0, "all", linearized=True)

    def _gemms(self):
        for a, b in self.ops:
            np.matmul(a, b)

    # Ratios of calls made in turn (common.interleaved_ratio), as benchmarks/scripts/torch_compare.py
    # gives them: the shared machine's slow spells fall on both sides.
    def track_torch_over_exact_all(self):
        return interleaved_ratio(self._torch_forward, self._exact, ROUNDS)

    def track_torch_over_exact_span(self):
        return interleaved_ratio(self._torch_forward, lambda: self._exact(slice(TOKENS // 2, None)), ROUNDS)

    def track_vmap_jvp_over_linearized(self):
        return interleaved_ratio(self._vmap_jvp, self._linearized, ROUNDS)

    def track_exact_over_gemms(self):
        return interleaved_ratio(self._exact, self._gemms, ROUNDS)

    for _f in (track_torch_over_exact_all, track_torch_over_exact_span, track_vmap_jvp_over_linearized,
               track_exact_over_gemms):
        _f.unit = "ratio"
    del _f
