"""A streamed Llama-3-8B-shaped bf16 checkpoint (d = 4096, GQA 32/8, d_mlp = 14336) against the same
blocks loaded as float32: the time ratio of a forward sweep and of a K-tangent JVP sweep, the cost of
one block read, and the peak memory of the streamed model, for the README's 8B estimate.

    python benchmarks/scripts/streaming_8b.py [--layers 4] [--T 128] [--K 8] [--rounds 3] [--folder /tmp/pe8b]

Writes the synthetic checkpoint (reused if present), then in a fresh subprocess:

1. peak RSS of a streamed ``hidden_states`` (VmHWM), before the loaded model exists;
2. one block read without read-ahead, synchronously (what a block costs without overlap);
3. the ratio streamed / loaded float32, side by side, alternated (``pyengine.bench.time_alternated``,
   ``paired_ratio``): ``--sweeps`` forward sweeps ``h = block_forward(k, h)`` over every block, and
   as many sweeps of ``block_jvp(k, h_k, u)`` with K tangents, each timed call ending when the
   streamed model's read-ahead has finished. Every streamed block is read (4 blocks do not stay
   in two buffers); the loaded model holds the same float32 weights in memory (about 0.9 GB a
   block). Per-block figures are call times over blocks x sweeps.
"""
import argparse
import os
import subprocess
import sys
import textwrap

from _common import TESTS

CHILD = textwrap.dedent("""
    import sys, threading, time, numpy as np
    from pyengine.bench import paired_ratio, time_alternated
    from pyengine.models.pretrained import load_pretrained
    folder, T, K, rounds, sweeps = sys.argv[1], *map(int, sys.argv[2:6])

    def peak():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

    def settled():  # a read still running ahead would be timed with the other model
        for t in threading.enumerate():
            if t.name.startswith("pyengine-read-ahead"):
                t.join()

    lazy = load_pretrained(folder, weights="mmap")
    L = lazy.config.n_layers
    ids = np.arange(T) % lazy.config.vocab_size
    hs = lazy.hidden_states(ids)
    print(f"streamed hidden_states: peak RSS {peak() / 2**30:.2f} GiB ({L} blocks)", flush=True)
    settled()
    t = time.perf_counter()
    lazy._read_block(0, np.dtype(np.float32))
    print(f"one block read into new arrays, nothing overlapped: {time.perf_counter() - t:.2f} s", flush=True)
    full = load_pretrained(folder)
    u = np.random.default_rng(0).standard_normal((K,) + hs[0].shape).astype(np.float32)

    def forward(m):
        def run():
            for _ in range(sweeps):
                h = hs[0]
                for k in range(L):
                    h = m.block_forward(k, h)
            settled()
        return run

    def jvp(m):
        def run():
            for _ in range(sweeps):
                for k in range(L):
                    m.block_jvp(k, hs[k], u)
            settled()
        return run

    for what, make in (("forward", forward), (f"K={K} JVP", jvp)):
        times = time_alternated({"loaded": make(full), "streamed": make(lazy)}, rounds)
        r = paired_ratio(times["loaded"], times["streamed"])
        print(f"{what}: per block loaded {np.median(times['loaded']) / L / sweeps:.2f} s, streamed "
              f"{np.median(times['streamed']) / L / sweeps:.2f} s; ratio streamed/loaded {r.ratio:.2f} "
              f"[{r.low:.2f}, {r.high:.2f}] over {rounds} rounds", flush=True)
""")

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sweeps", type=int, default=2)
    ap.add_argument("--folder", default="/tmp/pe8b")
    a = ap.parse_args()
    if not os.path.isfile(os.path.join(a.folder, "config.json")):
        sys.path.insert(0, str(TESTS))
        from test_streaming import write_bf16_llama
        write_bf16_llama(a.folder, d=4096, H=32, Hkv=8, L=a.layers, n=14336, V=256, shards=2)
    subprocess.run([sys.executable, "-c", CHILD, a.folder, str(a.T), str(a.K), str(a.rounds), str(a.sweeps)], check=True,
                   cwd="/tmp")
