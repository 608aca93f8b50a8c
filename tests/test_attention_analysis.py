"""The attention-dynamics analyses against independent computations (dense NumPy, SciPy, loops),
and every verdict and flag of the report driven by constructed data."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from pyengine.experiments import AttentionDynamics, format_attention_table, write_attention_report
from pyengine.experiments._attention_analysis import (
    attention_entropy,
    claim_verdict,
    key_orthogonality,
    paired_interval,
    posterior_entropy,
    settle_step,
    value_manifold,
)
from pyengine.experiments._attention_report import verdict_line
from pyengine.experiments.attention_dynamics import (
    CHANGES,
    METRICS,
    Model,
    bayes_entropy,
    eval_schedule,
    init_params,
    make_data,
    markov_chain,
)


def _dense_alpha(X, W):
    s = (X @ W["W_Q"]) @ (X @ W["W_K"]).T / math.sqrt(W["W_Q"].shape[1])
    s = np.where(np.tril(np.ones(s.shape, bool)), s, -np.inf)
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_attention_entropy_on_constructed_matrices_and_the_training_metric(backend):
    T = 6
    uniform = np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]  # causal uniform: row i has entropy log(i+1)
    assert abs(attention_entropy(uniform) - np.mean(np.log(np.arange(1, T + 1)))) < 1e-15
    assert attention_entropy(np.eye(T)) == 0.0
    rng = np.random.default_rng(0)
    X, y = make_data(markov_chain(), 50, rng.standard_normal((8, 20)), rng)
    W = {k: 5 * v for k, v in init_params(rng, 8, "float64").items()}  # peaked rows, not uniform
    alpha = _dense_alpha(X, W)
    direct = float(np.mean([-sum(a * math.log(a) for a in row if a > 0) for row in alpha]))
    assert abs(attention_entropy(alpha) - direct) < 1e-12
    metric = Model(X, y, 8, backend).step(W)[0]["attn_entropy"]
    assert abs(metric - direct) < 1e-10 and direct < attention_entropy(np.tril(np.ones((50, 50))) /
                                                                     np.arange(1, 51)[:, None])


def test_key_orthogonality_against_a_loop():
    assert key_orthogonality(np.eye(4, 6)) == 0.0
    assert abs(key_orthogonality(np.outer([1.0, -2.0, 3.0], [1.0, 2.0])) - 1.0) < 1e-15  # parallel, any sign
    K = np.random.default_rng(1).standard_normal((8, 10))
    loop = [abs(K[a] @ K[b]) / np.linalg.norm(K[a]) / np.linalg.norm(K[b]) for a in range(8) for b in range(8) if a != b]
    assert abs(key_orthogonality(K) - np.mean(loop)) < 1e-14
    with pytest.raises(ValueError, match="zero row"):
        key_orthogonality(np.array([[1.0, 0.0], [0.0, 0.0]]))


def test_posterior_entropy_is_bayes_rule_with_scipy_densities():
    rng = np.random.default_rng(2)
    mu, X = rng.standard_normal((4, 3)), rng.standard_normal((7, 3)) * 2
    prior = np.array([0.1, 0.2, 0.3, 0.4])
    like = np.stack([stats.multivariate_normal(m, np.eye(3)).pdf(X) for m in mu], axis=1) * prior
    post = like / like.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(posterior_entropy(X, mu, prior), stats.entropy(post, axis=1), rtol=1e-12)


def test_value_manifold_against_the_covariance_eigendecomposition():
    rng = np.random.default_rng(3)
    h = rng.random(500)
    V = np.outer(h, rng.standard_normal(15)) + 0.3 * rng.standard_normal((500, 15))
    frac, rho = value_manifold(V, h)
    evals, evecs = np.linalg.eigh(np.cov(V.T))
    score = (V - V.mean(axis=0)) @ evecs[:, -1]
    assert abs(frac - evals[-1] / evals.sum()) < 1e-12
    assert abs(rho - abs(stats.pearsonr(score, h)[0])) < 1e-12 and rho > 0.9
    _, rho_noise = value_manifold(rng.standard_normal((500, 15)), h)  # values that ignore h
    assert rho_noise < 0.2


def test_settle_step_on_constructed_moves():
    moves = np.array([8.0, 0.5, 0.5, 0.5, 0.25, 0.25])  # path 10: 90 % (9) covered after the moves of steps 0-2
    assert settle_step(moves) == 3.0
    assert settle_step(np.full(100, 0.3)) == 90.0  # a constant rate settles at 0.9 x steps
    assert settle_step(np.array([0.0, 0.0, 5.0])) == 3.0 and settle_step(moves, fraction=0.5) == 1.0
    assert math.isnan(settle_step(np.zeros(4)))  # never moved


def test_paired_interval_is_scipy_one_sample_t():
    d = np.array([-0.3, -0.1, -0.25, 0.05, -0.2])
    iv = paired_interval(d)
    ci = stats.ttest_1samp(d, 0.0).confidence_interval(0.95)
    assert abs(iv["lo"] - ci.low) < 1e-12 and abs(iv["hi"] - ci.high) < 1e-12 and iv["n"] == 5
    assert math.isnan(paired_interval(np.array([1.0]))["lo"])


TOL = 0.025
NEAR = {"arm": np.array([0.01, 0.012, 0.008, 0.011, 0.009]), "gd": np.array([0.012, 0.01, 0.011, 0.013, 0.01])}
FAR = {"arm": NEAR["arm"] + 0.2, "gd": NEAR["gd"]}


@pytest.mark.parametrize("diff, reached, excess, want", [
    ([-500, -480, -520, -510, -490], [True] * 5, NEAR, ("SUPPORTED", "faster than gd; both near the floor")),
    ([300, 280, 320, 310, 290], [True] * 5, NEAR, ("CONTRADICTED", "more steps")),
    ([0, 0, 0, 0, 0], [False] * 5, NEAR, ("CONTRADICTED", "never reaches")),
    ([-500, -480, -520, -510, -490], [True] * 5, FAR, ("CONTRADICTED", "faster than gd; arm stays far")),
    ([-500, 480, -520, 510, -490], [True] * 5, NEAR, ("NOT RESOLVED", "contains 0")),
    ([-500, -480, -520, -510, 0], [True] * 4 + [False], NEAR, ("NOT RESOLVED", "on 4/5 seeds")),
    ([-500, -480, -520, -510, -490], [True] * 5, {"arm": np.array([0.01, 0.05, 0.0, 0.04, 0.02]), "gd": NEAR["gd"]},
     ("NOT RESOLVED", "unresolved for arm")),
], ids=["faster-near", "slower", "never", "far", "steps-unsure", "censored", "near-unsure"])
def test_claim_verdict_from_constructed_data(diff, reached, excess, want):
    verdict, reason = claim_verdict(np.array(diff, float), np.array(reached), excess, TOL)
    assert verdict == want[0] and want[1] in reason, (verdict, reason)


def fake_report(heldout, train, steps=100, every=10):
    """An AttentionDynamics from constructed curves: heldout[arm] (n_seeds, len(schedule)), train[arm] (n_seeds, steps + 1)."""
    sched = eval_schedule(steps, every)
    P = markov_chain()
    arms = tuple(heldout)
    n = next(iter(heldout.values())).shape[0]
    cfg = {"seeds": list(range(n)), "arms": list(arms), "steps": steps, "T": 2000, "n_symbols": 8, "stay": 0.3,
           "m_step_ridge": 0.0, "n_heldout": 4, "eval_every": every, "heldout_seeds": "seed + 10000 + i",
           "validation_seed": "seed + 20000", "dtype": "float64"}
    ones = np.ones((n, steps + 1))
    change = np.geomspace(1, 1e-6, steps)[None].repeat(n, 0)
    return AttentionDynamics(
        config=cfg, chain=P, effective_stay=0.35, bayes_entropy=bayes_entropy(P), seeds=tuple(range(n)), arms=arms,
        metrics={a: {m: (train[a] if m == "loss" else 0.5 * ones) for m in METRICS} for a in arms}, schedule=sched,
        curves={a: {"heldout_loss": heldout[a], "validation_loss": heldout[a], "value_pc1": heldout[a] * 0 + 0.5,
                    "value_rho": heldout[a] * 0 + 0.5, "heldout_each": heldout[a][:, :, None].repeat(4, 2)}
                for a in arms},
        changes={a: {k: change for k in CHANGES} for a in arms},
        value_pca={a: np.full((n, 2), 0.5) for a in arms}, heatmaps={a: {} for a in arms},
        m_step_skipped=np.zeros(0), seconds={"total": 1.0, "per_step_ms": 1.0})


def _curve(start, end, n_sched, n_seeds=5, jitter=0.0):
    rng = np.random.default_rng(int(1000 * start + 100 * end))
    base = np.linspace(start, end, n_sched)[None] + jitter * rng.standard_normal((n_seeds, 1))
    return base


def test_report_flags_an_arm_below_the_floor_and_writes_the_json_keys(tmp_path):
    floor = bayes_entropy(markov_chain())
    n_sched = eval_schedule(100, 10).size
    heldout = {"gd": _curve(2.08, 1.90, n_sched, jitter=1e-3), "m_step": _curve(2.08, 2.40, n_sched, jitter=1e-3)}
    train = {"gd": np.linspace(2.08, 1.89, 101)[None].repeat(5, 0),
             "m_step": np.linspace(2.08, floor - 0.03, 101)[None].repeat(5, 0)}
    rep = fake_report(heldout, train)
    text = format_attention_table(rep)
    flags = [ln for ln in text.splitlines() if ln.startswith("FLAG")]
    assert len(flags) == 1 and flags[0].startswith("FLAG m_step") and "5/5 seeds" in flags[0]
    assert "fits the sample" in flags[0] and "population quantity" in flags[0]
    assert text.splitlines()[1].startswith("protocol: ") and "held-out" in text.splitlines()[1]
    assert "m_step ridge 0: set by the caller" in text.splitlines()[1]
    assert "m_step: CONTRADICTED (it never reaches" in text and "no arm reaches a lower final held-out loss" in text
    write_attention_report(rep, str(tmp_path), plots=False)
    data = json.loads((tmp_path / "attention.json").read_text())
    for arm in ("gd", "m_step"):
        np.testing.assert_allclose(data["final"][arm]["heldout_loss"], heldout[arm][:, -1])
        np.testing.assert_allclose(data["final"][arm]["train_loss"], train[arm][:, -1])
        assert data["curves"][arm]["steps"] == eval_schedule(100, 10).tolist()
        np.testing.assert_allclose(data["curves"][arm]["heldout_loss"], heldout[arm])
        np.testing.assert_allclose(data["curves"][arm]["train_loss"], train[arm][:, eval_schedule(100, 10)])
    assert data["below_floor"]["m_step"]["flagged"] and not data["below_floor"]["gd"]["flagged"]
    assert abs(data["bayes_entropy"] - floor) < 1e-12


def test_verdict_line_names_the_first_arm_and_its_interval():
    n_sched = eval_schedule(100, 10).size
    floor = bayes_entropy(markov_chain())
    near = floor + 0.01
    gd = np.linspace(2.0, near, n_sched)[None].repeat(5, 0) + np.arange(5)[:, None] * 1e-4
    fast = np.concatenate([np.linspace(2.0, near - 0.002, 4), np.full(n_sched - 4, near - 0.002)])[None].repeat(5, 0)
    fast[:, 3] += np.arange(5) * 1e-3  # seeds 1-4 reach gd's final loss one evaluation later: a spread
    train = np.linspace(2.0, near, 101)[None].repeat(5, 0)
    rep = fake_report({"gd": gd, "value_lr": fast}, {"gd": train, "value_lr": train})
    line = verdict_line(rep)
    assert line.startswith("verdict: value_lr reaches gd's final held-out loss first (5/5 seeds)")
    assert "value_lr: SUPPORTED" in line and "lower final held-out loss than gd: value_lr" in line
    p = rep.paired("value_lr")["steps"]
    assert p["hi"] < 0 and f"difference {p['mean']:+.0f} [{p['lo']:+.0f}, {p['hi']:+.0f}] steps" in line
    slow = np.concatenate([np.full(n_sched - 2, 2.0), [near + 0.05, near]])[None].repeat(5, 0)
    slow[:, -2] -= np.arange(5) * 0.02  # seeds reach it at the second-to-last or the last evaluation
    rep = fake_report({"gd": gd, "m_step": slow + 0.05, "value_lr": slow}, {a: train for a in ("gd", "m_step", "value_lr")})
    line = verdict_line(rep)
    assert "m_step: CONTRADICTED (it never reaches" in line and "value_lr: NOT RESOLVED" in line
    assert line.startswith("verdict: value_lr reaches gd's final held-out loss first")
