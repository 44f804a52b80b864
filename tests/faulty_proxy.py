"""A fault-injecting HTTP proxy for S3 tests: point ``AWS_ENDPOINT_URL`` at it and it forwards to a real endpoint
(the moto server of `conftest_runs.s3_endpoint`), failing a fraction of the requests on the way. Standard library
only.

    with FaultyProxy(upstream, read_fault=0.2, write_fault=0.2, seed=1) as proxy:
        env["AWS_ENDPOINT_URL"] = proxy.url
        ...
        assert proxy.faults("read") > 0 and proxy.faults("write") > 0

Requests are *reads* (GET, HEAD: object reads, listings, bucket lookups) or *writes* (PUT, POST, DELETE: uploads,
copies, deletes). Each request draws from a random stream seeded by `seed` (one stream per side, so the sequence of
decisions on a side is fixed by the seed; which request gets which decision depends on the order the clients send
them in). A faulty request gets one of `kinds`:

- ``slowdown``: ``503 SlowDown`` (S3's throttling answer), not forwarded;
- ``unavailable``: ``503 ServiceUnavailable``, not forwarded;
- ``reset``: the connection is closed without a response, the request not forwarded;
- ``lost``: the request is forwarded (so it takes effect), then the connection is closed without a response;
- ``cut``: the request is forwarded, the response starts (status line, headers, half the body; half the headers when
  there is no body), then the connection is closed.

`spare(method, target)`, when given, names requests that are never faulted by chance; `inject_when(predicate, kind)`
gives the next request matching `predicate` a fault of `kind` (a targeted fault, on top of the chance ones). `down`
(settable at any time, or armed with `go_down_when`) is a sustained outage: every request then gets `down_kind`.
`injected[side][kind]` counts what was injected, `requests[side]` every request seen, and `log` lists ``(side, kind,
method, target)`` of each fault.
"""

from __future__ import annotations

import http.client
import random
import socket
import threading
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

KINDS = ("slowdown", "unavailable", "reset", "lost", "cut")
READS = {"GET", "HEAD"}
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
              "expect"}

_ERRORS = {
    "slowdown": ("SlowDown", "Please reduce your request rate."),
    "unavailable": ("ServiceUnavailable", "Service is unable to handle request."),
}


def side_of(method: str) -> str:
    return "read" if method.upper() in READS else "write"


class FaultyProxy:
    def __init__(self, upstream: str, *, read_fault: float = 0.0, write_fault: float = 0.0, seed: int = 0,
                 kinds: tuple[str, ...] = KINDS, down_kind: str = "unavailable",
                 spare: Callable[[str, str], bool] | None = None):
        unknown = set(kinds) - set(KINDS) | ({down_kind} - set(KINDS))
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {KINDS}")
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port or 80)
        self.fraction = {"read": read_fault, "write": write_fault}
        self.kinds = tuple(kinds)
        self.down_kind = down_kind
        self.down = False
        self._down_when: Callable[[str, str], bool] | None = None
        self._spare = spare
        self._targeted: list[tuple[Callable[[str, str], bool], str]] = []
        self._rng = {"read": random.Random(f"{seed}-read"), "write": random.Random(f"{seed}-write")}
        self._lock = threading.Lock()
        self.injected = {"read": Counter(), "write": Counter()}
        self.requests = Counter()
        self.log: list[tuple[str, str, str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # -- control ------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def set_faults(self, read: float | None = None, write: float | None = None) -> None:
        with self._lock:
            if read is not None:
                self.fraction["read"] = read
            if write is not None:
                self.fraction["write"] = write

    def go_down_when(self, predicate: Callable[[str, str], bool]) -> None:
        """Start a sustained outage right after the first request (method, target) for which `predicate` is true
        has been forwarded and answered: that request succeeds, every later one gets `down_kind`."""
        with self._lock:
            self._down_when = predicate

    def inject_when(self, predicate: Callable[[str, str], bool], kind: str) -> None:
        """Give the next request (method, target) matching `predicate` a fault of `kind`, once."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {KINDS}")
        with self._lock:
            self._targeted.append((predicate, kind))

    def faults(self, side: str | None = None) -> int:
        with self._lock:
            sides = [side] if side else ["read", "write"]
            return sum(sum(self.injected[s].values()) for s in sides)

    def summary(self) -> str:
        with self._lock:
            return ", ".join(f"{s}: {self.requests[s]} requests, {sum(self.injected[s].values())} faults "
                             f"{dict(sorted(self.injected[s].items()))}" for s in ("read", "write"))

    def start(self) -> FaultyProxy:
        self._thread = threading.Thread(target=self._server.serve_forever, name="faulty-proxy", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> FaultyProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- decisions ----------------------------------------------------------------------------------------------

    def _decide(self, method: str, target: str) -> str | None:
        side = side_of(method)
        with self._lock:
            self.requests[side] += 1
            targeted = next((t for t in self._targeted if t[0](method, target)), None)
            if self.down:
                kind = self.down_kind
            elif targeted is not None:
                self._targeted.remove(targeted)
                kind = targeted[1]
            elif self._spare is not None and self._spare(method, target):
                kind = None
            else:
                rng = self._rng[side]
                hit = rng.random() < self.fraction[side]
                kind = rng.choice(self.kinds) if hit else None  # drawn only on a hit: the stream stays seeded
            if kind is not None:
                self.injected[side][kind] += 1
                self.log.append((side, kind, method, target))
            return kind

    def _answered(self, method: str, target: str) -> None:
        with self._lock:
            if self._down_when is not None and self._down_when(method, target):
                self._down_when = None
                self.down = True


def _handler_for(proxy: FaultyProxy):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect; 100-continue is answered by the base class
        disable_nagle_algorithm = True  # headers and body go out in separate writes: no delayed-ACK stalls

        def log_message(self, format, *args):  # quiet
            pass

        def _body(self) -> bytes:
            if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                out = bytearray()
                while True:
                    line = self.rfile.readline()
                    size = int(line.split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                            pass
                        return bytes(out)
                    out += self.rfile.read(size)
                    self.rfile.readline()
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def _drop(self) -> None:
            self.close_connection = True
            try:
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        def _error(self, kind: str) -> None:
            code, message = _ERRORS[kind]
            body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
                    f"<RequestId>faulty-proxy</RequestId></Error>").encode()
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
            conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                        conn.putheader(name, value)
                if body or self.command in ("PUT", "POST"):
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body or None)
                resp = conn.getresponse()
                data = resp.read()
                return resp.status, resp.reason, resp.getheaders(), data
            finally:
                conn.close()

        def _handle(self) -> None:
            body = self._body()
            kind = proxy._decide(self.command, self.path)
            if kind in ("slowdown", "unavailable"):
                self._error(kind)
                return
            if kind == "reset":
                self._drop()
                return
            status, reason, headers, data = self._forward(body)
            proxy._answered(self.command, self.path)
            if kind == "lost":
                self._drop()
                return
            head = f"HTTP/1.1 {status} {reason}\r\n".encode("latin-1")
            for name, value in headers:
                if name.lower() in HOP_BY_HOP or (name.lower() == "content-length" and self.command != "HEAD"):
                    continue
                head += f"{name}: {value}\r\n".encode("latin-1")
            if self.command != "HEAD":
                head += f"Content-Length: {len(data)}\r\n".encode("latin-1")
            head += b"\r\n"
            if kind == "cut":
                self.wfile.write(head + data[: len(data) // 2] if data and self.command != "HEAD"
                                 else head[: len(head) // 2])
                self._drop()
                return
            self.wfile.write(head if self.command == "HEAD" else head + data)
            self.wfile.flush()

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

    return Handler
