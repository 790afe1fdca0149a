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
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from desktop.core.common.errors import PortBusy, SwitchyardError
from desktop.core.runtime.ports import holder_of
from desktop.core.serving.http1 import (
    HOP_HEADERS,
    ClientConnection,
    Headers,
    Incoming,
    LocalHandler,
    LocalRequest,
    LocalResponse,
    LocalRoute,
    json_error,
    new_event_loop,
)
from desktop.core.serving.metering import RequestListener, RequestRecord
from desktop.core.serving.router import Lease, Router, Unavailable, Upstream
from desktop.core.serving.upstream import Exchange, Target, UpstreamConnection, UpstreamPool

__all__ = ["CONTROL_PREFIX", "DEFAULT_PROXY_PORT", "DEFAULT_WAIT_TIMEOUT", "ProxyServer", "RequestRecord", "Upstream"]

log = logging.getLogger("switchyard.proxy")

DEFAULT_PROXY_PORT = 8800
DEFAULT_WAIT_TIMEOUT = 600.0
CONTROL_PREFIX = "/switchyard/"
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
        self.connections: set[ClientConnection] = set()
        self.upstreams = UpstreamPool()
        self.counters = {"requests": 0, "failed": 0, "waited": 0}
        self.router = Router(self.counters)  # owned by the proxy's loop

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

    # --- routing (thread-safe) ---
    def set_upstream(self, upstream: Upstream | None, down_reason: str | None = None) -> None:
        """Send new requests to `upstream` from now on. None makes them wait (starting or switching) or, with
        `down_reason`, fail at once with that reason (no engine will come)."""
        if upstream is not None:
            Target.parse(upstream.base_url)  # a URL the endpoint cannot forward to fails here, in the caller
        self.call(self.router.set_upstream(upstream, down_reason), timeout=10)

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

    def dispatch(self, request: Incoming, client: ClientConnection) -> None:
        """Answer one request; calls client.request_done() when finished, now or later."""
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
        elif not self._authorized(request.headers):
            client.write_response(json_error(401, "invalid or missing API key", "authentication_error"),
                                  request=request)
        elif path == "/v1/models" and request.method in ("GET", "HEAD"):
            client.write_response(self._models(), request=request)
        else:
            self._forward_now(request, client)
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

    def _forward_now(self, request: Incoming, client: ClientConnection) -> None:
        """The common case without a task: an engine is active and an idle connection to it is at hand."""
        loop = asyncio.get_running_loop()
        arrived, wall = loop.time(), time.time()
        self.counters["requests"] += 1
        upstream = self.router.try_acquire(None)
        connection = self.upstreams.pooled(upstream.base_url, arrived) if upstream is not None else None
        if upstream is None or connection is None:
            if upstream is not None:
                self.router.release(upstream)
            client.wait_in(self._forward(request, client, arrived, wall))
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
                client.wait_in(self._forward(request, client, arrived, wall))

        exchange.done.add_done_callback(answered)

    def _health(self) -> LocalResponse:
        if self.router.active is not None:
            return LocalResponse.json({"status": "ok", "engine": self.router.active.engine})
        return LocalResponse.json({"status": "unavailable", "reason": self.router.down_reason or "starting"}, status=503)

    def _models(self) -> LocalResponse:
        active = self.router.active
        entry: dict[str, Any] = {"id": self.model_name, "object": "model", "created": int(self.started_at),
                                 "owned_by": "switchyard"}
        if active is not None:
            entry["switchyard"] = {"engine": active.engine, "model": active.model}
        return LocalResponse.json({"object": "list", "data": [entry]})

    async def _forward(self, request: Incoming, client: ClientConnection, arrived: float, wall: float) -> bool:
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

    async def _forward_with_retries(self, request: Incoming, client: ClientConnection, arrived: float,
                                    wall: float, deadline: float, avoid: Upstream | None,
                                    refused: dict[str, int]) -> bool:
        loop = asyncio.get_running_loop()
        while True:
            upstream = self.router.try_acquire(avoid)
            if upstream is None:
                try:
                    upstream = await self.router.acquire(deadline, avoid)
                except Unavailable as exc:
                    return self._fail(request, client, wall, arrived, None, 503, f"no engine is serving: {exc}")
            lease = Lease(self.router, upstream)
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

    async def _exchange(self, request: Incoming, client: ClientConnection, lease: Lease, wall: float,
                        arrived: float) -> tuple[RequestRecord | None, bool]:
        """Forward once: (record, reused). A None record means "nothing reached the client": the caller may
        retry; `reused` says it failed on a kept-alive connection (retry at once) rather than a fresh one."""
        loop = asyncio.get_running_loop()
        upstream = lease.upstream
        connection = self.upstreams.pooled(upstream.base_url, loop.time())
        reused = connection is not None
        if connection is None:
            try:
                connection = await self.upstreams.connect(upstream.base_url)
            except (OSError, TimeoutError) as exc:
                log.info("%s refused a request (%s): retrying", upstream.name, exc or type(exc).__name__)
                return None, False
        exchange = self._begin(request, client, lease, connection, arrived, wall)
        return await exchange.done, reused

    def _begin(self, request: Incoming, client: ClientConnection, lease: Lease,
               connection: UpstreamConnection, arrived: float, wall: float) -> Exchange:
        upstream = lease.upstream
        target = self.upstreams.target(upstream.base_url)
        exchange = Exchange(self._record, client, request, lease, arrived, wall, connection)
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
              upstream: Upstream | None, status: int, message: str) -> bool:
        now = asyncio.get_running_loop().time()
        self._record(RequestRecord(wall, request.method, request.path, upstream.name if upstream else None,
                                   status, False, None, now - arrived, None, message))
        client.write_response(json_error(status, message, "upstream_unavailable"), request=request)
        return True

    def _record(self, record: RequestRecord) -> None:
        if record.status != 499 and (record.error is not None or record.status >= 500):
            self.counters["failed"] += 1
        for listener in list(self._listeners):
            try:
                listener(record)
            except Exception:
                log.exception("request listener failed")
