"""Load shapes: closed loop (fixed concurrency) or open loop (constant, Poisson or gamma arrivals), bounded by a
request count or a duration, with warm-up and cool-down requests sent but left out of the numbers, and sweeps
over concurrency or rate.

Cool-down requests keep the load steady while the last measured requests finish (so the tail of a closed-loop
run is not measured at a falling concurrency); they are cancelled as soon as every measured request is done.
The event loop's own CPU time is measured: when it nears a full core the client, not the server, may be the
bottleneck, and the result says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import httpx
import numpy as np

from desktop.core.common.errors import SwitchyardError
from desktop.core.common.progress import ProgressCallback, ProgressEvent, no_progress
from desktop.core.measure.loadgen.client import (
    CONNECT_ERROR,
    ServerTokenCounter,
    Target,
    discover_model,
    send_request,
    server_token_counter,
)
from desktop.core.measure.loadgen.metrics import SLO, BenchmarkSummary, LiveBucket, RequestResult, summarize
from desktop.core.measure.loadgen.workload import (
    JsonlWorkload,
    RequestSpec,
    TokenCounter,
    Workload,
    generate,
)

Arrival = Literal["constant", "poisson", "gamma"]
BucketCallback = Callable[[LiveBucket], None]
AbortCheck = Callable[[], str | None]

DEFAULT_CONCURRENCY = (1, 8, 32, 64)
CPU_SATURATION = 0.85


@dataclass(frozen=True)
class LoadConfig:
    """One load level. Closed loop at `concurrency` when `rate` is None; else open loop at `rate` req/s."""

    concurrency: int | None = 1
    rate: float | None = None
    arrival: Arrival = "poisson"
    burstiness: float = 1.0  # gamma shape: 1 = Poisson, < 1 burstier, > 1 more regular
    num_requests: int | None = 64
    duration_s: float | None = None  # bounds the run by time instead of count
    warmup_requests: int = 0
    cooldown_requests: int = 0
    warmup_s: float = 0.0
    cooldown_s: float = 0.0
    request_timeout_s: float = 300.0
    abort_after_connect_errors: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate is None and (self.concurrency is None or self.concurrency < 1):
            raise SwitchyardError("a closed-loop run needs a concurrency of at least 1", "e.g. --concurrency 8")
        if self.rate is not None and self.rate <= 0:
            raise SwitchyardError(f"request rate must be positive, got {self.rate}", "e.g. --rate 4")
        if self.num_requests is None and self.duration_s is None:
            raise SwitchyardError("a run needs a request count or a duration", "give --requests N or --duration S")
        if self.num_requests is not None and self.num_requests < 1:
            raise SwitchyardError(f"request count must be at least 1, got {self.num_requests}")
        if self.burstiness <= 0:
            raise SwitchyardError(f"burstiness must be positive, got {self.burstiness}")

    @property
    def label(self) -> str:
        if self.rate is not None:
            return f"rate {self.rate:g}/s"
        return f"concurrency {self.concurrency}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadResult:
    """One load level's full outcome: summary, per-request records, live buckets, client health."""

    config: LoadConfig
    target: Target
    workload: dict[str, Any]
    model: str | None
    summary: BenchmarkSummary
    requests: list[RequestResult]
    buckets: list[LiveBucket]
    client_cpu: float  # event-loop CPU seconds / wall seconds over the run (1.0 = a full core)
    warnings: list[str] = field(default_factory=list)
    aborted: str | None = None
    started_at: float = 0.0
    prompt_tokens_source: str = "words (estimate)"  # how prompts were sized: tokenizer, server /tokenize, words
    sent_prompt_tokens: float | None = None  # mean prompt tokens as sized before sending

    @property
    def label(self) -> str:
        return self.config.label

    @property
    def mean_prompt_tokens(self) -> float | None:
        """Mean prompt tokens of the completed requests, as the server counted them (its usage) when it said."""
        done = self.summary.completed
        return round(self.summary.total_input_tokens / done, 2) if done else None

    def to_json(self, include_requests: bool = False) -> dict[str, Any]:
        data: dict[str, Any] = {
            "label": self.label,
            "config": self.config.to_json(),
            "target": self.target.to_json(),
            "workload": self.workload,
            "model_id": self.model,
            "started_at": self.started_at,
            **self.summary.to_json(),
            "max_concurrency": self.config.concurrency if self.config.rate is None else None,
            "request_rate": self.config.rate if self.config.rate is not None else "inf",
            "burstiness": self.config.burstiness,
            "client_cpu": self.client_cpu,
            "warnings": list(self.warnings),
            "aborted": self.aborted,
            "mean_prompt_tokens": self.mean_prompt_tokens,
            "sent_prompt_tokens": self.sent_prompt_tokens,
            "prompt_tokens_source": self.prompt_tokens_source,
            "buckets": [b.to_json() for b in self.buckets],
        }
        if include_requests:
            data["requests"] = [r.to_json() for r in self.requests]
        return data


@dataclass
class SweepResult:
    levels: list[LoadResult]

    @property
    def aborted(self) -> str | None:
        return next((level.aborted for level in self.levels if level.aborted), None)

    def to_json(self, include_requests: bool = False) -> dict[str, Any]:
        return {"levels": [level.to_json(include_requests) for level in self.levels]}


def sweep_levels(base: LoadConfig, concurrency: list[int] | None = None,
                 rates: list[float] | None = None) -> list[LoadConfig]:
    """Load levels for a sweep over concurrency (closed loop) or request rate (open loop)."""
    if rates:
        return [replace(base, rate=rate) for rate in rates]
    return [replace(base, concurrency=c, rate=None) for c in (concurrency or list(DEFAULT_CONCURRENCY))]


class _Live:
    """Counters the 1-second ticker turns into LiveBuckets."""

    def __init__(self) -> None:
        self.completed = self.failed = self.tokens = self.in_flight = 0
        self.ttfts: list[float] = []

    def on_chunk(self, result: RequestResult, first: bool) -> None:
        self.tokens += 1
        if first:
            self.ttfts.append(result.ttft)

    def take(self, second: int, cpu: float) -> LiveBucket:
        p50 = p95 = None
        if self.ttfts:
            p50, p95 = (float(v) * 1000.0 for v in np.percentile(self.ttfts, (50, 95)))
        bucket = LiveBucket(second, self.completed, self.failed, self.tokens, self.in_flight, p50, p95,
                            round(cpu, 3))
        self.completed = self.failed = self.tokens = 0
        self.ttfts = []
        return bucket


def _arrival_gaps(config: LoadConfig) -> Iterator[float]:
    rng = np.random.default_rng(config.seed)
    assert config.rate is not None
    while True:
        if config.arrival == "constant":
            yield 1.0 / config.rate
        else:
            shape = 1.0 if config.arrival == "poisson" else config.burstiness
            yield float(rng.gamma(shape, 1.0 / (config.rate * shape)))


DISTINCT_PROMPTS = 512  # a pool this large varies prompts enough for any concurrency; sizing more costs time only


def _specs(workload: Workload, config: LoadConfig, counter: TokenCounter | None) -> list[RequestSpec]:
    """The distinct requests of a run (cycled when it sends more). Capped because sizing a prompt can be a server
    round trip (/tokenize): 100,000 requests must not mean 100,000 round trips before the first one is sent."""
    wanted = DISTINCT_PROMPTS
    if config.num_requests is not None and config.duration_s is None:
        wanted = min(wanted, config.warmup_requests + config.num_requests + config.cooldown_requests)
    return generate(workload, wanted, counter)


def _spec_stream(specs: list[RequestSpec], config: LoadConfig) -> Iterator[RequestSpec]:
    if config.num_requests is not None and config.duration_s is None:
        yield from itertools.islice(itertools.cycle(specs), config.warmup_requests + config.num_requests
                                    + config.cooldown_requests)
        return
    while True:
        yield from specs


def token_source(counter: TokenCounter | None) -> str:
    if counter is None:
        return "words (estimate)"
    return "server /tokenize" if isinstance(counter, ServerTokenCounter) else "tokenizer"


async def calibrating_counter(target: Target, workload: Workload, counter: TokenCounter | None
                              ) -> TokenCounter | None:
    """The given counter; without one, the server's own /tokenize (when it has one) for generated prompts, so
    they have the asked length in the server's tokens."""
    if counter is not None or isinstance(workload, JsonlWorkload):
        return counter
    return await asyncio.to_thread(server_token_counter, target, target.model)


class _LoadRun:
    """One load level in flight: the clocks, counters and tasks its steps share. `dispatch` sends the requests
    (each phased warm-up, measure or cool-down), `drain` waits for the measured ones, `close` flushes the last
    part-second and `outcome` summarizes it."""

    def __init__(self, target: Target, config: LoadConfig, *, on_bucket: BucketCallback | None,
                 progress: ProgressCallback, abort_check: AbortCheck | None, stop: asyncio.Event | None) -> None:
        self.target = target
        self.config = config
        self.on_bucket = on_bucket
        self.progress = progress
        self.abort_check = abort_check
        self.stop = stop
        self.live = _Live()
        self.results: list[RequestResult] = []
        self.measured_tasks: set[asyncio.Task[RequestResult]] = set()
        self.other_tasks: set[asyncio.Task[RequestResult]] = set()
        self.measured_done = asyncio.Event()
        self.measuring_over = False
        self.abort_reason: list[str] = []
        self.consecutive_refused = 0
        self.limit = config.concurrency  # closed loop: the level; open loop: an optional cap on requests in flight
        self.slots = asyncio.Semaphore(self.limit) if self.limit else None
        self.started_at = time.time()
        self.clock_zero = time.perf_counter()
        self.cpu_zero = time.thread_time()
        self.buckets: list[LiveBucket] = []
        self.count_mode = config.duration_s is None
        self.total = (config.warmup_requests + (config.num_requests or 0) + config.cooldown_requests) \
            if self.count_mode else None

    def phase_of(self, index: int, now: float) -> str:
        config = self.config
        if self.count_mode:
            if index < config.warmup_requests:
                return "warmup"
            if index < config.warmup_requests + (config.num_requests or 0):
                return "measure"
            return "cooldown"
        assert config.duration_s is not None
        if now < config.warmup_s:
            return "warmup"
        return "measure" if now < config.warmup_s + config.duration_s else "cooldown"

    async def send_one(self, client: httpx.AsyncClient, spec: RequestSpec, index: int, phase: str,
                       model: str | None) -> RequestResult:
        config, live = self.config, self.live
        live.in_flight += 1
        try:
            result = await send_request(client, self.target, spec, index=index, model=model,
                                        clock_zero=self.clock_zero, timeout=config.request_timeout_s, phase=phase,
                                        on_chunk=live.on_chunk)
        finally:
            live.in_flight -= 1
            if self.slots:
                self.slots.release()
        self.results.append(result)
        self._count(result)
        done = sum(1 for r in self.results if r.phase == "measure")
        if self.total:
            self.progress(ProgressEvent(f"{config.label}: {done}/{config.num_requests} requests",
                                        done / max(1, config.num_requests or 1)))
        return result

    def _count(self, result: RequestResult) -> None:
        """Tally a finished request; enough refused connections in a row abort the run."""
        if result.success:
            self.live.completed += 1
            self.consecutive_refused = 0
            return
        self.live.failed += 1
        if (result.error or "").startswith(CONNECT_ERROR):
            self.consecutive_refused += 1
            if self.consecutive_refused >= self.config.abort_after_connect_errors and not self.abort_reason:
                self.abort_reason.append(f"the server at {self.target.base_url} stopped accepting connections "
                                         f"({result.error})")

    def _emit(self, bucket: LiveBucket) -> None:
        self.buckets.append(bucket)
        if self.on_bucket:
            self.on_bucket(bucket)

    async def ticker(self) -> None:
        second = 0
        last_cpu, last_wall = time.thread_time(), time.perf_counter()
        while True:
            await asyncio.sleep(max(0.0, self.clock_zero + second + 1 - time.perf_counter()))
            second += 1
            cpu, wall = time.thread_time(), time.perf_counter()
            bucket = self.live.take(second, (cpu - last_cpu) / max(1e-6, wall - last_wall))
            last_cpu, last_wall = cpu, wall
            self._emit(bucket)

    def should_stop(self, now: float) -> bool:
        if self.stop is not None and self.stop.is_set():
            if not self.abort_reason:
                self.abort_reason.append("stopped by the user")
            return True
        if self.abort_reason:
            return True
        if self.abort_check is not None:
            reason = self.abort_check()
            if reason:
                self.abort_reason.append(reason)
                return True
        if not self.count_mode:
            assert self.config.duration_s is not None
            end = self.config.warmup_s + self.config.duration_s + self.config.cooldown_s
            if now >= end:
                return True
        return False

    def check_measured_done(self) -> None:
        if self.measuring_over and all(task.done() for task in self.measured_tasks):
            self.measured_done.set()

    async def dispatch(self, client: httpx.AsyncClient, specs: list[RequestSpec], model: str | None) -> None:
        """Send the run's requests at its arrival times (or as slots free up) until it ends or must stop."""
        config, slots = self.config, self.slots
        gaps = _arrival_gaps(config) if config.rate is not None else None
        next_send = 0.0
        for index, spec in enumerate(_spec_stream(specs, config)):
            if gaps is not None:
                next_send += next(gaps)
                delay = self.clock_zero + next_send - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            phase = self.phase_of(index, time.perf_counter() - self.clock_zero)
            if phase == "cooldown" and not self.measuring_over:
                self.measuring_over = True
                self.check_measured_done()
            if slots and not await _acquire_unless(slots, self.measured_done if phase == "cooldown" else None):
                break
            now = time.perf_counter() - self.clock_zero
            phase = self.phase_of(index, now)
            if self.should_stop(now) or (phase == "cooldown" and self.measured_done.is_set()):
                if slots:
                    slots.release()
                break
            task = asyncio.create_task(self.send_one(client, spec, index, phase, model))
            if phase == "measure":
                self.measured_tasks.add(task)
                task.add_done_callback(lambda _task: self.check_measured_done())
            else:
                self.other_tasks.add(task)

    async def drain(self) -> None:
        """Wait for every measured request; cancel the warm-up and cool-down ones still running."""
        if self.measured_tasks:
            await asyncio.wait(self.measured_tasks)
        warmups = [t for t in self.other_tasks if not t.done()]
        for task in warmups:
            task.cancel()
        for task in warmups:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close(self, tick: asyncio.Task[None]) -> None:
        """Stop the ticker, bucket the level's last part-second, cancel whatever is left."""
        tick.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tick
        if self.live.completed or self.live.failed:  # the level's last part-second: every request lands in a bucket
            cpu, wall = time.thread_time(), time.perf_counter()
            self._emit(self.live.take(len(self.buckets) + 1, (cpu - self.cpu_zero) / max(1e-6, wall - self.clock_zero)))
        for task in self.measured_tasks | self.other_tasks:
            task.cancel()

    async def execute(self, specs: list[RequestSpec]) -> str | None:
        """Run the level against the target; the model it served."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(64, (self.limit or 0) * 2))
        timeout = httpx.Timeout(self.config.request_timeout_s, connect=10.0)
        async with self.target.async_client(limits=limits, timeout=timeout) as client:
            model = self.target.model or await discover_model(client, self.target)
            tick = asyncio.create_task(self.ticker())
            try:
                await self.dispatch(client, specs, model)
                await self.drain()
            finally:
                await self.close(tick)
        return model


def _client_warnings(client_cpu: float, summary: BenchmarkSummary) -> list[str]:
    warnings = []
    if client_cpu >= CPU_SATURATION:
        warnings.append(f"the load generator used {client_cpu:.0%} of a CPU core: the client may be the "
                        "bottleneck; lower the concurrency or run the client on another machine")
    if summary.tokens_estimated:
        warnings.append("the server sent no usage: output tokens are counted from stream chunks (estimated)")
    if summary.not_streamed:
        warnings.append(f"{summary.not_streamed} responses were not streamed: their TTFT equals their E2E latency")
    return warnings


def _abort_reason(run: _LoadRun, measured: list[RequestResult], summary: BenchmarkSummary) -> str | None:
    """Why the level stopped early, or that every measured request failed; None when it ran."""
    aborted = run.abort_reason[0] if run.abort_reason else None
    if not aborted and measured and summary.completed == 0:
        first = next((r.error for r in measured if r.error), "unknown error")
        aborted = f"all {len(measured)} requests failed; first error: {first}"
    return aborted


def _sent_prompt_tokens(specs: list[RequestSpec], config: LoadConfig) -> float | None:
    """Mean prompt tokens of the measured requests as sized before sending."""
    sized = [s.input_tokens for s in specs[config.warmup_requests:][: config.num_requests or len(specs)]] \
        or [s.input_tokens for s in specs]
    return round(sum(sized) / len(sized), 2) if sized else None


async def _sized_specs(target: Target, workload: Workload, config: LoadConfig, token_counter: TokenCounter | None
                       ) -> tuple[list[RequestSpec], TokenCounter | None]:
    """The run's distinct requests, sized by the given counter or the server's /tokenize (closed once used)."""
    own_counter = token_counter is None
    token_counter = await calibrating_counter(target, workload, token_counter)
    try:
        specs = await asyncio.to_thread(_specs, workload, config, token_counter)
    finally:
        if own_counter and isinstance(token_counter, ServerTokenCounter):
            token_counter.close()
    return specs, token_counter


async def run_load(
    target: Target,
    workload: Workload,
    config: LoadConfig,
    *,
    slo: SLO | None = None,
    on_bucket: BucketCallback | None = None,
    progress: ProgressCallback = no_progress,
    token_counter: TokenCounter | None = None,
    abort_check: AbortCheck | None = None,
    stop: asyncio.Event | None = None,
) -> LoadResult:
    """Run one load level and summarize it. Never raises for server failures: see `aborted` and `failed`."""
    specs, token_counter = await _sized_specs(target, workload, config, token_counter)
    run = _LoadRun(target, config, on_bucket=on_bucket, progress=progress, abort_check=abort_check, stop=stop)
    model = await run.execute(specs)
    wall = time.perf_counter() - run.clock_zero
    client_cpu = (time.thread_time() - run.cpu_zero) / max(1e-6, wall)
    results = run.results
    measured = [r for r in results if r.phase == "measure"]
    if measured:
        window = max(r.start + r.elapsed for r in measured) - min(r.start for r in measured)
    else:
        window = wall
    results.sort(key=lambda r: r.index)
    summary = summarize(results, window, slo)
    return LoadResult(config, target, workload.to_json(), model, summary, results, run.buckets,
                      round(client_cpu, 3), _client_warnings(client_cpu, summary), _abort_reason(run, measured, summary),
                      run.started_at, token_source(token_counter), _sent_prompt_tokens(specs, config))


async def run_sweep(
    target: Target,
    workload: Workload,
    levels: list[LoadConfig],
    *,
    slo: SLO | None = None,
    on_bucket: BucketCallback | None = None,
    progress: ProgressCallback = no_progress,
    token_counter: TokenCounter | None = None,
    abort_check: AbortCheck | None = None,
) -> SweepResult:
    """Run levels in order; stop at the first level that aborted (a dead server), keeping what was measured."""
    sweep = SweepResult([])
    counter = await calibrating_counter(target, workload, token_counter)  # once for all levels
    if isinstance(counter, ServerTokenCounter):
        progress(ProgressEvent(f"sizing prompts with {target.root}/tokenize (no local tokenizer)"))
    try:
        for position, level in enumerate(levels):
            progress(ProgressEvent(f"level {position + 1}/{len(levels)}: {level.label}"))
            result = await run_load(target, workload, level, slo=slo, on_bucket=on_bucket, progress=progress,
                                    token_counter=counter, abort_check=abort_check)
            sweep.levels.append(result)
            if result.aborted:
                break
    finally:
        if counter is not token_counter and isinstance(counter, ServerTokenCounter):
            counter.close()
    return sweep


async def _acquire_unless(slots: asyncio.Semaphore, event: asyncio.Event | None) -> bool:
    """Take a slot, or give up (False) as soon as `event` is set."""
    if event is None:
        await slots.acquire()
        return True
    if event.is_set():
        return False
    acquire = asyncio.ensure_future(slots.acquire())
    waiter = asyncio.ensure_future(event.wait())
    await asyncio.wait({acquire, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if acquire.done() and not acquire.cancelled():
        return True
    acquire.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await acquire
    if acquire.done() and not acquire.cancelled():  # won the race after all
        slots.release()
    return False


def run_load_sync(target: Target, workload: Workload, config: LoadConfig, **kwargs: Any) -> LoadResult:
    """`run_load` for callers without an event loop (CLI, A/B runner, GUI worker threads)."""
    return asyncio.run(run_load(target, workload, config, **kwargs))


def run_sweep_sync(target: Target, workload: Workload, levels: list[LoadConfig], **kwargs: Any) -> SweepResult:
    return asyncio.run(run_sweep(target, workload, levels, **kwargs))


__all__ = ["DEFAULT_CONCURRENCY", "LoadConfig", "LoadResult", "SweepResult", "run_load",
           "run_load_sync", "run_sweep", "run_sweep_sync", "sweep_levels"]
