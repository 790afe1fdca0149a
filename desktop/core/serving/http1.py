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
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, cast

import httptools

from desktop.core.serving.guard import Guard, peer_class
from desktop.core.serving.limits import Limits as Limits  # re-exported: its import path before limits.py
from desktop.core.serving.requestinfo import NO_INFO, RequestInfo

log = logging.getLogger("switchyard.proxy")

# Headers that describe one hop, not the message: never forwarded as they came (RFC 9110 §7.6.1); the proxy
# writes its own framing (Host, Content-Length or chunked) for each side.
HOP_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length", "expect",
})
MAX_HEAD_BYTES = 64 * 1024  # request line + headers
MAX_BODY_BYTES = 64 * 1024 * 1024
# A request refused from its head with a body still to come: the answer is sent, then at most this much of the body
# is read and dropped, for at most this long (so the client reads the answer, not a reset), and the connection ends.
LINGER_BYTES = 4096
LINGER_S = 2.0


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
    token: str | None = None  # the control token its requests must show in their head (checked by the screen)


def json_error(status: int, message: str, kind: str = "switchyard_error",
               headers: tuple[tuple[str, str], ...] = ()) -> LocalResponse:
    response = LocalResponse.json({"error": {"message": message, "type": kind, "code": status}}, status=status)
    response.headers = headers
    return response


def ollama_error(status: int, message: str, kind: str = "") -> LocalResponse:
    """An error as Ollama's clients read it (`/api/*`): `{"error": "..."}` (the official client raises it)."""
    return LocalResponse.json({"error": message}, status=status)


def anthropic_error(status: int, message: str, kind: str = "api_error") -> LocalResponse:
    """An error as Anthropic Messages clients expect it (`/v1/messages`)."""
    return LocalResponse.json({"type": "error", "error": {"type": kind, "message": message}}, status=status)


REASONS = {200: "OK", 204: "No Content", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
           404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict",
           413: "Content Too Large", 429: "Too Many Requests", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 501: "Not Implemented", 502: "Bad Gateway", 503: "Service Unavailable",
           504: "Gateway Timeout"}


def overloaded(limits: Limits, message: str, status: int = 503) -> LocalResponse:
    """The endpoint holds all it may (queued requests, buffered bodies, connections): come back shortly."""
    return json_error(status, message, "overloaded_error" if status == 503 else "rate_limit_error",
                      (("Retry-After", str(limits.retry_after_s)),))


def queue_full(limits: Limits) -> str:
    """The one wording of "every queued-request slot is taken" (said from a head, or while waiting)."""
    return f"the endpoint already holds {limits.queued} queued requests"


def encode_response(response: LocalResponse, close: bool, head_only: bool, cors: bytes) -> bytes:
    head = [f"HTTP/1.1 {response.status} {REASONS.get(response.status, 'Status')}"]
    if response.status != 204:  # a 204 has no body and says nothing about one (RFC 9110 §8.6)
        head += [f"Content-Type: {response.content_type}", f"Content-Length: {len(response.body)}"]
    head += [f"{name}: {value}" for name, value in response.headers]
    if close:
        head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n").encode("latin-1") + cors + b"\r\n" + (b"" if head_only else response.body)


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
    held: int = 0  # body bytes reserved in the endpoint's budget (Guard) until the request is answered
    info: RequestInfo = NO_INFO  # the body's model and stream, read once at dispatch
    shape: Any = None  # serving.normalize.Shape: the parsed body the rules shape for each engine (their routes)
    ollama: Any = None  # serving.ollama.OllamaCall: an Ollama request, sent on as OpenAI's, answered as Ollama's
    reasoning: str = "auto"  # its route's reasoning setting (serving.normalize rule 6)


class ResponseStream(Protocol):
    """The answer being streamed to a client from elsewhere (an engine): told when the client stalls or leaves."""

    def client_gone(self) -> None: ...

    def pause_upstream(self) -> None: ...

    def resume_upstream(self) -> None: ...


class RequestHandler(Protocol):
    """What answers the requests a ClientConnection reads (the endpoint)."""

    connections: set[ClientConnection]
    limits: Limits
    guard: Guard
    queued: int  # requests read ahead on every connection (not answered in advance), plus those waiting for an engine

    def screen(self, method: str, path: str, headers: Headers) -> tuple[LocalResponse | None, bytes, bool]:
        """Judge a request by its head, before any body is read: (an answer that ends it here, or None;
        CORS head lines for its answer; whether it showed a credential, which makes its connection trusted).
        A refused request's body is never kept."""

    def dispatch(self, request: Incoming, client: ClientConnection) -> None:
        """Answer `request`; call client.request_done() when finished, now or later."""


def conformance(method: str, target: bytes, headers: list[tuple[str, str]], http10: bool,
                upgrade: bool) -> str | None:
    """Why a request head is refused with a 400 before anything else looks at it (RFC 9112), or None: exactly
    one Host on HTTP/1.1 (at most one on 1.0), an origin-form target, no protocol upgrade and no CONNECT."""
    hosts = sum(1 for name, _ in headers if name.lower() == "host")
    if hosts > 1 or (hosts == 0 and not http10):
        return "a request must carry exactly one Host header"
    if not target.startswith(b"/"):
        return "only origin-form request targets ('/v1/...') are accepted"
    if method == "CONNECT" or upgrade:
        return "protocol upgrades and CONNECT are not supported by the endpoint"
    return None


class RequestReader(asyncio.Protocol):
    """Reading requests off one client connection within the front end's bounds (ClientConnection answers them).

    The head limit counts from a message's first byte: while a head (or a chunked body's framing and trailers)
    is arriving, data is fed to the parser at most up to what is left of MAX_HEAD_BYTES, and what it cannot have
    consumed otherwise counts against the limit, so a header line that never ends is refused at 64 KiB instead
    of growing inside the parser. Heads, silent bodies and idle keep-alive waits time out (check_time)."""

    def __init__(self, handler: RequestHandler) -> None:
        self.handler = handler
        self.limits = handler.limits
        self.guard = handler.guard
        self.transport: asyncio.Transport | None = None
        self.peer: str | None = None  # the client's address, for the request log
        self.peer_host = ""
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
        self.write_paused = False  # the client has not read its answers (write buffer over its mark)
        self.lingering = False  # refused from its head: a few KiB of its body are dropped, then it closes
        self.trusted = False  # a request of it showed its credential (the key, where one is set): evicted last
        self._reading_off = False  # the transport's reading is paused (for read-ahead or for writes)
        self._paused_since = 0.0
        self._write_since = 0.0  # when the client stopped reading its answers
        self._lingered = 0
        self._drain: asyncio.TimerHandle | None = None  # a closing connection's flush deadline
        self.ended = False  # nothing more is read: what is pending is answered, then the connection closes
        self.rejected = False  # refused as unreadable: answered once and closed
        self.phase = "idle"  # "idle" (between requests), "head", "body": what check_time() times
        self.since = time.monotonic()
        self._in_head = True  # the parser is in (or before) a head: its bytes count against MAX_HEAD_BYTES
        self._chunked = False  # a chunked body is arriving: its framing and trailers count likewise
        self._overhead = 0  # head (or chunk framing) bytes fed for the current message, at most
        self._seen = 0  # bytes of the piece being fed that callbacks accounted for (at least)
        self._begin_seen = -1  # _seen when a message began (or the one before ended) within the piece being fed
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
        self._held = 0  # budget reserved for the body being read (as its bytes arrive)
        self._body_start = 0.0  # when the body began (moved on by time the endpoint held reading back)
        self._window_at = 0.0  # when the body's current rate window began (0: not yet, during its grace)
        self._window_size = 0  # the body's size then
        self._declared = 0  # the Content-Length of the message being read

    def data_received(self, data: bytes) -> None:
        if self.lingering:  # the body of a refused request: dropped, a few KiB at most
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES:
                self.abort()
            return
        view = memoryview(data)
        while view and not self.ended:
            if self._in_head or self._chunked:
                room = MAX_HEAD_BYTES - self._overhead
                if room <= 0:
                    what = "request headers" if self._in_head else "chunk framing and trailers"
                    self._reject(431, f"{what} over {MAX_HEAD_BYTES // 1024} KiB")
                    return
                piece, view = view[:room], view[room:]
            else:
                piece, view = view, view[:0]
            self._seen, self._begin_seen = 0, -1
            try:
                self.parser.feed_data(piece)
            except httptools.HttpParserCallbackError:
                if not self.ended:
                    raise
                return
            except httptools.HttpParserUpgrade:  # refused in on_headers_complete; kept as a second line
                self._reject(400, "protocol upgrades are not supported by the endpoint")
                return
            except httptools.HttpParserError as exc:
                self._reject(400, f"malformed HTTP request: {exc}")
                return
            if self._in_head:  # what this piece may have added to an unfinished head, at most
                self._overhead = len(piece) - self._begin_seen if self._begin_seen >= 0 else \
                    self._overhead + len(piece)
            elif self._chunked:
                self._overhead = len(piece) - self._seen if self._seen else self._overhead + len(piece)

    def eof_received(self) -> bool | None:
        return None  # a half-closed client is treated as gone: the transport closes and connection_lost follows

    def close_quietly(self) -> None:
        self.ended = True
        self.close()

    def close(self) -> None:
        """End the connection: what is written is flushed for at most `drain_s`, then the socket is dropped (a
        plain close waits for ever for a client that reads nothing)."""
        transport = self.transport
        if transport is None or self.closed:
            return
        unsent = transport.get_write_buffer_size()
        transport.close()
        if unsent and self._drain is None:
            self._drain = asyncio.get_running_loop().call_later(self.limits.drain_s, self.abort)

    def abort(self) -> None:
        """Drop the socket now, whatever is unsent (connection_lost follows within this loop iteration)."""
        self.ended = True
        if self.transport is not None and not self.closed:
            self.transport.abort()

    def on_message_begin(self) -> None:
        self._begin_seen = self._seen
        self._in_head = True
        self._url = b""
        self._headers = []
        self._head = None
        self._answer = None
        self._cors = b""
        self._body = []
        self._head_size = self._body_size = self._declared = 0
        self.phase, self.since = "head", time.monotonic()

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._seen += len(url)
        self._head_size += len(url)
        if self._head_size > MAX_HEAD_BYTES:
            self._refuse(431, "the request line is too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # a chunked body's trailer: never forwarded (the head was screened without it)
        self._seen += len(name) + len(value) + 3
        self._head_size += len(name) + len(value) + 4
        if self._head_size > MAX_HEAD_BYTES:
            self._refuse(431, f"request headers over {MAX_HEAD_BYTES // 1024} KiB")
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_chunk_header(self) -> None:
        self._seen += 5  # at least "N\r\n" and the CRLF after the chunk's data

    def on_body(self, body: bytes) -> None:
        self._seen += len(body)
        self._body_size += len(body)
        if self._body_size > MAX_BODY_BYTES:
            self._refuse(413, f"request body over {MAX_BODY_BYTES >> 20} MiB")
        if self._body_size > self._held:  # reserved as it arrives, not as declared
            if not self.guard.reserve(self._body_size - self._held):
                self._refuse(503, f"the endpoint holds {self.limits.body_budget >> 20} MiB of request bodies "
                                  "already", overloaded(self.limits, "the endpoint holds too many request bodies"))
            self._held = self._body_size
        self._body.append(body)
        if (self.busy or self.pending) and not self.reading_paused and \
                self._body_size + self.pending_bytes > self.limits.readahead_bytes:
            self._pause_reading()

    def _pause_reading(self) -> None:
        self.reading_paused = True
        self._sync_reading()

    def _maybe_resume_reading(self) -> None:
        if not self.reading_paused or self.closed or self.transport is None or self.ended:
            return
        if (not self.busy and not self.pending) or (len(self.pending) + self.busy < self.limits.pipelined and
                                                    self.pending_bytes + self._body_size <= self.limits.readahead_bytes):
            self.reading_paused = False
            self._sync_reading()

    def _sync_reading(self) -> None:
        """Read from the client only while neither its read-ahead nor its unread answers are full (an ended
        connection is never read again)."""
        transport = self.transport
        if transport is None or self.closed:
            return
        off = self.reading_paused or self.write_paused
        if off == self._reading_off or (not off and self.ended):
            return
        self._reading_off = off
        now = time.monotonic()
        if off:
            self._paused_since = now
            transport.pause_reading()
        else:
            self._body_start += now - self._paused_since
            self._window_at = 0.0  # a fresh rate window: the endpoint held this body back
            transport.resume_reading()

    def _pop(self) -> Incoming:
        request = self.pending.popleft()
        self.pending_bytes -= len(request.body)
        if request.answer is None:
            self.handler.queued -= 1
        return request

    def _release(self, request: Incoming) -> None:
        """The request is answered: its body leaves the budget."""
        if request.held:
            self.guard.free(request.held)
            request.held = 0

    def _free_message(self) -> None:
        if self._held:
            self.guard.free(self._held)
            self._held = 0
        self._body = []

    def _drop_pending(self) -> None:
        while self.pending:
            self._release(self._pop())
        self.pending_bytes = 0

    def _reject(self, status: int, message: str, answer: LocalResponse | None = None) -> None:
        """A request we cannot read (or will not wait for): answer once, if nothing else is being answered,
        and close."""
        if self.rejected:
            return
        self.rejected = self.ended = True
        self._drop_pending()
        self._free_message()
        if self.transport is not None and not self.closed:
            if not self.busy and not self._answered_early:
                self.write_response(answer or json_error(status, message, "invalid_request_error"), close=True)
            if not self.busy:
                if self.phase == "body" and (self._chunked or self._declared):  # a body is still to come
                    self._linger()
                else:
                    self.close()

    def _linger(self) -> None:
        """Answered while its body is still coming: end our side (the client reads the answer, then an end of
        file), read and drop at most LINGER_BYTES of what follows for at most LINGER_S, then drop the socket
        (data_received, check_time). Closing at once would reset the connection under the unread body, and the
        client could lose the answer."""
        transport = self.transport
        self.lingering = self.ended = True
        self.phase, self.since = "linger", time.monotonic()
        if transport is None or self.closed:
            return
        if self._reading_off:
            self.close()
            return
        try:
            transport.write_eof()
        except (OSError, RuntimeError, NotImplementedError):
            self.close()

    def _refuse(self, status: int, message: str, answer: LocalResponse | None = None) -> None:
        """_reject() from inside a parser callback, which also stops the parser (caught in data_received)."""
        self._reject(status, message, answer)
        raise httptools.HttpParserCallbackError(message)

    def write_response(self, response: LocalResponse, close: bool = False, request: Incoming | None = None,
                       cors: bytes | None = None) -> None:
        if self.closed or self.transport is None:
            return
        if cors is None:
            cors = request.cors if request is not None else b""
        self.transport.write(encode_response(response, close or (request is not None and not request.keep_alive),
                                             request is not None and request.method == "HEAD", cors))

    # --- what answering adds (ClientConnection) ---
    def on_headers_complete(self) -> None:
        raise NotImplementedError

    def on_message_complete(self) -> None:
        raise NotImplementedError



class ClientConnection(RequestReader):
    """One client's connection: HTTP/1.1 parsed by llhttp (httptools), keep-alive, pipelined requests answered
    in order, every byte it makes the endpoint hold bounded (Limits, Guard)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        self.transport.set_write_buffer_limits(high=self.limits.write_buffer_bytes,
                                               low=self.limits.write_buffer_bytes // 4)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else None
        self.peer_host = peer_class(str(peer[0])) if isinstance(peer, tuple) and peer else ""
        if not self.guard.admit(self):
            self.ended = self.closed = True
            self.transport.write(encode_response(overloaded(self.limits, "the endpoint holds all the connections "
                                                                         "it may; retry shortly"), True, False, b""))
            self.transport.abort()  # never held: a client that does not read the 503 cannot keep the socket
            return
        self.handler.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._drain is not None:
            self._drain.cancel()
            self._drain = None
        self.handler.connections.discard(self)
        self.guard.forget(self)
        self._drop_pending()
        self._free_message()
        if self.exchange is not None:
            self.exchange.client_gone()
        elif self.worker is not None and not self.worker.done():
            self.worker.cancel()  # still waiting for an engine: nobody is left to answer

    def pause_writing(self) -> None:
        """The client reads its answers slower than they come: stop reading it (requests it sent wait unparsed
        in TCP) and the engine's stream, until it catches up (resume_writing) or the idle timeout drops it."""
        self.write_paused, self._write_since = True, time.monotonic()
        self._sync_reading()
        if self.exchange is not None:
            self.exchange.pause_upstream()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.exchange is not None:
            self.exchange.resume_upstream()
        self._sync_reading()
        if not self.busy and self.pending:
            self._next()

    def evictable(self) -> bool:
        """Nothing is being answered or held for it (a refused request's lingering body is not; a body from a
        connection that never showed its credential is not worth keeping): closing it loses no request of a
        client who showed one."""
        return not self.busy and not self.pending and not self.closed and \
            (self.phase != "body" or not self.trusted)

    def check_time(self, now: float) -> None:
        """Close a connection whose head, body, keep-alive wait or unread answers ran past its timeout."""
        limits = self.limits
        if self.closed:
            return
        if self.write_paused and now - self._write_since >= limits.idle_timeout_s:
            log.info("dropped a client that read none of its answers for %g s", limits.idle_timeout_s)
            self.abort()
            return
        if self.lingering:
            if now - self.since >= LINGER_S:
                self.abort()
            return
        if self._reading_off:  # held back by the endpoint: its time does not count against the client
            return
        if self.phase == "head" and now - self.since >= limits.head_timeout_s:
            self._reject(408, f"the request head did not arrive within {limits.head_timeout_s:g} s")
        elif self.phase == "body":
            self._check_body(now)
        elif self.phase == "idle" and not self.busy and not self.pending and \
                now - self.since >= limits.idle_timeout_s:
            self.close_quietly()

    def _check_body(self, now: float) -> None:
        """A body past its grace must arrive at the minimum rate on average since its head and within each grace
        period since (so bytes sent first buy no stalling later), and all of it within `body_timeout_s`."""
        limits = self.limits
        elapsed = now - self._body_start
        slow = f"the request body arrived slower than {limits.body_min_rate / 1024:g} KiB/s"
        if elapsed >= limits.body_timeout_s:
            self._reject(408, f"the request body did not arrive within {limits.body_timeout_s:g} s")
        elif elapsed < limits.body_grace_s:
            return
        elif self._body_size < limits.body_min_rate * (elapsed - limits.body_grace_s):
            self._reject(408, slow)
        elif not self._window_at:
            self._window_at, self._window_size = now, self._body_size
        elif now - self._window_at >= limits.body_grace_s:
            if self._body_size - self._window_size < limits.body_min_rate * (now - self._window_at):
                self._reject(408, slow + " (it stalled)")
            else:
                self._window_at, self._window_size = now, self._body_size

    def on_headers_complete(self) -> None:
        """The head is complete: judge it now (conformance, origin, API key, room), before any body is kept."""
        parser = self.parser
        method = self._method = parser.get_method().decode("ascii", "replace")
        self._seen += len(method) + 14
        self._in_head, self._overhead = False, 0
        self.phase, self.since = "body", time.monotonic()
        self._body_start, self._window_at = self.since, 0.0
        head = self._head = Headers(self._headers)
        self._chunked = "chunked" in head.get("Transfer-Encoding").lower()
        refusal = conformance(method, self._url, self._headers, parser.get_http_version() == "1.0",
                              parser.should_upgrade())
        if refusal is not None:
            self._refuse(400, refusal)
        try:
            length = int(head.get("Content-Length") or 0)  # llhttp has checked it is one plain number
        except ValueError:
            length = 0
        self._declared = length
        answer, self._cors, credentialed = self.handler.screen(method, self._url.decode("latin-1").partition("?")[0],
                                                               head)
        if length > MAX_BODY_BYTES:  # refused, and never drained: the connection ends with the answer
            self._refuse(413, f"request body over {MAX_BODY_BYTES >> 20} MiB", answer)
        if len(self.pending) + self.busy >= self.limits.pipelined:
            self._last(overloaded(self.limits, f"more than {self.limits.pipelined} pipelined requests on one "
                                               "connection", 429))
        if answer is None and (self.busy or self.pending) and self.handler.queued >= self.limits.queued:
            answer = overloaded(self.limits, queue_full(self.limits))
        if answer is None and length and not self.guard.has_room(length):
            answer = overloaded(self.limits, f"the endpoint holds {self.limits.body_budget >> 20} MiB of request "
                                             "bodies already")
        self.trusted = self.trusted or (answer is None and credentialed)
        self._answer = answer
        self._answered_early = False
        idle = not self.busy and not self.pending and not self.write_paused and self.transport is not None
        if answer is not None and (length or self._chunked):
            # Refused with a body to come: it is never read. Answered now (or after those before it), and the
            # connection ends there.
            if not idle:
                self._last(answer)
            self._answered_early = True
            self.write_response(answer, close=True, cors=self._cors)
            self._linger()
            raise httptools.HttpParserCallbackError("refused from its head")
        if answer is not None and idle:
            # Nothing earlier to answer first: say it now, so a client never sends a body only to be refused.
            self._answered_early = True
            self.write_response(answer, close=not parser.should_keep_alive(), cors=self._cors)
            if not parser.should_keep_alive():
                self._refuse(answer.status, "answered from its head")
        elif answer is None and idle and head.get("Expect").lower() == "100-continue":
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_message_complete(self) -> None:
        self._in_head, self._chunked, self._overhead = True, False, 0
        self._begin_seen = self._seen  # what follows in this piece belongs to the next head, at most
        self.phase, self.since = "idle", time.monotonic()
        if self._answered_early:  # its body was read and dropped
            return
        target = self._url.decode("latin-1")
        path, _, query = target.partition("?")
        body = b"".join(self._body) if self._body else b""
        self._body = []
        self._body_size = 0
        held, self._held = self._held, 0
        self.pending.append(Incoming(
            method=self._method, target=target, path=path, query=query,
            headers=self._head or Headers(self._headers), body=body, keep_alive=self.parser.should_keep_alive(),
            http10=self.parser.get_http_version() == "1.0", answer=self._answer, cors=self._cors, held=held))
        self.pending_bytes += len(body)
        if self._answer is None:
            self.handler.queued += 1
        if not self.busy:
            self._next()
        if self.pending and not self.reading_paused and (len(self.pending) + self.busy >= self.limits.pipelined
                                                         or self.pending_bytes > self.limits.readahead_bytes):
            self._pause_reading()  # answers waiting on an engine, or on a client that does not read them

    def _last(self, answer: LocalResponse) -> None:
        """Past the pipelining cap, or refused from its head with a body while earlier answers are outstanding:
        this request is answered `answer` after those before it, and the connection ends there (nothing more is
        read or parsed; its body is never read)."""
        self.ended = True
        self.pending.append(Incoming(self._method, "", "", "", self._head or Headers([]), b"", keep_alive=False,
                                     http10=False, answer=answer, cors=self._cors))
        self._pause_reading()
        if not self.busy:
            self._next()
        raise httptools.HttpParserCallbackError("past the pipelining cap")

    def _next(self) -> None:
        """Answer pending requests in order. Most are answered (or forwarded) right here, inside the callback
        that read them: no task, no loop iteration between a request's last byte and the engine."""
        if self._dispatching:
            return  # request_done() was called from inside dispatch: the loop below carries on
        self._dispatching = True
        try:
            while self.pending and not self.busy and not self.closed and not self.write_paused:
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
        current, self.current = self.current, None  # its body is no longer needed here
        if current is not None:
            self._release(current)
        if self.closed or self.transport is None:
            return
        if not keep or current is None or not current.keep_alive or (self.ended and not self.pending):
            self.close()
            return
        self.since = time.monotonic()
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
