"""Same-run A/B: another revision built into its own virtualenv (as asv does), and both
builds timed interleaved, kernel by kernel, by two long-lived worker processes.

For each (kernel, backend, dtype, size) both workers set the case up; the loop count is
calibrated on both and the larger used by both; then :data:`ROUNDS` rounds run, each
:data:`SAMPLES` pairs of samples alternating old-new / new-old; a side's round statistic
is its minimum. Outlier rounds (on either side) are re-run once. The verdict is the paired ratio
new/old with a bootstrap interval (:func:`pyengine._bench.stats.paired_ratio`): a
regression only when the whole interval lies above 1 / (1 - threshold), and again when both
workers are restarted and the case measured a second time (a row's "confirmation"): a
kernel's speed can depend on where one process put its arrays and its JIT-compiled code,
which fresh processes redraw, so two independent intervals must both exclude the threshold.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

from .._progress import Progress

from . import cases as _cases
from . import measure as _m
from . import stats as _stats

__all__ = ["ROUNDS", "THRESHOLD", "Worker", "build_revision", "compare_builds", "format_ab"]

#: Rounds per row (quick, standard), samples per side per round, the default threshold.
ROUNDS = {"quick": 8, "standard": 12}
SAMPLES = 3
THRESHOLD = 0.1
_WORKER = pathlib.Path(__file__).resolve().parent / "worker.py"
#: Build tools the other revision's venv needs (its runtime dependencies are shared).
_BUILD_TOOLS = ["scikit-build-core", "pybind11", "cmake", "ninja"]


class Worker:
    """One build's worker process (``python worker.py`` by path, cwd outside any source tree)."""

    def __init__(self, python: str, label: str, env: dict[str, str]):
        self.label, self.python, self.env = label, python, env
        self._cwd = tempfile.mkdtemp(prefix="pyengine-ab-")
        self.proc = subprocess.Popen([python, str(_WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=self._cwd, env=env)

    def ask(self, **req: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.label} build's bench worker exited (status {self.proc.poll()})")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"{self.label} build: {req.get('op')} {req.get('kernel', '')}: {out['error']}")
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None and not f.closed:
                f.close()


def _git(root: pathlib.Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


def build_revision(rev: str, root: str | os.PathLike, cache: str | os.PathLike) -> str:
    """The python of a virtualenv with revision ``rev`` of the git checkout ``root`` built and
    installed (not editable): ``cache/<sha>/venv``, reused when already built. The venv sees
    this interpreter's site-packages (a ``.pth``), so both builds share NumPy, Numba, SciPy."""
    root = pathlib.Path(root)
    try:
        sha = _git(root, "rev-parse", "--verify", f"{rev}^{{commit}}")
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        raise ValueError(f"rev {rev!r} is not a commit of the git checkout {root}") from exc
    home = pathlib.Path(cache) / sha[:16]
    python = home / "venv" / "bin" / "python"
    if (home / "built").exists():
        return str(python)
    src = home / "src"
    src.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(root), "archive", sha], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(home / "venv")], check=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    mine = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    pathlib.Path(site, "_pyengine_ab_shared.pth").write_text("\n".join(mine) + "\n")
    pip = [str(python), "-m", "pip", "install", "-q"]
    missing = [t for t in _BUILD_TOOLS if subprocess.run(
        [str(python), "-c", f"import {t.replace('-', '_')}"], capture_output=True).returncode != 0]
    if missing:
        subprocess.run([*pip, *missing], check=True)
    print(f"building {rev} ({sha[:12]}) into {home / 'venv'} ...", file=sys.stderr, flush=True)
    subprocess.run([*pip, "--no-deps", "--no-build-isolation", str(src)], check=True)
    (home / "built").write_text(sha + "\n")
    return str(python)


def _rounds(old: Worker, new: Worker, loops: int, rounds: int) -> tuple[list[float], list[float], int]:
    """Per-round statistics of both sides: a round is SAMPLES pairs of single samples, the
    order alternating pair by pair (old-new, new-old, ...), so a burst on the host lands on
    both sides alike; each side's round statistic is the minimum of its samples."""
    def one(i: int) -> tuple[float, float]:
        got: dict[str, list[float]] = {old.label: [], new.label: []}
        for j in range(SAMPLES):
            for w in ((old, new) if (i + j) % 2 == 0 else (new, old)):
                got[w.label] += w.ask(op="sample", loops=loops, n=1)["samples"]
        return _stats.round_stat(got[old.label]), _stats.round_stat(got[new.label])

    pairs = [one(i) for i in range(rounds)]
    bad = set(_stats.outlier_rounds([p[0] for p in pairs])) | set(_stats.outlier_rounds([p[1] for p in pairs]))
    for i in sorted(bad):
        pairs[i] = one(i)
    return [p[0] for p in pairs], [p[1] for p in pairs], len(bad)


def _measure(old: Worker, new: Worker, req: dict[str, Any], rounds: int, threshold: float,
             per_call: int) -> dict[str, Any]:
    """Set one case up in both workers (fresh arrays), calibrate, run the rounds: the ratio new/old
    with its interval and verdict, and the per-round statistics in seconds per kernel call."""
    new.ask(**req), old.ask(**req)
    cn, co = new.ask(op="calibrate"), old.ask(op="calibrate")
    mult = cn["multiple"] * co["multiple"]  # loops over which a slowed side's extra work is exact
    loops = -(-max(cn["loops"], co["loops"]) // mult) * mult
    t_old, t_new, reruns = _rounds(old, new, loops, rounds)
    r = _stats.paired_ratio(t_old, t_new)
    return {"time_old_s": min(t_old) / per_call, "time_new_s": min(t_new) / per_call, "ratio": r.ratio,
            "low": r.low, "high": r.high, "verdict": _stats.verdict(r, threshold), "loops": loops,
            "reruns": reruns, "rounds_old_s": [x / per_call for x in t_old],
            "rounds_new_s": [x / per_call for x in t_new]}


def compare_builds(old_python: str, quick: bool = True, dtypes: tuple[str, ...] = ("float32",),
                   kernels: tuple[str, ...] | None = None, only_backends: tuple[str, ...] | None = None,
                   threshold: float = THRESHOLD, rounds: int | None = None, old_label: str = "old") -> dict[str, Any]:
    """Time this build against ``old_python``'s, interleaved; one row per shared case.

    The test-only slowdown switch applies to this (the new) build only.
    """
    rounds = rounds or ROUNDS["quick" if quick else "standard"]
    env_new = dict(os.environ)
    env_old = {k: v for k, v in env_new.items() if k != _m.SLOWDOWN_ENV}
    _m.slowdown(env_new)  # a malformed switch fails here, before any worker starts
    for env in (env_new, env_old):
        env.pop("PYTHONPATH", None)
    new, old = Worker(sys.executable, "new", env_new), Worker(old_python, old_label, env_old)
    rows: list[dict[str, Any]] = []

    def restart() -> None:  # a fresh process for each build: new code and data placement
        nonlocal new, old
        new.close(), old.close()
        new, old = Worker(new.python, new.label, new.env), Worker(old.python, old.label, old.env)
        new.ask(op="hello"), old.ask(op="hello")

    try:
        hn, ho = new.ask(op="hello"), old.ask(op="hello")
        cases = _cases.all_cases()
        if kernels:
            unknown = sorted(set(kernels) - set(cases))
            if unknown:
                raise ValueError(f"kernels: unknown benchmark case(s) {unknown}; known: {sorted(cases)}")
            cases = {k: cases[k] for k in kernels}
        plan = [(c, b, dt, size) for c in cases.values() if c.name in hn["cases"] and c.name in ho["cases"]
                for dt in dtypes for size in _cases.SIZES["quick" if quick else "standard"]
                for b in c.backends if b in hn["available"] and b in ho["available"]
                and b in ho["cases"][c.name] and (only_backends is None or b in only_backends)]
        bar = Progress("auto")
        for i, (case, b, dt, size) in enumerate(plan):
            bar.step(i, len(plan), f"{case.name} {b} {dt} {size[0]}x{size[1]}")
            req = {"op": "setup", "kernel": case.name, "backend": b, "dtype": dt, "size": list(size)}
            first = _measure(old, new, req, rounds, threshold, case.per_call)
            row = {"kernel": case.name, "backend": b, "dtype": dt, "size": case.size_label(size), **first}
            if first["verdict"] != "same":  # a change must show again in fresh worker processes
                restart()
                row["confirmation"] = again = _measure(old, new, req, rounds, threshold, case.per_call)
                if again["verdict"] != first["verdict"]:
                    row["verdict"] = "same"
            rows.append(row)
        bar.step(len(plan), len(plan), "done")
    finally:
        new.close(), old.close()
    return {"threshold": threshold, "rounds": rounds, "old": old_label, "results": rows}


def _confirmation(row: dict[str, Any]) -> str:
    c = row.get("confirmation")
    if c is None:
        return ""
    word = "confirmed" if row["verdict"] != "same" else f"not confirmed ({c['verdict']})"
    return f"  ({word}: x{c['ratio']:.3f} [{c['low']:.3f}, {c['high']:.3f}])"


def format_ab(report: dict[str, Any]) -> str:
    """The A/B report as a table: time ratio new/old with its interval and the verdict."""
    lim = 1 / (1 - report["threshold"])
    lines = [f"A/B: new (this build) / {report['old']}, {report['rounds']} interleaved rounds; "
             f"regression when the {_stats.LEVEL:.0%} interval of the time ratio lies above x{lim:.3f}, "
             "twice (the second time in fresh worker processes)",
             f"{'kernel':<28}{'backend':<8}{'dtype':<9}{'size':<15}{'old':>11}{'new':>11}{'new/old':>9}"
             f"{'interval':>17}  verdict"]
    for r in report["results"]:
        tt = lambda t: f"{t * 1e3:.3f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"  # noqa: E731
        lines.append(f"{r['kernel']:<28}{r['backend']:<8}{r['dtype']:<9}{r['size']:<15}{tt(r['time_old_s']):>11}"
                     f"{tt(r['time_new_s']):>11}{r['ratio']:>9.3f}   [{r['low']:.3f}, {r['high']:.3f}]  {r['verdict']}"
                     + _confirmation(r))
    return "\n".join(lines)
