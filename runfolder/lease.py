"""A lease on a folder Winnow writes (a run folder, or the --out of build-sft/report): one writer at a time.

The lease is a small JSON file (`Holder`: command, host, pid, start time, a token) whose presence, held, means a
live process is writing the folder. Two stores, two mechanisms:

- **Local disk**: ``fcntl.flock`` on the lease file. The kernel holds the lock for the life of the process and drops
  it when the process ends in any way (exit, crash, SIGKILL, ``ray job stop``), so a lease left by a killed run is
  free at once, with no expiry to wait for. (Like every flock, it is only as good as the filesystem's locking: NFS
  mounts without lock support do not share it between hosts.)
- **Object stores** (s3://, and any other fsspec URL): a lease object created with a conditional write (S3's
  ``If-None-Match: *``: of two runs starting together exactly one creates it) and kept alive by a heartbeat thread
  that rewrites it every ``ttl/4`` seconds with ``If-Match`` on the ETag it last wrote. No process can release a
  lease it did not write, and a lease whose heartbeat is older than its ``ttl_s`` (default 120 s,
  ``WINNOW_LEASE_TTL_S``) is expired: a killed run's lease is taken over after that, again by ``If-Match`` on the
  expired lease's ETag, so of two runs taking it over together one wins. Stores without conditional writes (other
  than S3) cannot take over an expired lease safely; there the message says which file to delete by hand.

`holder_of` tells whether a folder is held now (for the refusal before a run starts, and for showing a manifest
left ``running`` by a killed or stopped run as interrupted).
"""

from __future__ import annotations

import datetime as dt
import errno
import json
import os
import posixpath
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass

from schemas.base import InputError

LEASE_FILE = "_lease.json"
DEFAULT_TTL_S = 120.0
HOLDER_WRITE_WAIT_S = 2.0  # how long a reader waits for a fresh holder to write its name into the file it locked


def ttl_seconds() -> float:
    raw = os.environ.get("WINNOW_LEASE_TTL_S")
    if raw is None:
        return DEFAULT_TTL_S
    try:
        value = float(raw)
    except ValueError:
        raise InputError(f"WINNOW_LEASE_TTL_S: {raw!r} is not a number of seconds") from None
    if not value > 0:
        raise InputError(f"WINNOW_LEASE_TTL_S: {raw!r} must be > 0")
    return value


@dataclass
class Holder:
    command: str
    host: str
    pid: int
    started_at: str  # ISO-8601 UTC
    token: str
    heartbeat_at: float  # epoch seconds of the last heartbeat (object stores)
    ttl_s: float

    def describe(self) -> str:
        return f"{self.command} on host {self.host}, pid {self.pid}, started {self.started_at}"

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) - self.heartbeat_at > self.ttl_s

    def encode(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    @classmethod
    def decode(cls, data: bytes) -> Holder | None:
        """The holder a lease file names, or None when it names none (empty, released, or not a lease)."""
        try:
            raw = json.loads(data.decode("utf-8"))
            return cls(**{k: raw[k] for k in cls.__dataclass_fields__})
        except (ValueError, UnicodeDecodeError, TypeError, KeyError):
            return None


def _is_local(fs) -> bool:
    p = fs.protocol
    return "file" in ((p,) if isinstance(p, str) else p)


def _is_s3(fs) -> bool:
    p = fs.protocol
    return bool({"s3", "s3a"} & set((p,) if isinstance(p, str) else p))


def _now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def lease_path(folder: str) -> str:
    """The lease of a run folder: a file inside it (`RunFolder.clear` and `entries` leave it aside)."""
    return posixpath.join(folder, LEASE_FILE)


def out_lease_path(out: str) -> str:
    """The lease of a build-sft/report --out folder: a file beside it, since the folder itself is swapped whole."""
    return out.rstrip("/") + ".lease.json"


def held_message(shown: str, holder: Holder, lease: str) -> str:
    """Why the folder `shown` (e.g. "output.path: s3://b/run") cannot be written now: who holds its `lease`."""
    return (f"{shown} is being written by another run: {holder.describe()} (lease {lease}); wait for it to end, or "
            "stop it first")


def _locker(fd: int) -> Holder:
    """Who holds the lock on the local lease file `fd`. A holder writes its name right after it locks, so a reader
    that finds the file still empty (two runs started together) waits up to HOLDER_WRITE_WAIT_S for it."""
    deadline = time.monotonic() + HOLDER_WRITE_WAIT_S
    while True:
        holder = Holder.decode(os.pread(fd, 1 << 16, 0))
        if holder is not None:
            return holder
        if time.monotonic() > deadline:
            return Holder("another process", "?", -1, "?", "", 0, 0)
        time.sleep(0.02)


def holder_of(fs, path: str) -> Holder | None:
    """The live holder of the lease file `path`, or None when nobody holds it (no lease, released, expired, or on a
    local disk a lock that no process holds)."""
    if _is_local(fs):
        import fcntl

        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # a live process holds it
                return _locker(fd)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)
    fs.invalidate_cache(path)
    try:
        holder = Holder.decode(fs.cat_file(path))
    except FileNotFoundError:
        return None
    return None if holder is None or holder.expired() else holder


class Lease:
    """Hold the lease file `path` (of `fs`; see `lease_path`, `out_lease_path`) for `command` while the `with` block
    runs; `acquire` raises InputError naming the live holder, the folder shown as `shown`. `taken_over` says whose
    expired or abandoned lease was taken (for the log)."""

    def __init__(self, fs, path: str, command: str, shown: str):
        self.fs, self.path, self.command, self.shown = fs, path, command, shown
        self.folder = posixpath.dirname(path)
        self.where = fs.unstrip_protocol(path) if not _is_local(fs) else path
        self.local = _is_local(fs)
        self.ttl_s = ttl_seconds()
        self.holder = Holder(command, socket.gethostname(), os.getpid(), _now_iso(), uuid.uuid4().hex, time.time(),
                             self.ttl_s)
        self.taken_over: Holder | None = None
        self.created_folder = False
        self.lost: str | None = None  # why the lease was lost while held (object stores), else None
        self.release_problem: str | None = None  # why `release` could not delete the lease (object stores)
        self._fd: int | None = None
        self._etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def refusal(self, holder: Holder) -> InputError:
        return InputError(held_message(self.shown, holder, self.where))

    # -- acquire -------------------------------------------------------------------------------------------------

    def acquire(self) -> None:
        if self.local:
            self._acquire_local()
        else:
            self._acquire_remote()

    def unwritable(self, err: OSError) -> InputError:
        """The refusal when the lease file cannot be created (the first thing a command writes): the folder is not
        writable, said as bad input naming it."""
        why = {errno.EROFS: "it is on a read-only filesystem", errno.EACCES: "this user may not write there",
               errno.EPERM: "this user may not write there", errno.ENOSPC: "its disk is full",
               errno.EDQUOT: "this user's disk quota is used up"}.get(err.errno, err.strerror or str(err))
        return InputError(f"{self.shown} is not writable: {why} (creating {err.filename or self.path} failed); "
                          "choose a folder on a disk this user can write")

    def _acquire_local(self) -> None:
        import fcntl

        try:
            if not os.path.isdir(self.folder):
                os.makedirs(self.folder, exist_ok=True)
                self.created_folder = True
        except OSError as err:
            raise self.unwritable(err) from None
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise self.unwritable(err) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _locker(fd)
                os.close(fd)
                raise self.refusal(holder) from None
            # The file may have been unlinked by its releasing holder between our open and our lock: then we hold a
            # lock on a file nobody else will open. Retry on the file that is there now.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = Holder.decode(os.pread(fd, 1 << 16, 0))
        if previous is not None:  # a holder that ended without releasing (killed): its lock died with it
            self.taken_over = previous
        os.ftruncate(fd, 0)
        os.pwrite(fd, self.holder.encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def _put(self, **conditions) -> str | None:
        self.holder.heartbeat_at = time.time()
        out = self.fs.pipe_file(self.path, self.holder.encode(), **conditions)
        return out.get("ETag") if isinstance(out, dict) else None

    def _acquire_remote(self) -> None:
        try:
            self._etag = self._put(mode="create")
        except FileExistsError:
            self._take_over()
        self._thread = threading.Thread(target=self._beat, name="winnow-lease-heartbeat", daemon=True)
        self._thread.start()

    def _ours(self) -> bool:
        """Whether the lease object is the very one this run last tried to write (same token and heartbeat): a
        retried conditional write whose first attempt landed is answered 412 though the write is ours. If so, its
        ETag is taken."""
        self.fs.invalidate_cache(self.path)
        etag = self.fs.info(self.path).get("ETag")
        holder = Holder.decode(self.fs.cat_file(self.path))
        if holder is not None and (holder.token, holder.heartbeat_at) == (self.holder.token, self.holder.heartbeat_at):
            self._etag = etag
            return True
        return False

    def _take_over(self) -> None:
        if self._ours():
            return
        self.fs.invalidate_cache(self.path)
        etag = self.fs.info(self.path).get("ETag")
        current = Holder.decode(self.fs.cat_file(self.path))
        if current is not None and not current.expired():
            raise self.refusal(current)
        if not _is_s3(self.fs):
            raise InputError(
                f"{self.where}: a lease left by a run that did not end cleanly"
                + (f" ({current.describe()})" if current else "")
                + "; this store has no conditional writes to take it over safely: once sure that run is gone, "
                "delete the file and run again"
            )
        try:
            self._etag = self._put(IfMatch=etag)
        except OSError as err:  # 412: another run took it over first, or our own retried write landed
            if self._ours():
                self.taken_over = current
                return
            holder = Holder.decode(self.fs.cat_file(self.path))
            if holder is not None and holder.token != self.holder.token:
                raise self.refusal(holder) from None
            raise InputError(f"{self.where}: cannot take over the expired lease ({err})") from None
        self.taken_over = current

    def _beat(self) -> None:
        """Rewrite the lease every ttl/4 s, only if it is still the one this run wrote."""
        last_ok = time.time()
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self._etag = self._put(IfMatch=self._etag)
                last_ok = time.time()
            except Exception as err:  # noqa: BLE001 - not only OSError: s3fs passes on botocore's ConnectionClosedError
                try:
                    if self._ours():  # the renewal landed; its retry was answered 412
                        last_ok = time.time()
                        continue
                    holder = Holder.decode(self.fs.cat_file(self.path))
                except Exception:  # noqa: BLE001 - the store is unreachable: decided by last_ok below
                    holder = None
                if holder is not None and holder.token != self.holder.token:
                    self.lost = f"the lease was taken over by {holder.describe()}"
                    return
                if time.time() - last_ok > self.ttl_s:
                    self.lost = f"the lease could not be renewed for {self.ttl_s:g} s ({err})"

    # -- release -------------------------------------------------------------------------------------------------

    def release(self) -> None:
        """Give the folder back: delete the lease file (a folder this lease created and left empty goes too)."""
        if self.local:
            if self._fd is None:
                return
            import fcntl

            try:
                os.unlink(self.path)  # while still locked: nobody can take a lease that is being deleted
            except FileNotFoundError:
                pass
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
            if self.created_folder:
                try:
                    os.rmdir(self.folder)  # only when empty: nothing was written
                except OSError as err:
                    if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                        raise
            return
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self.lost is None:
            try:
                self.fs.invalidate_cache(self.path)
                holder = Holder.decode(self.fs.cat_file(self.path))
                if holder is not None and holder.token == self.holder.token:
                    self.fs.rm_file(self.path)
            except Exception as err:  # noqa: BLE001 - the store is unreachable: the lease expires after ttl_s on its own
                self.release_problem = (f"could not delete the lease {self.where} ({err}); it expires "
                                        f"{self.ttl_s:g} s after its last heartbeat")
