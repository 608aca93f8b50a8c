"""Cost of sweeps on Dask: per-task overhead and spectral-scan throughput against workers.

    python benchmarks/scripts/distributed_overhead.py                   # both parts, defaults below
    python benchmarks/scripts/distributed_overhead.py --part overhead --repeats 5
    python benchmarks/scripts/distributed_overhead.py --part spectral --tokens 100000 --workers 1 2

Part "overhead": 1000 small tasks of the ``norms`` job (``--task-tokens`` x ``--task-d``
tokens each), as (a) a plain in-process loop over ``job.run``, (b) ``scan`` in-process,
(c) ``scan`` on a 2-worker LocalCluster (default chunks), (d) the same with one point per
task (the per-task cost of Dask). Cluster start-up is timed separately and not included.

Part "spectral": sigma_max of every LayerNorm of all-MiniLM-L6-v2 over ``--tokens`` tokens
(windows of 128), in-process (all threads, and one thread as a worker has) and on
LocalClusters of each ``--workers`` count; tokens/s and tokens/s per worker. The model
load and kernel warm-up on the workers happen in a first, untimed warm-up scan.

Times are medians of ``--repeats`` after one untimed call. Workers are processes x 1 thread on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
from _common import median_s as _median


def overhead(args: argparse.Namespace) -> None:
    from pyengine.distributed import get_job, local_client, scan

    grid = {"seeds": list(range(args.tasks)), "tokens": args.task_tokens, "d": args.task_d}
    job = get_job("norms")
    params, points, inputs = job.plan(grid)
    job.run(params, points[0], inputs[0])  # warm the kernels in this process
    loop = _median(lambda: [job.run(params, p, i) for p, i in zip(points, inputs)], args.repeats)
    inproc = _median(lambda: scan("norms", grid), args.repeats)
    inproc_st = _median(lambda: scan("norms", grid, out=tempfile.mkdtemp() + "/s"), args.repeats)
    t0 = time.perf_counter()
    client = local_client(2)
    client.wait_for_workers(2)
    start = time.perf_counter() - t0
    try:
        scan("norms", {**grid, "seeds": list(range(8))}, client=client, chunk=1)  # warm the workers
        clus = _median(lambda: scan("norms", grid, client=client), args.repeats)
        stored = _median(lambda: scan("norms", grid, client=client, out=tempfile.mkdtemp() + "/s"), args.repeats)
        one = _median(lambda: scan("norms", grid, client=client, chunk=1), max(1, args.repeats // 2))
    finally:
        cluster = client.cluster
        client.close()
        cluster.close()
    n = args.tasks
    print(f"overhead: {n} tasks of norms ({args.task_tokens} tokens x d={args.task_d}), medians of {args.repeats}")
    print(f"  plain loop in-process          {loop * 1e3:9.1f} ms  ({loop / n * 1e6:.1f} us/task)")
    print(f"  scan in-process                {inproc * 1e3:9.1f} ms  ({inproc / loop:.2f}x loop)")
    print(f"  scan in-process + store        {inproc_st * 1e3:9.1f} ms  ({inproc_st / loop:.2f}x loop)")
    print(f"  scan 2-worker cluster          {clus * 1e3:9.1f} ms  ({clus / loop:.2f}x loop)   <- target <= 1.3x")
    print(f"  scan 2-worker cluster + store  {stored * 1e3:9.1f} ms  ({stored / loop:.2f}x loop, {stored / inproc_st:.2f}x in-process + store)")
    print(f"  one point per task (chunk=1)   {one * 1e3:9.1f} ms  ({one / loop:.2f}x loop; "
          f"per-task cost ~{max(one - loop / 2, 0) / n * 1e3:.2f} ms on 2 workers)")
    print(f"  cluster start-up (not included) {start:.2f} s")


def spectral(args: argparse.Namespace) -> None:
    import pyengine
    from pyengine.distributed import local_client, scan

    grid = {"model": "all-MiniLM-L6-v2", "tokens": args.tokens, "seq_len": 128}
    warm = {**grid, "tokens": 1024}
    scan("spectral", warm)
    from threadpoolctl import threadpool_limits

    T = args.tokens
    print(f"spectral: every LayerNorm of all-MiniLM-L6-v2 (13 sites) over {T} tokens, medians of {args.repeats}")
    t_all = float("nan")
    if not args.skip_all_threads:  # pathological on an oversubscribed machine (OpenBLAS threads spin)
        t_all = _median(lambda: scan("spectral", grid), args.repeats)
        print(f"  in-process, all threads        {T / t_all:10.0f} tokens/s")
    with pyengine.num_threads(1), threadpool_limits(1):  # what one worker process has
        t_one = _median(lambda: scan("spectral", grid), args.repeats)
    print(f"  in-process, 1 thread           {T / t_one:10.0f} tokens/s")
    for w in args.workers:
        client = local_client(w)
        client.wait_for_workers(w)
        try:
            scan("spectral", warm, client=client, chunk=1)  # model load + warm-up on each worker
            t = _median(lambda: scan("spectral", grid, client=client), args.repeats)
        finally:
            cluster = client.cluster
            client.close()
            cluster.close()
        per = T / t / w
        print(f"  {w} worker(s)                    {T / t:10.0f} tokens/s, {per:10.0f} per worker "
              f"({per / (T / t_all):.0%} of all-thread, {per / (T / t_one):.0%} of 1-thread in-process)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["overhead", "spectral", "both"], default="both")
    p.add_argument("--tasks", type=int, default=1000)
    p.add_argument("--task-tokens", type=int, default=64)
    p.add_argument("--task-d", type=int, default=64)
    p.add_argument("--tokens", type=int, default=100_000)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-all-threads", action="store_true", help="skip the all-threads in-process run")
    args = p.parse_args()
    np.seterr(all="ignore")
    if args.part in ("overhead", "both"):
        overhead(args)
    if args.part in ("spectral", "both"):
        spectral(args)


if __name__ == "__main__":
    main()
