"""Per-block time of each stage of ``pyengine.experiments.recovery`` on a streamed Llama-3-8B-shaped bf16
checkpoint (d = 4096, GQA 32/8, d_mlp = 14336, V = 256), its peak RSS, and the 32-block figure they
extrapolate to.

    python benchmarks/scripts/recovery_8b.py [--layers 3] [--folder /tmp/pe8b-rec] [--spectra-layers last]

Writes the synthetic checkpoint with ``tests/test_streaming.py``'s writer and a word-level tokenizer
(reused if present), then runs, in a child process, ``recovery`` on the streamed model
(``load_pretrained(folder, weights="mmap")``) as ``pyengine recovery --layer 0 --directions 8
--positions last --scales 6`` runs it, on T = 128 words (no spectra unless ``--spectra-layers``).
Prints, per stage, its wall seconds and the process's CPU seconds (on a loaded machine the CPU
time is the better guide to a quiet run), per block passed (per block formed for the spectra);
the time left estimated when each stage began; the child's peak RSS; and the sum that 32 blocks
would take at those per-block times: an extrapolation, stated as one.
"""
import argparse
import json
import os
import subprocess
import sys
import textwrap

from _common import TESTS

CHILD = textwrap.dedent("""
    import json, resource, sys, time
    from pyengine.experiments import recovery
    from pyengine.models.pretrained import load_pretrained
    folder, text, spectra = sys.argv[1], sys.argv[2], sys.argv[3]
    model = load_pretrained(folder, weights="mmap")
    marks = []  # [stage, wall, cpu, fraction] where each stage begins

    def progress(fraction, stage):
        if not marks or marks[-1][0] != stage:
            marks.append([stage, time.perf_counter(), time.process_time(), fraction])

    t0 = time.perf_counter()
    layers = spectra if spectra in ("none", "all", "last") else [int(v) for v in spectra.split(",")]
    rep = recovery(model, text=text, layer=0, n_directions=8, positions="last", scales=[6.0],
                   spectra=spectra != "none", spectra_layers="all" if spectra == "none" else layers,
                   progress=progress)
    formed = int((~(rep.rho != rep.rho).all(axis=1)).sum()) if rep.rho.size else 0
    print(json.dumps({"marks": marks, "t0": t0, "formed": formed, "n_layers": model.config.n_layers,
                      "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
""")

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--folder", default="/tmp/pe8b-rec")
    ap.add_argument("--spectra-layers", default="none", help="e.g. last or 0,2 (default none: no spectra)")
    ap.add_argument("--blocks", type=int, default=32, help="the depth to extrapolate to (default 32)")
    a = ap.parse_args()
    sys.path.insert(0, str(TESTS))
    if not os.path.isfile(os.path.join(a.folder, "config.json")):
        from test_streaming import write_bf16_llama

        write_bf16_llama(a.folder, d=4096, H=32, Hkv=8, L=a.layers, n=14336, V=256, shards=2)
    if not os.path.isfile(os.path.join(a.folder, "tokenizer.json")):
        from test_recovery_8b import word_tokenizer

        word_tokenizer(a.folder, 255)
    text = " ".join(f"w{(7 * i) % 255}" for i in range(128))
    r = subprocess.run([sys.executable, "-c", CHILD, a.folder, text, a.spectra_layers], check=True,
                       capture_output=True, text=True)
    doc = json.loads(r.stdout.splitlines()[-1])
    marks, L = doc["marks"], doc["n_layers"]
    print(f"{L} streamed blocks; peak RSS {doc['rss'] / 2**30:.2f} GiB; total {marks[-1][1] - doc['t0']:.1f} s wall")
    ext_wall = ext_cpu = 0.0
    for (stage, w0, c0, f0), (_, w1, c1, _) in zip(marks, marks[1:]):
        spec = stage == "block Jacobian spectra"
        n, blocks = (doc["formed"], doc["formed"]) if spec else (L, a.blocks)
        pw, pc = ((w1 - w0) / n, (c1 - c0) / n) if n else (0.0, 0.0)
        ext_wall, ext_cpu = ext_wall + pw * blocks, ext_cpu + pc * blocks
        left = f"{(w0 - doc['t0']) * (1 - f0) / f0:.0f} s" if f0 > 0 else "-"
        print(f"  {stage:24s} wall {w1 - w0:7.1f} s, CPU {c1 - c0:7.1f} s = {pw:6.1f} / {pc:6.1f} s a block x {n}"
              f"  (time left estimated as it began: {left})")
    print(f"extrapolated to {a.blocks} blocks ({doc['formed']} spectra blocks): {ext_wall / 60:.1f} min wall, "
          f"{ext_cpu / 60:.1f} min CPU")
