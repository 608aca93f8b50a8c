"""Attention gradient dynamics on a sticky Markov chain: EM-style value updates against GD.

Protocol (after Agarwal, Dalal & Misra, arXiv 2512.22473, and their public script):

* **Chain.** ``n_symbols = 8``; row i has weight ``stay`` on the diagonal and
  1/(circular distance) off it; the row is normalized, multiplied by (1 - stay), ``stay``
  is added on the diagonal and the row normalized again. ``stay = 0.3`` gives an
  effective stay probability of about 0.35 (:func:`markov_chain` reports it).
* **Data.** One sequence y_0 .. y_T (y_0 from the stationary distribution) per seed;
  inputs x_t = mu_{y_{t-1}} + eps_t, eps ~ N(0, I_20), targets y_t, t = 1 .. T. The
  symbol means mu (8 x 20, N(0, 1)) are drawn once from ``mu_seed``; the sequence, the
  noise and the initialization come from the run's seed, so every arm of a seed sees the
  same data and starts from the same weights.
* **Model.** One causal attention head without positions: Q = X W_Q, K = X W_K,
  V = X W_V, logits = softmax(Q K^T / sqrt(10), causal) V W_O; W_Q, W_K 20x10, W_V 20x15,
  W_O 15x8, init N(0, 0.1^2); loss: mean cross-entropy over the T targets. The head
  runs on the fused kernels :func:`pyengine.kernels.attention.attention_forward` and
  ``attention_backward`` (row-streaming: no T x T matrix is stored). The default dtype is
  float32 (the C++ head then computes in float, about twice as fast); the final losses of
  every arm agree with ``dtype="float64"`` to ~3e-8 (seed 42, 1000 steps), and the M-step's
  Newton system is always solved in float64.
* **Arms.** ``gd``: full-batch gradient descent, learning rate ``lr`` (0.01) on all four
  matrices. ``value_lr``: the public script's "EM-like" arm, 10x the learning rate on W_V
  only. ``m_step``: gradient descent on W_Q, W_K, W_O as in ``gd``, and for W_V a true
  M-step with the routing (the attention weights) and W_O held fixed: the logits are then
  linear in W_V, logits = Z W_V W_O with Z = softmax(...) X, and the mean cross-entropy is
  convex in W_V. Each step takes one damped Newton (IRLS) step on it,
  (H + lambda I) Delta = -g with H the exact Hessian
  (1/T) sum_t (z_t z_t^T) ⊗ (W_O (diag p_t - p_t p_t^T) W_O^T) and lambda =
  ``newton_damping`` x trace(H)/300 (H is singular: W_O has rank 8 < 15, and the logits
  are shift-invariant), then halves the step until the loss does not increase
  (at most ``LINE_SEARCH`` halvings; if none lowers it the step is skipped and counted
  in ``m_step_skipped``). On its own, with routing and W_O fixed, the M-step therefore
  never raises the loss; the other three matrices move by gradient descent at the same
  time, from the same point.
* **Metrics.** Per step: loss, argmax accuracy, mean predictive entropy (nats), mean
  attention entropy (nats), and the advantage's spread: the mean over queries of the
  attention-weighted standard deviation sqrt(sum_j p_ij A_ij^2) of the advantage
  A_ij = u_i.v_j - sum_k p_ik u_i.v_k, with u_i = d(per-token loss)/do_i (T times the
  gradient of the mean loss). Per run: the Bayes floor H(Y_t | Y_{t-1}) (exact, from
  the stationary distribution), the steps each arm needs to reach the ``gd`` arm's final
  loss, a paired comparison over seeds, and the PCA of the trajectory of the value
  vectors mu_k W_V (8 x 15 per step): the variance explained by PC1 and PC2.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from ._attention_model import D_IN, D_K, D_V, LINE_SEARCH, Model, m_step, value_hessian  # noqa: F401 (re-exported)

__all__ = ["ARMS", "AttentionDynamics", "attention_dynamics", "bayes_entropy", "markov_chain"]

ARMS = ("gd", "value_lr", "m_step")
DEFAULT_SEEDS = (42, 2024, 1337, 7777, 9999)
INIT_STD = 0.1
#: Steps at which the attention heat map (first HEATMAP_TOKENS tokens, first seed) is kept.
HEATMAP_TOKENS = 48
METRICS = ("loss", "accuracy", "pred_entropy", "attn_entropy", "adv_spread")
Progress = Callable[[float, str], None]


def markov_chain(n_symbols: int = 8, stay: float = 0.3) -> np.ndarray:
    """The sticky chain's transition matrix (n, n): see the module docstring."""
    if n_symbols < 2:
        raise ValueError(f"n_symbols must be >= 2; got {n_symbols}")
    if not 0.0 <= stay < 1.0:
        raise ValueError(f"stay must be in [0, 1); got {stay}")
    idx = np.arange(n_symbols)
    dist = np.abs(idx[:, None] - idx[None, :])
    dist = np.minimum(dist, n_symbols - dist)
    w = np.where(dist == 0, stay, 1.0 / np.maximum(dist, 1))
    w = w / w.sum(axis=1, keepdims=True) * (1.0 - stay) + stay * np.eye(n_symbols)
    return w / w.sum(axis=1, keepdims=True)


def stationary(P: np.ndarray) -> np.ndarray:
    """The stationary distribution pi = pi P (the left eigenvector of eigenvalue 1)."""
    vals, vecs = np.linalg.eig(P.T)
    pi = np.real(vecs[:, np.argmin(np.abs(vals - 1.0))])
    return pi / pi.sum()


def bayes_entropy(P: np.ndarray) -> float:
    """H(Y_t | Y_{t-1}) = sum_i pi_i H(P_i) in nats: the best mean cross-entropy any predictor reaches."""
    pi = stationary(P)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(P > 0, P * np.log(P), 0.0).sum(axis=1)
    return float(pi @ h)


def make_data(P: np.ndarray, T: int, mu: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(X (T, d), y (T,)): one chain path y_0..y_T, x_t = mu_{y_{t-1}} + eps_t, targets y_1..y_T."""
    n = P.shape[0]
    y = np.empty(T + 1, dtype=np.int64)
    y[0] = rng.choice(n, p=stationary(P))
    cum = np.cumsum(P, axis=1)
    u = rng.random(T)
    for t in range(T):
        y[t + 1] = min(int(np.searchsorted(cum[y[t]], u[t], side="right")), n - 1)
    X = mu[y[:-1]] + rng.standard_normal((T, mu.shape[1]))
    return X, y[1:]


def init_params(rng: np.random.Generator, n_symbols: int, dtype) -> dict[str, np.ndarray]:
    shapes = {"W_Q": (D_IN, D_K), "W_K": (D_IN, D_K), "W_V": (D_IN, D_V), "W_O": (D_V, n_symbols)}
    return {k: (INIT_STD * rng.standard_normal(s)).astype(dtype) for k, s in shapes.items()}


@dataclasses.dataclass
class AttentionDynamics:
    """The report of :func:`attention_dynamics` (arrays indexed [seed, step])."""

    config: dict[str, Any]
    chain: np.ndarray
    effective_stay: float
    bayes_entropy: float
    seeds: tuple[int, ...]
    arms: tuple[str, ...]
    metrics: dict[str, dict[str, np.ndarray]]  # arm -> metric -> (n_seeds, steps + 1)
    value_pca: dict[str, np.ndarray]  # arm -> (n_seeds, 2): variance explained by PC1, PC2
    heatmaps: dict[str, dict[int, np.ndarray]]  # arm -> step -> (HEATMAP_TOKENS,)*2, first seed
    m_step_skipped: np.ndarray  # (n_seeds,)
    seconds: dict[str, float]
    interrupted: bool = False

    def final(self, arm: str, metric: str = "loss") -> np.ndarray:
        return self.metrics[arm][metric][:, -1]

    def steps_to_gd_final(self, arm: str) -> np.ndarray:
        """Per seed, the first step at which ``arm``'s loss is <= the gd arm's final loss (NaN: never)."""
        target = self.final("gd")
        loss = self.metrics[arm]["loss"]
        out = np.full(loss.shape[0], np.nan)
        for s in range(loss.shape[0]):
            hit = np.flatnonzero(loss[s] <= target[s] + 1e-12)
            out[s] = hit[0] if hit.size else np.nan
        return out

    def paired(self, arm: str) -> dict[str, float]:
        """Paired comparison with gd over seeds: final-loss difference (arm - gd), its t statistic, wins, step ratio."""
        diff = self.final(arm) - self.final("gd")
        n = diff.size
        sd = float(diff.std(ddof=1)) if n > 1 else float("nan")
        t = float(diff.mean() / (sd / math.sqrt(n))) if n > 1 and sd > 0 else float("nan")
        steps = self.steps_to_gd_final(arm)
        gd_steps = self.steps_to_gd_final("gd")
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = gd_steps / steps
        return {"mean_diff": float(diff.mean()), "sd_diff": sd, "t": t, "wins": int((diff < 0).sum()), "n": n,
                "step_ratio_mean": float(np.nanmean(ratio)) if np.isfinite(ratio).any() else float("nan")}


def _value_pca(traj: np.ndarray) -> np.ndarray:
    """Variance explained by PC1 and PC2 of a trajectory (steps, features)."""
    c = traj - traj.mean(axis=0)
    s = np.linalg.svd(c, compute_uv=False) ** 2
    tot = s.sum()
    return np.array([s[0] / tot, s[1] / tot]) if tot > 0 else np.zeros(2)


def _heatmap(model: Model, W: dict[str, np.ndarray]) -> np.ndarray:
    n = min(HEATMAP_TOKENS, model.T)
    X = model.X[:n].astype(np.float64)
    s = (X @ W["W_Q"]) @ (X @ W["W_K"]).T * model.scale
    s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def run_arm(arm: str, X: np.ndarray, y: np.ndarray, mu: np.ndarray, W0: dict[str, np.ndarray], *, steps: int,
            lr: float, value_lr_factor: float, newton_damping: float, heat_steps: Sequence[int], backend: str,
            tick: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Train one arm from W0: metric history (steps + 1, len(METRICS)), value trajectory, heat maps."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {', '.join(ARMS)}; got {arm!r}")
    model = Model(X, y, mu.shape[0], backend)
    W = {k: v.copy() for k, v in W0.items()}
    hist = np.empty((steps + 1, len(METRICS)))
    values = np.empty((steps + 1, mu.size // mu.shape[1] * D_V))
    heat, skipped = {}, 0
    mu_t = mu.astype(X.dtype)
    for step in range(steps + 1):
        metrics, grads, Z = model.step(W, want_z=arm == "m_step")
        hist[step] = [metrics[m] for m in METRICS]
        values[step] = (mu_t @ W["W_V"]).ravel()
        if step in heat_steps:
            heat[step] = _heatmap(model, W)
        if step == steps:
            break
        new_v = None
        if arm == "m_step":
            new_v, taken, _, _ = m_step(model, W, newton_damping, Z)
            skipped += not taken
        for name, g in grads.items():
            rate = lr * (value_lr_factor if arm == "value_lr" and name == "W_V" else 1.0)
            W[name] = W[name] - (rate * g).astype(W[name].dtype)
        if new_v is not None:
            W["W_V"] = new_v
        tick()
    return {"hist": hist, "pca": _value_pca(values), "heat": heat, "skipped": skipped, "W": W}


def attention_dynamics(*, seeds: Sequence[int] = DEFAULT_SEEDS, arms: Sequence[str] = ARMS, steps: int = 1000,
                       T: int = 2000, n_symbols: int = 8, stay: float = 0.3, lr: float = 0.01,
                       value_lr_factor: float = 10.0, newton_damping: float = 1e-3, mu_seed: int = 0,
                       dtype: str = "float32", backend: str = "auto",
                       progress: Progress | None = None, workers: int = 1) -> AttentionDynamics:
    """Run the experiment (module docstring) and return its report.

    ``workers`` > 1 runs the seeds in that many worker processes (spawned), each with
    single-threaded BLAS and kernels (threadpoolctl, :func:`pyengine.set_num_threads`);
    every seed computes exactly what it computes serially (the kernels' results do not
    depend on the thread count), so the report is identical, only sooner.

    Ctrl-C (KeyboardInterrupt) stops it: the report of the seeds finished so far (every
    arm of each) is returned with ``interrupted = True``; if no seed finished, it re-raises.
    """
    arms = tuple(arms)
    if "gd" not in arms:
        raise ValueError(f"arms must include 'gd' (the baseline); got {arms}")
    for a in arms:
        if a not in ARMS:
            raise ValueError(f"arm must be one of {', '.join(ARMS)}; got {a!r}")
    if steps < 1 or T < 2:
        raise ValueError(f"steps must be >= 1 and T >= 2; got steps={steps}, T={T}")
    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype must be 'float32' or 'float64'; got {dtype!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int; got {workers!r}")
    with threadpool_limits(1):  # the GEMMs are small: BLAS threads only contend with the kernel's
        return _run(seeds, arms, steps, T, n_symbols, stay, lr, value_lr_factor, newton_damping, mu_seed, dtype,
                    backend, progress, workers)


def run_seed(seed: int, arms: Sequence[str], steps: int, T: int, n_symbols: int, stay: float, mu_seed: int,
             dtype: str, backend: str, arm_kw: dict[str, Any], tick: Callable[[str], None] = lambda label: None
             ) -> dict[str, dict[str, Any]]:
    """Every arm of one seed (data, init and the runs depend on the seed only): arm -> :func:`run_arm`'s dict."""
    P = markov_chain(n_symbols, stay)
    mu = np.random.default_rng(mu_seed).standard_normal((n_symbols, D_IN))
    rng = np.random.default_rng(seed)
    X, y = make_data(P, T, mu, rng)
    X = X.astype(dtype)
    W0 = init_params(rng, n_symbols, dtype)
    out = {}
    for arm in arms:
        label = f"seed {seed} arm {arm}"
        out[arm] = run_arm(arm, X, y, mu, W0, steps=steps, heat_steps=sorted({0, steps // 10, steps}),
                           backend=backend, tick=lambda: tick(label), **arm_kw)
    return out


def _run(seeds, arms, steps, T, n_symbols, stay, lr, value_lr_factor, newton_damping, mu_seed, dtype, backend,
         progress, workers=1) -> AttentionDynamics:
    t0 = time.perf_counter()
    P = markov_chain(n_symbols, stay)
    total = len(seeds) * len(arms) * steps
    done = [0]

    def tick(label: str, n: int = 1) -> None:
        before, done[0] = done[0], done[0] + n
        if progress and (done[0] // 25 > before // 25 or done[0] == total):
            progress(done[0] / total, label)

    arm_kw = {"lr": lr, "value_lr_factor": value_lr_factor, "newton_damping": newton_damping}
    job = (arms, steps, T, n_symbols, stay, mu_seed, dtype, backend, arm_kw)
    runs: dict[str, list] = {a: [] for a in arms}
    finished: list[int] = []
    interrupted = False
    results: dict[int, dict[str, dict[str, Any]]] = {}  # seed -> arm -> run, filled as seeds finish
    try:
        if workers > 1 and len(seeds) * len(arms) > 1:
            from ._attention_pool import run_seeds

            run_seeds(run_seed, seeds, job, workers, tick, results)
        else:
            for seed in seeds:
                results[seed] = run_seed(seed, *job, tick=tick)
    except KeyboardInterrupt:
        if not results:
            raise
        interrupted = True
    for seed in seeds:
        if seed in results:
            for arm in arms:
                runs[arm].append(results[seed][arm])
            finished.append(seed)
    if progress:
        progress(1.0, "done")
    seconds = time.perf_counter() - t0
    n_steps = len(finished) * len(arms) * steps
    eff = float(np.mean(np.diag(P)))
    return AttentionDynamics(
        config={"seeds": list(seeds), "arms": list(arms), "steps": steps, "T": T, "n_symbols": n_symbols,
                "stay": stay, "lr": lr, "value_lr_factor": value_lr_factor, "newton_damping": newton_damping,
                "mu_seed": mu_seed, "dtype": dtype, "backend": backend, "workers": workers},
        chain=P, effective_stay=eff, bayes_entropy=bayes_entropy(P), seeds=tuple(finished), arms=arms,
        metrics={a: {m: np.stack([r["hist"][:, i] for r in runs[a]]) for i, m in enumerate(METRICS)} for a in arms},
        value_pca={a: np.stack([r["pca"] for r in runs[a]]) for a in arms},
        heatmaps={a: runs[a][0]["heat"] for a in arms},
        m_step_skipped=np.array([r["skipped"] for r in runs.get("m_step", [])]),
        seconds={"total": seconds, "per_step_ms": 1e3 * seconds / max(n_steps, 1)},
        interrupted=interrupted,
    )
