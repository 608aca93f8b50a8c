#!/usr/bin/env bash
# Issue 11's speed figures on a quiet machine, from the repository root with the package
# installed (pip install -e ".[test]"); the experiment runs outside the source tree.
#   bash benchmarks/issue11_quiet.sh [OUT_DIR]
set -euo pipefail
out=${1:-/tmp/issue11-quiet}
mkdir -p "$out"
root=$(pwd)
python benchmarks/attention_step_compare.py --repeat 30 | tee "$out/step.txt"
python benchmarks/issue11_targets.py --repeat 30 --json "$out/targets.json" | tee "$out/targets.txt"
cd "$out" && /usr/bin/time -p pyengine attention --out "$out/attention-out" --progress never 2>&1 | tee "$out/attention.txt"
cd "$root"
