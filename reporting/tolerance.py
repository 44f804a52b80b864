"""When two numbers of the report are the same: every comparison the report states goes through here.

Rewards are float32 model outputs summed and averaged in float64; the same prompts batched differently move them in
the last few float32 digits (an issue saw -1.68 reported "below" -1.68 over a difference of 8e-8). Such a difference
is no verdict, so two numbers a and b are **the same** when

    |a - b| <= max(REL_TOL x max(|a|, |b|), ABS_TOL)

REL_TOL = 1e-6 is about 16 float32 units in the last place (float32 keeps 2^-24 ~ 6e-8 relative), the drift of
a reduction over a few hundred terms; ABS_TOL = 1e-9 stands in near zero, where a relative tolerance vanishes (a
reward gain of 0 against 1e-12). Both are far below any difference the bootstrap intervals could resolve, so the
tolerance only removes verdicts that rest on rounding. `less`, `greater` and the rest are the strict and loose
orders beyond it; the report uses nothing else to compare rewards, costs and gains.
"""

from __future__ import annotations

REL_TOL = 1e-6
ABS_TOL = 1e-9


def same(a: float, b: float) -> bool:
    """a and b differ by no more than the tolerance."""
    return abs(a - b) <= max(REL_TOL * max(abs(a), abs(b)), ABS_TOL)


def less(a: float, b: float) -> bool:
    """a is below b by more than the tolerance."""
    return a < b and not same(a, b)


def greater(a: float, b: float) -> bool:
    """a is above b by more than the tolerance."""
    return less(b, a)


def at_most(a: float, b: float) -> bool:
    """a is below b or the same."""
    return not greater(a, b)


def at_least(a: float, b: float) -> bool:
    """a is above b or the same."""
    return not less(a, b)


def positive(x: float) -> bool:
    """x is above zero by more than the tolerance (ABS_TOL, at zero)."""
    return greater(x, 0.0)
