"""Structured output at the endpoint (issue 55), with a stand-in engine that answers in the real engines' words:
the texts below are what llama-server b11434 and vLLM 0.32 answered, through the endpoint, to a schema with an
unresolvable `$ref` (captured on this machine; tests/test_agent_clients.py sends the same to the real engines).
A refusal comes out as OpenAI's 400 (the openai SDK's BadRequestError, `param: response_format`), whether the
engine said it as a 400 (llama-server; vLLM unstreamed) or as the first event of a 200 stream (vLLM streamed);
any other stream of a structured request passes through byte for byte and is metered as before."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from desktop.core.engines import get_adapter
from desktop.core.engines.vllm import structured_output_args
from desktop.core.runtime.ports import find_free_port
from desktop.core.serving.metering import RequestRecord
from desktop.core.serving.normalize import Target, parse
from desktop.core.serving.proxy import ProxyServer
from desktop.core.serving.router import Upstream
from desktop.core.serving.structured import asked, schema_refusal

LLAMA_REFUSAL = {"error": {"code": 400, "message": "Unable to generate parser for this template. Automatic parser "
                           "generation failed: JSON schema error at #: cannot resolve $ref #/$defs/missing, $defs "
                           "not found", "type": "invalid_request_error"}}
VLLM_REFUSAL = {"error": {"message": "Grammar error: Pointer '/$defs/missing' does not exist",
                          "type": "BadRequestError", "param": None, "code": 400}}
BROKEN = {"type": "json_schema", "json_schema": {"name": "broken", "schema": {"$ref": "#/$defs/missing"}}}
CHUNKS = [{"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text},
                                                                       "finish_reason": None}]}
          for text in ('{"colour"', ':"red"', "}")]


class StandIn:
    """/v1/chat/completions answering as `engine` does: `refuse` -> its refusal (vLLM streams it as a 200 event
    stream), else a stream of CHUNKS written a few bytes at a time (the first event arrives in pieces)."""

    def __init__(self, engine: str) -> None:
        self.engine, self.refuse, self.port = engine, False, find_free_port()
        self.bodies: list[dict[str, Any]] = []
        started = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(10)

    def _run(self, started: threading.Event) -> None:
        async def setup() -> web.AppRunner:
            app = web.Application()
            app.router.add_post("/v1/chat/completions", self._chat)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            return runner

        self.runner = self.loop.run_until_complete(setup())
        started.set()
        self.loop.run_forever()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        stream = body.get("stream", False)
        if self.refuse and (self.engine == "llama.cpp" or not stream):
            return web.json_response(LLAMA_REFUSAL if self.engine == "llama.cpp" else VLLM_REFUSAL, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        events = [VLLM_REFUSAL] if self.refuse else CHUNKS
        wire = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        for start in range(0, len(wire), 7):
            await response.write(wire[start:start + 7])
        await response.write_eof()
        return response

    @property
    def upstream(self) -> Upstream:
        return Upstream(name=f"{self.engine}@{self.port}", engine=self.engine,
                        base_url=f"http://127.0.0.1:{self.port}", served_model_name="m", model="/models/m")

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(params=["llama.cpp", "vllm"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[ProxyServer, StandIn, Records]]:
    engine = StandIn(request.param)
    proxy = ProxyServer(port=find_free_port(), model_name="stable", wait_timeout=30)
    proxy.start()
    records = Records()
    proxy.subscribe(records.add)
    proxy.set_upstream(engine.upstream)
    yield proxy, engine, records
    proxy.stop()
    engine.close()


class Records(list[RequestRecord]):
    """The endpoint's records as they come (a refusal answered at the first event is recorded when the engine's
    stream ends, after the client has its answer)."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = threading.Condition()

    def add(self, record: RequestRecord) -> None:
        with self.changed:
            self.append(record)
            self.changed.notify_all()

    def wait(self, count: int) -> RequestRecord:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self) >= count, timeout=30), list(self)
        return self[count - 1]


def _client(proxy: ProxyServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=30))


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_the_engine_refuses_is_openais_400_naming_the_engine(
        served: tuple[ProxyServer, StandIn, Records], stream: bool) -> None:
    proxy, engine, records = served
    engine.refuse = True
    with pytest.raises(openai.BadRequestError) as caught:
        answer = _client(proxy).chat.completions.create(model="stable", messages=[{"role": "user", "content": "x"}],
                                                        response_format=BROKEN, stream=stream)  # type: ignore[arg-type, call-overload]
        if stream:
            list(answer)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format" and error["code"] is None
    said = (LLAMA_REFUSAL if engine.engine == "llama.cpp" else VLLM_REFUSAL)["error"]["message"]
    name = "llama-server" if engine.engine == "llama.cpp" else "vLLM"
    assert error["message"] == f"Invalid schema for response_format 'broken': {name} could not use it as a " \
                               f"constraint: {said}"
    record = records.wait(1)
    assert record.status == 400 and record.error == error["message"]


def test_a_structured_stream_passes_through_byte_for_byte(
        served: tuple[ProxyServer, StandIn, Records]) -> None:
    """The held first event goes on with the head: the client reads the engine's bytes, and they are metered."""
    proxy, _engine, records = served
    body = {"model": "stable", "stream": True, "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_object"}}
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, trust_env=False, timeout=30) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        received = b"".join(answer.iter_raw())
    expected = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in CHUNKS) + b"data: [DONE]\n\n"
    assert received == expected
    record = records.wait(1)
    assert record.status == 200 and record.output_tokens == len(CHUNKS)


def test_a_refusal_without_a_schema_request_passes_as_the_engine_said_it() -> None:
    """Only a request that asked for structured output is read this way; a schema word alone is not enough."""
    chat = {"model": "m", "messages": []}
    assert schema_refusal("/v1/chat/completions", chat, "vllm", json.dumps(VLLM_REFUSAL).encode()) is None
    text = {**chat, "response_format": {"type": "text"}}
    assert schema_refusal("/v1/chat/completions", text, "vllm", json.dumps(VLLM_REFUSAL).encode()) is None
    other = {"error": {"message": "messages: field required", "type": "BadRequestError"}}
    asked_json = {**chat, "response_format": BROKEN}
    assert schema_refusal("/v1/chat/completions", asked_json, "vllm", json.dumps(other).encode()) is None


def test_what_a_request_asks_for() -> None:
    assert asked("/v1/chat/completions", {"response_format": BROKEN}) == ("response_format",
                                                                          "response_format 'broken'")
    assert asked("/v1/chat/completions", {"response_format": {"type": "json_object"}}) == (
        "response_format", "response_format json_object")
    responses = {"text": {"format": {"type": "json_schema", "name": "pick", "schema": {"type": "object"}}}}
    assert asked("/v1/responses", responses) == ("text.format", "text.format 'pick'")
    assert asked("/v1/messages", {"response_format": BROKEN}) is None


def test_rule_7_sends_responses_text_format_to_llama_server_as_response_format() -> None:
    """llama-server maps a Responses body to a chat request and keeps the fields it does not map
    (server-chat.cpp server_chat_convert_responses_to_chatcmpl), of which response_format is one it reads."""
    schema = {"type": "object", "properties": {"c": {"type": "string"}}, "required": ["c"]}
    body = {"model": "x", "input": "hi", "text": {"format": {"type": "json_schema", "name": "p", "schema": schema,
                                                             "strict": True}}}
    shape = parse("/v1/responses", json.dumps(body).encode())
    assert shape is not None
    sent = shape.body_for(Target("m", engine="llama.cpp"))
    assert sent is not None
    assert json.loads(sent)["response_format"] == {"type": "json_schema",
                                                  "json_schema": {"name": "p", "schema": schema, "strict": True}}
    assert json.loads(sent)["text"] == body["text"]  # kept: llama-server reads no text.format, vLLM would
    assert shape.body_for(Target("m", engine="vllm")) is None  # vLLM reads text.format itself


def test_vllm_is_launched_with_compact_json_unless_the_person_sets_it() -> None:
    vllm = get_adapter("vllm")
    assert structured_output_args(vllm, ()) == ["--structured-outputs-config",
                                                '{"backend":"guidance","disable_any_whitespace":true}']
    for own in (["--structured-outputs-config", '{"backend":"xgrammar"}'],
                ["--structured_outputs_config.backend", "outlines"], ['--structured-outputs-config={"backend":"x"}']):
        assert structured_output_args(vllm, own) == [], own
    assert json.loads(structured_output_args(vllm, ["--tokenizer-mode", "mistral"])[1])["backend"] == "xgrammar"
    assert json.loads(structured_output_args(vllm, ["--tokenizer_mode=mistral"])[1])["backend"] == "xgrammar"
