"""pyengine.scan on a 2-worker LocalCluster bound to 127.0.0.1 (processes, one thread each).

One cluster for the module; the killed-worker test runs last. Together well under a minute.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from pyengine.distributed import local_client, scan

NORMS = {"seeds": list(range(40)), "scales": [1.0], "tokens": 256, "d": 256, "method": "power"}
TINY = {"model": "tiny", "tokens": 512, "seq_len": 64, "method": "power"}


@pytest.fixture(scope="module")
def client():
    c = local_client(2, threads_per_worker=1, processes=True)
    try:
        c.wait_for_workers(2, timeout=60)
        yield c
    finally:
        cluster = c.cluster
        c.close()
        cluster.close()


def _loads(client):
    from pyengine.distributed.worker import loads

    return client.run(loads)


def test_cluster_is_local_and_two_single_thread_workers(client):
    addrs = list(client.nthreads())
    assert len(addrs) == 2 and all(a.startswith("tcp://127.0.0.1:") for a in addrs)
    assert client.scheduler.address.startswith("tcp://127.0.0.1:")
    assert set(client.nthreads().values()) == {1}


def test_cluster_gives_the_in_process_bits(client, tmp_path):
    local = scan("spectral", TINY)
    remote = scan("spectral", TINY, client=client, out=tmp_path / "s", chunk=1)
    assert remote.complete and remote.tasks == 8
    assert np.array_equal(local.metrics["sigma"], remote.metrics["sigma"])
    assert sorted(_loads(client).values()) == [1, 1]  # the model is loaded once per worker, not per task
    grid = {"model": "tiny", "prompts": ["hello world", "the cat sat on the mat"], "layers": [0, 2],
            "linearized": True}
    a, b = scan("recovery", grid), scan("recovery", grid, client=client, chunk=1)
    for k in a.metrics:
        assert np.array_equal(a.metrics[k], b.metrics[k], equal_nan=True), k


def test_failing_points_on_the_cluster(client, tmp_path):
    grid = {**NORMS, "seeds": list(range(6)), "scales": [1.0, 1e39]}
    res = scan("norms", grid, client=client, out=tmp_path / "s", chunk=4)
    assert sorted(e["index"] for e in res.errors) == [1, 3, 5, 7, 9, 11]
    assert not res.missing and np.isfinite(res.metrics["sigma"][:, 0]).all()


def test_a_killed_worker_loses_nothing(client, tmp_path):
    local = scan("norms", NORMS)
    pids = client.run(os.getpid)
    killed = []

    def kill_one(done, total):
        if not killed and 0 < done < total:
            victim = sorted(pids.values())[0]
            os.kill(victim, signal.SIGKILL)
            killed.append((victim, done))

    res = scan("norms", NORMS, client=client, out=tmp_path / "s", chunk=4, progress=kill_one)
    assert killed and killed[0][1] < len(local.points)
    assert res.complete
    assert np.array_equal(res.metrics["sigma"], local.metrics["sigma"])
    client.wait_for_workers(2, timeout=60)
    assert killed[0][0] not in client.run(os.getpid).values()  # the nanny started a new process
