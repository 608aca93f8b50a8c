"""Experiments built on pyengine's engine; each returns a report object with its numbers.

:func:`recovery` — the residual-recovery experiment behind ``pyengine recovery``.
"""

from .recovery import Recovery, default_model, recovery

__all__ = ["Recovery", "default_model", "recovery"]
