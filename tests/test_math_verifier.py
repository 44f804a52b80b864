"""The math verifier: the final-answer rule, what math-verify holds equivalent, and the child processes (a hang is a
timeout that spares the other items, two threads share the verifier, `close` leaves no child)."""

from __future__ import annotations

import decimal
import os
import signal
import threading
import time
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np
import pytest

from workers.verifiers.math_verifier import MathVerifier, as_boxed, extract_answer, reference_text
from workers.verifiers.verdict import Verdict

TIMEOUT_S = 2.0
HANG = "\\boxed{9^{9^{9}}}"  # sympy works for minutes on 9^(9^9) against 2 (math-verify 0.9)


@pytest.fixture(scope="module")
def verifier():
    """One verifier for the module (its children start once): two children, the reference in `reference`."""
    v = MathVerifier(answer_column="reference", timeout_s=TIMEOUT_S, workers=2)
    assert all(x.verified for x in v.verify(["\\boxed{1}"] * 8, [{"reference": 1}] * 8))  # both children up
    yield v
    v.close()


def child_pids() -> set[int]:
    """The processes whose parent is this one, zombies included (from /proc)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[1]) == os.getpid():
            out.add(int(stat.parent.name))
    return out


def wait_until_running(future):
    """Until a thread of the verifier has taken the item (a killed child then fails it, wherever it is)."""
    deadline = time.monotonic() + 30
    while not future.running():
        assert time.monotonic() < deadline and not future.done()
        time.sleep(0.01)


@pytest.mark.parametrize("text, answer", [
    ("so the result is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\left\\{1, \\frac{2}{3}\\right\\}}", "\\left\\{1, \\frac{2}{3}\\right\\}"),
    ("first \\boxed{1}, then \\boxed{2}", "2"),
    ("\\fbox{7}", "7"),
    ("\\boxed{3} and then \\boxed{4", "3"),  # a box that never closes does not count
    ("\\boxed{ } The answer is 5", "5"),  # nor does an empty one
    ("\\boxed{3}. The answer is 4.", "3"),  # a box before a phrase
    ("The answer is 18 eggs.", "18 eggs"),
    ("the ANSWER is -3. Then 4 more", "-3"),
    ("Final answer: 1/2", "1/2"),
    ("answer: 3.5.", "3.5"),
    ("**Final Answer:** 12", "12"),
    ("The answer is:\n\n$\\frac{3}{4}$\nDone", "$\\frac{3}{4}$"),
    ("The answer is 1. Wait, the answer is 2.", "2"),
    ("The answer is 7. Check: 3 + 4 = 7 and 10 - 2 = 8", "7"),  # a phrase before the last number
    ("3 + 4 = 7", "7"),
    ("so it is -5", "-5"),
    ("so x = 3-5", "5"),  # a minus after a digit subtracts
    ("about 0.25 of it", "0.25"),
    ("it costs $3,000 in all", "3,000"),
    ("1,234.5 m", "1,234.5"),
    ("one half is 1/2", "1/2"),
    ("it grew by 50%", "50%"),
    ("it grew by 50\\%", "50\\%"),
    ("the pair (1,2)", "2"),
    ("it ends with 18.", "18"),
    ("x2 and .5", ".5"),
    ("no number here", None),
    ("", None),
    ("The answer is", None),
    ("\\boxed{}", None),
])
def test_the_final_answer(text, answer):
    assert extract_answer(text) == answer


def test_what_math_verify_is_handed():
    assert reference_text(3000) == "3000"
    assert reference_text(np.int64(7)) == "7"
    assert reference_text(0.5) == "0.5"
    assert reference_text(np.float64(0.25)) == "0.25"
    assert reference_text(1e-07) == "0.0000001"
    assert reference_text(decimal.Decimal("2.50")) == "2.50"
    assert reference_text(" 3/4 ") == "3/4"
    for unreadable in (True, float("nan"), float("inf"), None, "", [1, 2]):
        assert reference_text(unreadable) is None
    assert as_boxed("18 eggs") == "\\boxed{18 \\text{eggs}}"
    assert as_boxed("sqrt(2)") == "\\boxed{sqrt(2)}"
    assert as_boxed("\\frac{1}{2} cups") == "\\boxed{\\frac{1}{2} cups}"  # LaTeX goes in as written


@pytest.mark.parametrize("text, reference", [
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("The answer is 1/2.", "\\frac{1}{2}"),
    ("so 0.5", "1/2"),
    ("\\boxed{0.5}", 0.5),
    ("\\boxed{\\dfrac12}", "1/2"),
    ("The answer is 3,000.", 3000),
    ("\\boxed{3000}", "3,000"),
    ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}"),
    ("\\boxed{{2, 1}}", "{1,2}"),
    ("The answer is 18 eggs.", 18),
    ("The answer is $18.", "18"),
    ("\\boxed{x = 3}", "3"),
    ("\\boxed{-7}", np.int64(-7)),
    ("The answer is 50%.", "0.5"),
    ("\\boxed{50\\%}", "\\frac{1}{2}"),
    ("\\boxed{50\\%}", "50"),  # math-verify takes a percentage as either its fraction or its number
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
])
def test_equivalent_answers_verify(verifier, text, reference):
    verdict = verifier.submit(text, {"reference": reference}).result()
    assert verdict == Verdict(True, None, extract_answer(text))


@pytest.mark.parametrize("text, reference", [
    ("\\boxed{7}", 8),
    ("\\boxed{-7}", 7),
    ("\\boxed{7}", "-7"),
    ("so 0.5", "5"),
    ("it grew by 50%", "5"),
    ("\\boxed{2\\sqrt{2}}", "2"),
    ("\\boxed{\\{1,2,3\\}}", "\\{1,2\\}"),
    ("\\boxed{(2,1)}", "(1,2)"),  # math-verify reads (1,2) as an open interval; (2,1) is another
    ("\\boxed{0.333}", "\\frac{1}{3}"),
])
def test_different_answers_do_not(verifier, text, reference):
    verdict = verifier.submit(text, {"reference": reference}).result()
    assert verdict == Verdict(False, "wrong answer", extract_answer(text))


def test_verdicts_name_what_went_wrong(verifier):
    assert verifier.columns == ("reference",)
    texts = ["I do not know", "\\boxed{5}", "\\boxed{5}", "\\boxed{5}", "\\boxed{5}"]
    rows = [{"reference": 5}, {"reference": "???"}, {"reference": None}, {"reference": [5]}, {"reference": 6}]
    assert verifier.verify(texts, rows) == [
        Verdict(False, "no answer", None),
        Verdict(False, "the reference cannot be read: '???'", "5"),
        Verdict(False, "the reference cannot be read: None", "5"),
        Verdict(False, "the reference cannot be read: [5]", "5"),
        Verdict(False, "wrong answer", "5"),
    ]
    with pytest.raises(KeyError, match="reference"):
        verifier.submit("\\boxed{5}", {"answer": 5}).result()


def test_a_hang_times_out_and_spares_the_other_items(verifier):
    start = time.monotonic()
    hang = verifier.submit(HANG, {"reference": 2})
    quick = [verifier.submit(f"The answer is {i}.", {"reference": i}) for i in range(6)]
    assert all(f.result().verified for f in quick)  # the other child judged them meanwhile
    assert time.monotonic() - start < TIMEOUT_S and not hang.done()
    assert hang.result() == Verdict(False, "timeout", "9^{9^{9}}")
    assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + 3.0
    # the killed child's successor judges the next items, right and wrong
    texts = [f"\\boxed{{{i}}}" for i in range(8)]
    assert [v.verified for v in verifier.verify(texts, [{"reference": i % 2} for i in range(8)])] == \
        [i % 2 == i for i in range(8)]


def test_two_threads_submit_at_once(verifier):
    out: dict[str, list] = {}

    def submit_many(name: str, offset: int):
        futures = [verifier.submit(f"so we get \\boxed{{\\frac{{{i}}}{{4}}}}", {"reference": (i + offset) / 4})
                   for i in range(40)]
        out[name] = [f.result() for f in futures]

    threads = [threading.Thread(target=submit_many, args=(name, offset)) for name, offset in (("a", 0), ("b", 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [v.verified for v in out["a"]] == [True] * 40
    assert [v.reason for v in out["b"]] == ["wrong answer"] * 40
    assert out["a"][5].answer == "\\frac{5}{4}"


def test_a_dead_child_is_replaced_and_close_leaves_no_child():
    before = child_pids()
    v = MathVerifier(timeout_s=60.0, workers=1)
    assert v.submit("\\boxed{4}", {"answer": 4}).result().verified
    (child,) = child_pids() - before
    hang = v.submit(HANG, {"answer": 2})
    wait_until_running(hang)
    os.kill(child, signal.SIGKILL)  # the child dies on an item
    assert hang.result() == Verdict(False, "the checker's process died (exit status -9)", "9^{9^{9}}")
    assert v.submit("\\boxed{4}", {"answer": 4}).result().verified  # by its successor
    (successor,) = child_pids() - before
    assert successor != child

    hang = v.submit(HANG, {"answer": 2})
    waiting = v.submit("\\boxed{4}", {"answer": 4})
    wait_until_running(hang)
    start = time.monotonic()
    v.close()
    assert time.monotonic() - start < 5.0  # close does not wait for the hang
    with pytest.raises(RuntimeError, match="closed"):
        hang.result()
    with pytest.raises(CancelledError):
        waiting.result()
    assert child_pids() - before == set()
    with pytest.raises(RuntimeError, match="closed"):
        v.submit("\\boxed{4}", {"answer": 4})
    v.close()  # twice is fine
