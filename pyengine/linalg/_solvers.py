"""The iterative solvers behind :mod:`pyengine.linalg.spectral`, on batches of operators.

Private: :mod:`pyengine.linalg.spectral` validates the arguments, draws the start vectors,
splits a scan into chunks and wraps the arrays these functions fill into its result
classes; its docstring states what the results mean. Here:

* :func:`_power` -- batched power iteration on A^T A (sigma_max);
* :func:`_lanczos` -- batched Golub-Kahan-Lanczos bidiagonalization with full
  reorthogonalization (:func:`_orthogonalize`) and thick restarts (sigma_max);
* :func:`_radius` -- batched power iteration on A (spectral radius), with
  :func:`_arnoldi` (ARPACK through :func:`scipy.sparse.linalg.eigs`) for the
  operators it cannot settle, or, for n in [128, 2048], the dense eigenvalues
  (:mod:`._dense_radius`).

Each works on a :class:`~pyengine.linalg.operators.BatchedOperator` through its products
(``matvec``, ``rmatvec``) and ``take`` (to drop the operators that have finished),
in NumPy. The solvers' own tolerances, caps and sizes are named below;
the public defaults are in :mod:`pyengine.linalg.spectral` (``MAX_ITER``, ...) and
:mod:`pyengine.linalg.results` (``TOL``, ``TOL_RADIUS``).
"""

from __future__ import annotations

import numpy as np

from ..backends import one_blas_thread
from ._dense_radius import dense_radii, use_dense
from .operators import BatchedOperator

# -- the solvers' tolerances, caps and sizes: every one of them lives here ---------------
#: Largest Krylov subspace of method="lanczos" (basis vectors kept per operator).
LANCZOS_MAX_SUBSPACE = 50
#: Ritz vectors kept across a thick restart of method="lanczos".
LANCZOS_KEEP = 20
#: Lanczos: alpha or beta below this fraction of the largest seen is a breakdown (an
#: invariant subspace was found; the next basis vector would be noise).
BREAKDOWN = 1e-14
#: Gram-Schmidt: a second pass for a vector whose norm fell below this fraction.
DGKS_ETA = 0.7071067811865476
#: From this many basis vectors on, Gram-Schmidt runs operator by operator (see _project_out).
GS_LOOP_MIN = 12
#: First Ritz test of method="lanczos" (product pairs), and the longest gap between tests.
LANCZOS_FIRST_TEST = 4
LANCZOS_TEST_GAP = 8
#: Compact the active set once this fraction of it has converged (a compaction copies
#: the operators' data, so doing it for every single converged operator costs more
#: than iterating a few finished ones a little longer; their results are frozen).
COMPACT_FRACTION = 0.125
#: spectral_radius: a residual that has not halved over this many power iterations
#: marks a dominant eigenvalue that power iteration cannot separate (complex or
#: tied pair, or a gap too small): that operator goes to Arnoldi.
STALL_WINDOW = 25
STALL_RATIO = 0.5
#: Arnoldi is asked for this fraction of tol, so that its answer passes our own
#: explicit residual test (ARPACK tests its Ritz estimate, not the residual).
ARNOLDI_TOL_FACTOR = 0.1

def _one_blas_thread():
    """Single-threaded BLAS for the many tiny dense problems (projected SVDs, Gram-Schmidt):
    threaded OpenBLAS on 40 x 40 matrices is slower by orders of magnitude on a busy machine."""
    return one_blas_thread()


def _rowdot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", a, b, dtype=np.float64)


def _relative_residual(rn: np.ndarray, scale: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """rn / scale, the reported residual; where scale = 0 (a zero Rayleigh quotient, or a zero
    sigma) it is 0 only for a provably zero operator (bound 0, and rn = 0), else inf.

    So ``converged`` is exactly ``residual <= tol`` in every solver: sigma = 0 is an
    answer only when the operator is known to be zero, and the residual says so.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(scale > 0, rn / np.where(scale > 0, scale, 1.0),
                        np.where((rn == 0) & (bound == 0), 0.0, np.inf))


def _unit_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a / |a| row by row, |a|) in float64; zero rows stay zero. |a| is taken of the row divided
    by its largest entry first, so rows of 1e-200 or 1e+200 neither underflow nor overflow."""
    a = a.astype(np.float64)
    top = np.abs(a).max(axis=1) if a.shape[1] else np.zeros(a.shape[0])
    safe = np.where(top > 0, top, 1.0)
    scaled = a / safe[:, None]
    n = np.sqrt(_rowdot(scaled, scaled))
    return scaled / np.where(n > 0, n, 1.0)[:, None], n * top


# -- power iteration on A^T A (generic operators) ------------------------------------
def _power(op: BatchedOperator, V0: np.ndarray, tol: float, max_iter: int, out: dict[str, np.ndarray]) -> None:
    """Batched power iteration on A^T A; fills ``out`` (arrays of shape (B,)) in place.

    Each step: U = A v, W = A^T U, sigma^2 = ||U||^2, residual ||W - sigma^2 v|| / sigma^2;
    an operator stops when its residual is <= tol, else v <- W / ||W||.
    """
    B, (m, n) = op.batch, op.shape
    dt = op.dtype
    ids = np.arange(B)  # global (within this call) index of each active row
    active_op, V = op, V0.astype(dt)
    U, W = np.empty((B, m), dt), np.empty((B, n), dt)
    done = np.zeros(B, bool)  # finished, but maybe not yet compacted away
    bound = op.upper_bound()
    for k in range(max_iter):
        a = len(ids)
        active_op.matvec(V, out=U[:a])
        # A^T is applied to the unit vector U/sigma, not to U, so that A^T A v (of size
        # sigma^2) cannot overflow (float32 operators with sigma ~ 1e20): the residual
        # ||A^T A v - sigma^2 v|| / sigma^2 = ||A^T (U/sigma) - sigma v|| / sigma.
        Un, sig = _unit_rows(U[:a])
        U[:a] = Un
        active_op.rmatvec(U[:a], out=W[:a])
        R = W[:a].astype(np.float64) - sig[:, None] * V
        res = _relative_residual(np.sqrt(_rowdot(R, R)), sig, bound[ids])
        live = ~done[ids]
        g = ids[live]
        out["sigma"][g] = sig[live]
        out["residual"][g] = res[live]
        out["iterations"][g] = k + 1
        conv = live & (res <= tol)
        out["converged"][ids[conv]] = True
        done[ids[conv]] = True
        Wn, wn = _unit_rows(W[:a])
        zero = wn == 0  # A^T A v = 0: v lies in the null space; restart elsewhere
        V[...] = Wn.astype(dt)
        if zero.any():
            fresh = np.random.default_rng([k, *ids[zero][:1].tolist()]).standard_normal((int(zero.sum()), n))
            V[zero] = (fresh / np.linalg.norm(fresh, axis=1, keepdims=True)).astype(dt)
        keep = ~done[ids]
        if not keep.any():
            break
        if (~keep).sum() >= max(1, COMPACT_FRACTION * a):
            sel = np.flatnonzero(keep)
            active_op, V, ids = active_op.take(sel), np.ascontiguousarray(V[sel]), ids[sel]
            a = len(ids)


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
        with _one_blas_thread():
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
        with _one_blas_thread():
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
            with _one_blas_thread():
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
            with _one_blas_thread():
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
def _arnoldi(op_i: BatchedOperator, v0: np.ndarray, tol: float, max_iter: int) -> tuple[complex, np.ndarray, int, bool]:
    """Dominant eigenpair of one operator by ARPACK (eigs, k=1, which="LM"); counts products."""
    from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigs

    n = op_i.shape[0]
    count = [0]

    def mv(v):
        count[0] += 1
        return op_i.matvec(np.reshape(v, (1, n)))[0].astype(np.float64)

    L = LinearOperator((n, n), matvec=mv, dtype=np.float64)
    try:
        vals, vecs = eigs(L, k=1, which="LM", tol=tol * ARNOLDI_TOL_FACTOR, v0=v0, maxiter=max_iter,
                          ncv=min(n, 20))
        ok = True
    except ArpackNoConvergence as exc:
        vals, vecs, ok = exc.eigenvalues, exc.eigenvectors, False
        if len(vals) == 0:
            return complex(np.nan), np.zeros(n, complex), count[0], False
    return complex(vals[0]), vecs[:, 0], count[0], ok


def _radius(op: BatchedOperator, V: np.ndarray, tol: float, max_iter: int) -> dict[str, np.ndarray]:
    """Dominant eigenvalue of every square operator of a batch; the fields of a SpectralRadiusResult.

    Power iteration on A with the Rayleigh quotient; an operator whose residual does
    not halve over STALL_WINDOW iterations, or that runs out of iterations, goes to
    :func:`_arnoldi` started from its current iterate (n < 3: dense eigenvalues).
    V : (B, n) float64 unit start vectors (overwritten by the iterates). Returns rho, eigenvalue, residual,
    iterations, converged, method and upper, each of shape (B,).
    """
    B, n = op.batch, op.shape[0]
    rho, lam = np.zeros(B), np.zeros(B, complex)
    residual, iters = np.full(B, np.inf), np.zeros(B, np.int64)
    converged, method = np.zeros(B, bool), np.full(B, "power", dtype="<U7")
    bound = op.upper_bound()
    hist = np.full((STALL_WINDOW, B), np.inf)  # residual history, a ring per operator
    ids, act = np.arange(B), op
    done = np.zeros(B, bool)
    fallback = np.zeros(B, bool)
    dt = op.dtype
    Vw = V.astype(dt)
    for k in range(max_iter if n >= 3 else 0):
        a = len(ids)
        W = act.matvec(Vw)
        lq = _rowdot(Vw, W)
        R = W - lq.astype(dt)[:, None] * Vw
        res = _relative_residual(np.sqrt(_rowdot(R, R)), np.abs(lq), bound[ids])
        live = ~done[ids]
        g = ids[live]
        rho[g], lam[g], residual[g], iters[g] = np.abs(lq[live]), lq[live], res[live], k + 1
        conv = live & (res <= tol)
        converged[ids[conv]] = True
        old = hist[k % STALL_WINDOW, ids]
        stalled = live & ~conv & (k >= STALL_WINDOW) & ~(res <= STALL_RATIO * old)
        hist[k % STALL_WINDOW, ids] = res
        fallback[ids[stalled]] = True
        done[ids[conv | stalled]] = True
        wn = np.sqrt(_rowdot(W, W))
        stuck = live & (wn == 0) & ~conv  # A v = 0 but A is not known to be zero
        fallback[ids[stuck]] = True
        done[ids[stuck]] = True
        Vw = W / np.where(wn == 0, 1.0, wn).astype(dt)[:, None]
        V[ids] = Vw
        keep = ~done[ids]
        if not keep.any():
            break
        if (~keep).sum() >= max(1, COMPACT_FRACTION * a):
            sel = np.flatnonzero(keep)
            act, ids, Vw = act.take(sel), ids[sel], np.ascontiguousarray(Vw[sel])
    fallback |= ~converged
    todo = np.flatnonzero(fallback)
    pairs = dict(zip(todo.tolist(), dense_radii(op, todo, _one_blas_thread))) if use_dense(n) and len(todo) else {}
    for i in todo:
        one = op.take(np.array([i]))
        if i in pairs:  # moderate n: the formed matrix and LAPACK (see _dense_radius)
            (val, x), used, name = pairs[i], n, "dense"
            ok = True
        elif n < 3:  # ARPACK needs n >= 3: the dense eigenvalues of a tiny operator
            dense = one.matvec(np.eye(n)).T.astype(np.float64)
            ev, vecs = np.linalg.eig(dense)
            top = int(np.argmax(np.abs(ev)))
            x, val, used, ok, name = vecs[:, top], ev[top], n, True, "dense"
        else:
            val, x, used, ok = _arnoldi(one, V[i].astype(np.float64), tol, max_iter)
            name = "arnoldi"
        iters[i] += used
        method[i] = name
        if not np.isfinite(val):
            converged[i], residual[i] = False, np.inf
            continue
        xr = np.stack([x.real, x.imag]).astype(np.float64)
        Ax = one.matvec(xr).astype(np.float64)
        Axc = Ax[0] + 1j * Ax[1]
        xn = np.linalg.norm(x)
        r = float(_relative_residual(np.array([np.linalg.norm(Axc - val * x)]), np.array([abs(val) * xn]),
                                     bound[i : i + 1])[0])
        rho[i], lam[i], residual[i] = abs(val), val, r
        # Our own explicit residual decides (ARPACK's flag tests its Ritz estimate only).
        converged[i] = r <= tol
    return {"rho": rho, "eigenvalue": lam, "residual": residual, "iterations": iters,
            "converged": converged, "method": method, "upper": np.maximum(bound, rho)}
