"""The figure style (:mod:`pyengine._figures`)."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

from pyengine import _figures as F

MAGIC = {"png": (b"\x89PNG\r\n\x1a\n",), "pdf": (b"%PDF",), "svg": (b"<?xml", b"<svg")}


def _is(path, fmt: str) -> bool:
    head = pathlib.Path(path).read_bytes()[:4096]
    return head.startswith(MAGIC[fmt][0]) and all(m in head for m in MAGIC[fmt])


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
