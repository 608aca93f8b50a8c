"""One build's normalized benchmark: every case x backend x size x dtype, in rounds.

For each (case, dtype, size) every backend is set up and calibrated, then the rounds
run: the case's machine limit is probed, then each backend takes a few samples, in an
order that rotates from round to round (so the limit and the NumPy reference see the same
machine state as the kernel, and no backend always runs right after another); outlier rounds
are re-run once. A row's figures are medians over rounds of per-round figures, and the
per-round values are kept (``*_rounds``) so a later comparison can use their spread.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backends
from .._progress import Progress

from . import cases as _cases
from . import measure as _m
from . import stats as _stats

__all__ = ["ROUNDS", "SAMPLES", "machine_limits", "run"]

#: Rounds per row (quick, standard) and samples per round.
ROUNDS = {"quick": 5, "standard": 7}
SAMPLES = 3


def machine_limits(quick: bool = False) -> dict[str, float]:
    """All-core streaming copy bandwidth (bytes moved/s) and GEMM flop/s, measured now
    (the report's header; each row is normalized by a probe taken next to it)."""
    bw = _m.limit_probe("bandwidth", "float32", quick)
    limits = {"copy_bytes_per_s": max(bw() for _ in range(3))}
    for dt in ("float32", "float64"):
        g = _m.limit_probe("gemm", dt, quick)
        limits[f"gemm_{dt}_flop_per_s"] = max(g() for _ in range(3))
    return limits


def _rounds(probe, calls: dict[str, Any], loops: dict[str, int], per_round: dict[str, int], rounds: int):
    """Per-round limit values and per-backend round statistics, outlier rounds re-run once.

    The backends take turns in a rotating order (round i starts with the i-th, modulo their
    number): a kernel timed right after another runs in its aftermath (a NumPy reference's
    freed temporaries, a thread pool winding down), so a fixed order would tilt every round
    the same way against the same backend.
    """
    names = list(calls)

    def one(i):
        lim = probe() if probe else None
        k = i % len(names)
        return lim, {b: _stats.round_stat(_m.sample(calls[b], loops[b], per_round[b])) for b in names[k:] + names[:k]}

    got = [one(i) for i in range(rounds)]
    bad = set()
    for b in calls:
        bad.update(_stats.outlier_rounds([g[1][b] for g in got]))
    for i in sorted(bad):
        got[i] = one(i)
    return [g[0] for g in got], {b: [g[1][b] for g in got] for b in calls}, len(bad)


def run(quick: bool = False, repeat: int | None = None, dtypes: tuple[str, ...] = ("float32",),
        kernels: tuple[str, ...] | None = None, only_backends: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Measure every case x available backend x size x dtype (``repeat``: rounds per row).

    Returns ``{"machine": limits, "repeat": rounds, "results": [row, ...]}``; each row has
    kernel, backend, dtype, size, time_s (median round minimum, per call), spread (IQR over
    median of the rounds), gb_per_s, fraction (of the case's limit, or None),
    speedup_vs_numpy, their per-round values (time_rounds, fraction_rounds,
    speedup_rounds), loops and reruns.
    """
    rounds = repeat or ROUNDS["quick" if quick else "standard"]
    slow = _m.slowdown()
    limits = machine_limits(quick)
    cases = _cases.all_cases()
    if kernels:
        unknown = sorted(set(kernels) - set(cases))
        if unknown:
            raise ValueError(f"kernels: unknown benchmark case(s) {unknown}; known: {sorted(cases)}")
        cases = {k: cases[k] for k in kernels}
    avail = [n for n, i in backends.available_backends().items() if i.available]
    groups = [(case, dt, size, [b for b in reversed(avail) if b in case.backends  # numpy first
                                and (only_backends is None or b in only_backends or b == "numpy")])
              for case in cases.values() for dt in dtypes for size in _cases.SIZES["quick" if quick else "standard"]]
    rows: list[dict[str, Any]] = []
    bar = Progress("auto")
    for i, (case, dt, size, bs) in enumerate(groups):
        bar.step(i, len(groups), f"{case.name} {dt} {size[0]}x{size[1]}")
        calls, moved, flops, loops, per_round = {}, 0, 0.0, {}, {}
        for b in bs:
            call, moved, flops = case.setup(b, dt, size)
            calls[b] = _m.slowed(call, slow.get((case.name, b), 1.0))
            loops[b] = _m.calibrate(calls[b])
            one = _m.sample(calls[b], loops[b], 1)[0] * loops[b]
            per_round[b] = SAMPLES if one < 10 * _stats.SAMPLE_S else 1  # a slow reference: one per round
        probe = _m.limit_probe(case.limit, dt, quick)
        lims, stats, reruns = _rounds(probe, calls, loops, per_round, rounds)
        for b in bs:
            if only_backends is not None and b not in only_backends:
                continue
            t = np.asarray(stats[b]) / case.per_call
            med = float(np.median(t))
            q1, q3 = np.quantile(t, [0.25, 0.75])
            frac = None
            if case.limit == "bandwidth":
                frac = [float(moved / tr / lr) for tr, lr in zip(t, lims)]
            elif case.limit == "gemm":
                frac = [float(flops / tr / lr) for tr, lr in zip(t, lims)]
            speed = None
            if "numpy" in stats:
                speed = [float(r) for r in np.asarray(stats["numpy"]) / case.per_call / t]
            rows.append({
                "kernel": case.name, "backend": b, "dtype": dt, "size": case.size_label(size),
                "time_s": med, "spread": float((q3 - q1) / med),
                "gb_per_s": moved / case.per_call / med / 1e9 if moved else None,
                "fraction": None if frac is None else float(np.median(frac)),
                "speedup_vs_numpy": None if speed is None else float(np.median(speed)),
                "time_rounds": [float(v) for v in t], "fraction_rounds": frac, "speedup_rounds": speed,
                "loops": loops[b], "reruns": reruns,
            })
    bar.step(len(groups), len(groups), "done")
    return {"machine": limits, "repeat": rounds, "results": rows}
