"""Every file Winnow reads or writes goes through one place: `filesystem(uri)`, the fsspec filesystem of a local path
or URL (s3://, gs://, memory://, ...), with the store's options (e.g. S3 retries) set once."""

from __future__ import annotations

import fsspec


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of a URL or local path, and the path inside it (no trailing slash)."""
    fs, path = fsspec.core.url_to_fs(uri)
    return fs, path.rstrip("/") or path
