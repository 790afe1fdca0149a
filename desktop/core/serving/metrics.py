"""`GET /metrics` on the endpoint: Prometheus text format, one schema whichever engine serves, written by
`prometheus_client`.

Fed from what the endpoint already records, so no engine is scraped and both engines read the same: every finished
request of the request log (`RequestLog`, one listener) counts by model/engine/status, observes its TTFT, its mean
inter-token latency ((E2E - TTFT) / (output tokens - 1); the proxy does not time every chunk) and its tokens; the
in-flight gauge reads the log's in-flight table at scrape time; cold starts by phase come from the launches in
history since the endpoint started (read at scrape time, at most once a second). Switches and autopilot decisions
are observed through `observe_switch` / `observe_decision`, which the endpoint manager calls when it makes them
(the autopilot's reach it as request-log events).

Each observation costs a few microseconds on the endpoint's loop (`benchmarks/bench_metrics.py` measures it);
the text is built only when someone scrapes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Container, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from desktop.core.serving.metering import RequestRecord

if TYPE_CHECKING:
    from desktop.core.serving.http1 import LocalRequest, LocalResponse, LocalRoute
    from desktop.core.serving.requestlog import RequestLog

METRICS_PATH = "/metrics"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
COLD_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 600.0, 1200.0)
PHASES = ("t1_health_s", "t2_first_token_s", "t3_first_request_s")
LAUNCH_SYNC_S = 1.0


OTHER_MODEL = "other"  # the label of every requested model name that is not one the endpoint serves
UNNAMED_LABELS = 16  # without a list of served names: the first distinct names, then OTHER_MODEL


class EndpointMetrics:
    """The endpoint's metrics in a registry of its own (never the global one: two endpoints in one process,
    as in tests, must not mix).

    A request's `model` is the client's string, so it labels a series only when it is a name the endpoint
    serves (`model_names`: the configured models, or the served name of a single-model endpoint); any other
    name is `other`. Label sets, and so the size of a scrape, stay bounded whatever clients send."""

    def __init__(self, request_log: RequestLog | None = None, history: Any = None,
                 started_at: float | None = None,
                 model_names: Callable[[], Container[str]] | None = None) -> None:
        self._model_names = model_names
        self._unnamed: set[str] = set()
        self.registry = CollectorRegistry(auto_describe=True)
        self.started_at = time.time() if started_at is None else started_at
        self._history = history  # anything with runs(limit, kind): storage.history.Store
        self._seen_launches: set[int] = set()
        self._synced = 0.0
        self._lock = threading.Lock()
        r = self.registry
        labels = ("model", "engine")
        self.requests = Counter("switchyard_requests", "Finished requests by model, engine and HTTP status",
                                (*labels, "status"), registry=r)
        self.ttft = Histogram("switchyard_ttft_seconds", "Arrival to first token (includes any wait for an engine)",
                              labels, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("switchyard_request_duration_seconds", "Arrival to the last byte of the answer",
                             labels, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("switchyard_inter_token_latency_seconds",
                             "Mean gap between output tokens of each request ((E2E - TTFT) / (tokens - 1))",
                             labels, buckets=ITL_BUCKETS, registry=r)
        self.prompt_tokens = Counter("switchyard_prompt_tokens", "Prompt tokens of answered requests", labels,
                                     registry=r)
        self.output_tokens = Counter("switchyard_output_tokens", "Output tokens of answered requests", labels,
                                     registry=r)
        self.queue_wait = Histogram("switchyard_queue_wait_seconds",
                                    "Time a request waited at the endpoint for an engine (where the proxy reports "
                                    "it)", labels, buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("switchyard_requests_in_flight", "Requests being answered or waiting for an engine",
                               registry=r)
        self.switches = Counter("switchyard_switches", "Engine switches of the endpoint",
                                ("from_engine", "to_engine", "kind"), registry=r)
        self.switch_gap = Histogram("switchyard_switch_gap_seconds", "How long no engine served during a switch",
                                    buckets=(0.0, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0), registry=r)
        self.cold_start = Histogram("switchyard_cold_start_seconds", "Engine cold starts by phase (seconds since "
                                    "spawn: T1 health, T2 first token, T3 first request)", ("engine", "phase"),
                                    buckets=COLD_BUCKETS, registry=r)
        self.decisions = Counter("switchyard_autopilot_decisions", "Hybrid-policy decisions by action", ("action",),
                                 registry=r)
        self._status: dict[tuple[str, str, int], Any] = {}
        self._children: dict[tuple[str, str], tuple[Any, ...]] = {}
        self._request_log = request_log
        if request_log is not None:
            self.in_flight.set_function(lambda: float(len(request_log.inflight())))
            request_log.subscribe(self._on_request)
            request_log.subscribe_events(self._on_event)

    # --- feeding ---
    def _on_request(self, kind: str, record: RequestRecord) -> None:
        if kind == "finished":
            self.observe_request(record)

    def _on_event(self, event: Mapping[str, Any]) -> None:
        if event.get("kind") == "autopilot":  # the hybrid loop's decisions, as the request log keeps them
            self.observe_decision(str(event.get("action")))

    def model_label(self, model: str | None) -> str:
        """The `model` label of a request that named `model` (bounded: see the class docstring)."""
        if not model:
            return ""
        if self._model_names is not None:
            return model if model in self._model_names() else OTHER_MODEL
        if model in self._unnamed or len(self._unnamed) < UNNAMED_LABELS:
            self._unnamed.add(model)
            return model
        return OTHER_MODEL

    def observe_request(self, record: RequestRecord) -> None:
        model, engine = self.model_label(record.model), record.engine or ""
        status = self._status.get((model, engine, record.status))
        if status is None:  # labels() costs ~10 us; a dict lookup per request instead
            status = self._status[(model, engine, record.status)] = self.requests.labels(model, engine,
                                                                                        str(record.status))
        status.inc()
        kids = self._children.get((model, engine))
        if kids is None:
            kids = self._children[(model, engine)] = tuple(
                m.labels(model, engine) for m in (self.e2e, self.ttft, self.itl, self.prompt_tokens,
                                                  self.output_tokens, self.queue_wait))
        e2e, ttft, itl, prompt, output, queue_wait = kids
        e2e.observe(max(0.0, record.e2e_s))
        if record.ttft_s is not None:
            ttft.observe(max(0.0, record.ttft_s))
            if record.output_tokens and record.output_tokens > 1:
                itl.observe(max(0.0, (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)))
        if record.status < 400 and record.error is None:
            if record.prompt_tokens:
                prompt.inc(record.prompt_tokens)
            if record.output_tokens:
                output.inc(record.output_tokens)
        wait = getattr(record, "queue_wait_s", None)
        if isinstance(wait, (int, float)):
            queue_wait.observe(max(0.0, float(wait)))

    def observe_switch(self, from_engine: str | None, to_engine: str, kind: str, gap_s: float) -> None:
        self.switches.labels(from_engine or "", to_engine, kind).inc()
        self.switch_gap.observe(max(0.0, gap_s))

    def observe_cold_start(self, engine: str, cold_start: Mapping[str, Any]) -> None:
        for phase in PHASES:
            value = cold_start.get(phase)
            if isinstance(value, (int, float)):
                self.cold_start.labels(engine, phase.removesuffix("_s")).observe(float(value))

    def observe_decision(self, action: str) -> None:
        self.decisions.labels(action).inc()

    def _sync_launches(self) -> None:
        """Cold starts of the launches recorded in history since the endpoint started."""
        history = self._history
        now = time.monotonic()
        if history is None or not hasattr(history, "runs") or now - self._synced < LAUNCH_SYNC_S:
            return
        self._synced = now
        try:
            runs = history.runs(limit=50, kind="launch")
        except Exception:  # history trouble never breaks a scrape
            return
        for run in reversed(runs):
            if run.id in self._seen_launches or run.created_at < self.started_at:
                continue
            self._seen_launches.add(run.id)
            self.observe_cold_start(run.engine or "", run.summary.get("cold_start") or {})

    # --- reading ---
    def render(self) -> bytes:
        with self._lock:
            self._sync_launches()
        return generate_latest(self.registry)

    def close(self) -> None:
        if self._request_log is not None:
            self._request_log.unsubscribe(self._on_request)


def metrics_routes(request_log: RequestLog, history: Any = None,
                   model_names: Callable[[], Container[str]] | None = None) -> list[LocalRoute]:
    """`GET /metrics` for the endpoint's port (the proxy guards it like the API: local Host, the API key if set).
    `model_names`: the names the endpoint serves, the only `model` labels besides `other`."""
    import asyncio

    from desktop.core.serving.http1 import LocalResponse, LocalRoute

    metrics = EndpointMetrics(request_log, history, model_names=model_names)

    async def scrape(_request: LocalRequest) -> LocalResponse:
        body = await asyncio.to_thread(metrics.render)
        return LocalResponse(200, body, content_type=CONTENT_TYPE_LATEST)

    route = LocalRoute("GET", METRICS_PATH, scrape)
    route.handler.metrics = metrics  # type: ignore[attr-defined]  # tests and the manager reach it from the route
    return [route]


__all__ = ["METRICS_PATH", "OTHER_MODEL", "EndpointMetrics", "metrics_routes"]
