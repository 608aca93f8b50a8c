"""Wall time of ``pyengine recovery --no-spectra`` on its defaults, this checkout against another,
alternated, and whether their JSON outputs agree.

    python benchmarks/scripts/recovery_no_spectra.py --base /path/to/other/checkout [--rounds 5]

Each round runs the command once per checkout in a fresh process (``pyengine.bench.time_alternated``:
the order reversed every other round, after one untimed warm-up run each), with ``PYTHONPATH`` set
to the checkout, ``--no-plots --progress never``. Prints the wall seconds of each run, the medians
and their ratio, the ``seconds`` of each stage from the last run's recovery.json, and then compares
recovery.json and the stage files of the two checkouts, ignoring the keys that hold times, paths
and dates.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from _common import time_alternated

HERE = Path(__file__).resolve().parents[2]
#: Keys whose values differ between any two runs.
VOLATILE = {"seconds", "time", "date", "command", "argv", "cwd", "out", "path", "paths", "hostname", "pid",
            "python", "version", "git", "commit", "elapsed"}


def _run(checkout: str, out: str) -> None:
    env = {**os.environ, "PYTHONPATH": checkout}
    subprocess.run([sys.executable, "-m", "pyengine", "recovery", "--no-spectra", "--no-plots", "--progress", "never",
                    "--out", out], env=env, cwd=out, check=True, stdout=subprocess.DEVNULL)


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in VOLATILE and k != "provenance"}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def _differences(a: Path, b: Path) -> list[str]:
    names = ["recovery.json"] + sorted(p.relative_to(a).as_posix() for p in (a / "stages").glob("*.json"))
    bad = []
    for name in names:
        if not (b / name).is_file() or _strip(json.loads((a / name).read_text())) != _strip(
                json.loads((b / name).read_text())):
            bad.append(name)
    return bad


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the other checkout (its pyengine/ with the compiled extension)")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        outs = {"base": os.path.join(tmp, "base"), "this": os.path.join(tmp, "this")}
        for o in outs.values():
            os.makedirs(o)
        roots = {"base": os.path.abspath(a.base), "this": str(HERE)}
        times = time_alternated({k: (lambda k=k: _run(roots[k], outs[k])) for k in outs}, a.rounds)
        for k, t in times.items():
            print(f"{k:5s} {roots[k]}: " + " ".join(f"{x:.2f}" for x in t) + f" s; median {np.median(t):.2f} s")
        print(f"ratio this / base (medians): {np.median(times['this']) / np.median(times['base']):.3f}")
        for k, o in outs.items():
            sec = json.loads(Path(o, "recovery.json").read_text())["seconds"]
            print(f"{k:5s} stages: " + ", ".join(f"{s} {v:.2f}" for s, v in sec.items()))
        bad = _differences(Path(outs["base"]), Path(outs["this"]))
        print("JSON outputs agree (times, paths, dates and provenance ignored)" if not bad
              else f"JSON outputs differ: {', '.join(bad)}")
