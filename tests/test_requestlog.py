"""The endpoint's request log (in memory, in flight, in history, over the control channel, `switchyard requests`)
and the Anthropic Messages passthrough (metered, 501 where the engine lacks it), against a scriptable fake engine
and the real llama-server."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from conftest import serve_until_ready

from desktop.core.common.errors import SwitchyardError
from desktop.core.runtime.ports import find_free_port
from desktop.core.serving import control
from desktop.core.serving.metering import RequestRecord, StreamMeter, count_json_tokens
from desktop.core.serving.proxy import ProxyServer, Upstream
from desktop.core.serving.requestinfo import scan
from desktop.core.serving.requestlog import RequestLog
from desktop.core.storage.history import Store

# What llama-server (this build) streams for /v1/messages, verbatim but for the text.
ANTHROPIC_STREAM = [
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"m1","type":"message","role":"assistant",'
    b'"content":[],"model":"switchyard","stop_reason":null,"stop_sequence":null,"usage":{"cache_read_input_tokens":0,'
    b'"input_tokens":22,"output_tokens":0}}}\n\n',
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,"content_block":{"type":"text",'
    b'"text":""}}\n\n',
    *[b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
      b'"text":"t%d"}}\n\n' % i for i in range(8)],
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n',
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},'
    b'"usage":{"output_tokens":8}}\n\n',
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
]


# --- metering -------------------------------------------------------------------------------------------------
def test_the_meter_understands_anthropic_streams() -> None:
    meter = StreamMeter(started=0.0)
    for index, chunk in enumerate(ANTHROPIC_STREAM):
        meter.feed(chunk, float(index))
    meter.finish(99.0)
    assert meter.first_token_at == 2.0  # the first content_block_delta, not message_start
    assert meter.prompt_tokens == 22 and meter.output_tokens == 8


def test_the_meter_finds_prompt_tokens_in_openai_usage_and_llama_timings() -> None:
    usage = StreamMeter(0.0)
    usage.feed(b'data: {"choices":[{"text":"a"}]}\n\n', 1.0)
    usage.feed(b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":1}}\n\ndata: [DONE]\n\n', 2.0)
    usage.finish(2.0)
    assert (usage.prompt_tokens, usage.output_tokens) == (7, 1)
    timings = StreamMeter(0.0)
    timings.feed(b'data: {"choices":[{"text":"a"}]}\n\n', 1.0)
    timings.feed(b'data: {"choices":[{"text":""}],"timings":{"prompt_n":5,"predicted_n":1}}\n\n', 2.0)
    timings.finish(2.0)
    assert (timings.prompt_tokens, timings.output_tokens) == (5, 1)


def test_non_streamed_answers_count_openai_and_anthropic_usage() -> None:
    openai = StreamMeter(0.0)
    count_json_tokens(openai, b'{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3}}', 1.0)
    assert (openai.prompt_tokens, openai.output_tokens, openai.first_token_at) == (4, 3, 1.0)
    anthropic = StreamMeter(0.0)
    count_json_tokens(anthropic, b'{"type":"message","content":[],"usage":{"input_tokens":22,"output_tokens":8}}',
                      1.0)
    assert (anthropic.prompt_tokens, anthropic.output_tokens) == (22, 8)


def test_request_model_is_read_without_parsing_the_body() -> None:
    def model(body: bytes) -> str | None:
        info = scan(body)
        assert info is not None
        return info.model

    assert model(b'{"prompt": "x", "model" : "qwen\\"s"}') == 'qwen"s'
    assert model(b'{"prompt": "model"}') is None
    assert model(b"") is None
    assert model(b'{"tools": [{"model": "nested"}], "model": "top"}') == "top"  # the top-level key, as routed


# --- a fake engine with /v1/messages and held streams ------------------------------------------------------------
class MessagesEngine:
    """Streams ANTHROPIC_STREAM for /v1/messages (non-streamed: one message) and OpenAI chunks for
    /v1/chat/completions; `hold` pauses a chat stream after its first chunk until `release()`."""

    def __init__(self) -> None:
        self.hold = False
        self.first_chunk_sent = threading.Event()
        self._gate: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port = find_free_port()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        assert started.wait(10)

    def upstream(self, messages_api: bool = True) -> Upstream:
        return Upstream(name=f"fake@{self.port}", engine="fake", base_url=f"http://127.0.0.1:{self.port}",
                        served_model_name="served", messages_api=messages_api)

    def _run(self, started: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        runner: list[web.AppRunner] = []

        async def setup() -> None:
            self._gate = asyncio.Event()
            app = web.Application()
            app.router.add_post("/v1/messages", self._messages)
            app.router.add_post("/v1/chat/completions", self._chat)
            runner.append(web.AppRunner(app))
            await runner[0].setup()
            await web.TCPSite(runner[0], "127.0.0.1", self.port).start()

        loop.run_until_complete(setup())
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner[0].cleanup())
        loop.close()

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"type": "message", "role": "assistant", "model": body["model"],
                                      "content": [{"type": "text", "text": "hello"}],
                                      "usage": {"input_tokens": 22, "output_tokens": 8}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in ANTHROPIC_STREAM:
            await response.write(chunk)
        await response.write_eof()
        return response

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"delta":{"content":"a"},"index":0}]}\n\n')
        self.first_chunk_sent.set()
        if self.hold:
            assert self._gate is not None
            await self._gate.wait()
        await response.write(b'data: {"choices":[{"delta":{"content":"b"},"index":0}]}\n\n'
                             b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
                             b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def release(self) -> None:
        assert self._loop is not None and self._gate is not None
        self._loop.call_soon_threadsafe(self._gate.set)

    def close(self) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def engine() -> Iterator[MessagesEngine]:
    fake = MessagesEngine()
    yield fake
    fake.close()


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """The app's default history, in this test's own home (where `switchyard requests` looks too)."""
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    with Store() as opened:
        yield opened


TOKEN = control.new_token()


@pytest.fixture
def logged(store: Store) -> Iterator[tuple[ProxyServer, RequestLog]]:
    """A running endpoint with a request log kept in `store`, and its control route for the log."""
    proxy = ProxyServer(port=find_free_port(), model_name="stable", wait_timeout=30)
    request_log = RequestLog(capacity=50, sink=store)
    request_log.attach(proxy)
    proxy.add_routes(control.request_routes(request_log, TOKEN, lambda: proxy.capture_bodies))
    proxy.start()
    yield proxy, request_log
    proxy.stop()
    request_log.stop()


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]


# --- the log ----------------------------------------------------------------------------------------------------
def test_in_flight_then_finished_with_ttft_tokens_model_and_client(
        logged: tuple[ProxyServer, RequestLog], engine: MessagesEngine, store: Store) -> None:
    proxy, request_log = logged
    events: list[tuple[str, int]] = []
    request_log.subscribe(lambda kind, record: events.append((kind, record.seq)))
    proxy.set_upstream(engine.upstream())
    engine.hold = True
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", trust_env=False, timeout=30, json={
            "model": "stable", "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        (running,) = request_log.inflight()  # the stream is held by the engine: in flight, and shown so
        assert running.in_flight and running.model == "stable" and running.path == "/v1/chat/completions"
        local = response.extensions["network_stream"].get_extra_info("client_addr")
        assert running.client == f"{local[0]}:{local[1]}"
        engine.release()
        list(lines)
    assert request_log.inflight() == []
    (record,) = request_log.recent()
    assert record.seq == running.seq and events == [("started", record.seq), ("finished", record.seq)]
    assert record.status == 200 and record.engine == "fake" and record.streamed
    assert record.ttft_s is not None and record.ttft_s <= record.e2e_s
    assert (record.prompt_tokens, record.output_tokens) == (3, 2)
    assert record.request_body is None and record.response_body is None  # capture is off by default
    assert request_log.flush()
    (row,) = store.requests()
    assert RequestRecord.from_json(row) == record  # history keeps exactly what the log saw


def test_anthropic_messages_pass_through_metered(logged: tuple[ProxyServer, RequestLog],
                                                 engine: MessagesEngine) -> None:
    proxy, request_log = logged
    proxy.set_upstream(engine.upstream())
    headers = {"x-api-key": "unused", "anthropic-version": "2023-06-01"}
    body = {"model": "stable", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    plain = httpx.post(proxy.url + "/v1/messages", json=body, headers=headers, trust_env=False, timeout=30)
    assert plain.status_code == 200 and plain.json()["type"] == "message"
    assert plain.json()["model"] == "served"  # the stable name was rewritten to the engine's
    with httpx.stream("POST", proxy.url + "/v1/messages", json={**body, "stream": True}, headers=headers,
                      trust_env=False, timeout=30) as response:
        events = sse_events(response)
    assert [e["type"] for e in events][0] == "message_start" and events[-1]["type"] == "message_stop"
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == \
        "".join(f"t{i}" for i in range(8))
    plain_record, stream_record = request_log.recent()
    assert (plain_record.prompt_tokens, plain_record.output_tokens, plain_record.streamed) == (22, 8, False)
    assert (stream_record.prompt_tokens, stream_record.output_tokens, stream_record.streamed) == (22, 8, True)
    assert stream_record.ttft_s is not None and stream_record.path == "/v1/messages"


def test_engines_without_messages_get_a_clear_anthropic_style_501(
        logged: tuple[ProxyServer, RequestLog], engine: MessagesEngine) -> None:
    proxy, request_log = logged
    proxy.set_upstream(engine.upstream(messages_api=False))
    answer = httpx.post(proxy.url + "/v1/messages", trust_env=False, timeout=30,
                        json={"model": "stable", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]})
    assert answer.status_code == 501
    error = answer.json()
    assert error["type"] == "error" and "does not support the Anthropic Messages API" in error["error"]["message"]
    (record,) = request_log.recent()
    assert record.status == 501 and record.engine == "fake" and record.model == "stable"
    chat = httpx.post(proxy.url + "/v1/chat/completions", trust_env=False, timeout=30,
                      json={"model": "stable", "messages": [{"role": "user", "content": "x"}]})
    assert chat.status_code == 200  # the same engine still answers the OpenAI routes


def test_bodies_only_with_capture_on_and_never_with_an_api_key(
        logged: tuple[ProxyServer, RequestLog], engine: MessagesEngine) -> None:
    proxy, request_log = logged
    proxy.set_upstream(engine.upstream())
    proxy.set_capture_bodies(True)
    body = {"model": "stable", "max_tokens": 8, "messages": [{"role": "user", "content": "secret prompt"}]}
    httpx.post(proxy.url + "/v1/messages", json=body, trust_env=False, timeout=30)
    with httpx.stream("POST", proxy.url + "/v1/messages", json={**body, "stream": True}, trust_env=False,
                      timeout=30) as response:
        response.read()
    plain, streamed = request_log.recent()
    assert plain.request_body is not None and "secret prompt" in plain.request_body
    assert plain.response_body is not None and json.loads(plain.response_body)["content"][0]["text"] == "hello"
    assert streamed.response_body is not None and "message_stop" in streamed.response_body
    with pytest.raises(SwitchyardError, match="API key"):
        ProxyServer(port=find_free_port(), api_key="k", capture_bodies=True)
    keyed = ProxyServer(port=find_free_port(), api_key="k")
    with pytest.raises(SwitchyardError, match="API key"):
        keyed.set_capture_bodies(True)


def test_the_log_keeps_the_last_n_in_memory_and_prunes_history(store: Store) -> None:
    request_log = RequestLog(capacity=3, sink=store, history_keep=4)
    request_log.start()
    try:
        for seq in range(1, 7):
            request_log.finished(RequestRecord(float(seq), "POST", "/v1/completions", "u", 200, False, 0.1, 0.2, 1,
                                               seq=seq))
        assert [r.seq for r in request_log.recent()] == [4, 5, 6]
        assert [r.seq for r in request_log.recent(after=5)] == [6]
        assert [r.seq for r in request_log.recent(limit=2)] == [5, 6]
        assert request_log.flush()
    finally:
        request_log.stop()
    assert [row["seq"] for row in store.requests()] == [3, 4, 5, 6]


# --- the control channel and the CLI ----------------------------------------------------------------------------
@pytest.fixture
def discovered(logged: tuple[ProxyServer, RequestLog]) -> Iterator[tuple[ProxyServer, RequestLog, Path]]:
    """The logged endpoint, findable by `switchyard requests` as a running instance (this process)."""
    proxy, request_log = logged
    path = control.write_discovery(proxy.port, proxy.url, TOKEN)
    yield proxy, request_log, path
    control.remove_discovery(path)


def test_switchyard_requests_json_from_the_running_endpoint_then_from_history(
        discovered: tuple[ProxyServer, RequestLog, Path], engine: MessagesEngine,
        capsys: pytest.CaptureFixture[str]) -> None:
    from desktop.cli import main

    proxy, request_log, discovery = discovered
    proxy.set_upstream(engine.upstream())
    for stream in (False, True):
        with httpx.stream("POST", proxy.url + "/v1/messages", trust_env=False, timeout=30, json={
                "model": "stable", "max_tokens": 8, "stream": stream,
                "messages": [{"role": "user", "content": "Hi"}]}) as response:
            response.read()
    capsys.readouterr()
    assert main(["requests", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["source"] == "endpoint" and data["inflight"] == []
    assert [r["streamed"] for r in data["requests"]] == [False, True]
    for record in data["requests"]:
        # the fake answers at once: its TTFT may be under the loop clock's millisecond (0.0), never missing
        assert record["ttft_s"] >= 0 and record["output_tokens"] == 8 and record["prompt_tokens"] == 22
        assert record["model"] == "stable" and record["status"] == 200

    assert main(["requests"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["TIME", "#", "MODEL"] and len(table) == 3 and "/v1/messages" in table[2]

    # No endpoint runs: the history (the store the log wrote to) answers.
    assert request_log.flush()
    control.remove_discovery(discovery)
    assert main(["requests", "--json", "--limit", "1"]) == 0
    from_history = json.loads(capsys.readouterr().out)
    assert from_history["source"] == "history"
    assert [(r["seq"], r["ttft_s"] is not None, r["output_tokens"]) for r in from_history["requests"]] == \
        [(2, True, 8)]

    assert main(["requests", "--follow"]) != 0
    assert "--follow needs a running endpoint" in capsys.readouterr().err


def test_the_requests_route_long_polls_for_the_next_finished_request(
        discovered: tuple[ProxyServer, RequestLog, Path], engine: MessagesEngine) -> None:
    proxy, _request_log, _path = discovered
    discovery = control.find_instance(proxy.port)
    proxy.set_upstream(engine.upstream())
    client = control.ControlClient(discovery)
    assert client.requests()["requests"] == []
    answers: list[dict[str, Any]] = []
    poller = threading.Thread(target=lambda: answers.append(client.requests(after=0, wait=20)))
    poller.start()
    httpx.post(proxy.url + "/v1/chat/completions", trust_env=False, timeout=30,
               json={"model": "stable", "messages": [{"role": "user", "content": "x"}]})
    poller.join(30)
    assert [r["path"] for r in answers[0]["requests"]] == ["/v1/chat/completions"]
    denied = httpx.get(proxy.url + "/switchyard/requests", trust_env=False)
    assert denied.status_code == 403


def test_follow_prints_each_request_once_as_it_finishes_until_the_endpoint_stops(
        capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from desktop.commands.requests import _follow

    def record(seq: int) -> dict[str, Any]:
        return RequestRecord(float(seq), "POST", "/v1/messages", "u", 200, True, 0.1, 0.5, 8, prompt_tokens=3,
                             seq=seq).to_json()

    class Client:  # the control client: one long poll answers seq 3, the next finds the endpoint gone
        def __init__(self) -> None:
            self.afters: list[int] = []

        def requests(self, limit: int, after: int, wait: float) -> dict[str, Any]:
            self.afters.append(after)
            if len(self.afters) == 1:
                return {"requests": [record(3)], "inflight": []}
            raise SwitchyardError("could not reach the endpoint")

    client = Client()
    assert _follow(argparse.Namespace(json=True), client, {"requests": [record(1), record(2)]}) == 0
    printed = [json.loads(line)["seq"] for line in capsys.readouterr().out.splitlines()]
    assert printed == [1, 2, 3] and client.afters == [2, 3]


@pytest.mark.engine
@pytest.mark.vllm
def test_anthropic_messages_through_the_endpoint_to_vllm(proxy_for_vllm: Any) -> None:
    proxy, request_log = proxy_for_vllm
    body = {"model": "stable", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]}
    plain = httpx.post(proxy.url + "/v1/messages", json=body, trust_env=False, timeout=120)
    assert plain.status_code == 200 and plain.json()["usage"]["output_tokens"] == 8, plain.text
    with httpx.stream("POST", proxy.url + "/v1/messages", json={**body, "stream": True}, trust_env=False,
                      timeout=120) as response:
        events = sse_events(response)
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    for record in request_log.recent():
        assert record.status == 200 and record.engine == "vllm" and record.output_tokens == 8
        assert record.prompt_tokens == plain.json()["usage"]["input_tokens"] and record.ttft_s is not None


@pytest.fixture
def proxy_for_vllm(vllm_server: Any) -> Iterator[tuple[ProxyServer, RequestLog]]:
    from desktop.core.engines import get_adapter

    proxy = ProxyServer(port=find_free_port(), model_name="stable", wait_timeout=60)
    request_log = RequestLog()
    request_log.attach(proxy)
    proxy.start()
    proxy.set_upstream(Upstream("vllm@real", "vllm", vllm_server.base_url, vllm_server.plan.served_model_name,
                                messages_api=get_adapter("vllm").anthropic_messages))
    yield proxy, request_log
    proxy.stop()


# --- the real llama-server behind the endpoint ------------------------------------------------------------------
@pytest.mark.engine
@pytest.mark.llamacpp
def test_anthropic_client_through_the_endpoint_to_llama_server_and_switchyard_requests(
        llama_install: Any, demo_model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from desktop.cli import main
    from desktop.core.planning.planner import ask
    from desktop.core.serving.endpoint import EndpointManager

    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    proxy = ProxyServer(port=find_free_port(), model_name="stable", wait_timeout=120)
    with Store() as history:
        request_log = RequestLog(sink=history)
        request_log.attach(proxy)
        token = control.new_token()
        proxy.add_routes(control.request_routes(request_log, token))
        manager = EndpointManager(proxy)
        proxy.start()
        discovery = control.write_discovery(proxy.port, proxy.url, token)
        try:
            manager.start(ask("llama.cpp", "demo", {"ctx_per_request": 2048, "slots": 2}))
            headers = {"x-api-key": "none", "anthropic-version": "2023-06-01"}
            body = {"model": "stable", "max_tokens": 8, "temperature": 0,
                    "messages": [{"role": "user", "content": "Hello"}]}
            plain = httpx.post(proxy.url + "/v1/messages", json=body, headers=headers, trust_env=False, timeout=120)
            assert plain.status_code == 200, plain.text
            message = plain.json()
            assert message["type"] == "message" and message["content"][0]["type"] == "text"
            assert message["usage"]["output_tokens"] == 8
            with httpx.stream("POST", proxy.url + "/v1/messages", json={**body, "stream": True}, headers=headers,
                              trust_env=False, timeout=120) as response:
                assert response.status_code == 200
                events = sse_events(response)
            kinds = [e["type"] for e in events]
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
            streamed_text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
            assert streamed_text == message["content"][0]["text"]  # greedy: the same answer either way

            capsys.readouterr()
            assert main(["requests", "--json"]) == 0
            listed = json.loads(capsys.readouterr().out)["requests"]
            assert [r["path"] for r in listed] == ["/v1/messages", "/v1/messages"]
            for record in listed:
                assert record["status"] == 200 and record["engine"] == "llama.cpp" and record["model"] == "stable"
                assert record["ttft_s"] > 0 and record["output_tokens"] == 8
                assert record["prompt_tokens"] == message["usage"]["input_tokens"] > 0
            assert request_log.flush()
            assert [r["path"] for r in history.requests()] == ["/v1/messages", "/v1/messages"]
        finally:
            control.remove_discovery(discovery)
            manager.close()
            proxy.stop()
            request_log.stop()


# --- the CLI end to end: `switchyard serve --endpoint` in its own process, `switchyard requests` from another ------
def _cli(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "desktop", *args], capture_output=True, text=True,  # noqa: S603
                          timeout=timeout, env={**os.environ, "SWITCHYARD_HOME": str(home)})


def test_capture_is_refused_for_an_endpoint_with_an_api_key(tmp_path: Path) -> None:
    result = subprocess.run(  # noqa: S603 - our own CLI
        [sys.executable, "-m", "desktop", "serve", "--engine", "llama.cpp", "--model", "demo", "--proxy-port",
         str(find_free_port()), "--api-key-env", "SWITCHYARD_TEST_KEY", "--capture-bodies"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "SWITCHYARD_HOME": str(tmp_path), "SWITCHYARD_TEST_KEY": "k"})
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.startswith("switchyard: error: --capture-bodies is not available on an endpoint with an "
                                    "API key")


@pytest.mark.engine
@pytest.mark.llamacpp
def test_cli_serve_then_switchyard_requests_live_and_from_history(llama_install: Any, demo_model: Any,
                                                                  tmp_path: Path) -> None:
    home, port = tmp_path / "home", find_free_port()
    proc, ready = serve_until_ready("--engine", "llama.cpp", "--model", "demo", "--proxy-port", str(port),
                                    "--parallel", "2", "--capture-bodies",
                                    env={**os.environ, "SWITCHYARD_HOME": str(home)})
    try:
        assert ready.startswith(f"ready: http://127.0.0.1:{port}/v1"), ready
        url = f"http://127.0.0.1:{port}"
        body = {"model": "switchyard", "max_tokens": 8, "messages": [{"role": "user", "content": "captured prompt"}]}
        assert httpx.post(url + "/v1/messages", json=body, trust_env=False, timeout=120).status_code == 200
        with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}, trust_env=False,
                          timeout=120) as response:
            assert response.status_code == 200
            response.read()
        chat = httpx.post(url + "/v1/chat/completions", json=body, trust_env=False, timeout=120)
        assert chat.status_code == 200

        live = _cli(home, "requests", "--json", "--port", str(port))
        assert live.returncode == 0, live.stderr
        data = json.loads(live.stdout)
        assert data["source"] == "endpoint" and data["capture_bodies"] is True
        listed = data["requests"]
        assert [r["path"] for r in listed] == ["/v1/messages", "/v1/messages", "/v1/chat/completions"]
        for record in listed:
            assert record["ttft_s"] > 0 and record["output_tokens"] == 8 and record["prompt_tokens"] > 0
            assert record["engine"] == "llama.cpp" and record["client"].startswith("127.0.0.1:")
            assert "captured prompt" in record["request_body"]
        table = _cli(home, "requests", "--port", str(port)).stdout.splitlines()
        assert len(table) == 4 and all("llama.cpp" in line for line in table[1:])

        assert _cli(home, "stop", "--port", str(port)).returncode == 0
        assert proc.wait(30) == 0
        stored = _cli(home, "requests", "--json")  # nothing runs now: the history answers, the same requests
        assert stored.returncode == 0, stored.stderr
        from_history = json.loads(stored.stdout)
        assert from_history["source"] == "history"
        assert [(r["seq"], r["output_tokens"], r["ttft_s"]) for r in from_history["requests"]] == \
            [(r["seq"], r["output_tokens"], r["ttft_s"]) for r in listed]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_bad_limit_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    from desktop.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["requests", "--limit", "0"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "argument -n/--limit: must be at least 1" in err
