"""OpenAI-specific metering on the endpoint: what one forwarded request measured (time to first token, duration,
output tokens), found in the response as it streams past without slowing it down."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from desktop.core.common.sse import SSEDecoder, StreamDelta, parse_chunk
from desktop.core.runtime.telemetry import Sample


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
        self._tail: deque[bytes] = deque()
        self._tail_size = 0

    def feed(self, chunk: bytes, now: float) -> None:
        if self.first_token_at is None:
            for payload in self._decoder.feed(chunk):
                self._payload(payload, now)
            return
        self.payloads += chunk.count(b"data:")
        tail = self._tail
        tail.append(chunk)
        self._tail_size += len(chunk)
        while self._tail_size - len(tail[0]) >= self.TAIL_BYTES:
            self._tail_size -= len(tail.popleft())

    def finish(self, now: float) -> None:
        for payload in self._decoder.flush():
            self._payload(payload, now)
        tail = b"".join(self._tail).decode("utf-8", "replace")
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


def count_json_tokens(meter: StreamMeter, body: bytes, now: float) -> None:
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
