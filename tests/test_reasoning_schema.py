"""One reasoning schema at the endpoint (issue 34, item 2): whichever engine serves, a chat answer carries its
reasoning under both `reasoning` (vLLM 0.32) and `reasoning_content` (llama-server), streamed and whole; every
other answer, and every chunk without reasoning, reaches the client as the engine sent it."""

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

from desktop.core.runtime.ports import find_free_port
from desktop.core.serving.proxy import ProxyServer, Upstream
from desktop.core.serving.reasoning import StreamMirror, WholeMirror, mirror_line, mirror_whole


def _event(delta: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps({"id": "c1", "object": "chat.completion.chunk",
                                   "choices": [{"index": 0, "delta": delta}]}).encode() + b"\n\n"


def test_stream_lines_with_reasoning_get_both_names_and_the_rest_is_untouched() -> None:
    for name, other in (("reasoning", "reasoning_content"), ("reasoning_content", "reasoning")):
        line = _event({name: "thinking"}).rstrip(b"\n")
        delta = json.loads(mirror_line(line)[6:])["choices"][0]["delta"]
        assert delta == {name: "thinking", other: "thinking"}
    both = _event({"reasoning": "a", "reasoning_content": "a"}).rstrip(b"\n")
    assert mirror_line(both) is both
    content = _event({"content": 'he said "reasoning" twice'}).rstrip(b"\n")
    assert json.loads(mirror_line(content)[6:]) == json.loads(content[6:])  # the marker in text: parsed, unchanged
    assert mirror_line(b"data: {not json \"reasoning") == b"data: {not json \"reasoning"
    crlf = _event({"reasoning": "x"}).rstrip(b"\n") + b"\r"
    assert mirror_line(crlf).endswith(b"\r") and b'"reasoning_content":"x"' in mirror_line(crlf)


def test_stream_mirror_reframes_at_line_ends_whatever_the_pieces() -> None:
    stream = _event({"role": "assistant"}) + _event({"reasoning": "step one"}) + _event({"content": "Hi"}) \
        + b"data: [DONE]\n\n"
    for size in (1, 3, 7, 50, len(stream)):
        mirror = StreamMirror()
        out = b"".join(mirror.feed(stream[i:i + size]) for i in range(0, len(stream), size)) + mirror.end()
        events = [json.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: {")]
        assert [e["choices"][0]["delta"] for e in events] == [
            {"role": "assistant"}, {"reasoning": "step one", "reasoning_content": "step one"}, {"content": "Hi"}]
        assert out.endswith(b"data: [DONE]\n\n")
    plain = _event({"content": "Hi"})
    assert StreamMirror().feed(plain) is plain  # a whole event without reasoning: the same bytes, not a copy


def test_whole_answers_get_both_names() -> None:
    body = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "4",
                                                            "reasoning": "2+2"}}]}).encode()
    message = json.loads(mirror_whole(body))["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "2+2"
    plain = b'{"choices": [{"message": {"content": "4"}}]}'
    assert mirror_whole(plain) is plain
    mirror = WholeMirror()
    assert mirror.feed(body[:10]) == b"" and json.loads(mirror.feed(body[10:]) + mirror.end()) == json.loads(
        mirror_whole(body))


class ReasoningEngine:
    """A chat server that thinks under one name (`field`), then answers; /v1/completions streams plain text."""

    def __init__(self, field: str) -> None:
        self.field = field
        self.sent: list[bytes] = []  # exactly what each stream wrote
        self.port = find_free_port()
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        assert started.wait(10)

    @property
    def upstream(self) -> Upstream:
        return Upstream(name=f"thinker@{self.port}", engine="vllm", base_url=f"http://127.0.0.1:{self.port}",
                        served_model_name="m", model="/models/m")

    def _run(self, started: threading.Event) -> None:
        async def setup() -> None:
            app = web.Application()
            app.router.add_post("/v1/chat/completions", self._chat)
            app.router.add_post("/v1/completions", self._completions)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

        self._loop.run_until_complete(setup())
        started.set()
        self._loop.run_forever()
        assert self._runner is not None
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    async def _stream(self, request: web.Request, events: list[bytes]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
        self.sent.append(b"".join(events))
        await response.write_eof()
        return response

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"id": "c1", "object": "chat.completion", "choices": [
                {"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "4", self.field: "2 and 2 make 4"}}]})
        return await self._stream(request, [_event({"role": "assistant"}), _event({self.field: "2 and 2"}),
                                            _event({self.field: " make 4"}), _event({"content": "4"}),
                                            b"data: [DONE]\n\n"])

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        chunk = {"choices": [{"index": 0, "text": 'a "reasoning" word'}]}
        return await self._stream(request, [b"data: " + json.dumps(chunk).encode() + b"\n\n", b"data: [DONE]\n\n"])

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture(params=["reasoning", "reasoning_content"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[ProxyServer, ReasoningEngine]]:
    engine = ReasoningEngine(request.param)
    proxy = ProxyServer(port=find_free_port(), model_name="stable", wait_timeout=30)
    proxy.start()
    proxy.set_upstream(engine.upstream)
    yield proxy, engine
    proxy.stop()
    engine.close()


def test_the_openai_client_reads_reasoning_under_both_names_from_either_engine(
        served: tuple[ProxyServer, ReasoningEngine]) -> None:
    proxy, _engine = served
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0,
                           http_client=httpx.Client(trust_env=False, timeout=30))
    ask: list[Any] = [{"role": "user", "content": "2+2?"}]
    whole = client.chat.completions.create(model="stable", messages=ask)
    extra = whole.choices[0].message.model_extra or {}
    assert extra["reasoning"] == extra["reasoning_content"] == "2 and 2 make 4"
    assert whole.choices[0].message.content == "4"
    deltas = [c.choices[0].delta for c in client.chat.completions.create(model="stable", messages=ask, stream=True)]
    for name in ("reasoning", "reasoning_content"):
        assert "".join((d.model_extra or {}).get(name) or "" for d in deltas) == "2 and 2 make 4", name
    assert "".join(d.content or "" for d in deltas) == "4"


def test_answers_without_chat_reasoning_pass_as_the_engine_sent_them(
        served: tuple[ProxyServer, ReasoningEngine]) -> None:
    proxy, engine = served
    with httpx.stream("POST", proxy.url + "/v1/completions", json={"model": "stable", "prompt": "x", "stream": True},
                      trust_env=False, timeout=30) as response:
        received = b"".join(response.iter_bytes())
    assert received == engine.sent[-1]  # the literal "reasoning" in a completion's text is not touched
