"""Analyses of :mod:`pyengine.experiments.attention_dynamics`: attention entropy, key orthogonality, the
value manifold, the "frame before precision" timing, the paired interval and the verdict, and the
report object :class:`AttentionDynamics` that applies them (re-exported by ``attention_dynamics``).

Definitions (the experiment's report uses exactly these):

* **Attention entropy** of a row-stochastic alpha (T, T): the mean over rows i of
  -sum_j alpha_ij log alpha_ij (nats); the experiment takes it per step from the fused
  forward kernel's row entropies.
* **Key orthogonality** of keys K (n, d_k): the mean of |cos(k_a, k_b)| over the n (n - 1)
  ordered pairs a != b (the off-diagonal of the normalized Gram matrix); 0 for orthogonal
  keys, 1 for parallel ones. The experiment uses the 8 noise-free symbol keys mu_s W_K.
* **Value manifold**: for values V (T, d_v) of tokens whose latent state has posterior
  entropy h (T,), the fraction of variance on the first principal component of V and
  |corr(PC1 score, h)| (Pearson; the sign of PC1 is arbitrary). Token t's input is
  x_t = mu_{y_{t-1}} + eps_t, so the state it serves is y_{t-1}, with posterior
  p(s | x_t) proportional to pi_s exp(-|x_t - mu_s|^2 / 2) (the chain's stationary prior).
* **Settling step** of a weight from its per-step moves m(t) = |W(t+1) - W(t)|_F,
  t = 0 .. steps - 1: the first step s at which the path already travelled,
  sum_{t < s} m(t), reaches ``SETTLE_FRACTION`` (0.9) of the whole run's path sum_t m(t)
  (NaN if the weight never moved). It says when most of the motion is done, whatever the
  weight's scale; a weight still moving at a constant rate settles at about 0.9 x steps.
  Routing is the bilinear score form W_Q W_K^T (what the attention weights depend on,
  free of the W_Q, W_K gauge); values are W_V. "Frame before precision" holds on a run
  when routing settles before the values do. The report also prints the last step's
  relative move m(t) / |W(t)|_F: whether the weight is still moving at the end.
* **Paired interval**: the mean of per-seed differences and its two-sided 95 % Student-t
  interval, mean +- t_{0.975, n-1} sd / sqrt(n).
* **Verdict** on the claim "EM-style updates converge faster, both near the Bayes floor",
  per arm against gd, on held-out loss (:func:`claim_verdict`): "faster" reads the paired
  interval of the steps to gd's final held-out loss (arm - gd); "near the floor" reads the
  interval of each arm's final held-out excess over the floor against ``NEAR_FRACTION``
  (0.1) of the gap from the uniform predictor down to the floor (0.025 nats for the
  default chain). SUPPORTED needs every part supported, CONTRADICTED any part
  contradicted; otherwise NOT RESOLVED.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["AttentionDynamics", "attention_entropy", "claim_verdict", "key_orthogonality", "paired_interval", "posterior_entropy",
           "settle_step", "value_manifold"]

#: Fraction of a weight's path over the run after which it counts as settled (module docstring).
SETTLE_FRACTION = 0.9
#: "Near the Bayes floor": a final held-out loss whose excess over the floor is at most this
#: fraction of the gap from the uniform predictor (log n) down to the floor.
NEAR_FRACTION = 0.1


def attention_entropy(alpha: np.ndarray) -> float:
    """Mean row entropy (nats) of a row-stochastic matrix alpha (..., T, T), zeros allowed."""
    a = np.asarray(alpha, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(a > 0, a * np.log(a), 0.0).sum(axis=-1)
    return float(h.mean())


def key_orthogonality(K: np.ndarray) -> float:
    """Mean |off-diagonal cosine| of the rows of K (n, d), n >= 2; zero rows are refused."""
    K = np.asarray(K, dtype=np.float64)
    n = K.shape[0]
    if n < 2:
        raise ValueError(f"K needs at least 2 rows; got shape {K.shape}")
    norms = np.linalg.norm(K, axis=1)
    if not (norms > 0).all():
        raise ValueError("K has a zero row: its cosine is undefined")
    U = K / norms[:, None]
    c = np.abs(U @ U.T)
    return float((c.sum() - np.trace(c)) / (n * (n - 1)))


def posterior_entropy(X: np.ndarray, mu: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """Entropy (nats, (T,)) of p(s | x_t) proportional to prior_s exp(-|x_t - mu_s|^2 / 2), X (T, d), mu (n, d)."""
    X = np.asarray(X, dtype=np.float64)
    d2 = ((X[:, None, :] - mu[None, :, :]) ** 2).sum(axis=2)
    logw = np.log(prior)[None, :] - 0.5 * d2
    logw -= logw.max(axis=1, keepdims=True)
    logp = logw - np.log(np.exp(logw).sum(axis=1, keepdims=True))
    return -(np.exp(logp) * logp).sum(axis=1)


def value_manifold(V: np.ndarray, h: np.ndarray) -> tuple[float, float]:
    """(fraction of variance on PC1 of V (T, d), |Pearson corr(PC1 score, h)|); NaN where undefined."""
    V = np.asarray(V, dtype=np.float64)
    c = V - V.mean(axis=0)
    _, s, vt = np.linalg.svd(c, full_matrices=False)
    tot = float((s ** 2).sum())
    if tot <= 0:
        return float("nan"), float("nan")
    score = c @ vt[0]
    if score.std() == 0 or np.std(h) == 0:
        return float(s[0] ** 2 / tot), float("nan")
    return float(s[0] ** 2 / tot), float(abs(np.corrcoef(score, h)[0, 1]))


def settle_step(moves: np.ndarray, fraction: float = SETTLE_FRACTION) -> float:
    """First step s with sum(moves[:s]) >= fraction * sum(moves) (moves: (steps,), >= 0); NaN if all are 0."""
    m = np.asarray(moves, dtype=np.float64)
    total = float(m.sum())
    if not total > 0:
        return float("nan")
    cum = np.cumsum(m)
    return float(np.searchsorted(cum, fraction * total * (1 - 1e-12)) + 1)


def paired_interval(diff: np.ndarray, level: float = 0.95) -> dict[str, float]:
    """Mean of the paired differences diff (n,) and its two-sided Student-t interval (NaN bounds for n < 2)."""
    d = np.asarray(diff, dtype=np.float64)
    n = d.size
    mean = float(d.mean()) if n else float("nan")
    if n < 2:
        return {"mean": mean, "lo": float("nan"), "hi": float("nan"), "n": n}
    from scipy import stats  # here, not at import: the worker processes never need scipy.stats

    half = float(stats.t.ppf(0.5 + level / 2, n - 1) * d.std(ddof=1) / math.sqrt(n))
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n}


def _sign(iv: Mapping[str, float]) -> int:
    """-1: the interval lies below 0; +1: above 0; 0: it contains 0 or is undefined."""
    if iv["hi"] < 0:
        return -1
    if iv["lo"] > 0:
        return 1
    return 0


def claim_verdict(steps_diff: np.ndarray, reached: np.ndarray, excess: Mapping[str, np.ndarray],
                  near_tol: float) -> tuple[str, str]:
    """The claim "this arm converges faster than gd, both near the Bayes floor", from measured data.

    Parameters
    ----------
    steps_diff : (n_seeds,) float
        Per seed, the arm's steps to gd's final held-out loss minus gd's; where the arm never
        reached it (``reached`` False) the arm's value is the run length, a lower bound.
    reached : (n_seeds,) bool
    excess : {"arm": (n_seeds,), "gd": (n_seeds,)}
        Final held-out loss minus the Bayes floor.
    near_tol : float
        The largest excess that counts as near the floor.

    Returns
    -------
    (verdict, reason): SUPPORTED when every seed reached, the step difference's 95 % interval
    lies below 0 and both arms' excess intervals lie below ``near_tol``; CONTRADICTED when no
    seed reached, the step interval lies above 0 (censored values only raise it), or an
    excess interval lies above ``near_tol``; NOT RESOLVED otherwise. The reason states the
    speed part, then the floor part.
    """
    iv = paired_interval(steps_diff)
    if not np.any(reached):
        speed = (1, "it never reaches gd's final held-out loss")
    elif _sign(iv) > 0:
        speed = (1, "it needs more steps than gd")
    elif np.all(reached) and _sign(iv) < 0:
        speed = (-1, "faster than gd")
    elif not np.all(reached):
        speed = (0, f"it reaches gd's final held-out loss on {int(np.sum(reached))}/{len(reached)} seeds")
    else:
        speed = (0, "the step interval contains 0")
    near = {k: _sign(paired_interval(np.asarray(v) - near_tol)) for k, v in excess.items()}
    far = [k for k, s in near.items() if s > 0]
    unsure = [k for k, s in near.items() if s == 0]
    if far:
        floor = (1, f"{' and '.join(far)} stay{'s' if len(far) == 1 else ''} far above the floor")
    elif unsure:
        floor = (0, f"nearness to the floor unresolved for {' and '.join(unsure)}")
    else:
        floor = (-1, "both near the floor")
    parts = (speed[0], floor[0])
    verdict = "CONTRADICTED" if 1 in parts else "SUPPORTED" if parts == (-1, -1) else "NOT RESOLVED"
    return verdict, f"{speed[1]}; {floor[1]}"


@dataclasses.dataclass
class AttentionDynamics:
    """The report of :func:`attention_dynamics`.

    ``metrics``: training-sequence metrics per step, arm -> name -> (n_seeds, steps + 1);
    ``curves``: on the evaluation ``schedule``, arm -> name -> (n_seeds, len(schedule)) for
    ``heldout_loss`` (the mean over the held-out sequences), ``validation_loss``,
    ``value_pc1`` and ``value_rho``, and ``heldout_each`` (n_seeds, len(schedule), n_heldout);
    ``changes``: arm -> name of :data:`CHANGES` -> (n_seeds, steps). An interrupted run
    (``interrupted``) holds the seeds whose every arm finished; ``missing``: seed -> the arms
    that did not finish; ``partial``: the finished runs of those seeds, one dict each
    (:func:`~._attention_runs.partial_summary`).
    """

    config: dict[str, Any]
    chain: np.ndarray
    effective_stay: float
    bayes_entropy: float
    seeds: tuple[int, ...]
    arms: tuple[str, ...]
    metrics: dict[str, dict[str, np.ndarray]]
    schedule: np.ndarray
    curves: dict[str, dict[str, np.ndarray]]
    changes: dict[str, dict[str, np.ndarray]]
    value_pca: dict[str, np.ndarray]  # arm -> (n_seeds, 2): variance explained by PC1, PC2
    heatmaps: dict[str, dict[int, np.ndarray]]  # arm -> step -> (HEATMAP_TOKENS,)*2, first seed
    m_step_skipped: np.ndarray  # (n_seeds,)
    seconds: dict[str, float]
    interrupted: bool = False
    missing: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    partial: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def missing_runs(self) -> str:
        """One line: the runs an interrupted report lacks, seed by seed, with the finished runs of
        those seeds ("" when none is missing)."""
        if not self.missing:
            return ""
        done = {(p["seed"], p["arm"]) for p in self.partial}
        parts = []
        for s, arms in self.missing.items():
            have = [a for a in self.arms if (s, a) in done]
            parts.append(f"seed {s}: {', '.join(arms)}" + (f" (finished: {', '.join(have)})" if have else ""))
        return f"missing runs: {'; '.join(parts)}"

    def train_curve(self, arm: str) -> np.ndarray:
        """The training loss on the schedule, (n_seeds, len(schedule))."""
        return self.metrics[arm]["loss"][:, self.schedule]

    def final(self, arm: str, metric: str = "heldout_loss") -> np.ndarray:
        """Per seed, the last step's value: a curve (``heldout_loss``, ...), ``train_loss`` or a training metric."""
        if metric in self.curves[arm]:
            return self.curves[arm][metric][:, -1]
        return self.metrics[arm]["loss" if metric == "train_loss" else metric][:, -1]

    def steps_to_gd_final(self, arm: str) -> np.ndarray:
        """Per seed, the first scheduled step at which ``arm``'s held-out loss is <= gd's final held-out loss (NaN: never)."""
        target = self.final("gd")
        loss = self.curves[arm]["heldout_loss"]
        out = np.full(loss.shape[0], np.nan)
        for s in range(loss.shape[0]):
            hit = np.flatnonzero(loss[s] <= target[s] + 1e-12)
            out[s] = self.schedule[hit[0]] if hit.size else np.nan
        return out

    def paired(self, arm: str) -> dict[str, Any]:
        """Paired comparison with gd over seeds (see :func:`~._attention_analysis.paired_interval`).

        ``heldout``: final held-out loss, arm - gd; ``steps``: steps to gd's final held-out loss,
        arm - gd, with the run length standing in where the arm never reached it (``reached``).
        """
        steps, gd_steps = self.steps_to_gd_final(arm), self.steps_to_gd_final("gd")
        reached = np.isfinite(steps)
        diff = self.final(arm) - self.final("gd")
        return {"heldout": paired_interval(diff), "wins": int((diff < 0).sum()), "n": int(diff.size),
                "steps": paired_interval(np.where(reached, steps, self.config["steps"]) - gd_steps),
                "reached": reached}

    def below_floor(self, arm: str) -> np.ndarray:
        """Per seed, the smallest training loss over the run; below the Bayes floor means the sample was fitted."""
        return self.metrics[arm]["loss"].min(axis=1)

    def settle(self, arm: str, fraction: float = SETTLE_FRACTION) -> dict[str, np.ndarray]:
        """Per seed, the settling steps of routing and values (:func:`~._attention_analysis.settle_step`)."""
        ch = self.changes[arm]
        return {k: np.array([settle_step(m, fraction) for m in ch[f"{k}_move"]]) for k in ("routing", "value")}

    def verdicts(self) -> dict[str, tuple[str, str]]:
        """Per non-gd arm: (verdict, reason) on "converges faster than gd, both near the Bayes floor"."""
        n = self.config["n_symbols"]
        tol = NEAR_FRACTION * (math.log(n) - self.bayes_entropy)
        out = {}
        for arm in self.arms:
            if arm != "gd":
                pair = self.paired(arm)
                steps = self.steps_to_gd_final(arm)
                diff = np.where(pair["reached"], steps, self.config["steps"]) - self.steps_to_gd_final("gd")
                excess = {arm: self.final(arm) - self.bayes_entropy, "gd": self.final("gd") - self.bayes_entropy}
                out[arm] = claim_verdict(diff, pair["reached"], excess, tol)
        return out
