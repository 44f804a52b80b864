"""Where `data.source` points: a local file or folder, a datasets folder, s3://, or a bundled asset (`Source`),
resolved once on the driver."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from pathlib import Path

import fsspec

import assets
from schemas.base import InputError
from stores.filesystems import filesystem, store_problem


# file extension -> Ray Data reader
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

@dataclass(frozen=True)
class Source:
    """A resolved `data.source`: its reader and the files (or folder) it reads."""

    spec: str  # as written in the config
    kind: str  # json | parquet | csv | hf_disk
    paths: list[str]  # files for json/parquet/csv (with their protocol), the folder for hf_disk
    fs: fsspec.AbstractFileSystem
    # JSON only: "arrow" (pyarrow's reader, which types each column from its first values) or "python" (line by
    # line, for files every line of which is a JSON object but whose columns mix types, e.g. integer and string
    # ids, which pyarrow refuses; and for one-document .json arrays). `check_source` decides.
    reader: str = "arrow"
    why_python: str | None = None
    columns: tuple[str, ...] | None = None  # "python" reader: the columns its files' rows hold (None: not read)

    @property
    def local(self) -> bool:
        return "file" in _protocols(self.fs)


def _protocols(fs) -> tuple:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def source_location(spec: str) -> str:
    """`data.source` as a path or URL: builtin:NAME -> the bundled folder; anything else as given."""
    return _location(spec)


def _location(spec: str) -> str:
    """builtin:NAME -> the bundled folder; anything else as given (a local path or a URL)."""
    try:
        return assets.resolve(spec)
    except KeyError as err:
        raise InputError(f"data.source: {err.args[0]}") from None


def _with_protocol(fs, path: str) -> str:
    return path if "file" in _protocols(fs) else fs.unstrip_protocol(path)


def resolve_source(spec: str) -> Source:
    """Find what `data.source` names and how to read it; InputError naming the path when it cannot be read."""
    where = _location(spec)
    try:
        fs, root = filesystem(where)
        unusable = store_problem(fs, root)  # S3 without credentials, an endpoint that does not answer, no bucket
        if unusable:
            raise InputError(f"data.source: {spec}: {unusable}")
        if fs.isfile(root):
            ext = Path(root).suffix.lower()
            if ext not in FORMATS:
                raise InputError(
                    f"data.source: {spec}: unsupported file type {ext or '(none)'!r}; expected one of "
                    f"{', '.join(FORMATS)}"
                )
            return Source(spec, FORMATS[ext], [_with_protocol(fs, root)], fs)
        if not fs.isdir(root):
            raise InputError(f"data.source: {spec}: no such file or folder")
        names = {posixpath.basename(p) for p in fs.ls(root, detail=False)}
        if "dataset_dict.json" in names:
            raise InputError(
                f"data.source: {spec}: a datasets DatasetDict with several splits; point data.source at one "
                f"split's folder (e.g. {spec.rstrip('/')}/train)"
            )
        if {"state.json", "dataset_info.json"} <= names:
            return Source(spec, "hf_disk", [_with_protocol(fs, root)], fs)
        files = sorted(
            p for p in fs.find(root)
            if not any(part.startswith((".", "_")) for part in posixpath.relpath(p, root).split("/"))
            and Path(p).suffix.lower() in FORMATS
        )
    except InputError:
        raise
    except (OSError, ValueError, ImportError) as err:
        raise InputError(f"data.source: {spec}: cannot be read: {err}") from None
    if not files:
        raise InputError(
            f"data.source: {spec}: the folder holds no {', '.join(FORMATS)} files and is not a "
            "datasets.save_to_disk folder"
        )
    kinds = sorted({FORMATS[Path(p).suffix.lower()] for p in files})
    if len(kinds) > 1:
        raise InputError(f"data.source: {spec}: the folder mixes file types ({', '.join(kinds)}); keep one type")
    return Source(spec, kinds[0], [_with_protocol(fs, p) for p in files], fs)


