"""The endpoint's HTTP/1.1 transport: client connections parsed by llhttp (httptools), keep-alive, pipelined
requests answered in order, size limits, and the small request/response types of routes the endpoint answers
itself.

Why hand-written on asyncio protocols rather than a web framework: on a CPU-bound workstation every cycle the
endpoint spends is taken from the engine, and under concurrent load its per-request latency is serialized across
requests. A framework wakes a coroutine per streamed chunk; here a chunk is parsed in C and written to the client
in the same callback (benchmarks/bench_proxy.py measures the cost against direct engine access).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, cast

import httptools

log = logging.getLogger("switchyard.proxy")

# Headers that describe one hop, not the message: never forwarded as they came (RFC 9110 §7.6.1); the proxy
# writes its own framing (Host, Content-Length or chunked) for each side.
HOP_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length", "expect",
})
MAX_HEAD_BYTES = 64 * 1024  # request line + headers
MAX_BODY_BYTES = 64 * 1024 * 1024


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed (a fraction of asyncio's CPU per streamed chunk: on a CPU-bound box every cycle
    the proxy spends is taken from the engine), else the standard loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


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
    headers: tuple[tuple[str, str], ...] = ()  # extra ones, e.g. Retry-After

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


def json_error(status: int, message: str, kind: str = "switchyard_error") -> LocalResponse:
    return LocalResponse.json({"error": {"message": message, "type": kind, "code": status}}, status=status)


def anthropic_error(status: int, message: str, kind: str = "api_error") -> LocalResponse:
    """An error as Anthropic Messages clients expect it (`/v1/messages`)."""
    return LocalResponse.json({"type": "error", "error": {"type": kind, "message": message}}, status=status)


REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
           409: "Conflict", 413: "Content Too Large", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 501: "Not Implemented", 502: "Bad Gateway", 503: "Service Unavailable"}


@dataclass
class Incoming:
    """One complete request read from a client connection."""

    method: str
    target: str  # as sent: path and query
    path: str
    query: str
    headers: Headers
    body: bytes
    keep_alive: bool
    http10: bool
    seq: int = 0  # the endpoint's number for a forwarded request (the request log's key)


class ResponseStream(Protocol):
    """The answer being streamed to a client from elsewhere (an engine): told when the client stalls or leaves."""

    def client_gone(self) -> None: ...

    def pause_upstream(self) -> None: ...

    def resume_upstream(self) -> None: ...


class RequestHandler(Protocol):
    """What answers the requests a ClientConnection reads (the endpoint)."""

    connections: set[ClientConnection]

    def dispatch(self, request: Incoming, client: ClientConnection) -> None:
        """Answer `request`; call client.request_done() when finished, now or later."""


class ClientConnection(asyncio.Protocol):
    """One client's connection: HTTP/1.1 parsed by llhttp, keep-alive, pipelined requests answered in order."""

    def __init__(self, handler: RequestHandler) -> None:
        self.handler = handler
        self.transport: asyncio.Transport | None = None
        self.peer: str | None = None  # the client's address, for the request log
        self.parser = httptools.HttpRequestParser(self)
        self.pending: deque[Incoming] = deque()
        self.worker: asyncio.Task[bool] | None = None  # a request that had to wait (for an engine, a connection)
        self.exchange: ResponseStream | None = None  # the upstream answer now being streamed to this client
        self.busy = False  # a request is being answered; later (pipelined) ones wait in `pending`
        self.current: Incoming | None = None
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
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else None
        self.handler.connections.add(self)

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
        self.handler.connections.discard(self)
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
        self.pending.append(Incoming(
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
            self.write_response(json_error(status, message, "invalid_request_error"), close=True)
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
                    self.handler.dispatch(self.current, self)
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

    def write_response(self, response: LocalResponse, close: bool = False, request: Incoming | None = None
                       ) -> None:
        if self.closed or self.transport is None:
            return
        head = [f"HTTP/1.1 {response.status} {REASONS.get(response.status, 'Status')}",
                f"Content-Type: {response.content_type}", f"Content-Length: {len(response.body)}"]
        head += [f"{name}: {value}" for name, value in response.headers]
        if close or (request is not None and not request.keep_alive):
            head.append("Connection: close")
        body = b"" if request is not None and request.method == "HEAD" else response.body
        self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
