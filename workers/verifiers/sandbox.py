"""The sandbox: run a program that nobody trusts (a model's code) in a fresh folder, with limits, in a process of its
own, never in the caller's (docs/verifiers.md).

Two kinds:
- `bwrap` (bubblewrap, the Debian package `bubblewrap`). The program sees a read-only system (/usr, the library and
  binary links, a few /etc files, the Python prefixes it needs), its folder as the only writable place, its own
  /proc and /dev, no network (its own loopback only), and its own pid namespace: it cannot see or signal the caller,
  and killing the namespace's first process ends all of it. Nothing else of the machine is there (/root, /home, the
  run folder, the repository), beyond the Python prefixes, bound read-only. Where the caller is root, the
  namespaces are made as root and the program then runs under a fresh uid (`SANDBOX_UIDS`, no capabilities): a
  root-mapped user namespace would leave the process limit unenforced, since the kernel never counts uid 0's
  processes against it. Where the caller is not root, bwrap makes a user namespace and the program keeps the
  caller's uid outside it.
- `none`: a plain subprocess in a fresh folder, with the same rlimits, and no isolation. It runs as the caller's
  user: it can read and write what the caller can, reach the network, and signal the caller's processes; as root,
  the process limit does not bind. A config must choose it explicitly (`sandbox: none`).

The limits (`Limits`): wall time (the whole sandbox is killed at the limit), CPU time (RLIMIT_CPU: SIGXCPU, then
SIGKILL a second later), memory (RLIMIT_AS: an allocation beyond it fails, a MemoryError in Python), processes and
threads (RLIMIT_NPROC), each of stdout and stderr (read up to the cap; the program is killed when it writes more),
and the size of a file it writes (RLIMIT_FSIZE).

Steps of `run`: write the files into a fresh folder; start the launcher (a few lines of Python with `-I -S`, under
bwrap or not), which sets the rlimits, drops to the sandbox uid where there is one, puts the report channel on fd 3
and execs the program; feed stdin and read stdout, stderr and the channel until the program ends or a limit kills
it; reap it; remove the folder. No process of the sandbox outlives the call (with `none`, one that leaves the
process group can).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

KINDS = ("bwrap", "none")
BWRAP = "bwrap"  # looked up on PATH when a sandbox starts
INSTALL = "apt-get install bubblewrap"
INSIDE = "/sandbox"  # where the fresh folder is, inside a bwrap sandbox
# Where the caller is root, each bwrap run takes a fresh uid from this range, so that two sandboxes never share
# a process count (RLIMIT_NPROC counts a uid's processes).
SANDBOX_UIDS = range(1_000_000_000, 1_000_000_000 + (1 << 24))
# Read-only system paths a Python program needs; the links among them (merged /usr) are made as links.
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf", "passwd", "group", "alternatives")
DRAIN_S = 1.0  # after the program ends, how long its pipes may stay open (a `none` child that left the group)
GONE_S = 10.0  # after bwrap ends, how long its sandbox's processes may take to die

# Runs first in the sandbox: the channel on fd 3 and the launch status on fd 4, every other fd closed, rlimits, the
# uid, then the program. The status holds "." once the launcher runs, then why the launch failed, if it did; the
# exec closes it, so the program cannot write there.
LAUNCHER = r"""
import fcntl, os, resource, sys
cpu, memory, processes, file_bytes, uid, channel, status = map(int, sys.argv[1:8])
channel, status = fcntl.fcntl(channel, fcntl.F_DUPFD, 10), fcntl.fcntl(status, fcntl.F_DUPFD, 10)
os.dup2(channel, 3)
os.dup2(status, 4, inheritable=False)
os.closerange(5, os.sysconf("SC_OPEN_MAX"))
os.write(4, b".")
try:
    for which, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, memory, memory),
                              (resource.RLIMIT_NPROC, processes, processes),
                              (resource.RLIMIT_FSIZE, file_bytes, file_bytes), (resource.RLIMIT_CORE, 0, 0)):
        resource.setrlimit(which, (soft, hard))
    if uid >= 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    os.execvp(sys.argv[8], sys.argv[8:])
except BaseException as e:
    os.write(4, f"{type(e).__name__}: {e}".encode())
    os._exit(127)
"""


class SandboxError(RuntimeError):
    """The sandbox itself failed (bwrap could not build it, or the launcher could not start the program): a broken
    machine, not a verdict on the program."""


@dataclass(frozen=True)
class Limits:
    """What one run may use. `wall_s`: seconds from start to kill. `cpu_s`: CPU seconds (rounded up to whole
    seconds), over all its threads. `memory_mb`: address space per process. `processes`: processes and threads
    at once. `output_bytes`: the cap on each of stdout and stderr. `file_mb`: the largest file it may write."""

    wall_s: float = 10.0
    cpu_s: float = 10.0
    memory_mb: int = 1024
    processes: int = 64
    output_bytes: int = 65536
    file_mb: int = 16

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_mb", "processes", "output_bytes", "file_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name} must be > 0; got {getattr(self, name)!r}")


@dataclass(frozen=True)
class RunResult:
    """What a run did. `exit_code` (None when a signal ended it) or `signal`; `stdout` and `stderr` (decoded, cut at
    the cap: `stdout_cut`, `stderr_cut`); `channel`: what it wrote on fd 3; `timed_out`: killed at the wall limit;
    `limit`: the limit that ended it where that can be told ("wall time", "cpu time", "memory", "processes",
    "output"), else None; `wall_s`: its wall time.

    Under bwrap, an exit code above 128 reads as a signal (128 + n), as a shell reads it. The CPU limit shows as
    SIGXCPU; a program that ignores SIGXCPU dies of SIGKILL a second later, which reads as "cpu time" only without
    bwrap (the caller reaps bwrap, not the program, so it does not learn the program's CPU time)."""

    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    stdout_cut: bool
    stderr_cut: bool
    channel: bytes
    timed_out: bool
    limit: str | None
    wall_s: float


def sandbox_problem(kind: str) -> str | None:
    """Why `kind` cannot run programs here, with the fix; None when it can. `none` always can. For `bwrap`: the
    binary is there, and a smoke run starts Python in a sandbox, under a uid that is not root where the caller is
    root (else the process limit would not bind)."""
    if kind == "none":
        return None
    if kind != "bwrap":
        return f"unknown sandbox {kind!r}; use one of {', '.join(KINDS)}"
    if shutil.which(BWRAP) is None:
        return f"bubblewrap is not installed (no {BWRAP} on PATH); install it with: {INSTALL}"
    probe = "import os; print(os.getuid())"
    try:
        result = run(kind, {}, [sys.executable, "-I", "-S", "-c", probe], Limits(wall_s=20.0, cpu_s=10.0))
    except SandboxError as e:
        return (f"bubblewrap cannot start a sandbox here ({e}); it needs user namespaces, or root "
                f"(check `{BWRAP} --ro-bind / / true`)")
    if result.exit_code != 0:
        return f"a smoke run in the bubblewrap sandbox failed (exit {result.exit_code}): {_last_line(result.stderr)}"
    if os.geteuid() == 0 and result.stdout.strip() == "0":
        return "the bubblewrap sandbox runs programs as root here, so its process limit would not bind"
    return None


def python_binds(python: str | None = None) -> tuple[str, ...]:
    """The folders a Python interpreter needs, to bind read-only: its prefixes (a venv's and its base's).
    `python=None`: this interpreter. Another is asked (it is the config's own binary, run outside the sandbox)."""
    if python is None:
        found = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    else:
        probe = ("import json, sys; "
                 "print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))")
        out = subprocess.run([python, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise ValueError(f"python {python!r} did not run: {_last_line(out.stderr)}")
        found = set(json.loads(out.stdout))
    return tuple(sorted(os.path.realpath(p) for p in found) + sorted(found))


def run(kind: str, files: dict[str, str], argv: list[str], limits: Limits, *, stdin: bytes = b"",
        binds: tuple[str, ...] = ()) -> RunResult:
    """Run `argv` in a fresh folder holding `files` (relative path -> text), under the sandbox `kind`, within
    `limits`; `stdin` is its standard input. `binds`: more folders the program needs, bound read-only at their own
    paths under bwrap (this interpreter's prefixes always are: the launcher runs on it). Raises SandboxError when
    the sandbox itself fails."""
    if kind not in KINDS:
        raise ValueError(f"unknown sandbox {kind!r}; use one of {', '.join(KINDS)}")
    folder = Path(tempfile.mkdtemp(prefix="winnow-sandbox-"))
    try:
        for name, text in files.items():
            path = folder / name
            if not name or Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"sandbox file name {name!r} must be a relative path inside the folder")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8", errors="replace")
            path.chmod(0o644)  # readable by the sandbox's uid, whatever the caller's umask
            for parent in Path(name).parents[:-1]:  # its folders below the run's folder
                (folder / parent).chmod(0o755)
        uid = -1
        if kind == "bwrap" and os.geteuid() == 0:
            uid = SANDBOX_UIDS.start + secrets.randbelow(len(SANDBOX_UIDS))
            os.chown(folder, uid, uid)
            os.chmod(folder, 0o711)  # bwrap enters it as a root without capabilities
        return _supervise(kind, folder, argv, limits, stdin, binds, uid)
    finally:
        _remove(folder)


def _supervise(kind, folder: Path, argv, limits: Limits, stdin: bytes, binds, uid: int) -> RunResult:
    """Start the launcher, feed and read its pipes under the limits, reap it."""
    bwrap = shutil.which(BWRAP) if kind == "bwrap" else None
    if kind == "bwrap" and bwrap is None:
        raise SandboxError(f"bubblewrap is not installed (no {BWRAP} on PATH); install it with: {INSTALL}")
    inside = INSIDE if kind == "bwrap" else str(folder)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": inside, "TMPDIR": inside, "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    pipes = {name: os.pipe() for name in ("stdin", "stdout", "stderr", "channel", "status", "bwrap")}
    ours = {name: pair[1] if name == "stdin" else pair[0] for name, pair in pipes.items()}
    theirs = {name: pair[0] if name == "stdin" else pair[1] for name, pair in pipes.items()}
    command = [sys.executable, "-I", "-S", "-c", LAUNCHER, str(math.ceil(limits.cpu_s)), str(limits.memory_mb << 20),
               str(limits.processes), str(limits.file_mb << 20), str(uid), str(theirs["channel"]),
               str(theirs["status"]), *argv]
    if bwrap is not None:
        command = [bwrap, *_bwrap_options(folder, env, binds + python_binds(), uid),
                   "--json-status-fd", str(theirs["bwrap"]), "--", *command]
    start = time.monotonic()
    try:
        proc = subprocess.Popen(command, stdin=theirs["stdin"], stdout=theirs["stdout"], stderr=theirs["stderr"],
                                pass_fds=(theirs["channel"], theirs["status"], theirs["bwrap"]),
                                cwd=folder, env=env, start_new_session=True)
    except BaseException:
        _close(*ours.values())
        raise
    finally:
        _close(*theirs.values())
    caps = {"stdout": limits.output_bytes, "stderr": limits.output_bytes, "channel": limits.output_bytes,
            "status": 4096, "bwrap": 4096}
    read = _Reader(proc, kind, ours, caps, stdin)
    try:
        killed_for = read.until(start + limits.wall_s)
    except BaseException:
        read.kill()
        os.waitpid(proc.pid, 0)
        proc.returncode = -signal.SIGKILL
        read.wait_sandbox_gone()
        raise
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    read.wait_sandbox_gone()
    wall = time.monotonic() - start
    cpu = usage.ru_utime + usage.ru_stime
    launched = read.data["status"]
    if launched[1:]:
        raise SandboxError(f"the sandbox launcher failed: {launched[1:].decode(errors='replace')}")
    if not launched and killed_for is None:
        raise SandboxError(f"the sandbox did not start the program: {_last_line(read.text('stderr'))}")
    code = proc.returncode
    if kind == "bwrap" and code > 128:  # bwrap passes on its program's end as a shell would
        code = -(code - 128)
    stderr = read.text("stderr")
    sig = -code if code < 0 else None
    limit = {"wall": "wall time", "output": "output"}.get(killed_for)
    cpu_killed = kind == "none" and sig == signal.SIGKILL and cpu >= math.ceil(limits.cpu_s)
    if limit is None and (sig == signal.SIGXCPU or cpu_killed):
        limit = "cpu time"
    elif limit is None and "MemoryError" in stderr:
        limit = "memory"
    elif limit is None and ("[Errno 11] Resource temporarily unavailable" in stderr
                            or "can't start new thread" in stderr):
        limit = "processes"
    return RunResult(exit_code=None if sig else code, signal=sig, stdout=read.text("stdout"), stderr=stderr,
                     stdout_cut=read.cut["stdout"], stderr_cut=read.cut["stderr"], channel=bytes(read.data["channel"]),
                     timed_out=killed_for == "wall", limit=limit, wall_s=wall)


class _Reader:
    """The parent's side of a run's pipes: writes stdin, reads the others up to their caps, and kills the run at
    the wall deadline or when stdout or stderr passes its cap. Under bwrap it also learns the sandbox's first
    process (bwrap's status: its pid), to kill it directly and to wait until the whole namespace is gone."""

    def __init__(self, proc: subprocess.Popen, kind: str, fds: dict[str, int], caps: dict[str, int], stdin: bytes):
        self.proc, self.kind, self.caps = proc, kind, caps
        self.data = {name: bytearray() for name in fds if name != "stdin"}
        self.cut = {name: False for name in self.data}
        self.selector = selectors.DefaultSelector()
        self.pending = memoryview(stdin)
        for name, fd in fds.items():
            os.set_blocking(fd, False)
            if name == "stdin" and not stdin:
                os.close(fd)
            else:
                self.selector.register(fd, selectors.EVENT_WRITE if name == "stdin" else selectors.EVENT_READ, name)
        self.pidfd = os.pidfd_open(proc.pid)
        self.selector.register(self.pidfd, selectors.EVENT_READ, "exit")
        self.init = None  # a pidfd of the sandbox's first process, once bwrap says its pid

    def until(self, deadline: float) -> str | None:
        """Serve the pipes until the run has ended and its pipes are closed; returns why it was killed ("wall",
        "output") or None."""
        killed_for, ended_at = None, None
        try:
            while True:
                now = time.monotonic()
                if ended_at is None and killed_for is None and now >= deadline:
                    killed_for = "wall"
                    self.kill()
                open_pipes = len(self.selector.get_map()) - (ended_at is None)
                if ended_at is not None and (open_pipes == 0 or now >= ended_at + DRAIN_S):
                    return killed_for
                wait = (ended_at + DRAIN_S if ended_at is not None else deadline) - now
                for key, _ in self.selector.select(max(wait, 0.0) if killed_for is None else 0.1):
                    name = key.data
                    if name == "exit":
                        ended_at = time.monotonic()
                        self.selector.unregister(key.fd)
                        if self.kind == "none":
                            self.kill()  # what it left in its process group
                    elif name == "stdin":
                        self._feed(key.fd)
                    elif self._take(key.fd, name) and killed_for is None:
                        killed_for = "output"
                        self.kill()
        finally:
            for key in list(self.selector.get_map().values()):
                self.selector.unregister(key.fd)
                os.close(key.fd)
            os.close(self.pidfd)
            self.selector.close()

    def _feed(self, fd: int) -> None:
        try:
            sent = os.write(fd, self.pending[:65536])
        except BrokenPipeError:  # it closed its stdin: it reads no more
            sent = len(self.pending)
        self.pending = self.pending[sent:]
        if not self.pending:
            self.selector.unregister(fd)
            os.close(fd)

    def _take(self, fd: int, name: str) -> bool:
        """Read what is there; True when stdout or stderr just passed its cap."""
        chunk = os.read(fd, 65536)
        if not chunk:
            self.selector.unregister(fd)
            os.close(fd)
            return False
        buf, cap = self.data[name], self.caps[name]
        room = cap - len(buf)
        buf += chunk[:max(room, 0)]
        if name == "bwrap" and self.init is None:
            self._find_init()
        if len(chunk) > room and not self.cut[name]:
            self.cut[name] = True
            return name in ("stdout", "stderr")
        return False

    def _find_init(self) -> None:
        for line in self.data["bwrap"].decode(errors="replace").splitlines():
            pid = json.loads(line).get("child-pid") if line.rstrip().endswith("}") else None
            if pid is not None:
                try:
                    self.init = os.pidfd_open(pid)
                except ProcessLookupError:  # it has ended already, and its namespace with it
                    self.init = -1
                return

    def kill(self) -> None:
        """SIGKILL the run: the sandbox's first process (its pid namespace ends with it) and bwrap, or the `none`
        program's process group."""
        try:
            if self.kind == "none":
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                if self.init is not None and self.init >= 0:
                    signal.pidfd_send_signal(self.init, signal.SIGKILL)
                os.kill(self.proc.pid, signal.SIGKILL)  # and --die-with-parent takes the sandbox
        except ProcessLookupError:  # it has ended already: nothing left to kill
            return

    def wait_sandbox_gone(self) -> None:
        """Once bwrap has ended: wait until the sandbox's first process has, which the kernel lets happen only
        after every other process of its namespace has."""
        if self.init is None or self.init < 0:
            return
        try:
            with selectors.DefaultSelector() as gone:
                gone.register(self.init, selectors.EVENT_READ)
                if not gone.select(GONE_S):
                    raise SandboxError(f"the sandbox's processes outlived bwrap by {GONE_S:.0f} s")
        finally:
            os.close(self.init)
            self.init = -1

    def text(self, name: str) -> str:
        return self.data[name].decode("utf-8", errors="replace")


def _bwrap_options(folder: Path, env: dict, binds, uid: int) -> list[str]:
    """bwrap's arguments: namespaces, the read-only system and binds, the folder read-write, the environment."""
    out = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
           "--hostname", "sandbox", "--die-with-parent", "--new-session", "--proc", "/proc", "--dev", "/dev"]
    if uid >= 0:
        # made as root, no user namespace; the launcher keeps only what it needs to change its uid
        out += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        out += ["--unshare-user"]
    for path in SYSTEM:
        if os.path.islink(path):
            out += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            out += ["--ro-bind", path, path]
    for name in ETC:
        out += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    bound, made = set(SYSTEM), {"/", "/etc"}
    for path in sorted(set(binds)):
        if path == "/" or any(path == b or path.startswith(b + "/") for b in bound):
            continue  # inside a path bound already (a prefix under /usr)
        for parent in reversed(Path(path).parents):
            if str(parent) not in made:
                out += ["--perms", "0755", "--dir", str(parent)]
                made.add(str(parent))
        out += _ro_bind(path, opened=uid >= 0)
        bound.add(path)
    out += ["--bind", str(folder), INSIDE, "--chdir", INSIDE, "--clearenv"]
    for key, value in env.items():
        out += ["--setenv", key, value]
    return out


def _ro_bind(path: str, opened: bool) -> list[str]:
    """bwrap's arguments to bind `path` read-only. Where `opened`, the program runs under a uid of its own, and a
    folder that others cannot enter (a venv made by `mktemp -d`, a home at 0700) is made as a 0755 folder with its
    entries bound inside it (links as links), down to folders that others can enter; files keep their own modes."""
    if not opened or os.path.islink(path) or not os.path.isdir(path) or os.stat(path).st_mode & 0o005 == 0o005:
        return ["--ro-bind", path, path]
    out = ["--perms", "0755", "--dir", path]
    for name in sorted(os.listdir(path)):
        inner = os.path.join(path, name)
        out += ["--symlink", os.readlink(inner), inner] if os.path.islink(inner) else _ro_bind(inner, opened)
    return out


def _remove(folder: Path) -> None:
    """Remove the run's folder, whatever modes the program left on its folders (a caller that is not root needs
    them writable to empty them)."""
    try:
        shutil.rmtree(folder)
    except PermissionError:
        os.chmod(folder, 0o700)
        for root, dirs, _ in os.walk(folder):
            for name in dirs:
                os.chmod(os.path.join(root, name), 0o700)
        shutil.rmtree(folder)


def _close(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(no message)"
