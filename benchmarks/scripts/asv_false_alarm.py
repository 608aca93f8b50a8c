"""False alarms of the README's ``asv continuous`` line, on one build compared with itself.

Makes a twin of REV (a commit with REV's tree and REV as parent, branch ``asv-twin``), runs
``asv continuous --factor 1.25 --split -b '^bench_regression\\.' REV asv-twin`` N times, and
prints per run asv's exit status, whether it reported anything worse, and the largest
ratio between the two commits' figures (parsed from asv's two result tables); the twin
branch is deleted at the end. From ``benchmarks/``, on a quiet machine, after ``asv machine --yes``:

    python scripts/asv_false_alarm.py --runs 10 [--rev HEAD]

The first run builds both commits (about a minute each); the others take ~75 s on the
2-core development machine.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

UNITS = {"ns": 1e-9, "μs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}
CELL = re.compile(r"^([\d.]+)(ns|μs|us|ms|s)$")


def tables(text: str) -> list[list[float]]:
    """The figures of every asv result table in ``text``, table by table, row-major."""
    out, cur = [], None
    for line in text.splitlines():
        if "=====" in line:
            if cur is None:
                cur = []
            elif cur:
                out.append(cur)
                cur = None
            continue
        if cur is not None:
            cur.extend(float(m.group(1)) * UNITS[m.group(2)] for m in map(CELL.match, line.split()) if m)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--factor", default="1.25")
    a = ap.parse_args(argv)
    git = ["git", "-C", ".."]
    sha = subprocess.run([*git, "rev-parse", a.rev], check=True, capture_output=True, text=True).stdout.strip()
    twin = subprocess.run([*git, "commit-tree", f"{sha}^{{tree}}", "-p", sha, "-m", f"asv twin of {sha[:12]}"],
                          check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([*git, "branch", "-f", "asv-twin", twin], check=True)
    flagged = 0
    try:
        for i in range(a.runs):
            proc = subprocess.run(["asv", "continuous", "--factor", a.factor, "--split", "-b", r"^bench_regression\.",
                                   sha, "asv-twin"], capture_output=True, text=True)
            text = proc.stdout + proc.stderr
            worse = "got worse" in text or "PERFORMANCE DECREASED" in text
            flagged += worse or proc.returncode != 0
            t = tables(text)
            ratio = (max(max(y / x, x / y) for x, y in zip(t[0], t[1]) if x > 0 and y > 0)
                     if len(t) >= 2 and len(t[0]) == len(t[1]) and t[0] else float("nan"))
            print(f"run {i + 1}/{a.runs}: exit {proc.returncode}, {'WORSE reported' if worse else 'nothing worse'}, "
                  f"largest ratio between the twins x{ratio:.3f}", flush=True)
    finally:
        subprocess.run([*git, "branch", "-D", "asv-twin"], check=False, capture_output=True)
    print(f"{flagged} of {a.runs} self-comparisons reported a regression (factor {a.factor})")
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
