"""load_pretrained(folder, weights="mmap"): block weights read when the block runs; results equal to
the fully loaded model; peak resident memory of a bf16 Llama-shaped checkpoint measured in a
subprocess and bounded far under its float32 size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pyengine.analysis.block_spectra import block_jacobian_norm
from pyengine.analysis.propagate import propagate
from pyengine.models.pretrained import load_pretrained


def write_bf16_llama(folder, d, H, Hkv, L, n, V, seed=0, shards=2):
    """A random Llama-shaped checkpoint in bf16, written tensor by tensor (never all in memory)."""
    os.makedirs(folder, exist_ok=True)
    dh = d // H
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (V, d), "model.norm.weight": (d,), "lm_head.weight": (V, d)}
    for k in range(L):
        p = f"model.layers.{k}."
        shapes.update({p + "self_attn.q_proj.weight": (H * dh, d), p + "self_attn.k_proj.weight": (Hkv * dh, d),
                       p + "self_attn.v_proj.weight": (Hkv * dh, d), p + "self_attn.o_proj.weight": (d, H * dh),
                       p + "mlp.gate_proj.weight": (n, d), p + "mlp.up_proj.weight": (n, d),
                       p + "mlp.down_proj.weight": (d, n), p + "input_layernorm.weight": (d,),
                       p + "post_attention_layernorm.weight": (d,)})
    names = list(shapes)
    groups = [names[i::shards] for i in range(shards)]
    wmap = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        header, off = {}, 0
        for name in group:
            nbytes = 2 * int(np.prod(shapes[name]))
            header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [off, off + nbytes]}
            off += nbytes
            wmap[name] = fname
        raw = json.dumps(header).encode()
        with open(os.path.join(folder, fname), "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for name in group:
                shape = shapes[name]
                fan = shape[-1] if len(shape) == 2 else 1
                for rows in np.array_split(np.arange(shape[0]), max(1, shape[0] // 1024)):
                    x = rng.standard_normal((len(rows),) + shape[1:], dtype=np.float32) / np.float32(np.sqrt(fan))
                    if len(shape) == 1:
                        x = np.float32(1.0) + np.float32(0.1) * x
                    f.write((x.view(np.uint32) >> 16).astype("<u2").tobytes())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wmap}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "hidden_size": d, "num_attention_heads": H, "num_key_value_heads": Hkv,
                   "num_hidden_layers": L, "intermediate_size": n, "vocab_size": V, "rms_norm_eps": 1e-5,
                   "rope_theta": 500000.0, "max_position_embeddings": 256, "tie_word_embeddings": False,
                   "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}, f)
    return folder


def test_streamed_equals_loaded(tmp_path):
    folder = write_bf16_llama(str(tmp_path / "m"), d=32, H=4, Hkv=2, L=3, n=48, V=50)
    full, lazy = load_pretrained(folder), load_pretrained(folder, weights="mmap")
    ids = np.array([1, 7, 3, 22, 9, 40, 2, 5])
    assert np.array_equal(full.hidden_states(ids), lazy.hidden_states(ids))
    assert np.array_equal(full.logits(ids), lazy.logits(ids))
    for dt in (np.float32, np.float64):
        assert np.array_equal(full.hidden_states(ids, dtype=dt), lazy.hidden_states(ids, dtype=dt))
    h = full.hidden_states(ids)[1]
    rng = np.random.default_rng(0)
    u = rng.standard_normal((2,) + h.shape).astype(np.float32)
    assert np.array_equal(full.block_jvp(1, h, u), lazy.block_jvp(1, h, u))
    assert np.array_equal(full.block_vjp(1, h, u), lazy.block_vjp(1, h, u))
    for k in range(3):
        assert all(np.array_equal(a, full.block_weights(k)[n]) for n, a in lazy.block_weights(k).items())
    v = rng.standard_normal(32)
    a = propagate(full, ids, v, 0.5, layer=1)
    b = propagate(lazy, ids, v, 0.5, layer=1)
    assert any(isinstance(x, np.ndarray) for x in vars(a).values())
    for name, x in vars(a).items():
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, vars(b)[name]), name
    ja, jb = block_jacobian_norm(full, ids, 1), block_jacobian_norm(lazy, ids, 1)
    assert np.array_equal(ja.sigma, jb.sigma) and ja.sigma.size and np.all(ja.sigma > 0)
    assert lazy.replace(gamma_scale=0.5).hidden_states(ids).tolist() == full.replace(
        gamma_scale=0.5).hidden_states(ids).tolist()
    with pytest.raises(ValueError, match="weights must be"):
        load_pretrained(folder, weights="lazy")


# Peak resident memory of the child. ru_maxrss (getrusage) is the obvious reading, but Linux keeps
# it across fork + exec: a child of a big pytest process starts at its parent's peak. VmHWM in
# /proc/self/status belongs to the new address space and starts at zero; getrusage is the fallback.
_RSS = textwrap.dedent("""
    import resource, sys, time, numpy as np
    from pyengine.kernels.widen import bf16_transpose_into
    from pyengine.models.pretrained import load_pretrained

    def peak():
        try:
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
        except (OSError, StopIteration):
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    folder, mode = sys.argv[1], sys.argv[2]
    m = load_pretrained(folder, weights=mode)
    # the reader's compiled kernel, loaded before the baseline: Numba's runtime is not weights
    bf16_transpose_into(np.zeros((1, 1), np.uint16), np.zeros((1, 1), np.float32))
    base = peak()
    ids = np.arange(int(sys.argv[3])) % m.config.vocab_size
    t = time.perf_counter()
    hs = m.hidden_states(ids)
    dt = time.perf_counter() - t
    np.save(sys.argv[4], hs[-1])
    print(peak(), dt, base)
""")


def _peak(folder, mode, T, out):
    r = subprocess.run([sys.executable, "-c", _RSS, folder, mode, str(T), out], capture_output=True, text=True,
                       check=True, cwd=os.path.dirname(out))
    rss, secs, base = r.stdout.split()
    return int(rss), float(secs), int(base)


def test_streaming_peak_memory_small(tmp_path):
    """d = 1024, 8 blocks: float32 weights 8 x 50 MB = 400 MB. Streamed, the run adds less than 2.5 blocks'
    worth to the resident peak after loading (the block running, the next one being read and widened, and
    the mapped bf16 pages of the file); loaded, the model holds all 8 blocks after loading."""
    folder = write_bf16_llama(str(tmp_path / "m"), d=1024, H=8, Hkv=2, L=8, n=4096, V=64)
    block_f32 = 4 * (2 * 1024 * 1024 + 2 * 256 * 1024 + 3 * 1024 * 4096)
    lazy, _, lazy_base = _peak(folder, "mmap", 16, str(tmp_path / "a.npy"))
    full, _, full_base = _peak(folder, "load", 16, str(tmp_path / "b.npy"))
    assert np.array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy"))
    assert lazy - lazy_base < 2.5 * block_f32, (lazy, lazy_base)
    assert full_base - lazy_base > 6 * block_f32, (full_base, lazy_base)  # what streaming saves


@pytest.mark.slow
def test_streaming_peak_memory_multi_gb(tmp_path):
    """d = 4096, Llama-3-8B blocks (GQA 32/8, d_mlp 14336), 6 blocks in bf16: 2.6 GB on disk, 5.2 GB
    of float32 weights; the streamed run must peak under 2.5 GB resident."""
    folder = write_bf16_llama(str(tmp_path / "m"), d=4096, H=32, Hkv=8, L=6, n=14336, V=256, shards=3)
    lazy, secs, _ = _peak(folder, "mmap", 128, str(tmp_path / "a.npy"))
    print(f"streamed peak RSS {lazy / 2**30:.2f} GiB, hidden_states T=128 over 6 blocks {secs:.1f} s")
    assert lazy < 2.5 * 2**30
