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
  never raises the objective; the other three matrices move by gradient descent at the
  same time, from the same point. The objective is the mean cross-entropy plus
  ``m_step_ridge`` / 2 |W_V|_F^2: without the ridge the exact maximizer memorizes. W_V's
  300 parameters (160 as logit weights W_V W_O) face T = 2000 tokens, but early on the
  attention is near uniform and z_t is a running mean of the inputs, nearly the same
  vector for all late t: few effectively independent rows. Unpenalized, the training
  loss falls below the Bayes floor and the held-out loss rises above log 8 from the
  first steps (seed 42: 2.55 on the held-out sequences, its validation loss lowest at
  step 0, so early stopping would keep the initialization).
* **Ridge default** (``M_STEP_RIDGE`` = 3e-3), chosen as the lowest mean final loss on
  the validation sequences (seed + 20000) of the five default seeds, never on training
  loss, at the default configuration: 0.0003: 1.9505, 0.001: 1.9404, 0.003: 1.9397,
  0.01: 1.9513 (a coarse pass on seed 42 alone: 0: 2.998, 0.1: 2.073). 1e-3 and 3e-3
  are within 0.001 nats. The mean Hessian eigenvalue trace(H)/300 at the initialization
  is about 1.3e-3: the ridge is of that size.
* **Held-out evaluation.** Per seed, ``n_heldout`` (4) fresh sequences of the same
  chain, the same mu and the same T, drawn from seeds seed + 10000 + i, and one
  validation sequence from seed + 20000 (used only to choose the ridge). At the steps of
  :func:`eval_schedule` (0 .. 10, every ``eval_every``-th (20) and the last) every arm's
  weights are evaluated on them with the training step's fused forward kernel (one call
  for all five sequences, forward only: about two gd steps' time, 61 times in 1000
  steps). The headline numbers (table, paired comparison, steps to gd's final loss,
  plots) use the held-out loss, the mean over the held-out sequences; the training loss
  and the gap stand beside it.
* **Metrics.** Per step, on the training sequence: loss, argmax accuracy, mean
  predictive entropy (nats), mean attention entropy (nats), the advantage's spread (the
  mean over queries of the attention-weighted standard deviation sqrt(sum_j p_ij A_ij^2)
  of A_ij = u_i.v_j - sum_k p_ik u_i.v_k, with u_i = d(per-token loss)/do_i, T times the
  gradient of the mean loss), the key orthogonality of the symbol keys mu_s W_K, and the
  moves of W_Q W_K^T and W_V. On the schedule: the held-out and validation losses and the
  value manifold of the first held-out sequence's tokens. Per run: the Bayes floor
  H(Y_t | Y_{t-1}) (exact, from the stationary distribution; an arm whose training loss
  goes below it is flagged: the floor is a population quantity), the steps each arm
  needs to reach gd's final held-out loss, the paired comparison over seeds, the
  settling steps of routing and values ("frame before precision"), the PCA of the
  trajectory of the value vectors mu_k W_V (8 x 15 per step) and the verdict. The
  analyses are defined in :mod:`pyengine.experiments._attention_analysis`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from ._attention_analysis import AttentionDynamics, key_orthogonality, posterior_entropy, value_manifold
from ._attention_runs import missing_arms, partial_summary, run_from_arrays, run_to_arrays
from ._attention_model import (  # noqa: F401 (re-exported)
    D_IN,
    D_K,
    D_V,
    LINE_SEARCH,
    Evaluator,
    Model,
    m_step,
    value_hessian,
)

__all__ = ["ARMS", "PRESETS", "AttentionDynamics", "attention_dynamics", "bayes_entropy", "eval_schedule",
           "markov_chain", "run_from_arrays", "run_to_arrays"]

ARMS = ("gd", "value_lr", "m_step")
DEFAULT_SEEDS = (42, 2024, 1337, 7777, 9999)
INIT_STD = 0.1
#: Steps at which the attention heat map (first HEATMAP_TOKENS tokens, first seed) is kept.
HEATMAP_TOKENS = 48
METRICS = ("loss", "accuracy", "pred_entropy", "attn_entropy", "adv_spread", "key_orth")
#: Per-step weight moves: |W(t+1) - W(t)|_F of W_Q W_K^T and W_V, then each relative to |W(t)|_F.
CHANGES = ("routing_move", "value_move", "routing_change", "value_change")
#: Held-out sequences per seed (seeds seed + HELDOUT_OFFSET + i) and the validation sequence's seed offset.
N_HELDOUT, HELDOUT_OFFSET, VALIDATION_OFFSET = 4, 10000, 20000
#: The m_step arm's default ridge on W_V, chosen on the validation sequences (module docstring).
M_STEP_RIDGE = 3e-3
#: Named configurations of the CLI: the full run and the short toy run.
PRESETS = {"default": {"steps": 1000, "eval_every": 20}, "toy": {"steps": 100, "eval_every": 1}}
#: Held-out losses are evaluated at every one of the first EVAL_DENSE steps (fast arms move there).
EVAL_DENSE = 10
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


def eval_schedule(steps: int, every: int) -> np.ndarray:
    """The steps at which held-out losses are evaluated: 0 .. EVAL_DENSE, every ``every``-th, and the last."""
    pts = set(range(min(EVAL_DENSE, steps) + 1)) | set(range(0, steps + 1, every)) | {steps}
    return np.array(sorted(pts), dtype=np.int64)


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
            evals: EvalSet, schedule: Sequence[int], m_step_ridge: float = 0.0,
            tick: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Train one arm from W0: training metrics per step (steps + 1, len(METRICS)), held-out curves on the
    schedule, relative weight changes per step, the value trajectory's PCA and heat maps."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {', '.join(ARMS)}; got {arm!r}")
    model = Model(X, y, mu.shape[0], backend)
    W = {k: v.copy() for k, v in W0.items()}
    hist = np.empty((steps + 1, len(METRICS)))
    values = np.empty((steps + 1, mu.size // mu.shape[1] * D_V))
    change = np.empty((steps, 4))  # moves |dW|_F of routing and values, then relative to |W(t)|_F
    sched = {int(s): i for i, s in enumerate(schedule)}
    curve = np.empty((len(sched), evals.n_heldout + 3))  # held-out losses, validation loss, PC1, |rho|
    heat, skipped = {}, 0
    mu_t = mu.astype(X.dtype)
    for step in range(steps + 1):
        metrics, grads, Z = model.step(W, want_z=arm == "m_step")
        metrics["key_orth"] = key_orthogonality(mu_t @ W["W_K"])
        hist[step] = [metrics[m] for m in METRICS]
        values[step] = (mu_t @ W["W_V"]).ravel()
        if step in sched:
            curve[sched[step]] = evals.evaluate(W)
        if step in heat_steps:
            heat[step] = _heatmap(model, W)
        if step == steps:
            break
        route, wv = W["W_Q"].astype(np.float64) @ W["W_K"].T.astype(np.float64), W["W_V"]
        new_v = None
        if arm == "m_step":
            new_v, taken, _, _ = m_step(model, W, newton_damping, Z, ridge=m_step_ridge)
            skipped += not taken
        for name, g in grads.items():
            rate = lr * (value_lr_factor if arm == "value_lr" and name == "W_V" else 1.0)
            W[name] = W[name] - (rate * g).astype(W[name].dtype)
        if new_v is not None:
            W["W_V"] = new_v
        wv = wv.astype(np.float64)
        moves = (np.linalg.norm(W["W_Q"].astype(np.float64) @ W["W_K"].T.astype(np.float64) - route),
                 np.linalg.norm(W["W_V"].astype(np.float64) - wv))
        change[step] = (*moves, moves[0] / np.linalg.norm(route), moves[1] / np.linalg.norm(wv))
        tick()
    return {"hist": hist, "pca": _value_pca(values), "heat": heat, "skipped": skipped, "W": W, "curve": curve,
            "change": change}


class EvalSet:
    """The held-out sequences and the validation sequence of one seed, evaluated in one forward call.

    ``evaluate(W)`` returns (n_heldout + 3,): each held-out sequence's mean cross-entropy, the
    validation sequence's, and the value manifold (PC1 fraction, |rho|) on the first held-out
    sequence (:func:`~._attention_analysis.value_manifold`).
    """

    def __init__(self, seed: int, P: np.ndarray, T: int, mu: np.ndarray, n_heldout: int, dtype: str,
                 backend: str) -> None:
        seqs = [make_data(P, T, mu, np.random.default_rng(seed + HELDOUT_OFFSET + i)) for i in range(n_heldout)]
        seqs.append(make_data(P, T, mu, np.random.default_rng(seed + VALIDATION_OFFSET)))
        self.n_heldout = n_heldout
        self.X = np.stack([x for x, _ in seqs]).astype(dtype)
        self.evaluator = Evaluator(self.X, np.stack([t for _, t in seqs]), P.shape[0], backend)
        self.entropy = posterior_entropy(seqs[0][0], mu, stationary(P))

    def evaluate(self, W: dict[str, np.ndarray]) -> np.ndarray:
        losses = self.evaluator.losses(W)
        return np.array([*losses, *value_manifold(self.X[0] @ W["W_V"], self.entropy)])


def attention_dynamics(*, seeds: Sequence[int] = DEFAULT_SEEDS, arms: Sequence[str] = ARMS, steps: int = 1000,
                       T: int = 2000, n_symbols: int = 8, stay: float = 0.3, lr: float = 0.01,
                       value_lr_factor: float = 10.0, newton_damping: float = 1e-3,
                       m_step_ridge: float = M_STEP_RIDGE, n_heldout: int = N_HELDOUT, eval_every: int = 20,
                       mu_seed: int = 0, dtype: str = "float32", backend: str = "auto",
                       progress: Progress | None = None, workers: int = 1,
                       on_run: Callable[[int, str, dict[str, Any]], Any] | None = None,
                       done_runs: Mapping[tuple[int, str], dict[str, Any]] | None = None) -> AttentionDynamics:
    """Run the experiment (module docstring) and return its report.

    ``workers`` > 1 runs the seeds in that many worker processes (spawned), each with
    single-threaded BLAS and kernels (threadpoolctl, :func:`pyengine.set_num_threads`);
    every seed computes exactly what it computes serially (the kernels' results do not
    depend on the thread count), so the report is identical, only sooner.

    ``on_run(seed, arm, run)`` is called (in this process) as each (seed, arm) run finishes,
    with :func:`run_arm`'s dict (:mod:`._attention_runs` flattens it to arrays, bit for bit), so
    a caller can store every run as it ends; ``done_runs`` ((seed, arm) -> such a dict) are runs
    finished before (a resumed run): they are not computed again, and the report is the one an
    uninterrupted run gives.

    Ctrl-C (KeyboardInterrupt) stops it: the report of the seeds finished so far (every
    arm of each) is returned with ``interrupted = True``, ``missing`` (seed -> the arms that did
    not finish) and ``partial`` (the finished runs of the other seeds); if no seed has every arm
    finished, it re-raises (``on_run`` has seen every finished run).
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
    for name, v in (("workers", workers), ("n_heldout", n_heldout), ("eval_every", eval_every)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int; got {v!r}")
    if not m_step_ridge >= 0:
        raise ValueError(f"m_step_ridge must be >= 0; got {m_step_ridge!r}")
    cfg = {"seeds": list(seeds), "arms": list(arms), "steps": steps, "T": T, "n_symbols": n_symbols, "stay": stay,
           "lr": lr, "value_lr_factor": value_lr_factor, "newton_damping": newton_damping,
           "m_step_ridge": m_step_ridge, "n_heldout": n_heldout, "eval_every": eval_every,
           "heldout_seeds": f"seed + {HELDOUT_OFFSET} + i, i = 0 .. {n_heldout - 1}",
           "validation_seed": f"seed + {VALIDATION_OFFSET}", "mu_seed": mu_seed, "dtype": dtype,
           "backend": backend, "workers": workers}
    with threadpool_limits(1):  # the GEMMs are small: BLAS threads only contend with the kernel's
        return _run(cfg, progress, on_run, dict(done_runs or {}))


def run_seed(seed: int, arms: Sequence[str], cfg: dict[str, Any], tick: Callable[[str], None] = lambda label: None,
             on_arm: Callable[[str, dict[str, Any]], Any] | None = None) -> dict[str, dict[str, Any]]:
    """Every arm of one seed (data, init and the runs depend on the seed only): arm -> :func:`run_arm`'s dict;
    ``on_arm(arm, run)`` as each arm finishes."""
    n, T, steps, dtype, backend = cfg["n_symbols"], cfg["T"], cfg["steps"], cfg["dtype"], cfg["backend"]
    P = markov_chain(n, cfg["stay"])
    mu = np.random.default_rng(cfg["mu_seed"]).standard_normal((n, D_IN))
    rng = np.random.default_rng(seed)
    X, y = make_data(P, T, mu, rng)
    X = X.astype(dtype)
    W0 = init_params(rng, n, dtype)
    evals = EvalSet(seed, P, T, mu, cfg["n_heldout"], dtype, backend)
    kw = {k: cfg[k] for k in ("lr", "value_lr_factor", "newton_damping", "m_step_ridge")}
    out = {}
    for arm in arms:
        label = f"seed {seed} arm {arm}"
        out[arm] = run_arm(arm, X, y, mu, W0, steps=steps, heat_steps=sorted({0, steps // 10, steps}),
                           backend=backend, evals=evals, schedule=eval_schedule(steps, cfg["eval_every"]),
                           tick=lambda: tick(label), **kw)
        if on_arm is not None:
            on_arm(arm, out[arm])
    return out


def _run(cfg: dict[str, Any], progress: Progress | None, on_run: Callable[..., Any] | None,
         results: dict[tuple[int, str], dict[str, Any]]) -> AttentionDynamics:
    t0 = time.perf_counter()
    seeds, arms, steps, workers = cfg["seeds"], tuple(cfg["arms"]), cfg["steps"], cfg["workers"]
    P = markov_chain(cfg["n_symbols"], cfg["stay"])
    total = len(seeds) * len(arms) * steps
    done = [steps * sum((s, a) in results for s in seeds for a in arms)]

    def tick(label: str, n: int = 1) -> None:
        before, done[0] = done[0], done[0] + n
        if progress and (done[0] // 25 > before // 25 or done[0] == total):
            progress(done[0] / total, label)

    def record(seed: int, arm: str, run: dict[str, Any]) -> None:  # results first: Ctrl-C in on_run keeps it
        results[(seed, arm)] = run
        if on_run is not None:
            on_run(seed, arm, run)

    todo = [(s, a) for s in seeds for a in arms if (s, a) not in results]
    interrupted = False
    try:
        if workers > 1 and len(todo) > 1:
            from ._attention_pool import run_seeds

            run_seeds(run_seed, todo, cfg, workers, tick, record)
        else:
            for seed in dict.fromkeys(s for s, _ in todo):
                run_seed(seed, [a for s, a in todo if s == seed], cfg, tick=tick,
                         on_arm=lambda arm, run, seed=seed: record(seed, arm, run))
    except KeyboardInterrupt:
        interrupted = True
    missing = missing_arms(seeds, arms, results)
    finished = [s for s in seeds if s not in missing]
    if interrupted and not finished:
        raise KeyboardInterrupt
    runs = {a: [results[(s, a)] for s in finished] for a in arms}
    if progress:
        progress(1.0, "done")
    seconds = time.perf_counter() - t0
    n_steps = sum(k in results for k in todo) * steps  # the steps computed in this call
    nh = cfg["n_heldout"]

    def curves(rs: list) -> dict[str, np.ndarray]:
        c = np.stack([r["curve"] for r in rs])  # (seeds, schedule, nh + 3)
        return {"heldout_loss": c[:, :, :nh].mean(axis=2), "validation_loss": c[:, :, nh], "value_pc1": c[:, :, nh + 1],
                "value_rho": c[:, :, nh + 2], "heldout_each": c[:, :, :nh]}

    return AttentionDynamics(
        config=cfg, chain=P, effective_stay=float(np.mean(np.diag(P))), bayes_entropy=bayes_entropy(P),
        seeds=tuple(finished), arms=arms,
        metrics={a: {m: np.stack([r["hist"][:, i] for r in runs[a]]) for i, m in enumerate(METRICS)} for a in arms},
        schedule=eval_schedule(steps, cfg["eval_every"]),
        curves={a: curves(runs[a]) for a in arms},
        changes={a: {k: np.stack([r["change"][:, i] for r in runs[a]])
                     for i, k in enumerate(CHANGES)} for a in arms},
        value_pca={a: np.stack([r["pca"] for r in runs[a]]) for a in arms},
        heatmaps={a: runs[a][0]["heat"] for a in arms},
        m_step_skipped=np.array([r["skipped"] for r in runs.get("m_step", [])]),
        seconds={"total": seconds, "per_step_ms": 1e3 * seconds / max(n_steps, 1)},
        interrupted=interrupted, missing=missing,
        partial=[partial_summary(s, a, results[(s, a)], METRICS, nh) for s in missing for a in arms
                 if (s, a) in results],
    )
