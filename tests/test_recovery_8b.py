"""``pyengine recovery`` on a streamed Llama-3-8B-shaped checkpoint: peak memory and the time-left estimate."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from test_streaming import write_bf16_llama

#: Runs the CLI in the child and reports the child's own peak resident set (KiB) on the last line of stderr.
_CHILD = textwrap.dedent("""
    import resource, sys
    from pyengine.cli import main
    rc = main(sys.argv[1:])
    print(f"peak_rss_kib {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr)
    sys.exit(rc)
""")


def word_tokenizer(folder: str, n_words: int) -> None:
    """A word-level tokenizer.json in ``folder``: "w0" .. "w{n_words - 1}" are ids 1.., "[UNK]" 0."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(n_words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(os.path.join(folder, "tokenizer.json"))


@pytest.mark.slow
def test_recovery_on_two_8b_blocks_streams_and_estimates_its_time(tmp_path):
    """Two Llama-3-8B-shaped blocks (d 4096, GQA 32/8, d_mlp 14336; 0.9 GB of bf16, 1.7 GB of float32
    weights), streamed; K = 8 directions injected at the last of T = 128 tokens. The run's peak RSS
    stays under 4.75 GiB: the pool's two blocks of float32 weights (1.7 GB, shared by the ablation
    copies, which would otherwise add two blocks each: 5.3 GiB), the mapped bf16 pages (0.9 GB),
    the activations and the interpreter (measured 3.7 GiB in a development checkout, 4.1 GiB in a
    clean install); the time left printed when the second stage starts does not underestimate the
    end by more than 2x nor overestimate it by more than 3x (the first stage pays the cold reads),
    and once a warm forward stage has been measured the estimate is within 1.5x."""
    folder = write_bf16_llama(str(tmp_path / "m"), d=4096, H=32, Hkv=8, L=2, n=14336, V=256, shards=2)
    word_tokenizer(folder, 255)
    text = " ".join(f"w{(7 * i) % 255}" for i in range(128))
    args = ["recovery", "--model", folder, "--weights", "mmap", "--text", text, "--layer", "0", "--directions", "8",
            "--positions", "last", "--scales", "6", "--no-spectra", "--no-plots", "--progress", "auto",
            "--out", str(tmp_path / "o")]
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, cwd=tmp_path)
    wall = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    rss = int(re.search(r"peak_rss_kib (\d+)", r.stderr).group(1)) * 1024
    print(f"wall {wall:.1f} s, peak RSS {rss / 2**30:.2f} GiB\n{r.stderr}")
    assert rss < 4.75 * 2**30
    lines = {m.group(2): m.groups() for m in
             re.finditer(r"\]\s+([\d.]+) s  (.+?)  \(about ([\d.]+) (s|min) left\)", r.stderr)}
    final = float(re.search(r"\]\s+([\d.]+) s  done", r.stderr).group(1))

    def predicted(stage):
        at, _, left, unit = lines[stage]
        return float(at) + float(left) * (60 if unit == "min" else 1)

    # the first estimate rests on the first stage alone, which pays the cold reads of the weights
    # (and the compile of the reader): on the safe side, at most 3x
    assert final / 2 <= predicted("linearized propagation") <= 3 * final, (lines, final)
    # once a warm forward stage has been measured (the ablation), within 1.5x
    assert final / 1.5 <= predicted("sweep: norm eps") <= 1.5 * final, (lines, final)


_MEMORY = textwrap.dedent("""
    import resource, sys
    from pyengine.experiments import recovery
    from pyengine.models.pretrained import load_pretrained
    m = load_pretrained(sys.argv[1], weights="mmap")
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    recovery(m, text=" ".join(f"w{i % 63}" for i in range(64)), layer=0, n_directions=4, positions="last",
             scales=[6.0], spectra=False)
    print(loaded * 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
""")


def test_recovery_on_a_streamed_model_holds_few_blocks(tmp_path):
    """d = 1024, 4 streamed blocks of 58 MiB in float32: the whole run (its six ablation models
    included, each a model.replace of the streamed one) adds less than 4.5 blocks to the
    resident peak after loading."""
    folder = write_bf16_llama(str(tmp_path / "m"), d=1024, H=8, Hkv=2, L=4, n=4096, V=64)
    word_tokenizer(folder, 63)
    r = subprocess.run([sys.executable, "-c", _MEMORY, folder], capture_output=True, text=True, check=True,
                       cwd=tmp_path)
    loaded, peak = map(int, r.stdout.split())
    block_f32 = 4 * (2 * 1024 * 1024 + 2 * 256 * 1024 + 3 * 1024 * 4096)
    assert peak - loaded < 4.5 * block_f32, (loaded, peak)
