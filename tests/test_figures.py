"""The figure style (:mod:`pyengine._figures`) and ``--format png|pdf|svg`` on every plotting command."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

import pyengine as pe
from pyengine import _figures as F
from pyengine.cli import main

MAGIC = {"png": (b"\x89PNG\r\n\x1a\n",), "pdf": (b"%PDF",), "svg": (b"<?xml", b"<svg")}


def _is(path, fmt: str) -> bool:
    head = pathlib.Path(path).read_bytes()[:4096]
    return head.startswith(MAGIC[fmt][0]) and all(m in head for m in MAGIC[fmt])


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory) -> str:
    cfg = pe.StackConfig(d_model=16, n_heads=2, n_layers=3, d_mlp=32, vocab_size=256, max_seq_len=64)
    path = str(tmp_path_factory.mktemp("model") / "stack.npz")
    pe.init_weights(cfg, seed=0).save(path)
    return path


#: command -> (arguments of a fast run, with {out} and {model} to fill; the figures it writes).
COMMANDS = {
    "recovery": (["recovery", "--model", "{model}", "--text", "a short one", "--layer", "1", "--scales", "0.01,1",
                  "--directions", "2", "--out", "{out}", "--progress", "never"], ["recovery"]),
    "attention": (["attention", "--steps", "3", "--seeds", "1", "--T", "40", "--workers", "1", "--out", "{out}",
                   "--progress", "never"], ["attention_loss", "attention_heatmaps", "attention_value_pca"]),
    "stability": (["stability", "--depth", "2", "--width", "16", "--tokens", "4", "--schemes", "kaiming_normal",
                   "--stack-depth", "1", "--stack-width", "16", "--model", "none", "--out", "{out}"],
                  ["stability", "stack_stability", "descent"]),
    "positions": (["positions", "--contexts", "24", "--length", "8", "--ablation-contexts", "6", "--out", "{out}"],
                  ["positions_depth", "positions_angles", "placement"]),
    "scan": (["scan", "spectral", "--model", "tiny", "--tokens", "100", "--seq-len", "50", "--workers", "0",
              "--progress", "never", "--out", "{out}"], ["sigma_max"]),
}


def _argv(cmd: str, out, model: str) -> list[str]:
    return [a.format(out=out, model=model) for a in COMMANDS[cmd][0]]


@pytest.mark.parametrize("fmt", ["svg", "pdf"])
@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_format_option_writes_every_figure_in_that_format(cmd, fmt, tmp_path, small_stack, capsys):
    out = tmp_path / "out"
    assert main([*_argv(cmd, out, small_stack), "--format", fmt]) == 0, capsys.readouterr().err
    for name in COMMANDS[cmd][1]:
        assert _is(out / f"{name}.{fmt}", fmt), name
    assert not [f for f in os.listdir(out) if f.endswith(".png")]


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_bad_format_is_one_argparse_error(cmd, tmp_path, small_stack, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*_argv(cmd, tmp_path / "out", small_stack), "--format", "jpg"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "argument --format: invalid choice: 'jpg'" in err
    assert not (tmp_path / "out").exists()


def test_library_writers_check_fmt_before_writing(tmp_path):
    from pyengine.experiments import write_report

    with pytest.raises(ValueError, match="fmt must be one of 'png', 'pdf', 'svg'; got 'jpg'"):
        write_report(None, str(tmp_path / "out"), fmt="jpg")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("path, fmt, written", [("a/fig.png", "pdf", "a/fig.pdf"), ("a/fig", "svg", "a/fig.svg"),
                                                ("a/fig.v2", "png", "a/fig.v2.png")])
def test_save_sets_the_extension_and_the_format(tmp_path, path, fmt, written):
    os.makedirs(tmp_path / "a")
    fig, ax = F.subplots()
    ax.plot([0, 1], [1, 2])
    assert F.save(fig, str(tmp_path / path), fmt) == str(tmp_path / written)
    assert _is(tmp_path / written, fmt) and not fig.axes  # released


def test_save_is_reproducible(tmp_path):
    def draw(name: str) -> bytes:
        fig, ax = F.subplots()
        ax.plot([0, 1], [1, 2], label=r"$\sigma_{\max}$")
        ax.legend()
        return pathlib.Path(F.save(fig, str(tmp_path / name), "svg")).read_bytes()

    assert draw("a") == draw("b")


def _ticks(ax, axis: str = "y") -> list[str]:
    ax.figure.canvas.draw()
    return [t.get_text() for t in getattr(ax, f"get_{axis}ticklabels")() if t.get_text()]


@pytest.mark.parametrize("lo, hi, expect", [
    (4.9, 6.0, ["5", "5.25", "5.5", "5.75", "6"]),  # under a decade: plain, evenly spaced
    (0.3, 8.0, ["0.5", "1", "2", "5"]),  # 1-2-5 in each decade
    (1e-7, 30.0, ["$10^{-6}$", "$10^{-4}$", "$10^{-2}$", "$10^{0}$"]),  # many decades: powers of ten
])
def test_log_axis_labels_are_plain_numbers(lo, hi, expect):
    with F.style():
        fig, ax = F.subplots()
        ax.plot([0, 1], [lo, hi])
        F.log_axis(ax)
        labels = _ticks(ax)
    assert set(expect) <= set(labels), labels
    assert not any("times" in t for t in labels)


def test_layer_axis_has_integer_ticks():
    fig, ax = F.subplots()
    ax.plot([0, 3], [0, 1])
    F.layer_axis(ax)
    assert all(float(t).is_integer() for t in ax.get_xticks())


@pytest.mark.parametrize("data, norm", [
    (np.linspace(0.1, 1.0, 16).reshape(4, 4), "Normalize"),
    (np.tril(np.logspace(-4, 0, 16).reshape(4, 4)), "LogNorm"),
    (np.linspace(-1, 3, 16).reshape(4, 4), "CenteredNorm"),
])
def test_heatmap_grid_shares_one_scale_and_one_colorbar(data, norm):
    fig, axes = F.subplots(2, 2)
    images = F.heatmap_grid(fig, axes, [data, data / 2, data, data], label="weight")
    assert {type(im.norm).__name__ for im in images} == {norm} and len({id(im.norm) for im in images}) == 1
    assert len(fig.axes) == 5  # four maps and one colorbar
    if norm == "CenteredNorm":
        assert images[0].norm.vcenter == 0 and images[0].cmap.name.startswith("RdBu")
    with pytest.raises(ValueError, match="same length"):
        F.heatmap_grid(fig, axes, [data])


def test_check_format():
    assert [F.check_format(f) for f in F.FORMATS] == ["png", "pdf", "svg"]
    with pytest.raises(ValueError, match="fmt must be one of"):
        F.check_format("PNG")
