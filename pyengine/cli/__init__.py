"""The ``pyengine`` command (also ``python -m pyengine``).

``pyengine recovery``  the main job: inject a direction into the residual stream and
                   measure its decay, exact and linearized, with spectra and ablations.
``pyengine demo``  every normalization kernel on every backend: agreement with the
                   NumPy reference and throughput, on a built-in synthetic batch.
``pyengine spectral``  per-token sigma_max of LayerNorm/RMSNorm Jacobians of activations.
``pyengine bench``  every kernel x backend, as a fraction of the machine's limits
                   measured in the same run; ``--compare`` checks for regressions.
``pyengine attention``  attention gradient dynamics on a sticky Markov chain (EM-style vs GD).
``pyengine stability``  forward/backward signal propagation by init scheme, the spectral
                   condition of a model, steepest descent under norms.
``pyengine backends``  which backends load, and why not.

Bad arguments never end in a traceback: one line on stderr (with a "did you mean" for a
mistyped option) and exit status 2;
Ctrl-C ends the run with one line and exit status 130.

One module per subcommand, named as the subcommand, in :data:`COMMANDS`; each has
``add_parser(subparsers)`` (adds its ``argparse`` subparser) and ``run(args) -> int``
(the exit status). A new subcommand is a new module and its name in :data:`COMMANDS`.
Progress bars come from :mod:`pyengine._progress`, which ``pyengine bench`` shares.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence
from types import ModuleType

from .._progress import end_line
from .._version import __version__
from ._provenance import ARGV

__all__ = ["COMMANDS", "main", "parser"]

#: The subcommand modules of this package, in the order ``pyengine --help`` lists them.
COMMANDS = ("demo", "backends", "spectral", "recovery", "positions", "attention", "stability", "scan", "bench")

#: Errors that end a run with one line and exit status 2: bad arguments or input files,
#: a missing optional dependency, a request too large for memory.
ERRORS = (ValueError, TypeError, OSError, MemoryError, ImportError)


def _commands() -> dict[str, ModuleType]:
    return {name: importlib.import_module(f"{__name__}.{name}") for name in COMMANDS}


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``<prog>: error: <message>``, exit status 2
    (no usage dump: ``--help`` shows it); its subparsers are of this class too."""

    def error(self, message: str):  # type: ignore[override]
        import difflib

        bad = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if bad and (m := difflib.get_close_matches(bad[1], re.findall(r"'([^']*)'", bad[2]), 1)):
            message += f"; did you mean {m[0]!r}?"
        end_line()
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _options(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[argparse.ArgumentParser, list[str]]:
    """The innermost subparser chosen in ``args`` and its option strings."""
    while True:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if chosen is None or chosen not in subs[0].choices:
            return p, [o for a in p._actions for o in a.option_strings]
        p = subs[0].choices[chosen]


def _parse(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``p.parse_args(argv)``, with a "did you mean" for a mistyped option of the subcommand."""
    import difflib

    args, extra = p.parse_known_args(argv)
    if extra:
        sub, options = _options(p, args)
        hints = [f"{a} (did you mean {m[0]}?)" if a.startswith("-")
                 and (m := difflib.get_close_matches(a.split("=")[0], options, 1)) else a for a in extra]
        sub.error(f"unrecognized arguments: {' '.join(hints)}")
    return args


def parser() -> argparse.ArgumentParser:
    """The argument parser of the ``pyengine`` command, with every subcommand of :data:`COMMANDS`."""
    p = _Parser(prog="pyengine", description=_plain(__doc__.split("\n\n")[0]),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=_plain(__doc__.split("\n\n")[2]))
    p.add_argument("--version", action="version", version=f"pyengine {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for module in _commands().values():
        module.add_parser(sub)
    return p


def _plain(text: str) -> str:
    """Docstring text as help text: no reStructuredText markup (``literal``, :role:`target`)."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)
    return text.replace("``", "")


#: Options whose value may start with "-" ("-3:", "-1"): argparse would read it as an option.
DASH_VALUES = ("--positions", "--spectral-tokens")


def _join_dash_values(argv: Sequence[str]) -> list[str]:
    """``--positions -3:`` -> ``--positions=-3:`` for the options of :data:`DASH_VALUES`."""
    out, it = [], iter(argv)
    for a in it:
        if a in DASH_VALUES:
            nxt = next(it, None)
            if nxt is None:
                out.append(a)
            elif nxt.startswith("-") and len(nxt) > 1 and (nxt[1].isdigit() or nxt[1] == ":"):
                out.append(f"{a}={nxt}")
            else:
                out.extend((a, nxt))
        else:
            out.append(a)
    return out


def _thread_pools() -> None:
    """libgomp's spin count of :func:`pyengine.bench.tuned_environment`, where the user set no
    wait policy. libgomp reads it when it loads, with the compiled extension or Numba's OpenMP
    layer: so only while neither is loaded (``import pyengine`` loads neither); the worker
    processes of a run inherit it."""
    if "pyengine._core" in sys.modules or "numba" in sys.modules:
        return
    from ..bench import tuned_environment

    if "GOMP_SPINCOUNT" in (tuned := tuned_environment()):
        os.environ["GOMP_SPINCOUNT"] = tuned["GOMP_SPINCOUNT"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``pyengine`` command with ``argv`` (default: ``sys.argv[1:]``); the exit status."""
    _thread_pools()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(parser(), _join_dash_values(argv))
    setattr(args, ARGV, ["pyengine", *argv])  # the provenance of the JSON files this run writes
    try:
        return _commands()[args.command].run(args)
    except KeyboardInterrupt as exc:  # a subcommand may say what it kept: KeyboardInterrupt("...")
        end_line()
        print(f"pyengine: interrupted{'; ' + str(exc.args[0]) if exc.args else ''}", file=sys.stderr)
        return 130
    except ERRORS as exc:
        end_line()
        print(f"pyengine: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
