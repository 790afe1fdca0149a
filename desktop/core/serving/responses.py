"""A `/v1/responses` event stream finished by the endpoint when the engine leaves its end out.

Codex reads its turn from `response.output_item.done` (the last agent message) and ends it only at
`response.completed`: without them it fails with "stream closed before response.completed" (tested against the
real Codex 0.171.0 in tests/test_coding_agents.py). vLLM's Responses stream once ended without them, so an engine
that does is not hypothetical. The pinned engines send the whole sequence (llama-server b11434 server-task.cpp
`to_json_oaicompat_resp_stream`; vLLM 0.32 entrypoints/openai/responses), and then this passes their bytes on as
they are; it only watches.

Watching means parsing every event of the stream (json.loads of each `data:` line): a Responses stream is one
agent turn, tens to a few thousand events, so the cost is small beside generating them; it is paid only on this
route. Measured (benchmarks/bench_proxy.py --api responses --engine-threads spare --rounds 4, llama-server 11434
on this 2-core VM, 128 streams of 16-112 tokens per round at c=32; benchmarks/results/responses-completer/): the
endpoint's CPU per request 4.45 ms without the completer, 4.94 ms with it (about 7 us per event); throughput
through the endpoint / direct 1.008 and 0.989 (per-round pairs spread 0.955-1.044 in each run), added TTFT p50
within noise in both. When the engine's answer ends (its body complete) with no `response.completed`, `response.failed`,
`response.incomplete` or `error` event, the endpoint adds `response.output_item.done` for each item the engine
opened and did not close (its text or arguments gathered from the deltas) and a `response.completed` whose output
is every item, in order. A stream that breaks off (the engine died) is not completed: that is an error, said by the
proxy as any cut stream is.
"""

from __future__ import annotations

import json
import time
from typing import Any

from desktop.core.common.sse import SSEDecoder
from desktop.core.serving.reasoning import StreamMirror, WholeMirror, mirror_for

RESPONSES_PATH = "/v1/responses"
TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete", "error"})
TEXT_DELTAS = {"response.output_text.delta": "output_text", "response.reasoning_text.delta": "reasoning_text"}


class ResponsesCompleter:
    """Passes an engine's Responses event stream on unchanged, and at its end adds what it left out."""

    def __init__(self) -> None:
        self.decoder = SSEDecoder()
        self.response: dict[str, Any] = {}
        self.items: dict[int, dict[str, Any]] = {}  # output_index -> the item as added or, once done, as done
        self.done: set[int] = set()
        self.texts: dict[tuple[int, int], list[str]] = {}  # (output_index, content_index) -> text deltas
        self.kinds: dict[tuple[int, int], str] = {}
        self.arguments: dict[int, list[str]] = {}
        self.finished = False
        self.sequence = -1
        self.last = b""  # the stream's last two bytes: an added event must start after a blank line

    def feed(self, data: bytes) -> bytes:
        """The engine's bytes, unchanged (what it said is read on the way)."""
        if data:
            self.last = (self.last + data)[-2:]
        for payload in self.decoder.feed(data):
            self._read(payload)
        return data

    def end(self) -> bytes:
        """The events the engine left out (b"" when its stream was whole)."""
        for payload in self.decoder.flush():
            self._read(payload)
        if self.finished or not self.response:
            return b""  # a whole stream, or not a Responses stream at all (nothing to complete)
        out = [b"" if self.last.endswith(b"\n\n") or not self.last else b"\n" if self.last.endswith(b"\n")
               else b"\n\n"]
        for index in sorted(self.items):
            if index not in self.done:
                self.items[index] = self._closed(index)
                out.append(self._event("response.output_item.done", output_index=index, item=self.items[index]))
        response = {**self.response, "status": "completed", "completed_at": int(time.time()),
                    "output": [self.items[i] for i in sorted(self.items)]}
        out.append(self._event("response.completed", response=response))
        self.finished = True
        return b"".join(out)

    def _read(self, payload: str) -> None:
        try:
            event = json.loads(payload)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        kind = event.get("type")
        if isinstance(event.get("sequence_number"), int):
            self.sequence = max(self.sequence, event["sequence_number"])
        if kind in TERMINAL:
            self.finished = True
        elif kind in ("response.created", "response.in_progress") and isinstance(event.get("response"), dict):
            self.response = event["response"]
        index = event.get("output_index")
        if not isinstance(index, int):
            return
        if kind in ("response.output_item.added", "response.output_item.done") and isinstance(event.get("item"), dict):
            self.items[index] = event["item"]
            if kind == "response.output_item.done":
                self.done.add(index)
        elif kind in TEXT_DELTAS and isinstance(event.get("delta"), str):
            content_index = event.get("content_index")
            part = (index, content_index if isinstance(content_index, int) else 0)
            self.texts.setdefault(part, []).append(event["delta"])
            self.kinds[part] = TEXT_DELTAS[kind]
        elif kind == "response.function_call_arguments.delta" and isinstance(event.get("delta"), str):
            self.arguments.setdefault(index, []).append(event["delta"])

    def _closed(self, index: int) -> dict[str, Any]:
        """An item the engine opened, with what its deltas said, as `output_item.done` carries it."""
        item = {**self.items[index], "status": "completed"}
        if index in self.arguments:
            item["arguments"] = "".join(self.arguments[index])
        parts = sorted(part for part in self.texts if part[0] == index)
        if parts:
            content: list[dict[str, Any]] = [{"type": self.kinds[part], "text": "".join(self.texts[part])}
                                             for part in parts]
            for entry in content:
                if entry["type"] == "output_text":
                    entry["annotations"] = []
            item["content"] = content
        return item

    def _event(self, kind: str, **fields: Any) -> bytes:
        self.sequence += 1
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        return f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


def rewriter_for(path: str, status: int, streamed: bool) -> ResponsesCompleter | StreamMirror | WholeMirror | None:
    """What an engine's answer to `path` goes through on its way to the client: a Responses stream's completer,
    the chat routes' reasoning mirror (serving.reasoning), or None (passed as it comes)."""
    if path == RESPONSES_PATH and status == 200 and streamed:
        return ResponsesCompleter()
    return mirror_for(path, status, streamed)
