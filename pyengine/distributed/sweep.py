"""``pyengine.scan``: run a job over a grid, in-process or on a Dask cluster, into a store.

::

    res = pyengine.scan("spectral", {"model": "all-MiniLM-L6-v2", "tokens": 100_000},
                        client=client, out="scan-minilm")
    res = pyengine.scan.load("scan-minilm")      # the same ScanResult, from disk
    res.metrics["sigma"]                          # one array per metric

How a sweep runs: the job checks the grid and expands it into points (a malformed
grid raises before anything is submitted); points already stored in ``out`` are
skipped; the rest are grouped into chunks (tasks) of ``chunk`` points, by default
from the byte budget (below) and about four tasks per worker thread, so that tiny
points do not each pay the scheduler's per-task cost. Each task computes its points
one by one and writes each point's file as soon as it is done, so a task that is
retried after its worker died recomputes only the points it had not yet stored.

Faults. A worker that dies mid-task: the Dask scheduler reschedules the task on
another worker (up to ``distributed.scheduler.allowed-failures`` times, default 3);
the sweep completes. A point whose computation raises is recorded (``errors``: its
index, grid point and message) and the rest of its chunk and of the sweep go on.

Damage. With ``resume`` a stored point whose file is damaged (empty, truncated, not the
arrays written: :meth:`Store.read`) is moved aside, recomputed and listed in
:attr:`ScanResult.damaged`; :func:`load` raises a ValueError naming such a file.

Memory. ``memory_budget`` (bytes, default 256 MiB) bounds what one task holds at a
time: the chunk's input arrays plus one point's working memory as estimated by the
job (:meth:`Job.point_bytes`); ``chunk`` is at most ``budget // point_bytes`` points,
and a point bigger than the budget is an error before any task runs. Results are
written per point, never accumulated.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .jobs import Job, get_job
from .store import DamagedFile, Store

__all__ = ["MEMORY_BUDGET", "ScanResult", "load", "run_chunk", "scan"]

#: Default bytes one task may hold at a time (chunk inputs + one point's working memory).
MEMORY_BUDGET = 256 << 20
#: Default tasks per worker thread when ``chunk`` is not given (load balance vs per-task cost).
TASKS_PER_THREAD = 4


@dataclasses.dataclass
class ScanResult:
    """A sweep's results: ``metrics`` (name -> array, from :meth:`Job.combine`), the grid
    ``points``, ``params``, ``errors`` (failed points), ``missing`` (indices not stored),
    the store folder ``out`` (None in memory), timing of the run (``seconds``, ``tasks``), and
    ``damaged``: the damaged point files a resumed run set aside and recomputed (index -> message)."""

    job: str
    params: dict[str, Any]
    points: list[dict[str, Any]]
    metrics: dict[str, np.ndarray]
    errors: list[dict[str, Any]]
    missing: list[int]
    out: str | None = None
    seconds: float = 0.0
    tasks: int = 0
    computed: int = 0
    damaged: dict[int, str] = dataclasses.field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.missing and not self.errors


def run_chunk(job: Job, params: dict[str, Any], items: list[tuple[int, dict[str, Any], dict[str, np.ndarray]]],
              out: str | None) -> list[tuple[int, str | None, dict[str, np.ndarray] | None]]:
    """Compute the points ``items`` ((index, point, inputs) each) of one task.

    Runs on a worker (or in-process). With ``out`` each point's arrays are written to the
    store as soon as they are computed and points already stored are skipped (a retried
    task); without it they are returned. Returns (index, error message or None, arrays or None).
    """
    store = Store(out) if out is not None else None
    done: list[tuple[int, str | None, dict[str, np.ndarray] | None]] = []
    for index, point, inputs in items:
        if store is not None and os.path.exists(store.point_path(index)):
            done.append((index, None, None))
            continue
        try:
            arrays = job.run(params, point, inputs)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:  # a bad point is reported, and the chunk goes on
            done.append((index, f"{type(exc).__name__}: {exc}", None))
            continue
        if store is not None:
            store.write(index, arrays)
            done.append((index, None, None))
        else:
            done.append((index, None, arrays))
    return done


def _threads(client: Any) -> int:
    try:
        return max(1, sum(client.nthreads().values()))
    except Exception:
        return 1


def _bytes(n: int) -> str:
    """``n`` bytes in a readable unit: "512 bytes", "3.0 KiB", "1.5 MiB", "2.0 GiB"."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


def _chunk_size(job: Job, params: dict[str, Any], points: list[dict[str, Any]], inputs: list[dict[str, np.ndarray]],
                chunk: int | None, budget: int, threads: int) -> int:
    work = max(job.point_bytes(params, p) for p in points)
    inp = max(sum(a.nbytes for a in i.values()) for i in inputs)
    if work + inp > budget:
        raise ValueError(f"one grid point needs about {_bytes(work + inp)}, more than memory_budget = "
                         f"{_bytes(budget)}; raise memory_budget or make the points smaller")
    cap = max(1, (budget - work) // max(inp, 1))
    if chunk is None:
        chunk = max(1, -(-len(points) // (TASKS_PER_THREAD * threads)))
    elif isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer (points per task); got {chunk!r}")
    return int(min(chunk, cap))


def scan(job: str | Job, grid: Mapping[str, Any], *, client: Any = None, out: str | os.PathLike[str] | None = None,
         chunk: int | None = None, resume: bool = False, memory_budget: int = MEMORY_BUDGET,
         retries: int = 2, progress: Callable[[int, int], Any] | None = None,
         provenance: dict[str, Any] | None = None) -> ScanResult:
    """Run ``job`` over ``grid`` and return its :class:`ScanResult`.

    Parameters
    ----------
    job : str or Job
        A registered job name (``"spectral"``, ``"recovery"``, ``"norms"``, ``"attention"``,
        ``"stability"``: :data:`pyengine.distributed.JOBS`) or a :class:`Job`.
    grid : dict
        The job's parameters; its axes are sequences (see the job's docstring).
    client : dask.distributed.Client, optional
        Run the tasks on this cluster; default: in this process, one task after another.
    out : path, optional
        The store folder (module :mod:`pyengine.distributed.store`); default: keep the
        results in memory (no resume). On a remote cluster ``out`` must be a folder
        every worker can write (a shared file system).
    chunk : int, optional
        Points per task; default about four tasks per worker thread, capped by the budget.
    resume : bool
        Continue a sweep already in ``out`` (same job and grid): stored points are not recomputed.
    memory_budget : int
        Bytes one task may hold at a time (module docstring).
    retries : int
        Extra tries of a task whose worker raised outside a point (Dask's ``retries``).
    progress : callable(done, total), optional
        Called after every finished task with points done and the total.
    provenance : dict, optional
        The ``provenance`` block of ``out``'s manifest (default
        :func:`pyengine.provenance.provenance` with the grid's model name).
    """
    t0 = time.perf_counter()
    j = get_job(job)
    params, points, inputs = j.plan(grid)
    if not points:
        raise ValueError("grid has no points")
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget <= 0:
        raise ValueError(f"memory_budget must be a positive number of bytes; got {memory_budget!r}")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be callable(done, total); got {type(progress).__name__}")
    size = _chunk_size(j, params, points, inputs, chunk, memory_budget, _threads(client) if client else 1)
    store = None
    damaged: dict[int, str] = {}
    todo = list(range(len(points)))
    if out is not None:
        store = Store(out)
        store.create(j.name, params, points, resume=resume, content=inputs, provenance=provenance)
        damaged = store.damaged(len(points)) if resume else {}
        for i in damaged:
            store.set_aside(i)
        have = store.done(len(points))
        todo = [i for i in todo if i not in have]
    elif resume:
        raise ValueError("resume=True needs out (the store folder to resume)")
    chunks = [[(i, points[i], inputs[i]) for i in todo[a:a + size]] for a in range(0, len(todo), size)]
    where = None if store is None else store.path
    results: dict[int, dict[str, np.ndarray]] = {}
    errors: dict[int, str] = {}
    total, finished = len(points), len(points) - len(todo)
    if progress is not None:
        progress(finished, total)

    def collect(rows: list[tuple[int, str | None, dict[str, np.ndarray] | None]]) -> None:
        nonlocal finished
        for index, err, arrays in rows:
            if err is not None:
                errors[index] = err
            elif arrays is not None:
                results[index] = arrays
        finished += len(rows)
        if progress is not None:
            progress(finished, total)

    try:
        if client is None:
            for c in chunks:
                collect(run_chunk(j, params, c, where))
        else:
            from distributed import as_completed

            futures = [client.submit(run_chunk, j, params, c, where, pure=False, retries=retries) for c in chunks]
            try:
                for fut in as_completed(futures):
                    collect(fut.result())
            finally:
                client.cancel(futures)
    finally:
        if store is not None:
            try:
                old = {e["index"]: e for e in store.errors() if e["index"] not in results}
            except DamagedFile:  # rewritten below; the points it listed are not done, so they were rerun
                old = {}
            for i, msg in errors.items():
                old[i] = {"index": i, "point": points[i], "error": msg}
            done = store.done(len(points))
            store.write_errors([e for i, e in sorted(old.items()) if i not in done])
    res = _result(j, params, points, store, results, errors)
    res.seconds, res.tasks, res.computed = time.perf_counter() - t0, len(chunks), len(todo)
    res.damaged = damaged
    return res


def _result(j: Job, params: dict[str, Any], points: list[dict[str, Any]], store: Store | None,
            results: dict[int, dict[str, np.ndarray]], errors: dict[int, str]) -> ScanResult:
    if store is not None:
        have = store.done(len(points))
        rows = [store.read(i) if i in have else None for i in range(len(points))]
        errs = store.errors()
    else:
        rows = [results.get(i) for i in range(len(points))]
        errs = [{"index": i, "point": points[i], "error": m} for i, m in sorted(errors.items())]
    failed = {e["index"] for e in errs}
    missing = [i for i, r in enumerate(rows) if r is None and i not in failed]
    return ScanResult(j.name, params, points, j.combine(params, points, rows), errs, missing,
                      None if store is None else store.path)


def load(out: str | os.PathLike[str]) -> ScanResult:
    """The :class:`ScanResult` of the sweep stored in ``out`` (finished or not)."""
    store = Store(out)
    m = store.manifest()
    j = get_job(m["job"])
    params = m["params"]
    return _result(j, params, m["points"], store, {}, {})

