"""spectral_radius's exact path for operators of moderate size: form the n x n matrix, LAPACK.

Private to :mod:`pyengine.linalg._solvers` (``_radius``). An operator that power
iteration cannot settle (a dominant complex pair, a tied +-lambda pair or a tiny
gap) used to go to ARPACK's Arnoldi; for n in [DENSE_RADIUS_MIN, DENSE_RADIUS_MAX]
it is now formed densely instead (n products against the identity: for I + W J_LN
one GEMM and n JVPs) and its eigenvalues taken from LAPACK (``geev`` without
vectors, about 10 n^3 flops), the dominant eigenvector by two steps of inverse
iteration (one complex LU). Why: for a random W the eigenvalues of I + W J_LN
fill a disk (the circular law), so the dominant one sits on its rim with many
others close by, and a Krylov method crawls (ARPACK took about 1000 products, 1-10 s
at d = 768 when this path was added; 0.04-0.15 s with today's products) and can stop
at a neighbour with a passing residual (see ``_solvers.ARNOLDI_WANTED``): it certifies
no dominance. LAPACK takes about 0.4 s, always, and is exact. Below
DENSE_RADIUS_MIN ARPACK is cheap and stays; above DENSE_RADIUS_MAX the n^2 matrix
and the n^3 work outgrow the Krylov method.

Several operators: their matrices are formed in the calling thread (the
operators' products are not assumed thread-safe) and the eigenproblems solved by
a thread pool, one BLAS thread each (LAPACK releases the GIL). One operator: one
BLAS thread as well (threaded geev gained little, and on a busy machine a threaded
OpenBLAS was several times slower).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .operators import BatchedOperator

#: Operators of this size, and up to DENSE_RADIUS_MAX, that power iteration cannot settle
#: are solved densely (LAPACK) instead of by Arnoldi.
DENSE_RADIUS_MIN = 128
DENSE_RADIUS_MAX = 2048
#: Inverse iteration steps for the dominant eigenvector, and the relative shift off the
#: eigenvalue (keeps the LU of A - shift I away from an exactly zero pivot).
INVERSE_STEPS = 2
SHIFT_OFFSET = 1e-10

__all__ = ["DENSE_RADIUS_MAX", "DENSE_RADIUS_MIN", "dense_eigpair", "dense_matrix", "dense_radii", "use_dense",
           "zero_image", "zero_images"]


def use_dense(n: int) -> bool:
    """Whether an unsettled operator of size n goes to the dense path."""
    return DENSE_RADIUS_MIN <= n <= DENSE_RADIUS_MAX


def dense_matrix(one: BatchedOperator) -> np.ndarray:
    """The (n, n) float64 matrix of a batch-1 operator, from n products with the identity."""
    n = one.shape[0]
    cols = one.matvec(np.eye(n, dtype=one.dtype))  # row j is A e_j
    return np.ascontiguousarray(cols.T, dtype=np.float64)


def zero_image(matvec, v: np.ndarray, steps: int) -> tuple[np.ndarray | None, int]:
    """The power sequence v, A v, A^2 v, ... (normalized) up to ``steps`` products: (x, products)
    with x the unit iterate whose image A x is exactly zero (so (0, x) is an eigenpair), or
    (None, products) if no image was zero. ``matvec`` maps (n,) to (n,); v (n,) is not modified."""
    x = np.asarray(v, dtype=np.float64)
    x, k = x / np.linalg.norm(x), 0
    for k in range(1, steps + 1):
        y = np.asarray(matvec(x), dtype=np.float64)
        ny = np.linalg.norm(y)
        if ny == 0:
            return x, k
        if not np.isfinite(ny):
            break
        x = y / ny
    return None, k


def zero_images(op: BatchedOperator, V: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`zero_image` of every operator of a batch at once, matrix-free (batched products).

    op : B operators (n, n); V : (B, n) start vectors (not modified); steps : the cap on products.
    Returns (X (B, n) float64, found (B,) bool, products (B,) int64): where ``found``, X's row is the
    unit iterate whose image is exactly zero; an operator stops at its zero image, at a non-finite
    image, or after ``steps`` products (each counted in ``products``).
    """
    B, n = V.shape
    X = np.asarray(V, dtype=np.float64).copy()
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    found, used = np.zeros(B, bool), np.zeros(B, np.int64)
    ids, act = np.arange(B), op
    for _ in range(steps):
        Y = np.asarray(act.matvec(X[ids]), dtype=np.float64)
        used[ids] += 1
        ny = np.linalg.norm(Y, axis=1)
        zero, bad = ny == 0, ~np.isfinite(ny)
        found[ids[zero]] = True
        go = ~(zero | bad)
        X[ids[go]] = Y[go] / ny[go, None]
        if not go.all():
            if not go.any():
                break
            act, ids = act.take(np.flatnonzero(go)), ids[go]
    return X, found, used


def dense_eigpair(A: np.ndarray, seed: int = 0) -> tuple[complex, np.ndarray]:
    """Dominant eigenvalue of A (largest |lambda|) and a unit eigenvector (complex); NaN if A is not finite."""
    import scipy.linalg as sl

    n = A.shape[0]
    if not np.isfinite(A).all():
        return complex(np.nan), np.zeros(n, complex)
    ev = sl.eigvals(A, check_finite=False)
    lam = complex(ev[int(np.argmax(np.abs(ev)))])
    if lam == 0:  # every eigenvalue is 0 (A nilpotent): a null vector, not inverse iteration at shift 0
        x, _ = zero_image(lambda v: A @ v, np.random.default_rng(seed).standard_normal(n), n + 1)
        return 0j, (np.linalg.svd(A)[2][-1] if x is None else x).astype(complex)
    shift = lam + SHIFT_OFFSET * max(abs(lam), np.finfo(float).tiny) * (1 + 1j)
    M = A.astype(complex)
    M[np.diag_indices(n)] -= shift
    lu = sl.lu_factor(M, check_finite=False, overwrite_a=True)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) + 1j * rng.standard_normal(n)
    for _ in range(INVERSE_STEPS):
        x = sl.lu_solve(lu, x, check_finite=False)
        x /= np.linalg.norm(x)
    return lam, x


def dense_radii(op: BatchedOperator, idx: np.ndarray, blas_limit) -> list[tuple[complex, np.ndarray]]:
    """dense_eigpair of the operators ``idx`` of ``op``, in that order.

    blas_limit() : a context manager that limits BLAS to one thread (for the pool).
    """
    idx = [int(i) for i in idx]
    if len(idx) == 1:  # one BLAS thread here too: threaded geev gains little and collapses under load
        with blas_limit():
            return [dense_eigpair(dense_matrix(op.take(np.array(idx))))]
    workers = max(1, min(len(idx), os.cpu_count() or 1))
    out: list[tuple[complex, np.ndarray]] = []
    with blas_limit(), ThreadPoolExecutor(max_workers=workers) as pool:
        for lo in range(0, len(idx), workers):
            chunk = idx[lo : lo + workers]
            mats = [dense_matrix(op.take(np.array([i]))) for i in chunk]
            out.extend(pool.map(dense_eigpair, mats))
    return out
