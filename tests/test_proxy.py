"""The stable endpoint's reverse proxy against real HTTP servers on loopback: a scriptable fake engine for the
edge cases (held streams, mid-stream deaths, refused connections) and the real llama-server for passthrough."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from aiohttp import web

from desktop.core.common.errors import PortBusy
from desktop.core.runtime.ports import find_free_port
from desktop.core.serving.metering import RequestRecord, StreamMeter
from desktop.core.serving.proxy import ProxyServer, Upstream


class FakeEngine:
    """An OpenAI-ish streaming server in its own thread. `hold` pauses every stream after its first chunk until
    `release()`; `die_midstream` drops the connection after the first chunk; bodies and headers are recorded."""

    def __init__(self, name: str = "fake", chunks: int = 5, served_name: str = "fake-model") -> None:
        self.name = name
        self.chunks = chunks
        self.served_name = served_name
        self.hold = False
        self.die_midstream = False
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.first_chunk_sent = threading.Event()
        self.cancelled = threading.Event()  # a stream ended because its client went away
        self.peers: set[tuple[str, int]] = set()  # the connections requests came on
        self._gate: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self.port = find_free_port()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        assert started.wait(10)

    @property
    def upstream(self) -> Upstream:
        return Upstream(name=f"{self.name}@{self.port}", engine=self.name, base_url=f"http://127.0.0.1:{self.port}",
                        served_model_name=self.served_name, api_key="engine-secret", model="/models/fake")

    def _run(self, started: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop

        async def setup() -> None:
            self._gate = asyncio.Event()
            app = web.Application()
            app.router.add_post("/v1/completions", self._completions)
            app.router.add_get("/health", self._health)
            self._runner = web.AppRunner(app, handler_cancellation=True)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

        loop.run_until_complete(setup())
        started.set()
        loop.run_forever()
        assert self._runner is not None
        loop.run_until_complete(self._runner.cleanup())
        loop.close()

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        assert request.transport is not None
        self.peers.add(request.transport.get_extra_info("peername"))
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "abc", "index": 0}],
                                      "usage": {"completion_tokens": 3}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(self.chunks):
            chunk = {"choices": [{"text": f"t{index} ", "index": 0, "finish_reason": None}], "served_by": self.name}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if index == 0:
                self.first_chunk_sent.set()
                if self.die_midstream:
                    assert request.transport is not None
                    request.transport.abort()
                    return response
                if self.hold:
                    assert self._gate is not None
                    try:
                        await self._gate.wait()
                    except asyncio.CancelledError:
                        self.cancelled.set()
                        raise
        usage = {"choices": [], "usage": {"completion_tokens": self.chunks, "prompt_tokens": 2}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
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
def engine_a() -> Iterator[FakeEngine]:
    engine = FakeEngine("a")
    yield engine
    engine.close()


@pytest.fixture
def engine_b() -> Iterator[FakeEngine]:
    engine = FakeEngine("b")
    yield engine
    engine.close()


@pytest.fixture
def proxy() -> Iterator[ProxyServer]:
    server = ProxyServer(port=find_free_port(), model_name="stable", wait_timeout=30)
    server.start()
    yield server
    server.stop()


def records_of(server: ProxyServer) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    server.subscribe(records.append)
    return records


def completion_body(stream: bool = True) -> dict[str, Any]:
    return {"model": "stable", "prompt": "hi", "max_tokens": 5, "stream": stream}


def stream_texts(url: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
                 timeout: float = 30) -> tuple[int, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", url + "/v1/completions", json=body or completion_body(), headers=headers,
                      timeout=timeout, trust_env=False) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
        return response.status_code, events


def test_streams_chunk_by_chunk_without_buffering(proxy: ProxyServer, engine_a: FakeEngine) -> None:
    engine_a.hold = True  # the engine sends one chunk, then waits: a buffering proxy would deliver nothing
    proxy.set_upstream(engine_a.upstream)
    with httpx.stream("POST", proxy.url + "/v1/completions", json=completion_body(), timeout=10,
                      trust_env=False) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] == "t0 "
        assert proxy.inflight(engine_a.upstream.name) == 1
        engine_a.release()
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert len(rest) == engine_a.chunks + 1  # the 4 other token chunks + usage + [DONE]


def test_models_and_request_model_name_are_stable(proxy: ProxyServer, engine_a: FakeEngine) -> None:
    proxy.set_upstream(engine_a.upstream)
    models = httpx.get(proxy.url + "/v1/models", trust_env=False).json()
    assert [m["id"] for m in models["data"]] == ["stable"]
    assert models["data"][0]["switchyard"]["engine"] == "a"
    status, events = stream_texts(proxy.url)
    assert status == 200 and events
    assert engine_a.bodies[-1]["model"] == "fake-model"  # rewritten to what the engine serves
    assert engine_a.headers[-1]["Authorization"] == "Bearer engine-secret"


def test_api_key_is_checked_and_never_forwarded(engine_a: FakeEngine) -> None:
    server = ProxyServer(port=find_free_port(), api_key="client-key")
    server.start()
    try:
        server.set_upstream(engine_a.upstream)
        denied = httpx.post(server.url + "/v1/completions", json=completion_body(False), trust_env=False)
        assert denied.status_code == 401
        assert "API key" in denied.json()["error"]["message"]
        wrong = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer nope"}, trust_env=False)
        assert wrong.status_code == 401
        ok = httpx.post(server.url + "/v1/completions", json=completion_body(False),
                        headers={"Authorization": "Bearer client-key"}, trust_env=False)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert engine_a.headers[-1]["Authorization"] == "Bearer engine-secret"
        assert not engine_a.bodies or all("client-key" not in json.dumps(h) for h in engine_a.headers)
    finally:
        server.stop()


def test_requests_wait_for_an_engine_then_flow(proxy: ProxyServer, engine_a: FakeEngine) -> None:
    records = records_of(proxy)
    result: dict[str, Any] = {}
    waiting = threading.Thread(target=lambda: result.update(answer=stream_texts(proxy.url)))
    waiting.start()
    # The request is parked in the proxy (counted as waiting) until an engine is set.
    deadline = 100
    while proxy.counters["waited"] == 0 and deadline:
        deadline -= 1
        threading.Event().wait(0.05)
    assert proxy.counters["waited"] == 1
    proxy.set_upstream(engine_a.upstream)
    waiting.join(10)
    status, events = result["answer"]
    assert status == 200 and len(events) == engine_a.chunks + 1  # tokens + usage
    assert records[-1].error is None and records[-1].output_tokens == engine_a.chunks
    assert records[-1].ttft_s is not None and records[-1].ttft_s > 0


def test_waiting_is_bounded_and_down_fails_fast_with_the_reason() -> None:
    server = ProxyServer(port=find_free_port(), wait_timeout=0.3)
    server.start()
    try:
        timed_out = httpx.post(server.url + "/v1/completions", json=completion_body(False), trust_env=False)
        assert timed_out.status_code == 503
        assert "no engine became ready" in timed_out.json()["error"]["message"]
        server.wait_timeout = 600
        server.set_upstream(None, down_reason="llama.cpp failed: the model file is not a valid GGUF file")
        down = httpx.post(server.url + "/v1/completions", json=completion_body(False), trust_env=False, timeout=5)
        assert down.status_code == 503
        assert "not a valid GGUF" in down.json()["error"]["message"]
        assert httpx.get(server.url + "/health", trust_env=False).status_code == 503
        assert server.counters["failed"] == 2
    finally:
        server.stop()


def test_switch_moves_new_requests_and_drains_old(proxy: ProxyServer, engine_a: FakeEngine,
                                                  engine_b: FakeEngine) -> None:
    engine_a.hold = True
    proxy.set_upstream(engine_a.upstream)
    held: dict[str, Any] = {}
    old_request = threading.Thread(target=lambda: held.update(answer=stream_texts(proxy.url)))
    old_request.start()
    assert engine_a.first_chunk_sent.wait(10)
    proxy.set_upstream(engine_b.upstream)
    status, events = stream_texts(proxy.url)
    assert status == 200 and {e.get("served_by") for e in events if e.get("choices")} == {"b"}
    assert proxy.drain(engine_a.upstream, timeout=0.2) is False  # still streaming on the old engine
    engine_a.release()
    assert proxy.drain(engine_a.upstream, timeout=10) is True
    old_request.join(10)
    old_status, old_events = held["answer"]
    assert old_status == 200 and len(old_events) == engine_a.chunks + 1
    assert {e.get("served_by") for e in old_events if e.get("choices")} == {"a"}
    assert proxy.counters["failed"] == 0


def test_engine_dying_mid_stream_ends_the_stream_with_a_clear_error(proxy: ProxyServer,
                                                                    engine_a: FakeEngine) -> None:
    records = records_of(proxy)
    engine_a.die_midstream = True
    proxy.set_upstream(engine_a.upstream)
    status, events = stream_texts(proxy.url)
    assert status == 200
    assert events[0]["choices"][0]["text"] == "t0 "
    assert "stopped mid-response" in events[-1]["error"]["message"]
    assert records[-1].error and "stopped mid-response" in records[-1].error
    assert proxy.counters["failed"] == 1


class _LogSeen(logging.Handler):
    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle = needle
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.seen.set()


def test_refused_connection_is_retried_on_the_next_engine(proxy: ProxyServer, engine_b: FakeEngine) -> None:
    dead = Upstream("dead@1", "dead", f"http://127.0.0.1:{find_free_port()}", "x")
    watcher = _LogSeen("refused a request")
    logger = logging.getLogger("switchyard.proxy")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(watcher)
    try:
        proxy.set_upstream(dead)
        result: dict[str, Any] = {}
        request = threading.Thread(target=lambda: result.update(answer=stream_texts(proxy.url)))
        request.start()
        assert watcher.seen.wait(10)  # it tried the dead engine and now waits for another
        proxy.set_upstream(engine_b.upstream)
        request.join(10)
    finally:
        logger.removeHandler(watcher)
        logger.setLevel(level)
    status, events = result["answer"]
    assert status == 200 and {e.get("served_by") for e in events if e.get("choices")} == {"b"}
    assert proxy.counters["failed"] == 0


def test_busy_port_is_a_clear_error() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        server = ProxyServer(port=port)
        with pytest.raises(PortBusy, match=f"cannot listen on 127.0.0.1:{port}"):
            server.start()


def test_stream_meter_counts_usage_and_first_token() -> None:
    meter = StreamMeter(started=0.0)
    meter.feed(b'data: {"choices":[{"text":""}]}\n\ndata: {"choices":[{"te', 1.0)
    assert meter.first_token_at is None
    meter.feed(b'xt":"hi"}]}\n\n', 2.0)
    meter.feed(b'data: {"choices":[],"usage":{"completion_tokens":7}}\n\ndata: [DONE]\n\n', 3.0)
    meter.finish(3.0)
    assert meter.first_token_at == 2.0
    assert meter.output_tokens == 7


def test_stream_meter_falls_back_to_counting_and_sees_a_late_error() -> None:
    meter = StreamMeter(started=0.0)
    meter.feed(b'data: {"choices":[{"text":"a"}]}\n\n', 1.0)
    for _ in range(500):  # far more than the tail keeps
        meter.feed(b'data: {"choices":[{"text":"b"}]}\n\n', 2.0)
    meter.feed(b'data: {"error":{"message":"engine died"}}\n\ndata: [DONE]\n\n', 3.0)
    meter.finish(3.0)
    assert meter.output_tokens == 502  # 501 token chunks + the error event, no usage to go by
    assert meter.error == "engine died"


@pytest.mark.engine
@pytest.mark.llamacpp
def test_real_llama_server_through_the_proxy(proxy: ProxyServer, llama_server: Any) -> None:
    records = records_of(proxy)
    proxy.set_upstream(Upstream("llama.cpp@real", "llama.cpp", llama_server.base_url,
                                llama_server.plan.served_model_name, model=str(llama_server.plan.model_path)))
    body = {"model": "stable", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    status, events = stream_texts(proxy.url, body)
    direct_status, direct = stream_texts(llama_server.base_url, {**body, "model": "switchyard"})
    assert status == direct_status == 200

    def text(evts: list[dict[str, Any]]) -> str:
        return "".join(c.get("text", "") for e in evts for c in e.get("choices", []))

    assert text(events) == text(direct) and text(events)
    assert records[-1].output_tokens == 8 and records[-1].ttft_s is not None
    chat = httpx.post(proxy.url + "/v1/chat/completions", trust_env=False, timeout=60, json={
        "model": "anything", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]


# --- HTTP/1.1 on the wire: what clients other than httpx send ---------------------------------------------------
def raw_http(port: int, payload: bytes, timeout: float = 10) -> bytes:
    """Send raw bytes and read until the endpoint closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(payload)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def http_request(path: str, body: bytes = b"", *, close: bool = False, extra: str = "",
                 method: str = "POST") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    if body or method == "POST":
        head += f"Content-Length: {len(body)}\r\n"
    if close:
        head += "Connection: close\r\n"
    return (head + extra + "\r\n").encode() + body


def test_keep_alive_serves_a_client_session_on_one_connection(proxy: ProxyServer, engine_a: FakeEngine) -> None:
    """The OpenAI SDK's pattern: list models, then several requests, all on one pooled connection."""
    proxy.set_upstream(engine_a.upstream)
    ports: set[int] = set()
    with httpx.Client(base_url=proxy.url, trust_env=False, timeout=10) as client:
        for index in range(6):
            if index == 0:
                response = client.get("/v1/models")
            else:
                response = client.post("/v1/completions", json=completion_body(stream=index % 2 == 0))
            assert response.status_code == 200
            stream = response.extensions["network_stream"]
            ports.add(stream.get_extra_info("socket").getsockname()[1])
    assert len(ports) == 1  # one client connection carried them all
    assert len(engine_a.bodies) == 5 and proxy.counters["failed"] == 0
    assert len(engine_a.peers) == 1  # and one kept-alive connection to the engine


def test_pipelined_requests_are_answered_in_order(proxy: ProxyServer, engine_a: FakeEngine) -> None:
    proxy.set_upstream(engine_a.upstream)
    first = json.dumps({**completion_body(False), "prompt": "one"}).encode()
    second = json.dumps({**completion_body(True), "prompt": "two"}).encode()
    answer = raw_http(proxy.port, http_request("/v1/completions", first)
                      + http_request("/v1/completions", second, close=True))
    assert answer.count(b"HTTP/1.1 200") == 2
    assert answer.index(b'"abc"') < answer.index(b"t0 ")  # the JSON answer first, then the stream
    assert answer.rstrip().endswith(b"0")  # the chunked stream ended properly
    assert [b["prompt"] for b in engine_a.bodies] == ["one", "two"]


def test_chunked_request_body_and_expect_continue(proxy: ProxyServer, engine_a: FakeEngine) -> None:
    """curl sends `Expect: 100-continue` for larger bodies; some clients send bodies chunked."""
    proxy.set_upstream(engine_a.upstream)
    body = json.dumps(completion_body(False)).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n")
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(head)
        assert sock.recv(1024).startswith(b"HTTP/1.1 100 Continue")
        half = len(body) // 2
        sock.sendall(b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, body[:half], len(body) - half, body[half:]))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["usage"]["completion_tokens"] == 3
    assert engine_a.bodies[-1]["model"] == "fake-model"
    assert "Expect" not in engine_a.headers[-1]  # answered here, not forwarded


def test_http10_client_gets_a_close_delimited_stream(proxy: ProxyServer, engine_a: FakeEngine) -> None:
    proxy.set_upstream(engine_a.upstream)
    body = json.dumps(completion_body(True)).encode()
    answer = raw_http(proxy.port, b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" not in head.lower()
    events = [line for line in payload.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]" and len(events) == engine_a.chunks + 2


@pytest.mark.parametrize(("payload", "status", "message"), [
    (b"this is not HTTP\r\n\r\n", 400, "malformed HTTP request"),
    (b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431, "headers over"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2000\r\n\r\n" + b"x" * 2000, 413,
     "request body over"),
])
def test_unreadable_requests_get_a_clear_error_and_a_closed_connection(
        proxy: ProxyServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, payload: bytes,
        status: int, message: str) -> None:
    import desktop.core.serving.http1 as http1

    monkeypatch.setattr(http1, "MAX_BODY_BYTES", 1024)
    answer = raw_http(proxy.port, payload)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d" % status) and b"Connection: close" in head
    assert message in json.loads(body)["error"]["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # a bad client is not our error


def test_client_hanging_up_mid_stream_aborts_the_engine_request(proxy: ProxyServer, engine_a: FakeEngine) -> None:
    records = records_of(proxy)
    engine_a.hold = True
    proxy.set_upstream(engine_a.upstream)
    body = json.dumps(completion_body(True)).encode()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(http_request("/v1/completions", body))
        received = b""
        while b"t0 " not in received:  # the first token arrived; then hang up mid-stream
            chunk = sock.recv(65536)
            assert chunk, "the endpoint closed before the first token"
            received += chunk
    # The endpoint notices the hang-up, closes its engine connection and counts the request off.
    assert proxy.drain(engine_a.upstream, timeout=10)
    assert engine_a.cancelled.wait(10)  # the engine saw its client (the proxy) go away
    assert records[-1].status == 499 and proxy.counters["failed"] == 0
    engine_a.release()


class ClosingEngine:
    """Answers the first request on each connection (keeping it alive), then closes any later request's
    connection without answering: the race with an engine closing an idle kept-alive connection."""

    def __init__(self) -> None:
        self.answered = 0
        self.dropped = 0
        self.connections = 0
        self.port = find_free_port()
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        assert started.wait(10)

    def _run(self, started: threading.Event) -> None:
        engine = self

        class Answer(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.transport = transport
                self.buffer = b""
                self.served = False
                engine.connections += 1

            def data_received(self, data: bytes) -> None:
                self.buffer += data
                if b"\r\n\r\n" not in self.buffer:
                    return
                if self.served:
                    engine.dropped += 1
                    self.transport.close()
                    return
                self.served = True
                self.buffer = b""
                engine.answered += 1
                body = b'{"choices":[{"text":"ok","index":0}],"usage":{"completion_tokens":1}}'
                assert isinstance(self.transport, asyncio.WriteTransport)
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

        server = self._loop.run_until_complete(self._loop.create_server(Answer, "127.0.0.1", self.port))
        started.set()
        self._loop.run_forever()
        server.close()
        self._loop.run_until_complete(server.wait_closed())
        self._loop.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_a_kept_alive_connection_closed_by_the_engine_is_retried_unseen_when_idempotent() -> None:
    engine = ClosingEngine()
    proxy = ProxyServer(port=find_free_port(), model_name="stable", wait_timeout=30, extra_routes=["/props"])
    proxy.start()  # a GET reaches an engine only on a path the model opted in
    try:
        proxy.set_upstream(Upstream("closing@1", "closing", f"http://127.0.0.1:{engine.port}", "m"))
        for _ in range(3):
            response = httpx.get(proxy.url + "/props", trust_env=False, timeout=10)
            assert response.status_code == 200 and response.json()["choices"][0]["text"] == "ok"
        # Requests 2 and 3 went first to the kept-alive connection, which the engine closed unanswered.
        assert engine.answered == 3 and engine.dropped == 2 and engine.connections == 3
        assert proxy.counters["failed"] == 0
    finally:
        proxy.stop()
        engine.close()


def test_a_post_the_engine_may_have_read_is_not_retried(proxy: ProxyServer) -> None:
    """A generation must not run twice: a POST written in full and then dropped unanswered gets a 502."""
    engine = ClosingEngine()
    try:
        proxy.set_upstream(Upstream("closing@1", "closing", f"http://127.0.0.1:{engine.port}", "m"))
        first = httpx.post(proxy.url + "/v1/completions", json=completion_body(False), trust_env=False, timeout=10)
        assert first.status_code == 200
        second = httpx.post(proxy.url + "/v1/completions", json=completion_body(False), trust_env=False, timeout=10)
        assert second.status_code == 502
        assert "not retried" in second.json()["error"]["message"]
        assert engine.dropped == 1 and engine.answered == 1  # sent once, never again
    finally:
        engine.close()


def test_an_upstream_it_cannot_reach_is_refused_when_set(proxy: ProxyServer) -> None:
    from desktop.core.common.errors import SwitchyardError

    with pytest.raises(SwitchyardError, match="over http://"):
        proxy.set_upstream(Upstream("remote", "vllm", "https://example.invalid", "m"))
    assert proxy.active is None


def test_a_malformed_engine_answer_becomes_a_502(proxy: ProxyServer) -> None:
    """An engine that answers garbage: the client gets a clear 502 instead of a dropped connection."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        def answer_garbage() -> None:
            connection, _ = server.accept()
            with connection:
                connection.recv(65536)
                connection.sendall(b"this is not an HTTP response\r\n\r\n")

        garbage = threading.Thread(target=answer_garbage, daemon=True)
        garbage.start()
        records = records_of(proxy)
        proxy.set_upstream(Upstream("garbage@1", "garbage", f"http://127.0.0.1:{port}", "m"))
        response = httpx.post(proxy.url + "/v1/completions", json=completion_body(False), trust_env=False,
                              timeout=10)
        garbage.join(10)
    assert response.status_code == 502
    assert "malformed response" in response.json()["error"]["message"]
    assert records[-1].status == 502 and proxy.counters["failed"] == 1


class _LogCount(logging.Handler):
    """Sets `reached` once lines with one of `needles` have been logged `times` times."""

    def __init__(self, needles: tuple[str, ...], times: int) -> None:
        super().__init__(logging.DEBUG)
        self.needles, self.times, self.count = needles, times, 0
        self.reached = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if any(needle in record.getMessage() for needle in self.needles):
            self.count += 1
            if self.count >= self.times:
                self.reached.set()


def test_a_burst_that_fills_an_engines_unix_listen_queue_waits_for_room_and_no_request_fails(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Linux answers a connect to a Unix socket whose listen queue is full with EAGAIN at once, and the engines'
    queues are short (cpp-httplib: 4 per core; Python's socketserver: 5). A burst of new requests while the engine
    is slow to accept is back-pressure: each waits for room, none is refused, none waits for another engine."""
    folder = tmp_path_factory.mktemp("q")
    path = str(folder / "e.sock")
    if len(path) > 100:
        path = f"/tmp/switchyard-q-{find_free_port()}.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    fillers: list[socket.socket] = []
    while True:  # fill the queue with connections nobody accepts yet
        filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        filler.setblocking(False)
        try:
            filler.connect(path)
        except BlockingIOError:
            filler.close()
            break
        fillers.append(filler)
    burst = 6
    # a connect that met the full queue: waiting for room (or, were EAGAIN taken for a refusal, "refused")
    watcher = _LogCount(("listen queue", "Resource temporarily unavailable"), burst)
    logger = logging.getLogger("switchyard.proxy")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(watcher)
    server = ProxyServer(port=find_free_port(), model_name="stable", wait_timeout=30, retry_window=1)
    server.start()
    answers: list[int] = []

    def ask() -> None:
        response = httpx.post(server.url + "/v1/completions", json=completion_body(False), trust_env=False,
                              timeout=30)
        answers.append(response.status_code)

    def serve(count: int) -> None:
        for filler in fillers:
            listener.accept()[0].close()
            filler.close()
        for _ in range(count):
            connection, _ = listener.accept()
            with connection:
                head = b""
                while b"\r\n\r\n" not in head:
                    head += connection.recv(65536)
                body = json.dumps({"id": "x", "object": "text_completion", "model": "m",
                                   "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}).encode()
                connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    try:
        server.set_upstream(Upstream("queue@1", "queue", "http+unix://" + quote(path, safe=""), "m"))
        clients = [threading.Thread(target=ask) for _ in range(burst)]
        for client in clients:
            client.start()
        assert watcher.reached.wait(20), f"{watcher.count} connects met a full queue"  # each of the burst
        engine = threading.Thread(target=serve, args=(burst,), daemon=True)
        engine.start()  # now the engine accepts: room frees up
        for client in clients:
            client.join(30)
        engine.join(10)
    finally:
        logger.removeHandler(watcher)
        logger.setLevel(level)
        server.stop()
        listener.close()
    assert answers == [200] * burst
    assert server.counters["failed"] == 0
