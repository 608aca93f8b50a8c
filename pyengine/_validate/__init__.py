"""Argument checks shared by the public API, and their error messages: the one home of them.

Every check names the argument, what was expected and what was given (DESIGN.md, "Bad
input"), before any kernel runs. :mod:`.values` checks scalar arguments (counts, reals,
flags, options, indices, seeds, callbacks); :mod:`.arrays` checks arrays (shapes, dtypes,
finiteness) and turns the kernels' bad-row counts into messages. Callers use
``from pyengine import _validate as _v`` and ``_v.<check>``.
"""

from .arrays import *  # noqa: F403
from .arrays import DENSE_MAX_BYTES  # noqa: F401
from .values import *  # noqa: F403
from .values import BENCH_FIGURES, BENCH_KEYS, FLOAT_DTYPES, MODES  # noqa: F401
