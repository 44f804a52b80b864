"""`jobs.interrupts`: SIGTERM ends a command like Ctrl-C, and an interrupt that lands in a finaliser is not lost
(a CI run once saw `ray job stop`'s SIGTERM land in Ray's `ActorHandle.__del__`, and the job ran on to the end)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from jobs.interrupts import interrupts


class _SignalledWhileFinalised:
    """An object whose finaliser receives SIGTERM: the handler runs between the finaliser's own bytecodes."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # the handler runs here, where Python cannot raise
            pass


def _finalise_then_wait() -> float:
    _SignalledWhileFinalised()  # no reference kept: finalised at once
    started = time.monotonic()
    while time.monotonic() - started < 2.0:
        time.sleep(0.01)
    return time.monotonic() - started


def test_a_plain_handler_loses_an_interrupt_that_lands_in_a_finaliser():
    """The failure that `interrupts` exists for, so that the test below can fail."""
    def plain(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, plain)
    hook, sys.unraisablehook = sys.unraisablehook, lambda unraisable: None
    try:
        assert _finalise_then_wait() >= 2.0  # swallowed: nobody stopped the wait
    finally:
        signal.signal(signal.SIGTERM, previous)
        sys.unraisablehook = hook


def test_an_interrupt_that_lands_in_a_finaliser_is_raised_again_and_the_handlers_are_given_back():
    previous, hook = signal.getsignal(signal.SIGTERM), sys.unraisablehook
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with interrupts():
            _finalise_then_wait()
    assert time.monotonic() - started < 1.5  # raised right after the finaliser, not after the wait
    assert signal.getsignal(signal.SIGTERM) is previous and sys.unraisablehook is hook


def test_sigterm_raises_keyboard_interrupt_and_other_unraisable_errors_still_reach_the_hook():
    seen = []
    hook, sys.unraisablehook = sys.unraisablehook, seen.append
    try:
        with interrupts():
            class Broken:
                def __del__(self):
                    raise ValueError("in a finaliser")

            Broken()
            assert [type(u.exc_value) for u in seen] == [ValueError]
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
    finally:
        sys.unraisablehook = hook


def test_outside_the_main_thread_nothing_changes():
    previous, hook, inside = signal.getsignal(signal.SIGTERM), sys.unraisablehook, []

    def body():
        with interrupts():
            inside.append((signal.getsignal(signal.SIGTERM), sys.unraisablehook))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert inside == [(previous, hook)]
