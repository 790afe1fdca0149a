"""The endpoint's completer of /v1/responses streams (serving.responses), on hand-written event sequences in the
shape llama-server b11434 and vLLM 0.32 stream them; the real Codex and openai client over a stand-in that leaves
the end out are in tests/test_coding_agents.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from desktop.core.common.sse import SSEDecoder
from desktop.core.serving.reasoning import StreamMirror
from desktop.core.serving.responses import ResponsesCompleter, rewriter_for

RESPONSE = {"id": "resp_1", "object": "response", "created_at": 1764900000, "status": "in_progress",
            "model": "switchyard", "output": [], "usage": None}
MESSAGE = {"id": "msg_1", "type": "message", "status": "in_progress", "role": "assistant", "content": []}
CALL = {"id": "fc_1", "type": "function_call", "status": "in_progress", "call_id": "call_1", "name": "exec_command",
        "arguments": ""}


def sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def numbered(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**event, "sequence_number": number} for number, event in enumerate(events)]


OPENED = numbered([
    {"type": "response.created", "response": RESPONSE},
    {"type": "response.in_progress", "response": RESPONSE},
    {"type": "response.output_item.added", "output_index": 0, "item": MESSAGE},
    {"type": "response.content_part.added", "output_index": 0, "content_index": 0, "item_id": "msg_1",
     "part": {"type": "output_text", "text": "", "annotations": []}},
    {"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "item_id": "msg_1", "delta": "Hel"},
    {"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "item_id": "msg_1", "delta": "lo"},
    {"type": "response.output_item.added", "output_index": 1, "item": CALL},
    {"type": "response.function_call_arguments.delta", "output_index": 1, "item_id": "fc_1", "delta": '{"cmd":'},
    {"type": "response.function_call_arguments.delta", "output_index": 1, "item_id": "fc_1", "delta": '"ls"}'},
])
MESSAGE_DONE = {**MESSAGE, "status": "completed",
                "content": [{"type": "output_text", "text": "Hello", "annotations": []}]}
CALL_DONE = {**CALL, "status": "completed", "arguments": '{"cmd":"ls"}'}


def through(completer: ResponsesCompleter, stream: bytes, step: int) -> bytes:
    """The stream fed in pieces of `step` bytes (split mid-line, mid-event), then its end."""
    passed = b"".join(completer.feed(stream[i:i + step]) for i in range(0, len(stream), step))
    assert passed == stream  # the engine's own bytes go on unchanged
    return completer.end()


def events_of(data: bytes) -> list[dict[str, Any]]:
    decoder = SSEDecoder()
    return [json.loads(payload) for payload in decoder.feed(data) + decoder.flush()]


@pytest.mark.parametrize("step", [1, 7, 10_000])
def test_a_stream_left_open_is_closed_from_its_deltas(step: int) -> None:
    added = events_of(through(ResponsesCompleter(), sse(OPENED), step))
    assert [e["type"] for e in added] == ["response.output_item.done", "response.output_item.done",
                                          "response.completed"]
    assert added[0] == {"type": "response.output_item.done", "sequence_number": 9, "output_index": 0,
                        "item": MESSAGE_DONE}
    assert added[1] == {"type": "response.output_item.done", "sequence_number": 10, "output_index": 1,
                        "item": CALL_DONE}
    completed = added[2]
    assert completed["sequence_number"] == 11
    assert completed["response"]["id"] == "resp_1" and completed["response"]["status"] == "completed"
    assert completed["response"]["output"] == [MESSAGE_DONE, CALL_DONE]


def test_items_the_engine_closed_are_not_closed_again() -> None:
    engine_done = {**MESSAGE_DONE, "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]}
    stream = sse([*OPENED, {"type": "response.output_item.done", "output_index": 0, "item": engine_done}])
    added = events_of(through(ResponsesCompleter(), stream, 64))
    assert [(e["type"], e.get("output_index")) for e in added] == [("response.output_item.done", 1),
                                                                   ("response.completed", None)]
    assert added[-1]["response"]["output"] == [engine_done, CALL_DONE]  # the engine's own item as it said it


@pytest.mark.parametrize("last", [
    {"type": "response.completed", "response": {**RESPONSE, "status": "completed"}},
    {"type": "response.failed", "response": {**RESPONSE, "status": "failed", "error": {"message": "no"}}},
    {"type": "response.incomplete", "response": {**RESPONSE, "status": "incomplete"}},
    {"type": "error", "message": "the engine failed", "code": None},
])
def test_a_stream_that_ended_itself_gets_nothing_more(last: dict[str, Any]) -> None:
    assert through(ResponsesCompleter(), sse([*OPENED, last]), 13) == b""


def test_a_stream_that_is_no_responses_stream_gets_nothing() -> None:
    chat = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n'
    assert through(ResponsesCompleter(), chat, 5) == b""


@pytest.mark.parametrize("cut", [b"\n", b""])
def test_the_added_events_stand_apart_from_an_unterminated_last_event(cut: bytes) -> None:
    stream = sse(OPENED)[:-2] + cut  # the engine's last event without its blank line (or without any line end)
    completer = ResponsesCompleter()
    added = through(completer, stream, 50)
    kinds = [e["type"] for e in events_of(stream + added)]
    assert kinds[-4:] == ["response.function_call_arguments.delta", "response.output_item.done",
                          "response.output_item.done", "response.completed"]


def test_only_a_streamed_200_on_the_responses_route_is_watched() -> None:
    assert isinstance(rewriter_for("/v1/responses", 200, True), ResponsesCompleter)
    assert rewriter_for("/v1/responses", 200, False) is None
    assert rewriter_for("/v1/responses", 400, True) is None
    assert isinstance(rewriter_for("/v1/chat/completions", 200, True), StreamMirror)
