"""Forwarding a dispatched request to an engine: the one path every forwarded request takes.

An engine that is active with an idle pooled connection at hand takes the request right inside the callback that
read it (no task). Otherwise the request waits in a task, bounded: for an engine to become active (telling a
streaming client every few seconds that its model loads, when the route asks for that), for a fresh connection,
and it is retried once elsewhere when an engine refused it before answering. Every answer the endpoint gives
instead of the engine (503, 501, a stream's error event) is recorded like the engine's answers."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from desktop.core.common.sse import LAST_CHUNK, chunk, comment, error_event
from desktop.core.serving.http1 import (
    ClientConnection,
    Incoming,
    Limits,
    anthropic_error,
    json_error,
    ollama_error,
    overloaded,
    queue_full,
)
from desktop.core.serving.metering import CapturingMeter, RequestRecord
from desktop.core.serving.router import Lease, Route, Router, Unavailable, Upstream
from desktop.core.serving.upstream import Exchange, UpstreamConnection, UpstreamPool

log = logging.getLogger("switchyard.proxy")

LOADING_NOTE_EVERY = 2.0  # seconds between ": loading model X (12 s)" comments to a waiting streaming client
STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n" \
              b"Transfer-Encoding: chunked\r\n"
MESSAGES_PATH = "/v1/messages"  # Anthropic Messages: forwarded only to engines that answer it


class Endpoint(Protocol):
    """What the forwarder needs of the endpoint that owns it (ProxyServer)."""

    limits: Limits
    queued: int
    wait_timeout: float
    retry_window: float
    capture_bodies: bool

    def record(self, record: RequestRecord) -> None: ...


@dataclass
class Job:
    """One request on its way to an engine."""

    request: Incoming
    client: ClientConnection
    route: Route
    model: str | None  # the route's name in multi-model mode (what on_demand loads)
    arrived: float  # loop time
    wall: float
    told: bool = False  # a loading note went out: the client already has a 200 event-stream head

    def record(self, status: int, error: str | None, now: float, upstream: Upstream | None = None,
               streamed: bool = False) -> RequestRecord:
        """The record of an answer the endpoint gave itself, carrying what an engine's answer carries."""
        request = self.request
        path = request.ollama.path if request.ollama is not None else request.path  # what the client asked
        return RequestRecord(self.wall, request.method, path, upstream.name if upstream else None, status,
                             streamed, None, now - self.arrived, None, error, model=request.info.model,
                             engine=upstream.engine if upstream else None, client=self.client.peer,
                             seq=request.seq)


class Forwarder:
    """Acquire an engine, forward, wait and retry (see the module's docstring)."""

    def __init__(self, endpoint: Endpoint, router: Router, upstreams: UpstreamPool) -> None:
        self.endpoint = endpoint
        self.router = router
        self.upstreams = upstreams

    def forward(self, request: Incoming, client: ClientConnection, route: Route, model: str | None) -> None:
        """Forward `request`; client.request_done() is called when it is answered."""
        loop = asyncio.get_running_loop()
        job = Job(request, client, route, model, loop.time(), time.time())
        upstream = self.router.try_acquire(None, route)
        if upstream is not None:
            if not self._takes(job, upstream):
                client.request_done(True)
                return
            connection = self.upstreams.pooled(upstream.base_url, job.arrived)
            if connection is not None:
                lease = Lease(self.router, upstream)
                self._begin(job, lease, connection).done.add_done_callback(
                    lambda done: self._answered(job, lease, done))
                return
            self.router.release(upstream)
        client.wait_in(self._wait(job))

    def _answered(self, job: Job, lease: Lease, done: asyncio.Future[RequestRecord | None]) -> None:
        lease.release()
        record = done.result()
        if record is not None:
            job.client.request_done(job.request.keep_alive and record.status != 499)
        elif job.client.closed:
            job.client.request_done(False)
        else:  # the kept-alive connection had just been closed by the engine: the waiting path retries
            job.client.wait_in(self._wait(job))

    def _takes(self, job: Job, upstream: Upstream) -> bool:
        """Whether `upstream` can answer the request; if not, it is released and the client answered 501."""
        if upstream.messages_api or not job.request.path.startswith(MESSAGES_PATH):
            return True
        self.router.release(upstream)
        self.fail(job, upstream, 501, f"the engine {upstream.engine} does not support the Anthropic Messages API "
                                      f"({job.request.path}); use /v1/chat/completions, or switch to an engine "
                                      "that has it")
        return False

    async def _wait(self, job: Job) -> bool:
        """The waiting path; returns `keep` (False when the answer was cut short)."""
        try:
            return await self._wait_and_retry(job)
        except asyncio.CancelledError:  # the client left while its request waited (an exchange records itself)
            self.endpoint.record(job.record(499, "the client disconnected", asyncio.get_running_loop().time()))
            raise

    async def _wait_and_retry(self, job: Job) -> bool:
        loop = asyncio.get_running_loop()
        endpoint = self.endpoint
        deadline = job.arrived + endpoint.wait_timeout
        avoid: Upstream | None = None
        refused: dict[str, int] = {}
        while True:
            upstream = self.router.try_acquire(avoid, job.route)
            if upstream is None:
                if endpoint.queued >= endpoint.limits.queued:
                    return self.fail(job, None, 503, queue_full(endpoint.limits), retry_after=True)
                endpoint.queued += 1
                try:
                    upstream = await self._acquire(job, deadline, avoid)
                except Unavailable as exc:
                    what = f"model '{job.model}'" if job.model is not None and self.router.multi else "engine"
                    return self.fail(job, None, 503, f"no {what} is serving: {exc}")
                finally:
                    endpoint.queued -= 1
            if not self._takes(job, upstream):
                return True
            lease = Lease(self.router, upstream)
            try:
                record, reused = await self._exchange(job, lease)
            finally:
                lease.release()
            if record is not None:
                return job.request.keep_alive and record.status != 499
            if reused:
                continue  # a kept-alive connection the engine had just closed: retry on another at once
            # Nothing reached the client yet. Once: a passing hiccup, so retry at once. Again: the engine is
            # stopping or dead, so wait for the endpoint to move on.
            refused[upstream.name] = refused.get(upstream.name, 0) + 1
            if refused[upstream.name] >= 2:
                avoid = upstream
                deadline = min(job.arrived + endpoint.wait_timeout, loop.time() + endpoint.retry_window)

    async def _acquire(self, job: Job, deadline: float, avoid: Upstream | None) -> Upstream:
        """Wait for the route's engine; a streaming client of a route that asks for it hears every few seconds
        that its model loads, as SSE comment lines (`: loading model X (12 s)`) that OpenAI clients ignore."""
        request, client, route = job.request, job.client, job.route
        waiting = self.router.acquire(deadline, avoid, route, job.model)
        if not (route.loading_status and job.model is not None and not request.http10 and request.info.stream
                and request.ollama is None):  # NDJSON has no comment lines: an Ollama client just waits
            return await waiting
        task = asyncio.ensure_future(waiting)
        try:
            while True:
                done, _pending = await asyncio.wait({task}, timeout=LOADING_NOTE_EVERY)
                if done:
                    return task.result()
                if client.closed or client.transport is None:
                    continue
                since = route.loading_since
                note = f"loading model {job.model} ({time.monotonic() - since:.0f} s)" if since is not None \
                    else f"waiting for model {job.model}"
                head = b"" if job.told else STREAM_HEAD + request.cors + b"\r\n"
                client.transport.write(head + chunk(comment(note)))
                job.told = True
        finally:
            if not task.done():
                task.cancel()

    async def _exchange(self, job: Job, lease: Lease) -> tuple[RequestRecord | None, bool]:
        """Forward once: (record, reused). A None record means "nothing reached the client": the caller may
        retry; `reused` says it failed on a kept-alive connection (retry at once) rather than a fresh one."""
        upstream = lease.upstream
        connection = self.upstreams.pooled(upstream.base_url, asyncio.get_running_loop().time())
        reused = connection is not None
        if connection is None:
            try:
                connection = await self.upstreams.connect(upstream.base_url, upstream.closes_after_stream)
            except (OSError, TimeoutError) as exc:
                log.info("%s refused a request (%s): retrying", upstream.name, exc or type(exc).__name__)
                return None, False
            if upstream.listener_check is not None and not await asyncio.to_thread(upstream.listener_check):
                connection.abort()  # nothing was written: not the key, not the prompt
                log.warning("%s: its port is no longer held by the engine; nothing was sent there", upstream.name)
                return None, False
        return await self._begin(job, lease, connection).done, reused

    def _begin(self, job: Job, lease: Lease, connection: UpstreamConnection) -> Exchange:
        request, client = job.request, job.client
        exchange = Exchange(self.endpoint.record, client, request, lease, job.arrived, job.wall, connection,
                            self.upstreams, head_sent=job.told, retry_after_s=self.endpoint.limits.retry_after_s)
        if self.endpoint.capture_bodies:
            exchange.meter = CapturingMeter(job.arrived, request.body)
        if client.closed:
            exchange.client_gone()
        else:
            client.exchange = exchange
            exchange.send()
        return exchange

    def fail(self, job: Job, upstream: Upstream | None, status: int, message: str,
             retry_after: bool = False) -> bool:
        """Answer the request with an error of the endpoint's own (as a stream's error event once a loading note
        told the client its stream began). Returns `keep`."""
        now = asyncio.get_running_loop().time()
        request, client = job.request, job.client
        self.endpoint.record(job.record(status, message, now, upstream, streamed=job.told))
        if job.told:
            if not client.closed and client.transport is not None:
                client.transport.write(chunk(error_event(message, "upstream_unavailable", status, anthropic=request.path
                                                         .startswith(MESSAGES_PATH))) + LAST_CHUNK)
            return True
        error = anthropic_error(status, message) if request.path.startswith(MESSAGES_PATH) else \
            ollama_error(status, message) if request.ollama is not None else \
            json_error(status, message, "overloaded_error" if retry_after else "upstream_unavailable")
        if retry_after:
            error.headers = overloaded(self.endpoint.limits, message).headers
        client.write_response(error, request=request)
        return True

