"""The code verifier: a response's code passes when its row's tests, run after it in a sandbox, reach their end.

The code is the response's last fenced code block whose language is `python`, `py`, `python3` or empty (a fence
left open runs to the end of the response); without one, the whole response. An empty code is "no code".

The tests (the row's `tests_column`) are Python: a string (asserts, or a `check(candidate)` function and its call),
or a list of strings (MBPP's `test_list`), joined by lines. They run as the lines of a script, after the code, in
the code's namespace (a module), with `__name__ == "__main__"`. The code itself runs as the module `solution`, so
its own main block does not run. Tests that define `check` and never call it are refused: they would pass any
code. `unittest.main()` ends in SystemExit, which fails; call `unittest.main(exit=False)` and assert that its
result succeeded. doctest cannot run here (it sets a trace function).

A pass means the tests ran to their end and passed. The harness (`HARNESS`) runs in the sandbox's one Python
process:
1. It reads a secret, fresh for each run, from its stdin, and hands it to an audit hook. Hooks cannot be listed or
   removed, so no reference to the secret is left where the code can reach it.
2. It compiles the code and the tests, then runs the code and then the tests.
3. Only when the tests' last line returns does it ask the hook to write the secret and "pass" on fd 3 and end the
   process with status 0; any exception is reported there as a failure, with its reason.
A report counts only with the secret, from the first harness frame of the first process, and a pass also needs
exit status 0. So a response that exits early (`exit(0)`, `sys.exit`, `os._exit(0)`, SystemExit,
KeyboardInterrupt), prints what a harness might print, closes or redirects its output, or signals its parent does
not pass. The hook also refuses trace functions (which could skip the tests' lines), the garbage collector's
object lists and more audit hooks (which could find the secret). The process is not dumpable, so that the kernel
keeps the sandbox's uid out of its /proc/<pid>/mem and its children's.

What the harness does not catch:
- An object equal to everything, a redefined builtin that the tests call (`abs`, `sorted`: the code's names are
  the tests' names), or a patched module the tests use: the tests' job.
- Code that reads or writes its interpreter's memory through ctypes: it can forge a pass. The harness stops the
  ways a model stumbles into, not an attack on itself; the sandbox, not the harness, protects the machine. With
  `sandbox: none` and a root caller, /proc/<pid>/mem is open to the code as well.

Reasons (`Verdict.reason`): "no code", "syntax error: ...", "test failed: AssertionError: ... (line N of the
tests)", "error: NameError: ... (line N of the tests|code)", "exited before the tests ended" (with the exception
or the exit status where known), "timeout", "cpu time", "memory", "too many processes", "output limit", "killed
by signal N". For a bad row: "the tests column holds <type>, not Python code", "the tests are not valid Python:
...", "the tests hold no statements", "the tests define check() but never call it; ...".
"""

from __future__ import annotations

import ast
import functools
import re
import secrets
import shutil
import sys
from concurrent.futures import Future, ThreadPoolExecutor

from workers.verifiers.sandbox import KINDS, Limits, RunResult, python_binds, run
from workers.verifiers.verdict import Verdict

REASON_CHARS = 200
PYTHON_FENCES = ("", "python", "py", "python3")
# A fenced block: an opening fence line (its language, then anything), its lines, and a closing fence or the end.
FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:^[ \t]*```[ \t]*$|\Z)", re.M | re.S)

HARNESS = r'''"""Winnow's code harness (workers/verifiers/code_verifier.py): runs code.py, then tests.py, and
reports on fd 3 whether the tests reached their end. Only a report with the run's secret counts, and only the audit
hook holds the secret."""
import builtins
import os
import sys

REFUSED = ("sys.settrace", "sys.setprofile", "sys.addaudithook", "sys._current_frames", "gc.get_objects",
           "gc.get_referrers", "gc.get_referents")


def guard(secret, first):
    """The audit hook: writes the report (once, for the frame `first`, in this process) and ends the process;
    refuses what could find the secret or skip the tests' lines. Everything it uses is bound here, before the code
    runs, so that the code cannot patch it."""
    pid, getframe, getpid, write, exit_now = os.getpid(), sys._getframe, os.getpid, os.write, os._exit
    refused, refusal, done = frozenset(REFUSED), RuntimeError, []

    def hook(event, args):
        if event == "winnow.pass" or event == "winnow.fail":
            if done or getframe(1) is not first or getpid() != pid:
                return
            done.append(True)
            what = b"pass" if event == "winnow.pass" else b"fail " + args[0].encode("utf-8", "replace")
            write(3, secret + b" " + what + b"\n")
            exit_now(0 if event == "winnow.pass" else 1)
        elif event in refused:
            raise refusal("the code harness refuses " + event)
    return hook


def hide_memory():
    """Make this process not dumpable (prctl PR_SET_DUMPABLE 0): the kernel then gives /proc/<pid>/mem to root, so
    the code, under the sandbox's uid, cannot read the secret there, nor can a child it forks."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def innermost(tb):
    """The file ("<code>" or "<tests>") and line of the innermost frame of the code or the tests in a traceback."""
    found = (None, None)
    while tb is not None:
        if tb.tb_frame.f_code.co_filename in ("<code>", "<tests>"):
            found = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return found


def describe(e, tests):
    """Why the run failed, in one line."""
    try:
        kind = type(e).__name__
        try:
            message = " ".join(str(e).split())
        except BaseException:
            message = ""
        if isinstance(e, MemoryError):
            return "memory"
        if isinstance(e, (SystemExit, KeyboardInterrupt)):
            return f"exited before the tests ended ({kind})"
        if (isinstance(e, BlockingIOError) and e.errno == 11) or "can't start new thread" in message:
            return "too many processes"
        file, line = innermost(e.__traceback__)
        if file == "<tests>" and isinstance(e, AssertionError):
            lines = tests.splitlines()
            source = lines[line - 1].strip() if 0 < line <= len(lines) else ""
            return f"test failed: AssertionError: {(message or source)[:150]} (line {line} of the tests)"
        at = f" (line {line} of the {'tests' if file == '<tests>' else 'code'})" if file else ""
        return (f"error: {kind}: {message}" if message else f"error: {kind}")[:150] + at
    except BaseException as failure:
        return f"error: {type(e).__name__} (describing it failed: {type(failure).__name__})"


def main():
    audit, compile_, exec_, describe_ = sys.audit, builtins.compile, builtins.exec, describe
    pristine = dict(builtins.__dict__)
    secret = b""
    chunk = os.read(0, 4096)
    while chunk:
        secret += chunk
        chunk = os.read(0, 4096)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    with open("code.py", encoding="utf-8") as f:
        code = f.read()
    with open("tests.py", encoding="utf-8") as f:
        tests = f.read()
    hide_memory()
    sys.addaudithook(guard(secret, sys._getframe()))
    del secret
    try:
        code_object = compile_(code, "<code>", "exec")
    except SyntaxError as e:
        audit("winnow.fail", f"syntax error: {e.msg} (line {e.lineno} of the code)")
        return
    except Exception as e:
        audit("winnow.fail", f"syntax error: {type(e).__name__}: {e}"[:200])
        return
    try:
        tests_object = compile_(tests, "<tests>", "exec")
    except Exception as e:
        audit("winnow.fail", f"the tests do not compile: {type(e).__name__}: {e}"[:200])
        return
    module = type(sys)("solution")  # a module, so that dataclasses, pickle and unittest find the names
    names = module.__dict__
    names["__builtins__"] = builtins
    sys.modules["solution"] = module
    try:
        exec_(code_object, names)
        names["__name__"], names["__builtins__"] = "__main__", pristine
        sys.modules["__main__"] = module
        exec_(tests_object, names)
    except BaseException as e:
        audit("winnow.fail", describe_(e, tests))
    else:
        audit("winnow.pass")


main()
'''


def extract_code(text: str) -> str:
    """The response's code: its last fenced Python (or untagged) block, else the whole response."""
    blocks = [m.group(2) for m in FENCE.finditer(text) if m.group(1).lower() in PYTHON_FENCES]
    return blocks[-1] if blocks else text


class CodeVerifier:
    """Runs each response's code and its row's tests in the sandbox (`workers.verifiers.sandbox`), `workers` at a
    time, each on a thread that waits on its sandboxed process. `sandbox`: "bwrap" or "none". `python`: the
    interpreter inside (default: this one), run with -I so that PYTHONPATH and the user's site stay out."""

    def __init__(self, tests_column: str = "tests", sandbox: str = "bwrap", limits: Limits = Limits(),
                 workers: int = 1, python: str | None = None):
        if sandbox not in KINDS:
            raise ValueError(f"unknown sandbox {sandbox!r}; use one of {', '.join(KINDS)}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1; got {workers}")
        self.columns = (tests_column,)
        self.tests_column, self.kind, self.limits = tests_column, sandbox, limits
        self.python = sys.executable if python is None else shutil.which(python)
        if self.python is None:
            raise ValueError(f"python {python!r} is not an interpreter on PATH or a path to one")
        self._binds = python_binds(python and self.python)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="code-verifier")

    def submit(self, text: str, row: dict, prompt: list | None = None) -> Future:
        return self._pool.submit(self.judge, text, row)

    def verify(self, texts: list[str], rows: list[dict]) -> list[Verdict]:
        """Judge every response against its row, in parallel; blocks until all are judged."""
        futures = [self.submit(text, row) for text, row in zip(texts, rows, strict=True)]
        return [f.result() for f in futures]

    def close(self) -> None:
        """Cancel the verdicts not started; wait for the running ones (each ends within its wall limit)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def judge(self, text: str, row: dict) -> Verdict:
        """One response against its row's tests, on the calling thread."""
        tests = row.get(self.tests_column)
        if isinstance(tests, (list, tuple)) and all(isinstance(t, str) for t in tests):
            tests = "\n".join(tests)
        if not isinstance(tests, str):
            return Verdict(False, f"the tests column holds {type(tests).__name__}, not Python code")
        problem = problem_with_tests(tests)
        if problem:
            return Verdict(False, problem)
        code = extract_code(text)
        if not code.strip():
            return Verdict(False, "no code")
        secret = secrets.token_hex(16).encode()
        result = run(self.kind, {"harness.py": HARNESS, "code.py": code, "tests.py": tests},
                     [self.python, "-I", "-B", "harness.py"], self.limits, stdin=secret, binds=self._binds)
        return verdict_of(result, secret)


@functools.lru_cache(maxsize=1024)
def problem_with_tests(tests: str) -> str | None:
    """Why a row's tests cannot judge code (not Python, no statements, a `check` never called), or None."""
    try:
        tree = ast.parse(tests)
    except (SyntaxError, ValueError) as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        return short(f"the tests are not valid Python: {getattr(e, 'msg', e)}{where}")
    if not tree.body:
        return "the tests hold no statements"
    defines_check = any(isinstance(node, ast.FunctionDef) and node.name == "check" for node in tree.body)
    calls_check = any(isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "check"
                      for node in ast.walk(tree))
    if defines_check and not calls_check:
        return "the tests define check() but never call it; add its call, such as check(the_function)"
    return None


def verdict_of(result: RunResult, secret: bytes) -> Verdict:
    """The verdict from a run of the harness: its report, if it carries the secret, else what ended the run."""
    report = next((line[len(secret) + 1:].decode("utf-8", "replace") for line in result.channel.split(b"\n")
                   if line.startswith(secret + b" ")), None)
    if report == "pass" and result.exit_code == 0:
        return Verdict(True)
    if report is not None and report.startswith("fail "):
        return Verdict(False, short(report[len("fail "):]))
    if result.timed_out:
        return Verdict(False, "timeout")
    named = {"output": "output limit", "cpu time": "cpu time", "memory": "memory", "processes": "too many processes"}
    if result.limit in named:
        return Verdict(False, named[result.limit])
    if result.signal is not None:
        return Verdict(False, f"killed by signal {result.signal}")
    if result.exit_code == 0:
        return Verdict(False, "exited before the tests ended")
    return Verdict(False, f"exited before the tests ended (exit code {result.exit_code})")


def short(reason: str) -> str:
    """One line, at most REASON_CHARS characters."""
    line = " ".join(reason.split())
    return line if len(line) <= REASON_CHARS else line[:REASON_CHARS - 3] + "..."
