"""A user's Python function as a reward or a verifier: how it is found, what it is handed, and its time limit.

The one rule for what a `python` function is handed (`takes_rows`): `f(prompts, texts)`, or `f(prompts, texts,
rows)` when its third positional parameter has no default (or is named `rows`). `rows` holds, per text, the prompt's
dataset columns that the config names (`columns`), as JSON gives them. A call runs in a thread of its own and is
given `timeout_s` seconds (`call`): a function that hangs fails the run, naming the function, as one that raises.
It runs in the actor's process: it is the user's code, not the model's (generated code runs in a sandbox,
`workers.verifiers.code_verifier`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import threading
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

from workers.verifiers.verdict import Verdict


def load_function(path: str, field: str) -> Callable:
    """`package.module:function` imported; ValueError naming `field` when it cannot be."""
    module, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{field}: cannot import {path!r}: {err}") from None
    if not callable(fn):
        raise ValueError(f"{field}: {path!r} is not callable")
    return fn


def takes_rows(fn: Callable) -> bool:
    """Whether `fn` is called as f(prompts, texts, rows): its third positional parameter has no default, or is
    named `rows`, or it takes *args."""
    inner = fn.func if isinstance(fn, functools.partial) else fn
    try:
        params = list(inspect.signature(inner).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: called as f(prompts, texts)
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 3:
        third = positional[2]
        return third.default is inspect.Parameter.empty or third.name == "rows"
    return any(p.kind == p.VAR_POSITIONAL for p in params)


def rows_problem(fn: Callable, path: str, field: str, columns: list[str]) -> str | None:
    """Why `fn` cannot be called as configured: it takes rows and `columns` names none (each row would be empty)."""
    if takes_rows(fn) and not columns:
        return (f"{field}: {path} takes rows (a third parameter), but {field.rsplit('.', 1)[0]}.columns names no "
                "dataset column; name the columns it reads, e.g. columns: [answer]")
    return None


def _in_daemon_thread(fn, *args) -> Future:
    """`fn(*args)` in a thread of its own whose result is the future's. A daemon thread: a call that hangs past its
    time limit cannot be stopped, and must not hold the process at exit as an executor's thread would."""
    future: Future = Future()

    def call():
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as err:
                future.set_exception(err)

    threading.Thread(target=call, name="winnow-user-function", daemon=True).start()
    return future


class UserFunction:
    """`path`'s function, called with prompts, texts and (where it takes them) rows, within `timeout_s` per call.
    `field`: the config field that names it (models.reward.function, models.verifier.function), for messages."""

    def __init__(self, path: str, field: str, timeout_s: float, columns: list[str]):
        self.fn = load_function(path, field)
        problem = rows_problem(self.fn, path, field, columns)
        if problem:
            raise ValueError(problem)
        self.path, self.field, self.timeout_s = path, field, timeout_s
        self.with_rows = takes_rows(self.fn)
        self.where = f"{field}: {path}"
        self._lock = threading.Lock()

    def __call__(self, prompts: list, texts: list[str], rows: list[dict], noun: str = "values") -> list:
        """The function's values for `texts`, as a list of len(texts); RuntimeError naming the function when it
        raises, hangs past `timeout_s`, is asynchronous, or returns the wrong number of values."""
        args = (prompts, texts, rows) if self.with_rows else (prompts, texts)
        with self._lock:  # one call at a time; a call that timed out fails the run
            future = _in_daemon_thread(self.fn, *args)
            try:
                values = future.result(timeout=self.timeout_s)
            except FutureTimeout:
                raise RuntimeError(f"{self.where} did not return within {self.timeout_s:g} s ({len(texts)} texts; "
                                   f"{self.field.rsplit('.', 1)[0]}.timeout_s)") from None
            except Exception as err:  # the user's code: its failure is named as the function's, with its message
                frame = traceback.extract_tb(err.__traceback__)[-1]
                raise RuntimeError(f"{self.where} raised {type(err).__name__}: {err} (at {frame.filename}:"
                                   f"{frame.lineno})") from None  # one cause, the function's: what Ray shows first
        if inspect.isawaitable(values):
            raise RuntimeError(f"{self.where} returned an awaitable: it is asynchronous; it is called "
                               "synchronously, so wrap it: def f(prompts, texts): return asyncio.run(g(...))")
        shown = repr(values)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
            raise RuntimeError(f"{self.where} returned {type(values).__name__} {shown}; it must return a list of "
                               f"{len(texts)} {noun}, one per text")
        values = list(values)
        if len(values) != len(texts):
            raise RuntimeError(f"{self.where} returned {len(values)} values for {len(texts)} texts")
        return values

    def floats(self, prompts: list, texts: list[str], rows: list[dict]) -> list[float]:
        """The function's values as finite floats (a reward)."""
        out = []
        for i, v in enumerate(self(prompts, texts, rows, "floats")):
            if isinstance(v, (str, bytes)) or v is None:
                raise RuntimeError(f"{self.where} returned {v!r} (a {type(v).__name__}) at index {i}; it must return "
                                   "floats")
            try:
                out.append(float(v))
            except (TypeError, ValueError):
                raise RuntimeError(f"{self.where} returned {v!r} (a {type(v).__name__}) at index {i}; it must return "
                                   "floats") from None
        if not all(math.isfinite(v) for v in out):
            raise RuntimeError(f"{self.where} returned a non-finite value (nan or inf)")
        return out

    def verdicts(self, prompts: list, texts: list[str], rows: list[dict]) -> list[bool]:
        """The function's values as verdicts: True or False (1 or 0 are taken as such), nothing else."""
        out = []
        for i, v in enumerate(self(prompts, texts, rows, "verdicts (True or False)")):
            if isinstance(v, bool) or (isinstance(v, (int, float)) and v in (0, 1)):
                out.append(bool(v))
            else:
                raise RuntimeError(f"{self.where} returned {v!r} (a {type(v).__name__}) at index {i}; a verifier "
                                   "returns True or False for each text")
        return out


class PythonVerifier:
    """A `python` verifier (`models.verifier.kind: python`): the user's function judges each response, one call
    per submitted response, in a thread of its own beside decoding. A function that raises or hangs fails the run
    (its verdict raises where it is collected)."""

    def __init__(self, path: str, timeout_s: float, columns: list[str], field: str = "models.verifier.function"):
        self.columns = tuple(columns)
        self.fn = UserFunction(path, field, timeout_s, list(columns))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="winnow-python-verifier")

    def submit(self, text: str, row: dict, prompt: list | None = None) -> Future:
        return self._pool.submit(self._judge, prompt or [], text, row or {})

    def _judge(self, prompt: list, text: str, row: dict) -> Verdict:
        (ok,) = self.fn.verdicts([prompt], [text], [row])
        return Verdict(True) if ok else Verdict(False, "rejected by the function")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
