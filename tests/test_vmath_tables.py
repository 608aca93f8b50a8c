"""The polynomial tables that the C++ kernels (csrc/vmath.hpp) and the Numba kernels
(kernels/_numba/_vecmath.py) each spell out are the same numbers, read from the header's
text: the two backends evaluate one erfcx and one exponential."""

from __future__ import annotations

import fractions
import pathlib
import re

import numpy as np
import pytest

from pyengine.kernels._numba import _vecmath

HEADER = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "vmath.hpp"


def _double(term: str) -> float:
    """A C++ double literal, or a quotient ``a / b`` of two (one IEEE division, as in C++)."""
    parts = [float(p) for p in term.split("/")]
    return parts[0] if len(parts) == 1 else parts[0] / parts[1]


def _nearest_f32(exact: fractions.Fraction) -> np.float32:
    """The float32 nearest to ``exact`` (what a C++ float literal is), ties to even."""
    guess = np.float32(float(exact))
    cands = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return min(cands, key=lambda c: (abs(fractions.Fraction(float(c)) - exact), int(c.view(np.uint32)) & 1))


def header_table(name: str) -> list:
    """The entries of ``inline constexpr double|float <name>[] = {...};`` in vmath.hpp, as C++ rounds them."""
    text = HEADER.read_text()
    m = re.search(r"inline\s+constexpr\s+(double|float)\s+" + re.escape(name) + r"\[\]\s*=\s*\{([^}]*)\}", text)
    assert m, f"{name} not found in {HEADER}"
    terms = [t for t in m.group(2).replace("\n", " ").split(",") if t.strip()]
    if m.group(1) == "float":
        return [_nearest_f32(fractions.Fraction(t.strip().rstrip("fF"))) for t in terms]
    return [_double(t) for t in terms]


@pytest.mark.parametrize("cpp, python", [("kErfcxCoef", "ERFCX_COEF"), ("kErfcxCoefF", "ERFCX_COEF_F"),
                                         ("kExpCoef", "EXP_COEF")])
def test_header_and_numba_tables_are_identical(cpp, python):
    ours = list(getattr(_vecmath, python))
    theirs = header_table(cpp)
    assert len(ours) == len(theirs), (cpp, len(theirs), python, len(ours))
    for k, (a, b) in enumerate(zip(ours, theirs)):
        assert type(a) is type(b) and a == b, f"{python}[{k}] = {a!r} but {cpp}[{k}] = {b!r}"


def test_the_parser_reads_quotients_and_rounds_float_literals_once():
    assert _double(" 1.0 / 6 ") == 1.0 / 6 and _double("-2.5e-3") == -2.5e-3
    assert header_table("kExpCoef")[:4] == [1.0, 1.0, 0.5, 1.0 / 6]
    # 1 + 2^-24 + 2^-60 rounds up to 1 + 2^-23 in one step, but to 1 through the double 1 + 2^-24
    exact = 1 + fractions.Fraction(1, 2**24) + fractions.Fraction(1, 2**60)
    assert _nearest_f32(exact) == np.float32(1 + 2.0**-23) != np.float32(float(exact))
