"""The workload profile: what the endpoint's own request log says about the real load, so advice and A/B runs can
start from measured traffic instead of typed guesses.

Read from history (`desktop.core.storage.history`): every finished request has its arrival time `t`, its duration
`e2e_s`, its prompt and output tokens and (only when the user turned capture on) its bodies; every launch left a
`launch` run. From that, with no captured bodies needed:

- requests per minute over time and burstiness (peak minute / mean minute over the active span);
- in-flight concurrency p50/p95/max, from a sweep over the recorded [t, t + e2e_s] intervals: the exact step
  function of requests in flight, weighted by time over the time at least one request was in flight (idle hours
  would otherwise make every percentile 0). Sampled from what happened, not guessed from a rate;
- prompt and output token distributions (p50/p95 and a fitted log-normal: mu and sigma of ln tokens);
- server lifetimes and restarts from the launch history: a launch lives until the next launch or, for the last
  one, until the last request after it (the history records no stop time: the profile says "estimated");
- where bodies were captured: the share of requests whose prompt shares a long prefix with another request's.

`build_profile` is a pure function of rows (tested without a database); `load_profile` reads a Store.
"""

from __future__ import annotations

import bisect
import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from desktop.core.common.errors import SwitchyardError
from desktop.core.planning.recommend import Workload
from desktop.core.storage.history import RunRecord, Store

MIN_REQUESTS = 50  # fewer than this and typed numbers (or defaults) say more than the traffic does
SHARED_PREFIX_CHARS = 128  # a prompt shares a prefix when at least this many leading characters match another's
# the routes whose requests are the workload (Ollama's /api/chat and /api/generate are answered by an engine too)
INFERENCE_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/completion", "/v1/responses",
                   "/api/chat", "/api/generate")


@dataclass(frozen=True)
class LengthStats:
    """A token-length distribution: percentiles and the log-normal that fits it (mu, sigma of ln tokens)."""

    n: int
    mean: float
    p50: float
    p95: float
    max: int
    lognormal_mu: float
    lognormal_sigma: float

    @classmethod
    def of(cls, values: Sequence[int]) -> LengthStats | None:
        clean = np.asarray([v for v in values if v is not None and v > 0], dtype=float)
        if clean.size == 0:
            return None
        logs = np.log(clean)
        p50, p95 = (float(v) for v in np.percentile(clean, (50, 95)))
        return cls(int(clean.size), round(float(clean.mean()), 2), round(p50, 2), round(p95, 2), int(clean.max()),
                   round(float(logs.mean()), 4), round(float(logs.std()), 4))

    @property
    def median_of_fit(self) -> float:
        """exp(mu): the log-normal's median (what a generated workload is centred on)."""
        return math.exp(self.lognormal_mu)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ConcurrencyStats:
    """Requests in flight, time-weighted over the busy time (at least one in flight)."""

    p50: float
    p95: float
    max: int
    mean: float
    busy_s: float
    busy_share: float  # busy time / the profile's span

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Lifetime:
    """One launch and how long it (probably) lived."""

    run_id: int | None
    engine: str | None
    started_at: float
    lifetime_s: float
    ended_by: str  # "next launch" | "last request" (estimated: history keeps no stop time)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class WorkloadProfile:
    since: float
    until: float
    model: str | None
    requests: int
    failed: int
    first_t: float | None
    last_t: float | None
    bucket_s: float
    rate: list[tuple[float, float]]  # (bucket start, requests per minute in it)
    mean_rpm: float
    peak_rpm: float
    burstiness: float | None  # peak / mean requests per minute over the active span
    concurrency: ConcurrencyStats | None
    prompt_tokens: LengthStats | None
    output_tokens: LengthStats | None
    lifetimes: list[Lifetime] = field(default_factory=list)
    restarts: int = 0
    restarts_per_day: float | None = None
    captured_bodies: int = 0
    shared_prefix_share: float | None = None  # of the captured ones; None without captured bodies
    notes: list[str] = field(default_factory=list)

    @property
    def span_s(self) -> float:
        if self.first_t is None or self.last_t is None:
            return 0.0
        return max(0.0, self.last_t - self.first_t)

    @property
    def lifetime_p50_s(self) -> float | None:
        values = [life.lifetime_s for life in self.lifetimes if life.lifetime_s > 0]
        return float(np.median(values)) if values else None

    @property
    def enough(self) -> bool:
        """Enough traffic to replace typed numbers."""
        return self.requests - self.failed >= MIN_REQUESTS and self.concurrency is not None

    def summary_line(self) -> str:
        """"from 4,212 requests over 3 days: p95 concurrency 11, lifetime 9 h"."""
        parts = []
        if self.concurrency is not None:
            parts.append(f"p95 concurrency {_number(self.concurrency.p95)}")
        if self.prompt_tokens is not None and self.output_tokens is not None:
            parts.append(f"prompts {_number(self.prompt_tokens.p50)} / outputs {_number(self.output_tokens.p50)} "
                         "tokens (p50)")
        lifetime = self.lifetime_p50_s
        if lifetime is not None:
            parts.append(f"lifetime {duration(lifetime)}")
        head = f"from {self.requests:,} requests over {duration(self.span_s)}"
        return head + (": " + ", ".join(parts) if parts else "")

    def workload(self, *, concurrency: int | None = None, prompt_len: int | None = None,
                 output_len: int | None = None, lifetime_hours: float | None = None,
                 restarts_per_day: float | None = None) -> Workload:
        """The recommender's workload from this profile; every number given here (typed) overrides it.
        Concurrency is the p95 in flight (rounded up: capacity is sized for the busy times), lengths are the
        p50s, the lifetime is the median launch's (8 h when no launch was seen)."""
        conc = self.concurrency
        lifetime = self.lifetime_p50_s
        return Workload(
            concurrency=concurrency if concurrency is not None else max(1, math.ceil(conc.p95 - 1e-9) if conc else 1),
            prompt_len=prompt_len if prompt_len is not None else max(1, round(self.prompt_tokens.p50)
                                                                       if self.prompt_tokens else 512),
            output_len=output_len if output_len is not None else max(1, round(self.output_tokens.p50)
                                                                       if self.output_tokens else 256),
            lifetime_hours=lifetime_hours if lifetime_hours is not None else (
                min(24 * 365.0, max(1 / 60, lifetime / 3600.0)) if lifetime else 8.0),
            restarts_per_day=restarts_per_day if restarts_per_day is not None else min(
                1440.0, self.restarts_per_day or 0.0),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "since": self.since, "until": self.until, "model": self.model, "requests": self.requests,
            "failed": self.failed, "first_t": self.first_t, "last_t": self.last_t, "span_s": self.span_s,
            "bucket_s": self.bucket_s, "requests_per_minute": [list(row) for row in self.rate],
            "mean_rpm": self.mean_rpm, "peak_rpm": self.peak_rpm, "burstiness": self.burstiness,
            "concurrency": self.concurrency.to_json() if self.concurrency else None,
            "prompt_tokens": self.prompt_tokens.to_json() if self.prompt_tokens else None,
            "output_tokens": self.output_tokens.to_json() if self.output_tokens else None,
            "lifetimes": [life.to_json() for life in self.lifetimes], "lifetime_p50_s": self.lifetime_p50_s,
            "lifetime_source": "estimated: launch to the next launch, or to the last request after it",
            "restarts": self.restarts, "restarts_per_day": self.restarts_per_day,
            "captured_bodies": self.captured_bodies, "shared_prefix_share": self.shared_prefix_share,
            "enough": self.enough, "min_requests": MIN_REQUESTS, "summary": self.summary_line(),
            "notes": list(self.notes),
        }


def _number(value: float) -> str:
    return f"{value:.0f}" if abs(value - round(value)) < 0.05 or value >= 10 else f"{value:.1f}"


def duration(seconds: float) -> str:
    """A span as people say it: 45 s, 12 min, 9 h, 3 days."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"


def parse_since(text: str, now: float | None = None) -> float:
    """`7d`, `12h`, `30m`, `90s` (or a bare number of seconds) before now, as a wall-clock time."""
    now = time.time() if now is None else now
    spec = text.strip().lower()
    units = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
    scale = units.get(spec[-1:], None)
    number = spec[:-1] if scale is not None else spec
    try:
        value = float(number)
    except ValueError:
        raise SwitchyardError(f"cannot read the time span {text!r}", "e.g. --since 7d, 12h, 30m or 90s") from None
    if not math.isfinite(value) or value <= 0:
        raise SwitchyardError(f"the time span must be positive, not {text!r}", "e.g. --since 7d")
    return now - value * (scale or 1.0)


# --- the pieces ---------------------------------------------------------------------------------------------
def concurrency_stats(intervals: Sequence[tuple[float, float]], span_s: float) -> ConcurrencyStats | None:
    """Sweep the [start, end) intervals: the time spent at each in-flight level, then its weighted percentiles
    over the busy time."""
    events: list[tuple[float, int]] = []
    for start, end in intervals:
        events.append((start, 1))
        events.append((max(end, start), -1))
    if not events:
        return None
    events.sort(key=lambda e: (e[0], e[1]))  # at a tie an end comes first: back-to-back requests do not overlap
    time_at: dict[int, float] = {}
    level, last = 0, events[0][0]
    peak = 0
    for when, step in events:
        if level > 0 and when > last:
            time_at[level] = time_at.get(level, 0.0) + (when - last)
        level += step
        peak = max(peak, level)
        last = when
    busy = sum(time_at.values())
    if busy <= 0:  # every request took no time at all: count each as one in flight
        return ConcurrencyStats(1.0, 1.0, max(1, peak), 1.0, 0.0, 0.0)
    levels = sorted(time_at)

    def percentile(q: float) -> float:
        goal, acc = busy * q, 0.0
        for lvl in levels:
            acc += time_at[lvl]
            if acc >= goal - 1e-12:
                return float(lvl)
        return float(levels[-1])

    mean = sum(lvl * t for lvl, t in time_at.items()) / busy
    return ConcurrencyStats(percentile(0.50), percentile(0.95), max(levels), round(mean, 3), round(busy, 3),
                            round(busy / span_s, 4) if span_s > 0 else 1.0)


def rate_buckets(times: Sequence[float], first: float, last: float) -> tuple[float, list[tuple[float, float]]]:
    """Requests per minute in buckets of a minute (wider for long spans, at most ~500 buckets)."""
    span = max(0.0, last - first)
    bucket = 60.0
    for width in (60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 86400.0):
        bucket = width
        if span / width <= 500:
            break
    count = max(1, int(span // bucket) + 1)
    counts = [0] * count
    for t in times:
        counts[min(count - 1, int((t - first) // bucket))] += 1
    scale = 60.0 / bucket
    return bucket, [(round(first + i * bucket, 3), round(c * scale, 3)) for i, c in enumerate(counts)]


def prompt_text(body: str | None) -> str | None:
    """The text a captured request body asks about: its prompt, or its messages' text parts in order."""
    if not body:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("prompt"), str):
        return str(data["prompt"])
    messages = data.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
        return "\n".join(parts)
    return None


def shared_prefix_share(prompts: Sequence[str], min_chars: int = SHARED_PREFIX_CHARS) -> float | None:
    """Share of prompts whose first `min_chars` characters equal another prompt's (neighbours in sorted order
    have the longest common prefixes, so one sort finds them all)."""
    texts = sorted(p for p in prompts if p is not None)
    if len(texts) < 2:
        return None if not texts else 0.0
    shared = 0
    for i, text in enumerate(texts):
        if len(text) < min_chars:
            continue
        head = text[:min_chars]
        if (i > 0 and texts[i - 1][:min_chars] == head) or (i + 1 < len(texts) and texts[i + 1][:min_chars] == head):
            shared += 1
    return round(shared / len(texts), 4)


def lifetimes(launches: Iterable[RunRecord], request_ends: Sequence[float]) -> list[Lifetime]:
    """Each launch lives until the next one; the last until the last request that ended after it."""
    ordered = sorted(launches, key=lambda r: r.created_at)
    ends = sorted(request_ends)
    out = []
    for index, run in enumerate(ordered):
        if index + 1 < len(ordered):
            out.append(Lifetime(run.id, run.engine, run.created_at, ordered[index + 1].created_at - run.created_at,
                                "next launch"))
            continue
        position = bisect.bisect_left(ends, run.created_at)
        last = ends[-1] if position < len(ends) else run.created_at
        out.append(Lifetime(run.id, run.engine, run.created_at, max(0.0, last - run.created_at), "last request"))
    return out


def _is_inference(row: Mapping[str, Any]) -> bool:
    path = str(row.get("path") or "")
    return any(path.startswith(p) for p in INFERENCE_PATHS) or not path


def build_profile(rows: Sequence[Mapping[str, Any]], launches: Sequence[RunRecord] = (), *, since: float = 0.0,
                  until: float | None = None, model: str | None = None) -> WorkloadProfile:
    """The profile of finished request rows (history's REQUEST_COLUMNS) and the launch runs of the same span."""
    until = time.time() if until is None else until
    requests = [r for r in rows if _is_inference(r) and r.get("t") is not None and int(r.get("status") or 0) != 0]
    times = sorted(float(r["t"]) for r in requests)
    failed = sum(1 for r in requests if int(r["status"]) >= 400 or r.get("error"))
    notes: list[str] = []
    if not requests:
        notes.append("no requests in the request log for this span: serve through the endpoint "
                     "(`switchyard serve --endpoint`) and come back")
        return WorkloadProfile(since, until, model, 0, 0, None, None, 60.0, [], 0.0, 0.0, None, None, None, None,
                               lifetimes(launches, []), max(0, len(launches) - 1), None, 0, None, notes)
    first, last = times[0], times[-1]
    intervals = [(float(r["t"]), float(r["t"]) + max(0.0, float(r.get("e2e_s") or 0.0))) for r in requests]
    span_end = max(end for _, end in intervals)
    span = max(0.0, span_end - first)
    bucket, rate = rate_buckets(times, first, last)
    values = [v for _, v in rate]
    mean_rpm = sum(values) / len(values)  # per bucket, as the peak is: peak / mean is never below 1
    peak = max(values) if values else 0.0
    ok = [r for r in requests if int(r["status"]) < 400 and not r.get("error")]
    prompts = [int(r["prompt_tokens"]) for r in ok if isinstance(r.get("prompt_tokens"), int)]
    outputs = [int(r["output_tokens"]) for r in ok if isinstance(r.get("output_tokens"), int)]
    if len(prompts) < len(ok):
        notes.append(f"{len(ok) - len(prompts)} answered requests carried no prompt token count (the engine sent "
                     "no usage): the prompt distribution leaves them out")
    texts = [prompt_text(r.get("request_body")) for r in requests]
    captured = [t for t in texts if t is not None]
    if not captured:
        notes.append("no request bodies were captured (turn on --capture-bodies to see shared prefixes): sizes and "
                     "timings are enough for everything else")
    lives = lifetimes(launches, [end for _, end in intervals])
    restarts = max(0, len(launches) - 1)
    window_days = max(span, (until - since) if since > 0 else span) / 86400.0
    per_day = round(restarts / window_days, 3) if launches and window_days > 0 else None
    return WorkloadProfile(
        since, until, model, len(requests), failed, first, span_end if span_end >= last else last, bucket, rate,
        round(mean_rpm, 3), round(peak, 3), round(peak / mean_rpm, 3) if mean_rpm > 0 else None,
        concurrency_stats(intervals, span), LengthStats.of(prompts), LengthStats.of(outputs), lives, restarts,
        per_day, len(captured), shared_prefix_share(captured) if captured else None, notes)


def load_profile(store: Store, since: float = 0.0, until: float | None = None, model: str | None = None
                 ) -> WorkloadProfile:
    """The profile of what history holds for [since, until), optionally for one requested model."""
    rows = store.requests_between(since, until, model)
    launches = [run for run in store.runs(limit=10_000, kind="launch")
                if run.created_at >= since and (until is None or run.created_at < until)]
    return build_profile(rows, launches, since=since, until=until, model=model)


__all__ = ["MIN_REQUESTS", "ConcurrencyStats", "LengthStats", "Lifetime", "WorkloadProfile", "build_profile",
           "concurrency_stats", "duration", "lifetimes", "load_profile", "parse_since", "rate_buckets",
           "shared_prefix_share"]
