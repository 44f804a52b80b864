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

Those retries are for a flaky S3, not for an absent one. Before a command reads or writes anything it asks each S3
location once (`store_problem`: one listing of the path's prefix, on a client of its own with a short connect
timeout and botocore's retries off): missing credentials, an endpoint that cannot be reached (a closed port, no
network, a name that does not resolve), a bucket that does not exist and a refusal (403) are answered at once, as
bad input naming the path, the cause and the fix. Only answers a flaky store gives (5xx, throttling, a connection
dropped or cut mid-answer) are asked again, up to N times.

The options are constructor arguments of the filesystem, so they travel with it when it is pickled to Ray workers
(the run folder's filesystem is shipped to Ray Data's tasks inside a pyarrow ``PyFileSystem(FSSpecHandler(fs))``), and
``fs.storage_options`` stays valid for a plain ``s3fs.S3FileSystem`` (datasets' ``storage_options=``). S3
filesystems share s3fs's instance cache, so ``s3fs.S3FileSystem.clear_instance_cache()`` forgets them too.
"""

from __future__ import annotations

import os
import shlex
import time
from urllib.parse import urlsplit

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


def bucket_message(bucket: str) -> str:
    """The rest of a message for a bucket that does not exist (`store_problem`), with the fix."""
    return (f"the bucket {bucket!r} does not exist (or these credentials cannot see it); check its name and region, "
            f"or create it first ({shlex.join(['aws', 's3', 'mb', 's3://' + bucket])})")


PROBE_CONNECT_TIMEOUT_S = 5.0  # an endpoint that answers at all accepts a connection well within this
PROBE_READ_TIMEOUT_S = 20.0
ABSENT_MEMO_S = 60.0  # how long a bucket found unreachable or without credentials is answered from memory
_ABSENT: dict[tuple, tuple[float, str]] = {}  # (bucket, options, AWS_* settings) -> (when, why)
CREDENTIALS_FIX = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or run where an instance or pod "
                   "role gives them")


def is_s3(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return bool(set(protocols) & set(S3_PROTOCOLS))


def store_problem(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """Why the S3 location `path` of `fs` cannot be used from here, as the rest of a one-line message with the fix
    (missing or refused credentials, an endpoint that cannot be reached, a missing bucket, a refused listing); None
    when it can, and for every other store.

    One listing of the path's prefix (at most one key), on a client of its own: botocore's retries off, a connect
    timeout of PROBE_CONNECT_TIMEOUT_S. An answer that a flaky store gives (5xx, throttling, a dropped or cut
    connection) is asked again, up to `max_attempts()` times with a short backoff; every other answer is final at
    once, so an absent store is said within seconds."""
    if not is_s3(fs):
        return None
    bucket, _, prefix = path.strip("/").partition("/")
    if not bucket:
        return None
    options = dict(fs.storage_options)
    key = (bucket, repr(sorted(options.items())), tuple(sorted((k, v) for k, v in os.environ.items()
                                                              if k.startswith("AWS_"))))
    said = _ABSENT.get(key)
    if said is not None and time.monotonic() - said[0] < ABSENT_MEMO_S:
        return said[1]
    config = dict(options.get("config_kwargs") or {})
    config.update(retries={"total_max_attempts": 1, "mode": RETRY_MODE}, connect_timeout=PROBE_CONNECT_TIMEOUT_S,
                  read_timeout=PROBE_READ_TIMEOUT_S)
    options["config_kwargs"] = config
    options["skip_instance_cache"] = True
    attempts = max_attempts()
    for attempt in range(attempts):
        probe = None
        try:
            probe = _s3_class()(**options)
            probe.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1)
            return None
        except Exception as err:  # noqa: BLE001 - classified below; what is not a store's answer is raised again
            why, transient = _store_answer(err, bucket, _endpoint(probe, err))
            absent = _is_absent(err)
        if absent:  # the next location in this bucket is answered from here, not after another timeout
            _ABSENT[key] = (time.monotonic(), why)
        if not transient or attempt == attempts - 1:
            return why
        time.sleep(min(0.2 * 2 ** attempt, 2.0))
    return None


def _endpoint(probe, err: Exception) -> str:
    """The endpoint a probe asked, as scheme://host[:port]: the failed request's, else the client's, else the
    environment's."""
    url = getattr(err, "kwargs", {}).get("endpoint_url") if isinstance(getattr(err, "kwargs", None), dict) else None
    if not url:
        url = getattr(getattr(getattr(probe, "s3", None), "meta", None), "endpoint_url", None)
    url = url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if not url:
        return "S3's endpoint"
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.netloc else url


def _is_absent(err: Exception) -> bool:
    """Whether `err` says that no store can be asked at all (no credentials, an endpoint that cannot be reached),
    whatever the path: the same answer holds for every location of the bucket."""
    from botocore import exceptions as bx

    return isinstance(err, (bx.NoCredentialsError, bx.PartialCredentialsError, bx.CredentialRetrievalError,
                            bx.ConnectionError))


def _store_answer(err: Exception, bucket: str, endpoint: str) -> tuple[str, bool]:
    """(what `err` says about the store, with the fix; whether a flaky store gives it and it is worth asking
    again). An exception that is no answer of a store (a bug) is raised again."""
    from botocore import exceptions as bx
    from fsspec.exceptions import FSTimeoutError

    cause = err.__cause__ if isinstance(err.__cause__, bx.ClientError) else err  # s3fs wraps ClientError in OSError
    if isinstance(cause, bx.ClientError):
        answer = cause.response.get("Error", {})
        code = str(answer.get("Code") or "")
        status = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        said = f"{status} {code}".strip() if code != str(status) else str(status)
        if code == "NoSuchBucket":
            return bucket_message(bucket), False
        if status == 404:  # S3 names a missing bucket: a bare 404 comes from something else at that address
            return (f"{endpoint} answered 404 to a listing of s3://{bucket} without S3's NoSuchBucket, so it is "
                    "perhaps not an S3 endpoint; check AWS_ENDPOINT_URL and the bucket's name"), False
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                    "TokenRefreshRequired", "UnrecognizedClientException"):
            return f"{endpoint} refused these AWS credentials ({said}); {CREDENTIALS_FIX}", False
        if status == 403 or code == "AccessDenied":
            return (f"{endpoint} denied these credentials a listing of s3://{bucket} ({said}); grant them "
                    "s3:ListBucket on it (and the object reads and writes the command needs), or use credentials "
                    "that have it"), False
        if (isinstance(status, int) and status >= 500) or code in ("SlowDown", "Throttling", "ThrottlingException",
                                                                    "RequestTimeout", "ServiceUnavailable"):
            return (f"{endpoint} answers {said} (the store is failing or overloaded); try again once it answers"), True
        message = " ".join(str(answer.get("Message") or "").split())
        return (f"{endpoint} refused the request ({said}{': ' + message if message else ''}); check the bucket's name "
                "and region (AWS_DEFAULT_REGION)"), False
    if isinstance(err, (bx.NoCredentialsError, bx.PartialCredentialsError, bx.CredentialRetrievalError,
                        bx.NoAuthTokenError, bx.TokenRetrievalError)):
        return f"no usable AWS credentials were found ({type(err).__name__}); {CREDENTIALS_FIX}", False
    if isinstance(err, bx.ConnectionError):  # refused, unresolvable name, no route, connect timeout, proxy
        return (f"cannot reach the S3 endpoint {endpoint} ({type(err).__name__}); check AWS_ENDPOINT_URL (or the "
                "network) and that the store is up"), False
    if isinstance(err, (bx.HTTPClientError, bx.ResponseParserError, FSTimeoutError, TimeoutError)):
        return (f"the S3 endpoint {endpoint} does not answer ({type(err).__name__}); check that the store is up, and "
                "try again"), True
    if isinstance(err, bx.BotoCoreError):  # a bad setting botocore names itself (a region, an endpoint's form)
        return f"S3 cannot be asked from here ({type(err).__name__}: {err}); check the AWS_* settings", False
    if isinstance(err, ValueError) and "endpoint" in str(err).lower():  # botocore: "Invalid endpoint: ..."
        return f"{err}; check AWS_ENDPOINT_URL", False
    raise err
