"""A Dask client for a sweep: a ``LocalCluster`` on 127.0.0.1, or an existing scheduler by address.

Ctrl-C. A terminal sends SIGINT to the whole process group, the workers of a
``LocalCluster`` included; a worker killed by it prints a traceback and its nanny logs
errors while the cluster closes. So the workers of :func:`local_client` ignore SIGINT
(a worker plugin: the client process alone turns Ctrl-C into KeyboardInterrupt, cancels
and closes the cluster), an interrupt while the cluster starts is held until it has
started (worker processes still starting then die of it, and print their own traceback),
and :func:`close_client` closes a client with SIGINT held, so a second Ctrl-C cannot leave a
half-closed cluster that keeps the process alive.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["close_client", "held_interrupts", "local_client"]


@contextlib.contextmanager
def held_interrupts() -> Iterator[list[int]]:
    """Hold SIGINT inside the block: the list it yields gets one entry per Ctrl-C, and no
    KeyboardInterrupt is raised there. Outside the main thread it holds nothing."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    old = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield got
    finally:
        signal.signal(signal.SIGINT, old)


def _ignore_interrupts() -> Any:
    """A worker plugin by which each worker process ignores SIGINT (see the module docstring);
    made here so that ``import pyengine`` does not import dask (pickled by value)."""
    from distributed import WorkerPlugin

    class IgnoreInterrupts(WorkerPlugin):
        name = "pyengine-ignore-sigint"

        def setup(self, worker: Any) -> None:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, signal.SIG_IGN)

    return IgnoreInterrupts()


def _quiet() -> None:
    logging.getLogger("distributed").setLevel(logging.CRITICAL)


def close_client(client: Any) -> bool:
    """Close ``client`` (and a ``LocalCluster`` it owns) with SIGINT held and Dask's shutdown
    logging quiet, in this process and in the workers of a cluster it owns (a worker still
    busy when its scheduler goes logs lost connections); True if a Ctrl-C arrived meanwhile
    (the caller decides what it means)."""
    log = logging.getLogger("distributed")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with held_interrupts() as got:
            if getattr(client, "cluster", None) is not None:
                with contextlib.suppress(Exception):
                    client.run(_quiet)
            client.close()
    finally:
        log.setLevel(level)
    return bool(got)


def local_client(workers: int = 2, *, scheduler: str | None = None, threads_per_worker: int = 1,
                 memory_limit: str | int = "auto", processes: bool = True) -> Any:
    """A ``dask.distributed.Client``.

    With ``scheduler`` (``"tcp://HOST:PORT"``) it connects to that cluster; otherwise it
    starts a ``LocalCluster`` of ``workers`` processes x ``threads_per_worker`` threads,
    bound to 127.0.0.1 only, no dashboard, owned by the client: ``client.close()`` (or leaving
    a ``with local_client() as client:`` block) stops it. ``memory_limit`` per worker (Dask's
    setting: the nanny restarts a worker that exceeds it). Its worker processes ignore SIGINT;
    a Ctrl-C while it starts raises KeyboardInterrupt once the cluster is closed again.
    """
    try:
        from distributed import Client
    except ImportError:
        raise ImportError("sweeps on Dask need dask.distributed: pip install 'pyengine[scale]'") from None
    if scheduler is not None:
        if not isinstance(scheduler, str) or "://" not in scheduler:
            raise ValueError(f"scheduler must be an address like tcp://HOST:PORT; got {scheduler!r}")
        return Client(scheduler, timeout="20s")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer; got {workers!r}")
    # The client starts (and on close() stops) its own LocalCluster: it owns it.
    with held_interrupts() as got:
        try:
            client = Client(n_workers=workers, threads_per_worker=threads_per_worker, processes=processes,
                            host="127.0.0.1", dashboard_address=None, memory_limit=memory_limit)
        except Exception:
            if got:  # the workers died of the Ctrl-C while they started
                raise KeyboardInterrupt from None
            raise
        if processes:
            client.register_plugin(_ignore_interrupts())
    if got:
        close_client(client)
        raise KeyboardInterrupt
    return client
