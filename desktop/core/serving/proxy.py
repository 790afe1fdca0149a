"""The stable endpoint: an OpenAI-compatible reverse proxy on a fixed loopback port in front of whichever engine
is active, so clients keep one URL and one model name while engines are switched behind it.

The parts, each in its own module (after llama-swap's split of process management, routing and HTTP):
`http1` reads and answers client connections within the bounds of `guard`; `requestinfo` reads a body's model and
stream once; `router` decides which engine takes a request and counts what is in flight (drain); `forward` takes
a request to an engine (waiting and retrying); `upstream` pools engine connections and streams each exchange
back; `metering` measures TTFT and tokens on the way; `dispatch` answers the routes the endpoint answers itself
(/health, /v1/models, the control channel), decides which paths reach an engine at all and hands the rest to the
forwarder. This module joins them: the server's lifecycle on its own asyncio loop in a thread (so synchronous
code, the endpoint manager and the CLI, drives it through thread-safe methods) and screening by head (Host,
Origin, API key).

Streams pass through chunk by chunk as they arrive (no buffering). While no engine is ready, requests wait
(bounded) instead of failing.

What it refuses, from a request's head alone (before any body is kept): a `Host` that is not this machine (DNS
rebinding), an `Origin` that is neither local nor allowed by the user (a web page the user visits), a missing or
wrong API key. CORS is answered for allowed origins only. Only the inference routes in INFERENCE_ROUTES (and a
model's opted-in extra routes) are forwarded; anything else is a 404 from the endpoint, so an engine's admin and
debug routes (/slots, /props, /metrics, /invocations, ...) are never reachable through it. Engines behind it hold
a per-launch key (Upstream.api_key) that only the endpoint sends.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import threading
import time
from collections.abc import Container, Coroutine, Iterable, Mapping
from typing import Any, TypeVar

from desktop.core.common.errors import PortBusy, SwitchyardError
from desktop.core.common.origins import ANY_ORIGIN, is_local_origin, is_loopback_host, normalize_origin
from desktop.core.runtime.ports import holder_of
from desktop.core.serving.capabilities import TrafficCapabilities
from desktop.core.serving.control import TOKEN_HEADER
from desktop.core.serving.defaults import DEFAULT_PROXY_PORT, DEFAULT_WAIT_TIMEOUT
from desktop.core.serving.dispatch import CONTROL_PREFIX, INFERENCE_ROUTES, Dispatcher, RequestEvents
from desktop.core.serving.forward import MESSAGES_PATH, Forwarder
from desktop.core.serving.guard import Guard, raise_fd_limit
from desktop.core.serving.http1 import (
    ClientConnection,
    Headers,
    Incoming,
    Limits,
    LocalResponse,
    LocalRoute,
    anthropic_error,
    json_error,
    new_event_loop,
    ollama_error,
)
from desktop.core.serving.metering import RequestListener, RequestRecord
from desktop.core.serving.router import OnDemand, Route, Router, Upstream
from desktop.core.serving.upstream import Exchange, Target, Timeouts, UpstreamPool

__all__ = ["CONTROL_PREFIX", "DEFAULT_PROXY_PORT", "DEFAULT_WAIT_TIMEOUT", "INFERENCE_ROUTES", "ProxyServer",
           "RequestRecord", "Upstream"]

log = logging.getLogger("switchyard.proxy")

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
        extra_routes: Iterable[str] = (),
    ) -> None:
        """`allowed_origins`: normalized origins (common.origins.parse_allowed_origins) web pages may call from,
        besides local ones; `*` allows any. `extra_routes`: paths forwarded besides INFERENCE_ROUTES."""
        self.host = host
        self.port = port
        self.model_name = model_name
        self.api_key = api_key
        self.wait_timeout = wait_timeout
        self.retry_window = retry_window
        self.screening = Screen(api_key, allowed_origins)
        self.limits = limits or Limits()
        self.guard = Guard(self.limits, 0)  # sized for the descriptor limit at start()
        self.queued = 0  # requests read ahead on all connections + those waiting for an engine
        self.started_at = time.time()
        self.events = RequestEvents()
        self.capture_bodies = False
        self.set_capture_bodies(capture_bodies)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self.connections: set[ClientConnection] = set()
        self.upstreams = UpstreamPool(timeouts)
        self.counters = self.events.counters
        self.router = Router(self.counters)  # owned by the proxy's loop
        self.router.default.extra_routes = frozenset(extra_routes)
        self.forwarder = Forwarder(self, self.router, self.upstreams)
        self.capabilities = TrafficCapabilities()  # what each model's traffic used: a switch keeps it working
        self.dispatcher = Dispatcher(self.router, self.events, self.forwarder, self.capabilities, model_name,
                                     self.started_at)

    def served_names(self) -> Container[str]:
        """The model names this endpoint serves: the configured models, or the one served name (read on the
        endpoint's loop, where the request log's listeners run)."""
        return self.router.routes or (self.model_name,)

    # --- configuration (before start) ---
    def subscribe(self, listener: RequestListener) -> None:
        self.events.listeners.append(listener)

    def subscribe_started(self, listener: RequestListener) -> None:
        """Also tell `listener` when a request arrives (a record with status 0), for views of what is in flight."""
        self.events.started_listeners.append(listener)

    def set_capture_bodies(self, on: bool) -> None:
        """Keep request and response bodies in the request records (off by default; never with an API key:
        the endpoint is then shared, and its clients' prompts are not the local user's to read)."""
        if on and self.api_key:
            raise SwitchyardError("body capture is not available on an endpoint with an API key",
                                  "serve without --api-key-env to capture bodies")
        self.capture_bodies = on

    def add_routes(self, routes: Iterable[LocalRoute]) -> None:
        """Extra routes served on the same port by the endpoint itself (the control channel under /switchyard/,
        whose token the screen checks from the head; any other path needs the API key like inference); call
        before start()."""
        for route in routes:
            if route.token is not None:
                self.screening.control_token = route.token
            self.dispatcher.local_routes.setdefault(route.path, {})[route.method.upper()] = route.handler

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

        self.guard = Guard(self.limits, raise_fd_limit())
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
        self._server = await loop.create_server(lambda: ClientConnection(self), self.host, self.port,
                                                backlog=min(1024, self.guard.max_connections))
        self.guard.start(loop)
        if self.port == 0:
            self.port = int(self._server.sockets[0].getsockname()[1])

    async def _stop_server(self) -> None:
        self.guard.stop()
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
        # Every request still waiting (also those of clients that just left, whose cancellation is under way).
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.dispatcher.close()

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

    def set_models(self, models: dict[str, dict[str, Any]], on_demand: OnDemand | None = None,
                   loading_status: Iterable[str] = (), extra_routes: Mapping[str, Iterable[str]] | None = None,
                   reasoning: Mapping[str, str] | None = None) -> None:
        """Serve several models (call before start): requests are routed by their JSON `model` field to the
        route of that name, an unknown name gets a 404 naming the ones that exist, /v1/models lists them all.
        `on_demand(name)` is called (on the endpoint's loop: it must not block) when a request finds its model
        unloaded; names in `loading_status` tell waiting streaming clients that their model loads;
        `extra_routes[name]`: paths forwarded to that model's engine besides INFERENCE_ROUTES."""
        shown = set(loading_status)
        extra = extra_routes or {}
        efforts = reasoning or {}
        self.router.routes = {name: Route(info=dict(info), loading_status=name in shown,
                                          extra_routes=frozenset(extra.get(name, ())),
                                          reasoning_effort=efforts.get(name, "auto"))
                              for name, info in models.items()}
        self.router.on_demand = on_demand

    def set_reasoning(self, effort: str) -> None:
        """The served model's reasoning setting (single-model mode), for requests that set none (rule 6)."""
        self.router.default.reasoning_effort = effort

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

    # --- requests ---
    def screen(self, method: str, path: str, headers: Headers) -> tuple[LocalResponse | None, bytes, bool]:
        """Judge a request by its head (ClientConnection calls this before reading the body); see Screen."""
        return self.screening.judge(method, path, headers)

    def dispatch(self, request: Incoming, client: ClientConnection) -> None:
        """Answer one request that passed screen(); calls client.request_done() when finished, now or later."""
        self.dispatcher.dispatch(request, client)

    def record(self, record: RequestRecord) -> None:
        """A forwarded request finished (answered by its engine or by the endpoint): count it and publish it."""
        self.events.finished(record)


class Screen:
    """Judging a request by its head alone: refuse a foreign Host or Origin (403), a missing API key (401), a
    control request without the control token (403) and a body sent to `/health` (400), answer a CORS preflight;
    otherwise the CORS lines the answer will carry (none without an Origin).

    Whether the request showed its credential (the API key where one is set, the control token under
    /switchyard/) is part of the verdict: only such a request makes its connection one the guard evicts last, so
    keyless `/health` checks never hold what a keyed client needs, and no keyless request is ever read a body."""

    def __init__(self, api_key: str | None, allowed_origins: Iterable[str]) -> None:
        self.api_key = api_key
        self.allowed_origins = frozenset(allowed_origins)
        self.control_token: str | None = None  # the control routes' token (ProxyServer.add_routes)
        self._hosts: dict[str, bool] = {}

    def judge(self, method: str, path: str, headers: Headers) -> tuple[LocalResponse | None, bytes, bool]:
        """(an answer that ends the request here, or None; CORS head lines; whether it showed its credential)."""
        # each API's own error shape
        error = anthropic_error if path.startswith(MESSAGES_PATH) else ollama_error if path.startswith("/api/") \
            else json_error
        host = headers.get("Host")
        if host and not self._local_host(host):
            return error(403, f"the endpoint answers only requests addressed to this machine, not to "
                              f"'{host[:100]}'", "permission_error"), b"", False
        origin = headers.get("Origin")
        cors = b""
        if origin:
            if not self._origin_allowed(origin):
                return error(403, f"requests from web pages at '{origin[:100]}' are refused; allow the origin with "
                                  "`switchyard serve --allowed-origins ORIGIN` or the allowed_origins setting",
                             "permission_error"), b"", False
            cors = f"Access-Control-Allow-Origin: {origin}\r\nVary: Origin\r\n".encode("latin-1")
            if method == "OPTIONS" and "Access-Control-Request-Method" in headers:
                return self._preflight(origin, headers), b"", False
        if path == "/health":
            if _has_body(headers):
                return json_error(400, "/health takes no request body: GET it", "invalid_request_error"), cors, False
            return None, cors, self._authorized(headers)  # open to anyone, but a credential only with the key
        if path.startswith(CONTROL_PREFIX) and self.control_token is not None:
            if not hmac.compare_digest(headers.get(TOKEN_HEADER).encode(), self.control_token.encode()):
                return LocalResponse.json({"error": "missing or wrong control token"}, status=403), cors, False
            return None, cors, True
        if not self._authorized(headers):
            return error(401, "invalid or missing API key", "authentication_error"), cors, False
        return None, cors, True

    def _authorized(self, headers: Headers) -> bool:
        if not self.api_key:
            return True
        header = headers.get("Authorization")
        token = header[7:] if header.lower().startswith("bearer ") else headers.get("x-api-key")
        return hmac.compare_digest(token.encode(), self.api_key.encode())

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


def _has_body(headers: Headers) -> bool:
    """Whether the head announces a body (llhttp has checked that Content-Length is one plain number)."""
    if "chunked" in headers.get("Transfer-Encoding").lower():
        return True
    length = headers.get("Content-Length").strip()
    return bool(length) and length.strip("0") != ""
