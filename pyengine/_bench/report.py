"""The report of one run as a table, its comparison with a stored baseline, and the
baseline reader (checked before any timing)."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from .. import _validate as _v

from . import stats as _stats
from .cases import THRESHOLD

__all__ = ["compare", "format_table", "load_baseline"]

#: Normalized figures compared against a baseline (higher is better).
FIGURES = ("fraction", "speedup_vs_numpy")
_ROUNDS = {"fraction": "fraction_rounds", "speedup_vs_numpy": "speedup_rounds"}


def format_table(report: dict[str, Any]) -> str:
    """The report as a text table."""
    m = report["machine"]
    lines = [
        f"machine: copy {m['copy_bytes_per_s'] / 1e9:.1f} GB/s (all cores), GEMM "
        f"{m['gemm_float32_flop_per_s'] / 1e9:.0f} GFLOP/s float32, {m['gemm_float64_flop_per_s'] / 1e9:.0f} float64",
        f"{'kernel':<28}{'backend':<8}{'dtype':<9}{'size':<15}{'time':>11}{'spread':>8}"
        f"{'GB/s':>8}{'of limit':>10}{'vs numpy':>10}",
    ]
    for r in report["results"]:
        t = r["time_s"]
        tt = f"{t * 1e3:.3f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"
        fmt = lambda v, spec: "" if v is None else format(v, spec)  # noqa: E731
        lines.append(
            f"{r['kernel']:<28}{r['backend']:<8}{r['dtype']:<9}{r['size']:<15}{tt:>11}"
            f"{r['spread']:>7.0%} {fmt(r['gb_per_s'], '8.1f'):>8}{fmt(r['fraction'], '10.1%'):>10}"
            f"{fmt(r['speedup_vs_numpy'], '9.1f') + ('x' if r['speedup_vs_numpy'] else ''):>10}"
        )
    return "\n".join(lines)


def _rounds(name: str, i: int, row: dict[str, Any], key: str) -> list[float] | None:
    """A row's per-round values of a figure (None when absent: an older report)."""
    vals = row.get(_ROUNDS[key])
    if vals is None:
        return None
    ok = isinstance(vals, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                         and math.isfinite(v) and v > 0 for v in vals)
    if not ok:
        raise ValueError(f"{name}: results[{i}] {_ROUNDS[key]!r} must be a list of finite positive numbers; "
                         f"got {vals!r}")
    return vals if len(vals) >= 2 else None


#: Rows of one backend needed to estimate a run-wide drift of a figure.
DRIFT_ROWS = 3


def _drift(report, base, key_of) -> dict[tuple[str, str], float]:
    """Per (backend, figure): the median over shared rows of now / baseline, capped at 1.

    A busier machine lowers every row of a backend alike (a neighbour's load, not a code
    change); one kernel's regression moves one row. Dividing by the run-wide median forgives
    the common slowdown only (a machine-wide *speed-up* is not used to sharpen the check),
    so a change that slows every kernel of a backend equally is left to the same-run A/B."""
    ratios: dict[tuple[str, str], list[float]] = {}
    for r in report["results"]:
        b = base.get(key_of(r, r["backend"]), (None, None))[1]
        for key in FIGURES:
            if b is not None and r.get(key) and b.get(key) and r["backend"] != "numpy":
                ratios.setdefault((r["backend"], key), []).append(r[key] / b[key])
    return {k: min(1.0, float(np.median(v))) for k, v in ratios.items() if len(v) >= DRIFT_ROWS}


def compare(report: dict[str, Any], baseline: dict[str, Any], threshold: float = THRESHOLD) -> list[str]:
    """Regressions of the normalized figures (fraction of limit, speed-up over NumPy).

    With per-round values on both sides, the figure's ratio baseline/now (a slowdown) gets a
    two-sample bootstrap interval (:func:`pyengine._bench.stats.unpaired_ratio`), so both runs'
    spreads count, after a machine-wide slowdown of the backend's figure (:func:`_drift`,
    from at least :data:`DRIFT_ROWS` rows) is divided out; a row regresses only when, for every
    figure it has rounds of, the whole interval lies above 1 / (1 - threshold): a slower kernel
    lowers both its fraction of the limit and its speed-up over NumPy, while a noisy limit
    probe moves only the first and a noisy NumPy reference only the second.
    Rows of an older report (no rounds) fall back to: now < baseline * (1 - threshold - the
    larger spread / 2). Returns one line per regression (empty when none). ``threshold``: in
    [0, 1); ``baseline`` is checked as :func:`load_baseline` checks a file.
    """
    threshold = _v.real("threshold", threshold, low=0, high=1, high_open=True)
    baseline = _v.bench_report("baseline", baseline)
    key_of = lambda r, backend: (r["kernel"], backend, r["dtype"], r["size"])  # noqa: E731
    base = {key_of(r, r["backend"]): (i, r) for i, r in enumerate(baseline["results"])}
    mine = {key_of(r, r["backend"]): r for r in report["results"]}
    drift = _drift(report, base, key_of)
    found = []
    for j, r in enumerate(report["results"]):
        i, b = base.get(key_of(r, r["backend"]), (None, None))
        if b is None or r["backend"] == "numpy":
            continue
        verdicts, lines = [], []  # the figures with rounds on both sides: a regression needs them all
        for key in FIGURES:
            if r.get(key) is None or not b.get(key):
                continue
            now, then = _rounds("report", j, r, key), _rounds("baseline", i, b, key)
            if now is not None and then is not None:
                d = drift.get((r["backend"], key), 1.0)
                slow = _stats.unpaired_ratio([v / d for v in now], then)  # median(then) / median(now): a time ratio
                verdicts.append(_stats.verdict(slow, threshold) == "regression")
                lines.append(f"{key} {r[key]:.3g} < baseline {b[key]:.3g}: slower x{slow.ratio:.2f} "
                             f"[{slow.low:.2f}, {slow.high:.2f}]")
                continue
            spreads = [r["spread"], b["spread"]]
            if key == "speedup_vs_numpy":  # a ratio: the reference's noise is in it too
                spreads += [t[key_of(r, "numpy")]["spread"] for t in (mine, {k: v[1] for k, v in base.items()})
                            if key_of(r, "numpy") in t]
            slack = threshold + max(spreads) / 2
            if r[key] < b[key] * (1 - slack):
                found.append(f"{r['kernel']} {r['backend']} {r['dtype']} {r['size']}: {key} {r[key]:.3g} "
                             f"< baseline {b[key]:.3g} (allowed drop {slack:.0%})")
        if verdicts and all(verdicts):
            found.append(f"{r['kernel']} {r['backend']} {r['dtype']} {r['size']}: " + "; ".join(lines)
                         + f"; beyond x{1 / (1 - threshold):.2f}")
    return found


def load_baseline(path: str) -> dict[str, Any]:
    """A ``pyengine bench --json`` report read from ``path`` and checked row by row
    (:func:`pyengine._validate.bench_report`, and the per-round lists), before any benchmark
    runs; every error names the file."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except UnicodeDecodeError:
        raise ValueError(f"baseline {path} is not a text (UTF-8 JSON) file: not a `pyengine bench --json` file") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"baseline {path} is not valid JSON: {exc}") from None
    doc = _v.bench_report(f"baseline {path}", doc)
    for i, row in enumerate(doc["results"]):
        for key in FIGURES:
            _rounds(f"baseline {path}", i, row, key)
    return doc
