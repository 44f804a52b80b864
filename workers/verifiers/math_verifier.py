"""The math verifier: a response's final answer (`extract_answer`) against its row's reference, judged equivalent or
not by math-verify (`MathVerifier`).

math-verify's own time limits use signals, which work only in a process's main thread, and sympy can hang on an
adversarial answer (`9^{9^{9}}` against 2 does). So every comparison runs in the main thread of a child process, and a
child that passes the time limit is killed and replaced: that item's verdict is "timeout", the others go on.
"""

from __future__ import annotations

import decimal
import logging
import math
import multiprocessing
import numbers
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path

from workers.verifiers.verdict import Verdict

_ROOT = str(Path(__file__).resolve().parents[2])  # where the child imports this module from
START_LIMIT_S = 120.0  # a child must import math-verify and judge its warm-up item within this (not the item's limit)

# --- The final answer -------------------------------------------------------------------------------------------

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_PHRASE = re.compile(r"\banswer\**(?:\s+is\b|\s*:)[\s:*]*", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\.(?=\s|$)|\n")
_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])-)?"  # a minus sign, unless right after a word, a digit or a closing bracket (3-5 ends in 5)
    r"(?<![\w.])"  # a number starts a word: not x2, not the 5 of 3.5
    r"(?:\d+/\d+"  # a simple fraction
    r"|\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?"  # thousands separators: 3,000 and 1,234.5
    r"|\d+(?:\.\d+)?"  # an integer or a decimal
    r"|\.\d+)"  # a decimal without its 0
    r"(?:\\?%)?"  # a percentage sign, kept
)


def extract_answer(text: str) -> str | None:
    """The response's final answer, as written, or None when it has none.

    The last `\\boxed{...}` or `\\fbox{...}` gives the answer: its content, nested braces included. A box that never
    closes, or an empty one, does not count. Without a box, the last "answer is X" or "answer: X" gives it, in any
    case ("The final answer is X", "Final answer: X"). X starts after spaces, colons and bold marks (**). It runs to
    the end of its sentence (a period and a space) or of its line. A trailing period is dropped. A phrase with
    nothing after it does not count. Without either, the last number in the text is the answer. A number may be
    negative, a decimal, a simple fraction (3/4), or have thousands separators (3,000). A percentage sign after it
    is kept (50%). A minus sign right after a digit, a letter or a closing bracket subtracts (3-5 gives 5). A number
    glued to a letter before it (x2) does not count.
    """
    return _last_box(text) or _last_phrase(text) or _last_number(text)


def _closing_braces(text: str) -> dict[int, int]:
    """Where each "{" of `text` closes: its index to the index of its "}"; a brace that never closes is absent. An
    escaped brace (`\\{`) neither opens nor closes. One pass, so a text full of open boxes costs no more."""
    closes: dict[int, int] = {}
    opened: list[int] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2  # the escaped character is skipped with its backslash
            continue
        if c == "{":
            opened.append(i)
        elif c == "}" and opened:
            closes[opened.pop()] = i
        i += 1
    return closes


def _last_box(text: str) -> str | None:
    boxes = list(_BOX.finditer(text))
    if not boxes:
        return None
    closes = _closing_braces(text)
    for box in reversed(boxes):
        end = closes.get(box.end() - 1)
        if end is not None and text[box.end():end].strip():
            return text[box.end():end].strip()
    return None


def _last_phrase(text: str) -> str | None:
    for phrase in reversed(list(_PHRASE.finditer(text))):
        end = _SENTENCE_END.search(text, phrase.end())
        answer = text[phrase.end():end.start() if end else len(text)].strip().strip("*").strip()
        if answer:
            return answer
    return None


def _last_number(text: str) -> str | None:
    last = None
    for last in _NUMBER.finditer(text):
        pass
    return last.group(0) if last else None


# --- What math-verify is handed ---------------------------------------------------------------------------------

_WORD = re.compile(r"(?<![A-Za-z\\])[A-Za-z]{2,}(?![A-Za-z(])")


def reference_text(value) -> str | None:
    """A row's reference as text: a string as it is, a number in plain decimal notation (1e-07 is 0.0000001). None
    for anything else: an empty string, a boolean, a number that is not finite, a list."""
    if isinstance(value, str):
        return value.strip() or None
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, (numbers.Real, decimal.Decimal)):
        if isinstance(value, numbers.Real):
            value = float(value)
            if not math.isfinite(value):
                return None
            value = decimal.Decimal(repr(value))
        return format(value, "f") if value.is_finite() else None
    return None


def as_boxed(answer: str) -> str:
    """How an answer or a reference is handed to math-verify: inside `\\boxed{}`, so that math-verify reads it as
    LaTeX, where 1/2, 0.5, \\frac{1}{2}, 50%, {1,2} and 3,000 all parse. In a plain-text answer (one without a
    backslash), each word of two or more letters is marked as text (`\\text{eggs}`). math-verify drops text after a
    number, so "18 eggs" reads as 18; a bare word would read as a product of variables. A word right before "("
    stays, so sqrt(2) is still a square root.
    """
    if "\\" not in answer:
        answer = _WORD.sub(lambda word: "\\text{%s}" % word.group(0), answer)
    return "\\boxed{%s}" % answer


# --- The child process ------------------------------------------------------------------------------------------

_parsed_references: dict = {}  # a child's parsed references: a prompt's n candidates share one


class _TimeLimitIsOurs(logging.Filter):
    """math-verify warns once that its time limit is off and the caller must stop a hang: the parent does so."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def compare(reference: str, answer: str) -> str:
    """math-verify's judgement of two boxed texts (`as_boxed`): "equivalent", "different", or "unreadable" when
    it finds nothing in the reference that it can read as math. Its own time limits are off (they work only in a
    main thread); the parent's limit stops a hang. Runs in a child process."""
    from math_verify import parse, verify

    gold = _parsed_references.get(reference)
    if gold is None:
        gold = parse(reference, parsing_timeout=None)
        if len(_parsed_references) >= 4096:
            _parsed_references.clear()
        _parsed_references[reference] = gold
    if all(isinstance(g, str) for g in gold):  # nothing parsed, or only the text math-verify could not parse
        return "unreadable"
    return "equivalent" if verify(gold, parse(answer, parsing_timeout=None), timeout_seconds=None) else "different"


def _serve(fd: int) -> None:
    """A child's loop, in its main thread, on the socket `fd` that the parent passed: judge each (reference,
    answer) pair the parent sends, and send back ("done", the judgement), or ("failed", the traceback) when judging
    raised. The first judgement is a warm-up, so that the imports are not charged to a real item. Ends when the
    parent closes its end."""
    conn = Connection(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the parent, which closes the verifier
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_TimeLimitIsOurs())
    try:
        compare(as_boxed("1/2"), as_boxed("0.5"))
    except Exception:  # noqa: BLE001 - sent to the parent, which raises it
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            reference, answer = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("done", compare(reference, answer)))
        except Exception:  # noqa: BLE001 - sent to the parent, which raises it
            conn.send(("failed", traceback.format_exc()))


_CHILD_MAIN = "import sys; from workers.verifiers.math_verifier import _serve; _serve(int(sys.argv[1]))"


class _Child:
    """One child process (`_serve`) and the parent's end of its socket. A plain `python -c` process, not a
    multiprocessing one: it imports only this module, never the parent's main script (which multiprocessing's
    spawn would run again). It is started at once and waited for on its first item. Only strings cross."""

    def __init__(self):
        self.conn, child_end = multiprocessing.Pipe()  # a socket pair: pickled messages both ways
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _CHILD_MAIN, str(child_end.fileno())], pass_fds=(child_end.fileno(),),
                stdin=subprocess.DEVNULL, env=env)
        finally:
            child_end.close()
        self.ready = False
        self._lock = threading.Lock()
        self._killed = False

    def ask(self, reference: str, answer: str, limit_s: float) -> str | None:
        """The child's judgement, or None when it takes longer than `limit_s` (counted from the moment the item is
        sent, not from the child's start). Raises EOFError or OSError when the child died on the item."""
        if not self.ready:
            try:
                started = self.conn.poll(START_LIMIT_S)
                reply = self.conn.recv() if started else None
            except (EOFError, OSError):
                self.process.wait()
                raise RuntimeError(f"the math verifier's child process exited while starting (exit status "
                                   f"{self.process.returncode}); its error is in the output above") from None
            if reply is None:
                raise RuntimeError(f"the math verifier's child process did not start in {START_LIMIT_S:.0f} s")
            self._raise_on_failure(reply, "could not start")
            self.ready = True
        self.conn.send((reference, answer))
        if not self.conn.poll(limit_s):
            return None
        return self._raise_on_failure(self.conn.recv(), "failed")

    @staticmethod
    def _raise_on_failure(reply: tuple, what: str):
        status, value = reply
        if status == "failed":
            raise RuntimeError(f"the math verifier's child process {what}:\n{value}")
        return value

    def kill(self) -> None:
        """Kill the process and wait for it; once, whoever calls. The socket stays open (`close_pipe`): another
        thread may be waiting on it, and sees its end."""
        with self._lock:
            if not self._killed:
                self._killed = True
                self.process.kill()
                self.process.wait()

    def close_pipe(self) -> None:
        self.conn.close()


# --- The verifier -----------------------------------------------------------------------------------------------


class MathVerifier:
    """A `Verifier` of final answers: `extract_answer` reads the response's answer, and math-verify, in one of
    `workers` child processes, says whether it is equivalent to the row's `answer_column`.

    `submit` returns a future at once; a thread per child hands it the items, so the caller's thread never judges.
    An item that takes longer than `timeout_s` in its child is a "timeout": its child is killed, and a new one is
    started for the next items. Usable from any thread. `close` stops the threads and the children.

    A verdict's reason is "wrong answer", "no answer" (`extract_answer` found none), "timeout", "the reference
    cannot be read: VALUE" (math-verify reads no math in it), or "the checker's process died (exit status N)". Its
    answer is the extracted one wherever there is one.
    """

    def __init__(self, answer_column: str = "answer", timeout_s: float = 5.0, workers: int = 1):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0; got {timeout_s}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1; got {workers}")
        self.columns = (answer_column,)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self._children: set[_Child] = set()
        self._idle: queue.SimpleQueue[_Child | None] = queue.SimpleQueue()
        for _ in range(workers):
            self._idle.put(self._start())
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="winnow-math-verifier")

    def submit(self, text: str, row: dict, prompt: list | None = None) -> Future:
        """Start judging `text` against `row`; the future's result is a `Verdict`. Returns at once."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the math verifier is closed")
            return self._threads.submit(self._judge, text, row)

    def verify(self, texts: list[str], rows: list[dict]) -> list[Verdict]:
        """The verdicts of `texts` against their `rows`, in order (blocks until all are judged)."""
        if len(texts) != len(rows):
            raise ValueError(f"{len(texts)} texts but {len(rows)} rows")
        futures = [self.submit(text, row) for text, row in zip(texts, rows)]
        return [future.result() for future in futures]

    def close(self) -> None:
        """Cancel the items not started, kill the children (an item being judged raises), and wait for the
        threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            children = list(self._children)
        self._threads.shutdown(wait=False, cancel_futures=True)
        for child in children:
            child.kill()
        self._threads.shutdown(wait=True)
        for child in children:
            child.close_pipe()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> _Child:
        """A new child, registered so that `close` kills it. Started outside the lock: `submit` never waits on it."""
        child = _Child()
        with self._lock:
            if not self._closed:
                self._children.add(child)
                return child
        child.kill()
        child.close_pipe()
        raise RuntimeError("the math verifier was closed while judging")

    def _retire(self, child: _Child) -> None:
        """Kill `child` and put a new one in its place. Where the new one cannot start, its place waits empty
        (None) and the next item starts one."""
        child.kill()
        child.close_pipe()
        with self._lock:
            self._children.discard(child)
        try:
            successor = self._start()
        except BaseException:
            self._idle.put(None)
            raise
        self._idle.put(successor)

    def _judge(self, text: str, row: dict) -> Verdict:
        """One item, on a thread of the pool: read the answer and the reference here, judge them in a child."""
        answer = extract_answer(text)
        if answer is None:
            return Verdict(False, "no answer", None)
        column = self.columns[0]
        if column not in row:
            raise KeyError(f"the row has no column {column!r}, which holds the math verifier's reference")
        reference = reference_text(row[column])
        if reference is None:
            return Verdict(False, f"the reference cannot be read: {row[column]!r}", answer)
        child = self._idle.get()
        if child is None:  # its predecessor was killed and no successor could start then
            try:
                child = self._start()
            except BaseException:
                self._idle.put(None)
                raise
        try:
            judgement = child.ask(as_boxed(reference), as_boxed(answer), self.timeout_s)
        except BaseException as err:
            if self._closed:  # `close` killed the child
                raise RuntimeError("the math verifier was closed while judging") from None
            self._retire(child)
            if isinstance(err, (EOFError, OSError)):  # the child died on this item
                return Verdict(False, f"the checker's process died (exit status {child.process.returncode})", answer)
            raise
        if judgement is None:
            self._retire(child)
            return Verdict(False, "timeout", answer)
        self._idle.put(child)
        if judgement == "unreadable":
            return Verdict(False, f"the reference cannot be read: {row[column]!r}", answer)
        return Verdict(True, None, answer) if judgement == "equivalent" else Verdict(False, "wrong answer", answer)
