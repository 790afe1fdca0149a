"""The stable endpoint: an OpenAI-compatible reverse proxy on a fixed loopback port in front of whichever engine
is active, so clients keep one URL and one model name while engines are switched behind it.

The parts, each in its own module (after llama-swap's split of process management, routing and HTTP):
`http1` reads and answers client connections; `router` decides which engine takes a request and counts what is
in flight (drain); `upstream` pools engine connections and streams each exchange back; `metering` measures
TTFT and tokens on the way. This module joins them: the server's lifecycle on its own asyncio loop in a thread
(so synchronous code, the endpoint manager and the CLI, drives it through thread-safe methods), the API key,
the routes it answers itself (/health, /v1/models, the control channel), and forwarding with wait and retry.

Streams pass through chunk by chunk as they arrive (no buffering). While no engine is ready, requests wait
(bounded) instead of failing.

What it refuses, from a request's head alone (before any body is kept): a `Host` that is not this machine (DNS
rebinding), an `Origin` that is neither local nor allowed by the user (a web page the user visits), a missing or
wrong API key. CORS is answered for allowed origins only. Engines behind it hold a per-launch key (Upstream.api_key)
that only the endpoint sends, so their own ports are no side door.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from desktop.core.common.errors import PortBusy, SwitchyardError
from desktop.core.common.origins import ANY_ORIGIN, is_local_origin, is_loopback_host, normalize_origin
from desktop.core.engines.model_path import model_label
from desktop.core.runtime.ports import holder_of
from desktop.core.serving.defaults import DEFAULT_PROXY_PORT, DEFAULT_WAIT_TIMEOUT
from desktop.core.serving.http1 import (
    HOP_HEADERS,
    ClientConnection,
    Headers,
    Incoming,
    Limits,
    LocalHandler,
    LocalRequest,
    LocalResponse,
    LocalRoute,
    anthropic_error,
    json_error,
    new_event_loop,
)
from desktop.core.serving.metering import CapturingMeter, RequestListener, RequestRecord, request_model
from desktop.core.serving.router import Lease, OnDemand, Route, Router, Unavailable, Upstream
from desktop.core.serving.upstream import Exchange, Target, Timeouts, UpstreamConnection, UpstreamPool

__all__ = ["CONTROL_PREFIX", "DEFAULT_PROXY_PORT", "DEFAULT_WAIT_TIMEOUT", "ProxyServer", "RequestRecord", "Upstream"]

log = logging.getLogger("switchyard.proxy")

LOADING_NOTE_EVERY = 2.0  # seconds between ": loading model X (12 s)" comments to a waiting streaming client
STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n" \
              b"Transfer-Encoding: chunked\r\n\r\n"
CONTROL_PREFIX = "/switchyard/"
MESSAGES_PATH = "/v1/messages"  # Anthropic Messages: forwarded only to engines that answer it
CORS_MAX_AGE_S = 600
_TOKEN_LIST = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*")
T = TypeVar("T")


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
        capture_bodies: bool = False,
        allowed_origins: Iterable[str] = (),
        timeouts: Timeouts | None = None,
        limits: Limits | None = None,
    ) -> None:
        """`allowed_origins`: normalized origins (common.origins.parse_allowed_origins) web pages may call from,
        besides local ones; `*` allows any."""
        self.host = host
        self.port = port
        self.model_name = model_name
        self.api_key = api_key
        self.wait_timeout = wait_timeout
        self.retry_window = retry_window
        self.allowed_origins = frozenset(allowed_origins)
        self.limits = limits or Limits()
        self.queued = 0  # requests read ahead on all connections + those waiting for an engine
        self._hosts: dict[str, bool] = {}
        self.started_at = time.time()
        self._listeners: list[RequestListener] = []
        self._started: list[RequestListener] = []
        self.capture_bodies = False
        self.set_capture_bodies(capture_bodies)
        self._routes: dict[str, dict[str, LocalHandler]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self.connections: set[ClientConnection] = set()
        self.upstreams = UpstreamPool(timeouts)
        self.counters = {"requests": 0, "failed": 0, "waited": 0}
        self.router = Router(self.counters)  # owned by the proxy's loop

    # --- configuration (before start) ---
    def subscribe(self, listener: RequestListener) -> None:
        self._listeners.append(listener)

    def subscribe_started(self, listener: RequestListener) -> None:
        """Also tell `listener` when a request arrives (a record with status 0), for views of what is in flight."""
        self._started.append(listener)

    def set_capture_bodies(self, on: bool) -> None:
        """Keep request and response bodies in the request records (off by default; never with an API key:
        the endpoint is then shared, and its clients' prompts are not the local user's to read)."""
        if on and self.api_key:
            raise SwitchyardError("body capture is not available on an endpoint with an API key",
                                  "serve without --api-key-env to capture bodies")
        self.capture_bodies = on

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
            loop = new_event_loop()
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
        self.router.bind()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: ClientConnection(self), self.host, self.port)
        if self.port == 0:
            self.port = int(self._server.sockets[0].getsockname()[1])

    async def _stop_server(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            if connection.exchange is not None:
                connection.exchange.client_gone()
            if connection.transport is not None:
                connection.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()
        self.upstreams.close_idle()
        tasks = [c.worker for c in self.connections if c.worker is not None and not c.worker.done()]
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

    def set_models(self, models: dict[str, dict[str, Any]], on_demand: OnDemand | None = None,
                   loading_status: Iterable[str] = ()) -> None:
        """Serve several models (call before start): requests are routed by their JSON `model` field to the
        route of that name, an unknown name gets a 404 naming the ones that exist, /v1/models lists them all.
        `on_demand(name)` is called (on the endpoint's loop: it must not block) when a request finds its model
        unloaded; names in `loading_status` tell waiting streaming clients that their model loads."""
        shown = set(loading_status)
        self.router.routes = {name: Route(info=dict(info), loading_status=name in shown)
                              for name, info in models.items()}
        self.router.on_demand = on_demand

    # --- routing (thread-safe) ---
    def set_upstream(self, upstream: Upstream | None, down_reason: str | None = None, model: str | None = None,
                     idle: bool = False) -> None:
        """Send new requests (for `model`, in multi-model mode) to `upstream` from now on. None makes them wait
        (starting or switching) or, with `down_reason`, fail at once with that reason (no engine will come);
        `idle` marks the model unloaded: the next request for it asks for a load."""
        if upstream is not None:
            Target.parse(upstream.base_url)  # a URL the endpoint cannot forward to fails here, in the caller
        self.call(self.router.set_upstream(upstream, down_reason, model, idle), timeout=10)

    def mark_loading(self, model: str | None) -> None:
        """A load of `model` began (thread-safe): waiting streaming clients may be told how long it has taken."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.router.mark_loading, model)

    def settle(self, model: str, timeout: float) -> bool:
        """Wait until the requests that waited for `model`'s engine have all been let in (see Router.settle)."""
        return self.call(self.router.settle(model, timeout), timeout=timeout + 10)

    def cut(self, upstream: Upstream, message: str) -> int:
        """End the requests still in flight on `upstream` with a clear, retryable error (503 + Retry-After before
        the answer began, an SSE error event in a stream); the number cut."""
        async def run() -> int:
            cut = 0
            for connection in list(self.connections):
                exchange = connection.exchange
                if isinstance(exchange, Exchange) and exchange.upstream is upstream and not exchange.finished:
                    exchange.cut(message)
                    cut += 1
            return cut
        return self.call(run(), timeout=10)

    @property
    def active(self) -> Upstream | None:
        return self.router.active

    def inflight(self, name: str | None = None) -> int:
        return self.router.inflight(name)

    def drain(self, upstream: Upstream, timeout: float) -> bool:
        """Wait until no request is in flight on `upstream`; False if some still are after `timeout` seconds."""
        return self.call(self.router.drain(upstream.name, timeout), timeout=timeout + 10)

    # --- handlers ---
    def _authorized(self, headers: Headers) -> bool:
        if not self.api_key:
            return True
        header = headers.get("Authorization")
        token = header[7:] if header.lower().startswith("bearer ") else headers.get("x-api-key")
        return hmac.compare_digest(token.encode(), self.api_key.encode())

    def screen(self, method: str, path: str, headers: Headers) -> tuple[LocalResponse | None, bytes]:
        """Judge a request by its head (ClientConnection calls this before reading the body): refuse a foreign
        Host or Origin (403) and a missing API key (401), answer a CORS preflight; otherwise return the CORS
        lines the answer will carry (none without an Origin)."""
        error = anthropic_error if path.startswith(MESSAGES_PATH) else json_error  # each API's own error shape
        host = headers.get("Host")
        if host and not self._local_host(host):
            return error(403, f"the endpoint answers only requests addressed to this machine, not to "
                              f"'{host[:100]}'", "permission_error"), b""
        origin = headers.get("Origin")
        cors = b""
        if origin:
            if not self._origin_allowed(origin):
                return error(403, f"requests from web pages at '{origin[:100]}' are refused; allow the origin with "
                                  "`switchyard serve --allowed-origins ORIGIN` or the allowed_origins setting",
                             "permission_error"), b""
            cors = f"Access-Control-Allow-Origin: {origin}\r\nVary: Origin\r\n".encode("latin-1")
            if method == "OPTIONS" and "Access-Control-Request-Method" in headers:
                return self._preflight(origin, headers), b""
        if path.startswith(CONTROL_PREFIX) or path == "/health":
            return None, cors  # the control routes check their own token
        if not self._authorized(headers):
            return error(401, "invalid or missing API key", "authentication_error"), cors
        return None, cors

    def _local_host(self, host: str) -> bool:
        """is_loopback_host, remembered: clients send the same few Host values on every request."""
        local = self._hosts.get(host)
        if local is None:
            if len(self._hosts) >= 256:
                self._hosts.clear()
            local = self._hosts[host] = is_loopback_host(host)
        return local

    def _origin_allowed(self, origin: str) -> bool:
        if is_local_origin(origin) or ANY_ORIGIN in self.allowed_origins:
            return True
        normalized = normalize_origin(origin)
        return normalized is not None and normalized in self.allowed_origins

    def _preflight(self, origin: str, headers: Headers) -> LocalResponse:
        """A browser asks whether a page at `origin` (allowed) may send this request."""
        requested = headers.get("Access-Control-Request-Headers").strip()
        allow_headers = requested if _TOKEN_LIST.fullmatch(requested) else "Authorization, Content-Type"
        return LocalResponse(204, b"", headers=(
            ("Access-Control-Allow-Origin", origin), ("Vary", "Origin"),
            ("Access-Control-Allow-Methods", "GET, POST, OPTIONS"),
            ("Access-Control-Allow-Headers", allow_headers),
            ("Access-Control-Max-Age", str(CORS_MAX_AGE_S))))

    def dispatch(self, request: Incoming, client: ClientConnection) -> None:
        """Answer one request that passed screen(); calls client.request_done() when finished, now or later."""
        path = request.path
        if path.startswith(CONTROL_PREFIX):
            routes = self._routes.get(path)
            handler = routes.get(request.method) if routes else None
            if handler is None:
                client.write_response(json_error(404 if not routes else 405,
                                                  f"no control route {request.method} {path}"), request=request)
                client.request_done(True)
            else:
                client.wait_in(self._local(handler, request, client))
            return
        if path == "/health":
            client.write_response(self._health(), request=request)
        elif path == "/v1/models" and request.method in ("GET", "HEAD"):
            client.write_response(self._models(), request=request)
        elif not self.router.multi:
            self._forward_now(request, client, self.router.default)
            return
        else:
            name = _requested_model(request.body)
            route = self.router.route(name)
            if route is None:
                client.write_response(self._unknown_model(name), request=request)
            else:
                self._forward_now(request, client, route, name if name in self.router.routes else
                                  next(iter(self.router.routes)))
                return
        client.request_done(True)

    async def _local(self, handler: LocalHandler, request: Incoming, client: ClientConnection) -> bool:
        try:
            response = await handler(LocalRequest(request.method, request.path, request.query, request.headers,
                                                  request.body))
        except Exception as exc:
            log.exception("control route %s failed", request.path)
            response = json_error(500, f"the endpoint failed: {exc}")
        client.write_response(response, request=request)
        return True

    def _forward_now(self, request: Incoming, client: ClientConnection, route: Route,
                     model: str | None = None) -> None:
        """The common case without a task: an engine is active and an idle connection to it is at hand."""
        loop = asyncio.get_running_loop()
        arrived, wall = loop.time(), time.time()
        self.counters["requests"] += 1
        request.seq = self.counters["requests"]
        if self._started:
            self._announce(request, client, wall)
        upstream = self.router.try_acquire(None, route)
        if upstream is not None and not upstream.messages_api and request.path.startswith(MESSAGES_PATH):
            self.router.release(upstream)
            client.request_done(self._unsupported(request, client, wall, arrived, upstream))
            return
        connection = self.upstreams.pooled(upstream.base_url, arrived) if upstream is not None else None
        if upstream is None or connection is None:
            if upstream is not None:
                self.router.release(upstream)
            client.wait_in(self._forward(request, client, arrived, wall, route, model))
            return
        lease = Lease(self.router, upstream)
        exchange = self._begin(request, client, lease, connection, arrived, wall)

        def answered(done: asyncio.Future[RequestRecord | None]) -> None:
            lease.release()
            record = done.result()
            if record is not None:
                client.request_done(request.keep_alive and record.status != 499)
            elif client.closed:
                client.request_done(False)
            else:  # the kept-alive connection had just been closed by the engine: the careful path retries
                client.wait_in(self._forward(request, client, arrived, wall, route, model))

        exchange.done.add_done_callback(answered)

    def _health(self) -> LocalResponse:
        if self.router.multi:  # serving: every model is loaded, or loads on its next request
            models = {name: "loaded" if route.active else route.down_reason or "unloaded"
                      for name, route in self.router.routes.items()}
            return LocalResponse.json({"status": "ok", "models": models})
        if self.router.active is not None:
            return LocalResponse.json({"status": "ok", "engine": self.router.active.engine})
        return LocalResponse.json({"status": "unavailable", "reason": self.router.down_reason or "starting"}, status=503)

    def _models(self) -> LocalResponse:
        if self.router.multi:
            data = []
            for name, route in self.router.routes.items():
                state = "loaded" if route.active else "loading" if route.loading_since else \
                    "down" if route.down_reason else "unloaded"
                info = {**route.info, "state": state}
                if isinstance(info.get("model"), str):
                    info["model"] = model_label(info["model"])  # a name, never the user's path
                data.append({"id": name, "object": "model", "created": int(self.started_at),
                             "owned_by": "switchyard", "switchyard": info})
            return LocalResponse.json({"object": "list", "data": data})
        active = self.router.active
        entry: dict[str, Any] = {"id": self.model_name, "object": "model", "created": int(self.started_at),
                                 "owned_by": "switchyard"}
        if active is not None:
            entry["switchyard"] = {"engine": active.engine, "model": model_label(active.model)}
        return LocalResponse.json({"object": "list", "data": [entry]})

    def _unknown_model(self, name: str | None) -> LocalResponse:
        """OpenAI's answer for a model it does not have, naming the ones this endpoint does have."""
        names = ", ".join(self.router.routes)
        message = (f"The model '{name}' does not exist on this endpoint; available: {names}" if name is not None
                   else f"the request names no model; this endpoint serves several: {names}")
        return LocalResponse.json({"error": {"message": message, "type": "invalid_request_error", "param": "model",
                                             "code": "model_not_found" if name is not None else "model_required"}},
                                  status=404 if name is not None else 400)

    async def _forward(self, request: Incoming, client: ClientConnection, arrived: float, wall: float,
                       route: Route, model: str | None = None) -> bool:
        """Forward with waiting: for an engine to become active, for a fresh connection, and retrying once
        on another engine when the first refuses. Returns `keep` (False when the answer was cut short)."""
        loop = asyncio.get_running_loop()
        deadline = arrived + self.wait_timeout
        avoid: Upstream | None = None
        refused: dict[str, int] = {}
        try:
            return await self._forward_with_retries(request, client, arrived, wall, deadline, avoid, refused,
                                                    route, model)
        except asyncio.CancelledError:  # the client left while its request waited (an exchange records itself)
            self._record(RequestRecord(wall, request.method, request.path, None, 499, False, None,
                                       loop.time() - arrived, None, "the client disconnected",
                                       model=request_model(request.body), client=client.peer, seq=request.seq))
            raise

    async def _forward_with_retries(self, request: Incoming, client: ClientConnection, arrived: float,
                                    wall: float, deadline: float, avoid: Upstream | None,
                                    refused: dict[str, int], route: Route, model: str | None) -> bool:
        loop = asyncio.get_running_loop()
        told = False  # a loading note went out: the client already has a 200 event-stream head
        while True:
            upstream = self.router.try_acquire(avoid, route)
            if upstream is None:
                if self.queued >= self.limits.queued:
                    return self._fail(request, client, wall, arrived, None, 503,
                                      f"the endpoint already holds {self.limits.queued} queued requests",
                                      retry_after=True)
                self.queued += 1
                try:
                    if route.loading_status and model is not None and not request.http10 and \
                            _wants_stream(request.body):
                        upstream, told = await self._acquire_telling(request, client, route, model, deadline,
                                                                     avoid, told)
                    else:
                        upstream = await self.router.acquire(deadline, avoid, route, model)
                except Unavailable as exc:
                    what = f"model '{model}'" if model is not None and self.router.multi else "engine"
                    message = f"no {what} is serving: {exc}"
                    if told:
                        return self._fail_stream(request, client, wall, arrived, message)
                    return self._fail(request, client, wall, arrived, None, 503, message)
                finally:
                    self.queued -= 1
            if not upstream.messages_api and request.path.startswith(MESSAGES_PATH):
                self.router.release(upstream)
                return self._unsupported(request, client, wall, arrived, upstream)
            lease = Lease(self.router, upstream)
            try:
                record, reused = await self._exchange(request, client, lease, wall, arrived, told)
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

    async def _acquire_telling(self, request: Incoming, client: ClientConnection, route: Route, model: str,
                               deadline: float, avoid: Upstream | None, told: bool) -> tuple[Upstream, bool]:
        """Wait for the model's engine like acquire(), and meanwhile tell the streaming client every few seconds
        that its model loads, as SSE comment lines (`: loading model X (12 s)`) that OpenAI clients ignore."""
        waiting = asyncio.ensure_future(self.router.acquire(deadline, avoid, route, model))
        try:
            while True:
                done, _pending = await asyncio.wait({waiting}, timeout=LOADING_NOTE_EVERY)
                if done:
                    return waiting.result(), told
                if client.closed or client.transport is None:
                    continue
                since = route.loading_since
                note = f": loading model {model} ({time.monotonic() - since:.0f} s)\n\n" if since is not None \
                    else f": waiting for model {model}\n\n"
                payload = note.encode()
                head = b"" if told else STREAM_HEAD[:-2] + request.cors + b"\r\n"
                client.transport.write(head + b"%x\r\n%b\r\n" % (len(payload), payload))
                told = True
        finally:
            if not waiting.done():
                waiting.cancel()

    def _fail_stream(self, request: Incoming, client: ClientConnection, wall: float, arrived: float,
                     message: str) -> bool:
        """A stream that was told its model loads, and then none came: end it with an SSE error event."""
        now = asyncio.get_running_loop().time()
        self._record(RequestRecord(wall, request.method, request.path, None, 503, True, None, now - arrived, None,
                                   message))
        if not client.closed and client.transport is not None:
            event = json.dumps({"error": {"message": message, "type": "upstream_unavailable", "code": 503}})
            payload = f"data: {event}\n\n".encode()
            client.transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(payload), payload))
        return True

    async def _exchange(self, request: Incoming, client: ClientConnection, lease: Lease, wall: float,
                        arrived: float, told: bool = False) -> tuple[RequestRecord | None, bool]:
        """Forward once: (record, reused). A None record means "nothing reached the client": the caller may
        retry; `reused` says it failed on a kept-alive connection (retry at once) rather than a fresh one."""
        loop = asyncio.get_running_loop()
        upstream = lease.upstream
        connection = self.upstreams.pooled(upstream.base_url, loop.time())
        reused = connection is not None
        if connection is None:
            try:
                connection = await self.upstreams.connect(upstream.base_url, upstream.closes_after_stream)
            except (OSError, TimeoutError) as exc:
                log.info("%s refused a request (%s): retrying", upstream.name, exc or type(exc).__name__)
                return None, False
        exchange = self._begin(request, client, lease, connection, arrived, wall, told)
        return await exchange.done, reused

    def _begin(self, request: Incoming, client: ClientConnection, lease: Lease,
               connection: UpstreamConnection, arrived: float, wall: float, told: bool = False) -> Exchange:
        upstream = lease.upstream
        target = self.upstreams.target(upstream.base_url)
        exchange = Exchange(self._record, client, request, lease, arrived, wall, connection, self.upstreams,
                            head_sent=told)
        if self.capture_bodies:
            exchange.meter = CapturingMeter(arrived, request.body)
        if client.closed:
            exchange.client_gone()
        else:
            client.exchange = exchange
            connection.begin(exchange, self._upstream_request(request, upstream, target))
        return exchange

    def _upstream_request(self, request: Incoming, upstream: Upstream, target: Target) -> bytes:
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

    def _fail(self, request: Incoming, client: ClientConnection, wall: float, arrived: float,
              upstream: Upstream | None, status: int, message: str, retry_after: bool = False) -> bool:
        now = asyncio.get_running_loop().time()
        self._record(RequestRecord(wall, request.method, request.path, upstream.name if upstream else None,
                                   status, False, None, now - arrived, None, message,
                                   model=request_model(request.body), engine=upstream.engine if upstream else None,
                                   client=client.peer, seq=request.seq))
        error = anthropic_error(status, message) if request.path.startswith(MESSAGES_PATH) else \
            json_error(status, message, "upstream_unavailable")
        if retry_after:
            error.headers = (("Retry-After", str(self.limits.retry_after_s)),)
        client.write_response(error, request=request)
        return True

    def _unsupported(self, request: Incoming, client: ClientConnection, wall: float, arrived: float,
                     upstream: Upstream) -> bool:
        return self._fail(request, client, wall, arrived, upstream, 501,
                          f"the engine {upstream.engine} does not support the Anthropic Messages API "
                          f"({request.path}); use /v1/chat/completions, or switch to an engine that has it")

    def _announce(self, request: Incoming, client: ClientConnection, wall: float) -> None:
        """Tell the "started" listeners about a request that just arrived (only when someone listens)."""
        record = RequestRecord(wall, request.method, request.path, None, 0, False, None, 0.0, None,
                               model=request_model(request.body), client=client.peer, seq=request.seq)
        for listener in list(self._started):
            try:
                listener(record)
            except Exception:
                log.exception("request listener failed")

    def _record(self, record: RequestRecord) -> None:
        if record.status != 499 and (record.error is not None or record.status >= 500):
            self.counters["failed"] += 1
        for listener in list(self._listeners):
            try:
                listener(record)
            except Exception:
                log.exception("request listener failed")


def _wants_stream(body: bytes) -> bool:
    if b'"stream"' not in body:
        return False
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("stream") is True


def _requested_model(body: bytes) -> str | None:
    """The JSON body's `model` field (what multi-model mode routes on), or None."""
    if not body or b'"model"' not in body:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None
