"""The ``pyengine`` command: its subcommand modules, ``python -m pyengine``, one-line errors,
Ctrl-C, and the one progress display (``pyengine._progress``) it shares with bench."""

from __future__ import annotations

import importlib
import io
import subprocess
import tempfile
import sys

import pytest

from pyengine import _progress, cli
from pyengine._progress import Progress


def _run_module(*args: str) -> subprocess.CompletedProcess:
    # Run outside the source tree: `python -m` puts the working directory first on sys.path,
    # and there `pyengine/` is the source folder (no built extension), not the installed package.
    return subprocess.run([sys.executable, "-m", "pyengine", *args], capture_output=True, text=True, timeout=120,
                          cwd=tempfile.gettempdir())


def test_every_subcommand_is_a_module_with_add_parser_and_run():
    sub = next(a for a in cli.parser()._actions if a.dest == "command")
    assert tuple(sub.choices) == cli.COMMANDS
    for name in cli.COMMANDS:
        module = importlib.import_module(f"pyengine.cli.{name}")
        assert callable(module.add_parser) and callable(module.run)


def test_python_m_pyengine_works_like_the_command(capsys):
    done = _run_module("backends")
    assert done.returncode == 0, done.stderr
    assert cli.main(["backends"]) == 0
    assert done.stdout == capsys.readouterr().out
    assert {"cpp", "numba", "numpy"} <= {line.split()[0] for line in done.stdout.splitlines()}
    helped = _run_module("--help")
    assert helped.returncode == 0
    assert all(name in helped.stdout for name in cli.COMMANDS)


def test_python_m_pyengine_bad_argument_is_one_line_without_traceback():
    done = _run_module("demo", "--d", "1")
    assert done.returncode == 2
    assert done.stderr == "pyengine: error: --d must be at least 2; got 1\n"


def test_bad_weights_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "stack.npz"
    bad.write_bytes(b"this is not a zip file")
    assert cli.main(["recovery", "--model", str(bad), "--progress", "never", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pyengine: error:") and err.count("\n") == 1


def test_ctrl_c_is_one_line_and_ends_an_open_bar(monkeypatch, capsys):
    def interrupted(args):
        Progress("always", label="work").update(0.5, "halfway")
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module("pyengine.cli.backends"), "run", interrupted)
    assert cli.main(["backends"]) == 130
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "pyengine: interrupted"
    assert "halfway\n" in err  # the bar's line was ended before the message
    assert "Traceback" not in err and not _progress._open


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal():
    tty = _Tty()
    p = Progress(label="sigma_max", unit="tokens", stream=tty)
    assert p.enabled
    p.count(1, 4)
    p.count(4, 4)
    out = tty.getvalue()
    assert out.startswith("\r\033[Ksigma_max [#######.......................]  25.0%  1/4 tokens")
    assert out.endswith("\n") and out.count("\n") == 1 and "100.0%  4/4 tokens" in out
    tty = _Tty()
    p = Progress(stream=tty)
    p.step(0, 2, "layer_norm numba")
    p.step(2, 2, "done")
    assert "  0.0%  0/2 layer_norm numba" in tty.getvalue() and tty.getvalue().endswith("2/2 done\n")
    tty = _Tty()
    p = Progress(stream=tty)
    p.status("layer_norm on cpp ...")
    p.status("")
    assert tty.getvalue() == "\r\033[Klayer_norm on cpp ...\r\033[K"
    assert not _progress._open


def test_progress_stages_bar_or_lines():
    tty = _Tty()
    p = Progress(lines=True, stream=tty)
    p.stage(0.0, "forward")
    p.stage(1.0, "done")
    assert tty.getvalue().count("\r\033[K[") == 2 and tty.getvalue().endswith("done\n")
    log = io.StringIO()  # not a terminal: one line per new stage
    p = Progress(lines=True, stream=log)
    for frac, stage in [(0.0, "forward"), (0.1, "forward"), (0.5, "spectra"), (1.0, "done")]:
        p.stage(frac, stage)
    lines = log.getvalue().splitlines()
    assert [line.split("s  ")[-1] for line in lines] == ["forward", "spectra", "done"]
    assert lines[1].startswith("[ 50.0%]")


@pytest.mark.parametrize("mode, lines", [("never", True), ("auto", False)])
def test_progress_silent(mode, lines):
    for stream in (io.StringIO(), _Tty()):
        if mode == "auto" and isinstance(stream, _Tty):
            continue
        p = Progress(mode, lines=lines, stream=stream)
        p.count(1, 2)
        p.stage(0.5, "x")
        p.step(1, 2)
        p.status("x")
        assert stream.getvalue() == ""
    with pytest.raises(ValueError, match="progress mode must be one of"):
        Progress("sometimes")
