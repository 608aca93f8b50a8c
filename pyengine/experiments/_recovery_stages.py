"""The stages of one :func:`pyengine.experiments.recovery` run: timing, ``on_stage`` records, and a
progress fraction that estimates the share of the run's *time* already spent.

Each stage is announced with its work in block passes (a propagation: the baseline forward
and one sweep through the blocks, 2 passes; the spectra: a prior of
:data:`SPECTRA_PASSES` passes per block formed) and a kind (``"forward"``: the exact
propagations and the ablations; ``"jvp"``; ``"linear"``; ``"spectra"``). The time left is

* for the running stage, its own measured time per step (a block of its sweep, a block of
  its spectra, a fit of a sweep) times the steps left, once one step is done;
* for a later stage, its passes times the seconds per pass last measured on a finished stage
  of its kind, else on the running stage, else the mean over the finished ones.

The fraction is ``elapsed / (elapsed + left)``, so that ``elapsed * (1 - f) / f`` (what
:class:`pyengine._progress.Progress` prints as the time left) is that estimate. It is not
clamped: when a stage turns out slower than estimated, the fraction steps back.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from ._report import _clean

__all__ = ["SPECTRA_PASSES", "Stages"]

#: Block passes one block's spectra are assumed to cost before any has been measured (dense
#: d = 768: about 10 forward passes; matrix-free d = 4096: about 40).
SPECTRA_PASSES = 20.0

Progress = Callable[[float, str], None]


def _quiet(*args: Any) -> None:
    """No progress lines, no stage records."""


class Stages:
    """Progress, timing and ``on_stage`` records of the stages of one run (see the module docstring).

    ``plan``: ``{stage: (kind, passes)}`` of every stage, in order; :meth:`plan_stage` may revise an
    entry before the stage starts. ``t_start``: the run's start (``time.perf_counter()``; default now).
    """

    def __init__(self, progress: Progress | None, on_stage: Callable[[str, dict[str, Any]], None] | None,
                 plan: dict[str, tuple[str, float]], t_start: float | None = None) -> None:
        self.say = progress or _quiet
        self.keep = on_stage or _quiet
        self.plan = dict(plan)
        self.seconds: dict[str, float] = {}
        self.rate: dict[str, float] = {}  # kind -> seconds per pass, last finished stage of that kind
        self.t_start = time.perf_counter() if t_start is None else t_start
        self.stage, self.t0 = "", self.t_start

    def plan_stage(self, stage: str, kind: str, passes: float) -> None:
        """Revise the work of a stage not started yet."""
        self.plan[stage] = (kind, float(passes))

    def start(self, stage: str) -> Callable[[int, int], None]:
        """Begin ``stage``; returns the progress(done, total) of its steps."""
        self.stage, self.t0 = stage, time.perf_counter()
        self.say(self._fraction(0, 0), stage)
        return functools.partial(self._step, stage)

    def _step(self, stage: str, done: int, total: int) -> None:
        self.say(self._fraction(done, total), stage)

    def _fraction(self, done: int, total: int) -> float:
        """``elapsed / (elapsed + left)`` with the running stage ``done`` of ``total`` steps (0, 0: just begun)."""
        now = time.perf_counter()
        elapsed, spent = now - self.t_start, now - self.t0
        kind, passes = self.plan[self.stage]
        running = spent / (passes * done / total) if done and passes > 0 else None  # seconds per pass
        rates = list(self.rate.values())
        fallback = running if running is not None else (sum(rates) / len(rates) if rates else None)
        if done:
            left = spent * (total - done) / done
        else:
            rate = self.rate.get(kind, fallback)
            left = None if rate is None else max(passes * rate - spent, 0.0)
        later = list(self.plan)[list(self.plan).index(self.stage) + 1:]
        for s in later:
            k, p = self.plan[s]
            rate = running if k == kind and running is not None and k not in self.rate else self.rate.get(k, fallback)
            if left is None or rate is None:
                return 0.0  # nothing measured yet: no estimate
            left += p * rate
        if left is None:
            return 0.0
        return elapsed / (elapsed + left) if elapsed + left > 0 else 1.0

    def finish(self, out: Any, record: Callable[[Any], dict[str, Any]]) -> Any:
        """End the stage begun last: time it, hand ``record(out)`` to on_stage; returns ``out``."""
        self.seconds[self.stage] = time.perf_counter() - self.t0
        kind, passes = self.plan[self.stage]
        if passes > 0:
            self.rate[kind] = self.seconds[self.stage] / passes
        self.keep(self.stage, _clean({"stage": self.stage, "seconds": self.seconds[self.stage], **record(out)}))
        return out

    def done(self) -> None:
        """The run has finished: progress 1."""
        self.say(1.0, "done")
