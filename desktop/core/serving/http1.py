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


@dataclass
class Limits:
    """How much one client, and all of them together, may make the endpoint hold.

    While a connection's request is being answered it may read ahead `pipelined` more requests and
    `readahead_bytes` of their bodies; past either, the endpoint stops reading that connection (TCP pushes back
    on the client) until the answer is done. Requests past `pipelined` that were already read (one read can hold
    many small ones) are answered 429; past `queued` across all connections (read ahead or waiting for an engine)
    the answer is 503. Both carry Retry-After.
    """

    pipelined: int = 16
    readahead_bytes: int = 1 << 20
    queued: int = 1024
    retry_after_s: int = 1


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
    headers: tuple[tuple[str, str], ...] = ()  # extra head lines (CORS, Retry-After)

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


def json_error(status: int, message: str, kind: str = "switchyard_error",
               headers: tuple[tuple[str, str], ...] = ()) -> LocalResponse:
    response = LocalResponse.json({"error": {"message": message, "type": kind, "code": status}}, status=status)
    response.headers = headers
    return response


def anthropic_error(status: int, message: str, kind: str = "api_error") -> LocalResponse:
    """An error as Anthropic Messages clients expect it (`/v1/messages`)."""
    return LocalResponse.json({"type": "error", "error": {"type": kind, "message": message}}, status=status)


REASONS = {200: "OK", 204: "No Content", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
           404: "Not Found", 405: "Method Not Allowed", 409: "Conflict", 413: "Content Too Large",
           429: "Too Many Requests", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
           501: "Not Implemented", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}


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
    answer: LocalResponse | None = None  # decided from the head alone (refused, preflight): the handler never sees it
    cors: bytes = b""  # CORS head lines for an allowed Origin, added to whatever answers this request


class ResponseStream(Protocol):
    """The answer being streamed to a client from elsewhere (an engine): told when the client stalls or leaves."""

    def client_gone(self) -> None: ...

    def pause_upstream(self) -> None: ...

    def resume_upstream(self) -> None: ...


class RequestHandler(Protocol):
    """What answers the requests a ClientConnection reads (the endpoint)."""

    connections: set[ClientConnection]
    limits: Limits
    queued: int  # requests read ahead on every connection, plus those waiting for an engine

    def screen(self, method: str, path: str, headers: Headers) -> tuple[LocalResponse | None, bytes]:
        """Judge a request by its head, before any body is read: (an answer that ends it here, or None;
        CORS head lines for its answer). A refused request's body is read and dropped, never kept."""

    def dispatch(self, request: Incoming, client: ClientConnection) -> None:
        """Answer `request`; call client.request_done() when finished, now or later."""


class ClientConnection(asyncio.Protocol):
    """One client's connection: HTTP/1.1 parsed by llhttp, keep-alive, pipelined requests answered in order."""

    def __init__(self, handler: RequestHandler) -> None:
        self.handler = handler
        self.limits = handler.limits
        self.transport: asyncio.Transport | None = None
        self.peer: str | None = None  # the client's address, for the request log
        self.parser = httptools.HttpRequestParser(self)
        self.pending: deque[Incoming] = deque()
        self.pending_bytes = 0  # bodies of the requests in `pending`
        self.worker: asyncio.Task[bool] | None = None  # a request that had to wait (for an engine, a connection)
        self.exchange: ResponseStream | None = None  # the upstream answer now being streamed to this client
        self.busy = False  # a request is being answered; later (pipelined) ones wait in `pending`
        self.current: Incoming | None = None
        self._dispatching = False
        self.closed = False
        self.reading_paused = False  # read-ahead is full: TCP holds the client back
        self.rejected: tuple[int, str] | None = None
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._head: Headers | None = None
        self._method = ""
        self._answer: LocalResponse | None = None
        self._cors = b""
        self._answered_early = False
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
        self._drop_pending()
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
        self._head = None
        self._answer = None
        self._cors = b""
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
        """The head is complete: judge it now (origin, API key, queue room), before any body is kept."""
        head = self._head = Headers(self._headers)
        method = self._method = self.parser.get_method().decode("ascii", "replace")
        answer, self._cors = self.handler.screen(method, self._url.decode("latin-1").partition("?")[0], head)
        retry_after = (("Retry-After", str(self.limits.retry_after_s)),)
        if answer is None and len(self.pending) >= self.limits.pipelined:
            answer = json_error(429, f"more than {self.limits.pipelined} pipelined requests on one connection",
                                "rate_limit_error", retry_after)
        elif answer is None and (self.busy or self.pending) and self.handler.queued >= self.limits.queued:
            answer = json_error(503, f"the endpoint already holds {self.limits.queued} queued requests",
                                "overloaded_error", retry_after)
        self._answer = answer
        self._answered_early = False
        idle = not self.busy and not self.pending and self.transport is not None
        if answer is not None and idle:
            # Nothing earlier to answer first: say it now, so a client never sends a body only to be refused.
            self._answered_early = True
            self.write_response(answer, close=not self.parser.should_keep_alive(), cors=self._cors)
        elif answer is None and idle and head.get("Expect").lower() == "100-continue":
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._answer is not None:
            return  # answered from its head: the body is read (to keep the connection in step) and dropped
        self._body_size += len(body)
        if self._body_size > MAX_BODY_BYTES:
            self._refuse(413, f"request body over {MAX_BODY_BYTES >> 20} MiB")
        self._body.append(body)
        if (self.busy or self.pending) and not self.reading_paused and \
                self._body_size + self.pending_bytes > self.limits.readahead_bytes:
            self._pause_reading()

    def on_message_complete(self) -> None:
        if self._answered_early:  # its body was read and dropped
            if not self.parser.should_keep_alive() and self.transport is not None:
                self.transport.close()
            return
        target = self._url.decode("latin-1")
        path, _, query = target.partition("?")
        body = b"".join(self._body) if self._body else b""
        self._body = []
        self._body_size = 0
        self.pending.append(Incoming(
            method=self._method, target=target, path=path, query=query,
            headers=self._head or Headers(self._headers), body=body, keep_alive=self.parser.should_keep_alive(),
            http10=self.parser.get_http_version() == "1.0", answer=self._answer, cors=self._cors))
        self.pending_bytes += len(body)
        self.handler.queued += 1
        if not self.busy:
            self._next()
        elif not self.reading_paused and (len(self.pending) >= self.limits.pipelined
                                          or self.pending_bytes > self.limits.readahead_bytes):
            self._pause_reading()

    # --- flow control towards the client ---
    def _pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.reading_paused = True
            self.transport.pause_reading()

    def _maybe_resume_reading(self) -> None:
        if not self.reading_paused or self.closed or self.transport is None:
            return
        if (not self.busy and not self.pending) or (len(self.pending) < self.limits.pipelined and
                                                    self.pending_bytes + self._body_size <= self.limits.readahead_bytes):
            self.reading_paused = False
            self.transport.resume_reading()

    def _pop(self) -> Incoming:
        request = self.pending.popleft()
        self.pending_bytes -= len(request.body)
        self.handler.queued -= 1
        return request

    def _drop_pending(self) -> None:
        self.handler.queued -= len(self.pending)
        self.pending.clear()
        self.pending_bytes = 0

    # --- answering ---
    def _reject(self, status: int, message: str) -> None:
        """A request we cannot read: answer once (if nothing else is being answered) and close."""
        if self.rejected is not None:
            return
        self.rejected = (status, message)
        self._drop_pending()
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
                self.current = request = self._pop()
                self.busy = True
                if request.answer is not None:
                    self.write_response(request.answer, request=request)
                    self.request_done(True)
                    continue
                try:
                    self.handler.dispatch(request, self)
                except Exception:
                    log.exception("the endpoint failed a request to %s", request.path)
                    self.request_done(False)
        finally:
            self._dispatching = False
        self._maybe_resume_reading()

    def request_done(self, keep: bool) -> None:
        """The current request is answered; `keep` False closes the connection (the answer was cut short)."""
        self.busy = False
        self.worker = None
        if self.closed or self.transport is None:
            return
        current, self.current = self.current, None  # its body is no longer needed here
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

    def write_response(self, response: LocalResponse, close: bool = False, request: Incoming | None = None,
                       cors: bytes | None = None) -> None:
        if self.closed or self.transport is None:
            return
        head = [f"HTTP/1.1 {response.status} {REASONS.get(response.status, 'Status')}"]
        if response.status != 204:  # a 204 has no body and says nothing about one (RFC 9110 §8.6)
            head += [f"Content-Type: {response.content_type}", f"Content-Length: {len(response.body)}"]
        head += [f"{name}: {value}" for name, value in response.headers]
        if close or (request is not None and not request.keep_alive):
            head.append("Connection: close")
        body = b"" if request is not None and request.method == "HEAD" else response.body
        if cors is None:
            cors = request.cors if request is not None else b""
        self.transport.write(("\r\n".join(head) + "\r\n").encode("latin-1") + cors + b"\r\n" + body)
