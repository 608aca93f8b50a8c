"""The iterative solvers behind :mod:`pyengine.linalg.spectral`, on batches of operators.

Private: :mod:`pyengine.linalg.spectral` validates the arguments, draws the start vectors,
splits a scan into chunks and wraps the arrays these functions fill into its result
classes; its docstring states what the results mean. Here:

* :func:`_power` -- batched power iteration on A^T A (sigma_max);
* :func:`~pyengine.linalg._lanczos._lanczos` (its own module) -- batched Golub-Kahan-Lanczos
  bidiagonalization with full reorthogonalization and thick restarts (sigma_max);
* :func:`_radius` -- batched power iteration on A (spectral radius), with
  :func:`_arnoldi` (ARPACK through :func:`scipy.sparse.linalg.eigs`) for the
  operators it cannot settle (after a search for an exact zero image, the answer rho = 0
  of a nilpotent operator), or, for n in [128, 2048], the dense eigenvalues
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
from ._dense_radius import dense_radii, use_dense, zero_images
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
#: Arnoldi computes this many eigenvalues of largest modulus and returns the largest of
#: them, in a Krylov space of ARNOLDI_NCV vectors (both capped by n). Asked for one, ARPACK
#: often settles on another eigenvalue of the rim when several lie close to the dominant
#: one in modulus; ten in a space of 40 do not, at about the same number of products
#: (docs/design.md).
ARNOLDI_WANTED = 10
ARNOLDI_NCV = 40


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


def _arnoldi(op_i: BatchedOperator, v0: np.ndarray, tol: float, max_iter: int) -> tuple[complex, np.ndarray, int, bool]:
    """Dominant eigenpair of one operator by ARPACK (eigs, which="LM"): the largest in modulus of
    the ARNOLDI_WANTED it computes (see there why not k=1); counts products."""
    from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigs

    n = op_i.shape[0]
    count = [0]

    def mv(v):
        count[0] += 1
        return op_i.matvec(np.reshape(v, (1, n)))[0].astype(np.float64)

    L = LinearOperator((n, n), matvec=mv, dtype=np.float64)
    ncv = min(n, ARNOLDI_NCV)
    try:
        vals, vecs = eigs(L, k=min(ARNOLDI_WANTED, ncv - 2), which="LM", tol=tol * ARNOLDI_TOL_FACTOR, v0=v0,
                          maxiter=max_iter, ncv=ncv)
        ok = True
    except ArpackNoConvergence as exc:
        vals, vecs, ok = exc.eigenvalues, exc.eigenvectors, False
        if len(vals) == 0:
            return complex(np.nan), np.zeros(n, complex), count[0], False
    top = int(np.argmax(np.abs(vals)))
    return complex(vals[top]), vecs[:, top], count[0], ok


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
        wn = np.sqrt(_rowdot(W, W))
        # A v = 0: (0, v) is an exact eigenpair (from a random start, A is nilpotent: rho = 0)
        res = np.where(wn == 0, 0.0, _relative_residual(np.sqrt(_rowdot(R, R)), np.abs(lq), bound[ids]))
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
    pairs = dict(zip(todo.tolist(), dense_radii(op, todo, one_blas_thread))) if use_dense(n) and len(todo) else {}
    # ARPACK's Ritz values of a nilpotent operator are pseudo-eigenvalues far from 0 with tiny
    # residuals; only its power sequence reaching an exact zero image certifies rho = 0. So every
    # operator bound for Arnoldi first continues its power sequence, for at most n products (as
    # many as forming the matrix would take; matrix-free, batched); V is not changed.
    rest = todo[[i not in pairs for i in todo.tolist()]] if n >= 3 else todo[:0]
    nil = dict(zip(rest.tolist(), zip(*zero_images(op.take(rest), V[rest], n)))) if len(rest) else {}
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
            x, found, used = nil[i]
            if found:
                val, ok, name = 0j, True, "power"
            else:
                val, x, more, ok = _arnoldi(one, V[i].astype(np.float64), tol, max_iter)
                used, name = used + more, "arnoldi"
        iters[i] += used
        method[i] = name
        if not np.isfinite(val):
            converged[i], residual[i] = False, np.inf
            continue
        xr = np.stack([x.real, x.imag]).astype(np.float64)
        Ax = one.matvec(xr).astype(np.float64)
        Axc = Ax[0] + 1j * Ax[1]
        xn, rn = np.linalg.norm(x), np.linalg.norm(Axc - val * x)
        # A x = 0 exactly: (0, x) is an exact eigenpair
        r = 0.0 if val == 0 and rn == 0 else float(
            _relative_residual(np.array([rn]), np.array([abs(val) * xn]), bound[i : i + 1])[0])
        rho[i], lam[i], residual[i] = abs(val), val, r
        # Our own explicit residual decides (ARPACK's flag tests its Ritz estimate only), and
        # an Arnoldi run that stopped before all ARNOLDI_WANTED converged has not converged: the
        # largest of the eigenvalues it has may not be the dominant one, whatever its residual.
        converged[i] = ok and r <= tol
    return {"rho": rho, "eigenvalue": lam, "residual": residual, "iterations": iters,
            "converged": converged, "method": method, "upper": np.maximum(bound, rho)}
