"""Per-block time and peak memory of a streamed Llama-3-8B-shaped bf16 checkpoint (d = 4096, GQA 32/8,
d_mlp = 14336), for the README's 8B estimate.

    python benchmarks/scripts/streaming_8b.py [--layers 4] [--T 128] [--K 8] [--folder /tmp/pe8b]

Writes the synthetic checkpoint (reused if present), then in a fresh subprocess measures, per block,
the streamed forward (read + convert + block; ``pyengine.bench.time_call`` with one call after a
warm-up call, so the checkpoint's pages are in the page cache) and a K-tangent block JVP, float32;
prints medians over the blocks and the subprocess's peak RSS (resource.getrusage).
"""
import argparse
import os
import subprocess
import sys
import textwrap

from _common import TESTS

CHILD = textwrap.dedent("""
    import resource, sys, numpy as np
    from pyengine.bench import time_call
    from pyengine.models.pretrained import load_pretrained
    folder, T, K = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    m = load_pretrained(folder, weights="mmap")
    ids = np.arange(T) % m.config.vocab_size
    h = m.embed(ids)
    rng = np.random.default_rng(0)
    fwd, jvp = [], []
    for k in range(m.config.n_layers):
        fwd.append(time_call(lambda: m.block_forward(k, h), 1)[0])
        u = rng.standard_normal((K,) + h.shape).astype(np.float32)
        jvp.append(time_call(lambda: m.block_jvp(k, h, u), 1)[0])
        h = m.block_forward(k, h)
    print(f"per block: forward (read + convert + run) median {np.median(fwd):.2f} s, "
          f"K={K} JVP median {np.median(jvp):.2f} s over {len(fwd)} blocks; "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
""")

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--folder", default="/tmp/pe8b")
    a = ap.parse_args()
    if not os.path.isfile(os.path.join(a.folder, "config.json")):
        sys.path.insert(0, str(TESTS))
        from test_streaming import write_bf16_llama
        write_bf16_llama(a.folder, d=4096, H=32, Hkv=8, L=a.layers, n=14336, V=256, shards=2)
    subprocess.run([sys.executable, "-c", CHILD, a.folder, str(a.T), str(a.K)], check=True, cwd="/tmp")
