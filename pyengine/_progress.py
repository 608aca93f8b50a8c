"""The one progress display of pyengine: a bar or a status line on stderr.

Foundation (a root module), so that both ``pyengine bench`` (:mod:`pyengine.bench`,
itself foundation) and the subcommands of :mod:`pyengine.cli` use it. One bar
format everywhere::

    <label> [##########....................]  33.3%  <text>

redrawn in place (carriage return, erase line) while stderr is a terminal, and
ended with a newline when the work is done. Away from a terminal (a log file, a
pipe) nothing is drawn, unless the display was made with ``lines=True``: then each
new stage is printed once, as ``[ 33.3%]   12.0 s  <stage>``, so a log shows
where the time went.

Callers hand one of its methods to the code that reports progress:
``count(done, total)`` (items: tokens, rows), ``stage(fraction, stage)`` (named
stages of an experiment), ``step(done, total, what)`` (a plan of benchmark cases),
``status(text)`` (a transient status line, no bar). :func:`end_line` ends a line
left open by any display, so an error message starts on a line of its own.

A display made with ``eta=True`` takes the fractions of :meth:`stage` as estimates of the
share of the run's *time* done (as :func:`pyengine.experiments.recovery` computes them from
the measured time per block of each stage) and adds the time left they imply,
``elapsed * (1 - f) / f``: ``[ 33.3%]   12.0 s  exact propagation  (about 24 s left)``.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["MODES", "WIDTH", "Progress", "duration", "end_line"]

#: ``mode`` of a :class:`Progress`: draw when stderr is a terminal, always, or never.
MODES = ("auto", "always", "never")
#: Characters of the bar.
WIDTH = 30

#: The stream a display left a line open on (drawn without its newline), if any.
_open: list[TextIO] = []


def end_line() -> None:
    """End a progress line left open (by an error or Ctrl-C midway), so the next message
    starts on its own line; nothing if none is open."""
    while _open:
        print(file=_open.pop(), flush=True)


def duration(seconds: float) -> str:
    """``12 s``, ``4.5 min`` or ``1.2 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


class Progress:
    """A progress display on stderr (``stream``).

    Parameters
    ----------
    mode : {"auto", "always", "never"}
        ``auto`` draws the bar when the stream is a terminal; ``always`` draws it
        anyway; ``never`` prints nothing at all.
    label : str
        Printed before the bar.
    lines : bool
        Away from a terminal in ``auto`` mode, print one line per new stage (see
        :meth:`stage`) instead of nothing.
    unit : str
        What :meth:`count` counts ("tokens").
    eta : bool
        :meth:`stage` prints the time left that its fractions imply (see the module docstring).
    """

    def __init__(self, mode: str = "auto", *, label: str = "", lines: bool = False, unit: str = "",
                 stream: TextIO | None = None, eta: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"progress mode must be one of {', '.join(map(repr, MODES))}; got {mode!r}")
        self.stream = sys.stderr if stream is None else stream
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        #: True when the bar is drawn.
        self.enabled = tty if mode == "auto" else mode == "always"
        self.log = lines and mode == "auto" and not tty
        self.label, self.unit, self.eta = label, unit, eta
        self.t0 = time.perf_counter()
        self._stage: str | None = None

    @property
    def elapsed(self) -> float:
        """Seconds since the display was made."""
        return time.perf_counter() - self.t0

    def _draw(self, line: str, final: bool) -> None:
        print(f"\r\033[K{line}", end="\n" if final else "", file=self.stream, flush=True)
        if final:
            if self.stream in _open:
                _open.remove(self.stream)
        elif self.stream not in _open:
            _open.append(self.stream)

    def update(self, fraction: float, text: str = "", final: bool = False) -> None:
        """Draw the bar at ``fraction`` (0..1) with ``text`` after it; ``final`` ends the line."""
        if not self.enabled:
            return
        frac = min(max(fraction, 0.0), 1.0)
        fill = int(WIDTH * frac)
        head = f"{self.label} " if self.label else ""
        self._draw(f"{head}[{'#' * fill}{'.' * (WIDTH - fill)}] {100 * frac:5.1f}%  {text}".rstrip(), final)

    def count(self, done: int, total: int) -> None:
        """``callback(done, total)`` of a job over ``total`` items: the count and the rate."""
        rate = done / max(self.elapsed, 1e-9)
        unit = f" {self.unit}" if self.unit else ""
        self.update(done / total if total else 1.0, f"{done}/{total}{unit}  {rate:,.0f}/s", done >= total)

    def stage(self, fraction: float, stage: str) -> None:
        """``progress(fraction, stage)`` of an experiment; the stage ``"done"`` ends it."""
        left = self.time_left(fraction) if self.eta and stage != "done" else None
        tail = "" if left is None else f"  (about {duration(left)} left)"
        if self.enabled:
            self.update(fraction, f"{self.elapsed:6.1f} s  {stage}{tail}", stage == "done")
        elif self.log and stage != self._stage:
            print(f"[{100 * fraction:5.1f}%] {self.elapsed:6.1f} s  {stage}{tail}", file=self.stream, flush=True)
        self._stage = stage

    def time_left(self, fraction: float) -> float | None:
        """Seconds left if ``fraction`` of the time is spent: ``elapsed * (1 - f) / f`` (None at 0)."""
        if not 0.0 < fraction:
            return None
        return self.elapsed * max(1.0 - fraction, 0.0) / fraction

    def step(self, done: int, total: int, what: str = "") -> None:
        """Step ``done`` of a plan of ``total`` (``what``: the step now running); ends at ``total``."""
        self.update(done / total if total else 1.0, f"{done}/{total} {what}", done >= total)

    def status(self, text: str) -> None:
        """A transient status line without a bar; ``""`` erases it."""
        if self.enabled:
            self._draw(text, False)
            if not text and self.stream in _open:
                _open.remove(self.stream)
