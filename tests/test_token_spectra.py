"""pyengine.analysis.token_spectra: rho and sigma_max of the per-token diagonal Jacobian blocks,
matrix-free (TokenJacobian + Lanczos / power / Arnoldi) against the dense path, directly and
through the spectra stage of the recovery experiment."""

from __future__ import annotations

import functools
import importlib

import numpy as np
import pytest

import pyengine as pe
from pyengine.analysis import token_jacobians
from pyengine.analysis import token_spectra as ts
from pyengine.analysis.token_spectra import DENSE_MAX_D, TokenJacobian, token_jacobian_spectra
from pyengine.experiments import recovery

TOKS = [2, 5, 9]


def _stack(d, **kw):
    base = dict(d_model=d, n_heads=4, n_layers=2, d_mlp=2 * d, vocab_size=256, max_seq_len=16)
    base.update(kw)
    return pe.init_weights(pe.StackConfig(**base), "xavier", seed=3, dtype=np.float64, gamma_jitter=0.3,
                           bias_std=0.1)


IDS = np.arange(10) * 7 % 256


def _h(st, k=1):
    return st.hidden_states(IDS, dtype=np.float64)[k]


@pytest.mark.parametrize("kw", [dict(), dict(norm="rmsnorm", positions="rotary"), dict(layout="parallel")],
                         ids=["pre-ln", "rms-rotary", "parallel"])
def test_operator_is_the_formed_diagonal_blocks(kw):
    st = _stack(16, **kw)
    h = _h(st)
    A = token_jacobians(st, h, 1, TOKS)
    op = TokenJacobian(st, h, 1, TOKS)
    rng = np.random.default_rng(0)
    V, U = rng.standard_normal((2, 3, 16))
    np.testing.assert_allclose(op.matvec(V), np.einsum("rij,rj->ri", A, V), rtol=0, atol=1e-12)
    np.testing.assert_allclose(op.rmatvec(U), np.einsum("rji,rj->ri", A, U), rtol=0, atol=1e-12)
    one = op.take([1])  # batch 1: every row is a tangent of that token, not only the first
    W = rng.standard_normal((4, 16))
    np.testing.assert_allclose(one.matvec(W), W @ A[1].T, rtol=0, atol=1e-12)
    np.testing.assert_allclose(one.rmatvec(W), W @ A[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("d", [16, 32, 64])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_matrix_free_agrees_with_dense(d, norm):
    st = _stack(d, norm=norm)
    for k in (0, 1):
        h = _h(st, k)
        dense = token_jacobian_spectra(st, h, k, TOKS, method="dense")
        free = token_jacobian_spectra(st, h, k, TOKS, method="matrix_free")
        assert set(dense.norm.method) == set(dense.radius.method) == {"dense"} and dense.converged.all()
        assert set(free.norm.method) == {"lanczos"} and set(free.radius.method) <= {"power", "arnoldi"}
        assert free.converged.all() and (free.norm.residual <= free.norm.tol).all()
        # Lanczos on A^T A: sigma's error is second order in the residual test (tol 1e-6);
        # rho's is first order in its residual (tol 1e-8) times the eigenvalue's condition.
        np.testing.assert_allclose(free.sigma, dense.sigma, rtol=1e-9)
        np.testing.assert_allclose(free.rho, dense.rho, rtol=1e-6)
        np.testing.assert_allclose(free.ones_residual, dense.ones_residual, rtol=0, atol=1e-12)
        want = token_jacobians(st, h, k, TOKS)
        np.testing.assert_array_equal(dense.rho, [np.abs(np.linalg.eigvals(a)).max() for a in want])
        np.testing.assert_array_equal(dense.sigma, [np.linalg.norm(a, 2) for a in want])


def test_auto_picks_dense_up_to_the_threshold(monkeypatch):
    st = _stack(16)
    assert set(token_jacobian_spectra(st, _h(st), 1, TOKS).norm.method) == {"dense"}
    monkeypatch.setattr(ts, "DENSE_MAX_D", 8)
    assert set(token_jacobian_spectra(st, _h(st), 1, TOKS).norm.method) == {"lanczos"}
    assert DENSE_MAX_D >= 768  # GPT-2-sized blocks keep the exact dense answer


def test_tiny_max_iter_is_flagged_not_converged():
    st = _stack(64)
    res = token_jacobian_spectra(st, _h(st), 1, TOKS, method="matrix_free", max_iter=1)
    assert not res.norm.converged.any() and (res.norm.residual > res.norm.tol).all()
    # Arnoldi cut short: its residual may be small, but the eigenvalue it has may not be dominant
    assert set(res.radius.method) == {"arnoldi"} and not res.radius.converged.any()
    assert not res.converged.any()


def test_bad_arguments():
    st = _stack(16)
    with pytest.raises(ValueError, match="method"):
        token_jacobian_spectra(st, _h(st), 1, method="svd")
    with pytest.raises(ValueError, match="max_iter"):
        token_jacobian_spectra(st, _h(st), 1, max_iter=0)
    with pytest.raises(TypeError, match="model"):
        token_jacobian_spectra(object(), _h(st), 1)
    with pytest.raises(ValueError, match="h must"):
        TokenJacobian(st, _h(st)[None].repeat(2, 0), 1)


def _recovery(st, monkeypatch=None, layer=0, **kw):
    if monkeypatch is not None:
        mod = importlib.import_module("pyengine.experiments.recovery")
        monkeypatch.setattr(mod, "token_jacobian_spectra",
                            functools.partial(token_jacobian_spectra, method="matrix_free", **kw))
    return recovery(st, ids=IDS, layer=layer, n_directions=2, scales=(0.1, 1.0), spectral_tokens=TOKS,
                    eps_values=[1e-5], gamma_values=[1.0])


def test_recovery_spectra_stage_matrix_free_and_dense(monkeypatch):
    st = _stack(32)
    dense = _recovery(st)
    free = _recovery(st, monkeypatch)
    np.testing.assert_allclose(free.sigma, dense.sigma, rtol=1e-9)
    np.testing.assert_allclose(free.rho, dense.rho, rtol=1e-6)
    for rep, want in ((dense, {"dense"}), (free, {"lanczos"})):
        assert set(rep.spectra_how["sigma_method"].ravel()) == want and rep.spectra_how["sigma_converged"].all()
        spec = rep.to_dict()["spectral"]
        assert np.array(spec["sigma_converged"]).all() and np.array(spec["rho_converged"]).all()
    rows = free.layer_table()
    assert rows[0]["sigma_method"] == "lanczos" and rows[0]["sigma_converged"] is True
    assert rows[-1]["sigma_method"] is None  # the last hidden state leaves no block
    table = pe.experiments._report.format_table(dense)
    assert table.splitlines()[4].rstrip().endswith("dense") and "?" not in table.splitlines()[4]


def test_recovery_marks_unconverged_spectra(monkeypatch):
    st = _stack(64)
    rep = _recovery(st, monkeypatch, layer=1, max_iter=1)
    how = rep.spectra_how
    assert not how["sigma_converged"].any() and not how["rho_converged"].any()
    assert rep.layer_table()[0]["sigma_converged"] is False and rep.layer_table()[0]["rho_converged"] is False
    assert rep.to_dict()["spectral"]["sigma_converged"] == [[False] * 3]
    line = pe.experiments._report.format_table(rep).splitlines()[4]
    assert f"{rep.layer_table()[0]['sigma_max']:.3f}?" in line and f"{rep.layer_table()[0]['rho']:.4f}?" in line
    assert "NOT CONVERGED: rho at 3 and sigma_max at 3 of 3 (block, token) pairs" in rep.verdicts[0]
    monkeypatch.undo()
    assert "NOT CONVERGED" not in _recovery(st).verdicts[0]
