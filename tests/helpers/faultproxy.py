"""A fault-injecting HTTP proxy on loopback, between an object-storage client (obstore) and moto's S3
server (``tests/helpers/s3.py``), for the tests of retries and for counting requests in the benchmarks.

The client is pointed at the proxy (``AWS_ENDPOINT_URL=http://127.0.0.1:PORT``) and the proxy forwards
each request to the server, one request at a time over one upstream connection per client connection
(HTTP/1.1 keep-alive on both sides; a thread per client connection). Requests are parsed (request
line, headers, a ``Content-Length`` or chunked body) so that a fault hits whole requests, and so that
requests and bytes are counted per method and per kind of key.

Faults, switched at run time by the test (``fail``, ``pass_through``), for ``seconds``, for the next
``requests`` requests, or for the first ``per_key`` requests of each key (or until switched off),
optionally only for requests ``match`` picks. A test that needs a fault to hit requests should count
them (``requests``, ``per_key``): a window of ``seconds`` may pass, on a loaded machine, before the
client sends anything.

- ``"reset"``: the request is read, then the connection is closed with ``SO_LINGER`` 0 (a TCP RST),
  without an answer: the client sees "connection reset" after it sent the request;
- ``"503"``: the request is read and answered ``503 Slow Down`` with S3's XML error body
  (``<Error><Code>SlowDown</Code>...``) and ``Connection: close``, as S3 throttles;
- ``"hold"`` (``hold()``): the request is read and held, unanswered, until ``release()``, then forwarded
  (a request in flight while its client is paused, or a server that stalls); ``held`` is set once one is.

Failed requests are counted as requests (the client sent them) and in ``faults``; they never reach
the server. obstore speaks HTTP/1.1 to an ``http://`` endpoint with ``Content-Length`` bodies; chunked
request bodies are handled all the same (forwarded de-chunked with a ``Content-Length``).
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

import pytest

from .s3 import S3Server

Match = Callable[[str, str], bool]  # (method, path) -> whether a fault applies to the request
MODES = ("reset", "503", "hold")
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    b"<RequestId>FAULTPROXY</RequestId><HostId>faultproxy</HostId></Error>"
)
_PIECE = 1 << 16
# hop-by-hop headers: not forwarded (the proxy frames each side's messages itself)
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


def key_class(path: str) -> str:
    """The kind of object a request's path names: ``list`` (a bucket listing), ``lock`` (``*.lock``),
    ``meta`` (``zarr.json``), ``chunk`` (a zarr chunk, ``.../c/...``), ``other``."""
    parts = urlsplit(path)
    key = unquote(parts.path).strip("/")
    if "/" not in key:  # the bucket itself: listings (list-type=2), bucket calls
        return "list"
    if key.endswith(".lock"):
        return "lock"
    if key.endswith("zarr.json"):
        return "meta"
    if "/c/" in f"/{key}" or key.split("/")[-1].startswith("c."):
        return "chunk"
    return "other"


@dataclass
class Counts:
    """What the proxy has seen since it started (or since ``reset_counts``)."""

    requests: Counter = field(default_factory=Counter)  # method -> requests
    classes: Counter = field(default_factory=Counter)  # (method, key class) -> requests
    faults: Counter = field(default_factory=Counter)  # mode -> requests failed so
    up: int = 0  # bytes the client sent (request lines, headers, bodies)
    down: int = 0  # bytes sent back to the client
    body_up: Counter = field(default_factory=Counter)  # (method, key class) -> request body bytes
    body_down: Counter = field(default_factory=Counter)  # (method, key class) -> response body bytes
    keys: Counter = field(default_factory=Counter)  # (method, key: the path without its query) -> requests
    connections: int = 0

    @property
    def total(self) -> int:
        return sum(self.requests.values())


class _Closed(Exception):
    """The client closed its connection between requests."""


def _read_head(stream) -> tuple[bytes, list[bytes]]:
    """The raw head (request line and header lines) of the next request; ``_Closed`` at a clean EOF."""
    lines = []
    while True:
        line = stream.readline(65537)
        if not line:
            if lines:
                raise ConnectionError("the client closed mid-request")
            raise _Closed
        if line in (b"\r\n", b"\n"):
            if not lines:  # a stray empty line between requests
                continue
            return b"".join(lines) + line, lines
        lines.append(line)


def _read_chunked(stream) -> tuple[bytes, int]:
    """A chunked body, de-chunked; and the raw bytes it took."""
    body, raw = bytearray(), 0
    while True:
        line = stream.readline(65537)
        raw += len(line)
        size = int(line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while True:  # trailers, up to the empty line
                trailer = stream.readline(65537)
                raw += len(trailer)
                if trailer in (b"\r\n", b"\n", b""):
                    return bytes(body), raw
        piece = stream.read(size + 2)
        raw += len(piece)
        body += piece[:size]


def _reset(connection: socket.socket) -> None:
    """Close abruptly: SO_LINGER 0 makes the close send a TCP RST, not a FIN."""
    try:
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    connection.close()


class FaultProxy:
    """``FaultProxy(upstream).start()``; point the client at ``endpoint``; ``fail(...)`` and
    ``pass_through()`` switch faults; ``counts`` says what was seen; ``stop()`` at the end."""

    def __init__(self, upstream: str, env: dict[str, str] | None = None, host: str = "127.0.0.1") -> None:
        parts = urlsplit(upstream)
        self._env = dict(env or {})
        assert parts.scheme == "http" and parts.hostname and parts.port, upstream
        self.upstream = (parts.hostname, parts.port)
        self._listener = socket.create_server((host, 0))
        self.endpoint = f"http://{host}:{self._listener.getsockname()[1]}"
        self.counts = Counts()
        self._lock = threading.Lock()
        self._mode: str | None = None
        self._until: float | None = None  # monotonic deadline of the fault
        self._left: int | None = None  # requests the fault has still to hit
        self._match: Match | None = None
        self._per_key: int | None = None  # each key fails this many times, then passes
        self._hits: Counter = Counter()  # key -> requests failed so (with ``per_key``)
        self._stopped = threading.Event()
        self.held = threading.Event()  # a request is being held (``hold``)
        self._released = threading.Event()
        self._connections: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, name="faultproxy", daemon=True)

    # -- control, from the test ------------------------------------------------------------------
    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def env(self) -> dict[str, str]:
        """The environment a client needs to reach the server through the proxy: the server's
        (``S3Server.env()``, given as ``env``) with ``AWS_ENDPOINT_URL`` pointed at the proxy."""
        return {**self._env, "AWS_ENDPOINT_URL": self.endpoint}

    def fail(
        self,
        mode: str,
        *,
        seconds: float | None = None,
        requests: int | None = None,
        match: Match | None = None,
        per_key: int | None = None,
    ) -> None:
        """Fail requests as ``mode`` (``"reset"`` or ``"503"``) for ``seconds`` from now, or for the next
        ``requests`` requests (whichever ends first where both are given; until ``pass_through()`` where
        neither is); only those ``match(method, path)`` picks, where given. With ``per_key``, only the
        first ``per_key`` requests of each key (the path without its query) fail, and its later ones pass:
        an outage every retried request meets the same number of times, however slowly it comes."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {MODES}")
        with self._lock:
            self._mode, self._match = mode, match
            self._until = None if seconds is None else time.monotonic() + seconds
            self._left = requests
            self._per_key, self._hits = per_key, Counter()

    def hold(self, match: Match, requests: int = 1) -> None:
        """Hold the next ``requests`` requests ``match`` picks until ``release()``."""
        self.held.clear()
        self._released.clear()
        self.fail("hold", requests=requests, match=match)

    def release(self) -> None:
        self._released.set()

    def pass_through(self) -> None:
        with self._lock:
            self._mode = self._until = self._left = self._match = self._per_key = None

    @property
    def failing(self) -> bool:
        with self._lock:
            return self._active()

    def reset_counts(self) -> Counts:
        """Start counting afresh; the counts so far."""
        with self._lock:
            counts, self.counts = self.counts, Counts()
        return counts

    def stop(self) -> None:
        self._stopped.set()
        self._released.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    # -- the proxy -------------------------------------------------------------------------------
    def _active(self) -> bool:
        if self._mode is None:
            return False
        if (self._until is not None and time.monotonic() >= self._until) or self._left == 0:
            self._mode = self._until = self._left = self._match = self._per_key = None
            return False
        return True

    def _decide(self, method: str, path: str) -> str | None:
        """The fault for this request, if any (and count it against the fault's ``requests``)."""
        with self._lock:
            if not self._active() or (self._match is not None and not self._match(method, path)):
                return None
            if self._per_key is not None:
                key = unquote(urlsplit(path).path)
                if self._hits[key] >= self._per_key:
                    return None
                self._hits[key] += 1
            if self._left is not None:
                self._left -= 1
            assert self._mode is not None
            self.counts.faults[self._mode] += 1
            return self._mode

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._connections.add(connection)
                self.counts.connections += 1
            threading.Thread(target=self._serve, args=(connection,), name="faultproxy-conn", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        stream = connection.makefile("rb")
        upstream: http.client.HTTPConnection | None = None
        try:
            while not self._stopped.is_set():
                try:
                    head, lines = _read_head(stream)
                except _Closed:
                    return
                method, path, version = lines[0].decode("latin-1").split(None, 2)
                headers: list[tuple[str, str]] = []
                for line in lines[1:]:
                    name, _, value = line.decode("latin-1").partition(":")
                    headers.append((name.strip(), value.strip()))
                lower = {name.lower(): value for name, value in headers}
                raw = len(head)
                if "chunked" in lower.get("transfer-encoding", "").lower():
                    body, taken = _read_chunked(stream)
                    raw += taken
                else:
                    body = stream.read(int(lower.get("content-length", "0") or 0))
                    raw += len(body)
                kind = key_class(path)
                with self._lock:
                    self.counts.requests[method] += 1
                    self.counts.classes[method, kind] += 1
                    self.counts.keys[method, unquote(urlsplit(path).path)] += 1
                    self.counts.up += raw
                    self.counts.body_up[method, kind] += len(body)
                fault = self._decide(method, path)
                if fault == "reset":
                    _reset(connection)
                    return
                if fault == "503":
                    self._send(connection, self._slow_down())
                    return
                if fault == "hold":
                    self.held.set()
                    self._released.wait(300)
                forwarded = [(n, v) for n, v in headers if n.lower() not in _HOP and n.lower() != "content-length"]
                if body or method in ("PUT", "POST"):
                    forwarded.append(("Content-Length", str(len(body))))
                upstream = self._forward(connection, upstream, method, path, forwarded, body, kind)
                if upstream is None or lower.get("connection", "").lower() == "close" or version.strip() == "HTTP/1.0":
                    return
        except (OSError, ValueError, http.client.HTTPException):
            return  # the client or the server went away mid-request: drop the client's connection
        finally:
            if upstream is not None:
                upstream.close()
            with self._lock:
                self._connections.discard(connection)
            try:
                connection.close()
            except OSError:
                pass

    def _slow_down(self) -> bytes:
        head = (
            "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(SLOW_DOWN)}\r\nx-amz-request-id: FAULTPROXY\r\nConnection: close\r\n\r\n"
        )
        return head.encode() + SLOW_DOWN

    def _send(self, connection: socket.socket, data: bytes, kind: tuple[str, str] | None = None, body: int = 0) -> None:
        connection.sendall(data)
        with self._lock:
            self.counts.down += len(data)
            if kind is not None:
                self.counts.body_down[kind] += body

    def _forward(
        self,
        connection: socket.socket,
        upstream: http.client.HTTPConnection | None,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        kind: str,
    ) -> http.client.HTTPConnection | None:
        """Send one request upstream and stream its response back; the upstream connection to reuse
        (None where it is to be closed). A reused connection the server closed meanwhile is replaced
        once, before anything was answered."""
        for attempt in (0, 1):
            fresh = upstream is None
            if upstream is None:
                upstream = http.client.HTTPConnection(*self.upstream, timeout=60)
            try:
                upstream.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
                for name, value in headers:
                    upstream.putheader(name, value)
                upstream.endheaders(body or None)
                response = upstream.getresponse()
                break
            except (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine):
                upstream.close()
                upstream = None
                if fresh or attempt:
                    raise
        assert upstream is not None
        status = f"HTTP/1.1 {response.status} {response.reason}\r\n"
        out = [status] + [f"{n}: {v}\r\n" for n, v in response.getheaders() if n.lower() not in _HOP]
        length = response.getheader("Content-Length")
        bodiless = method == "HEAD" or response.status in (204, 304) or 100 <= response.status < 200
        chunked = not bodiless and length is None and response.chunked
        data = b""
        if not bodiless and length is None and not chunked:  # until the server closes: read it all
            data = response.read()
            out = [line for line in out if not line.lower().startswith("content-length:")]
            out.append(f"Content-Length: {len(data)}\r\n")
        if chunked:
            out.append("Transfer-Encoding: chunked\r\n")
        out.append("\r\n")
        self._send(connection, "".join(out).encode("latin-1") + data, (method, kind), len(data))
        if not bodiless and not data:
            while piece := response.read(_PIECE):
                self._send(
                    connection, b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece, (method, kind), len(piece)
                )
            if chunked:
                self._send(connection, b"0\r\n\r\n")
        response.read()  # nothing left; lets the connection be reused
        if response.will_close:
            upstream.close()
            return http.client.HTTPConnection(*self.upstream, timeout=60)
        return upstream


@pytest.fixture
def fault_proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    """A fresh proxy (fresh counts) in front of the session's moto server; ``fault_proxy.env()`` is
    ``S3Server.env()`` through it (set it with monkeypatch, after the ``s3`` fixture set the server's)."""
    with FaultProxy(s3_server.endpoint, env=s3_server.env()) as proxy:
        yield proxy
