"""Seeds of :func:`~pyengine.experiments.attention_dynamics.attention_dynamics` in worker processes.

Each worker is a spawned process (not forked: the parent's OpenMP and BLAS thread pools do
not survive a fork) that runs (seed, arm) tasks with one BLAS thread (threadpoolctl) and
one kernel thread (:func:`pyengine.set_num_threads`), so ``workers`` processes use
``workers`` cores. A task computes what the serial run computes, and the kernels' results
do not depend on their thread count: the report is bit-for-bit the serial report. With
spawn, a script that sets ``workers`` > 1 needs the ``if __name__ == "__main__":`` guard. Progress comes back
through a queue, 25 steps at a time.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import queue as queue_mod
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["run_seeds"]

_TICKS = 25
_QUEUE: Any = None


def _init(q: Any) -> None:
    global _QUEUE
    _QUEUE = q
    from threadpoolctl import threadpool_limits

    from ..backends import set_num_threads

    threadpool_limits(1)
    set_num_threads(1)


def _work(run_seed: Callable[..., dict], seed: int, arm: str, cfg: dict) -> tuple[int, str, dict]:
    from threadpoolctl import threadpool_limits

    count = [0]

    def tick(label: str) -> None:
        count[0] += 1
        if count[0] == _TICKS:
            _QUEUE.put((label, count[0]))
            count[0] = 0

    with threadpool_limits(1):  # BLAS loaded after the initializer (scipy's) is limited too
        out = run_seed(seed, (arm,), cfg, tick=tick)[arm]
    if count[0]:
        _QUEUE.put((f"seed {seed} arm {arm}", count[0]))
    return seed, arm, out


def run_seeds(run_seed: Callable[..., dict], tasks: Sequence[tuple[int, str]], cfg: dict, workers: int,
              tick: Callable[..., None], record: Callable[[int, str, dict], Any]) -> None:
    """Run the (seed, arm) ``tasks`` by ``run_seed(seed, (arm,), cfg)`` (a module-level function: it is
    pickled by name) in ``workers`` processes, calling ``record(seed, arm, run)`` here as each finishes.

    A task depends on its seed only (the data and the initialization are drawn from it); the
    M-step tasks go first (the longest), so that 5 seeds x 3 arms keep 2 workers busy to the end.

    ``tick(label, n)`` reports n finished steps. On KeyboardInterrupt (or an exception from
    ``record``) the pending tasks are cancelled, the workers stopped, and the exception re-raised.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    pool = cf.ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=ctx, initializer=_init,
                                  initargs=(q,))
    try:
        rank = {a: i for i, a in enumerate(dict.fromkeys(a for _, a in tasks))}  # arm by arm, M-step first
        order = sorted(tasks, key=lambda t: (t[1] != "m_step", rank[t[1]]))
        pending = {pool.submit(_work, run_seed, s, a, cfg) for s, a in order}
        while pending:
            done, pending = cf.wait(pending, timeout=0.2, return_when=cf.FIRST_COMPLETED)
            _drain(q, tick)
            for f in done:
                record(*f.result())
        _drain(q, tick)
    except BaseException:
        for p in list(getattr(pool, "_processes", {}).values()):  # stop running seeds now, not at their end
            p.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _drain(q: Any, tick: Callable[..., None]) -> None:
    while True:
        try:
            label, n = q.get_nowait()
        except queue_mod.Empty:
            return
        tick(label, n)
