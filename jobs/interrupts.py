"""SIGTERM ends a command like Ctrl-C, and an interrupt is never lost.

A signal's handler runs between two bytecodes of the main thread, wherever it is; when that is inside a finaliser
(an object's `__del__`, a weakref callback: Ray's `ActorHandle.__del__` runs often while a job waits on its actors),
Python cannot raise there and only prints "Exception ignored ... KeyboardInterrupt", so the run went on as if nobody
had asked it to stop (seen once in CI: `ray job stop`'s SIGTERM, and the job ran to the end). `interrupts` raises
such a swallowed KeyboardInterrupt again in the main thread, at its next bytecode outside the finaliser.
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _interrupt_main_soon() -> None:
    time.sleep(0.01)
    _thread.interrupt_main(signal.SIGTERM)  # runs _interrupt at the main thread's next bytecode


@contextmanager
def interrupts() -> Iterator[None]:
    """While inside, in the main thread: SIGTERM (`ray job stop`, a plain kill) raises KeyboardInterrupt like
    Ctrl-C, and a KeyboardInterrupt that a finaliser swallowed is raised again. The handler and
    `sys.unraisablehook` are given back on leaving. Elsewhere than the main thread (no signal handlers there) it
    changes nothing. Nested uses (`winnow rounds` runs `winnow generate` in its process) each restore their own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous_handler = signal.getsignal(signal.SIGTERM)
    previous_hook = sys.unraisablehook

    def raise_again(unraisable) -> None:
        if (isinstance(unraisable.exc_value, KeyboardInterrupt)
                and threading.current_thread() is threading.main_thread()):
            # from another thread, a moment later: called here, in the main thread, the handler would run at once,
            # still inside the hook, and be swallowed again (so would a threading.Thread, whose start waits)
            _thread.start_new_thread(_interrupt_main_soon, ())
            return
        previous_hook(unraisable)

    signal.signal(signal.SIGTERM, _interrupt)
    sys.unraisablehook = raise_again
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        # None: a handler set outside Python, which cannot be put back; the default ends the process on SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous_handler is None else previous_handler)
