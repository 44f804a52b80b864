"""Every file Winnow reads or writes goes through one place: `filesystem(uri)`, the fsspec filesystem of a local path
or URL (s3://, gs://, memory://, ...), with the store's options (e.g. S3 retries) set once.

S3 (s3fs) retries transient faults (503 SlowDown / ServiceUnavailable, throttling, 500/502/504, dropped or reset
connections, a response cut off mid-body) with backoff, at two levels:

- botocore retries each request in its ``standard`` mode (`config_kwargs={"retries": {"total_max_attempts": N,
  "mode": "standard"}}`; botocore's ``max_attempts`` would count retries, ``total_max_attempts`` counts attempts):
  exponential backoff with jitter (``rand() * min(2 ** (attempt - 1), 20)`` seconds before retry ``attempt``) and a
  retry quota per client (500 tokens, 5 per retry, 10 per timeout, paid back by successes) that stops retrying
  when most requests fail;
- s3fs retries a call that botocore gave up on with a dropped connection or SlowDown, and a read whose body broke off
  mid-transfer (which botocore never sees), up to N attempts with its own short backoff (0.1 s x 1.7^i).

N is ``WINNOW_S3_MAX_ATTEMPTS`` (default 5; 1 turns both levels' retries off), read when `filesystem` is called. A
dropped connection or SlowDown can so be tried up to N x N times per call (botocore's N inside each of s3fs's N); a
503 ServiceUnavailable N times. A sustained outage therefore fails a run rather than stalling it; with the default N,
on a 2-core machine (the outage of tests/test_s3_faults.py), about 15 s after the store went down when it answers
503, about 2 minutes when it drops every connection.

The options are constructor arguments of the filesystem, so they travel with it when it is pickled to Ray workers
(the run folder's filesystem is shipped to Ray Data's tasks inside a pyarrow ``PyFileSystem(FSSpecHandler(fs))``), and
``fs.storage_options`` stays valid for a plain ``s3fs.S3FileSystem`` (datasets' ``storage_options=``). S3
filesystems share s3fs's instance cache, so ``s3fs.S3FileSystem.clear_instance_cache()`` forgets them too.
"""

from __future__ import annotations

import os

import fsspec

ENV_MAX_ATTEMPTS = "WINNOW_S3_MAX_ATTEMPTS"
DEFAULT_MAX_ATTEMPTS = 5
RETRY_MODE = "standard"
S3_PROTOCOLS = ("s3", "s3a")


def max_attempts() -> int:
    """Attempts per S3 request (and per s3fs call): ``WINNOW_S3_MAX_ATTEMPTS``, else `DEFAULT_MAX_ATTEMPTS`."""
    raw = os.environ.get(ENV_MAX_ATTEMPTS, "").strip()
    if not raw:
        return DEFAULT_MAX_ATTEMPTS
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_MAX_ATTEMPTS}={raw!r}: expected a whole number of attempts >= 1") from None
    if value < 1:
        raise ValueError(f"{ENV_MAX_ATTEMPTS}={raw!r}: expected a whole number of attempts >= 1")
    return value


def s3_options(attempts: int | None = None) -> dict:
    """The storage options Winnow gives every S3 filesystem (plain data: they pickle and tokenize)."""
    n = max_attempts() if attempts is None else attempts
    return {"config_kwargs": {"retries": {"total_max_attempts": n, "mode": RETRY_MODE}}}


_S3_CLASS = None


def _s3_class():
    """`s3fs.S3FileSystem` whose own call retries (``retries``, a class attribute in s3fs) follow botocore's
    ``total_max_attempts`` from ``config_kwargs``, so that they are set per instance and survive pickling. Created on
    first use: s3fs is only needed where an s3:// path is."""
    global _S3_CLASS
    if _S3_CLASS is None:
        import s3fs

        class RetryingS3FileSystem(s3fs.S3FileSystem):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                retries = (self.config_kwargs.get("retries") or {}).get("total_max_attempts")
                if retries:
                    self.retries = int(retries)

        RetryingS3FileSystem.__module__ = __name__
        RetryingS3FileSystem.__qualname__ = "RetryingS3FileSystem"
        # One instance cache with s3fs: tests (and users) clear it with s3fs.S3FileSystem.clear_instance_cache().
        RetryingS3FileSystem._cache = s3fs.S3FileSystem._cache
        globals()["RetryingS3FileSystem"] = RetryingS3FileSystem  # pickled by reference: stores.filesystems.<name>
        _S3_CLASS = RetryingS3FileSystem
    return _S3_CLASS


def __getattr__(name: str):  # the class on import by name (unpickling on a Ray worker), without importing s3fs early
    if name == "RetryingS3FileSystem":
        return _s3_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of a URL or local path, and the path inside it (no trailing slash)."""
    protocol, _ = fsspec.core.split_protocol(uri)
    if protocol in S3_PROTOCOLS:
        cls = _s3_class()
        fs = cls(**s3_options(), **cls._get_kwargs_from_urls(uri))
        path = fs._strip_protocol(uri)
    else:
        fs, path = fsspec.core.url_to_fs(uri)
    return fs, path.rstrip("/") or path


def missing_bucket(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """The bucket of `path` when `fs` is an S3 filesystem and the bucket does not exist (or these credentials cannot
    see it: S3 answers both with 404 to a HEAD of the bucket), else None. Other stores have no buckets to check."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if not set(protocols) & set(S3_PROTOCOLS):
        return None
    bucket = path.split("/", 1)[0]
    return None if not bucket or fs.exists(bucket) else bucket


def bucket_message(bucket: str) -> str:
    """The rest of a message for a `missing_bucket`, with the fix."""
    return (f"the bucket {bucket!r} does not exist (or these credentials cannot see it); check its name and region, "
            f"or create it first (aws s3 mb s3://{bucket})")
