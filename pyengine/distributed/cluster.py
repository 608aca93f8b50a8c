"""A Dask client for a sweep: a ``LocalCluster`` on 127.0.0.1, or an existing scheduler by address."""

from __future__ import annotations

from typing import Any

__all__ = ["local_client"]


def local_client(workers: int = 2, *, scheduler: str | None = None, threads_per_worker: int = 1,
                 memory_limit: str | int = "auto", processes: bool = True) -> Any:
    """A ``dask.distributed.Client``.

    With ``scheduler`` (``"tcp://HOST:PORT"``) it connects to that cluster; otherwise it
    starts a ``LocalCluster`` of ``workers`` processes x ``threads_per_worker`` threads,
    bound to 127.0.0.1 only, no dashboard, owned by the client: ``client.close()`` (or leaving
    a ``with local_client() as client:`` block) stops it. ``memory_limit`` per worker (Dask's
    setting: the nanny restarts a worker that exceeds it).
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
    return Client(n_workers=workers, threads_per_worker=threads_per_worker, processes=processes,
                  host="127.0.0.1", dashboard_address=None, memory_limit=memory_limit)
