"""Incremental Server-Sent-Events decoding for OpenAI-compatible streams (and Anthropic Messages streams).

Bytes arrive split at arbitrary boundaries (mid-line, mid-UTF-8 character); the decoder buffers until a full
event is available, so callers see whole `data:` payloads only.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

DONE = "[DONE]"


class SSEDecoder:
    """Feed raw bytes, get complete `data:` payloads (strings) back."""

    def __init__(self) -> None:
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += self._text.decode(chunk)
        events: list[str] = []
        while True:
            newline = self._buffer.find("\n")
            if newline < 0:
                break
            line = self._buffer[:newline].rstrip("\r")
            self._buffer = self._buffer[newline + 1:]
            if line == "":
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].lstrip(" "))
            # comments (":") and other fields (event:, id:, retry:) carry nothing we use
        return events

    def flush(self) -> list[str]:
        """End of stream: return a last event not followed by a blank line."""
        events = self.feed(b"\n\n") if self._buffer or self._data else []
        return events


@dataclass
class StreamDelta:
    """What one OpenAI stream chunk carries that a client measures."""

    text: str = ""
    has_token: bool = False
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)


# Anthropic Messages stream events (`/v1/messages`): the `type` of each `data:` payload.
ANTHROPIC_EVENTS = frozenset({"message_start", "content_block_start", "content_block_delta", "content_block_stop",
                              "message_delta", "message_stop", "ping"})


def parse_chunk(payload: str) -> StreamDelta | None:
    """Interpret one `data:` payload of /v1/completions, /v1/chat/completions or /v1/messages; None for [DONE].

    Anthropic events map onto the same fields: a `content_block_delta` is a token; `message_start` carries
    `usage.input_tokens` and `message_delta` `usage.output_tokens` (in `usage`, under Anthropic's names)."""
    if payload.strip() == DONE:
        return None
    try:
        data = json.loads(payload)
    except ValueError:
        return StreamDelta(error=f"malformed stream chunk: {payload[:120]}")
    if not isinstance(data, dict):
        return StreamDelta(error=f"unexpected stream chunk: {payload[:120]}")
    if "error" in data:
        err = data["error"]
        message = err.get("message") if isinstance(err, dict) else str(err)
        return StreamDelta(error=str(message), raw=data)
    kind = data.get("type")
    if kind in ANTHROPIC_EVENTS:
        return _anthropic(kind, data)
    delta = StreamDelta(raw=data, usage=data.get("usage") or None)
    for choice in data.get("choices") or []:
        text = choice.get("text")
        calls = None
        if text is None:
            message = choice.get("delta") or {}
            text = (message.get("content") or "") + _reasoning(message)
            calls = message.get("tool_calls")
        if text or calls:  # reasoning and tool-call deltas are generated tokens: TTFT is at the first of them
            delta.text += text or ""
            delta.has_token = True
        if choice.get("finish_reason"):
            delta.finish_reason = choice["finish_reason"]
    return delta


def _reasoning(message: dict[str, Any]) -> str:
    """A chat delta's reasoning text: llama.cpp calls it `reasoning_content`, vLLM `reasoning` (it renamed
    `reasoning_content`); a chunk that carries both names carries the same text, counted once."""
    return str(message.get("reasoning_content") or message.get("reasoning") or "")


def _anthropic(kind: str, data: dict[str, Any]) -> StreamDelta:
    if kind == "content_block_delta":
        part = data.get("delta") or {}
        text = str(part.get("text") or part.get("thinking") or part.get("partial_json") or "")
        return StreamDelta(text=text, has_token=True, raw=data)
    if kind == "message_start":
        usage = (data.get("message") or {}).get("usage")
        return StreamDelta(usage=usage if isinstance(usage, dict) else None, raw=data)
    if kind == "message_delta":
        usage = data.get("usage")
        stop = (data.get("delta") or {}).get("stop_reason")
        return StreamDelta(usage=usage if isinstance(usage, dict) else None, finish_reason=stop, raw=data)
    return StreamDelta(raw=data)


def iter_deltas(chunks: Iterator[bytes]) -> Iterator[StreamDelta]:
    decoder = SSEDecoder()
    for chunk in chunks:
        for payload in decoder.feed(chunk):
            delta = parse_chunk(payload)
            if delta is not None:
                yield delta
    for payload in decoder.flush():
        delta = parse_chunk(payload)
        if delta is not None:
            yield delta


# --- encoding (the endpoint writes these to clients) -------------------------------------------------------------
LAST_CHUNK = b"0\r\n\r\n"  # the end of a chunked body (HTTP/1.1 chunked transfer coding)


def chunk(payload: bytes) -> bytes:
    """`payload` framed as one HTTP/1.1 chunk (an empty payload would end the body, so it is never framed)."""
    return b"%x\r\n%b\r\n" % (len(payload), payload) if payload else b""


def event(data: str) -> bytes:
    """One SSE event carrying `data` (a single line: JSON never holds a raw newline)."""
    return f"data: {data}\n\n".encode()


def comment(text: str) -> bytes:
    """An SSE comment line, which OpenAI clients ignore (the endpoint's ": loading model X" notes)."""
    return f": {text}\n\n".encode()


def error_event(message: str, kind: str, code: int, anthropic: bool = False, **extra: Any) -> bytes:
    """The SSE event that ends a stream with an error: OpenAI's error shape, or for an Anthropic Messages stream
    Anthropic's named `event: error` (Claude Code 2.1.197 and the anthropic SDKs raise only for an event named
    `error` and skip unnamed ones), whose type is one of Anthropic's (overloaded_error for a retryable 429/503)."""
    if anthropic:
        named = kind if kind.endswith("_error") else "overloaded_error" if code in (429, 503, 529) else "api_error"
        return b"event: error\n" + event(json.dumps({"type": "error", "error": {"type": named, "message": message}}))
    return event(json.dumps({"error": {"message": message, "type": kind, "code": code, **extra}}))
