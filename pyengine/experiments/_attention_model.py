"""The one-head model of :mod:`pyengine.experiments.attention_dynamics`: loss, metrics, gradient, M-step.

:class:`Model` holds the data and the fused attention kernels (forward and backward)
and computes the metrics and the exact gradient of the mean cross-entropy at given
weights; :class:`Evaluator` the forward-only loss on held-out sequences (one fused
kernel call for all of them); :func:`m_step` is the damped Newton (IRLS) step in W_V
with routing and W_O held fixed, :func:`value_hessian` its Hessian. The protocol, the M-step's definition and
the constants are documented in the experiment's module docstring; they are re-exported
there (import them from ``attention_dynamics``).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.linalg import cho_factor, cho_solve
from scipy.linalg.blas import dsyrk  # imported at load: threadpool_limits only limits loaded BLAS

from ..backends import resolve

__all__ = ["D_IN", "D_K", "D_V", "LINE_SEARCH", "Evaluator", "Model", "m_step", "value_hessian"]

D_IN, D_K, D_V = 20, 10, 15
#: Halvings of the Newton step before the M-step gives up on a step.
LINE_SEARCH = 20


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _log_softmax_cols(lt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log p, p) of the columns of lt (n_out, T): the softmax over axis 0, in lt's dtype.

    The same numbers as ``_log_softmax(lt.T).T``; laid out (n_out, T) because numpy's
    reductions over the 8 entries of a row cost ~10x the elementwise ones across rows
    (175 us against ~20 us a step at T = 2000).
    """
    z = lt - lt.max(axis=0)
    e = np.exp(z)
    s = e.sum(axis=0)
    return z - np.log(s), e / s


class Model:
    """The one-head model's loss, metrics and exact gradient on fixed data, via the fused kernels."""

    def __init__(self, X: np.ndarray, y: np.ndarray, n_symbols: int, backend: str = "auto") -> None:
        self.X, self.y, self.T = X, y, X.shape[0]
        self.Y = np.eye(n_symbols, dtype=X.dtype)[y]
        self.rows = np.arange(self.T)
        self.scale = 1.0 / math.sqrt(D_K)
        self.fwd = resolve("attention_forward", backend)
        self.bwd = resolve("attention_backward", backend)
        T, dt = self.T, X.dtype
        self.lse, self.ent, self.spread = np.empty((1, T)), np.empty((1, T)), np.empty((1, T))
        self._out: dict[int, np.ndarray] = {}  # the forward pass's outputs, by width

    def attend(self, W: dict[str, np.ndarray], V: np.ndarray | None = None):
        """(Q, K, V, O) of the head; V defaults to X W_V (pass X itself for Z = softmax(.) X)."""
        X = self.X
        Q, K = (X @ W["W_Q"])[None], (X @ W["W_K"])[None]
        V = (X @ W["W_V"])[None] if V is None else V[None]
        O = self._out.setdefault(V.shape[-1], np.empty((1, self.T, V.shape[-1]), X.dtype))
        if self.fwd(Q, K, V, 0, self.scale, O, self.lse, self.ent):
            raise FloatingPointError("the attention scores overflowed")
        return Q, K, V, O[0]

    def loss(self, logits: np.ndarray) -> float:
        """The mean cross-entropy of logits (T, n_out), in float64."""
        z = logits.astype(np.float64)
        z = z - z.max(axis=1, keepdims=True)
        lse = np.log(np.exp(z).sum(axis=1))
        return float((lse - z[self.rows, self.y]).sum() / self.T)

    def step(self, W: dict[str, np.ndarray], want_z: bool = False
             ) -> tuple[dict[str, float], dict[str, np.ndarray], np.ndarray | None]:
        """(metrics, gradients of the mean loss, Z = softmax(.) X or None) at the weights W.

        With ``want_z`` the forward pass attends over X itself (Z, 20 features) and
        O = Z W_V, which is the same O (o is linear in the values): the M-step needs Z.
        """
        # The head is linear after the attention: logits = softmax(.) V W_O. Both passes
        # therefore run on the values seen through W_O, V W_O (T, n_out = 8), not on V
        # (T, 15): the forward pass gives the logits directly, and the backward pass on
        # (V W_O, logits, dL/dlogits) computes the same p, dp_ij = d_o_i.v_j =
        # dlogits_i.(W_O^T v_j) and D_i = d_o_i.o_i = dlogits_i.logits_i, so the same dq,
        # dk and spread, and dvo = A^T dlogits, from which dL/dV = dvo W_O^T and
        # dL/dW_O = O^T dlogits = V^T dvo. 8 instead of 15 features in two of the
        # forward's and four of the backward's per-(query, key) products.
        X = self.X
        V = X @ W["W_V"]
        Vo = V @ W["W_O"]
        if want_z:
            Q, K, _, Z = self.attend(W, V=X)
            Z = Z.copy()
            logits = (Z @ W["W_V"]) @ W["W_O"]
        else:
            Q, K, _, logits = self.attend(W, V=Vo)
            Z = None
        # The loss head laid out (n_out, T) in float64 (see _log_softmax_cols).
        lt = np.ascontiguousarray(logits.T, dtype=np.float64)
        logp, p = _log_softmax_cols(lt)
        T, rows, y = self.T, self.rows, self.y
        metrics = {
            "loss": float(-logp[y, rows].sum() / T),
            "accuracy": float((lt.argmax(axis=0) == y).mean()),
            "pred_entropy": float(-np.einsum("ij,ij->", p, logp) / T),
            "attn_entropy": float(self.ent.mean()),
        }
        p[y, rows] -= 1.0  # dL/dlogits^T = (p - onehot(y)) / T, in place
        dlog = np.ascontiguousarray((p / T).T, dtype=X.dtype)  # (T, n_out)
        dq, dk, dvo = np.empty_like(Q), np.empty_like(K), np.empty((1,) + Vo.shape, X.dtype)
        if self.bwd(Q, K, Vo[None], logits[None], dlog[None], self.lse, 0, self.scale, dq, dk, dvo, self.spread):
            raise FloatingPointError("the attention backward pass overflowed")
        metrics["adv_spread"] = float(self.spread.mean() * T)  # per-token loss: u = T dL/do
        grads = {"W_Q": X.T @ dq[0], "W_K": X.T @ dk[0], "W_V": (X.T @ dvo[0]) @ W["W_O"].T, "W_O": V.T @ dvo[0]}
        return metrics, grads, Z


class Evaluator:
    """The mean cross-entropy of the head on B sequences of equal length, forward only.

    Parameters
    ----------
    X : ndarray, shape (B, T, d_in), float32 or float64
        The inputs; the kernels compute in X's dtype.
    y : ndarray, shape (B, T), int
        The targets.
    """

    def __init__(self, X: np.ndarray, y: np.ndarray, n_symbols: int, backend: str = "auto") -> None:
        if X.ndim != 3 or y.shape != X.shape[:2]:
            raise ValueError(f"X must be (B, T, d) and y (B, T); got {X.shape} and {y.shape}")
        self.X, self.y = np.ascontiguousarray(X), y
        B, T = y.shape
        self.scale = 1.0 / math.sqrt(D_K)
        self.fwd = resolve("attention_forward", backend)
        self.lse, self.ent = np.empty((B, T)), np.empty((B, T))
        self.out = np.empty((B, T, n_symbols), X.dtype)
        self._pick = (y, np.arange(B)[:, None], np.arange(T)[None, :])

    def losses(self, W: dict[str, np.ndarray]) -> np.ndarray:
        """(B,) float64: each sequence's mean cross-entropy at the weights W (the training step's forward)."""
        X = self.X
        Q, K = X @ W["W_Q"], X @ W["W_K"]
        Vo = (X @ W["W_V"]) @ W["W_O"]  # attend over V W_O, as Model.step does
        if self.fwd(Q, K, np.ascontiguousarray(Vo), 0, self.scale, self.out, self.lse, self.ent):
            raise FloatingPointError("the attention scores overflowed")
        # (n_out, B, T) layout in float64: reductions over the 8 logits of a token are cheap across tokens
        logp = _log_softmax_cols(np.ascontiguousarray(self.out.transpose(2, 0, 1), dtype=np.float64))[0]
        return -logp[self._pick].mean(axis=1)


def value_hessian(Z: np.ndarray, p: np.ndarray, Wo: np.ndarray) -> np.ndarray:
    """The Hessian in vec(W_V) (row-major) of the mean cross-entropy of Z W_V Wo: J H_L J^T.

    H_L, in the logit weights W_V Wo (160 instead of 300 parameters), is one product G^T Z
    (G_t = z_t ⊗ p_t) minus the symmetric G^T G (BLAS syrk: the largest cost); J = kron(I, Wo)
    is applied as two contractions with Wo, never formed.
    """
    T, dz = Z.shape
    dv, n_out = Wo.shape
    G = (Z[:, :, None] * p[:, None, :]).reshape(T, dz * n_out)
    C = dsyrk(1.0, G.T, trans=0)  # G^T G, upper triangle (G.T is Fortran-ordered: no copy)
    HL = -(np.triu(C) + np.triu(C, 1).T).reshape(dz, n_out, dz, n_out)  # sum_t (z z^T) ⊗ (p p^T)
    idx = np.arange(n_out)  # the diag(p_t) term, k = l: [a, k, b] = sum_t z_a p_k z_b
    HL[:, idx, :, idx] += (G.T @ Z).reshape(dz, n_out, dz).transpose(1, 0, 2)
    HL /= T
    # H[a, i, b, j] = sum_{k, l} Wo[i, k] HL[a, k, b, l] Wo[j, l]
    H = np.einsum("ik,akbj->aibj", Wo, HL @ Wo.T, optimize=True).reshape(dz * dv, dz * dv)
    return 0.5 * (H + H.T)  # symmetric to the last bit (the contraction order is not)


def m_step(model: Model, W: dict[str, np.ndarray], damping: float, Z: np.ndarray | None = None,
           ridge: float = 0.0) -> tuple[np.ndarray, bool, float, float]:
    """One damped Newton step in W_V with routing and W_O fixed: (new W_V, taken, objective before, after).

    The objective is the mean cross-entropy plus ``ridge`` / 2 |W_V|_F^2 (a ridge penalty:
    its gradient ridge W_V and Hessian ridge I are added to the cross-entropy's).
    ``Z`` = softmax(Q K^T / sqrt(dk), causal) X at W (from ``Model.step(W, want_z=True)``;
    computed here if None).
    """
    if Z is None:
        Z = model.attend(W, V=model.X)[3]
    Z = Z.astype(np.float64)
    Wo, Wv = W["W_O"].astype(np.float64), W["W_V"].astype(np.float64)
    T, dz, dv = Z.shape[0], Z.shape[1], Wv.shape[1]
    base = Z @ Wv @ Wo
    logp = _log_softmax(base)
    p = np.exp(logp)
    f0 = float(-(logp * model.Y).sum() / T) + 0.5 * ridge * float((Wv * Wv).sum())
    g = Z.T @ ((p - model.Y) @ Wo.T) / T + ridge * Wv  # (dz, dv)
    H = value_hessian(Z, p, Wo)
    lam = damping * np.trace(H) / H.shape[0] + 1e-12
    H[np.diag_indices_from(H)] += lam + ridge
    delta = -cho_solve(cho_factor(H), g.reshape(-1)).reshape(dz, dv)
    dlog = Z @ delta @ Wo
    t = 1.0
    for _ in range(LINE_SEARCH):
        cand = Wv + t * delta
        f = model.loss(base + t * dlog) + 0.5 * ridge * float((cand * cand).sum())
        if f <= f0:
            return (Wv + t * delta).astype(W["W_V"].dtype), True, f0, f
        t *= 0.5
    return W["W_V"], False, f0, f0
