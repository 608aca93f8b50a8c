"""False-alarm and detection rates of pyengine's regression checks (``pyengine bench``).

Runs ``pyengine bench`` repeatedly on one build and counts verdicts:

- ``--self N`` self-comparisons: the same build against itself, which must report zero
  regressions; A/B mode (``--compare-python``: this interpreter plays both builds, or
  ``--rev REV`` to build REV once, as ``--compare-rev`` does) and/or baseline mode (one
  ``--json`` baseline, then N ``--compare`` runs).
- ``--detect N`` runs per factor in ``--factors`` with ``PYENGINE_BENCH_SLOWDOWN`` making
  ``--target`` (kernel:backend) that much slower in the new build: each must be flagged.
- From the self-comparisons' intervals, the smallest slowdown each kernel family would be
  flagged at (threshold factor / the lowest interval bound seen on any of its rows).

Every run happens in a temporary folder (outside the source tree). Full run, from the
repository root (quiet machine, ~1 h): ``python benchmarks/scripts/false_alarm.py --out false_alarm.json``;
reduced (a loaded machine, a few minutes): ``--self 2 --detect 2 --factors 1.5
--kernels layer_norm,rms_norm,softmax --backends cpp``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

FAMILIES = {"layer": "layernorm", "rms": "rmsnorm", "softmax": "softmax", "attention": "attention",
            "gelu": "activations", "relu": "activations", "silu": "activations", "newton": "orthogonalize"}


def _family(kernel: str) -> str:
    return FAMILIES.get(kernel.split("_")[0], kernel.split("_")[0])


def _bench(args: list[str], env: dict[str, str], cwd: str) -> tuple[int, dict]:
    out = os.path.join(cwd, "run.json")
    proc = subprocess.run([sys.executable, "-m", "pyengine", "bench", "--quick", *args, "--json", out], cwd=cwd,
                          env=env, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"pyengine bench {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(out, encoding="utf-8") as f:
        return proc.returncode, {"report": json.load(f), "stdout": proc.stdout}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--self", type=int, default=10, dest="n_self")
    p.add_argument("--detect", type=int, default=5)
    p.add_argument("--factors", default="1.5,1.2")
    p.add_argument("--target", default="layer_norm:cpp")
    p.add_argument("--mode", choices=["ab", "baseline", "both"], default="both")
    p.add_argument("--rev", help="build this revision as the old side of the A/B (default: this interpreter)")
    p.add_argument("--kernels")
    p.add_argument("--backends")
    p.add_argument("--out", help="write the summary as JSON")
    a = p.parse_args(argv)
    sel = [*(["--kernels", a.kernels] if a.kernels else []), *(["--backends", a.backends] if a.backends else [])]
    old = ["--compare-rev", a.rev, "--repo", os.getcwd()] if a.rev else ["--compare-python", sys.executable]
    env = {k: v for k, v in os.environ.items() if k not in ("PYENGINE_BENCH_SLOWDOWN", "PYTHONPATH")}
    factors = [float(f) for f in a.factors.split(",")]
    summary: dict = {"argv": sys.argv[1:], "modes": {}}
    with tempfile.TemporaryDirectory(prefix="pyengine-false-alarm-") as cwd:
        modes = ["ab", "baseline"] if a.mode == "both" else [a.mode]
        for mode in modes:
            base_args = []
            if mode == "baseline":
                _bench(sel, env, cwd)
                os.replace(os.path.join(cwd, "run.json"), os.path.join(cwd, "base.json"))
                base_args = ["--compare", os.path.join(cwd, "base.json")]
            how = (old if mode == "ab" else base_args) + sel
            res = {"self": [], "detect": {}}
            lows: dict[str, float] = {}
            row_lows: dict[str, float] = {}  # per row: the lowest interval bound of the self-comparisons
            for i in range(a.n_self):
                code, got = _bench(how, env, cwd)
                flagged = [ln for ln in got["stdout"].splitlines() if ln.startswith("REGRESSION")]
                res["self"].append({"exit": code, "regressions": flagged})
                print(f"[{mode}] self {i + 1}/{a.n_self}: {len(flagged)} regression(s)", flush=True)
                for ln in flagged:
                    print("   ", ln)
                if mode == "ab":
                    for r in got["report"]["results"]:
                        fam = _family(r["kernel"])
                        lows[fam] = min(lows.get(fam, float("inf")), r["low"])
                        row = f"{r['kernel']} {r['backend']} {r['dtype']} {r['size']}"
                        row_lows[row] = min(row_lows.get(row, float("inf")), r["low"])
                    res["threshold"] = got["report"]["threshold"]
            if mode == "ab" and lows:
                lim = 1 / (1 - res["threshold"])
                res["smallest_flagged_slowdown_per_family"] = {f: lim / lo for f, lo in sorted(lows.items())}
                res["smallest_flagged_slowdown_per_row"] = {k: lim / lo for k, lo in sorted(row_lows.items())}
            kernel, backend = a.target.split(":")
            for factor in factors:
                hits = []
                for i in range(a.detect):
                    code, got = _bench(how, {**env, "PYENGINE_BENCH_SLOWDOWN": f"{a.target}={factor}"}, cwd)
                    hit = any(ln.startswith("REGRESSION") and f"{kernel} {backend} " in ln
                              for ln in got["stdout"].splitlines())
                    hits.append(hit)
                    print(f"[{mode}] x{factor} {i + 1}/{a.detect}: {'flagged' if hit else 'MISSED'}", flush=True)
                res["detect"][str(factor)] = hits
            res["false_alarm_runs"] = sum(1 for s in res["self"] if s["regressions"])
            summary["modes"][mode] = res
    for mode, res in summary["modes"].items():
        print(f"{mode}: {res['false_alarm_runs']} of {len(res['self'])} self-comparisons reported a regression; "
              + "; ".join(f"x{f} flagged {sum(h)}/{len(h)}" for f, h in res["detect"].items()))
        per_row = res.get("smallest_flagged_slowdown_per_row", {})
        for fam, s in res.get("smallest_flagged_slowdown_per_family", {}).items():
            worst = max((k for k in per_row if _family(k.split()[0]) == fam), key=per_row.get, default="")
            print(f"   {fam}: a slowdown above x{s:.2f} is flagged (from the self-comparisons' intervals; "
                  f"decided by {worst})")
        if per_row:
            vals = sorted(per_row.values())
            print(f"   per row: median x{vals[len(vals) // 2]:.2f}, {sum(v <= 1.2 for v in vals)} of {len(vals)} rows "
                  f"at or below x1.2, {sum(v <= 1.5 for v in vals)} at or below x1.5")
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
