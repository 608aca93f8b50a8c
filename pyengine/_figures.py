"""The one figure style of pyengine: rcParams, axis helpers and the writer every plot uses.

Every plotting function draws inside :func:`styled` (a decorator) or :func:`style` (a
context manager), makes its figure with :func:`subplots`, and writes it with :func:`save`.
Figures are sized for a paper: :data:`COLUMN` inches wide for one panel, :data:`PAGE` for a
row of panels, at the font sizes of :data:`RC`. matplotlib is imported on first use only,
so ``import pyengine`` stays fast, and no pyplot state is touched: the figures are plain
:class:`matplotlib.figure.Figure` objects, drawn with the Agg, PDF or SVG canvas.

API
---
``FORMATS``                       the file formats written: ``("png", "pdf", "svg")``
``check_format(fmt)``             ``fmt`` if it is one of them; a ValueError naming ``fmt`` otherwise
``style()`` / ``@styled``         the shared rcParams, as a context manager / a decorator
``subplots(nrows, ncols, size)``  a constrained-layout Figure and its axes (pyplot's signature)
``layer_axis(ax, axis="x")``      integer ticks (layers, blocks, steps)
``log_axis(ax, axis="y")``        a log scale with plain decimal tick labels (0.5, 1, 2, 5)
``heatmap_grid(fig, axes, arrays, label=...)``  one colour scale and one colorbar for a grid
``save(fig, path, fmt="png")``    write ``path`` with the extension ``fmt`` (png at 200 dpi)
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

__all__ = ["COLUMN", "FORMATS", "PAGE", "PNG_DPI", "RC", "check_format", "heatmap_grid", "layer_axis",
           "log_axis", "save", "style", "styled", "subplots"]

#: The formats :func:`save` writes (and the choices of the CLI's ``--format``).
FORMATS = ("png", "pdf", "svg")
#: Resolution of PNG files (pdf and svg are vector formats).
PNG_DPI = 200
#: Width in inches of a single-column figure and of a full-page-width figure.
COLUMN, PAGE = 3.4, 7.0

#: The shared rcParams: 8-9 pt sans-serif text with matching mathtext, constrained layout
#: (titles and labels are never clipped), no top/right spines, fonts embedded as TrueType in
#: PDF, and files that do not change from run to run (fixed SVG ids, no creation dates).
RC: dict[str, Any] = {
    "font.family": "sans-serif",
    "font.size": 8.0,
    "axes.titlesize": 8.5,
    "axes.labelsize": 8.0,
    "xtick.labelsize": 7.5,
    "ytick.labelsize": 7.5,
    "legend.fontsize": 7.0,
    "legend.title_fontsize": 7.0,
    "legend.framealpha": 0.85,
    "legend.borderaxespad": 0.3,
    "figure.titlesize": 9.0,
    "mathtext.fontset": "dejavusans",
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.linewidth": 0.7,
    "lines.linewidth": 1.2,
    "lines.markersize": 3.5,
    "xtick.major.width": 0.7,
    "ytick.major.width": 0.7,
    "grid.linewidth": 0.5,
    "grid.alpha": 0.35,
    "figure.constrained_layout.use": True,
    "figure.dpi": 100,
    "savefig.dpi": PNG_DPI,
    "savefig.bbox": "tight",
    "savefig.pad_inches": 0.03,
    "pdf.fonttype": 42,
    "svg.hashsalt": "pyengine",
    "image.cmap": "viridis",
}

F = TypeVar("F", bound=Callable[..., Any])


def check_format(fmt: Any) -> str:
    """``fmt`` if it is one of :data:`FORMATS`; a ValueError naming ``fmt`` otherwise."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(map(repr, FORMATS))}; got {fmt!r}")
    return fmt


@contextlib.contextmanager
def style() -> Iterator[None]:
    """The shared rcParams, for the duration of the block (text takes its size when drawn)."""
    import matplotlib

    with matplotlib.rc_context(RC):
        yield


def styled(func: F) -> F:
    """Decorator: run ``func`` (which makes, draws and saves figures) inside :func:`style`."""
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with style():
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def subplots(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (COLUMN, 2.6),
             **kwargs: Any) -> tuple[Any, Any]:
    """A constrained-layout :class:`~matplotlib.figure.Figure` of ``size`` inches and its axes.

    Parameters
    ----------
    nrows, ncols : int
        The grid of axes.
    size : (float, float)
        Width and height in inches (:data:`COLUMN` or :data:`PAGE` wide).
    **kwargs
        Passed to :meth:`matplotlib.figure.Figure.subplots` (``squeeze``, ``sharex``, ...).

    Returns
    -------
    fig : matplotlib.figure.Figure
    axes : Axes or ndarray of Axes
        As :func:`matplotlib.pyplot.subplots` returns them.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.subplots(nrows, ncols, **kwargs)


def layer_axis(ax: Any, axis: str = "x") -> None:
    """Integer ticks on ``axis`` ("x" or "y") of ``ax``: layers, blocks, training steps."""
    from matplotlib.ticker import MaxNLocator

    getattr(ax, f"{axis}axis").set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))


def _label(v: float, plain: bool) -> str:
    """A log-axis tick label: a plain decimal, or a power of ten (other ticks unlabelled)."""
    if v <= 0 or not math.isfinite(v):
        return ""
    if plain:
        return f"{v:g}"
    e = round(math.log10(v))
    return f"$10^{{{e}}}$" if abs(v / 10.0**e - 1) < 1e-6 else ""  # 2 and 5 ticks stay unlabelled


def _formatter() -> Any:
    """Plain decimals when every visible tick lies in [10^-4, 10^5), powers of ten otherwise."""
    from matplotlib.ticker import Formatter

    class ReadableLog(Formatter):
        plain = True

        def set_locs(self, locs: Any) -> None:
            lo, hi = sorted(self.axis.get_view_interval()) if self.axis is not None else (-np.inf, np.inf)
            shown = [t for t in locs if lo * (1 - 1e-9) <= t <= hi * (1 + 1e-9)]
            self.plain = all(1e-4 <= t < 1e5 for t in shown)

        def __call__(self, x: float, pos: int | None = None) -> str:
            return _label(x, self.plain)

    return ReadableLog()


def _locator() -> Any:
    """Major ticks of a log axis, chosen from the view interval at draw time."""
    from matplotlib.ticker import LogLocator, MaxNLocator

    class ReadableLog(LogLocator):
        def tick_values(self, vmin: float, vmax: float) -> Any:
            lo, hi = sorted((vmin, vmax))
            if lo <= 0 or not math.isfinite(lo * hi):
                return super().tick_values(vmin, vmax)
            decades = math.log10(hi / lo)
            if decades < 1:  # less than a decade: evenly spaced plain numbers (25, 30, 35, 40)
                ticks = MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi)
                return ticks[ticks > 0]
            self.set_params(subs=(1.0, 2.0, 5.0) if decades <= 3 else (1.0,))
            return super().tick_values(vmin, vmax)

    return ReadableLog(base=10.0, subs=(1.0,), numticks=12)


def log_axis(ax: Any, axis: str = "y") -> None:
    """A log scale on ``axis`` ("x" or "y") with readable ticks whatever the range.

    Less than a decade: evenly spaced plain numbers (0.25, 0.3, 0.35); up to three decades:
    1, 2, 5 in each decade (0.5, 1, 2, 5, 10); more: one tick per decade. Labels are plain
    decimals when every tick lies between 0.0001 and 10^5, powers of ten otherwise (the 2 and 5
    ticks then unlabelled), never "6×10⁰".
    """
    from matplotlib.ticker import LogLocator, NullFormatter

    a = getattr(ax, f"{axis}axis")
    getattr(ax, f"set_{axis}scale")("log")
    a.set_major_locator(_locator())
    a.set_major_formatter(_formatter())
    a.set_minor_locator(LogLocator(base=10.0, subs=np.arange(2, 10), numticks=12))
    a.set_minor_formatter(NullFormatter())


def _norm(values: np.ndarray, center: float | None) -> tuple[Any, str]:
    """The colour scale of ``values``: centred for signed data, log for positive data over decades."""
    from matplotlib.colors import CenteredNorm, LogNorm, Normalize

    v = values[np.isfinite(values)]
    if v.size == 0:
        return Normalize(0.0, 1.0), "viridis"
    if center is not None or (v.min() < 0 < v.max()):
        return CenteredNorm(vcenter=0.0 if center is None else center), "RdBu_r"
    pos = v[v > 0]
    if v.min() >= 0 and pos.size and pos.max() / pos.min() > 100:
        # zeros (a causal mask, say) are drawn in the "bad" colour; the scale spans at most 4 decades
        return LogNorm(vmin=max(pos.min(), pos.max() * 1e-4), vmax=pos.max()), "viridis"
    return Normalize(float(v.min()), float(v.max())), "viridis"


def heatmap_grid(fig: Any, axes: Sequence[Any], arrays: Sequence[np.ndarray], *, label: str = "",
                 center: float | None = None, **imshow: Any) -> list[Any]:
    """Draw ``arrays`` on ``axes`` with one shared colour scale and one colorbar for the grid.

    Parameters
    ----------
    fig : matplotlib.figure.Figure
    axes : sequence of Axes, or an ndarray of them (flattened)
        One per array.
    arrays : sequence of (m, n) arrays
        The heat maps. The scale: centred at ``center`` (a diverging map) when given or when the
        data take both signs; logarithmic when they are positive and span more than two decades
        (zeros then show in light grey); linear otherwise.
    label : str
        The colorbar's label.
    **imshow
        Passed to :meth:`~matplotlib.axes.Axes.imshow` (``cmap`` overrides the chosen map).

    Returns
    -------
    list of AxesImage
    """
    import matplotlib
    from matplotlib.colors import LogNorm

    axes = list(np.ravel(np.asarray(axes, dtype=object)))
    if len(axes) != len(arrays):
        raise ValueError(f"axes and arrays must have the same length; got {len(axes)} and {len(arrays)}")
    norm, cmap = _norm(np.concatenate([np.ravel(np.asarray(a, dtype=float)) for a in arrays]), center)
    cmap = matplotlib.colormaps[imshow.pop("cmap", cmap)].with_extremes(bad="0.88")
    imshow.setdefault("interpolation", "nearest")
    images = [ax.imshow(np.asarray(a, dtype=float), norm=norm, cmap=cmap, **imshow) for ax, a in zip(axes, arrays)]
    bar = fig.colorbar(images[0], ax=axes, shrink=0.9, aspect=30, pad=0.02)
    if isinstance(norm, LogNorm):
        bar.locator, bar.formatter = _locator(), _formatter()
    bar.set_label(label)
    return images


def save(fig: Any, path: str, fmt: str = "png") -> str:
    """Write ``fig`` to ``path`` with its extension set to ``fmt`` and release it; the path written.

    Parameters
    ----------
    fig : matplotlib.figure.Figure
    path : str
        The file, with or without an extension: ``out/recovery`` and ``out/recovery.png``
        both become ``out/recovery.pdf`` for ``fmt="pdf"``.
    fmt : {"png", "pdf", "svg"}
        PNG at :data:`PNG_DPI` dpi, or a vector format.

    Returns
    -------
    str
        The path of the file written.
    """
    check_format(fmt)
    stem, ext = os.path.splitext(path)
    path = (stem if ext.lstrip(".").lower() in FORMATS else path) + "." + fmt
    # no creation date in the file: the same figure gives the same bytes
    meta = {"pdf": {"CreationDate": None}, "svg": {"Date": None}, "png": {"Software": None}}[fmt]
    with style():
        fig.savefig(path, format=fmt, dpi=PNG_DPI, metadata=meta)
    fig.clear()
    return path
