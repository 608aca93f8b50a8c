"""Experiments built on pyengine's engine; each returns a report object with its numbers.

:func:`recovery` — the residual-recovery experiment behind ``pyengine recovery``;
:func:`format_table` and :func:`write_report` print and save its report.
"""

from ._report import format_table
from ._report import write as write_report
from .recovery import Recovery, default_model, recovery

__all__ = ["Recovery", "default_model", "format_table", "recovery", "write_report"]
