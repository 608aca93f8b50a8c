"""Ctrl-C of ``pyengine scan`` on a 2-worker LocalCluster: SIGINT to the whole process group
(as a terminal sends it) at several moments ends the run within seconds, with exit status
130 and one line on stderr, and every point file in the store is whole.

The moments are read from the store: its manifest (the cluster has started, no point is
done yet), half of the point files, all of them (the cluster is closing); and from the process
table: fixed delays after the first worker process appears (the cluster is starting).
"""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from pyengine.distributed import Store

pytestmark = pytest.mark.slow

POINTS = 16
DEADLINE_S = 5.0


def _files(out):
    try:
        return [n for n in os.listdir(out / "points") if n.endswith(".npz") and not n.startswith(".")]
    except FileNotFoundError:
        return []


def _interrupt(tmp_path, ready, what, points=POINTS):
    """Start a 2-worker scan of ``points`` points into tmp_path/D, send SIGINT to its process group
    once ``ready(proc)`` holds, and check the end: within DEADLINE_S, exit status 130, one line, no
    traceback."""
    cmd = [sys.executable, "-m", "pyengine", "scan", "norms", "--points", str(points), "--tokens", "2000", "--d",
           "512", "--chunk", "1", "--workers", "2", "--progress", "never", "--out", str(tmp_path / "D")]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    t0 = time.monotonic()
    try:
        while proc.poll() is None and not ready(proc) and time.monotonic() - t0 < 240:
            time.sleep(0.005)
        assert proc.poll() is None, f"the scan ended before the moment {what}: {proc.communicate()}"
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    print(f"{what}: ended {took:.2f} s after SIGINT")
    assert took < DEADLINE_S, f"the scan took {took:.1f} s to end after Ctrl-C"
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    assert line.startswith("pyengine: interrupted; "), err
    return line


@pytest.mark.parametrize("moment", ["manifest", "half", "last"])
def test_ctrl_c_of_a_two_worker_scan(tmp_path, moment):
    out = tmp_path / "D"
    target = {"manifest": 0, "half": POINTS // 2, "last": POINTS}[moment]
    line = _interrupt(tmp_path, lambda proc: (out / "manifest.json").exists() and len(_files(out)) >= target,
                      moment)
    kept = sorted(_files(out))
    assert (f"the {len(kept)} finished point(s) are in the store" in line) if kept else "no point had finished" in line
    store = Store(out)
    for name in kept:
        assert store.read(int(name[:-4]))["sigma"].shape == (2000,)
    if moment == "last":
        assert len(kept) == POINTS


def _workers(pid):
    """The worker processes started so far (spawned by multiprocessing; its resource tracker is not one)."""
    import psutil  # a dependency of dask.distributed

    out = []
    for child in psutil.Process(pid).children():
        with contextlib.suppress(psutil.Error):
            if "spawn_main" in " ".join(child.cmdline()):
                out.append(child)
    return out


@pytest.mark.parametrize("after_s", [0.0, 0.2, 0.5, 1.0])
def test_ctrl_c_while_the_cluster_starts(tmp_path, after_s):
    """SIGINT at fixed delays after the first worker process appears (workers still importing, the
    cluster connecting): no worker's traceback, and the start does not run to its end first."""
    first: list[float] = []

    def ready(proc):
        if not first and _workers(proc.pid):
            first.append(time.monotonic())
        return bool(first) and time.monotonic() - first[0] >= after_s

    # 8x the points: on a quiet machine the 16-point scan can be over 1 s after its first worker
    # appears, so that the signal would find the interpreter shutting down, not the cluster starting
    line = _interrupt(tmp_path, ready, f"{after_s} s after the first worker started", points=8 * POINTS)
    assert "point" in line
