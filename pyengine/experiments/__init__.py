"""Experiments built on pyengine's engine; each returns a report object with its numbers.

:func:`recovery` — the residual-recovery experiment behind ``pyengine recovery``;
:func:`format_table` and :func:`write_report` print and save its report.
:func:`attention_dynamics` — attention gradient dynamics on a sticky Markov chain (``pyengine
attention``); :func:`format_attention_table` and :func:`write_attention_report`.
"""

from ._report import format_table
from ._report import write as write_report
from .recovery import Recovery, default_model, recovery
from .attention_dynamics import AttentionDynamics, attention_dynamics
from ._attention_report import format_attention_table, write_attention_report

__all__ = ["AttentionDynamics", "Recovery", "attention_dynamics", "default_model", "format_attention_table",
           "format_table", "recovery", "write_attention_report", "write_report"]
