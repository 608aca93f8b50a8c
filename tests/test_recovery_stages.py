"""The time-left estimate of recovery's stages (pyengine.experiments._recovery_stages) and its display."""

from __future__ import annotations

import io

import pytest

from pyengine import _progress
from pyengine.experiments import _recovery_stages


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(_recovery_stages.time, "perf_counter", c)
    monkeypatch.setattr(_progress.time, "perf_counter", c)
    return c


def test_time_left_uses_each_stage_measured_time_per_pass(clock):
    """A (forward, 2 passes), B (jvp, 2), C (forward, 4): the running stage's own rate, a later
    stage of its kind at that rate, an unmeasured kind at the mean rate of those measured."""
    calls, records = [], []
    st = _recovery_stages.Stages(lambda f, s: calls.append((f, s)), lambda s, r: records.append(s),
                                 {"A": ("forward", 2), "B": ("jvp", 2), "C": ("forward", 4)})
    step = st.start("A")
    assert calls[-1] == (0.0, "A")  # nothing measured: no estimate
    clock.t = 1.0
    step(1, 2)  # 1 s a pass: A 1 s left, B 2 s (the running rate), C 4 s
    assert calls[-1] == (pytest.approx(1 / 8), "A")
    clock.t = 2.0
    st.finish(None, lambda out: {})
    st.start("B")  # B at the forward rate (the only one measured): 2 s; C 4 s
    assert calls[-1] == (pytest.approx(2 / 8), "B")
    clock.t = 6.0
    st.finish(None, lambda out: {})  # jvp: 2 s a pass, C still at forward's 1 s
    step = st.start("C")
    assert calls[-1] == (pytest.approx(6 / 10), "C")
    clock.t = 7.0
    step(1, 4)  # C turned out 4x slower than forward was: its own rate now, 3 steps of 1 s
    assert calls[-1] == (pytest.approx(7 / 10), "C")
    st.plan_stage("C", "forward", 8)
    st.finish(None, lambda out: {})
    st.done()
    assert calls[-1] == (1.0, "done") and records == ["A", "B", "C"] and st.rate == {"forward": 0.125, "jvp": 2.0}
    assert st.seconds == {"A": 2.0, "B": 4.0, "C": 1.0}


def test_progress_prints_the_time_left_the_fraction_implies(clock):
    log = io.StringIO()
    p = _progress.Progress(lines=True, stream=log, eta=True)
    p.stage(0.0, "exact propagation")
    clock.t = 20.0
    p.stage(0.25, "linearized propagation")  # 20 s for a quarter: 60 s left
    clock.t = 200.0
    p.stage(0.5, "spectra")
    p.stage(1.0, "done")
    lines = log.getvalue().splitlines()
    assert lines[0].endswith("  exact propagation")
    assert lines[1].endswith("linearized propagation  (about 60 s left)")
    assert lines[2].endswith("spectra  (about 3.3 min left)") and lines[3].endswith("  done")
    assert _progress.duration(7200) == "2.0 h"
    plain = io.StringIO()
    _progress.Progress(lines=True, stream=plain).stage(0.5, "x")
    assert "left" not in plain.getvalue()
