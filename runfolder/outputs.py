"""Output folders of `winnow build-sft` and `winnow report`, local or any fsspec URL: taken with a lease, refused
when they are or hold or sit inside an input or hold something (unless --overwrite), and written to a temporary
sibling that is swapped into place at the end, so a failure leaves no half-written folder.

A command replaces only what a Winnow command wrote: every output folder ends with its record, `OUTPUT_RECORD`
(the command and every file it wrote), and --overwrite replaces a folder only when each file in it is in its
record. A folder with anything else in it (a user's notes, a source tree with .git/, an output written before the
record existed) is refused with what it holds named, even with --overwrite, and nothing is deleted.

The order is what makes one writer at a time true: `check_out` first compares paths (an --out that is, holds or sits
inside an input is refused before anything is written, its lease file included), then takes the folder's lease
(`runfolder.lease.out_lease_path`, beside it), and only then looks at what the folder holds; the lease stays held
(for `staged_out`) until `release_out`. A second writer aimed at the same folder meanwhile is refused by the lease,
and one that comes after sees the first one's files. With the lease held, what killed writers left beside the
folder (``OUT.tmp-*`` and ``OUT.old-*`` of local swaps, ``OUT.swap-*`` marks of object-store swaps) is finished or
removed: only a lease holder creates them, so whoever holds the lease knows that their writer is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

from runfolder.folder import holds_run_folder, refresh, store
from runfolder.lease import Lease, out_lease_path
from runfolder.paths import local_write_problem, location_key, overlap_problem
from schemas.base import InputError
from stores.filesystems import store_problem

_HELD: dict[str, Lease] = {}  # --out leases taken by `check_out` in this process, by location_key
OUTPUT_RECORD = ".winnow-output.json"  # in an output folder: {"command": ..., "files": [relative paths]}


def foreign_files(fs, path: str) -> list[str]:
    """The files under the output folder `path` that no Winnow command recorded writing (`OUTPUT_RECORD`), relative
    to it: every file when the folder has no record (or one that does not parse)."""
    files = sorted(p[len(path.rstrip("/")) + 1:] for p in fs.find(path, withdirs=False))
    recorded: set[str] = set()
    if OUTPUT_RECORD in files:
        try:
            with fs.open(posixpath.join(path, OUTPUT_RECORD), "rb") as f:
                record = json.loads(f.read().decode("utf-8"))
            recorded = {str(p) for p in record["files"]} | {OUTPUT_RECORD}
        except (ValueError, UnicodeDecodeError, KeyError, TypeError):
            recorded = set()
    return [f for f in files if f not in recorded]


def _named(paths: list[str], most: int = 8) -> str:
    return ", ".join(paths[:most]) + (f" and {len(paths) - most} more" if len(paths) > most else "")


def check_out(uri: str, overwrite: bool, inputs: Iterable[str] = (), command: str = "winnow") -> list[str]:
    """Claim the output folder `uri` for `command`: InputError when it is, holds or sits inside one of `inputs` (run
    folders the command reads), when another process holds its lease, when it is a file, or when it holds anything
    and not `overwrite`; a folder that holds a Winnow run folder is never replaced, even with `overwrite`. On
    success the lease stays held for `staged_out` until `release_out`; returns one line per leftover of a killed
    writer that was finished or removed (`clean_leftovers`)."""
    shown = f"--out {uri}"
    problems = [p for other in inputs if (p := overlap_problem(shown, uri, "input run", other))]
    if problems:
        raise InputError(problems)
    fs, path = store(uri, shown)
    problem = store_problem(fs, path)  # no credentials, an endpoint that does not answer, no bucket: said at once
    if problem:
        raise InputError(f"{shown}: {problem}")
    unwritable = local_write_problem(path, shown) if isinstance(fs, LocalFileSystem) else None
    if unwritable:
        raise InputError(unwritable)
    key = location_key(uri)
    lease = _HELD.pop(key, None)
    if lease is None:
        lease = Lease(fs, out_lease_path(path), command, shown)
        lease.acquire()  # InputError naming the holder when another writer has it
    try:
        notes = clean_leftovers(fs, path)
        refresh(fs, path)
        if fs.isfile(path):
            raise InputError(f"{uri}: --out exists and is a file, not a folder")
        if fs.isdir(path) and fs.find(path):
            run = holds_run_folder(fs, path)
            if run is not None:
                raise InputError(f"{shown} holds a Winnow run folder ({run}); refusing to replace it even with "
                                 "--overwrite; choose another output folder")
            foreign = foreign_files(fs, path)
            if foreign:
                raise InputError(f"{uri}: --out holds files that no Winnow command wrote there ({_named(foreign)}); "
                                 "a command replaces only a folder it wrote and deletes nothing else, even with "
                                 "--overwrite: choose a new or empty --out, or move these files away")
            if not overwrite:
                raise InputError(f"{uri}: --out holds an earlier output ({_recorded_by(fs, path)}); pass "
                                 "--overwrite to replace it, or choose another --out")
    except BaseException:
        lease.release()
        raise
    _HELD[key] = lease
    return notes


def _recorded_by(fs, path: str) -> str:
    try:
        with fs.open(posixpath.join(path, OUTPUT_RECORD), "rb") as f:
            return f"written by {json.loads(f.read().decode('utf-8'))['command']}"
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError):
        return "written by a Winnow command"


def release_out(uri: str | None = None) -> None:
    """Give back the lease `check_out` took on `uri` (every one this process holds when None)."""
    keys = list(_HELD) if uri is None else [location_key(uri)]
    for key in keys:
        lease = _HELD.pop(key, None)
        if lease is not None:
            lease.release()


@contextlib.contextmanager
def staged_out(uri: str, command: str) -> Iterator[tuple[fsspec.AbstractFileSystem, str]]:
    """Yield (fs, temporary folder) beside ``uri``; on success record what was written there (`OUTPUT_RECORD`) and
    put its files at ``uri``, replacing what is there (`check_out` has made sure that only a Winnow output is).
    `command` holds the folder's lease (`runfolder.lease.out_lease_path`) meanwhile: the one `check_out` took, else
    its own; either way it is given back at the end.

    On an exception the temporary folder is removed and ``uri`` is left as it was. On a local disk the swap is two
    renames (the old folder is moved aside first and deleted last), so an interruption leaves the old or the new
    folder, and the next writer finishes the swap (`clean_leftovers`). Object stores (S3) have no rename: there a
    mark (``OUT.swap-*``) is written, the old files are deleted and the new ones copied object by object; a writer
    killed meanwhile leaves the mark and the whole temporary folder, and the next writer copies it again.
    """
    fs, path = store(uri, f"--out {uri}")
    lease = _HELD.pop(location_key(uri), None)
    if lease is None:
        lease = Lease(fs, out_lease_path(path), command, f"--out {uri}")
        lease.acquire()  # one writer: a second one gets InputError
        try:
            clean_leftovers(fs, path)
        except BaseException:
            lease.release()
            raise
    token = uuid.uuid4().hex[:12]
    tmp = f"{path}.tmp-{token}"
    try:
        try:
            fs.makedirs(tmp, exist_ok=True)
            yield fs, tmp
            files = sorted(p[len(tmp) + 1:] for p in fs.find(tmp, withdirs=False))
            write_bytes(fs, posixpath.join(tmp, OUTPUT_RECORD),
                        json.dumps({"command": command, "files": files}, indent=1).encode("utf-8"))
        except BaseException:
            if fs.exists(tmp):
                fs.rm(tmp, recursive=True)
            raise
        _swap(fs, tmp, path, token)  # cut short, it leaves what the next writer finishes (`clean_leftovers`)
        if fs.exists(tmp):
            fs.rm(tmp, recursive=True)
    finally:
        lease.release()


def _swap(fs, tmp: str, path: str, token: str) -> None:
    if isinstance(fs, LocalFileSystem):
        old = f"{path}.old-{token}"
        had_old = os.path.lexists(path)
        if had_old:
            os.rename(path, old)
        os.rename(tmp, path)
        if had_old:
            shutil.rmtree(old)
        return
    mark = f"{path}.swap-{token}"
    fs.pipe_file(mark, b"")
    _copy_over(fs, tmp, path)
    fs.rm_file(mark)


def _copy_over(fs, tmp: str, path: str) -> None:
    """Replace the object-store folder `path` by a copy of `tmp`."""
    if fs.exists(path):
        fs.rm(path, recursive=True)
    for src in fs.find(tmp):
        fs.copy(src, path + src[len(tmp):])


_LEFTOVER = re.compile(r"\.(tmp|old|swap)-([0-9a-f]{12})$")


def clean_leftovers(fs, path: str) -> list[str]:
    """Finish or remove what writers of the output folder `path` that were killed left beside it; one line per
    thing done. Call only while holding the folder's lease (then no writer of them is alive).

    - ``OUT.old-T`` (local: killed mid-swap): with ``OUT`` in place the swap had finished, so it is deleted; without
      it, ``OUT.tmp-T`` (whole: a swap starts after the last file was written) is renamed into place, or else
      ``OUT.old-T`` is put back.
    - ``OUT.swap-T`` (object stores: killed mid-copy): ``OUT.tmp-T`` is copied over ``OUT`` again.
    - ``OUT.tmp-T`` left alone (killed while writing): deleted.
    """
    parent, base = posixpath.split(path)
    refresh(fs, parent)
    try:
        siblings = fs.ls(parent or ".", detail=False)
    except FileNotFoundError:
        return []
    found: dict[str, dict[str, str]] = {}
    for p in siblings:
        name = posixpath.basename(p.rstrip("/"))
        m = _LEFTOVER.search(name)
        if m and name[: m.start()] == base:
            found.setdefault(m.group(2), {})[m.group(1)] = p.rstrip("/")
    lines = []
    for token, parts in sorted(found.items()):
        tmp, old, mark = parts.get("tmp"), parts.get("old"), parts.get("swap")
        if old is not None:
            if fs.exists(path):
                fs.rm(old, recursive=True)
                lines.append(f"removed {old}, the old folder of a replacement that was killed after it was done")
            elif tmp is not None:
                fs.mv(tmp, path, recursive=True)
                fs.rm(old, recursive=True)
                tmp = None
                lines.append(f"finished replacing {path} (a writer was killed mid-swap): moved {parts['tmp']} in")
            else:
                fs.mv(old, path, recursive=True)
                lines.append(f"put back {path} from {old} (a writer was killed mid-swap)")
        elif mark is not None and tmp is not None:
            _copy_over(fs, tmp, path)
            lines.append(f"finished replacing {path} (a writer was killed mid-copy): copied {tmp} in again")
        if mark is not None:
            fs.rm_file(mark)
        if tmp is not None:
            fs.rm(tmp, recursive=True)
            if old is None and mark is None:
                lines.append(f"removed {tmp}, left by a writer that was killed before it finished")
    if lines:
        refresh(fs, parent)
    return lines


def write_bytes(fs, path: str, data: bytes) -> None:
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    with fs.open(path, "wb") as f:
        f.write(data)
