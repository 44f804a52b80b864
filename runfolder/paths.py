"""Whether two folders given by the user are one, or one holds the other: local paths and URLs compared in one
normal form, so that no command writes into, or clears, a folder it reads.

`location_key` spells a folder one way: a local path absolute with its symbolic links resolved (``runs/a``,
``runs/a/``, ``./runs/a`` and a link to it are one folder), a URL as its filesystem spells it with the protocol
(``s3a://b/x/`` and ``s3://b/x`` are one prefix). `relation` compares two keys by whole path components, so
``runs/a`` neither holds nor sits inside ``runs/ab``.
"""

from __future__ import annotations

import os

from schemas.base import InputError
from stores.filesystems import filesystem

SAME, INSIDE, HOLDS = "same", "inside", "holds"


def location_key(uri: str) -> str:
    """One spelling per folder: ``file://`` plus the real absolute path for a local path, else the URL."""
    if "://" not in uri or uri.startswith("file://"):
        local = uri[len("file://"):] if uri.startswith("file://") else uri
        return "file://" + os.path.realpath(os.path.expanduser(local)).rstrip("/")
    try:
        fs, path = filesystem(uri)
    except ValueError as err:  # a bad store setting, e.g. WINNOW_S3_MAX_ATTEMPTS
        raise InputError(f"{uri}: {err}") from None
    return fs.unstrip_protocol(path.rstrip("/"))


def relation(a: str, b: str) -> str | None:
    """How folder `a` stands to folder `b` (both as given: paths or URLs): SAME, INSIDE (a is under b), HOLDS (b is
    under a), or None when they are apart."""
    ka, kb = location_key(a), location_key(b)
    if ka == kb:
        return SAME
    if ka.startswith(kb.rstrip("/") + "/"):
        return INSIDE
    if kb.startswith(ka.rstrip("/") + "/"):
        return HOLDS
    return None


def overlap_problem(shown: str, out: str, role: str, other: str) -> str | None:
    """A message when the output folder `out` (shown as `shown`, e.g. "--out reports/a") is, holds or sits inside
    the input `other` (`role`, e.g. "input run"), else None."""
    how = relation(out, other)
    if how is None:
        return None
    what = {SAME: f"is the {role} {other}", INSIDE: f"is inside the {role} {other}",
            HOLDS: f"holds the {role} {other}"}[how]
    return (f"{shown} {what}; a command never writes into or replaces its own input, so choose an output folder "
            "apart from it")


def local_write_problem(path: str, shown: str) -> str | None:
    """Why the local folder `path` (shown as `shown`, e.g. "--out reports/a") cannot be created or written into: a
    file where a parent folder should be, a read-only filesystem, or no write permission on the folder or on its
    nearest existing parent; None when it can. Checked from the filesystem's flags and permissions, writing
    nothing (root passes every permission, but not a read-only mount)."""
    path = os.path.abspath(os.path.expanduser(path))
    nearest = path
    while not os.path.lexists(nearest):
        parent = os.path.dirname(nearest)
        if parent == nearest:
            break
        nearest = parent
    if nearest != path and not os.path.isdir(nearest):
        return f"{shown} cannot be created: {nearest} is a file, not a folder"
    what = "the folder" if nearest == path else f"its nearest existing parent {nearest}"
    try:
        read_only = bool(os.statvfs(nearest).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return (f"{shown} is not writable: {what} is on a read-only filesystem; choose a folder on a writable "
                "disk")
    if not os.access(nearest, os.W_OK | os.X_OK):
        return f"{shown} is not writable: {what} does not permit this user to write into it"
    return None
