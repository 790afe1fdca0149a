"""The endpoint's side towards the engines: kept-alive connections pooled per engine, and the exchange that
forwards one request on such a connection and streams the engine's answer to the client as it arrives (what
that answer becomes on its way: serving.relay)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

from desktop.core.common import unixhttp
from desktop.core.common.errors import SwitchyardError
from desktop.core.common.sse import LAST_CHUNK, chunk, error_event
from desktop.core.serving import normalize, ollama
from desktop.core.serving.defaults import DEFAULT_FIRST_BYTE_TIMEOUT, DEFAULT_IDLE_TIMEOUT
from desktop.core.serving.http1 import HOP_HEADERS, ClientConnection, Incoming, json_error, ollama_error
from desktop.core.serving.metering import RequestListener, RequestRecord, StreamMeter, count_json_tokens
from desktop.core.serving.relay import ResponseRelay, adjusted
from desktop.core.serving.requestinfo import rewrite_model
from desktop.core.serving.router import Lease, Upstream

log = logging.getLogger("switchyard.proxy")

# Methods whose repetition has the effect of one (RFC 9110 §9.2.2): the only ones retried once the engine may
# have received them.
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
# Idle connections to an engine are reused for this long: well under the 5 s after which llama-server
# (cpp-httplib) and vLLM (uvicorn) close them, so the race with their close is rare (and retried when it happens).
POOL_IDLE_SECONDS = 2.0
POOL_MAX_IDLE = 64


class _Spent:
    """What a finished exchange's parser points at instead of the exchange (see Exchange._finish)."""


_SPENT_PARSER = httptools.HttpResponseParser(_Spent())


@dataclass(frozen=True)
class Timeouts:
    """How long the endpoint waits on an engine before giving up on a request (seconds).

    `first_byte` runs from the request's start to the engine's first response byte: a non-streamed answer
    arrives whole, so it bounds a whole generation on a slow CPU and is generous. `idle` is the longest silence
    once the answer started (a stream's gap between tokens, a long prompt's prefill). A request that runs out gets
    a 504 (or, mid-stream, an error event) and its engine connection is aborted, which cancels it in the engine.
    """

    connect: float = 10.0
    first_byte: float = DEFAULT_FIRST_BYTE_TIMEOUT
    idle: float = DEFAULT_IDLE_TIMEOUT


@dataclass(frozen=True)
class Target:
    """Where an upstream's base URL points, parsed once. Engines are local processes: plain HTTP."""

    host: str
    port: int
    prefix: str
    authority: str

    @classmethod
    def parse(cls, base_url: str) -> Target:
        parts = urlsplit(base_url)
        if parts.scheme == unixhttp.SCHEME:  # an engine on a Unix socket (desktop.core.common.unixhttp): port 0
            return cls(unixhttp.socket_of(base_url) or "", 0, parts.path.rstrip("/"), unixhttp.NOMINAL_HOST)
        if parts.scheme != "http":
            raise SwitchyardError(f"the endpoint forwards to local engines over http://, not {base_url}")
        return cls(parts.hostname or "127.0.0.1", parts.port or 80, parts.path.rstrip("/"), parts.netloc)


class Pool:
    """Idle kept-alive connections to one engine, and what the engine showed about keeping them.

    llama-server (cpp-httplib) closes its connection right after a chunked (streamed) answer although the answer
    says `Keep-Alive`; a connection pooled after one is dead a few µs later. Seen once (it closed idle, or was
    found readable at reuse), such connections are no longer pooled for that engine: reusing one would send a
    request into a closing connection, which then cannot be retried safely. Engines that keep them (vLLM) keep
    the pool's speed.
    """

    __slots__ = ("closes_after_chunked", "idle")

    def __init__(self) -> None:
        self.idle: list[UpstreamConnection] = []
        self.closes_after_chunked = False


class UpstreamConnection(asyncio.Protocol):
    """A connection to an engine, kept alive between requests: connecting afresh costs the proxy's one thread
    ~0.2 ms per request, and under a burst of concurrent requests every client waits on the sum of those."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.closed = False
        self.idle_since = 0.0
        self.reused = False  # it carried an earlier request (the engine may close it while idle)
        self.unsent = False  # part of the current request is still in our buffer: the engine cannot have it all
        self.after_chunked = False  # idle after a chunked answer (see Pool)
        self._readable: Callable[[], bool] = _always

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        # pause_writing/resume_writing as soon as anything is buffered/once all is handed to the kernel: they
        # tell whether the engine can have received the whole request (see Exchange.connection_lost).
        self.transport.set_write_buffer_limits(high=0, low=0)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            self._readable = readiness(sock.fileno())

    def pause_writing(self) -> None:
        self.unsent = True

    def resume_writing(self) -> None:
        self.unsent = False

    def data_received(self, data: bytes) -> None:
        if self.exchange is not None:
            self.exchange.data_received(data)
        else:  # bytes nobody asked for: this connection cannot be trusted with another request
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed and self.exchange is None and self.after_chunked:
            self.pool.closes_after_chunked = True  # the engine closed it, idle, right after a chunked answer
        self.closed = True
        with contextlib.suppress(ValueError):
            self.pool.idle.remove(self)
        if self.exchange is not None:
            self.exchange.connection_lost(exc)

    def readable(self) -> bool:
        """Whether the engine sent something (its FIN, most likely) that the loop has not handled yet. An idle
        kept-alive connection never should: one that is readable was closed by the engine and must not carry a
        request that could not then be retried. One poll (a few µs) per reuse narrows that race to the
        microseconds between this check and the write."""
        return self._readable()

    def begin(self, exchange: Exchange, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self.exchange = exchange
        self.unsent = False
        self.transport.write(head)
        if body:
            self.transport.write(body)  # not joined to the head: a 60 MiB body is not copied once more

    def release(self, reusable: bool, now: float, chunked: bool = False) -> None:
        """The exchange is over: back to the pool when the engine left it clean (and will keep it), else closed."""
        self.exchange = None
        pool = self.pool
        if reusable and not self.closed and self.transport is not None and len(pool.idle) < POOL_MAX_IDLE \
                and not (chunked and pool.closes_after_chunked):
            if not self.transport.is_reading():  # paused for a slow client
                self.transport.resume_reading()
            self.idle_since = now
            self.reused = True
            self.after_chunked = chunked
            pool.idle.append(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.closed = True
        with contextlib.suppress(ValueError):
            self.pool.idle.remove(self)
        if self.transport is not None:
            self.transport.abort()


def _always() -> bool:
    return True  # no socket to look at: never reuse the connection


def readiness(fileno: int) -> Callable[[], bool]:
    """A zero-timeout "is there something to read" check of one socket: poll() where the platform has it (~0.5 µs
    a check), else select(), which Windows has for sockets (poll() does not exist there)."""
    poll_factory: Any = getattr(select, "poll", None)
    if poll_factory is not None:
        poll = poll_factory()
        poll.register(fileno, select.POLLIN)
        return lambda: bool(poll.poll(0))
    return lambda: bool(select.select([fileno], [], [], 0)[0])


# A full listen queue on a Unix socket is back-pressure, not a refusal: retry the connect after this long, doubling
# up to the cap, until the caller's connect timeout.
UNIX_BUSY_FIRST_WAIT = 0.001
UNIX_BUSY_MAX_WAIT = 0.05


async def open_connection(target: Target, connection: UpstreamConnection) -> None:
    """Connect `connection` to the engine at `target`: the one place the endpoint opens a connection to one."""
    loop = asyncio.get_running_loop()
    if target.port == 0:  # the engine's private Unix socket: only this user can connect or listen there
        sock = await connect_unix(target.host)
        try:
            await loop.create_unix_connection(lambda: connection, sock=sock)
        except BaseException:
            sock.close()
            raise
    else:
        await loop.create_connection(lambda: connection, target.host, target.port)


async def connect_unix(path: str) -> socket.socket:
    """A connected non-blocking socket to `path`. Linux answers a connect to a Unix socket whose listen queue is
    full with EAGAIN at once (TCP would queue the SYN and retry by itself); the engines' queues are short
    (cpp-httplib's is 4 per core, Python's socketserver's 5), so a burst of new requests meets it whenever the
    engine is slow to accept. The kernel tells no one when room frees up, hence the short doubling retry here,
    bounded by the caller's connect timeout. (uvloop raises the EAGAIN; asyncio's own loop would wrongly take the
    socket for connected, another reason to connect here.)"""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    wait = UNIX_BUSY_FIRST_WAIT
    try:
        while True:
            try:
                sock.connect(path)
                return sock
            except BlockingIOError:
                if wait == UNIX_BUSY_FIRST_WAIT:  # once per connection: a burst is logged, not each retry
                    log.debug("the listen queue of %s is full: waiting for room", path)
                await asyncio.sleep(wait)
                wait = min(wait * 2, UNIX_BUSY_MAX_WAIT)
    except BaseException:
        sock.close()
        raise


class UpstreamPool:
    """Idle kept-alive connections per engine base URL, and each URL parsed once."""

    def __init__(self, timeouts: Timeouts | None = None) -> None:
        self.timeouts = timeouts or Timeouts()
        # Exchanges in flight, swept for timeouts a few times per timeout (at most each second): one timer for
        # all of them, so a request costs a set add/discard and a chunk nothing.
        self.active: set[Exchange] = set()
        self.sweep_interval = max(0.05, min(1.0, self.timeouts.first_byte / 5, self.timeouts.idle / 5))
        self._sweep: asyncio.TimerHandle | None = None
        self._targets: dict[str, Target] = {}
        self._pools: dict[str, Pool] = {}

    def target(self, base_url: str) -> Target:
        target = self._targets.get(base_url)
        if target is None:
            target = self._targets[base_url] = Target.parse(base_url)
        return target

    def pooled(self, base_url: str, now: float) -> UpstreamConnection | None:
        """The most recently used idle connection to `base_url` that is still fresh, if any."""
        pool = self._pools.get(base_url)
        idle = pool.idle if pool is not None else None
        while idle:
            connection = idle.pop()
            if connection.closed or now - connection.idle_since >= POOL_IDLE_SECONDS:
                connection.abort()
            elif connection.readable():
                if connection.after_chunked and pool is not None:
                    pool.closes_after_chunked = True
                connection.abort()
            else:
                return connection
        return None

    async def connect(self, base_url: str, closes_after_stream: bool = False) -> UpstreamConnection:
        """A fresh connection (OSError or TimeoutError when the engine does not take it in time).
        `closes_after_stream`: known from the engine's adapter, so the pool need not learn it by a failed reuse."""
        target = self.target(base_url)
        pool = self._pools.get(base_url)
        if pool is None:
            pool = self._pools[base_url] = Pool()
            pool.closes_after_chunked = closes_after_stream
        connection = UpstreamConnection(pool)
        async with asyncio.timeout(self.timeouts.connect):
            await open_connection(target, connection)
        return connection

    def track(self, exchange: Exchange) -> None:
        self.active.add(exchange)
        if self._sweep is None:
            self._sweep = exchange.loop.call_later(self.sweep_interval, self._sweep_now)

    def _sweep_now(self) -> None:
        self._sweep = None
        if not self.active:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        for exchange in list(self.active):
            exchange.check_time(now)
        if self.active:
            self._sweep = loop.call_later(self.sweep_interval, self._sweep_now)

    def close_idle(self) -> None:
        for pool in self._pools.values():
            for idle in list(pool.idle):
                idle.abort()


class Exchange(ResponseRelay):
    """One forwarded request on an upstream connection; the answer is written to the client as it arrives.

    `done` resolves to the RequestRecord, or to None when the engine provably never got the request, so the
    caller may retry (elsewhere) without the client noticing. The rule (a retried generation must not run twice):
    a connection closed before any response byte is retried only when part of the request was still unsent
    (the engine cannot have read all of it) or the method is idempotent. A POST the engine may have read is
    answered 502 instead. (Refused connects are retried by the caller: nothing was sent.) Kept-alive connections
    are reused for at most POOL_IDLE_SECONDS, well before the engines close idle ones, so that race stays rare.

    Time is checked without per-chunk work: UpstreamPool sweeps the exchanges in flight and compares the time of
    the last upstream bytes (which data_received notes anyway) with the timeouts.

    What the engine's answer becomes on its way (head, body, held error answers) is its ResponseRelay part
    (serving.relay, the parser's callbacks); this class adds the engine connection, the timeouts and the end.
    """

    def __init__(self, record: RequestListener, client: ClientConnection, request: Incoming, lease: Lease,
                 arrived: float, wall: float, connection: UpstreamConnection, upstreams: UpstreamPool, *,
                 head_sent: bool = False, retry_after_s: int = 1) -> None:
        super().__init__(request, lease.upstream, StreamMeter(arrived), head_sent)
        self.record = record
        self.client = client
        self.connection = connection
        self.lease = lease
        self.arrived = arrived
        self.wall = wall
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future[RequestRecord | None] = self.loop.create_future()
        self.parser = httptools.HttpResponseParser(self)
        self.finished = False
        self.paused = False
        self.cut_reason: str | None = None  # the endpoint took the engine away (see cut())
        self.paused_at = 0.0
        self.upstreams = upstreams
        self.timeouts = upstreams.timeouts
        self.started = self.loop.time()
        self.retry_after_s = retry_after_s
        upstreams.track(self)

    def send(self) -> None:
        """Write the request to the engine: the endpoint's framing and key, the engine's served model name."""
        request, upstream = self.request, self.upstream
        target = normalize.Target(upstream.served_model_name, upstream.system_first, upstream.context,
                                  upstream.engine, request.reasoning)
        shaped = request.shape.body_for(target) if request.shape is not None else None
        if shaped is not None:
            log.info("%s: %s", upstream.name, request.shape.note)
        body = shaped if shaped is not None else rewrite_model(request.body, request.info, upstream.served_model_name)
        self.connection.begin(self, upstream_head(request, upstream, self.upstreams.target(upstream.base_url),
                                                  len(body)), body)

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
            self._finish(None, retry=self.retry_wanted, reason="retried with max_tokens lowered to the context")
        else:
            self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.finished:
            return
        if not self.answered:
            why = f"{type(exc).__name__}: {exc}" if exc else "no response"
            if self.now == 0.0 and (self.connection.unsent or self.request.method in IDEMPOTENT):
                self._finish(None, retry=True, reason=f"closed before answering ({why})")
            else:
                self._finish(f"the engine {self.upstream.engine} closed the connection without answering ({why}); "
                             "not retried, since it may have started on the request")
        elif not self.upstream_framed and not self.complete:
            self.complete = True  # a body delimited by the connection's end
            self._end_body()
            self._finish(None)
        else:
            detail = f"{type(exc).__name__}: {exc}" if exc else "connection closed"
            self._finish(f"the engine {self.upstream.engine} stopped mid-response ({detail})")

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
        """The client reads slower than the engine writes: stop reading the engine (TCP slows it down)."""
        transport = self.connection.transport
        if transport is not None and not self.paused:
            self.paused = True
            self.paused_at = self.loop.time()
            transport.pause_reading()

    def resume_upstream(self) -> None:
        transport = self.connection.transport
        if transport is not None and self.paused:
            self.paused = False
            if self.now:
                self.now = self.loop.time()  # the engine's silence while paused was ours
            transport.resume_reading()

    def cut(self, message: str) -> None:
        """The endpoint takes this engine away (a switch's drain deadline passed): end the request with a clear,
        retryable error: a 503 with Retry-After when nothing was answered yet, else an SSE error event."""
        if not self.finished:
            self.cut_reason = message
            self._finish(message)

    def check_time(self, now: float) -> None:
        """Called by the pool's sweep: time the request out when the engine (or the client) is late."""
        if self.finished:
            return
        if self.paused:  # waiting on the client, not the engine
            if now - self.paused_at >= self.timeouts.idle:
                self._finish(f"the client read nothing for {self.timeouts.idle:g} s", client_gone=True)
                if self.client.transport is not None:
                    self.client.transport.abort()  # close() would wait for it to read what is buffered
        elif self.now == 0.0:
            if now - self.started >= self.timeouts.first_byte:
                self._finish(f"the engine {self.upstream.engine} did not answer within "
                             f"{self.timeouts.first_byte:g} s; the request was cancelled", timed_out=True)
        elif now - self.now >= self.timeouts.idle:
            self._finish(f"the engine {self.upstream.engine} sent nothing for {self.timeouts.idle:g} s; "
                         "the request was cancelled", timed_out=True)

    def client_gone(self) -> None:
        """The client hung up: abort the upstream request so the engine stops working on it."""
        if not self.finished:
            self._finish("the client disconnected", client_gone=True)

    def _finish(self, error: str | None, *, retry: bool = False, reason: str = "", client_gone: bool = False,
                timed_out: bool = False) -> None:
        self.finished = True
        self.upstreams.active.discard(self)
        # The parser holds this exchange (its callbacks) and the exchange its request: a cycle that only the
        # cyclic GC would free, keeping every request body (up to 64 MiB each) alive until it runs.
        self.parser = _SPENT_PARSER
        self.client.exchange = None
        done = self.loop.time()
        reusable = self.complete and error is None and self.upstream_framed and self.upstream_keep_alive
        self.connection.release(reusable and not (retry or client_gone), done, self.upstream_chunked)
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
            count_json_tokens(self.meter, b"".join(self.kept), done)
        request_body, response_body = self.meter.bodies(self.kept)
        status, error = outcome(self.status, error, answered=self.answered, cut=self.cut_reason is not None,
                                client_gone=client_gone, timed_out=timed_out, stream_error=self.meter.error)
        record = exchange_record(self, status, error, done, request_body, response_body)
        self.lease.release()  # counted off and published before the client sees the end of its answer
        self.record(record)
        self._flush()
        if told is not None and not self.answered and self.head_sent:
            self.framing, self.streamed = "chunked", True  # the client has the endpoint's event-stream head
            tell_client(self, told)
        elif told is not None and not self.answered and self.cut_reason:
            response = ollama_error(503, told) if self.request.ollama is not None else \
                json_error(503, told, "engine_switch")
            response.headers = (("Retry-After", str(self.retry_after_s)),)
            self.client.write_response(response, request=self.request)
        elif told is not None and not self.answered:
            self.request.keep_alive = False
            response = ollama_error(status, told) if self.request.ollama is not None else \
                json_error(status, told, "upstream_timeout" if timed_out else "upstream_error")
            self.client.write_response(response, close=True, request=self.request)
        elif told is not None:
            tell_client(self, told)
        self.done.set_result(record)


def tell_client(exchange: Exchange, error: str) -> None:
    """An answer cut short: end a chunked event stream with an error event; otherwise close the connection,
    which is how HTTP says "truncated"."""
    exchange.request.keep_alive = False
    client = exchange.client
    if exchange.framing == "chunked" and exchange.streamed and not client.closed and client.transport:
        if exchange.request.ollama is not None:  # an NDJSON stream ends with an error line
            client.transport.write(chunk(ollama.error_line(error)) + LAST_CHUNK)
            return
        kind, code = ("engine_switch", 503) if exchange.cut_reason else ("upstream_disconnected", 502)
        client.transport.write(chunk(error_event(error, kind, code, retryable=bool(exchange.cut_reason),
                                                 anthropic=exchange.request.path.startswith("/v1/messages")))
                               + LAST_CHUNK)


def exchange_record(exchange: Exchange, status: int, error: str | None, done: float, request_body: str | None,
                    response_body: str | None) -> RequestRecord:
    """What the request log, metering and the GUI learn of one finished exchange."""
    meter, request, upstream = exchange.meter, exchange.request, exchange.upstream
    return RequestRecord(
        t=exchange.wall, method=request.method, upstream=upstream.name, status=status,
        path=request.ollama.path if request.ollama is not None else request.path,  # what the client asked
        streamed=exchange.streamed, ttft_s=(meter.first_token_at - exchange.arrived) if meter.first_token_at else None,
        e2e_s=done - exchange.arrived, output_tokens=meter.output_tokens if status < 400 else None,
        error=exchange.told_instead or error, prompt_tokens=meter.prompt_tokens, model=request.info.model,
        engine=upstream.engine, client=exchange.client.peer, seq=request.seq, request_body=request_body,
        response_body=response_body, note=adjusted(request))


def outcome(status: int, error: str | None, *, answered: bool, cut: bool, client_gone: bool, timed_out: bool,
            stream_error: str | None) -> tuple[int, str | None]:
    """The (status, error) an exchange is recorded with: the engine's status unless the endpoint ended it."""
    if client_gone:
        return 499, error
    if timed_out:
        return 504, error
    if not answered and error is not None:  # e.g. a malformed response head: the client gets a 502
        return (503 if cut else 502), error
    if error is None and status >= 400:
        return status, f"HTTP {status}"
    return status, error if error is not None else stream_error


def upstream_head(request: Incoming, upstream: Upstream, target: Target, length: int) -> bytes:
    """The request head towards the engine: the client's end-to-end headers, the endpoint's own framing and the
    engine's per-launch key (hop-by-hop headers, the client's credentials and what `Connection` names dropped)."""
    dropped = HOP_HEADERS | {"authorization", "x-api-key"}
    connection = request.headers.get("Connection")
    if connection:
        dropped = dropped | {token.strip().lower() for token in connection.split(",")}
    lines = [f"{request.method} {target.prefix}{request.target} HTTP/1.1", f"Host: {target.authority}"]
    lines += [f"{name}: {value}" for name, value in request.headers.items if name.lower() not in dropped]
    if upstream.api_key:
        lines.append(f"Authorization: Bearer {upstream.api_key}")
    if length or request.method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
