"""Batched Golub-Kahan-Lanczos for sigma_max (``spectral_norm(method="lanczos")``), with full
reorthogonalization and thick restarts. Private to :mod:`pyengine.linalg.spectral`, like
:mod:`._solvers`, whose shared helpers and named constants it uses."""

from __future__ import annotations

import numpy as np

from ..backends import one_blas_thread
from ._solvers import (BREAKDOWN, COMPACT_FRACTION, DGKS_ETA, GS_LOOP_MIN, LANCZOS_FIRST_TEST, LANCZOS_KEEP,
                       LANCZOS_MAX_SUBSPACE, LANCZOS_TEST_GAP, _power, _relative_residual,
                       _rowdot, _unit_rows)
from .operators import BatchedOperator


# -- Golub-Kahan-Lanczos bidiagonalization with thick restarts --------------------------
def _orthogonalize(w: np.ndarray, basis: np.ndarray, j: int) -> np.ndarray:
    """w -= Q Q^T w against the first j basis vectors; returns the coefficients Q^T w.

    ``basis`` is (a, p, n): each operator's vectors one contiguous block, so that the
    batched products run on (j, n) blocks that stay in cache between the two passes.

    Classical Gram-Schmidt with the DGKS test: a row whose norm dropped below
    DGKS_ETA of its former value has lost digits to cancellation and gets a second
    pass ("twice is enough"), which keeps the basis orthonormal to rounding.
    """
    if j == 0:
        return np.zeros((w.shape[0], 0))
    Q = basis[:, :j]  # (a, j, n) view, each (j, n) block contiguous
    before = _rowdot(w, w)
    coef = _project_out(Q, w)
    again = np.flatnonzero(_rowdot(w, w) < DGKS_ETA**2 * before)
    if again.size:
        wa = w[again]
        c2 = _project_out(Q[again], wa)
        w[again] = wa
        coef[again] += c2
    return coef


def _project_out(Q: np.ndarray, w: np.ndarray) -> np.ndarray:
    """c = Q w and w -= c Q, per operator (Q: (a, j, n), w: (a, n) in place); returns c (a, j).

    From GS_LOOP_MIN vectors on, one operator at a time: its (j, n) block is then read
    from memory once and from cache the second time, where the batched products read all
    of Q from memory twice (2-3x slower at j = 20-40, d = 768; the same result bit for bit,
    since each is the same BLAS product per operator).
    """
    a, j = Q.shape[:2]
    if j < GS_LOOP_MIN:
        coef = np.matmul(Q, w[:, :, None])[:, :, 0]
        w -= np.matmul(coef[:, None, :], Q)[:, 0, :]
        return coef
    coef = np.empty((a, j))
    for i in range(a):
        Qi = Q[i]
        ci = Qi @ w[i]
        w[i] -= ci @ Qi
        coef[i] = ci
    return coef


def _lanczos(op: BatchedOperator, V0: np.ndarray, tol: float, max_iter: int, out: dict[str, np.ndarray]) -> None:
    """Batched Golub-Kahan-Lanczos for sigma_max; fills ``out`` in place.

    Keeps, per operator, orthonormal V (n x j), U (m x j) and the j x j projection M with
        A V = U M,    A^T U = V M^T + v_next f^T.
    The top singular triplet (theta, p, q) of M gives the Ritz vector V q, whose
    residual is ||A^T A (Vq) - theta^2 Vq|| / theta^2 = |f . p| / theta. When that
    estimate passes tol, the Ritz vector is verified with one explicit product pair
    (that residual is what is reported). At LANCZOS_MAX_SUBSPACE vectors the basis is
    thick-restarted on the LANCZOS_KEEP top Ritz vectors (the decomposition stays exact:
    M becomes diag(theta_keep) and f becomes P_keep^T f).

    The small SVDs cost O(j^3) per operator, far more than a LayerNorm product, so
    an operator is tested only when due: the next test is scheduled halfway to where
    the observed convergence rate of its estimate predicts tol (every step once it
    is near), and at every restart, which needs the SVD anyway.
    """
    if max_iter == 1:  # no room for a step and its check: one power step is the same thing
        _power(op, V0, tol, max_iter, out)
        return
    B, (m, n) = op.batch, op.shape
    p = int(min(LANCZOS_MAX_SUBSPACE, m, n))
    keep_k = int(min(LANCZOS_KEEP, max(p - 2, 1)))
    ids = np.arange(B)
    act = op
    # Per operator its basis vectors as one contiguous block (operator-major): the
    # Gram-Schmidt products then read each operator's (j, n) block from cache, not the
    # whole basis (B x p x n doubles, far larger than any cache) from memory twice a step.
    Vb = np.zeros((B, p + 1, n))
    Ub = np.zeros((B, p, m))
    M = np.zeros((B, p, p))
    f = np.zeros((B, p))
    Vb[:, 0] = V0
    j = 0
    used = np.zeros(B, np.int64)  # product pairs per operator (this call)
    factor = np.ones(B)  # tightened after a failed verification
    done = np.zeros(B, bool)
    bound = op.upper_bound()
    scale = np.zeros(B)  # per operator: largest alpha / beta seen (~ ||A||), for breakdown tests
    due = np.full(B, LANCZOS_FIRST_TEST, np.int64)  # pair count at which to test next
    last_est, last_at = np.full(B, np.inf), np.zeros(B, np.int64)
    while True:
        a = len(ids)
        # -- extend by one: u = A v_j, orthogonalize against U, alpha; w = A^T u, beta --------
        u = act.matvec(np.ascontiguousarray(Vb[:a, j])).astype(np.float64)
        with one_blas_thread():
            c = _orthogonalize(u, Ub[:a], j)
        alpha = np.sqrt(_rowdot(u, u))
        tiny = alpha <= BREAKDOWN * np.maximum(scale[ids], 1e-300)
        u /= np.where(tiny, 1.0, alpha)[:, None]
        u[tiny] = 0.0
        alpha[tiny] = 0.0
        Ub[:a, j] = u
        M[:a, :j, j] = c
        M[:a, j, j] = alpha
        w = act.rmatvec(u).astype(np.float64)
        with one_blas_thread():
            _orthogonalize(w, Vb[:a], j + 1)
        beta = np.sqrt(_rowdot(w, w))
        scale[ids] = np.maximum(scale[ids], np.maximum(alpha, beta))
        btiny = beta <= BREAKDOWN * np.maximum(scale[ids], 1e-300)
        beta[btiny] = 0.0
        Vb[:a, j + 1] = w / np.where(btiny, 1.0, beta)[:, None]
        Vb[:a, j + 1][btiny] = 0.0
        f[:a, :j] = 0.0
        f[:a, j] = beta
        j += 1
        used[ids] += 1
        # -- Ritz test, for the operators that are due (all of them before a restart) ------
        live = ~done[ids]
        out_of_budget = used[ids] + 1 >= max_iter  # one pair stays reserved for the final check
        restart = j == p
        test = live & (restart | out_of_budget | (used[ids] >= due[ids]) | btiny)
        ti = np.flatnonzero(test)
        if restart:
            ti = np.arange(a)
        if ti.size:
            with one_blas_thread():
                P, theta, Qt = np.linalg.svd(M[ti, :j, :j])
            th = theta[:, 0]
            fp = np.abs(np.einsum("aj,aj->a", f[ti, :j], P[:, :, 0]))
            with np.errstate(divide="ignore", invalid="ignore"):
                est = np.where(th > 0, fp / th, np.where(fp == 0, 0.0, np.inf))
            g = ids[ti]
            _schedule(due, last_est, last_at, g, est, used[g], tol * factor[g])
            cand_local = live[ti] & ((est <= tol * factor[g]) | out_of_budget[ti])
            if cand_local.any():
                ci = ti[cand_local]
                ritz = np.einsum("ajn,aj->an", Vb[ci, :j], Qt[cand_local, 0, :])
                ritz /= np.linalg.norm(ritz, axis=1, keepdims=True)
                sub = act.take(ci)
                # As in _power: A^T is applied to the unit y/sigma (no overflow of A^T A v).
                yn, sig = _unit_rows(sub.matvec(ritz))
                z = sub.rmatvec(yn.astype(sub.dtype)).astype(np.float64)
                r = z - sig[:, None] * ritz
                gc = ids[ci]
                res = _relative_residual(np.sqrt(_rowdot(r, r)), sig, bound[gc])
                used[gc] += 1
                ok = res <= tol
                # Finish when no room is left for one more step and its check: a failed
                # check near the end must not run past max_iter.
                fin = ok | out_of_budget[ci] | (used[gc] + 2 > max_iter)
                out["sigma"][gc[fin]] = sig[fin]
                out["residual"][gc[fin]] = res[fin]
                out["iterations"][gc[fin]] = used[gc[fin]]
                out["converged"][gc[ok]] = True
                done[gc[fin]] = True
                factor[gc[~fin]] *= 0.1  # the estimate was optimistic: ask more of it next time
        keep = ~done[ids]
        if not keep.any():
            return
        # -- thick restart when the basis is full -------------------------------------------
        if restart:
            k = keep_k
            with one_blas_thread():
                newV = np.einsum("aln,akl->akn", Vb[:a, :j], Qt[:, :k, :])  # V_j q_i, i < k
                newU = np.einsum("alm,alk->akm", Ub[:a, :j], P[:, :, :k])  # U_j p_i
            nxt = Vb[:a, j].copy()
            Vb[:a, :k], Ub[:a, :k] = newV, newU
            Vb[:a, k] = nxt
            fk = np.einsum("aj,ajk->ak", f[:a, :j], P[:, :, :k])
            M[:a] = 0.0
            M[:a, np.arange(k), np.arange(k)] = theta[:, :k]
            f[:a] = 0.0
            f[:a, :k] = fk
            j = k
        if (~keep).sum() >= max(1, COMPACT_FRACTION * a):
            sel = np.flatnonzero(keep)
            act, ids = act.take(sel), ids[sel]
            Vb, Ub = Vb[sel], Ub[sel]  # fancy indexing copies: contiguous
            M, f = M[sel], f[sel]


def _schedule(due, last_est, last_at, g, est, now, target) -> None:
    """Set the pair count of the next Ritz test of operators ``g`` from their estimates' progress."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        rate = (est / last_est[g]) ** (1.0 / np.maximum(now - last_at[g], 1))  # per step
        steps = np.log(target / est) / np.log(rate)  # predicted steps to reach target
    gap = np.where((rate > 0) & (rate < 1) & np.isfinite(steps), np.floor(steps / 2), LANCZOS_TEST_GAP)
    due[g] = now + np.clip(gap, 1, LANCZOS_TEST_GAP).astype(np.int64)
    last_est[g], last_at[g] = est, now


# -- spectral radius: power iteration on A, Arnoldi for what it cannot settle -------------
