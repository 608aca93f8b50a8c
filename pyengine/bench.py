"""Machine-normalized benchmarks and regression checks: ``pyengine bench``.

Absolute times mean little across machines (and a shared machine is noisy); a
kernel's speed as a fraction of what the machine can do, measured next to it, travels.
:func:`run` times every registered kernel on every available backend in rounds of
short calibrated samples, probing the relevant machine limit (all-core streaming copy
bandwidth, or BLAS GEMM throughput) in every round, and reports for each: the time
(median over rounds of the round minimum) and its spread, the throughput, the fraction
of the limit and the speed-up over the NumPy reference, with their per-round values.

Two ways to find a regression:

- :func:`compare_builds` (``pyengine bench ab --rev REV``): another revision built into
  its own virtualenv, both builds timed interleaved in one run, a bootstrap interval on
  the ratio; the check to trust on a shared machine.
- :func:`compare` (``pyengine bench --compare BASELINE.json``): against a stored report,
  both runs' per-round spreads taken into account.

``PYENGINE_BENCH_SLOWDOWN="kernel:backend=factor"`` (test only, read by the harness, not
the kernels) makes one kernel that much slower, to check that a slowdown is caught.
Downstream packages add their own cases with :func:`register_case`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from . import _validate as _v
from ._bench import ab as _ab
from ._bench import runner as _runner
from ._bench.cases import _CASES, ARGUMENTS, SIZES, THRESHOLD, Case, _kernel_case, register_case  # noqa: F401
from ._bench.measure import SLOWDOWN_ENV, slowdown, steady_allocator, time_alternated, time_call
from ._bench.report import compare, format_table, load_baseline
from ._bench.stats import paired_ratio, unpaired_ratio, verdict

__all__ = ["AB_THRESHOLD", "Case", "SLOWDOWN_ENV", "ab_main", "compare", "compare_builds", "copy_bandwidth",
           "format_ab", "format_table", "load_baseline", "machine_limits", "paired_ratio", "register_case", "run",
           "slowdown", "time_alternated", "time_call", "tuned_environment", "unpaired_ratio", "verdict"]

#: Default threshold of the same-run A/B check (a relative speed drop, like ``THRESHOLD``).
AB_THRESHOLD = _ab.THRESHOLD
machine_limits = _runner.machine_limits
compare_builds = _ab.compare_builds
format_ab = _ab.format_ab


def copy_bandwidth(nbytes: int, repeat: int = 5) -> float:
    """The machine's all-core streaming copy bandwidth (bytes moved per second), best of ``repeat``."""
    import numpy as np

    from . import backends
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros_like(src)
    cpp = backends.backend_module("cpp")
    if cpp is not None:
        copy = lambda: cpp.stream_copy(src, dst)  # noqa: E731
    else:
        copy = lambda: np.copyto(dst, src)  # noqa: E731
    copy()
    from ._bench.measure import sample
    return 2 * nbytes / min(sample(copy, 1, repeat))


def run(quick: bool = False, repeat: int | None = None, dtypes: tuple[str, ...] = ("float32",),
        kernels: tuple[str, ...] | None = None, backends: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Every case x available backend x size x dtype (``repeat``: rounds per row; ``kernels``,
    ``backends``: only these; NumPy is always timed, for the speed-up). See
    :func:`pyengine._bench.runner.run` for the rows."""
    return _runner.run(quick=quick, repeat=repeat, dtypes=dtypes, kernels=kernels, only_backends=backends)


def tuned_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The thread-pool settings pyengine's timings assume, less those ``environ`` (default
    ``os.environ``) already decides: ``{name: value}`` to add to a new process's environment.

    Both are read once, when the library loads, so they count only in a process that
    starts with them (``env OPENBLAS_THREAD_TIMEOUT=20 pyengine ...``, or
    ``subprocess.run(cmd, env=os.environ | tuned_environment())``); ``import pyengine``
    sets neither, and the ``pyengine`` command sets only ``GOMP_SPINCOUNT``, before the
    compiled extension or Numba load libgomp (NumPy, and its OpenBLAS, are loaded by then).

    - ``GOMP_SPINCOUNT=10000`` (omitted when ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is
      set). The C++ kernels and Numba's "omp" threading layer share libgomp, whose idle
      threads spin 300000 rounds (a few ms) by default before they sleep. On a 2-core
      machine such a spinning team starved the other backend's: a 100-token LayerNorm JVP
      took 8 ms instead of 0.08-0.14 ms when cpp and numba calls alternated. Not spinning
      (``OMP_WAIT_POLICY=PASSIVE``) wakes the threads through the kernel in every parallel
      region: 70-80 us each, more than that JVP's work (C++ 94 us passive against 24 us
      spinning). 10000 rounds (about 0.1 ms) span the gap between back-to-back calls and
      stop before they slow a NumPy product that follows (a kernel right after a 512 x 512
      matmul: passive 76-120 us, 10000 rounds 99-124, 100000 rounds 1.3 ms).
    - ``OPENBLAS_THREAD_TIMEOUT=20`` (omitted when set). OpenBLAS's idle threads spin for
      2^28 cycles (~0.1 s) after a threaded product, and a compiled kernel that starts
      meanwhile shares the cores with them: the attention forward at (192, 128, 128, 64)
      float32 took 20-21 ms right after a NumPy matmul instead of 9-10. 2^20 cycles
      (~0.4 ms) still span back-to-back products.

    Neither changes any result, only where the threads wait.
    """
    env = os.environ if environ is None else environ
    out = {}
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        out["GOMP_SPINCOUNT"] = "10000"
    if "OPENBLAS_THREAD_TIMEOUT" not in env:
        out["OPENBLAS_THREAD_TIMEOUT"] = "20"
    return out


def _write(path: str | None, doc: dict[str, Any], dtypes: tuple[str, ...] = (),
           argv: list[str] | None = None) -> None:
    """``doc`` as JSON at ``path`` (if given), with a ``provenance`` block (``argv``: the command line)."""
    if path is not None:
        from .provenance import provenance

        doc = {**doc, "provenance": provenance(argv=argv, dtype=dtypes[0] if len(dtypes) == 1 else None,
                                               extra={"dtypes": list(dtypes)} if len(dtypes) > 1 else None)}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {path}")


def main(quick: bool, json_path: str | None, compare_path: str | None, threshold: float, dtypes: tuple[str, ...],
         kernels: tuple[str, ...] | None = None, backends: tuple[str, ...] | None = None,
         argv: list[str] | None = None) -> int:
    """The ``pyengine bench`` command; exit status 1 on a regression against the baseline.
    Every argument (and the slowdown switch) is checked before any timing; ``argv``: the
    command line for the JSON report's provenance (default ``sys.argv``)."""
    threshold = _v.real("threshold", threshold, low=0, high=1, high_open=True)
    slowdown()
    baseline = None if compare_path is None else load_baseline(compare_path)
    steady_allocator()  # this process times the kernels: allocate as every bench process does
    report = run(quick=quick, dtypes=dtypes, kernels=kernels, backends=backends)
    print(format_table(report))
    _write(json_path, report, dtypes, argv)
    if baseline is not None:
        regressions = compare(report, baseline, threshold)
        for line in regressions:
            print(f"REGRESSION {line}")
        print(f"compared with {compare_path}: {len(regressions)} regression(s)")
        return 1 if regressions else 0
    return 0


def ab_main(rev: str | None, old_python: str | None, quick: bool, json_path: str | None, threshold: float,
            dtypes: tuple[str, ...], kernels: tuple[str, ...] | None = None,
            backends: tuple[str, ...] | None = None, root: str = ".", cache: str | None = None,
            rounds: int | None = None, argv: list[str] | None = None) -> int:
    """``pyengine bench ab``: build ``rev`` (or use the interpreter ``old_python``), time it against
    this build interleaved; exit status 1 when any row's verdict is a regression."""
    threshold = _v.real("threshold", threshold, low=0, high=1, high_open=True)
    slowdown()
    if (rev is None) == (old_python is None):
        raise ValueError("give exactly one of rev (a git revision to build) and old_python (a built interpreter)")
    if rounds is not None:
        rounds = int(_v.real("rounds", rounds, low=3))
    if old_python is None:
        cache = cache or os.path.join(os.path.expanduser("~"), ".cache", "pyengine-bench-ab")
        old_python = _ab.build_revision(rev, root, cache)
    elif not os.path.isfile(old_python):
        raise ValueError(f"old_python {old_python} is not a file (an interpreter with the other build installed)")
    report = compare_builds(old_python, quick=quick, dtypes=dtypes, kernels=kernels, only_backends=backends,
                            threshold=threshold, rounds=rounds, old_label=rev or "old")
    print(format_ab(report))
    _write(json_path, report, dtypes, argv)
    bad = [r for r in report["results"] if r["verdict"] == "regression"]
    for r in bad:
        print(f"REGRESSION {r['kernel']} {r['backend']} {r['dtype']} {r['size']}: x{r['ratio']:.3f} "
              f"[{r['low']:.3f}, {r['high']:.3f}]")
    print(f"A/B against {report['old']}: {len(bad)} regression(s) in {len(report['results'])} row(s)")
    return 1 if bad else 0
