"""The endpoint, read as an attacker would: foreign Host/Origin refused (DNS rebinding, web pages), CORS only for
allowed origins, the API key checked from the head, engines behind a per-launch key, timeouts toward a hung
engine, read-ahead caps with backpressure, retries only for what the engine never got. Real sockets throughout;
engine stand-ins are small raw servers (they do exactly one odd thing each)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from desktop.core.common.errors import SwitchyardError
from desktop.core.common.origins import is_local_origin, is_loopback_host, parse_allowed_origins
from desktop.core.runtime.ports import find_free_port
from desktop.core.serving import control
from desktop.core.serving.http1 import Limits
from desktop.core.serving.proxy import ProxyServer, Upstream
from desktop.core.serving.upstream import Timeouts
from desktop.core.storage import settings as core_settings

JSON_ANSWER = b'{"choices":[{"text":"ok","index":0}],"usage":{"completion_tokens":1}}'


# --- helpers ----------------------------------------------------------------------------------------------------
def read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """Read up to the end of a response head: (head, bytes after it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def read_response(sock: socket.socket, buffered: bytes = b"") -> tuple[int, dict[str, str], bytes, bytes]:
    """One Content-Length response: (status, headers, body, bytes after it)."""
    data = buffered
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-head: {data[:200]!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    return status, headers, rest[:length], rest[length:]


def request_bytes(method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1"]
    merged = {"Host": "127.0.0.1", **(headers or {})}
    if body or method == "POST":
        merged["Content-Length"] = str(len(body))
    lines += [f"{k}: {v}" for k, v in merged.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def one_request(port: int, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b""
                ) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(request_bytes(method, path, headers, body))
        status, head, payload, _ = read_response(sock)
    return status, head, payload


def connections_of(proxy: ProxyServer) -> list[Any]:
    """The endpoint's client connections, read from another thread (the set may change meanwhile)."""
    while True:
        try:
            return list(proxy.connections)
        except RuntimeError:
            continue


def eventually(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Wait for a state the endpoint reaches on its own thread (polled; bounded)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.01)


class RawEngine:
    """A stand-in engine on a raw listening socket: `serve(conn, index)` runs in a thread per connection."""

    def __init__(self, serve: Callable[[socket.socket, int], None]) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.serve = serve
        self.accepted = 0
        self.threads: list[threading.Thread] = []
        self._closing = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def upstream(self) -> Upstream:
        return Upstream(f"raw@{self.port}", "raw", f"http://127.0.0.1:{self.port}", "m")

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            index = self.accepted
            self.accepted += 1
            thread = threading.Thread(target=self._run, args=(conn, index), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _run(self, conn: socket.socket, index: int) -> None:
        with conn:
            try:
                self.serve(conn, index)
            except OSError:
                pass

    def close(self) -> None:
        self._closing = True
        self.listener.close()


def read_request(conn: socket.socket, buffered: bytes = b"", sink: bool = False) -> tuple[bytes, bytes, bytes]:
    """One request from a raw engine connection: (head, body, leftover). `sink` drops the body as it comes."""
    data = buffered
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(1 << 20)
        if not chunk:
            raise OSError("closed")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if sink:
        got = min(len(rest), length)
        rest = rest[got:]
        buffer = bytearray(1 << 20)
        while got < length:
            n = conn.recv_into(buffer, min(len(buffer), length - got))
            if not n:
                raise OSError("closed")
            got += n
        return head, b"", rest
    while len(rest) < length:
        chunk = conn.recv(1 << 20)
        if not chunk:
            raise OSError("closed")
        rest += chunk
    return head, rest[:length], rest[length:]


def answer_json(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(JSON_ANSWER), JSON_ANSWER))


@pytest.fixture
def make_proxy() -> Iterator[Callable[..., ProxyServer]]:
    started: list[ProxyServer] = []

    def make(**kwargs: Any) -> ProxyServer:
        server = ProxyServer(port=find_free_port(), model_name="stable", **kwargs)
        server.start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def json_engine() -> Iterator[RawEngine]:
    def serve(conn: socket.socket, _index: int) -> None:
        leftover = b""
        while True:
            _head, _body, leftover = read_request(conn, leftover)
            answer_json(conn)

    engine = RawEngine(serve)
    yield engine
    engine.close()


# --- Host and Origin --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["localhost", "localhost:8800", "127.0.0.1", "127.0.0.1:8800", "127.1.2.3:1",
                                  "[::1]", "[::1]:8800", "app.localhost:3000"])
def test_loopback_hosts_are_local(host: str) -> None:
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8800", "localhost.evil.example", "10.0.0.1",
                                  "[::2]:80", "127.0.0.1:port", "", "[::1"])
def test_other_hosts_are_not(host: str) -> None:
    assert not is_loopback_host(host)


@pytest.mark.parametrize(("origin", "local"), [
    ("http://localhost:3000", True), ("https://127.0.0.1", True), ("http://[::1]:8080", True),
    ("http://evil.example", False), ("null", False), ("http://localhost.evil.example", False),
    ("file://", False), ("http://localhost:3000/path", False)])
def test_local_origins(origin: str, local: bool) -> None:
    assert is_local_origin(origin) is local


def test_allowed_origins_are_normalized_and_bad_ones_named() -> None:
    assert parse_allowed_origins(["HTTP://Box.lan:3000/, https://a.example", "*"]) == (
        "http://box.lan:3000", "https://a.example", "*")
    with pytest.raises(SwitchyardError, match="'box.lan' is not an origin"):
        parse_allowed_origins(["box.lan"])


@pytest.mark.parametrize(("headers", "needle"), [
    ({"Host": "evil.example"}, "addressed to this machine"),
    ({"Host": "evil.example:8800"}, "addressed to this machine"),
    ({"Origin": "http://evil.example"}, "web pages at 'http://evil.example' are refused"),
    ({"Origin": "null"}, "are refused"),
])
@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/completions"), ("GET", "/v1/models"),
                                              ("GET", "/health"), ("GET", "/switchyard/status"),
                                              ("POST", "/switchyard/stop")])
def test_foreign_host_or_origin_is_refused_on_endpoint_and_control_channel(
        json_engine: RawEngine, headers: dict[str, str], needle: str,
        method: str, path: str) -> None:
    stopped = threading.Event()

    class Target:
        def status(self) -> dict[str, Any]:
            return {"state": "serving"}

        def switch(self, engine: str, model: str | None) -> dict[str, Any]:
            raise AssertionError("never reached")

        def request_stop(self) -> None:
            stopped.set()

    proxy = ProxyServer(port=find_free_port())
    token = control.new_token()
    proxy.add_routes(control.control_routes(Target(), token))
    proxy.start()
    try:
        proxy.set_upstream(json_engine.upstream)
        body = json.dumps({"prompt": "hi"}).encode() if method == "POST" else b""
        status, head, payload = one_request(proxy.port, method, path,
                                            {**headers, control.TOKEN_HEADER: token}, body)
        assert status == 403
        assert needle in json.loads(payload)["error"]["message"]
        assert not any(name.startswith("access-control-") for name in head)  # nothing for foreign origins
        assert not stopped.is_set() and json_engine.accepted == 0  # refused before anything ran
        # The same request from this machine goes through.
        ok, _, _ = one_request(proxy.port, method, path, {control.TOKEN_HEADER: token}, body)
        assert ok == 200
    finally:
        proxy.stop()


def test_local_origin_gets_cors_and_preflight(make_proxy: Callable[..., ProxyServer], json_engine: RawEngine
                                              ) -> None:
    proxy = make_proxy(api_key="k")
    proxy.set_upstream(json_engine.upstream)
    origin = "http://localhost:5173"
    status, head, _ = one_request(proxy.port, "OPTIONS", "/v1/chat/completions", {
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 204
    assert head["access-control-allow-origin"] == origin
    assert "POST" in head["access-control-allow-methods"]
    assert head["access-control-allow-headers"] == "authorization, content-type"
    assert json_engine.accepted == 0  # the preflight is the endpoint's, not forwarded
    status, head, payload = one_request(proxy.port, "POST", "/v1/completions",
                                        {"Origin": origin, "Authorization": "Bearer k"}, b'{"prompt":"hi"}')
    assert status == 200 and json.loads(payload)["choices"][0]["text"] == "ok"
    assert head["access-control-allow-origin"] == origin and head["vary"] == "Origin"
    status, head, _ = one_request(proxy.port, "GET", "/v1/models", {"Origin": origin})
    assert status == 401 and head["access-control-allow-origin"] == origin  # the page may read why


def test_foreign_origin_preflight_gets_nothing(make_proxy: Callable[..., ProxyServer]) -> None:
    proxy = make_proxy()
    status, head, _ = one_request(proxy.port, "OPTIONS", "/v1/completions", {
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert status == 403 and "access-control-allow-origin" not in head


@pytest.mark.parametrize("allowed", [("http://box.lan:3000",), ("*",)])
def test_origins_the_user_allows_pass(make_proxy: Callable[..., ProxyServer], json_engine: RawEngine,
                                      allowed: tuple[str, ...]) -> None:
    proxy = make_proxy(allowed_origins=allowed)
    proxy.set_upstream(json_engine.upstream)
    status, head, _ = one_request(proxy.port, "POST", "/v1/completions", {"Origin": "http://box.lan:3000"},
                                  b'{"prompt":"hi"}')
    assert status == 200 and head["access-control-allow-origin"] == "http://box.lan:3000"
    other, _, _ = one_request(proxy.port, "POST", "/v1/completions", {"Origin": "http://other.lan"}, b"{}")
    assert other == (200 if allowed == ("*",) else 403)
    # Allowing origins never allows a foreign Host (DNS rebinding).
    rebound, _, _ = one_request(proxy.port, "GET", "/v1/models", {"Host": "box.lan:3000"})
    assert rebound == 403


def test_engine_cors_headers_are_not_passed_through(make_proxy: Callable[..., ProxyServer]) -> None:
    def serve(conn: socket.socket, _index: int) -> None:
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nAccess-Control-Allow-Origin: *\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(JSON_ANSWER), JSON_ANSWER))

    engine = RawEngine(serve)
    try:
        proxy = make_proxy()
        proxy.set_upstream(engine.upstream)
        status, head, _ = one_request(proxy.port, "POST", "/v1/completions", {}, b"{}")
        assert status == 200 and "access-control-allow-origin" not in head
    finally:
        engine.close()


# --- settings and CLI -------------------------------------------------------------------------------------------
def test_allowed_origins_setting_round_trips_and_migrates(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"version": 2, "endpoint_port": 9100, "preferred_engine": "vllm"}))
    loaded = core_settings.load(path)
    assert loaded.allowed_origins == () and loaded.endpoint_port == 9100 and loaded.preferred_engine == "vllm"
    assert json.loads(path.read_text())["version"] == core_settings.SCHEMA_VERSION >= 3
    saved = core_settings.Settings(allowed_origins=("http://box.lan:3000", "*"))
    core_settings.save(saved, path)
    assert json.loads(path.read_text())["allowed_origins"] == ["http://box.lan:3000", "*"]
    assert core_settings.load(path) == saved


@pytest.mark.parametrize("bad", [["box.lan"], "http://a.example", ["HTTP://A.example"], [1]])
def test_bad_allowed_origins_setting_is_refused(bad: object) -> None:
    with pytest.raises(SwitchyardError, match="origin"):
        core_settings.from_dict({"version": core_settings.SCHEMA_VERSION, "allowed_origins": bad})


def test_cli_bad_allowed_origin_fails_before_starting_anything() -> None:
    result = subprocess.run(  # noqa: S603 - our own CLI
        [sys.executable, "-m", "desktop", "serve", "--engine", "llama.cpp", "--model", "demo", "--proxy-port",
         str(find_free_port()), "--allowed-origins", "http://ok.example,not an origin"],
        capture_output=True, text=True, timeout=120, env={**os.environ})
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "'not an origin' is not an origin" in result.stderr
    assert "starting" not in result.stderr


# --- the API key is judged from the head ------------------------------------------------------------------------
def test_api_key_is_checked_before_the_body_is_kept(make_proxy: Callable[..., ProxyServer], json_engine: RawEngine,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import desktop.core.serving.http1 as http1

    monkeypatch.setattr(http1, "MAX_BODY_BYTES", 1024)
    proxy = make_proxy(api_key="k")
    proxy.set_upstream(json_engine.upstream)
    body = b"x" * 1000  # under the body limit: a refused body is still never kept, and the connection ends
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=20) as sock:
        head = request_bytes("POST", "/v1/completions", {"Expect": "100-continue"}, body)
        sock.sendall(head[:-len(body)])
        status, headers, payload, rest = read_response(sock)  # answered from the head, before any body byte
        assert status == 401 and "API key" in json.loads(payload)["error"]["message"]
        assert headers.get("connection") == "close"
        sock.sendall(body)  # the client sends it anyway: a few KiB are dropped, then the endpoint's end of file
        assert rest == b"" and sock.recv(1) == b""
    status, _, payload = one_request(proxy.port, "GET", "/v1/models", {"Authorization": "Bearer k"})
    assert status == 200 and json.loads(payload)["data"][0]["id"] == "stable"
    big = b"x" * 4096  # over it (Content-Length: 10**18 alike): answered, and the connection ends, never drained
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=20) as sock:
        sock.sendall(request_bytes("POST", "/v1/completions", {}, big)[:-len(big)])
        status, headers, _, _ = read_response(sock)
        assert status == 401 and headers.get("connection") == "close"
        assert sock.recv(1) == b""
    assert json_engine.accepted == 0 and proxy.guard.buffered == 0


# --- engines behind the endpoint hold a per-launch key --------------------------------------------------------
def _engine_post(base_url: str, path: str, body: Any, timeout: float, **options: Any) -> httpx.Response:
    """POST straight to an engine (its private Unix socket, desktop.core.common.unixhttp)."""
    from desktop.core.common import unixhttp

    with unixhttp.client(base_url, timeout=timeout) as client:
        return client.post(unixhttp.http_url(base_url) + path, json=body, **options)


@pytest.mark.engine
@pytest.mark.llamacpp
def test_engine_port_refuses_requests_without_the_endpoints_key(llama_install: Any, demo_model: Any) -> None:
    from desktop.core.planning.planner import ask
    from desktop.core.serving.endpoint import EndpointManager

    proxy = ProxyServer(port=find_free_port(), wait_timeout=600)
    proxy.start()
    manager = EndpointManager(proxy, ready_timeout=600)
    try:
        manager.start(ask("llama.cpp", str(demo_model.gguf_path), {"slots": 1}))
        active = manager.active
        assert active is not None
        key = active.upstream.api_key
        assert key and len(key) >= 32 and key not in " ".join(psutil.Process(active.process.pid).cmdline())
        body = {"model": "x", "prompt": "Hi", "max_tokens": 2}
        side_door = _engine_post(active.process.base_url, "/v1/completions", body, timeout=30)
        assert side_door.status_code == 401
        wrong = _engine_post(active.process.base_url, "/v1/completions", body, timeout=30,
                             headers={"Authorization": "Bearer guess"})
        assert wrong.status_code == 401
        through = httpx.post(proxy.url + "/v1/completions", json=body, trust_env=False, timeout=60)
        assert through.status_code == 200 and through.json()["choices"]
    finally:
        manager.close()
        proxy.stop()


def vllm_refuses_v1_without_the_key(active: Any, proxy: ProxyServer) -> None:
    """vLLM's key guards /v1 only (its /health, /metrics stay open): the completions it serves need the key.
    Run on the real vLLM behind the endpoint by tests/test_engine_sockets.py (one vLLM start for its checks)."""
    assert active.upstream.api_key
    body = {"model": "x", "prompt": "Hi", "max_tokens": 2}
    side_door = _engine_post(active.process.base_url, "/v1/completions", body, timeout=60)
    assert side_door.status_code == 401
    through = httpx.post(proxy.url + "/v1/completions", json=body, trust_env=False, timeout=120)
    assert through.status_code == 200 and through.json()["choices"]


# --- timeouts toward the engine ---------------------------------------------------------------------------------
def test_a_hung_engine_yields_504_and_its_request_is_cancelled(make_proxy: Callable[..., ProxyServer]) -> None:
    cancelled = threading.Event()

    def hang(conn: socket.socket, _index: int) -> None:
        read_request(conn)
        if conn.recv(1) == b"":  # never answers; the endpoint giving up closes the connection
            cancelled.set()

    engine = RawEngine(hang)
    try:
        proxy = make_proxy(timeouts=Timeouts(first_byte=0.5, idle=0.5))
        records: list[Any] = []
        proxy.subscribe(records.append)
        proxy.set_upstream(engine.upstream)
        started = time.monotonic()
        response = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi"}, trust_env=False, timeout=30)
        assert response.status_code == 504
        assert "did not answer within 0.5 s" in response.json()["error"]["message"]
        assert time.monotonic() - started < 20  # generous: the point is that it ends, not how fast
        assert cancelled.wait(10)
        assert records[-1].status == 504 and proxy.counters["failed"] == 1
        assert proxy.inflight() == 0
    finally:
        engine.close()


def test_an_engine_silent_mid_stream_is_cut_with_an_error_event(make_proxy: Callable[..., ProxyServer]) -> None:
    cancelled = threading.Event()

    def stall(conn: socket.socket, _index: int) -> None:
        read_request(conn)
        event = b'data: {"choices":[{"text":"t0","index":0}]}\n\n'
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"%x\r\n%s\r\n" % (len(event), event))
        if conn.recv(1) == b"":
            cancelled.set()

    engine = RawEngine(stall)
    try:
        proxy = make_proxy(timeouts=Timeouts(first_byte=30, idle=0.5))
        proxy.set_upstream(engine.upstream)
        with httpx.stream("POST", proxy.url + "/v1/completions", json={"prompt": "hi", "stream": True},
                          trust_env=False, timeout=30) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert response.status_code == 200
        assert json.loads(lines[0][6:])["choices"][0]["text"] == "t0"
        assert "sent nothing for 0.5 s" in json.loads(lines[-1][6:])["error"]["message"]
        assert cancelled.wait(10)
    finally:
        engine.close()


# --- limits ------------------------------------------------------------------------------------------------------
def test_300_idle_connections_do_not_stop_a_request(make_proxy: Callable[..., ProxyServer],
                                                    json_engine: RawEngine) -> None:
    proxy = make_proxy()
    proxy.set_upstream(json_engine.upstream)
    idle: list[socket.socket] = []
    try:
        for index in range(300):
            sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
            if index % 2:  # half of them stop mid-head (slowloris), half say nothing at all
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
            idle.append(sock)
        eventually(lambda: len(proxy.connections) >= 300, "the endpoint to hold the 300 connections")
        response = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi"}, trust_env=False,
                              timeout=httpx.Timeout(5.0))
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "ok"
        assert len(proxy.connections) >= 300  # served while they were all still open
    finally:
        for sock in idle:
            sock.close()


def test_pipelined_requests_past_the_cap_get_429_in_order(make_proxy: Callable[..., ProxyServer]) -> None:
    gate = threading.Event()

    def held_then_json(conn: socket.socket, _index: int) -> None:
        leftover = b""
        while True:
            _head, _body, leftover = read_request(conn, leftover)
            gate.wait(30)
            answer_json(conn)

    engine = RawEngine(held_then_json)
    try:
        proxy = make_proxy(limits=Limits(pipelined=2))
        proxy.set_upstream(engine.upstream)
        payload = request_bytes("POST", "/v1/completions", body=b"{}") + request_bytes("GET", "/v1/models") * 5
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=20) as sock:
            sock.sendall(payload)  # one small write: the endpoint reads it in one go
            eventually(lambda: any(c.reading_paused for c in connections_of(proxy)), "read-ahead to pause")
            gate.set()
            answers = []
            leftover = b""
            for _ in range(3):
                status, head, _, leftover = read_response(sock, leftover)
                answers.append((status, head.get("retry-after"), head.get("connection")))
            assert sock.recv(1) == b""  # the connection ends at the 429: nothing after it was parsed
        # pipelined=2 requests in hand (the one being answered included): the 3rd is 429, as the README says of
        # the default 16 (the 17th); it was the 4th (and the 18th) before
        assert answers == [(200, None, None), (200, None, None), (429, "1", "close")]
        assert proxy.queued == 0
    finally:
        gate.set()
        engine.close()


def test_past_the_total_queue_cap_requests_get_503_with_retry_after(make_proxy: Callable[..., ProxyServer],
                                                                     json_engine: RawEngine) -> None:
    proxy = make_proxy(limits=Limits(queued=2))  # no engine yet: requests wait for one
    results: list[int] = []
    waiting = [threading.Thread(target=lambda: results.append(
        httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi"}, trust_env=False, timeout=30).status_code))
        for _ in range(2)]
    for thread in waiting:
        thread.start()
    eventually(lambda: proxy.queued == 2, "two requests to wait for an engine")
    full = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi"}, trust_env=False, timeout=10)
    assert full.status_code == 503 and full.headers["retry-after"] == "1"
    assert "queued requests" in full.json()["error"]["message"]
    proxy.set_upstream(json_engine.upstream)
    for thread in waiting:
        thread.join(30)
    assert results == [200, 200] and proxy.queued == 0


def test_a_slow_reader_pauses_the_engine_stream(make_proxy: Callable[..., ProxyServer]) -> None:
    total = 64 << 20
    sent = [0]

    def flood(conn: socket.socket, _index: int) -> None:
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n"
                     % total)
        block = b"data: " + b"x" * 65528 + b"\n\n"
        while sent[0] < total:
            piece = block[:total - sent[0]]
            conn.sendall(piece)
            sent[0] += len(piece)

    engine = RawEngine(flood)
    try:
        proxy = make_proxy()
        proxy.set_upstream(engine.upstream)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as sock:
            sock.sendall(request_bytes("POST", "/v1/completions", body=b"{}"))

            def paused() -> bool:
                exchanges = [c.exchange for c in connections_of(proxy) if c.exchange is not None]
                return any(getattr(e, "paused", False) for e in exchanges)

            eventually(paused, "the engine stream to pause while the client reads nothing")
            assert sent[0] < total  # the engine was held back: it could not send it all
            head, rest = read_head(sock)
            received = len(rest)
            while received < total:
                chunk = sock.recv(1 << 20)
                assert chunk
                received += len(chunk)
        assert head.startswith(b"HTTP/1.1 200") and received == total
    finally:
        engine.close()


def test_20_pipelined_60mib_bodies_do_not_grow_the_process_past_the_cap(make_proxy: Callable[..., ProxyServer]
                                                                         ) -> None:
    count, size = 20, 60 << 20
    gate = threading.Event()
    bodies: list[int] = []

    def sink(conn: socket.socket, _index: int) -> None:
        leftover = b""
        while True:
            head, _body, leftover = read_request(conn, leftover, sink=True)
            bodies.append(len(head))
            gate.wait(60)
            answer_json(conn)

    engine = RawEngine(sink)
    body = b'{"prompt": "' + b"x" * (size - 14) + b'"}'
    assert len(body) == size
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {size}\r\n\r\n".encode()
    process = psutil.Process()
    try:
        proxy = make_proxy()
        proxy.set_upstream(engine.upstream)
        baseline = process.memory_info().rss
        peak = [baseline]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.005):
                peak[0] = max(peak[0], process.memory_info().rss)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=60) as sock:
            def send_all() -> None:
                for _ in range(count):
                    sock.sendall(head)
                    sock.sendall(body)

            sender = threading.Thread(target=send_all, daemon=True)
            sender.start()
            # The first request is at the engine (held); the endpoint stops reading the second one early.
            eventually(lambda: len(bodies) == 1 and any(c.reading_paused for c in connections_of(proxy)),
                       "the endpoint to stop reading ahead", timeout=60)
            held = process.memory_info().rss - baseline
            gate.set()
            leftover = b""
            statuses = []
            for _ in range(count):
                status, _, _, leftover = read_response(sock, leftover)
                statuses.append(status)
            sender.join(60)
        done.set()
        sampler.join(10)
        growth = peak[0] - baseline
        print(f"RSS growth while held {held / 2**20:.0f} MiB, peak {growth / 2**20:.0f} MiB "
              f"(all {count} bodies: {count * size / 2**20:.0f} MiB)")
        assert statuses == [200] * count and len(bodies) == count
        assert held < 4 * size  # the one being forwarded (and its copy), not the 19 behind it
        assert growth < 5 * size  # well below the 20 bodies it was sent (about 3 bodies: read, joined, sent)
    finally:
        gate.set()
        engine.close()


# --- retries only for what the engine never got -----------------------------------------------------------------
def test_a_post_cut_off_before_it_was_all_sent_is_retried(make_proxy: Callable[..., ProxyServer]) -> None:
    def first_drops(conn: socket.socket, index: int) -> None:
        if index == 0:
            conn.recv(4096)  # the head arrived; close with most of the body unread (the engine never had it)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            return
        read_request(conn, sink=True)
        answer_json(conn)

    engine = RawEngine(first_drops)
    try:
        proxy = make_proxy()
        proxy.set_upstream(engine.upstream)
        body = b'{"prompt": "' + b"x" * (32 << 20) + b'"}'  # more than loopback's socket buffers hold
        response = httpx.post(proxy.url + "/v1/completions", content=body, trust_env=False, timeout=60)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "ok"
        assert engine.accepted == 2 and proxy.counters["failed"] == 0
    finally:
        engine.close()


def test_a_post_on_a_fresh_connection_closed_unanswered_is_not_run_twice(make_proxy: Callable[..., ProxyServer]
                                                                         ) -> None:
    def crash_after_reading(conn: socket.socket, _index: int) -> None:
        read_request(conn)  # read it all (a generation may have started), then die without a byte

    engine = RawEngine(crash_after_reading)
    try:
        proxy = make_proxy()
        proxy.set_upstream(engine.upstream)
        response = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi"}, trust_env=False, timeout=30)
        assert response.status_code == 502 and "not retried" in response.json()["error"]["message"]
        assert engine.accepted == 1
    finally:
        engine.close()


def test_a_client_that_stops_reading_is_cut_after_the_idle_timeout(make_proxy: Callable[..., ProxyServer]) -> None:
    cut = threading.Event()

    def flood(conn: socket.socket, _index: int) -> None:
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        block = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
        try:
            while True:
                conn.sendall(block)
        except OSError:
            cut.set()  # the endpoint gave up on the request: the engine's connection is gone

    engine = RawEngine(flood)
    try:
        proxy = make_proxy(timeouts=Timeouts(first_byte=30, idle=0.5))
        records: list[Any] = []
        proxy.subscribe(records.append)
        proxy.set_upstream(engine.upstream)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as sock:
            sock.sendall(request_bytes("POST", "/v1/completions", body=b"{}"))
            assert cut.wait(20)  # never reading: paused, then cut once the idle timeout passed
        eventually(lambda: bool(records), "the request to be recorded")
        assert records[-1].status == 499 and proxy.inflight() == 0
    finally:
        engine.close()
