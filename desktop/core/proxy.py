"""The stable endpoint: an OpenAI-compatible reverse proxy on a fixed loopback port in front of whichever engine
is active, so clients keep one URL and one model name while engines are switched behind it.

Streams pass through chunk by chunk as they arrive (no buffering). Which upstream serves is decided per request
when it arrives; the in-flight count per upstream lets a switch drain the old engine before stopping it.
While no engine is ready, requests wait (bounded) instead of failing. The proxy runs its own asyncio loop in a
thread, so synchronous code (the endpoint manager, the CLI) drives it through thread-safe methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from desktop.core.errors import PortBusy, SwitchyardError
from desktop.core.ports import holder_of
from desktop.core.sse import SSEDecoder, StreamDelta, parse_chunk
from desktop.core.telemetry import Sample

log = logging.getLogger("switchyard.proxy")

DEFAULT_PROXY_PORT = 8800
DEFAULT_WAIT_TIMEOUT = 600.0
CONTROL_PREFIX = "/switchyard/"
# Headers that describe one hop, not the message: never forwarded (RFC 9110 §7.6.1, plus what aiohttp sets).
HOP_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
})
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
        self._tail = b""

    def feed(self, chunk: bytes, now: float) -> None:
        if self.first_token_at is None:
            for payload in self._decoder.feed(chunk):
                self._payload(payload, now)
            return
        self.payloads += chunk.count(b"data:")
        self._tail += chunk
        if len(self._tail) > 2 * self.TAIL_BYTES:
            self._tail = self._tail[-self.TAIL_BYTES:]

    def finish(self, now: float) -> None:
        for payload in self._decoder.flush():
            self._payload(payload, now)
        tail = self._tail.decode("utf-8", "replace")
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


def _json_error(status: int, message: str, kind: str = "switchyard_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


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
        self._extra_routes: list[web.RouteDef] = []
        self._middlewares: list[Any] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        # Loop-owned state (touched only from the proxy's loop).
        self._active: Upstream | None = None
        self._down_reason: str | None = None
        self._inflight: dict[str, int] = {}
        self._changed: asyncio.Condition | None = None
        self.counters = {"requests": 0, "failed": 0, "waited": 0}

    # --- configuration (before start) ---
    def subscribe(self, listener: RequestListener) -> None:
        self._listeners.append(listener)

    def add_routes(self, routes: Iterable[web.RouteDef], middleware: Any = None) -> None:
        """Extra routes (the control channel under /switchyard/) served on the same port; call before start()."""
        self._extra_routes.extend(routes)
        if middleware is not None:
            self._middlewares.append(middleware)

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
        self._session = aiohttp.ClientSession(
            # A fresh loopback connection per request (~0.1 ms): reusing keep-alive connections races with
            # engines closing idle ones (llama-server does), which fails requests with "Server disconnected".
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=None),
            auto_decompress=False,
            trust_env=False,
        )
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=self._middlewares)
        app.add_routes(self._extra_routes)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=False)
        try:
            await site.start()
        except BaseException:
            await self._stop_server()
            raise
        if self.port == 0:
            server = site._server
            sockets = getattr(server, "sockets", None) or []
            self.port = int(sockets[0].getsockname()[1])

    async def _stop_server(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

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
        with contextlib.suppress(TimeoutError):
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(lambda: self._inflight.get(name, 0) == 0), timeout)
        return self._inflight.get(name, 0) == 0

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
            upstream = self._active
            if upstream is None or upstream is avoid:
                raise _Unavailable(self._down_reason or "no engine became ready in time")
            self._inflight[upstream.name] = self._inflight.get(upstream.name, 0) + 1
            return upstream

    async def _release(self, upstream: Upstream) -> None:
        assert self._changed is not None
        async with self._changed:
            self._inflight[upstream.name] -= 1
            if self._inflight[upstream.name] <= 0:
                del self._inflight[upstream.name]
            self._changed.notify_all()

    # --- handlers ---
    def _authorized(self, request: web.Request) -> bool:
        if not self.api_key:
            return True
        header = request.headers.get("Authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        return hmac.compare_digest(token.encode(), self.api_key.encode())

    async def _health(self, _request: web.Request) -> web.Response:
        if self._active is not None:
            return web.json_response({"status": "ok", "engine": self._active.engine})
        return web.json_response({"status": "unavailable", "reason": self._down_reason or "starting"}, status=503)

    async def _models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _json_error(401, "invalid or missing API key", "authentication_error")
        active = self._active
        entry: dict[str, Any] = {"id": self.model_name, "object": "model", "created": int(self.started_at),
                                 "owned_by": "switchyard"}
        if active is not None:
            entry["switchyard"] = {"engine": active.engine, "model": active.model}
        return web.json_response({"object": "list", "data": [entry]})

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        if request.path.startswith(CONTROL_PREFIX):
            return _json_error(404, f"no control route {request.path}")
        if not self._authorized(request):
            return _json_error(401, "invalid or missing API key", "authentication_error")
        loop = asyncio.get_running_loop()
        arrived, wall = loop.time(), time.time()
        self.counters["requests"] += 1
        body = await request.read()
        deadline = arrived + self.wait_timeout
        avoid: Upstream | None = None
        refused: dict[str, int] = {}
        while True:
            try:
                upstream = await self._acquire(deadline, avoid)
            except _Unavailable as exc:
                return self._finish_error(request, wall, arrived, None, 503, f"no engine is serving: {exc}")
            try:
                outcome = await self._exchange(request, upstream, body, wall, arrived)
            finally:
                await self._release(upstream)
            if outcome is not None:
                return outcome
            # Nothing reached the client yet. Once: a pooled keep-alive connection the engine had closed, so
            # retry at once. Again: the engine is stopping or dead, so wait for the endpoint to move on.
            refused[upstream.name] = refused.get(upstream.name, 0) + 1
            if refused[upstream.name] >= 2:
                avoid = upstream
                deadline = min(arrived + self.wait_timeout, loop.time() + self.retry_window)

    async def _exchange(self, request: web.Request, upstream: Upstream, body: bytes, wall: float,
                        arrived: float) -> web.StreamResponse | None:
        """Forward once. None means "not connected, nothing sent": the caller may retry elsewhere."""
        assert self._session is not None
        loop = asyncio.get_running_loop()
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in HOP_HEADERS and k.lower() not in ("authorization", "x-api-key")}
        if upstream.api_key:
            headers["Authorization"] = f"Bearer {upstream.api_key}"
        try:
            upstream_response = await self._session.request(
                request.method, upstream.base_url + request.rel_url.path_qs,
                data=self._rewrite_model(body, upstream), headers=headers, allow_redirects=False)
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
            # Usually a keep-alive connection the engine had just closed (retried at once), else a dying engine.
            log.info("%s refused a request (%s): retrying", upstream.name, exc)
            return None
        except aiohttp.ClientError as exc:
            return self._finish_error(request, wall, arrived, upstream, 502,
                                      f"the engine {upstream.engine} failed the request: {exc}")
        status = upstream_response.status
        streamed = "text/event-stream" in upstream_response.headers.get("Content-Type", "")
        meter = StreamMeter(arrived)
        error: str | None = None
        client_gone = False
        try:
            response = web.StreamResponse(status=status, reason=upstream_response.reason)
            for key, value in upstream_response.headers.items():
                if key.lower() not in HOP_HEADERS:
                    response.headers.add(key, value)
            kept: list[bytes] = []
            kept_size = 0
            await response.prepare(request)
            while True:
                try:
                    chunk = await upstream_response.content.readany()
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
                    error = f"the engine {upstream.engine} stopped mid-response ({type(exc).__name__}: {exc})"
                    break
                if not chunk:
                    break
                if streamed:
                    meter.feed(chunk, loop.time())
                elif kept_size < 1 << 20:
                    kept.append(chunk)
                    kept_size += len(chunk)
                try:
                    await response.write(chunk)
                except (ConnectionError, aiohttp.ClientConnectionResetError):
                    client_gone = True
                    break
            done = loop.time()
            if error is not None:
                log.warning("%s", error)
                if streamed:
                    payload = {"error": {"message": error, "type": "upstream_disconnected", "code": 502}}
                    with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
                        await response.write(f"data: {json.dumps(payload)}\n\n".encode())
            if streamed:
                meter.finish(done)
            else:
                _count_json_tokens(meter, b"".join(kept), done)
            if not client_gone:
                with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
                    await response.write_eof()
        finally:
            if upstream_response.content.at_eof():
                upstream_response.release()
            else:  # closing aborts the engine's work on a request nobody reads any more
                upstream_response.close()
        if client_gone:
            status, error = 499, "the client disconnected"
        elif error is None and status >= 400:
            error = f"HTTP {status}"
        elif error is None:
            error = meter.error
        self._record(RequestRecord(
            t=wall, method=request.method, path=request.path, upstream=upstream.name, status=status,
            streamed=streamed, ttft_s=(meter.first_token_at - arrived) if meter.first_token_at else None,
            e2e_s=done - arrived, output_tokens=meter.output_tokens if status < 400 else None, error=error))
        return response

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

    def _finish_error(self, request: web.Request, wall: float, arrived: float, upstream: Upstream | None,
                      status: int, message: str) -> web.Response:
        now = asyncio.get_running_loop().time()
        self._record(RequestRecord(wall, request.method, request.path, upstream.name if upstream else None,
                                   status, False, None, now - arrived, None, message))
        return _json_error(status, message, "upstream_unavailable")

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
