"""The sandbox (workers/verifiers/sandbox.py): what a program in it can reach, and the limits that end it.

Programs here are small Python scripts; each test asserts what the caller sees (the RunResult, files on this
machine, processes left, a listener's connections). Limits are small so that the file runs in seconds."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest

from workers.verifiers import sandbox
from workers.verifiers.sandbox import Limits, SandboxError, run, sandbox_problem

ROOT = Path(__file__).resolve().parent.parent
PY = [sys.executable, "-I"]
MARGIN_S = 3.0  # start, kill and reap, on a loaded machine


def processes_with(marker: str) -> list[int]:
    """Pids of this machine's processes whose command line holds `marker`."""
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


def spawner(marker: str, count: int) -> str:
    """Python that starts `count` sleepers named by `marker`, in new sessions (out of the program's group) and
    holding none of its pipes, as daemons do."""
    return (f"import subprocess, sys\n"
            f"for _ in range({count}):\n"
            f"    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}],"
            f" start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,"
            f" stderr=subprocess.DEVNULL)\n")


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    """Sandbox folders made under tmp_path, to see that each run removes its own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_bwrap_works_here_and_none_always():
    assert sandbox_problem("bwrap") is None
    assert sandbox_problem("none") is None
    assert "unknown sandbox 'docker'" in sandbox_problem("docker")


def test_missing_bwrap_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on this PATH
    problem = sandbox_problem("bwrap")
    assert "apt-get install bubblewrap" in problem
    with pytest.raises(SandboxError, match="apt-get install bubblewrap"):
        run("bwrap", {}, PY + ["-c", "pass"], Limits())
    assert sandbox_problem("none") is None


@pytest.mark.parametrize("kind", ["bwrap", "none"])
def test_a_run_gives_its_output_channel_and_exit_code_and_removes_its_folder(kind, own_tmp):
    program = ("import os, sys\n"
               "data = sys.stdin.read()\n"
               "print('read', len(data), 'files', sorted(os.listdir('.')))\n"
               "print('to stderr', file=sys.stderr)\n"
               "os.write(3, b'on the channel')\n"
               "open('made.txt', 'w').write('x')\n"
               "sys.exit(3)\n")
    result = run(kind, {"main.py": program, "sub/data.txt": "d"}, PY + ["main.py"], Limits(), stdin=b"y" * 300_000)
    assert result.exit_code == 3 and result.signal is None
    assert result.stdout.startswith("read 300000 files ")  # all of stdin arrived, past a pipe's buffer
    assert "files ['main.py', 'sub']" in result.stdout
    assert result.stderr == "to stderr\n"
    assert result.channel == b"on the channel"
    assert not result.timed_out and result.limit is None
    assert list(own_tmp.iterdir()) == []  # its folder is gone, with what it wrote


def test_bwrap_isolates_files_processes_and_network(own_tmp):
    marker = f"winnow-escape-{secrets.token_hex(4)}"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    targets = [f"/tmp/{marker}", str(ROOT / marker), f"/root/{marker}", f"{sys.prefix}/{marker}"]
    program = f"""
import json, os, socket
out = {{"uid": os.getuid(), "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}}
for path in {targets!r}:
    try:
        open(path, "w").write("escaped")
        out[path] = "written"
    except OSError as e:
        out[path] = type(e).__name__
for name in ("/root", "/home", "{ROOT}"):
    out[name] = sorted(os.listdir(name)) if os.path.isdir(name) else None
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    out["connect"] = "connected"
except OSError as e:
    out["connect"] = type(e).__name__
try:
    os.kill({os.getpid()}, 0)
    out["caller"] = "visible"
except OSError as e:
    out["caller"] = type(e).__name__
print(json.dumps(out))
"""
    result = run("bwrap", {"main.py": program}, PY + ["main.py"], Limits())
    seen = json.loads(result.stdout)
    for path in targets:
        assert seen[path] in ("PermissionError", "FileNotFoundError", "OSError"), (path, seen[path])
        assert not os.path.exists(path)
    assert seen["/root"] in ([".pyenv"], [], None)  # at most the path to the Python prefix, made empty
    assert seen["/home"] is None
    assert seen[str(ROOT)] in ([".venv"], [], None)  # the repository is not there, at most its venv's folder
    assert seen["connect"] in ("ConnectionRefusedError", "OSError", "TimeoutError")
    with pytest.raises(BlockingIOError):  # nothing connected to this machine's listener
        listener.accept()
    listener.close()
    assert seen["caller"] == "ProcessLookupError"  # the caller's pid is not in its namespace
    assert len(seen["pids"]) <= 3  # bwrap's init and the program: none of this machine's processes
    if os.geteuid() == 0:
        assert seen["uid"] in sandbox.SANDBOX_UIDS  # not root, so that the process limit binds


@pytest.mark.parametrize("kind", ["bwrap", "none"])
@pytest.mark.parametrize("program", ["while True: pass", "import time\ntime.sleep(60)"], ids=["spin", "sleep"])
def test_the_wall_limit_kills_the_run_and_what_it_started(kind, program):
    marker = f"winnow-wall-{secrets.token_hex(4)}"
    spawn = spawner(marker, 3).replace(", start_new_session=True", "") if kind == "none" else spawner(marker, 3)
    limits = Limits(wall_s=2.0, cpu_s=30.0)
    start = time.monotonic()
    result = run(kind, {"main.py": spawn + program}, PY + ["main.py"], limits)
    assert time.monotonic() - start < limits.wall_s + MARGIN_S
    assert result.timed_out and result.limit == "wall time" and result.signal == signal.SIGKILL
    if kind == "none":
        time.sleep(0.2)  # its group was sent SIGKILL; under bwrap, the call waits until the namespace is gone
    assert processes_with(marker) == []


@pytest.mark.parametrize("kind", ["bwrap", "none"])
def test_the_cpu_limit_ends_a_busy_program(kind):
    result = run(kind, {"main.py": "while True: pass"}, PY + ["main.py"], Limits(wall_s=20.0, cpu_s=1.0))
    assert not result.timed_out
    assert result.signal == signal.SIGXCPU and result.limit == "cpu time"


@pytest.mark.parametrize("kind", ["bwrap", "none"])
def test_the_memory_limit_refuses_6_gb(kind):
    program = "x = bytearray(6 * 2**30)\nprint('allocated')"
    result = run(kind, {"main.py": program}, PY + ["main.py"], Limits(memory_mb=512))
    assert "allocated" not in result.stdout
    assert result.exit_code == 1 and result.limit == "memory"


@pytest.mark.skipif(os.geteuid() != 0, reason="a caller that is not root runs the program as itself")
def test_a_bound_folder_that_others_cannot_enter_is_readable_and_stays_read_only(tmp_path):
    """A venv made by `mktemp -d` (mode 0700, as CI makes its own): the sandbox's uid reads and runs what is in it,
    follows its links, and writes nothing there."""
    closed = tmp_path / "closed"
    (closed / "lib").mkdir(parents=True)
    (closed / "lib" / "data.txt").write_text("inside")
    (closed / "lib" / "data.txt").chmod(0o644)
    (closed / "link.txt").symlink_to("lib/data.txt")
    closed.chmod(0o700)
    program = (f"import os\nprint(open({str(closed / 'link.txt')!r}).read())\n"
               f"try:\n    open({str(closed / 'new.txt')!r}, 'w')\nexcept OSError as e:\n    print(type(e).__name__)\n")
    result = run("bwrap", {"main.py": program}, PY + ["main.py"], Limits(), binds=(str(closed),))
    assert result.stdout.split() == ["inside", "PermissionError"], result
    assert sorted(p.name for p in closed.iterdir()) == ["lib", "link.txt"]


def test_the_process_limit_binds_on_a_fork_bomb():
    program = ("import os, time\n"
               "children = 0\n"
               "try:\n"
               "    for _ in range(500):\n"
               "        if os.fork() == 0:\n"
               "            time.sleep(30)\n"
               "            os._exit(0)\n"
               "        children += 1\n"
               "finally:\n"
               "    print(children, flush=True)\n")
    start = time.monotonic()
    result = run("bwrap", {"main.py": program}, PY + ["main.py"], Limits(wall_s=10.0, processes=16))
    assert time.monotonic() - start < 10.0  # the limit, not the clock, stopped it
    assert int(result.stdout) < 16
    assert result.limit == "processes" and "BlockingIOError" in result.stderr


def test_hundreds_of_processes_leave_nothing_behind():
    marker = f"winnow-bomb-{secrets.token_hex(4)}"
    result = run("bwrap", {"main.py": spawner(marker, 300)}, PY + ["main.py"], Limits(wall_s=5.0, processes=32))
    assert result.limit == "processes"
    assert processes_with(marker) == []


@pytest.mark.parametrize("kind", ["bwrap", "none"])
def test_output_past_the_cap_is_cut_and_ends_the_run(kind):
    start = time.monotonic()
    program = "import sys\nwhile True:\n    sys.stdout.write('x' * 4096)"
    result = run(kind, {"main.py": program}, PY + ["main.py"], Limits(wall_s=10.0, output_bytes=10_000))
    assert time.monotonic() - start < 10.0
    assert result.stdout_cut and len(result.stdout) == 10_000
    assert result.limit == "output" and not result.timed_out


def test_a_file_past_the_size_limit_is_refused():
    program = "open('big', 'wb').write(b'x' * (3 << 20))"
    result = run("bwrap", {"main.py": program}, PY + ["main.py"], Limits(file_mb=1))
    assert result.exit_code == 1 and "File too large" in result.stderr


def test_none_runs_in_a_separate_process_and_a_fresh_folder(own_tmp):
    program = "import os\nprint(os.getpid(), os.getppid(), os.getcwd())"
    result = run("none", {"main.py": program}, PY + ["main.py"], Limits())
    pid, parent, cwd = result.stdout.split()
    assert int(pid) != os.getpid() and int(parent) == os.getpid()
    assert Path(cwd).parent == own_tmp and not Path(cwd).exists()


def test_a_program_that_cannot_start_is_a_sandbox_error():
    for kind in ("bwrap", "none"):
        with pytest.raises(SandboxError, match="launcher failed: FileNotFoundError"):
            run(kind, {}, ["/nonexistent/program"], Limits())


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="wall_s must be > 0"):
        Limits(wall_s=0)
    with pytest.raises(ValueError, match="must be a relative path"):
        run("none", {"../x.py": ""}, PY, Limits())
