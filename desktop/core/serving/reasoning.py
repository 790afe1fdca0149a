"""One reasoning schema at the endpoint, whichever engine serves.

vLLM (0.32) sends a thinking model's reasoning as `reasoning`; llama-server as `reasoning_content` (vLLM's old
name). A client written against one engine reads nothing from the other, so after a switch the same agent sees its
model stop thinking. The endpoint therefore puts reasoning under both names, in chat-completion streams
(`choices[].delta`) and whole answers (`choices[].message`). `/v1/messages` needs nothing: both engines already
turn reasoning into Anthropic `thinking` blocks (llama-server server-task.cpp, vLLM entrypoints/anthropic) once
the plan carries a reasoning parser.

Written by hand because it sits on the proxy's hot path: only event lines that carry `"reasoning` are parsed and
rewritten; every other chunk passes through as the same bytes object when it ends at a line end (engines write
whole events), and is otherwise held only until its line ends. The cost is measured by
benchmarks/bench_proxy.py (its results: benchmarks/results/).
"""

from __future__ import annotations

import json
from typing import Any

CHAT_PATH = "/v1/chat/completions"
MARK = b'"reasoning'
NAMES = ("reasoning", "reasoning_content")
WHOLE_LIMIT = 16 * 1024 * 1024  # a whole answer larger than this passes through unchanged


def mirror(message: Any) -> bool:
    """Give a delta or message dict its reasoning under both names; True when it changed."""
    if not isinstance(message, dict):
        return False
    present = [name for name in NAMES if isinstance(message.get(name), str)]
    if len(present) != 1:
        return False
    other = NAMES[1] if present[0] == NAMES[0] else NAMES[0]
    message[other] = message[present[0]]
    return True


def mirror_choices(payload: Any, key: str) -> bool:
    """Mirror every choice's `key` ("delta" in a stream, "message" in a whole answer)."""
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list):
        return False
    changed = False
    for choice in choices:
        if isinstance(choice, dict) and mirror(choice.get(key)):
            changed = True
    return changed


def _dumps(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def mirror_line(line: bytes) -> bytes:
    """One SSE line: a `data:` event with reasoning in a delta, rewritten; anything else as it was."""
    if MARK not in line or not line.startswith(b"data:"):
        return line
    end = b"\r" if line.endswith(b"\r") else b""
    try:
        payload = json.loads(line[5:])
    except ValueError:
        return line
    return b"data: " + _dumps(payload) + end if mirror_choices(payload, "delta") else line


def mirror_whole(body: bytes) -> bytes:
    """A whole chat answer with its reasoning under both names (unchanged when it has none or is no JSON)."""
    if MARK not in body:
        return body
    try:
        payload = json.loads(body)
    except ValueError:
        return body
    return _dumps(payload) if mirror_choices(payload, "message") else body


class StreamMirror:
    """An event stream's bytes, passed on at line ends with reasoning lines rewritten."""

    def __init__(self) -> None:
        self.tail = b""

    def feed(self, data: bytes) -> bytes:
        """What can go to the client now (b"" while a line is incomplete)."""
        if not self.tail and data.endswith(b"\n") and MARK not in data:
            return data
        data = self.tail + data
        cut = data.rfind(b"\n") + 1
        self.tail, ready = data[cut:], data[:cut]
        if MARK not in ready:
            return ready
        return b"\n".join(mirror_line(line) for line in ready.split(b"\n"))

    def end(self) -> bytes:
        """The unterminated rest at the end of the stream (an event without its blank line)."""
        rest, self.tail = self.tail, b""
        return mirror_line(rest)


class WholeMirror:
    """A whole JSON answer, held until complete (the client cannot use half of one), then rewritten."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.passing = False  # too large to hold: the rest goes through as it comes

    def feed(self, data: bytes) -> bytes:
        if self.passing:
            return data
        self.parts.append(data)
        self.size += len(data)
        if self.size > WHOLE_LIMIT:
            self.passing = True
            return self.end()
        return b""

    def end(self) -> bytes:
        body, self.parts = b"".join(self.parts), []
        return body if self.passing else mirror_whole(body)


def mirror_for(path: str, status: int, streamed: bool) -> StreamMirror | WholeMirror | None:
    """The rewriter an engine's answer to `path` goes through, or None (most answers: passed as they come)."""
    if path != CHAT_PATH or status != 200:
        return None
    return StreamMirror() if streamed else WholeMirror()


EFFORTS = ("off", "low", "medium", "high", "auto")  # the one reasoning setting (models.yaml, serve, requests)


def engine_fields(engine: str, effort: str) -> dict[str, Any]:
    """The request fields that give `effort` on `engine`, each engine's own mechanism (sources: llama.cpp b11434
    tools/server/server-common.cpp: `chat_template_kwargs` merged over the launch's, `reasoning_effort` "none" off,
    `reasoning_budget_tokens` 0 "immediate end"; vLLM 0.32 chat_completion/protocol.py: `reasoning_effort`, which
    also sets `enable_thinking` unless the client did, and `chat_template_kwargs`). `auto`: nothing."""
    if effort == "auto":
        return {}
    if effort == "off":
        fields: dict[str, Any] = {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": False}}
        if engine == "llama.cpp":
            fields["reasoning_budget_tokens"] = 0
        return fields
    return {"reasoning_effort": effort}
