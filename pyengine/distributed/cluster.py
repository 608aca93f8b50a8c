"""A Dask client for a sweep: a ``LocalCluster`` on 127.0.0.1, or an existing scheduler by address.

Ctrl-C. A terminal sends SIGINT to the whole process group, the workers of a
``LocalCluster`` included; a worker killed by it prints a traceback and its nanny logs
errors while the cluster closes. So the worker processes of :func:`local_client` never see
SIGINT: they are started with SIGINT blocked (the signal mask of the threads that start them,
inherited through fork and exec, so a worker still importing cannot die of it), and a worker
plugin then ignores it; the client process alone turns Ctrl-C into KeyboardInterrupt, cancels
and closes the cluster. An interrupt while the cluster starts stops its worker processes at
once (the start then fails, quietly) and raises KeyboardInterrupt; :func:`close_client` closes a client
with SIGINT held, so a second Ctrl-C cannot leave a half-closed cluster that keeps the process
alive.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
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


@contextlib.contextmanager
def _blocked_for_children() -> Iterator[None]:
    """Block SIGINT in this thread inside the block: the threads it starts (Dask's event loop)
    and the processes they start inherit the mask. Leaving it delivers a SIGINT that arrived
    meanwhile to this process's handler (``held_interrupts`` records it). A no-op outside the
    main thread and where the platform has no ``pthread_sigmask``."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # multiprocessing's resource tracker unblocks SIGINT in the thread that first starts it (every
    # spawned process needs it): start it now, before the mask is set.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


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
    a Ctrl-C while it starts stops them and raises KeyboardInterrupt (within about a second).
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
    kw = dict(n_workers=workers, threads_per_worker=threads_per_worker, processes=processes, host="127.0.0.1",
              dashboard_address=None, memory_limit=memory_limit)
    with held_interrupts() as got:
        client = _start(Client, kw, got)
        if processes and not got:
            client.register_plugin(_ignore_interrupts())
    if got:
        if client is not None:
            close_client(client)
        raise KeyboardInterrupt
    return client


def _start(Client: Any, kw: dict[str, Any], got: list[int]) -> Any:
    """``Client(**kw)``, started in a thread with SIGINT blocked (its event loop and the worker
    processes inherit the mask) while this thread waits for it with SIGINT free: a Ctrl-C
    (recorded in ``got`` by :func:`held_interrupts`) stops the starting worker processes at once,
    so that the start fails fast and quietly. None if it failed after a Ctrl-C."""
    box: dict[str, Any] = {}
    before = set(multiprocessing.active_children())  # the caller's own processes are left alone

    def target() -> None:
        try:
            box["client"] = Client(**kw)
        except BaseException as exc:  # handed to the waiting thread
            box["error"] = exc

    with _blocked_for_children():
        thread = threading.Thread(target=target, name="pyengine-cluster-start", daemon=True)
        thread.start()
    while thread.is_alive():
        thread.join(0.02)
        if got:  # also the workers that start after the Ctrl-C
            _quiet()
            for proc in set(multiprocessing.active_children()) - before:
                proc.terminate()
    if "error" in box:
        if got:  # the workers were stopped by the Ctrl-C while they started
            return None
        raise box["error"]
    return box["client"]
