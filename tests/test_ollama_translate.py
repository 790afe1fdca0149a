"""Issue 54: the Ollama translation on its own (serving.ollama): requests become the OpenAI bodies the engines take,
and the engines' answers (OpenAI chat SSE, whole JSON, errors) become what the official `ollama` client parses:
every NDJSON line is read by its own response models (ollama._types), fed to the translator a byte at a time.
The engine side is written as llama-server b11434 and vLLM 0.32 send it (chat.completion.chunk deltas with
`reasoning_content` / `reasoning`, a usage chunk with empty choices, `timings` from llama-server, [DONE])."""

from __future__ import annotations

import json
from typing import Any

import pytest
from ollama._types import (
    ChatResponse,
    EmbedResponse,
    GenerateResponse,
    ListResponse,
    ProcessResponse,
    ShowResponse,
)

from desktop.core.serving import ollama


def _sse(*payloads: dict[str, Any] | str) -> bytes:
    return b"".join(b"data: " + (p if isinstance(p, str) else json.dumps(p)).encode() + b"\n\n" for p in payloads)


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk", "model": "switchyard",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


LLAMA_STREAM = _sse(
    _chunk({"role": "assistant", "content": None}),
    _chunk({"reasoning_content": "Let me think."}),
    _chunk({"content": "Hello"}),
    _chunk({"content": " there"}),
    _chunk({}, "stop"),
    {"id": "c1", "object": "chat.completion.chunk", "choices": [],
     "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14},
     "timings": {"prompt_ms": 12.5, "predicted_ms": 40.0}},
    "[DONE]")


def _byte_by_byte(rewriter: Any, data: bytes) -> bytes:
    out = b"".join(rewriter.feed(data[i:i + 1]) for i in range(len(data)))
    return out + rewriter.end()


def _lines(out: bytes) -> list[dict[str, Any]]:
    assert out.endswith(b"\n") and b"\n\n" not in out, out  # NDJSON: the client breaks on a blank line
    return [json.loads(line) for line in out.split(b"\n")[:-1]]


def test_a_chat_request_becomes_the_openai_body_the_engines_take() -> None:
    body = {"model": "switchyard:latest", "stream": True, "think": False, "format": "json",
            "options": {"temperature": 0.2, "num_predict": 64, "stop": "END", "num_ctx": 8192, "seed": 7,
                        "repeat_penalty": 1.1},
            "tools": [],
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "What is this?", "images": ["iVBORw0KGgoAAA"]},
                         {"role": "assistant", "content": "", "thinking": "hmm",
                          "tool_calls": [{"function": {"name": "look", "arguments": {"x": 1}}}]},
                         {"role": "tool", "content": "a cat", "tool_name": "look"}]}
    call, route, out = ollama.translate("/api/chat", json.dumps(body).encode())
    assert route == "/v1/chat/completions" and call.stream and call.model == "switchyard:latest"
    assert out["stream_options"] == {"include_usage": True}
    assert out["reasoning_effort"] == "none"  # think: false
    assert out["response_format"] == {"type": "json_object"}
    assert out["max_tokens"] == 64 and out["stop"] == ["END"] and out["temperature"] == 0.2 and out["seed"] == 7
    assert out["repeat_penalty"] == 1.1 and out["repetition_penalty"] == 1.1
    assert "tools" not in out  # the client always sends an empty list, which vLLM refuses
    assert out["messages"][1]["content"] == [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url",
                                              "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAA"}}]
    assert out["messages"][2]["tool_calls"][0]["function"] == {"name": "look", "arguments": '{"x": 1}'}
    assert "thinking" not in out["messages"][2]
    assert out["messages"][3]["tool_call_id"] == out["messages"][2]["tool_calls"][0]["id"] == "call_0"
    assert any("num_ctx 8192 ignored" in note for note in call.notes)


def test_generate_and_its_raw_form_and_an_empty_prompt_that_only_loads() -> None:
    call, route, out = ollama.translate("/api/generate", b'{"model":"m","prompt":"Hi","system":"S","stream":false}')
    assert route == "/v1/chat/completions" and not call.stream and "stream_options" not in out
    assert out["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    call, route, out = ollama.translate("/api/generate", b'{"model":"m","prompt":"[INST]Hi","raw":true}')
    assert route == "/v1/completions" and out["prompt"] == "[INST]Hi" and call.raw
    with pytest.raises(ollama.OllamaRefusal) as loading:
        ollama.translate("/api/generate", b'{"model":"m"}')
    loaded = ollama.is_load(loading.value)
    assert loaded is not None
    assert GenerateResponse(**ollama.load_answer(loaded)).done_reason == "load"
    for bad, said in ((b'{"prompt":"x"}', "model is required"), (b"{", "invalid JSON"),
                      (b'{"model":"m","prompt":"x","think":"lots"}', "think must be"),
                      (b'{"model":"m","prompt":"x","template":"{{.Prompt}}"}', "`template` is not supported")):
        with pytest.raises(ollama.OllamaRefusal, match=said):
            ollama.translate("/api/generate", bad)


def test_a_streamed_chat_answer_reads_as_ollamas_lines_with_thinking_and_counts() -> None:
    call, _route, _out = ollama.translate("/api/chat", b'{"model":"switchyard","messages":[{"role":"user","content":"hi"}]}')
    lines = _lines(_byte_by_byte(ollama.rewriter_for(call, 200, streamed=True), LLAMA_STREAM))
    parsed = [ChatResponse(**line) for line in lines]
    assert [p.message.thinking for p in parsed[:-1]] == ["Let me think.", None, None]
    assert "".join(p.message.content or "" for p in parsed) == "Hello there"
    final = parsed[-1]
    assert final.done and final.done_reason == "stop" and not any(p.done for p in parsed[:-1])
    assert final.prompt_eval_count == 11 and final.eval_count == 3
    assert final.prompt_eval_duration == 12_500_000 and final.eval_duration == 40_000_000  # llama's timings, in ns
    assert all(line["model"] == "switchyard" and line["created_at"].endswith("Z") for line in lines)


def test_streamed_tool_calls_arrive_as_one_line_with_arguments_as_objects() -> None:
    call, _r, _o = ollama.translate("/api/chat", b'{"model":"m","messages":[{"role":"user","content":"weather?"}]}')
    stream = _sse(
        _chunk({"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                "function": {"name": "get_weather", "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        _chunk({}, "tool_calls"), "[DONE]")
    parsed = [ChatResponse(**line) for line in _lines(_byte_by_byte(ollama.rewriter_for(call, 200, True), stream))]
    calls = [c for p in parsed for c in (p.message.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert dict(calls[0].function.arguments) == {"city": "Paris"}
    assert parsed[-1].done_reason == "stop"  # Ollama has no tool-call reason


def test_whole_answers_embeddings_and_engine_errors() -> None:
    call, _r, _o = ollama.translate("/api/generate", b'{"model":"m","prompt":"hi","stream":false}')
    whole = {"choices": [{"index": 0, "finish_reason": "length",
                          "message": {"role": "assistant", "content": "Hi!", "reasoning": "short"}}],
             "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    answer = GenerateResponse(**json.loads(_byte_by_byte(ollama.rewriter_for(call, 200, False),
                                                         json.dumps(whole).encode())))
    assert answer.response == "Hi!" and answer.thinking == "short" and answer.done_reason == "length"
    assert answer.prompt_eval_count == 5 and answer.eval_count == 2
    call, route, out = ollama.translate("/api/embed", b'{"model":"m","input":["a","b"]}')
    assert route == "/v1/embeddings" and out == {"model": "m", "input": ["a", "b"]}
    vectors = {"data": [{"index": 1, "embedding": [0.0, 1.0]}, {"index": 0, "embedding": [1.0, 0.0]}],
               "usage": {"prompt_tokens": 2}}
    embedded = EmbedResponse(**json.loads(_byte_by_byte(ollama.rewriter_for(call, 200, False),
                                                        json.dumps(vectors).encode())))
    assert [list(v) for v in embedded.embeddings] == [[1.0, 0.0], [0.0, 1.0]]
    # llama-server without --embeddings (server-context.cpp's words): Ollama's error shape, and how to add one
    refused = b'{"error":{"code":501,"message":"This server does not support embeddings. Start it with `--embeddings`","type":"not_supported_error"}}'
    said = json.loads(_byte_by_byte(ollama.rewriter_for(call, 501, False), refused))
    assert said["error"].startswith("This server does not support embeddings") and "models.yaml" in said["error"]


def test_the_endpoints_own_answers_parse_with_the_client() -> None:
    served = [ollama.Served(name="switchyard", model="demo", engine="llama.cpp", context=4096, started_at=1.7e9)]
    status, tags = ollama.local_answer("/api/tags", "GET", b"", served)
    listed = ListResponse(**tags)
    assert status == 200 and listed.models[0].model == "switchyard"
    assert listed.models[0].details is not None and listed.models[0].details.family == "llama"  # the demo's arch
    assert ProcessResponse(**ollama.local_answer("/api/ps", "GET", b"", served)[1]).models[0].context_length == 4096
    status, shown = ollama.local_answer("/api/show", "POST", b'{"model":"switchyard:latest"}', served)
    assert status == 200 and ShowResponse(**shown).modelinfo["llama.context_length"] == 4096  # demo.py's window
    assert ollama.local_answer("/api/show", "POST", b'{"model":"nope"}', served) == (404, {"error": "model 'nope' not found"})
    assert ollama.local_answer("/api/version", "GET", b"", served)[1]["version"]
    assert "switchyard pull" in (ollama.management("/api/pull") or "")
