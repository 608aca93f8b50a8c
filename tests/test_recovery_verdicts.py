"""The recovery verdicts: decide's table, and each verdict of each prediction driven by
constructed rates and intervals (SUPPORTED, CONTRADICTED, NOT RESOLVED)."""

import dataclasses
import math

import numpy as np
import pytest

import pyengine as pe
from pyengine.experiments import recovery
from pyengine.experiments._recovery_verdicts import CONTRADICTED, NOT_RESOLVED, SUPPORTED, decide
from pyengine.experiments.recovery import _verdicts

NAN = math.nan


@pytest.mark.parametrize("lo, hi, predicted, margin, want", [
    (0.1, 0.3, ">", 0, SUPPORTED), (-0.3, -0.1, ">", 0, CONTRADICTED), (-0.1, 0.2, ">", 0, NOT_RESOLVED),
    (0.0, 0.2, ">", 0, NOT_RESOLVED),  # an interval that reaches 0 holds the alternative
    (-0.3, -0.1, "<", 0, SUPPORTED), (0.1, 0.3, "<", 0, CONTRADICTED), (-0.1, 0.1, "<", 0, NOT_RESOLVED),
    (-0.04, 0.03, "=", 0.05, SUPPORTED), (0.06, 0.2, "=", 0.05, CONTRADICTED), (-0.2, -0.06, "=", 0.05, CONTRADICTED),
    (0.0, 0.1, "=", 0.05, NOT_RESOLVED), (-1.0, 1.0, "=", 0.05, NOT_RESOLVED),
    (0.03, 0.2, "!=", 0.02, SUPPORTED), (-0.2, -0.03, "!=", 0.02, SUPPORTED), (-0.01, 0.01, "!=", 0.02, CONTRADICTED),
    (0.0, 0.1, "!=", 0.02, NOT_RESOLVED),
    (NAN, 0.2, ">", 0, NOT_RESOLVED), (0.1, math.inf, ">", 0, NOT_RESOLVED), (NAN, NAN, "=", 0.1, NOT_RESOLVED),
])
def test_decide_follows_its_table(lo, hi, predicted, margin, want):
    assert decide(lo, hi, predicted, margin) == want


def test_decide_bad_arguments():
    with pytest.raises(ValueError, match="predicted must be one of"):
        decide(0.0, 1.0, "greater")
    with pytest.raises(ValueError, match="margin must be >= 0"):
        decide(0.0, 1.0, "=", -0.1)
    with pytest.raises(ValueError, match="lo <= hi"):
        decide(1.0, 0.0, ">")


def _fit(rate, half=0.02, n=10):
    return pe.DecayFit(rate, (rate - half, rate + half), 0.99, math.inf, 0.0, n)


@pytest.fixture(scope="module")
def rep():
    cfg = pe.StackConfig(d_model=16, n_heads=4, n_layers=6, d_mlp=32, vocab_size=256, max_seq_len=64)
    st = pe.init_weights(cfg, seed=0, dtype=np.float64, gamma_jitter=0.3, bias_std=0.1)
    return recovery(st, ids=np.arange(20, 32), layer=0, scales=[0.1], n_directions=2, eps_values=[1e-5, 1e-3],
                    gamma_values=[0.5, 1.0])


def _heads(rep, **changes):
    return [line.split(":")[1].strip().split(" (")[0] for line in _verdicts(dataclasses.replace(rep, **changes))]


def test_residual_verdict_reads_the_sign(rep):
    """(2) predicts a faster decay without the residual: growth without it contradicts it."""
    smollm2 = _heads(rep, fit_exact=_fit(0.033), no_residual=_fit(-0.132))  # SmolLM2, "The capital of France..."
    assert smollm2[1] == CONTRADICTED
    line = _verdicts(dataclasses.replace(rep, fit_exact=_fit(0.033), no_residual=_fit(-0.132)))[1]
    assert "without it the perturbation grows" in line and "difference -0.165, interval [-0.205, -0.125]" in line
    assert _heads(rep, fit_exact=_fit(0.033), no_residual=_fit(0.3))[1] == SUPPORTED
    assert _heads(rep, fit_exact=_fit(0.033), no_residual=_fit(0.05))[1] == NOT_RESOLVED  # intervals overlap
    assert _heads(rep, fit_exact=_fit(0.0), no_residual=_fit(-0.03))[1] == NOT_RESOLVED
    short = pe.DecayFit(NAN, (NAN, NAN), NAN, NAN, NAN, 1)
    assert _verdicts(dataclasses.replace(rep, no_residual=short))[1].startswith("(2) residual: NOT RESOLVED (a fit")


def test_spectra_verdict_against_its_margin(rep):
    pred = float(-np.log(rep.rho.max(axis=1)).mean())
    tol = 0.05 + 0.25 * abs(pred)
    assert _heads(rep, fit_exact=_fit(pred, half=0.01))[0] == SUPPORTED
    assert _heads(rep, fit_exact=_fit(pred + tol + 0.05, half=0.01))[0] == CONTRADICTED
    assert _heads(rep, fit_exact=_fit(pred - tol - 0.05, half=0.01))[0] == CONTRADICTED
    assert _heads(rep, fit_exact=_fit(pred, half=0.5))[0] == NOT_RESOLVED  # too wide to tell
    assert _heads(rep, fit_exact=_fit(pred + tol, half=0.01))[0] == NOT_RESOLVED  # on the margin's edge
    line = _verdicts(dataclasses.replace(rep, fit_exact=_fit(pred, half=0.01)))[0]
    assert "gain along v" in line and "sigma_max" in line and "rho(A_k) >= 1" in line


def test_spectra_skipped_is_not_resolved(rep):
    empty = np.empty((0, 1))
    line = _verdicts(dataclasses.replace(rep, spectra_skipped=True, rho=empty, sigma=empty, ones_residual=empty))[0]
    assert line.startswith("(1) spectra: NOT RESOLVED (spectra skipped)")


def test_sweep_verdicts(rep):
    """(3) predicts the norm parameter sets the rate: two values whose rates separate by > 0.02."""
    heads = _heads(rep, eps_sweep=[(1e-5, _fit(0.0)), (1e-2, _fit(0.01)), (1.0, _fit(0.3))],
                   gamma_sweep=[(0.5, _fit(0.0, 0.002)), (1.0, _fit(0.001, 0.002)), (2.0, _fit(-0.002, 0.002))])
    assert heads[2:4] == [SUPPORTED, CONTRADICTED]
    heads = _heads(rep, eps_sweep=[(1e-5, _fit(0.0)), (1.0, _fit(0.03))],
                   gamma_sweep=[(1.0, _fit(0.0))])  # overlapping; one value only
    assert heads[2:4] == [NOT_RESOLVED, NOT_RESOLVED]
    line = _verdicts(dataclasses.replace(rep, eps_sweep=[(1e-5, _fit(0.0)), (1e-2, _fit(0.01)), (1.0, _fit(0.3))]))[2]
    assert "rate at 1 - at 1e-05 = +0.300, interval [+0.260, +0.340]" in line


def test_every_verdict_is_one_of_three(rep):
    for line in rep.verdicts[:4]:
        head = line.split(":")[1].strip()
        assert head.startswith((SUPPORTED, CONTRADICTED, NOT_RESOLVED)), line
    assert rep.protocol.startswith("protocol: one sequence of 12 tokens, in-sample")
    assert "2 random directions seeded by seed 0" in rep.protocol and "95 % Student t" in rep.protocol
