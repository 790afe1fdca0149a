"""Metering on the endpoint: what one forwarded request measured (time to first token, duration, prompt and
output tokens), found in the response as it streams past without slowing it down. OpenAI streams and Anthropic
Messages streams are both understood (the SSE parser maps Anthropic events onto the same fields)."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from desktop.core.common.sse import SSEDecoder, StreamDelta, parse_chunk
from desktop.core.common.text import bounded
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
    prompt_tokens: int | None = None
    model: str | None = None  # the `model` the client asked for: escaped, at most RECORDED_CHARS (common.text)
    engine: str | None = None
    client: str | None = None  # the client's address (host:port)
    seq: int = 0  # the endpoint's number for this request: a "started" and its finished record share it
    request_body: str | None = None  # only when body capture is on
    response_body: str | None = None
    note: str | None = None  # what the endpoint changed in the request for the engine (serving.normalize)

    def __post_init__(self) -> None:
        # The client picks the name's size; the request log, history and every view keep this record.
        if self.model is not None:
            self.model = bounded(self.model)

    @property
    def in_flight(self) -> bool:
        """A "started" record (status 0): the request has not been answered yet."""
        return self.status == 0

    @property
    def client_error(self) -> bool:
        """Refused as the client's fault (4xx, including 499: the client left before its answer)."""
        return 400 <= self.status < 500

    @property
    def failed(self) -> bool:
        """The endpoint or the engine failed it: a 5xx, or an answer that began and broke off (a cut stream).
        A client's 4xx is not a failure."""
        return self.status >= 500 or (0 < self.status < 400 and self.error is not None)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        """From to_json() or a history row (extra keys, such as the row id, are ignored)."""
        names = cls.__dataclass_fields__
        return cls(**{key: value for key, value in data.items() if key in names})

    def to_samples(self, source: str = "proxy") -> list[Sample]:
        samples = [Sample(self.t, source, "proxy_e2e_s", self.e2e_s)]
        if self.ttft_s is not None:
            samples.append(Sample(self.t, source, "proxy_ttft_s", self.ttft_s))
        if self.output_tokens is not None:
            samples.append(Sample(self.t, source, "proxy_output_tokens", float(self.output_tokens)))
        if self.failed:
            samples.append(Sample(self.t, source, "proxy_failed", 1.0))
        return samples


RequestListener = Callable[[RequestRecord], None]

CAPTURE_BYTES = 64 * 1024  # of each body, when capture is on
ANTHROPIC_CACHE_FIELDS = ("cache_read_input_tokens", "cache_creation_input_tokens")  # beside input_tokens


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
        self.prompt_tokens: int | None = None
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
        if delta.usage:
            self.read_usage(delta.usage, output=delta.raw.get("type") != "message_start")
        timings = delta.raw.get("timings")
        if isinstance(timings, dict):
            if self.usage_tokens is None and isinstance(timings.get("predicted_n"), int):
                self.usage_tokens = timings["predicted_n"]
            if self.prompt_tokens is None:
                self.prompt_tokens = timings_prompt(timings)

    def read_usage(self, usage: dict[str, Any], output: bool = True) -> None:
        """OpenAI (`prompt_tokens`, `completion_tokens`) or Anthropic (`input_tokens`, `output_tokens`) usage;
        Anthropic's `message_start` says output_tokens 0 (or 1) before any token, so it gives the prompt only."""
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        if isinstance(prompt, int):
            if "prompt_tokens" not in usage:  # Anthropic's input_tokens leaves out what the prefix cache served
                prompt += sum(v for k in ANTHROPIC_CACHE_FIELDS if isinstance(v := usage.get(k), int))
            self.prompt_tokens = prompt
        completion = usage.get("completion_tokens", usage.get("output_tokens"))
        if output and isinstance(completion, int):
            self.usage_tokens = completion

    def bodies(self, kept: list[bytes]) -> tuple[str | None, str | None]:
        """(request, response) bodies for the request log: none unless capture is on (CapturingMeter)."""
        return None, None

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.payloads


class CapturingMeter(StreamMeter):
    """A StreamMeter that also keeps the bodies (each up to CAPTURE_BYTES) for the request log. Chosen per request
    only while the user has capture on, so a plain request pays nothing for the feature."""

    LIMIT: ClassVar[int] = CAPTURE_BYTES

    def __init__(self, started: float, request_body: bytes) -> None:
        super().__init__(started)
        self.request_body = request_body[:self.LIMIT]
        self.captured: list[bytes] = []
        self.captured_size = 0

    def feed(self, chunk: bytes, now: float) -> None:
        if self.captured_size < self.LIMIT:
            self.captured.append(chunk)
            self.captured_size += len(chunk)
        super().feed(chunk, now)

    def bodies(self, kept: list[bytes]) -> tuple[str | None, str | None]:
        response = b"".join(self.captured or kept)[:self.LIMIT]
        return self.request_body.decode("utf-8", "replace"), response.decode("utf-8", "replace")


def timings_prompt(timings: dict[str, Any]) -> int | None:
    """The whole prompt from llama.cpp's timings: `prompt_n` counts only what was evaluated, `cache_n` what the
    prefix cache served (tools/server/server-task.cpp)."""
    evaluated = timings.get("prompt_n")
    if not isinstance(evaluated, int):
        return None
    cached = timings.get("cache_n")
    return evaluated + (cached if isinstance(cached, int) else 0)


def count_json_tokens(meter: StreamMeter, body: bytes, now: float) -> None:
    """Non-streamed answers: the whole body is the first (and last) token; take the counts from usage
    (OpenAI or Anthropic names) or llama.cpp's timings."""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        return
    if not isinstance(data, dict):
        return
    usage = data.get("usage")
    if isinstance(usage, dict):
        meter.read_usage(usage)
    timings = data.get("timings")
    if isinstance(timings, dict):
        if meter.usage_tokens is None and isinstance(timings.get("predicted_n"), int):
            meter.usage_tokens = timings["predicted_n"]
        if meter.prompt_tokens is None:
            meter.prompt_tokens = timings_prompt(timings)
    if meter.usage_tokens is not None:
        meter.first_token_at = now
