"""The BLAS library under the C++ linear kernels, and NumPy's BLAS threads around them.

``pyengine.kernels._blas.find``: NumPy's OpenBLAS, MKL from the ``mkl`` extra, the choice by
``PYENGINE_BLAS`` (a bad value fails every compiled call), the reasons it falls back; each
library's products against the reference in a process of its own (the library is chosen
once per process); NumPy's thread count untouched by the kernels; ``matmul_one_thread``
(numpy's product with NumPy's OpenBLAS held to one thread, the count restored under
concurrent callers).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from conftest import require
from helpers import assert_close
from pyengine.kernels import _blas
from pyengine.kernels import linear as L


def _python(code: str, choice: str, cwd) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with PYENGINE_BLAS=choice. cwd elsewhere than the
    checkout: from there ``python -c`` would import its pyengine/, not the installed one."""
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYENGINE_BLAS=choice),
                          capture_output=True, text=True, timeout=300, cwd=cwd)


def _numpy_blas_threads():
    from threadpoolctl import threadpool_info

    libs = [i for i in threadpool_info() if i["internal_api"] == "openblas" and "numpy" in i["filepath"]]
    return libs[0]["num_threads"] if libs else None


def test_the_finder_says_why_it_falls_back(monkeypatch):
    import threadpoolctl

    monkeypatch.setattr(threadpoolctl, "threadpool_info", lambda: [
        {"user_api": "blas", "internal_api": "mkl", "filepath": "/x/libmkl_rt.so", "version": "2024"}])
    s, d, local, _, why = _blas.find()
    assert (s, d, local) == (0, 0, 0) and "mkl" in why and why.startswith("numpy matmul")
    monkeypatch.setattr(threadpoolctl, "threadpool_info", lambda: [])
    assert _blas.find()[:3] == (0, 0, 0)


def _numpy_has_openblas() -> bool:
    return not isinstance(_blas._numpy_openblas(), str)


def test_the_finder_finds_numpys_openblas(monkeypatch):
    if not _numpy_has_openblas():
        pytest.skip("NumPy's BLAS is not OpenBLAS here")
    monkeypatch.setenv("PYENGINE_BLAS", "openblas")
    s, d, local, _, why = _blas.find()
    assert s and d and local and why.startswith("OpenBLAS")
    monkeypatch.setattr(_blas, "_mkl_path", lambda: None)  # auto without the mkl package
    monkeypatch.setenv("PYENGINE_BLAS", "auto")
    assert _blas.find()[4] == why
    monkeypatch.setenv("PYENGINE_BLAS", "mkl")  # asked for, missing: OpenBLAS, and the reason
    got = _blas.find()
    assert got[:4] == (s, d, local, _) and got[4].startswith("OpenBLAS") and "mkl package is not installed" in got[4]


def test_the_finder_takes_mkl_when_installed(monkeypatch):
    if _blas._mkl_path() is None or not _numpy_has_openblas():
        pytest.skip("the mkl package (the mkl extra) is not installed, or NumPy's BLAS is not OpenBLAS")
    monkeypatch.setattr(_blas, "_cpu_vendor", lambda: "GenuineIntel")
    for choice in ("auto", " MKL ", ""):
        monkeypatch.setenv("PYENGINE_BLAS", choice)
        s, d, local, ilp64, why = _blas.find()
        assert s and d and local and not ilp64 and why.startswith("MKL 20"), why
    if L.blas_info().startswith("MKL"):  # this process's kernels took it: numpy's threads untouched
        assert "sequential" in L.blas_info()


@pytest.mark.parametrize("vendor", ["AuthenticAMD", ""])
def test_the_finder_leaves_mkl_to_intel_cpus_unless_asked(monkeypatch, vendor):
    # MKL's sgemm measured slower than OpenBLAS's on AMD Zen 4 (docs/design.md):
    # auto keeps OpenBLAS there (and where the vendor is unknown) and says why; mkl still takes it.
    if _blas._mkl_path() is None or not _numpy_has_openblas():
        pytest.skip("the mkl package (the mkl extra) is not installed, or NumPy's BLAS is not OpenBLAS")
    monkeypatch.setattr(_blas, "_cpu_vendor", lambda: vendor)
    monkeypatch.setenv("PYENGINE_BLAS", "auto")
    s, d, local, ilp64, why = _blas.find()
    assert s and d and local and why.startswith("OpenBLAS"), why
    assert f"MKL installed but not used: CPU vendor {vendor or 'unknown'}, not GenuineIntel (PYENGINE_BLAS=mkl takes it)" in why
    monkeypatch.setenv("PYENGINE_BLAS", "mkl")
    assert _blas.find()[4].startswith("MKL 20")


def test_the_cpu_vendor_is_read():
    vendor = _blas._cpu_vendor()
    assert isinstance(vendor, str)
    if os.path.exists("/proc/cpuinfo") and platform.machine() in ("x86_64", "AMD64"):
        assert vendor in ("GenuineIntel", "AuthenticAMD", "HygonGenuine", "CentaurHauls"), vendor


def test_the_finder_refuses_an_unknown_choice(monkeypatch):
    monkeypatch.setenv("PYENGINE_BLAS", "blis")
    with pytest.raises(ValueError, match="PYENGINE_BLAS must be 'auto', 'mkl' or 'openblas'; got 'blis'"):
        _blas.find()


def test_a_bad_choice_fails_every_compiled_call(tmp_path):
    # Not only the first: a lookup that raised is tried again, never left as the fallback.
    require("cpp")
    code = """
import numpy as np
from pyengine import backends
x = np.ones((4, 3), np.float32)
for _ in range(2):
    try:
        backends.resolve("linear")(x, np.ones((3, 2), np.float32), None, None, np.empty((4, 2), np.float32))
    except ValueError as exc:
        assert "PYENGINE_BLAS must be" in str(exc), exc
    else:
        raise SystemExit("no error")
print("ok")
"""
    run = _python(code, "blis", tmp_path)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr


@pytest.mark.parametrize("choice", ["openblas", "mkl"])
def test_each_library_gives_the_references_products(choice, tmp_path):
    # The library is chosen once per process: each in a process of its own, every kernel
    # against the reference (the rest of the suite runs on whichever this process took), and
    # the same products on any thread count.
    require("cpp")
    if choice == "mkl" and _blas._mkl_path() is None:
        pytest.skip("the mkl package (the mkl extra) is not installed")
    code = """
import numpy as np
from pyengine import backends
from pyengine.kernels.linear import blas_info
info = blas_info()
assert info.startswith({want!r}), info
rng = np.random.default_rng(5)
for dt, tol in ((np.float32, 2e-5), (np.float64, 1e-12)):
    for N, k, n in ((1, 7, 5), (300, 70, 90), (2100, 64, 33), (40, 768, 2304)):
        x, w = rng.standard_normal((N, k)).astype(dt), (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dt)
        b, r, coef = rng.standard_normal(n).astype(dt), rng.standard_normal((N, n)).astype(dt), rng.standard_normal((1, n)).astype(dt)
        for name, args in (("linear", (x, w, b, r)), ("linear_act", (x, w, b, "gelu_tanh", None)), ("linear_mul", (x, w, coef))):
            want, got = np.empty((N, n), dt), np.empty((N, n), dt)
            assert backends.resolve(name, "numpy")(*args, want) == 0 and backends.resolve(name, "cpp")(*args, got) == 0
            err = np.abs(got - want).max() / np.abs(want).max()
            assert err < tol, (name, dt, N, k, n, err)
    # A large product's row tiles follow the thread count: the library must round a row the
    # same way in any row tile (csrc/linear.hpp's tiling), so the results are the same.
    x, w = rng.standard_normal((1000, 512)).astype(dt), rng.standard_normal((512, 640)).astype(dt)
    outs = []
    for t in (1, 2, 3, 5, 8):
        outs.append(np.empty((1000, 640), dt))
        with backends.num_threads(t):
            backends.resolve("linear", "cpp")(x, w, None, None, outs[-1])
    assert all(np.array_equal(outs[0], o) for o in outs[1:]), dt
print("ok", info)
""".format(want="OpenBLAS" if choice == "openblas" else "MKL")
    run = _python(code, choice, tmp_path)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr



def test_numpy_keeps_its_blas_threads_after_the_linear_kernels():
    # Each OpenMP thread of a linear kernel runs OpenBLAS single-threaded. Restoring the count
    # from every thread raced where OpenBLAS keeps it globally: NumPy was left on one thread
    # after a block forward (a numpy 8192x3072x768 product: 202 ms before, 373 ms after).
    from pyengine import _core

    before = _numpy_blas_threads()
    if _core.linear_blas_info().startswith("numpy matmul") or _core.get_num_threads() < 2 or before is None:
        pytest.skip("needs NumPy's OpenBLAS, the kernels' BLAS path (OpenBLAS or MKL) and two threads")
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2048, 512), np.float32), rng.standard_normal((512, 512), np.float32)
    out = np.empty((2048, 512), np.float32)
    for _ in range(20):
        _core.linear(x, w, None, None, out)
        assert _numpy_blas_threads() == before


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_one_thread_is_numpys_product(dtype):
    rng = np.random.default_rng(3)
    for sa, sb in [((1, 12, 1, 128, 64), (1, 12, 1, 64, 128)), ((5, 3, 2, 7, 16), (1, 3, 1, 16, 9)),
                   ((300, 70), (70, 301)), ((4, 0), (0, 3))]:
        a, b = rng.standard_normal(sa).astype(dtype), rng.standard_normal(sb).astype(dtype)
        want = np.matmul(a, b)
        got = _blas.matmul_one_thread(a, b)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert_close(got, want, dtype)
        out = np.full_like(want, np.nan)
        assert _blas.matmul_one_thread(a, b.swapaxes(-1, -2).copy().swapaxes(-1, -2), out=out) is out
        assert_close(out, want, dtype)


def test_matmul_one_thread_holds_numpys_blas_to_one_thread_and_restores_it(monkeypatch):
    before = _numpy_blas_threads()
    if before is None or not _blas.find()[2]:
        pytest.skip("needs NumPy's OpenBLAS with openblas_set_num_threads_local")
    seen = []
    real = _blas.np.matmul

    def spy(*args, **kwargs):
        seen.append(_numpy_blas_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(_blas.np, "matmul", spy)
    x = np.ones((8, 8), np.float32)
    _blas.matmul_one_thread(x, x)
    with pytest.raises(ValueError):
        _blas.matmul_one_thread(x, np.ones((7, 8), np.float32))
    assert seen == [1, 1] and _numpy_blas_threads() == before


def test_matmul_one_thread_restores_the_count_under_concurrent_callers():
    # In NumPy's pthreads OpenBLAS the "local" count is global: callers that saved and restored
    # it each on their own left it at 1 when they interleaved. The first in sets, the last out restores.
    import threading

    before = _numpy_blas_threads()
    if before is None or not _blas.find()[2]:
        pytest.skip("needs NumPy's OpenBLAS with openblas_set_num_threads_local")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 12, 96, 64)).astype(np.float32)
    want = np.matmul(a, a.swapaxes(-1, -2))
    bad = []

    def work():
        for _ in range(30):
            if not np.allclose(_blas.matmul_one_thread(a, a.swapaxes(-1, -2)), want, rtol=1e-5, atol=1e-4):
                bad.append(1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad and _blas._state["depth"] == 0 and _numpy_blas_threads() == before


def test_matmul_one_thread_without_openblas_is_numpy_matmul(monkeypatch):
    monkeypatch.setitem(_blas._state, "set", False)
    x = np.arange(6.0).reshape(2, 3)
    assert np.array_equal(_blas.matmul_one_thread(x, x.T), x @ x.T)
