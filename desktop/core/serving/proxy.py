"""The stable endpoint: an OpenAI-compatible reverse proxy on a fixed loopback port in front of whichever engine
is active, so clients keep one URL and one model name while engines are switched behind it.

Streams pass through chunk by chunk as they arrive (no buffering). Which upstream serves is decided per request
when it arrives; the in-flight count per upstream lets a switch drain the old engine before stopping it.
While no engine is ready, requests wait (bounded) instead of failing. The proxy runs its own asyncio loop in a
thread, so synchronous code (the endpoint manager, the CLI) drives it through thread-safe methods.

Why HTTP/1.1 is spoken here with asyncio protocols and `httptools` (llhttp, the parser under uvicorn and
Node.js) rather than a web framework: on a CPU-bound workstation every cycle the proxy spends is taken from the
engine, and under concurrent load its per-request latency is serialized across requests. A framework's client
and server each wake a coroutine per streamed chunk; here a chunk is parsed in C, metered and written to the
client in the same callback, and the upstream request leaves the moment the client's request is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import httptools

from desktop.core.common.errors import PortBusy, SwitchyardError
from desktop.core.common.sse import SSEDecoder, StreamDelta, parse_chunk
from desktop.core.runtime.ports import holder_of
from desktop.core.runtime.telemetry import Sample

log = logging.getLogger("switchyard.proxy")

DEFAULT_PROXY_PORT = 8800
DEFAULT_WAIT_TIMEOUT = 600.0
CONTROL_PREFIX = "/switchyard/"
# Headers that describe one hop, not the message: never forwarded as they came (RFC 9110 §7.6.1); the proxy
# writes its own framing (Host, Content-Length or chunked) for each side.
HOP_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length", "expect",
})
MAX_HEAD_BYTES = 64 * 1024  # request line + headers
MAX_BODY_BYTES = 64 * 1024 * 1024
CONNECT_TIMEOUT = 10.0
# Idle connections to an engine are reused for this long: well under the 5 s after which llama-server
# (cpp-httplib) and vLLM (uvicorn) close them, so the race with their close is rare (and retried when it happens).
POOL_IDLE_SECONDS = 2.0
POOL_MAX_IDLE = 64
KEPT_BODY_BYTES = 1 << 20  # of a non-streamed answer, for its token count
T = TypeVar("T")


@dataclass(frozen=True)
class Upstream:
    """One engine server the proxy can forward to."""

    name: str  # unique, e.g. "llama.cpp@41234"
    engine: str
    base_url: str
    served_model_name: str
    api_key: str | None = None
    model: str = ""  # what it serves, for /v1/models

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("api_key")
        return data


@dataclass
class RequestRecord:
    """What the proxy measured for one forwarded request."""

    t: float  # wall clock when it arrived
    method: str
    path: str
    upstream: str | None
    status: int
    streamed: bool
    ttft_s: float | None  # arrival → first token-bearing chunk (includes any wait for an engine)
    e2e_s: float
    output_tokens: int | None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def to_samples(self, source: str = "proxy") -> list[Sample]:
        samples = [Sample(self.t, source, "proxy_e2e_s", self.e2e_s)]
        if self.ttft_s is not None:
            samples.append(Sample(self.t, source, "proxy_ttft_s", self.ttft_s))
        if self.output_tokens is not None:
            samples.append(Sample(self.t, source, "proxy_output_tokens", float(self.output_tokens)))
        if self.status != 499 and (self.error is not None or self.status >= 500):
            samples.append(Sample(self.t, source, "proxy_failed", 1.0))
        return samples


RequestListener = Callable[[RequestRecord], None]


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed (a fraction of asyncio's CPU per streamed chunk: on a CPU-bound box every cycle
    the proxy spends is taken from the engine), else the standard loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class StreamMeter:
    """Finds the first token-bearing chunk and the output token count of a response without slowing it down.

    Until the first token, payloads are decoded and parsed. After it, a chunk costs one byte count and a copy
    into a short rolling tail: the usage (or llama.cpp timings) and any error sit in the stream's last events,
    which are parsed once at the end.
    """

    TAIL_BYTES = 8192

    def __init__(self, started: float) -> None:
        self.started = started
        self.first_token_at: float | None = None
        self.payloads = 0
        self.usage_tokens: int | None = None
        self.error: str | None = None
        self._decoder = SSEDecoder()
        self._tail: deque[bytes] = deque()
        self._tail_size = 0

    def feed(self, chunk: bytes, now: float) -> None:
        if self.first_token_at is None:
            for payload in self._decoder.feed(chunk):
                self._payload(payload, now)
            return
        self.payloads += chunk.count(b"data:")
        tail = self._tail
        tail.append(chunk)
        self._tail_size += len(chunk)
        while self._tail_size - len(tail[0]) >= self.TAIL_BYTES:
            self._tail_size -= len(tail.popleft())

    def finish(self, now: float) -> None:
        for payload in self._decoder.flush():
            self._payload(payload, now)
        tail = b"".join(self._tail).decode("utf-8", "replace")
        if "[DONE]" in tail:
            self.payloads -= 1
        for event in tail.split("\n\n"):
            if '"usage"' in event or '"timings"' in event or '"error"' in event:
                payload = "\n".join(line[5:].lstrip() for line in event.splitlines() if line.startswith("data:"))
                self._inspect(parse_chunk(payload) if payload else None)

    def _payload(self, payload: str, now: float) -> None:
        if payload.strip() == "[DONE]":
            return
        self.payloads += 1
        if self.first_token_at is not None and '"usage"' not in payload and '"timings"' not in payload \
                and '"error"' not in payload:
            return  # the rest of a batch that arrived with the first token: counted, not parsed
        delta = parse_chunk(payload)
        if delta is not None and delta.has_token and self.first_token_at is None:
            self.first_token_at = now
        self._inspect(delta)

    def _inspect(self, delta: StreamDelta | None) -> None:
        if delta is None:
            return
        if delta.error:
            self.error = delta.error
        usage = delta.usage or {}
        if isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
        timings = delta.raw.get("timings")
        if self.usage_tokens is None and isinstance(timings, dict) and isinstance(timings.get("predicted_n"), int):
            self.usage_tokens = timings["predicted_n"]

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.payloads


class Headers:
    """A request's headers in arrival order, with case-insensitive lookup (last value wins)."""

    __slots__ = ("items", "_index")

    def __init__(self, items: list[tuple[str, str]]) -> None:
        self.items = items
        self._index = {name.lower(): value for name, value in items}

    def get(self, name: str, default: str = "") -> str:
        return self._index.get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._index


@dataclass
class LocalRequest:
    """A request the endpoint answers itself (/v1/models, /health, the control channel)."""

    method: str
    path: str
    query: str
    headers: Headers
    body: bytes

    def json(self) -> Any:
        """The body as JSON; ValueError when it is not."""
        return json.loads(self.body or b"null")


@dataclass
class LocalResponse:
    status: int
    body: bytes
    content_type: str = "application/json"

    @classmethod
    def json(cls, data: Any, status: int = 200) -> LocalResponse:
        return cls(status, json.dumps(data).encode())


LocalHandler = Callable[[LocalRequest], Awaitable[LocalResponse]]


@dataclass(frozen=True)
class LocalRoute:
    """An extra route served on the endpoint's port (the control channel under /switchyard/)."""

    method: str
    path: str
    handler: LocalHandler


def _json_error(status: int, message: str, kind: str = "switchyard_error") -> LocalResponse:
    return LocalResponse.json({"error": {"message": message, "type": kind, "code": status}}, status=status)


REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
           409: "Conflict", 413: "Content Too Large", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable"}


@dataclass
class _Incoming:
    """One complete request read from a client connection."""

    method: str
    target: str  # as sent: path and query
    path: str
    query: str
    headers: Headers
    body: bytes
    keep_alive: bool
    http10: bool


@dataclass(frozen=True)
class _Target:
    """Where an upstream's base URL points, parsed once. Engines are local processes: plain HTTP."""

    host: str
    port: int
    prefix: str
    authority: str

    @classmethod
    def parse(cls, base_url: str) -> _Target:
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise SwitchyardError(f"the endpoint forwards to local engines over http://, not {base_url}")
        return cls(parts.hostname or "127.0.0.1", parts.port or 80, parts.path.rstrip("/"), parts.netloc)


class _ClientConnection(asyncio.Protocol):
    """One client's connection: HTTP/1.1 parsed by llhttp, keep-alive, pipelined requests answered in order."""

    def __init__(self, proxy: ProxyServer) -> None:
        self.proxy = proxy
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.pending: deque[_Incoming] = deque()
        self.worker: asyncio.Task[bool] | None = None  # a request that had to wait (for an engine, a connection)
        self.exchange: _Exchange | None = None  # the upstream answer now being streamed to this client
        self.busy = False  # a request is being answered; later (pipelined) ones wait in `pending`
        self.current: _Incoming | None = None
        self._dispatching = False
        self.closed = False
        self.rejected: tuple[int, str] | None = None
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._body: list[bytes] = []
        self._head_size = 0
        self._body_size = 0

    # --- asyncio.Protocol ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        self.proxy._connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.rejected is not None:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, "protocol upgrades are not supported by the endpoint")
        except httptools.HttpParserCallbackError:
            if self.rejected is None:
                raise
        except httptools.HttpParserError as exc:
            self._reject(400, f"malformed HTTP request: {exc}")

    def eof_received(self) -> bool | None:
        return None  # a half-closed client is treated as gone: the transport closes and connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.proxy._connections.discard(self)
        if self.exchange is not None:
            self.exchange.client_gone()
        elif self.worker is not None and not self.worker.done():
            self.worker.cancel()  # still waiting for an engine: nobody is left to answer

    def pause_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.pause_upstream()

    def resume_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.resume_upstream()

    # --- httptools callbacks ---
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body = []
        self._head_size = 0
        self._body_size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)
        if self._head_size > MAX_HEAD_BYTES:
            self._refuse(431, "the request line is too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        if self._head_size > MAX_HEAD_BYTES:
            self._refuse(431, f"request headers over {MAX_HEAD_BYTES // 1024} KiB")
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        expect = [v for n, v in self._headers if n.lower() == "expect"]
        if expect and expect[-1].lower() == "100-continue" and not self.busy and not self.pending \
                and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > MAX_BODY_BYTES:
            self._refuse(413, f"request body over {MAX_BODY_BYTES >> 20} MiB")
        self._body.append(body)

    def on_message_complete(self) -> None:
        target = self._url.decode("latin-1")
        path, _, query = target.partition("?")
        self.pending.append(_Incoming(
            method=self.parser.get_method().decode("ascii", "replace"), target=target, path=path, query=query,
            headers=Headers(self._headers), body=b"".join(self._body), keep_alive=self.parser.should_keep_alive(),
            http10=self.parser.get_http_version() == "1.0"))
        if not self.busy:
            self._next()

    # --- answering ---
    def _reject(self, status: int, message: str) -> None:
        """A request we cannot read: answer once (if nothing else is being answered) and close."""
        if self.rejected is not None:
            return
        self.rejected = (status, message)
        self.pending.clear()
        if not self.busy and self.transport is not None:
            self.write_response(_json_error(status, message, "invalid_request_error"), close=True)
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        """_reject() from inside a parser callback, which also stops the parser (caught in data_received)."""
        self._reject(status, message)
        raise httptools.HttpParserCallbackError(message)

    def _next(self) -> None:
        """Answer pending requests in order. Most are answered (or forwarded) right here, inside the callback
        that read them: no task, no loop iteration between a request's last byte and the engine."""
        if self._dispatching:
            return  # request_done() was called from inside dispatch: the loop below carries on
        self._dispatching = True
        try:
            while self.pending and not self.busy and not self.closed:
                self.current = self.pending.popleft()
                self.busy = True
                try:
                    self.proxy._dispatch(self.current, self)
                except Exception:
                    log.exception("the endpoint failed a request to %s", self.current.path)
                    self.request_done(False)
        finally:
            self._dispatching = False

    def request_done(self, keep: bool) -> None:
        """The current request is answered; `keep` False closes the connection (the answer was cut short)."""
        self.busy = False
        self.worker = None
        if self.closed or self.transport is None:
            return
        current = self.current
        if not keep or current is None or not current.keep_alive or self.rejected is not None:
            self.transport.close()
            return
        self._next()

    def wait_in(self, coroutine: Coroutine[Any, Any, bool]) -> None:
        """Continue the current request in a task (it has to wait); its result is `keep` for request_done."""
        task = asyncio.ensure_future(coroutine)
        self.worker = task

        def finished(done: asyncio.Task[bool]) -> None:
            if done.cancelled():
                self.request_done(False)
            elif done.exception() is not None:
                log.error("the endpoint failed a request", exc_info=done.exception())
                self.request_done(False)
            else:
                self.request_done(done.result())

        task.add_done_callback(finished)

    def write_response(self, response: LocalResponse, close: bool = False, request: _Incoming | None = None
                       ) -> None:
        if self.closed or self.transport is None:
            return
        head = [f"HTTP/1.1 {response.status} {REASONS.get(response.status, 'Status')}",
                f"Content-Type: {response.content_type}", f"Content-Length: {len(response.body)}"]
        if close or (request is not None and not request.keep_alive):
            head.append("Connection: close")
        body = b"" if request is not None and request.method == "HEAD" else response.body
        self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)


class _UpstreamConnection(asyncio.Protocol):
    """A connection to an engine, kept alive between requests: connecting afresh costs the proxy's one thread
    ~0.2 ms per request, and under a burst of concurrent requests every client waits on the sum of those."""

    def __init__(self, pool: list[_UpstreamConnection]) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None
        self.closed = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        if self.exchange is not None:
            self.exchange.data_received(data)
        else:  # bytes nobody asked for: this connection cannot be trusted with another request
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        with contextlib.suppress(ValueError):
            self.pool.remove(self)
        if self.exchange is not None:
            self.exchange.connection_lost(exc)

    def begin(self, exchange: _Exchange, request: bytes) -> None:
        assert self.transport is not None
        self.exchange = exchange
        self.transport.write(request)

    def release(self, reusable: bool, now: float) -> None:
        """The exchange is over: back to the pool when the engine left it clean, else closed."""
        self.exchange = None
        if reusable and not self.closed and self.transport is not None and len(self.pool) < POOL_MAX_IDLE:
            if not self.transport.is_reading():  # paused for a slow client
                self.transport.resume_reading()
            self.idle_since = now
            self.pool.append(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.closed = True
        with contextlib.suppress(ValueError):
            self.pool.remove(self)
        if self.transport is not None:
            self.transport.abort()


class _Exchange:
    """One forwarded request on an upstream connection; the answer is written to the client as it arrives.

    `done` resolves to the RequestRecord, or to None when the engine took nothing (refused or closed before
    answering), so the caller may retry elsewhere without the client noticing.
    """

    def __init__(self, proxy: ProxyServer, client: _ClientConnection, request: _Incoming, lease: _Lease,
                 arrived: float, wall: float, connection: _UpstreamConnection) -> None:
        self.proxy = proxy
        self.client = client
        self.connection = connection
        self.lease = lease
        self.upstream = lease.upstream
        self.request = request
        self.arrived = arrived
        self.wall = wall
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future[RequestRecord | None] = self.loop.create_future()
        self.parser = httptools.HttpResponseParser(self)
        self.meter = StreamMeter(arrived)
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.answered = False  # the response head was sent to the client: no retry from here on
        self.streamed = False
        self.framing = "length"  # to the client: "length", "chunked", "close" or "none"
        self.upstream_framed = True  # the engine said how long its body is (length or chunked)
        self.upstream_keep_alive = False  # the engine will take another request on this connection
        self.complete = False
        self.finished = False
        self.out: list[bytes] = []
        self.kept: list[bytes] = []
        self.kept_size = 0
        self.now = 0.0
        self.paused = False

    # --- from the upstream connection ---
    def data_received(self, data: bytes) -> None:
        if self.finished:
            return
        self.now = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(f"the engine {self.upstream.engine} sent a malformed response ({exc})")
            return
        if self.complete:
            self._finish(None)
        else:
            self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.finished:
            return
        if not self.answered:
            self._finish(None, retry=True, reason=f"closed before answering ({exc or 'no response'})")
        elif not self.upstream_framed and not self.complete:
            self.complete = True  # a body delimited by the connection's end
            if self.framing == "chunked":
                self.out.append(b"0\r\n\r\n")
            self._finish(None)
        else:
            detail = f"{type(exc).__name__}: {exc}" if exc else "connection closed"
            self._finish(f"the engine {self.upstream.engine} stopped mid-response ({detail})")

    # --- httptools callbacks ---
    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        request = self.request
        lines = [b"HTTP/1.1 %d %s" % (self.status, self.reason or b"Status")]
        length: bytes | None = None
        chunked = False
        for name, value in self.headers:
            lower = name.lower()
            if lower == b"content-length":
                length = value
            elif lower == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif lower.decode("latin-1") not in HOP_HEADERS:
                if lower == b"content-type" and b"text/event-stream" in value:
                    self.streamed = True
                lines.append(name + b": " + value)
        no_body = request.method == "HEAD" or self.status < 200 or self.status in (204, 304)
        close = not request.keep_alive
        if no_body:
            self.framing = "none"
            if length is not None:
                lines.append(b"Content-Length: " + length)
        elif length is not None and not chunked:
            self.framing = "length"
            lines.append(b"Content-Length: " + length)
        elif not request.http10:
            self.framing = "chunked"
            self.upstream_framed = chunked
            lines.append(b"Transfer-Encoding: chunked")
        else:
            self.framing = "close"
            self.upstream_framed = chunked
            close = True
        if close:
            lines.append(b"Connection: close")
            request.keep_alive = False
        self.out.append(b"\r\n".join(lines) + b"\r\n\r\n")
        self.answered = True
        if no_body:
            self.complete = True

    def on_body(self, body: bytes) -> None:
        if self.complete:
            return
        if self.streamed:
            self.meter.feed(body, self.now)
        elif self.kept_size < KEPT_BODY_BYTES:
            self.kept.append(body)
            self.kept_size += len(body)
        if self.framing == "chunked":
            self.out.append(b"%x\r\n%b\r\n" % (len(body), body))
        else:
            self.out.append(body)

    def on_message_complete(self) -> None:
        if self.complete:
            return
        self.complete = True
        self.upstream_keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the callback returns
        if self.framing == "chunked":
            self.out.append(b"0\r\n\r\n")

    # --- towards the client ---
    def _flush(self) -> None:
        """One write per batch of upstream bytes (the head goes out with the first body bytes)."""
        if not self.out:
            return
        transport = self.client.transport
        if not self.client.closed and transport is not None:
            transport.write(b"".join(self.out) if len(self.out) > 1 else self.out[0])
        self.out.clear()

    def pause_upstream(self) -> None:
        transport = self.connection.transport
        if transport is not None and not self.paused:
            self.paused = True
            transport.pause_reading()

    def resume_upstream(self) -> None:
        transport = self.connection.transport
        if transport is not None and self.paused:
            self.paused = False
            transport.resume_reading()

    def client_gone(self) -> None:
        """The client hung up: abort the upstream request so the engine stops working on it."""
        if not self.finished:
            self._finish("the client disconnected", client_gone=True)

    def _finish(self, error: str | None, *, retry: bool = False, reason: str = "", client_gone: bool = False
                ) -> None:
        self.finished = True
        self.client.exchange = None
        done = self.loop.time()
        reusable = self.complete and error is None and self.upstream_framed and self.upstream_keep_alive
        self.connection.release(reusable and not (retry or client_gone), done)
        if retry:
            log.info("%s refused a request (%s): retrying", self.upstream.name, reason)
            self.done.set_result(None)
            return
        told = error if not client_gone else None
        if told is not None:
            log.warning("%s", told)
        if self.streamed:
            self.meter.finish(done)
        elif self.kept:
            _count_json_tokens(self.meter, b"".join(self.kept), done)
        status = self.status
        if client_gone:
            status = 499
        elif not self.answered and error is not None:  # e.g. a malformed response head: the client gets a 502
            status = 502
        elif error is None and status >= 400:
            error = f"HTTP {status}"
        elif error is None:
            error = self.meter.error
        record = RequestRecord(
            t=self.wall, method=self.request.method, path=self.request.path, upstream=self.upstream.name,
            status=status, streamed=self.streamed,
            ttft_s=(self.meter.first_token_at - self.arrived) if self.meter.first_token_at else None,
            e2e_s=done - self.arrived, output_tokens=self.meter.output_tokens if status < 400 else None,
            error=error)
        self.lease.release()  # counted off and published before the client sees the end of its answer
        self.proxy._record(record)
        self._flush()
        if told is not None and not self.answered:
            self.request.keep_alive = False
            self.client.write_response(_json_error(502, told, "upstream_error"), close=True, request=self.request)
        elif told is not None:
            self._tell_client(told)
        self.done.set_result(record)

    def _tell_client(self, error: str) -> None:
        """An answer cut short: end a chunked event stream with an error event; otherwise close the connection,
        which is how HTTP says "truncated"."""
        self.request.keep_alive = False
        if self.framing == "chunked" and self.streamed and not self.client.closed and self.client.transport:
            event = {"error": {"message": error, "type": "upstream_disconnected", "code": 502}}
            payload = f"data: {json.dumps(event)}\n\n".encode()
            self.client.transport.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload))


class _Lease:
    """One request's claim on an upstream (what drain() waits on); released exactly once."""

    __slots__ = ("held", "proxy", "upstream")

    def __init__(self, proxy: ProxyServer, upstream: Upstream) -> None:
        self.proxy = proxy
        self.upstream = upstream
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.proxy._release(self.upstream)


class _Unavailable(Exception):
    """No upstream could take the request before its deadline."""


class ProxyServer:
    """The stable OpenAI-compatible endpoint. `start()` binds the port (PortBusy if taken) and returns."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PROXY_PORT,
        model_name: str = "switchyard",
        api_key: str | None = None,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
        retry_window: float = 30.0,
    ) -> None:
        self.host = host
        self.port = port
        self.model_name = model_name
        self.api_key = api_key
        self.wait_timeout = wait_timeout
        self.retry_window = retry_window
        self.started_at = time.time()
        self._listeners: list[RequestListener] = []
        self._routes: dict[str, dict[str, LocalHandler]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_ClientConnection] = set()
        self._targets: dict[str, _Target] = {}
        self._pools: dict[str, list[_UpstreamConnection]] = {}
        # Loop-owned state (touched only from the proxy's loop).
        self._active: Upstream | None = None
        self._down_reason: str | None = None
        self._inflight: dict[str, int] = {}
        self._changed: asyncio.Condition | None = None
        self._draining = 0  # drain() calls waiting: only they need waking when a request ends
        self.counters = {"requests": 0, "failed": 0, "waited": 0}

    # --- configuration (before start) ---
    def subscribe(self, listener: RequestListener) -> None:
        self._listeners.append(listener)

    def add_routes(self, routes: Iterable[LocalRoute]) -> None:
        """Extra routes (the control channel under /switchyard/) served on the same port; call before start()."""
        for route in routes:
            self._routes.setdefault(route.path, {})[route.method.upper()] = route.handler

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # --- lifecycle ---
    def start(self) -> None:
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = _new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._start_server())
            except BaseException as exc:  # bind failures are reported to start()'s caller
                failure.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self._stop_server())
            loop.close()

        self._thread = threading.Thread(target=run, name="switchyard-proxy", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            exc = failure[0]
            if isinstance(exc, OSError):
                holder = holder_of(self.port)
                raise PortBusy(f"the endpoint cannot listen on {self.host}:{self.port}: "
                               f"{exc.strerror or exc}{f' (held by {holder})' if holder else ''}",
                               "pick another --proxy-port, or stop the process holding it") from exc
            raise SwitchyardError(f"the endpoint could not start: {exc}") from exc

    async def _start_server(self) -> None:
        self._changed = asyncio.Condition()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ClientConnection(self), self.host, self.port)
        if self.port == 0:
            self.port = int(self._server.sockets[0].getsockname()[1])

    async def _stop_server(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            if connection.exchange is not None:
                connection.exchange.client_gone()
            if connection.transport is not None:
                connection.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()
        for pool in self._pools.values():
            for idle in list(pool):
                idle.abort()
        tasks = [c.worker for c in self._connections if c.worker is not None and not c.worker.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=15)

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the proxy's loop from another thread and return its result."""
        if self._loop is None:
            raise SwitchyardError("the endpoint is not running")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def call_soon(self, function: Callable[[], Awaitable[Any]]) -> None:
        """Schedule a coroutine function on the proxy's loop without waiting (safe from any thread)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(function()))

    # --- routing (thread-safe) ---
    def set_upstream(self, upstream: Upstream | None, down_reason: str | None = None) -> None:
        """Send new requests to `upstream` from now on. None makes them wait (starting or switching) or, with
        `down_reason`, fail at once with that reason (no engine will come)."""
        if upstream is not None:
            _Target.parse(upstream.base_url)  # a URL the endpoint cannot forward to fails here, in the caller
        self.call(self._set_upstream(upstream, down_reason), timeout=10)

    async def _set_upstream(self, upstream: Upstream | None, down_reason: str | None) -> None:
        assert self._changed is not None
        async with self._changed:
            self._active = upstream
            self._down_reason = None if upstream else down_reason
            self._changed.notify_all()
        log.info("endpoint now forwards to %s", upstream.name if upstream else f"nothing ({down_reason})")

    @property
    def active(self) -> Upstream | None:
        return self._active

    def inflight(self, name: str | None = None) -> int:
        counts = dict(self._inflight)
        return counts.get(name, 0) if name is not None else sum(counts.values())

    def drain(self, upstream: Upstream, timeout: float) -> bool:
        """Wait until no request is in flight on `upstream`; False if some still are after `timeout` seconds."""
        return self.call(self._drain(upstream.name, timeout), timeout=timeout + 10)

    async def _drain(self, name: str, timeout: float) -> bool:
        assert self._changed is not None
        self._draining += 1
        try:
            with contextlib.suppress(TimeoutError):
                async with self._changed:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self._inflight.get(name, 0) == 0),
                                           timeout)
        finally:
            self._draining -= 1
        return self._inflight.get(name, 0) == 0

    def _try_acquire(self, avoid: Upstream | None) -> Upstream | None:
        """The fast path, without touching the condition: an engine is there and may be used."""
        upstream = self._active
        if upstream is None or upstream is avoid:
            return None
        self._inflight[upstream.name] = self._inflight.get(upstream.name, 0) + 1
        return upstream

    async def _acquire(self, deadline: float, avoid: Upstream | None = None) -> Upstream:
        """The upstream to use now, waiting (until `deadline`) while there is none or only `avoid`."""
        assert self._changed is not None
        loop = asyncio.get_running_loop()
        async with self._changed:
            def usable() -> bool:
                return (self._active is not None and self._active is not avoid) or self._down_reason is not None

            if not usable():
                self.counters["waited"] += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait_for(usable), max(0.0, deadline - loop.time()))
            upstream = self._try_acquire(avoid)
            if upstream is None:
                raise _Unavailable(self._down_reason or "no engine became ready in time")
            return upstream

    def _release(self, upstream: Upstream) -> None:
        """Count one request off `upstream`; when it was the last, wake any drain() waiting for that."""
        count = self._inflight[upstream.name] - 1
        if count > 0:
            self._inflight[upstream.name] = count
            return
        del self._inflight[upstream.name]
        if self._draining:
            asyncio.ensure_future(self._notify())

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    # --- handlers ---
    def _authorized(self, headers: Headers) -> bool:
        if not self.api_key:
            return True
        header = headers.get("Authorization")
        token = header[7:] if header.lower().startswith("bearer ") else headers.get("x-api-key")
        return hmac.compare_digest(token.encode(), self.api_key.encode())

    def _dispatch(self, request: _Incoming, client: _ClientConnection) -> None:
        """Answer one request; calls client.request_done() when finished, now or later."""
        path = request.path
        if path.startswith(CONTROL_PREFIX):
            routes = self._routes.get(path)
            handler = routes.get(request.method) if routes else None
            if handler is None:
                client.write_response(_json_error(404 if not routes else 405,
                                                  f"no control route {request.method} {path}"), request=request)
                client.request_done(True)
            else:
                client.wait_in(self._local(handler, request, client))
            return
        if path == "/health":
            client.write_response(self._health(), request=request)
        elif not self._authorized(request.headers):
            client.write_response(_json_error(401, "invalid or missing API key", "authentication_error"),
                                  request=request)
        elif path == "/v1/models" and request.method in ("GET", "HEAD"):
            client.write_response(self._models(), request=request)
        else:
            self._forward_now(request, client)
            return
        client.request_done(True)

    async def _local(self, handler: LocalHandler, request: _Incoming, client: _ClientConnection) -> bool:
        try:
            response = await handler(LocalRequest(request.method, request.path, request.query, request.headers,
                                                  request.body))
        except Exception as exc:
            log.exception("control route %s failed", request.path)
            response = _json_error(500, f"the endpoint failed: {exc}")
        client.write_response(response, request=request)
        return True

    def _forward_now(self, request: _Incoming, client: _ClientConnection) -> None:
        """The common case without a task: an engine is active and an idle connection to it is at hand."""
        loop = asyncio.get_running_loop()
        arrived, wall = loop.time(), time.time()
        self.counters["requests"] += 1
        upstream = self._try_acquire(None)
        connection = self._pooled(upstream.base_url, arrived) if upstream is not None else None
        if upstream is None or connection is None:
            if upstream is not None:
                self._release(upstream)
            client.wait_in(self._forward(request, client, arrived, wall))
            return
        lease = _Lease(self, upstream)
        exchange = self._begin(request, client, lease, connection, arrived, wall)

        def answered(done: asyncio.Future[RequestRecord | None]) -> None:
            lease.release()
            record = done.result()
            if record is not None:
                client.request_done(request.keep_alive and record.status != 499)
            elif client.closed:
                client.request_done(False)
            else:  # the kept-alive connection had just been closed by the engine: the careful path retries
                client.wait_in(self._forward(request, client, arrived, wall))

        exchange.done.add_done_callback(answered)

    def _health(self) -> LocalResponse:
        if self._active is not None:
            return LocalResponse.json({"status": "ok", "engine": self._active.engine})
        return LocalResponse.json({"status": "unavailable", "reason": self._down_reason or "starting"}, status=503)

    def _models(self) -> LocalResponse:
        active = self._active
        entry: dict[str, Any] = {"id": self.model_name, "object": "model", "created": int(self.started_at),
                                 "owned_by": "switchyard"}
        if active is not None:
            entry["switchyard"] = {"engine": active.engine, "model": active.model}
        return LocalResponse.json({"object": "list", "data": [entry]})

    async def _forward(self, request: _Incoming, client: _ClientConnection, arrived: float, wall: float) -> bool:
        """Forward with waiting: for an engine to become active, for a fresh connection, and retrying once
        on another engine when the first refuses. Returns `keep` (False when the answer was cut short)."""
        loop = asyncio.get_running_loop()
        deadline = arrived + self.wait_timeout
        avoid: Upstream | None = None
        refused: dict[str, int] = {}
        try:
            return await self._forward_with_retries(request, client, arrived, wall, deadline, avoid, refused)
        except asyncio.CancelledError:  # the client left while its request waited (an exchange records itself)
            self._record(RequestRecord(wall, request.method, request.path, None, 499, False, None,
                                       loop.time() - arrived, None, "the client disconnected"))
            raise

    async def _forward_with_retries(self, request: _Incoming, client: _ClientConnection, arrived: float,
                                    wall: float, deadline: float, avoid: Upstream | None,
                                    refused: dict[str, int]) -> bool:
        loop = asyncio.get_running_loop()
        while True:
            upstream = self._try_acquire(avoid)
            if upstream is None:
                try:
                    upstream = await self._acquire(deadline, avoid)
                except _Unavailable as exc:
                    return self._fail(request, client, wall, arrived, None, 503, f"no engine is serving: {exc}")
            lease = _Lease(self, upstream)
            try:
                record, reused = await self._exchange(request, client, lease, wall, arrived)
            finally:
                lease.release()
            if record is not None:
                return request.keep_alive and record.status != 499
            if reused:
                continue  # a kept-alive connection the engine had just closed: retry on another at once
            # Nothing reached the client yet. Once: a passing hiccup, so retry at once. Again: the engine is
            # stopping or dead, so wait for the endpoint to move on.
            refused[upstream.name] = refused.get(upstream.name, 0) + 1
            if refused[upstream.name] >= 2:
                avoid = upstream
                deadline = min(arrived + self.wait_timeout, loop.time() + self.retry_window)

    async def _exchange(self, request: _Incoming, client: _ClientConnection, lease: _Lease, wall: float,
                        arrived: float) -> tuple[RequestRecord | None, bool]:
        """Forward once: (record, reused). A None record means "nothing reached the client": the caller may
        retry; `reused` says it failed on a kept-alive connection (retry at once) rather than a fresh one."""
        loop = asyncio.get_running_loop()
        upstream = lease.upstream
        target = self._target(upstream)
        connection = self._pooled(upstream.base_url, loop.time())
        reused = connection is not None
        if connection is None:
            connection = _UpstreamConnection(self._pools.setdefault(upstream.base_url, []))
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT):
                    await loop.create_connection(lambda: connection, target.host, target.port)
            except (OSError, TimeoutError) as exc:
                log.info("%s refused a request (%s): retrying", upstream.name, exc or type(exc).__name__)
                return None, False
        exchange = self._begin(request, client, lease, connection, arrived, wall)
        return await exchange.done, reused

    def _begin(self, request: _Incoming, client: _ClientConnection, lease: _Lease,
               connection: _UpstreamConnection, arrived: float, wall: float) -> _Exchange:
        upstream = lease.upstream
        target = self._target(upstream)
        exchange = _Exchange(self, client, request, lease, arrived, wall, connection)
        if client.closed:
            exchange.client_gone()
        else:
            client.exchange = exchange
            connection.begin(exchange, self._upstream_request(request, upstream, target))
        return exchange

    def _target(self, upstream: Upstream) -> _Target:
        target = self._targets.get(upstream.base_url)
        if target is None:
            target = self._targets[upstream.base_url] = _Target.parse(upstream.base_url)
        return target

    def _pooled(self, base_url: str, now: float) -> _UpstreamConnection | None:
        """The most recently used idle connection to `base_url` that is still fresh, if any."""
        pool = self._pools.get(base_url)
        while pool:
            connection = pool.pop()
            if not connection.closed and now - connection.idle_since < POOL_IDLE_SECONDS:
                return connection
            connection.abort()
        return None

    def _upstream_request(self, request: _Incoming, upstream: Upstream, target: _Target) -> bytes:
        body = self._rewrite_model(request.body, upstream)
        dropped = HOP_HEADERS | {"authorization", "x-api-key"}
        connection = request.headers.get("Connection")
        if connection:
            dropped = dropped | {token.strip().lower() for token in connection.split(",")}
        lines = [f"{request.method} {target.prefix}{request.target} HTTP/1.1", f"Host: {target.authority}"]
        lines += [f"{name}: {value}" for name, value in request.headers.items if name.lower() not in dropped]
        if upstream.api_key:
            lines.append(f"Authorization: Bearer {upstream.api_key}")
        if body or request.method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    def _rewrite_model(self, body: bytes, upstream: Upstream) -> bytes:
        """Requests name the stable model; the engine knows its own served name."""
        if not body or b'"model"' not in body:
            return body
        try:
            data = json.loads(body)
        except ValueError:
            return body
        if not isinstance(data, dict) or data.get("model") == upstream.served_model_name:
            return body
        data["model"] = upstream.served_model_name
        return json.dumps(data).encode()

    def _fail(self, request: _Incoming, client: _ClientConnection, wall: float, arrived: float,
              upstream: Upstream | None, status: int, message: str) -> bool:
        now = asyncio.get_running_loop().time()
        self._record(RequestRecord(wall, request.method, request.path, upstream.name if upstream else None,
                                   status, False, None, now - arrived, None, message))
        client.write_response(_json_error(status, message, "upstream_unavailable"), request=request)
        return True

    def _record(self, record: RequestRecord) -> None:
        if record.status != 499 and (record.error is not None or record.status >= 500):
            self.counters["failed"] += 1
        for listener in list(self._listeners):
            try:
                listener(record)
            except Exception:
                log.exception("request listener failed")


def _count_json_tokens(meter: StreamMeter, body: bytes, now: float) -> None:
    """Non-streamed answers: the whole body is the first (and last) token; take the count from usage."""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        return
    if isinstance(data, dict):
        usage = data.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            meter.usage_tokens = usage["completion_tokens"]
            meter.first_token_at = now
