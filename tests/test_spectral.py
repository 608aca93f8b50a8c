"""Spectral norms and radii: against SciPy/NumPy dense answers, honest convergence, determinism
(the `pyengine spectral` command: test_spectral_cli.py)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import scipy.sparse.linalg

import pyengine as pe
from pyengine import backends
from pyengine.linalg import weights

NORMS = ["layer_norm", "rms_norm"]
MODES = ["full", "frozen_scale"]
#: Slack for "lower <= exact <= upper": lower is ||A v|| computed in floating point.
BRACKET = 1e-12


def realistic(N, d, seed=0, dtype=np.float64):
    """Tokens with lognormal channel scales and a lognormal gamma (a hard case for power iteration)."""
    rng = np.random.default_rng(seed)
    x = (0.3 + rng.standard_normal((N, d)) * rng.lognormal(0, 0.5, d)).astype(dtype)
    return x, rng.lognormal(0, 0.3, d).astype(dtype)


def dense_sigma(norm, x, gamma, eps=1e-5, mode="full"):
    jac = getattr(pe, norm + "_jacobian")(np.asarray(x, np.float64), np.asarray(gamma, np.float64), eps, mode,
                                          backend="numpy")
    return np.array([scipy.linalg.svdvals(j)[0] for j in jac.reshape(-1, *jac.shape[-2:])]).reshape(jac.shape[:-2])


def check_honest(res, exact=None, slack=BRACKET):
    """Invariants of every SpectralResult: converged => residual <= tol; lower <= upper; brackets."""
    assert (res.residual[res.converged] <= res.tol).all()
    assert not (res.converged & ~(res.residual <= res.tol)).any()
    assert (res.lower <= res.upper).all()
    if exact is not None:
        assert (res.lower <= exact * (1 + slack)).all()
        assert (exact <= res.upper * (1 + slack)).all()


def needs(kernel, backend):
    if (kernel, backend) not in backends._TABLE and backends.available_backends()[backend].available:
        backends.resolve(kernel, "numpy")  # make sure the table is loaded
        if (kernel, backend) not in backends._TABLE:
            pytest.skip(f"backend {backend} has no {kernel} yet")


# -- spectral_norm on dense stacks ------------------------------------------------------------
@pytest.mark.parametrize("method", ["power", "lanczos"])
@pytest.mark.parametrize("shape", [(6, 12, 9), (5, 7, 30), (3, 40, 40), (2, 2, 3)], ids=lambda s: "x".join(map(str, s)))
def test_spectral_norm_dense_vs_svdvals(method, shape):
    rng = np.random.default_rng(sum(shape))
    A = rng.standard_normal(shape)
    exact = np.array([scipy.linalg.svdvals(a)[0] for a in A])
    res = pe.spectral_norm(A, method=method, tol=1e-10, max_iter=5000)
    assert res.all_converged and res.shape == (shape[0],)
    np.testing.assert_allclose(res.sigma, exact, rtol=1e-9)
    check_honest(res, exact)
    assert (res.method == method).all()


@pytest.mark.parametrize("method", ["power", "lanczos"])
def test_spectral_norm_of_a_composition(method):
    x, gamma = realistic(5, 24, seed=3)
    W = np.random.default_rng(4).standard_normal((24, 24)) / 5
    op = pe.Identity(24) + pe.DenseOperator(W) @ pe.LayerNormJacobian(x, gamma)
    exact = np.array([scipy.linalg.svdvals(np.eye(24) + W @ j)[0] for j in pe.layer_norm_jacobian(x, gamma)])
    res = pe.spectral_norm(op, method=method, tol=1e-10, max_iter=5000)
    np.testing.assert_allclose(res.sigma, exact, rtol=1e-9)
    check_honest(res, exact)


# -- LayerNorm / RMSNorm Jacobians on every backend --------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("method", ["exact", "power", "lanczos"])
def test_norm_spectral_norm_every_backend(backend, method, norm, mode):
    if method != "lanczos":
        needs(f"{norm}_{'sigma_max' if method == 'exact' else 'power_iteration'}", backend)
    x, gamma = realistic(12, 16, seed=5)
    exact = dense_sigma(norm, x, gamma, mode=mode)
    fn = getattr(pe, norm + "_spectral_norm")
    res = fn(x, gamma, mode=mode, method=method, tol=1e-11, max_iter=20000, backend=backend)
    assert res.all_converged, res.summary()
    np.testing.assert_allclose(res.sigma, exact, rtol=1e-9)
    check_honest(res, exact)
    if method == "exact":
        assert (res.iterations == 0).all() and (res.lower == res.sigma).all() and (res.upper == res.sigma).all()


@pytest.mark.parametrize("method", ["power", "lanczos"])
def test_bounds_bracket_the_exact_value_for_every_token(backend, method):
    """Converged or not (max_iter small): lower <= sigma_max <= upper, token by token."""
    needs("layer_norm_power_iteration", backend)
    x, gamma = realistic(40, 32, seed=6)
    exact = dense_sigma("layer_norm", x, gamma)
    for max_iter in (3, 30, 3000):
        res = pe.layer_norm_spectral_norm(x, gamma, method=method, tol=1e-10, max_iter=max_iter, backend=backend)
        check_honest(res, exact)
        assert (res.iterations <= max_iter).all()


def test_closed_form_for_constant_gamma():
    x, _ = realistic(7, 10, seed=7)
    s = np.sqrt(x.var(axis=1) + 1e-5)
    for method in ("exact", "power", "lanczos"):
        res = pe.layer_norm_spectral_norm(x, np.full(10, -1.7), method=method, tol=1e-12, backend="numpy")
        np.testing.assert_allclose(res.sigma, 1.7 / s, rtol=1e-10)


def test_float32_tokens():
    x, gamma = realistic(9, 48, seed=8, dtype=np.float32)
    exact = dense_sigma("layer_norm", x, gamma)
    for method in ("power", "lanczos"):
        res = pe.layer_norm_spectral_norm(x, gamma, method=method, tol=1e-5, max_iter=5000)
        assert res.all_converged
        np.testing.assert_allclose(res.sigma, exact, rtol=1e-4)
        check_honest(res, exact, slack=1e-5)


# -- honesty: hard cases must not claim convergence -------------------------------------------
@pytest.mark.parametrize("method", ["power", "lanczos"])
def test_hard_case_is_not_converged(method):
    """A tiny spectral gap and a small max_iter: the answer is a lower bound, flagged as such."""
    rng = np.random.default_rng(9)
    n = 60
    Q1, _ = np.linalg.qr(rng.standard_normal((n, n)))
    Q2, _ = np.linalg.qr(rng.standard_normal((n, n)))
    s = np.linspace(0.1, 1.0 - 1e-7, n)
    s[-1] = 1.0
    A = (Q1 * s) @ Q2.T
    res = pe.spectral_norm(np.stack([A, A]), method=method, tol=1e-13, max_iter=4)
    assert not res.converged.any()
    assert (res.residual > 1e-13).all() and (res.iterations <= 4).all()
    check_honest(res, np.ones(2), slack=1e-12)
    assert "NOT converged" in res.summary()


def test_hard_layer_norm_case_is_not_converged(backend):
    needs("layer_norm_power_iteration", backend)
    x, gamma = realistic(6, 64, seed=10)
    res = pe.layer_norm_spectral_norm(x, gamma, method="power", tol=1e-12, max_iter=5, backend=backend)
    assert not res.converged.any() and (res.iterations == 5).all()
    check_honest(res, dense_sigma("layer_norm", x, gamma))


# -- Lanczos against ARPACK: products at 1e-10 ------------------------------------------------
class Counting(pe.BatchedOperator):
    """Counts the rows it multiplies (products with A, with A^T)."""

    def __init__(self, op):
        super().__init__(op.batch, op.shape, op.dtype)
        self.op, self.products = op, 0

    def _matvec(self, V, out):
        self.products += V.shape[0]
        return self.op.matvec(V, out=out)

    def _rmatvec(self, U, out):
        self.products += U.shape[0]
        return self.op.rmatvec(U, out=out)

    def upper_bound(self):
        return self.op.upper_bound()


def arpack_products(L, tol, v0):
    """Products with A and A^T that ARPACK needs: eigsh on A^T A (the same residual test as
    ours), and svds (which runs eigsh at tol**2 and then forms the singular vectors)."""
    count = [0]

    def mv(v):
        count[0] += 1
        return L.matvec(v)

    def rmv(u):
        count[0] += 1
        return L.rmatvec(u)

    C = scipy.sparse.linalg.LinearOperator(L.shape, matvec=mv, rmatvec=rmv, dtype=L.dtype)
    AtA = scipy.sparse.linalg.LinearOperator(L.shape, matvec=lambda v: rmv(mv(v)), dtype=L.dtype)
    scipy.sparse.linalg.eigsh(AtA, k=1, tol=tol, v0=v0, return_eigenvectors=False)
    eigsh_count, count[0] = count[0], 0
    scipy.sparse.linalg.svds(C, k=1, tol=tol, v0=v0, return_singular_vectors=False)
    return eigsh_count, count[0]


def test_lanczos_needs_no_more_products_than_arpack():
    d, tol = 768, 1e-10
    x, gamma = realistic(4, d, seed=11)
    J = pe.LayerNormJacobian(x, gamma)
    exact = pe.layer_norm_spectral_norm(x, gamma, method="exact", backend="numpy").sigma
    for i in range(4):
        op = Counting(J.take(np.array([i])))
        res = pe.spectral_norm(op, method="lanczos", tol=tol)
        ours = op.products
        assert ours == 2 * res.iterations[0]  # the result reports the products it used
        assert res.converged[0] and abs(res.sigma[0] - exact[i]) <= 1e-12 * exact[i]
        v0 = np.random.default_rng(i).standard_normal(d)
        eigsh_count, svds_count = arpack_products(pe.as_linear_operator(J, i), tol, v0)
        assert ours <= eigsh_count <= svds_count, (ours, eigsh_count, svds_count)


# -- spectral radius -------------------------------------------------------------------------
def similar(eigs, seed):
    """A real matrix with the given eigenvalues (a conjugate pair as a 2 x 2 rotation block)."""
    rng = np.random.default_rng(seed)
    blocks = []
    for e in eigs:
        if isinstance(e, complex):
            blocks.append(np.array([[e.real, -e.imag], [e.imag, e.real]]))
        else:
            blocks.append(np.array([[e]]))
    D = scipy.linalg.block_diag(*blocks)
    S = rng.standard_normal(D.shape) + 3 * np.eye(D.shape[0])
    return S @ D @ np.linalg.inv(S)


def test_spectral_radius_vs_eigvals():
    A = np.stack([
        similar([2.0, -1.2, 0.5, complex(0.3, 0.9), 0.1, 0.05], 12),  # real dominant eigenvalue
        similar([complex(1.1, 1.5), 1.0, -0.7, 0.2, 0.1, -0.3], 13),  # dominant complex pair
        similar([1.5, -1.5, 0.2, 0.1, 0.3, -0.4, 0.05], 14),  # tied pair +-1.5
    ])
    exact = np.array([np.abs(np.linalg.eigvals(a)).max() for a in A])
    res = pe.spectral_radius(A, tol=1e-9)
    np.testing.assert_allclose(res.rho, exact, rtol=1e-7)
    assert res.all_converged
    assert res.method.tolist() == ["power", "arnoldi", "arnoldi"]
    assert abs(res.eigenvalue[1].imag) > 1.0  # the complex pair was found as such
    assert (res.rho <= res.upper).all() and (res.residual <= 1e-9).all()
    assert "arnoldi 2" in res.summary()


def test_spectral_radius_of_tiny_operators_is_dense():
    rot = np.array([[[0.0, -2.0], [2.0, 0.0]], [[0.5, 1.0], [0.0, -0.25]]])
    res = pe.spectral_radius(rot)
    np.testing.assert_allclose(res.rho, [2.0, 0.5], rtol=1e-12)
    assert res.method.tolist() == ["dense", "dense"] and res.all_converged


def test_spectral_radius_and_norm_differ_on_non_normal():
    A = np.array([[0.5, 10.0, 0.0], [0.0, 0.4, 3.0], [0.0, 0.0, 0.3]])
    rho = pe.spectral_radius(A, tol=1e-10)
    sigma = pe.spectral_norm(A, tol=1e-10)
    np.testing.assert_allclose(rho.rho, [0.5], rtol=1e-8)
    np.testing.assert_allclose(sigma.sigma, [scipy.linalg.svdvals(A)[0]], rtol=1e-9)
    assert rho.rho[0] < 0.1 * sigma.sigma[0]


def test_spectral_radius_of_a_pre_layernorm_block():
    """DESIGN: A_L = I + W J_LN fixes 1, so rho(A_L) >= 1."""
    x, gamma = realistic(3, 16, seed=15)
    W = np.random.default_rng(16).standard_normal((16, 16)) / 16
    op = pe.Identity(16) + pe.DenseOperator(W) @ pe.LayerNormJacobian(x, gamma)
    res = pe.spectral_radius(op, tol=1e-9)
    dense = np.eye(16) + W @ pe.layer_norm_jacobian(x, gamma)
    exact = np.array([np.abs(np.linalg.eigvals(a)).max() for a in dense])
    np.testing.assert_allclose(res.rho, exact, rtol=1e-7)
    assert (res.rho >= 1 - 1e-9).all()


# -- algebra, determinism, chunking -------------------------------------------------------------
@pytest.mark.parametrize("method", ["power", "lanczos"])
@pytest.mark.parametrize("c", [3.5, -0.25])
def test_scaling(method, c):
    A = np.random.default_rng(17).standard_normal((4, 10, 8))
    base = pe.spectral_norm(A, method=method, tol=1e-11, max_iter=5000)
    scaled = pe.spectral_norm(c * pe.DenseOperator(A), method=method, tol=1e-11, max_iter=5000)
    np.testing.assert_allclose(scaled.sigma, abs(c) * base.sigma, rtol=1e-9)
    np.testing.assert_allclose(scaled.upper, abs(c) * base.upper, rtol=1e-12)


@pytest.mark.parametrize("method", ["power", "lanczos"])
def test_seeds_reproduce_bit_for_bit(method):
    x, gamma = realistic(10, 32, seed=18)
    J = pe.LayerNormJacobian(x, gamma, backend="numpy")
    W = pe.DenseOperator(np.random.default_rng(19).standard_normal((10, 32, 32)))
    for op in (J, W):
        a = pe.spectral_norm(op, method=method, seed=5, tol=1e-6)
        b = pe.spectral_norm(op, method=method, seed=5, tol=1e-6)
        c = pe.spectral_norm(op, method=method, seed=6, tol=1e-6)
        for f in ("sigma", "residual", "iterations"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
        assert not np.array_equal(a.sigma, c.sigma)


@pytest.mark.parametrize("method", ["exact", "power", "lanczos"])
def test_chunked_scan_equals_unchunked(method):
    x, gamma = realistic(23, 20, seed=20)
    x3 = x.reshape(23, 1, 20)
    whole = pe.layer_norm_spectral_norm(x3, gamma, method=method, tol=1e-9, backend="numpy")
    seen = []
    chunked = pe.layer_norm_spectral_norm(x3, gamma, method=method, tol=1e-9, backend="numpy", chunk_size=4,
                                          callback=lambda done, total: seen.append((done, total)))
    assert whole.shape == chunked.shape == (23, 1)
    for f in ("sigma", "lower", "upper", "residual", "iterations", "converged"):
        np.testing.assert_array_equal(getattr(whole, f), getattr(chunked, f))
    assert seen == [(min(23, k), 23) for k in range(4, 28, 4)]
    if method != "exact":  # the operator path gives the same numbers as the scan
        op = pe.LayerNormJacobian(x, gamma, backend="numpy")
        np.testing.assert_array_equal(pe.spectral_norm(op, method=method, tol=1e-9).sigma, whole.sigma.ravel())


def test_v0_and_result_object():
    A = np.random.default_rng(21).standard_normal((3, 5, 5))
    v0 = np.ones((3, 5))
    res = pe.spectral_norm(A, v0=v0, tol=1e-8)
    np.testing.assert_allclose(res.sigma, [scipy.linalg.svdvals(a)[0] for a in A], rtol=1e-7)
    assert "SpectralResult(shape=(3,)" in repr(res) and "converged: 3/3" in res.summary()
    with pytest.raises(ValueError):
        res.sigma[0] = 1.0  # read-only
    d = res.to_dict()
    assert d["tol"] == 1e-8 and len(d["sigma"]) == 3


def test_zero_operator_is_answered_exactly():
    res = pe.spectral_norm(np.zeros((2, 3, 3)), method="power")
    assert res.all_converged and (res.sigma == 0).all()
    res = pe.layer_norm_spectral_norm(np.random.default_rng(0).standard_normal((2, 4)), np.zeros(4), method="exact")
    assert (res.sigma == 0).all()


# -- weight scans ------------------------------------------------------------------------------
def test_weight_scan():
    rng = np.random.default_rng(22)
    weights = {"wq": rng.standard_normal((64, 16)), "w_out": rng.standard_normal((16, 64)).astype(np.float32)}
    scan = pe.weight_scan(weights)
    sig = np.array([scipy.linalg.svdvals(np.asarray(w, np.float64))[0] for w in weights.values()])
    np.testing.assert_allclose(scan.sigma_max, sig, rtol=1e-6)
    assert scan.name == ("wq", "w_out") and scan.d_out.tolist() == [64, 16] and scan.d_in.tolist() == [16, 64]
    np.testing.assert_allclose(scan.rms_to_rms, sig * np.sqrt(scan.d_in / scan.d_out))
    np.testing.assert_allclose(scan.target, np.sqrt(scan.d_out / scan.d_in))
    text = scan.to_text()
    assert "wq" in text and "64x16" in text and "sigma_max" in text
    listed = pe.weight_scan([weights["wq"]], layout="in_out")
    assert listed.name == ("0",) and listed.d_out.tolist() == [16]
    with pytest.raises(ValueError, match=r"weights\['wq'\] must be a non-empty 2-D matrix"):
        pe.weight_scan({"wq": np.ones((2, 3, 4))})
    with pytest.raises(TypeError, match="weights must be a dict"):
        pe.weight_scan(np.ones((3, 3)))


def test_weight_scan_large_matrix_uses_lanczos(monkeypatch):
    monkeypatch.setattr(weights, "WEIGHT_SVD_MAX", 8)
    W = np.random.default_rng(23).standard_normal((40, 30))
    scan = pe.weight_scan([W])
    np.testing.assert_allclose(scan.sigma_max, [scipy.linalg.svdvals(W)[0]], rtol=1e-9)
    assert scan.converged.all()


# -- bad input --------------------------------------------------------------------------------
def test_bad_arguments():
    x, gamma = realistic(5, 8)
    A = np.ones((2, 3, 3))
    cases = [
        (lambda: pe.spectral_norm(A, method="svd"), ValueError, "method must be one of 'power', 'lanczos'"),
        (lambda: pe.spectral_norm(A, tol=0), ValueError, r"tol must be a real number in \(0, 1\)"),
        (lambda: pe.spectral_norm(A, max_iter=0), ValueError, "max_iter must be a positive integer"),
        (lambda: pe.spectral_norm(A, seed=-1), ValueError, "seed must be a non-negative integer"),
        (lambda: pe.spectral_norm(A, v0=np.ones((2, 4))), ValueError, r"v0 must have shape \(B, n\) = \(2, 3\)"),
        (lambda: pe.spectral_norm(A, v0=np.zeros((2, 3))), ValueError, "v0 row 0 is zero"),
        (lambda: pe.spectral_norm(A, v0=np.array([[1.0, 2, 3], [1, np.nan, 3]])), ValueError,
         r"v0 contains NaN or Inf \(first at index \(1, 1\): nan\)"),
        (lambda: pe.spectral_radius(A, v0=np.full((2, 3), np.inf)), ValueError,
         r"v0 contains NaN or Inf \(first at index \(0, 0\): inf\)"),
        (lambda: pe.weight_scan({"wq": np.array([[1.0, np.inf]])}), ValueError,
         r"weights\['wq'\] contains NaN or Inf \(first at index \(0, 1\): inf\)"),
        (lambda: pe.weight_scan([np.eye(2)], layout="row"), ValueError, "layout must be one of 'out_in', 'in_out'"),
        (lambda: pe.weight_scan([np.eye(2)], tol=1.5), ValueError, r"tol must be a real number in \(0, 1\)"),
        (lambda: pe.spectral_norm(A, callback=3), TypeError, "callback must be callable"),
        (lambda: pe.spectral_norm(A, chunk_size=0), ValueError, "chunk_size must be a positive integer"),
        (lambda: pe.spectral_norm("A"), TypeError, "op must be a pyengine BatchedOperator"),
        (lambda: pe.spectral_radius(np.ones((3, 4))), ValueError, r"op must be square.*\(3, 4\)"),
        (lambda: pe.layer_norm_spectral_norm(x, gamma, method="arnoldi"), ValueError, "method must be one of 'exact'"),
        (lambda: pe.layer_norm_spectral_norm(x.astype(int)), TypeError, "x must be a float32 or float64 array"),
        (lambda: pe.rms_norm_spectral_norm(x, gamma[:4]), ValueError, r"gamma must have shape \(d,\)"),
        (lambda: pe.layer_norm_spectral_norm(x, eps=-1.0), ValueError, "eps must be a finite number >= 0"),
        (lambda: pe.layer_norm_spectral_norm(x, mode="detached"), ValueError, "mode must be"),
        (lambda: pe.layer_norm_spectral_norm(x, backend="gpu"), ValueError, "backend must be one of"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call()


@pytest.mark.parametrize("method", ["exact", "power", "lanczos"])
def test_bad_row_in_a_later_chunk_is_named_globally(method):
    x, gamma = realistic(12, 8)
    x[9, 2] = np.nan
    with pytest.raises(ValueError, match=r"x contains NaN or Inf .*row \(9,\)"):
        pe.layer_norm_spectral_norm(x, gamma, method=method, chunk_size=4, backend="numpy")
    x[9, 2] = 1.0
    x[10] = 3.0  # constant row, eps = 0
    with pytest.raises(ValueError, match=r"x row \(10,\) is constant"):
        pe.layer_norm_spectral_norm(x, gamma, eps=0.0, method=method, chunk_size=4, backend="numpy")
