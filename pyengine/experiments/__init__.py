"""Experiments built on pyengine's engine; each returns a report object with its numbers.

:func:`recovery` — the residual-recovery experiment behind ``pyengine recovery``;
:func:`format_table` and :func:`write_report` print and save its report.
:func:`attention_dynamics` — attention gradient dynamics on a sticky Markov chain (``pyengine
attention``); :func:`format_attention_table` and :func:`write_attention_report`.
:func:`stability` — signal propagation, spectral condition, steepest descent (``pyengine stability``).
"""

from ._report import format_table
from ._report import write as write_report
from .recovery import Recovery, default_model, recovery
from .attention_dynamics import AttentionDynamics, attention_dynamics
from ._attention_report import format_attention_table, write_attention_report
from .stability import Stability, format_stability, stability, write_stability

__all__ = ["AttentionDynamics", "Recovery", "attention_dynamics", "default_model", "format_attention_table",
           "format_stability", "format_table", "recovery", "stability", "write_attention_report",
           "write_report", "write_stability", "Stability"]
