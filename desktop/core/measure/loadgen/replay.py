"""Replay: the endpoint's recorded traffic sent again, open loop, to an engine under test.

A `ReplaySchedule` is built from request-log rows (history): each request's arrival offset from the first one,
its prompt and output token counts, and its body only where capture was on. Sending is open loop: request i leaves
at `offset_i / speed` after the start whatever the server is doing (a closed loop would slow down with the server
and hide its queueing), and every result records how late it left against the schedule (`send_lag`), so a client
that could not keep up is visible instead of silently reshaping the load.

Prompts without a captured body are random words sized to the recorded token count (with the model's tokenizer
or the server's /tokenize when at hand), asking for the recorded output tokens with ignore_eos: the same lengths
and the same arrival gaps, not the same text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from desktop.core.common.errors import SwitchyardError
from desktop.core.measure.loadgen.client import ServerTokenCounter, Target, discover_model, send_request
from desktop.core.measure.loadgen.metrics import BenchmarkSummary, RequestResult, summarize
from desktop.core.measure.loadgen.runner import calibrating_counter, token_source
from desktop.core.measure.loadgen.workload import RandomWorkload, RequestSpec, TokenCounter, _fit, _words

START_LEAD_S = 0.2  # the schedule's zero is this far after sizing ends, so the first send is not already late
DEFAULT_OUTPUT_TOKENS = 64  # a recorded request without an output count (a failed one) asks for this many


@dataclass(frozen=True)
class ReplayItem:
    """One recorded request: when it arrived (seconds after the first), its sizes, its body if captured."""

    offset_s: float
    prompt_tokens: int
    output_tokens: int
    body: dict[str, Any] | None = None

    def spec(self, prompt: str | None, sized: int) -> RequestSpec:
        body = self.body or {}
        if isinstance(body.get("messages"), list):
            return RequestSpec(messages=body["messages"], max_tokens=self.output_tokens,
                               input_tokens=self.prompt_tokens)
        if isinstance(body.get("prompt"), str):
            return RequestSpec(prompt=body["prompt"], max_tokens=self.output_tokens, input_tokens=self.prompt_tokens)
        return RequestSpec(prompt=prompt, max_tokens=self.output_tokens, input_tokens=sized)


@dataclass(frozen=True)
class ReplaySchedule:
    items: tuple[ReplayItem, ...]
    source: str = ""  # what it was recorded from, for the report

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]], *, max_requests: int | None = None,
                  source: str = "") -> ReplaySchedule:
        """From request-log rows (oldest first or not): arrival offsets, token counts, captured bodies."""
        usable = sorted((r for r in rows if r.get("t") is not None and int(r.get("status") or 0) != 0),
                        key=lambda r: float(r["t"]))
        if max_requests is not None:
            usable = usable[:max_requests]
        if not usable:
            raise SwitchyardError("no recorded requests to replay in this span",
                                  "serve through the endpoint first (`switchyard serve --endpoint`), or widen --since")
        zero = float(usable[0]["t"])
        items = []
        for row in usable:
            prompt = row.get("prompt_tokens")
            output = row.get("output_tokens")
            items.append(ReplayItem(
                round(float(row["t"]) - zero, 6),
                int(prompt) if isinstance(prompt, int) and prompt > 0 else 16,
                int(output) if isinstance(output, int) and output > 0 else DEFAULT_OUTPUT_TOKENS,
                _body(row.get("request_body"))))
        return cls(tuple(items), source)

    @property
    def span_s(self) -> float:
        return self.items[-1].offset_s if self.items else 0.0

    def to_json(self, include_items: bool = False) -> dict[str, Any]:
        gaps = np.diff([i.offset_s for i in self.items]) if len(self.items) > 1 else np.asarray([])
        data: dict[str, Any] = {
            "requests": len(self.items), "span_s": round(self.span_s, 3), "source": self.source,
            "captured_bodies": sum(1 for i in self.items if i.body is not None),
            "mean_gap_s": round(float(gaps.mean()), 4) if gaps.size else None,
            "prompt_tokens_mean": round(float(np.mean([i.prompt_tokens for i in self.items])), 2),
            "output_tokens_mean": round(float(np.mean([i.output_tokens for i in self.items])), 2),
        }
        if include_items:
            data["items"] = [[i.offset_s, i.prompt_tokens, i.output_tokens] for i in self.items]
        return data


def schedule_from_log(since: str, *, max_requests: int | None = None) -> ReplaySchedule:
    """The endpoint's request log since `since` (`1d`, `12h`, `30m`) as a schedule: one reader for `ab --replay`
    and the Compare page's benchmark child (which gets the span, not thousands of items, in its job)."""
    from desktop.core.measure.profile import parse_since
    from desktop.core.storage.history import Store

    start = parse_since(since)
    with Store() as store:
        rows = store.requests_between(start)
    return ReplaySchedule.from_rows(rows, max_requests=max_requests, source=f"request log since {since}")


def _body(raw: Any) -> dict[str, Any] | None:
    if not isinstance(raw, str) or not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None  # cut at the capture limit, or not JSON: sizes are replayed instead
    if isinstance(data, dict) and (isinstance(data.get("prompt"), str) or isinstance(data.get("messages"), list)):
        return data
    return None


def parse_speed(text: str) -> float:
    """`2x`, `0.5x` or `2`: how much faster than recorded the replay runs."""
    spec = text.strip().lower().removesuffix("x")
    try:
        value = float(spec)
    except ValueError:
        raise SwitchyardError(f"cannot read the replay speed {text!r}", "e.g. --speed 2x (twice as fast)") from None
    if not math.isfinite(value) or value <= 0:
        raise SwitchyardError(f"the replay speed must be positive, not {text!r}", "e.g. --speed 1x")
    return value


@dataclass
class ReplayResult:
    """What one engine did with the replayed traffic."""

    target: Target
    speed: float
    schedule: dict[str, Any]
    summary: BenchmarkSummary
    requests: list[RequestResult]
    scheduled_s: list[float]  # each request's planned send time (after the schedule's zero)
    prompt_tokens_source: str = "words (estimate)"
    aborted: str | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def send_lags(self) -> list[float]:
        """Actual send time minus the schedule, per request (seconds; positive = late)."""
        return [r.start - planned for r, planned in zip(self.requests, self.scheduled_s, strict=True)]

    def lag_stats(self) -> dict[str, float | None]:
        lags = self.send_lags
        if not lags:
            return {"p50_ms": None, "p95_ms": None, "max_ms": None}
        ms = np.abs(np.asarray(lags)) * 1000.0
        p50, p95 = (float(v) for v in np.percentile(ms, (50, 95)))
        return {"p50_ms": round(p50, 3), "p95_ms": round(p95, 3), "max_ms": round(float(ms.max()), 3)}

    def to_json(self, include_requests: bool = False) -> dict[str, Any]:
        data: dict[str, Any] = {
            "kind": "replay", "target": self.target.to_json(), "speed": self.speed, "schedule": self.schedule,
            **self.summary.to_json(), "send_lag": self.lag_stats(), "prompt_tokens_source": self.prompt_tokens_source,
            "aborted": self.aborted, "warnings": list(self.warnings),
        }
        if include_requests:
            data["requests"] = [{**r.to_json(), "scheduled": s} for r, s in zip(self.requests, self.scheduled_s,
                                                                                 strict=True)]
        return data


def _sized_specs(schedule: ReplaySchedule, counter: TokenCounter | None, seed: int) -> list[RequestSpec]:
    """One spec per item; a prompt per distinct length is sized once (sizing can be a server round trip)."""
    rng = random.Random(seed)
    by_length: dict[int, tuple[str, int]] = {}
    specs = []
    for item in schedule.items:
        if item.body is not None:
            specs.append(item.spec(None, item.prompt_tokens))
            continue
        if item.prompt_tokens not in by_length:
            by_length[item.prompt_tokens] = _fit(_words(rng, item.prompt_tokens), item.prompt_tokens, counter)
        prompt, sized = by_length[item.prompt_tokens]
        specs.append(item.spec(prompt, sized))
    return specs


async def run_replay(
    target: Target,
    schedule: ReplaySchedule,
    *,
    speed: float = 1.0,
    token_counter: TokenCounter | None = None,
    request_timeout_s: float = 300.0,
    abort_check: Callable[[], str | None] | None = None,
    seed: int = 0,
) -> ReplayResult:
    """Send `schedule` open loop at `speed` x the recorded rate; never raises for server failures."""
    if speed <= 0:
        raise SwitchyardError(f"the replay speed must be positive, not {speed}")
    own_counter = token_counter is None
    counter = await calibrating_counter(target, RandomWorkload(), token_counter)
    try:
        specs = await asyncio.to_thread(_sized_specs, schedule, counter, seed)
    finally:
        if own_counter and isinstance(counter, ServerTokenCounter):
            counter.close()
    planned = [item.offset_s / speed for item in schedule.items]
    results: list[RequestResult | None] = [None] * len(specs)
    aborted: list[str] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    # target.async_client: over the engine's private Unix socket where it has one (common.unixhttp), else TCP
    async with target.async_client(limits=limits, timeout=httpx.Timeout(request_timeout_s, connect=10.0)) as client:
        model = target.model or await discover_model(client, target)
        clock_zero = time.perf_counter() + START_LEAD_S

        async def one(index: int, spec: RequestSpec) -> None:
            results[index] = await send_request(client, target, spec, index=index, model=model,
                                                clock_zero=clock_zero, timeout=request_timeout_s, phase="measure")

        tasks: list[asyncio.Task[None]] = []
        try:
            for index, (spec, when) in enumerate(zip(specs, planned, strict=True)):
                delay = clock_zero + when - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                reason = abort_check() if abort_check is not None else None
                if reason:
                    aborted.append(reason)
                    break
                tasks.append(asyncio.create_task(one(index, spec)))
            if tasks:
                await asyncio.wait(tasks)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    done = [(r, planned[i]) for i, r in enumerate(results) if r is not None]
    requests = [r for r, _ in done]
    window = (max(r.start + r.elapsed for r in requests) - min(r.start for r in requests)) if requests else 0.0
    summary = summarize(requests, window)
    result = ReplayResult(target, speed, schedule.to_json(), summary, requests, [p for _, p in done],
                          token_source(counter), aborted[0] if aborted else None)
    late = result.lag_stats()["p95_ms"]
    if late is not None and late > 50.0:
        result.warnings.append(f"the client sent 5% of the requests more than {late:.0f} ms late against the "
                               "schedule: the load generator could not keep up (a busy machine?)")
    if not aborted and requests and summary.completed == 0:
        result.aborted = f"all {len(requests)} replayed requests failed; first error: " \
                         f"{next((r.error for r in requests if r.error), 'unknown error')}"
    return result


def run_replay_sync(target: Target, schedule: ReplaySchedule, **kwargs: Any) -> ReplayResult:
    """`run_replay` for callers without an event loop (the A/B runner, the CLI)."""
    return asyncio.run(run_replay(target, schedule, **kwargs))


__all__ = ["ReplayItem", "ReplayResult", "ReplaySchedule", "parse_speed", "run_replay", "run_replay_sync",
           "schedule_from_log"]
