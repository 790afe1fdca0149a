"""Per-request timings and the run summary, with `vllm bench serve`'s definitions and result-JSON field names.

TTFT: send -> first token-bearing chunk. E2E: send -> last token-bearing chunk. TPOT: (E2E - TTFT) / (output
tokens - 1), only for requests with more than one token. ITL: gaps between token-bearing chunks (per chunk, not
per token). Throughputs divide by the measurement window. Output tokens come from the server's usage; when a
server sends none, the number of token-bearing chunks is used and the summary says the counts are estimated.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (90, 95, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """One request's outcome. Times are seconds; `start` is on the run's monotonic clock."""

    index: int
    start: float
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0  # E2E: send -> last token (-> failure for failed requests)
    elapsed: float = 0.0  # send -> response closed (the measurement window's edge)
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    tokens_estimated: bool = False
    streamed: bool = True
    error: str | None = None
    phase: str = "measure"  # "warmup" | "measure" | "cooldown"
    finish_reason: str | None = None
    retried: bool = False  # resent once after a stale kept-alive connection

    @property
    def end(self) -> float:
        return self.start + self.latency

    @property
    def tpot(self) -> float:
        """vllm bench: 0 for goodput when a request has at most one token."""
        if self.output_tokens > 1:
            return (self.latency - self.ttft) / (self.output_tokens - 1)
        return 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds for goodput; None = not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def met_by(self, result: RequestResult) -> bool:
        checks = ((self.ttft_ms, result.ttft), (self.tpot_ms, result.tpot), (self.e2el_ms, result.latency))
        return all(limit is None or value * 1000.0 <= limit for limit, value in checks)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Distribution:
    mean: float = 0.0
    median: float = 0.0
    std: float = 0.0
    p90: float = 0.0
    p95: float = 0.0
    p99: float = 0.0

    @classmethod
    def of(cls, seconds: list[float]) -> Distribution:
        if not seconds:
            return cls()
        values = np.asarray(seconds, dtype=float) * 1000.0
        p90, p95, p99 = (float(v) for v in np.percentile(values, PERCENTILES))
        return cls(float(values.mean()), float(np.median(values)), float(values.std()), p90, p95, p99)


@dataclass
class BenchmarkSummary:
    """One load level's result. `to_json()` uses vllm bench serve's keys (plus p90/p95 and a few of ours)."""

    duration: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    error_rate: float
    tokens_estimated: bool
    not_streamed: int
    errors: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "duration": self.duration,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_output_tokens_per_s": self.max_output_tokens_per_s,
            "max_concurrent_requests": self.max_concurrent_requests,
        }
        for name in METRICS:
            dist: Distribution = getattr(self, name)
            for stat in ("mean", "median", "std", "p90", "p95", "p99"):
                data[f"{stat}_{name}_ms"] = getattr(dist, stat)
        data.update(error_rate=self.error_rate, tokens_estimated=self.tokens_estimated,
                    not_streamed=self.not_streamed, errors=dict(self.errors))
        return data


def _error_kind(message: str) -> str:
    return message.split(":", 1)[0][:80]


def summarize(results: list[RequestResult], duration: float, slo: SLO | None = None) -> BenchmarkSummary:
    """Summarize the measured requests (warm-up and cool-down ones are left out) over `duration` seconds."""
    measured = [r for r in results if r.phase == "measure"]
    ok = [r for r in measured if r.success]
    bad = [r for r in measured if not r.success]
    duration = max(duration, 1e-9)
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in bad:
        kind = _error_kind(r.error or "unknown error")
        errors[kind] = errors.get(kind, 0) + 1
    goodput = sum(1 for r in ok if slo.met_by(r)) / duration if slo else None
    max_tokens_per_s, max_concurrent = _peaks(ok)
    return BenchmarkSummary(
        duration=duration,
        completed=len(ok),
        failed=len(bad),
        total_input_tokens=prompt,
        total_output_tokens=output,
        request_throughput=len(ok) / duration,
        request_goodput=goodput,
        output_throughput=output / duration,
        total_token_throughput=(prompt + output) / duration,
        max_output_tokens_per_s=max_tokens_per_s,
        max_concurrent_requests=max_concurrent,
        ttft=Distribution.of([r.ttft for r in ok]),
        tpot=Distribution.of([r.tpot for r in ok if r.output_tokens > 1]),
        itl=Distribution.of([gap for r in ok for gap in r.itl]),
        e2el=Distribution.of([r.latency for r in ok]),
        error_rate=len(bad) / len(measured) if measured else 0.0,
        tokens_estimated=any(r.tokens_estimated for r in ok),
        not_streamed=sum(1 for r in ok if not r.streamed),
        errors=errors,
    )


def _peaks(ok: list[RequestResult]) -> tuple[float, int]:
    """vllm bench's max output tokens/s and max concurrent requests, in 1-second buckets (chunks as tokens)."""
    if not ok:
        return 0.0, 0
    first = min(r.start for r in ok)
    seconds = int(math.ceil(max(r.end for r in ok) - first)) + 1
    tokens = np.zeros(seconds)
    concurrent = np.zeros(seconds)
    for r in ok:
        when = r.start + r.ttft
        times = [when]
        for gap in r.itl:
            when += gap
            times.append(when)
        for t in times:
            bucket = int(t - first)
            if 0 <= bucket < seconds:
                tokens[bucket] += 1
        for second in range(int(r.start - first), min(seconds - 1, int(r.end - first)) + 1):
            concurrent[second] += 1
    return float(tokens.max()), int(concurrent.max())


@dataclass
class LiveBucket:
    """One second of a running benchmark, for live graphs (the GUI subscribes through a callback)."""

    second: int  # since the run started
    completed: int  # requests finished in this second
    failed: int
    output_tokens: int  # tokens received in this second (chunks when usage is not in yet)
    in_flight: int
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    client_cpu: float  # fraction of one core the load generator's event loop used in this second

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
