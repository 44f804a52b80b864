"""Output folders of `winnow build-sft` and `winnow report`, local or any fsspec URL: refused when they hold
something unless --overwrite, and written to a temporary sibling that is swapped into place at the end, so a failure
leaves no half-written folder."""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import uuid
from collections.abc import Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

from runfolder.folder import store
from runfolder.lease import Lease, held_message, holder_of, out_lease_path
from schemas.base import InputError


def check_out(uri: str, overwrite: bool) -> None:
    """Refuse (InputError) an --out that exists and is not empty unless overwrite, or that is a file."""
    fs, path = store(uri, f"--out {uri}")
    if fs.isfile(path):
        raise InputError(f"{uri}: --out exists and is a file, not a folder")
    holder = holder_of(fs, out_lease_path(path))
    if holder is not None:
        raise InputError(held_message(f"--out {uri}", holder, out_lease_path(uri)))
    if fs.isdir(path) and fs.find(path) and not overwrite:
        raise InputError(f"{uri}: --out exists and is not empty; pass --overwrite to replace it")


@contextlib.contextmanager
def staged_out(uri: str, command: str) -> Iterator[tuple[fsspec.AbstractFileSystem, str]]:
    """Yield (fs, temporary folder) beside ``uri``; on success put its files at ``uri``, replacing what is there.
    `command` holds the folder's lease (`runfolder.lease.out_lease_path`) meanwhile: one writer at a time.

    On an exception the temporary folder is removed and ``uri`` is left as it was. On a local disk the swap is two
    renames (the old folder is moved aside first and deleted last), so an interruption leaves the old or the new
    folder. Object stores (S3) have no rename: there the old files are deleted and the new ones copied object by
    object, which is not atomic, but nothing is touched until every file was written to the temporary folder.
    """
    fs, path = store(uri, f"--out {uri}")
    token = uuid.uuid4().hex[:12]
    tmp = f"{path}.tmp-{token}"
    with Lease(fs, out_lease_path(path), command, f"--out {uri}"):  # one writer: a second one gets InputError
        try:
            fs.makedirs(tmp, exist_ok=True)
            yield fs, tmp
            _swap(fs, tmp, path, token)
        finally:
            if fs.exists(tmp):
                fs.rm(tmp, recursive=True)


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
    if fs.exists(path):
        fs.rm(path, recursive=True)
    for src in fs.find(tmp):
        dst = path + src[len(tmp):]
        fs.copy(src, dst)


def write_bytes(fs, path: str, data: bytes) -> None:
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    with fs.open(path, "wb") as f:
        f.write(data)
