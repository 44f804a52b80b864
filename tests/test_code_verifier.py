"""The code verifier (workers/verifiers/code_verifier.py): which code it reads, which tests it runs, and that only
tests that ran to their end make a pass, whatever the code does to the harness, the sandbox or its neighbours."""

from __future__ import annotations

import os
import secrets
import socket
import time
from pathlib import Path

import pytest

from workers.verifiers.code_verifier import CodeVerifier, extract_code, problem_with_tests
from workers.verifiers.sandbox import Limits
from workers.verifiers.verdict import Verdict

ROOT = Path(__file__).resolve().parent.parent
ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
GOOD = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\n"
SLOW = "import time\ntime.sleep({})\ndef add(a, b):\n    return a + b"
LIMITS = Limits(wall_s=3.0, cpu_s=2.0, memory_mb=512, processes=32, output_bytes=20_000)
MARGIN_S = 3.0


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):  # it ended while we looked
            continue
        if marker.encode() in cmdline:
            found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def verifier():
    v = CodeVerifier(limits=LIMITS, workers=2)
    yield v
    v.close()


def test_the_code_is_the_last_python_block_else_the_whole_response():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```\nc") == "y = 2\n"
    assert extract_code("```\nx = 1\n```\n```bash\nls\n```") == "x = 1\n"  # other languages are not the code
    assert extract_code("x = 1\nprint(x)") == "x = 1\nprint(x)"
    assert extract_code("Some text\n```python\ndef f():\n    return 1") == "def f():\n    return 1"  # left open
    assert extract_code("only ```bash\nls\n```") == "only ```bash\nls\n```"


def test_a_right_solution_passes_and_a_wrong_one_names_the_failing_assert(verifier):
    wrong = "```python\ndef add(a, b):\n    return a + b if a > 0 else 1\n```"
    good, bad = verifier.verify([GOOD, wrong], [{"tests": ADD_TESTS}] * 2)
    assert good == Verdict(True)
    assert bad == Verdict(False, "test failed: AssertionError: assert add(-1, 1) == 0 (line 2 of the tests)")


def test_the_tests_take_each_form(verifier):
    check_style = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 2) == 4\ncheck(add)"
    with_message = "assert add(1, 1) == 3, 'one and one'"
    rows = [{"tests": check_style}, {"tests": "\n".join(ADD_TESTS)}, {"tests": with_message},
            {"tests": "def check(c):\n    assert c(1, 1) == 3\n"}, {"tests": None}, {"tests": 3},
            {"tests": "assert add(1,"}, {"tests": "# nothing"}, {}]
    got = verifier.verify([GOOD] * len(rows), rows)
    assert got[0] == Verdict(True) and got[1] == Verdict(True)
    assert got[2].reason == "test failed: AssertionError: one and one (line 1 of the tests)"
    assert got[3].reason.startswith("the tests define check() but never call it")
    assert got[4].reason == got[8].reason == "the tests column holds NoneType, not Python code"
    assert got[5].reason == "the tests column holds int, not Python code"
    assert got[6].reason.startswith("the tests are not valid Python: ")
    assert got[7].reason == "the tests hold no statements"
    assert problem_with_tests("assert True") is None


def test_reasons_for_code_that_does_not_run(verifier):
    texts = ["I cannot write this.\n```python\n\n```", "def add(a, b) return a", "def plus(a, b):\n    return a + b",
             "def add(a, b):\n    return a / 0", "x = 1 / 0"]
    got = [v.reason for v in verifier.verify(texts, [{"tests": ADD_TESTS}] * len(texts))]
    assert got[0] == "no code"
    assert got[1] == "syntax error: expected ':' (line 1 of the code)"
    assert got[2] == "error: NameError: name 'add' is not defined (line 1 of the tests)"
    assert got[3] == "error: ZeroDivisionError: division by zero (line 2 of the code)"
    assert got[4] == "error: ZeroDivisionError: division by zero (line 1 of the code)"


def test_the_code_main_block_does_not_run_but_the_tests_main_block_does(verifier):
    code = GOOD + "```python\ndef add(a, b):\n    return a + b\nif __name__ == '__main__':\n    input()\n```"
    tests = "if __name__ == '__main__':\n    assert add(1, 1) == 3"
    assert verifier.verify([code, code], [{"tests": ADD_TESTS}, {"tests": tests}]) == [
        Verdict(True), Verdict(False, "test failed: AssertionError: assert add(1, 1) == 3 (line 2 of the tests)")]


def test_the_code_is_a_module_that_dataclasses_pickle_and_unittest_find(verifier):
    code = ("from __future__ import annotations\nimport pickle\nfrom dataclasses import dataclass\n"
            "@dataclass\nclass Box:\n    x: int\n"
            "def add(a, b):\n    return pickle.loads(pickle.dumps(Box(a))).x + b\n")
    suite = ("import unittest\nclass T(unittest.TestCase):\n    def test_add(self):\n"
             "        self.assertEqual(add(2, 3), {})\n")
    runs = suite + "assert unittest.main(exit=False, argv=['tests']).result.wasSuccessful()"
    exits = suite + "unittest.main(argv=['tests'])"
    rows = [{"tests": runs.format(5)}, {"tests": runs.format(6)}, {"tests": exits.format(5)}]
    got = verifier.verify([code] * 3, rows)
    assert got[0] == Verdict(True)
    assert got[1].reason.startswith("test failed: AssertionError: assert unittest.main(exit=False")
    assert got[2].reason == "exited before the tests ended (SystemExit)"  # unittest.main() exits


MARKER = f"winnow-sample-{secrets.token_hex(4)}"
FORGED = f"""
import os, subprocess, sys
for _ in range(3):
    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {MARKER!r}], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
"""
# The list: each bad sample, and how its verdict begins (a prefix, or a tuple of them). None passes; each
# ends within its limit.
REFUSED = ("error: FileNotFoundError", "error: PermissionError", "error: OSError: [Errno 30]")
BAD = {
    "loops forever": ("while True:\n    pass", ("cpu time", "timeout")),  # which comes first: the machine's load
    "sleeps forever": ("import time\ntime.sleep(60)", "timeout"),
    "starts sleepers and loops": (FORGED + "while True:\n    pass", ("cpu time", "timeout")),
    "allocates 6 GB": ("x = bytearray(6 * 2**30)", "memory"),
    "fork bomb": ("import os\nwhile True:\n    os.fork()", "too many processes"),
    "hundreds of processes": (FORGED.replace("range(3)", "range(300)"), "too many processes"),
    # each folder is absent in the sandbox, or bound read-only, or made by bwrap (root's) to hold a bind inside it
    "writes to /tmp": (f"open('/tmp/{MARKER}', 'w').write('x')", REFUSED),
    "writes to the repository": (f"open({str(ROOT / MARKER)!r}, 'w').write('x')", REFUSED),
    "writes to /root": (f"open('/root/{MARKER}', 'w').write('x')", REFUSED),
    "exit(0)": ("exit(0)", "exited before the tests ended"),
    "sys.exit(0)": ("import sys\nsys.exit(0)", "exited before the tests ended"),
    "os._exit(0)": ("import os\nos._exit(0)", "exited before the tests ended"),
    "raise SystemExit": ("raise SystemExit", "exited before the tests ended"),
    "KeyboardInterrupt": ("raise KeyboardInterrupt", "exited before the tests ended"),
    "prints success": ("print('All tests passed')\nprint('OK')\nprint('PASS')\nimport sys\nsys.stdout.flush()\n"
                       "import os\nos._exit(0)", "exited before the tests ended"),
    "closes its output": ("import os\nfor fd in (1, 2, 3):\n    os.close(fd)\ndef add(a, b):\n    return a - b",
                          "exited before the tests ended"),
    "kills its parent": ("import os\nos.kill(os.getppid(), 9)", "error: PermissionError"),
    "kills everything": ("import os\nos.kill(-1, 9)\ndef add(a, b):\n    return a - b", "error:"),
    "floods its output": ("while True:\n    print('x' * 1000)", "output limit"),
}


def test_bad_samples_fail_and_leave_the_others_and_the_machine_alone(verifier):
    """The issue's "done when": bad samples beside good ones, two at a time through one verifier."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    connects = f"import socket\nsocket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=2)"
    bad = {**BAD, "opens a socket to this machine": (connects, "error: ConnectionRefusedError")}
    order = []
    for i, name in enumerate(bad):  # good ones among the bad ones
        order += ["good", name] if i % 3 == 0 else [name]
    samples = [GOOD if name == "good" else bad[name][0] for name in order]
    start = time.monotonic()
    futures = [verifier.submit(text, {"tests": ADD_TESTS}) for text in samples]
    assert not all(f.done() for f in futures)  # submit does not wait for the judging
    verdicts = [f.result(timeout=120) for f in futures]
    elapsed = time.monotonic() - start
    for name, verdict in zip(order, verdicts):
        if name == "good":
            assert verdict == Verdict(True), verdict
        else:
            assert not verdict.verified, name
            assert verdict.reason.startswith(bad[name][1]), (name, verdict.reason)
    # two at a time, each within its wall limit plus a margin
    assert elapsed < len(samples) / 2 * LIMITS.wall_s + MARGIN_S * 4
    assert processes_with(MARKER) == []
    assert not any(Path(p).exists() for p in (f"/tmp/{MARKER}", ROOT / MARKER, f"/root/{MARKER}"))
    with pytest.raises(BlockingIOError):  # nothing reached this machine's listener
        listener.accept()
    listener.close()


def test_each_run_ends_within_its_limit():
    verifier = CodeVerifier(limits=Limits(wall_s=2.0, cpu_s=60.0), workers=1)
    for text in ("import time\ntime.sleep(60)", "while True:\n    pass"):
        start = time.monotonic()
        assert verifier.verify([text], [{"tests": ADD_TESTS}]) == [Verdict(False, "timeout")]
        assert time.monotonic() - start < 2.0 + MARGIN_S
    verifier.close()


TRACE_JUMP = ("import sys\ndef add(a, b):\n    return 0\n"
              "def tracer(frame, event, arg):\n"
              "    if frame.f_code.co_filename == '<tests>' and event == 'line':\n"
              "        frame.f_lineno = frame.f_lineno + 1\n    return tracer\nsys.settrace(tracer)")
HARNESS_ATTACKS = {
    # writes what it hopes the harness writes, on the report channel
    "fake report": "import os\nos.write(3, b'pass\\n' + b'0' * 32 + b' pass\\n')\nos._exit(0)",
    # runs the harness again after emptying the tests
    "harness again": ("import __main__, sys\nif not hasattr(sys, 'again'):\n    sys.again = 1\n"
                      "    import os\n    os.remove('tests.py')\n    open('tests.py', 'w').write('pass')\n"
                      "    __main__.main()\n    os._exit(0)"),
    # skips the tests' lines with a trace function
    "trace jump": TRACE_JUMP,
    # looks for the secret among the interpreter's objects
    "gc search": "import gc\nfor o in gc.get_objects():\n    pass",
    # skips the tests' lines after emptying the harness's list of refusals
    "refusals cleared": "import __main__\n__main__.REFUSED = ()\n" + TRACE_JUMP,
    # reads its own memory, or its parent's from a child
    "proc mem": "open('/proc/self/mem', 'rb')",
    "child's mem": ("import os\nif os.fork() == 0:\n    try:\n        open('/proc/self/mem', 'rb')\n"
                    "    except PermissionError:\n        os._exit(7)\n    os._exit(0)\n"
                    "raise ValueError(os.waitstatus_to_exitcode(os.wait()[1]))"),
    # passes the tests in a forked child only, while the harness's own process waits and exits 0
    "forked pass": ("import os\ndef add(a, b):\n    return a + b if os.getpid() != PARENT else 0\n"
                    "PARENT = os.getpid()\nchild = os.fork()\nif child:\n    os.waitpid(child, 0)\n    os._exit(0)"),
}


def test_the_harness_cannot_be_talked_into_a_pass(verifier):
    names = list(HARNESS_ATTACKS)
    verdicts = verifier.verify([HARNESS_ATTACKS[n] for n in names], [{"tests": ADD_TESTS}] * len(names))
    assert [v.verified for v in verdicts] == [False] * len(names), list(zip(names, verdicts))
    reasons = dict(zip(names, (v.reason for v in verdicts)))
    assert reasons["trace jump"] == "error: RuntimeError: the code harness refuses sys.settrace (line 8 of the code)"
    assert reasons["gc search"].startswith("error: RuntimeError: the code harness refuses gc.get_objects")
    assert reasons["refusals cleared"] == reasons["trace jump"].replace("line 8", "line 10")
    assert reasons["proc mem"] == ("error: PermissionError: [Errno 13] Permission denied: '/proc/self/mem' "
                                   "(line 1 of the code)")
    assert reasons["child's mem"] == "error: ValueError: 7 (line 8 of the code)"  # its children cannot either
    assert reasons["forked pass"] == reasons["harness again"] == "exited before the tests ended"


def test_samples_run_in_parallel_off_the_callers_thread():
    slow = SLOW.format(2)
    verifier = CodeVerifier(limits=Limits(wall_s=8.0), workers=2)
    start = time.monotonic()
    futures = [verifier.submit(slow, {"tests": ADD_TESTS}) for _ in range(2)]
    assert time.monotonic() - start < 0.5  # submit returns at once
    assert [f.result() for f in futures] == [Verdict(True)] * 2
    assert time.monotonic() - start < 2 * 2.0  # two at once, not one after the other
    verifier.close()


def test_the_verifier_reads_its_own_column_and_none_sandbox_works():
    verifier = CodeVerifier(tests_column="test_list", sandbox="none", limits=Limits(wall_s=8.0, cpu_s=1.0))
    assert verifier.columns == ("test_list",)
    texts = [GOOD, "def add(a, b):\n    return a", "while True:\n    pass", "import os\nos._exit(0)"]
    got = verifier.verify(texts, [{"test_list": ADD_TESTS, "tests": "assert False"}] * len(texts))
    assert got[0] == Verdict(True)
    assert got[1].reason == "test failed: AssertionError: assert add(2, 3) == 5 (line 1 of the tests)"
    assert got[2].reason == "cpu time"
    assert got[3].reason == "exited before the tests ended"
    verifier.close()


def test_close_cancels_what_has_not_started():
    verifier = CodeVerifier(limits=Limits(wall_s=5.0), workers=1)
    futures = [verifier.submit(SLOW.format(1), {"tests": ADD_TESTS}) for _ in range(3)]
    time.sleep(0.3)
    verifier.close()
    assert futures[0].result() == Verdict(True)
    assert futures[2].cancelled()
    with pytest.raises(RuntimeError):
        verifier.submit(GOOD, {"tests": ADD_TESTS})


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no system Python to choose")
@pytest.mark.parametrize("kind", ["bwrap", "none"])
def test_the_chosen_python_runs_isolated(kind, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("PYTHONSTARTUP", "/nonexistent")
    tests = ("import sys\n"
             "assert sys.executable == '/usr/bin/python3', sys.executable\n"
             "assert sys.flags.isolated and sys.flags.ignore_environment and sys.flags.no_user_site\n"
             f"assert not any(p.startswith({str(ROOT)!r}) for p in sys.path), sys.path")
    verifier = CodeVerifier(sandbox=kind, python="/usr/bin/python3")
    assert verifier.verify([GOOD], [{"tests": tests}]) == [Verdict(True)]
    verifier.close()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown sandbox 'docker'"):
        CodeVerifier(sandbox="docker")
    with pytest.raises(ValueError, match="workers must be >= 1"):
        CodeVerifier(workers=0)
