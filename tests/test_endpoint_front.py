"""The endpoint's front end, closed and bounded (issue 21 items 2, 3, 5; review serving-surface.md #2, #4-#6, #9,
#12-#14, #16): only inference routes reach an engine, a head is refused at 64 KiB however it arrives, heads and
idle connections time out, connections and buffered bodies are capped, a body is read once without a parse tree,
RFC 9112's head rules hold, trailers never reach an engine, and a client's 4xx is not counted as a failure.
Real sockets throughout; the engine stand-ins record what reaches them."""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from test_endpoint_guard import RawEngine, answer_json, eventually, make_proxy, read_request, read_response

from desktop.core.runtime.ports import find_free_port
from desktop.core.serving import requestinfo
from desktop.core.serving.fleet import parse_models_config
from desktop.core.serving.guard import connection_cap, raise_fd_limit
from desktop.core.serving.http1 import MAX_HEAD_BYTES, Limits
from desktop.core.serving.metering import RequestRecord
from desktop.core.serving.proxy import INFERENCE_ROUTES, ProxyServer, Upstream
from desktop.core.serving.requestlog import RequestLog

__all__ = ["make_proxy"]  # the fixture, shared with test_endpoint_guard

ENGINE_PATHS = ["GET /slots", "POST /slots/0?action=erase", "GET /metrics", "GET /props", "POST /props",
                "POST /collective_rpc", "POST /sleep?level=1", "POST /wake_up", "POST /pause", "POST /lora-adapters",
                "GET /lora-adapters", "POST /invocations", "POST /tokenize", "POST /detokenize", "POST /pooling",
                "POST /v1/models", "GET /v1/chat/completions", "POST /v1/chat/completions/", "POST /v1//completions",
                "POST /switchyard/../v1/completions", "GET /", "POST /infill", "POST /apply-template"]


class RecordingEngine(RawEngine):
    """Answers every request with a small JSON 200 and records its request line and head."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []

        def serve(conn: socket.socket, _index: int) -> None:
            leftover = b""
            while True:
                head, body, leftover = read_request(conn, leftover)
                self.seen.append(head.split(b"\r\n", 1)[0].decode("latin-1"))
                self.heads.append(head)
                self.bodies.append(body)
                answer_json(conn)

        super().__init__(serve)

    @property
    def upstream(self) -> Upstream:
        return Upstream(f"rec@{self.port}", "rec", f"http://127.0.0.1:{self.port}", "served", api_key="engine-key",
                        messages_api=True)


@pytest.fixture
def engine() -> Iterator[RecordingEngine]:
    recording = RecordingEngine()
    yield recording
    recording.close()


def exchange(port: int, raw: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes, return everything the endpoint answers until it closes (the requests say
    `Connection: close`, or are refused); a half-close would read as a client that left."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before it was all sent: the answer is still there to read
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return data


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def post(path: str, body: bytes = b'{"model": "stable", "prompt": "hi"}', *, host: str = "127.0.0.1",
         extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Length: {len(body)}\r\nConnection: close"
            f"\r\n\r\n").encode() + body


# --- only inference routes reach an engine (review #2) -----------------------------------------------------------
def test_engine_admin_and_debug_routes_are_404_and_never_reach_the_engine(
        make_proxy: Callable[..., ProxyServer], engine: RecordingEngine) -> None:
    proxy = make_proxy()
    proxy.set_upstream(engine.upstream)
    for line in ENGINE_PATHS:
        method, path = line.split(" ")
        body = b'{"method": "check_health"}' if method == "POST" else b""
        raw = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n" \
              f"Connection: close\r\n\r\n".encode() + body
        answer = exchange(proxy.port, raw)
        assert status_of(answer) in (404, 405), (line, answer[:200])
    assert engine.seen == []
    assert proxy.counters["client_errors"] == len(ENGINE_PATHS) and proxy.counters["failed"] == 0
    for path in sorted(INFERENCE_ROUTES):
        answer = exchange(proxy.port, post(path))
        assert status_of(answer) == 200, (path, answer[:200])
    assert engine.seen == [f"POST {path} HTTP/1.1" for path in sorted(INFERENCE_ROUTES)]
    assert all(b"Authorization: Bearer engine-key" in head for head in engine.heads)
    assert all(json.loads(body)["model"] == "served" for body in engine.bodies)


def test_a_model_can_opt_extra_engine_routes_in(make_proxy: Callable[..., ProxyServer],
                                                engine: RecordingEngine) -> None:
    proxy = make_proxy(extra_routes=["/props", "/tokenize"])
    proxy.set_upstream(engine.upstream)
    assert status_of(exchange(proxy.port, b"GET /props HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")) \
        == 200
    assert status_of(exchange(proxy.port, post("/tokenize", b'{"content": "hi"}'))) == 200
    assert status_of(exchange(proxy.port, b"GET /slots HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")) \
        == 404
    assert engine.seen == ["GET /props HTTP/1.1", "POST /tokenize HTTP/1.1"]


def test_extra_routes_are_per_model_in_a_fleet(engine: RecordingEngine) -> None:
    config = parse_models_config({"models": [
        {"name": "a", "engine": "llama.cpp", "model": "demo", "extra_routes": ["/props"]},
        {"name": "b", "engine": "llama.cpp", "model": "demo"}]})
    assert [m.extra_routes for m in config.models] == [("/props",), ()]
    with pytest.raises(Exception, match="extra_routes"):
        parse_models_config({"models": [{"name": "a", "engine": "llama.cpp", "model": "demo",
                                         "extra_routes": "props"}]})
    proxy = ProxyServer(port=0, model_name="stable")
    proxy.set_models({"a": {}, "b": {}}, extra_routes={m.name: m.extra_routes for m in config.models})
    proxy.start()
    try:
        proxy.set_upstream(engine.upstream, model="a")
        proxy.set_upstream(engine.upstream, model="b")
        assert status_of(exchange(proxy.port, post("/props", b'{"model": "a"}'))) == 200
        assert status_of(exchange(proxy.port, post("/props", b'{"model": "b"}'))) == 404
        get = b"GET /props HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        assert status_of(exchange(proxy.port, get)) == 200  # no model to route on: the one that opted it in
        assert engine.seen == ["POST /props HTTP/1.1", "GET /props HTTP/1.1"]
    finally:
        proxy.stop()


# --- the head limit counts from the first byte (review #4) -------------------------------------------------------
@pytest.mark.parametrize("start", [b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ",
                                   b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Name-Without-A-Colon"])
def test_a_header_line_that_never_ends_is_refused_at_64_kib(make_proxy: Callable[..., ProxyServer],
                                                            start: bytes) -> None:
    proxy = make_proxy()
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    sent = 0
    answer = b""
    try:
        sock.sendall(start)
        sent += len(start)
        for _ in range(16):  # 1 MiB in 64 KiB writes, never a CRLF
            sock.sendall(b"a" * 65536)
            sent += 65536
            readable, _, _ = select.select([sock], [], [], 0.2)
            if readable:
                break
        started = time.monotonic()
        health = httpx.get(proxy.url + "/health", trust_env=False, timeout=5)
        assert health.status_code == 503 and time.monotonic() - started < 1.0  # the loop was never stalled
        while chunk := sock.recv(65536):
            answer += chunk
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 431 ") and b"Connection: close" in answer
    assert sent <= MAX_HEAD_BYTES + 3 * 65536  # refused within the first writes past 64 KiB, not after 1 MiB


@pytest.mark.parametrize("chunked", [False, True])
def test_a_large_body_does_not_count_against_the_next_head(make_proxy: Callable[..., ProxyServer],
                                                           engine: RecordingEngine, chunked: bool) -> None:
    """Kept alive: a 4 MiB body (its last read holds far more than 64 KiB), then another request."""
    proxy = make_proxy()
    proxy.set_upstream(engine.upstream)
    payload = b'{"prompt": "' + b"x" * (4 << 20) + b'"}'
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as sock:
        for _ in range(3):
            if chunked:
                pieces = b"".join(b"%x\r\n%b\r\n" % (len(payload[i:i + 300_000]), payload[i:i + 300_000])
                                  for i in range(0, len(payload), 300_000))
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked"
                             b"\r\n\r\n" + pieces + b"0\r\n\r\n")
            else:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n%b"
                             % (len(payload), payload))
            status, _, _, _ = read_response(sock)
            assert status == 200
    assert len(engine.seen) == 3


def test_a_head_fed_a_byte_at_a_time_is_counted_too(make_proxy: Callable[..., ProxyServer]) -> None:
    proxy = make_proxy()
    connection = proxy.call(_one_connection(proxy))  # feed the parser directly: no TCP coalescing
    raw = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * MAX_HEAD_BYTES
    fed = proxy.call(_feed(connection, raw, 4096))
    assert connection.rejected and fed <= MAX_HEAD_BYTES + 4096


async def _one_connection(proxy: ProxyServer) -> Any:
    from desktop.core.serving.http1 import ClientConnection

    class Sink:
        def __init__(self) -> None:
            self.data = b""

        def write(self, data: bytes) -> None:
            self.data += data

        def close(self) -> None:
            pass

        def abort(self) -> None:
            pass

        def get_extra_info(self, _name: str) -> Any:
            return ("127.0.0.1", 1)

        def pause_reading(self) -> None:
            pass

        def resume_reading(self) -> None:
            pass

        def set_write_buffer_limits(self, high: int, low: int) -> None:
            pass

        def get_write_buffer_size(self) -> int:
            return 0

        def write_eof(self) -> None:
            pass

    connection = ClientConnection(proxy)
    connection.connection_made(Sink())  # type: ignore[arg-type]
    return connection


async def _feed(connection: Any, raw: bytes, step: int) -> int:
    fed = 0
    while fed < len(raw) and not connection.rejected:
        connection.data_received(raw[fed:fed + step])
        fed += step
    return fed


# --- RFC 9112 head rules, trailers, upgrades (review #12-#14) ----------------------------------------------------
@pytest.mark.parametrize("raw", [
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",  # no Host
    b"POST /v1/completions HTTP/1.1\r\nHost: evil.example\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}",
    b"POST http://evil.example/v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}",
    b"POST http://127.0.0.1/v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}",
    b"OPTIONS * HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\n\r\n",
    b"CONNECT x:1 HTTP/1.1\r\nHost: x:1\r\n\r\nSSH-2.0-x\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Content-Length: 2\r\n\r\n{}",
], ids=["no-host", "two-hosts", "absolute-form", "absolute-form-loopback", "asterisk", "connect", "connect-tunnel",
        "upgrade"])
def test_malformed_heads_get_one_400_and_reach_no_engine(make_proxy: Callable[..., ProxyServer],
                                                         engine: RecordingEngine, raw: bytes) -> None:
    proxy = make_proxy()
    proxy.set_upstream(engine.upstream)
    answer = exchange(proxy.port, raw)
    assert status_of(answer) == 400 and answer.count(b"HTTP/1.1 ") == 1, answer[:300]
    assert engine.seen == []


def test_chunked_trailers_never_reach_the_engine(make_proxy: Callable[..., ProxyServer],
                                                 engine: RecordingEngine) -> None:
    proxy = make_proxy()
    proxy.set_upstream(engine.upstream)
    raw = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
           b"Connection: close\r\n\r\n2\r\n{}\r\n0\r\nX-Injected: from-trailer\r\nOrigin: http://evil.example\r\n\r\n")
    assert status_of(exchange(proxy.port, raw)) == 200
    assert len(engine.heads) == 1 and b"X-Injected" not in engine.heads[0] and b"evil" not in engine.heads[0]


def test_trailers_that_never_end_are_refused(make_proxy: Callable[..., ProxyServer],
                                             engine: RecordingEngine) -> None:
    proxy = make_proxy()
    proxy.set_upstream(engine.upstream)
    raw = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"2\r\n{}\r\n0\r\nX-Trailer: " + b"t" * (2 * MAX_HEAD_BYTES))
    answer = exchange(proxy.port, raw)
    assert status_of(answer) == 431 and engine.seen == []


# --- timeouts and connection caps (review #5) --------------------------------------------------------------------
def test_a_half_head_and_an_idle_connection_are_closed_after_their_timeouts(
        make_proxy: Callable[..., ProxyServer]) -> None:
    proxy = make_proxy(limits=Limits(head_timeout_s=1.0, idle_timeout_s=2.0))
    half = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    idle = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    started = time.monotonic()
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
    answer = b""
    while chunk := half.recv(65536):
        answer += chunk
    head_closed = time.monotonic() - started
    assert idle.recv(1) == b""
    idle_closed = time.monotonic() - started
    half.close()
    idle.close()
    assert status_of(answer) == 408
    assert 0.9 <= head_closed < 3.0 and 1.9 <= idle_closed < 4.0, (head_closed, idle_closed)


def test_a_body_that_falls_silent_is_closed_after_its_grace(make_proxy: Callable[..., ProxyServer],
                                                            engine: RecordingEngine) -> None:
    proxy = make_proxy(limits=Limits(body_grace_s=1.0))
    proxy.set_upstream(engine.upstream)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{\"a\":")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert status_of(answer) == 408 and engine.seen == [] and proxy.guard.buffered == 0


def test_at_the_connection_cap_the_longest_idle_connection_makes_room(make_proxy: Callable[..., ProxyServer],
                                                                      engine: RecordingEngine) -> None:
    proxy = make_proxy(limits=Limits(connections=8, per_peer=8))
    assert proxy.guard.max_connections == 8
    proxy.set_upstream(engine.upstream)
    idle = [socket.create_connection(("127.0.0.1", proxy.port), timeout=10) for _ in range(8)]
    eventually(lambda: len(proxy.guard.open) == 8, "8 connections to be held")
    response = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi"}, trust_env=False, timeout=10)
    assert response.status_code == 200  # the oldest idle connection was closed for it
    assert idle[0].recv(1) == b""
    assert len(proxy.guard.open) <= 8
    for sock in idle:
        sock.close()


def test_connections_are_capped_below_the_descriptor_limit() -> None:
    assert connection_cap(1024, 256) == 96  # (256 - 64 reserved) / 2: each answered one may hold an engine fd
    assert connection_cap(1024, 1 << 20) == 1024 and connection_cap(1024, 0) == 1024
    try:
        import resource
    except ImportError:
        return
    soft = raise_fd_limit()
    assert soft == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert soft == hard or hard == resource.RLIM_INFINITY


CHILD_ENDPOINT = textwrap.dedent("""
    import resource, sys, threading
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    from desktop.core.serving.http1 import Limits
    from desktop.core.serving.proxy import ProxyServer, Upstream
    proxy = ProxyServer(port=0, limits=Limits(head_timeout_s=2.0, idle_timeout_s=2.0))
    proxy.start()
    proxy.set_upstream(Upstream("raw", "raw", sys.argv[1], "m"))
    print(proxy.port, proxy.guard.max_connections, flush=True)
    threading.Event().wait(120)
""")


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_NOFILE is POSIX")
def test_a_child_endpoint_with_256_descriptors_serves_past_400_idle_sockets(engine: RecordingEngine) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD_ENDPOINT, engine.upstream.base_url],
                             stdout=subprocess.PIPE, text=True, cwd=str(Path(__file__).parents[1]),
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    sockets: list[socket.socket] = []
    try:
        assert child.stdout is not None
        port_text, cap = child.stdout.readline().split()
        port = int(port_text)
        assert int(cap) == 96
        started = time.monotonic()
        for index in range(400):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            if index % 2:  # half stop mid-head (slowloris), half say nothing at all
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
            sockets.append(sock)
        deadline = started + 2.0 + 6.0  # the timeout, plus the sweep and a loaded machine
        status = 0
        while time.monotonic() < deadline:
            try:
                status = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi"},
                                    trust_env=False, timeout=5).status_code
            except httpx.HTTPError:
                status = 0
            if status == 200:
                break
            time.sleep(0.2)  # a retry pause for the client, not synchronisation: the deadline bounds it
        assert status == 200
        assert child.poll() is None  # the endpoint is alive (no EMFILE crash)
        closed = 0
        for sock in sockets:
            sock.settimeout(10)
            try:
                sock.recv(65536)  # b"" (closed), or the 408/503 it was closed with
            except TimeoutError:
                continue  # still held open: not closed
            except OSError:
                pass  # reset: closed
            closed += 1
        assert closed == 400  # every idle socket was closed (or refused) by the endpoint
        assert psutil.Process(child.pid).num_fds() < 256
    finally:
        for sock in sockets:
            sock.close()
        child.kill()
        child.wait(10)


# --- buffered bodies and the body scan (review #6) ---------------------------------------------------------------
def test_40_bodies_of_60_mib_without_an_engine_stay_within_the_body_budget(
        make_proxy: Callable[..., ProxyServer]) -> None:
    """No engine: four bodies fit the 256 MiB budget and wait; the other 36 get 503 + Retry-After from their
    head, and are read and dropped. The process grows by the budget plus one body's copy, not by 2.4 GiB."""
    count, size = 40, 60 << 20
    body = b'{"model": "x", "prompt": "' + b"x" * (size - 30) + b'"}'
    body = body + b" " * (size - len(body))
    proxy = make_proxy(wait_timeout=600)
    process = psutil.Process()
    baseline = process.memory_info().rss
    peak = [baseline]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], process.memory_info().rss)

    statuses: list[tuple[int, str | None]] = []
    socks: list[socket.socket] = []

    def upload() -> None:
        sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=120)
        socks.append(sock)
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {size}\r\n\r\n".encode())
        try:
            sock.sendall(body)
        except OSError:
            pass
        readable, _, _ = select.select([sock], [], [], 0.5)
        if readable:
            status, headers, _, _ = read_response(sock)
            statuses.append((status, headers.get("retry-after")))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    uploads = [threading.Thread(target=upload) for _ in range(count)]
    for thread in uploads:
        thread.start()
    for thread in uploads:
        thread.join(300)
    eventually(lambda: proxy.queued == 4, "four uploads to wait for an engine")
    held = proxy.guard.buffered
    done.set()
    sampler.join(10)
    for sock in socks:
        sock.close()
    growth = peak[0] - baseline
    print(f"RSS growth peak {growth / 2**20:.0f} MiB for {count} x {size >> 20} MiB offered, "
          f"{held >> 20} MiB held")
    assert sorted(statuses) == [(503, "1")] * (count - 4)
    assert held == 4 * size
    assert growth < 512 << 20  # the README's bound: the 256 MiB budget + one body being joined + slack


def test_a_deeply_nested_body_is_a_400_without_a_traceback(make_proxy: Callable[..., ProxyServer],
                                                           engine: RecordingEngine,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    proxy = make_proxy()
    proxy.set_upstream(engine.upstream)
    deep = b'{"model":"x","a":' + b"[" * 100000 + b"]" * 100000 + b"}"
    with caplog.at_level(logging.WARNING):
        answer = exchange(proxy.port, post("/v1/completions", deep))
    assert status_of(answer) == 400 and b"nested deeper" in answer
    assert engine.seen == []
    assert not [r for r in caplog.records if r.levelno > logging.WARNING]


def test_a_57_mib_body_of_empty_arrays_is_read_off_the_loop(make_proxy: Callable[..., ProxyServer],
                                                            engine: RecordingEngine) -> None:
    """json.loads of this took 6.9 s and 1.5 GiB on the endpoint's one thread (on an idle machine); the scan runs
    in a worker thread, gives up past MAX_TOKENS with a 400, and /health answers meanwhile (the bound leaves room
    for a machine shared with other work: the loop stays responsive, it is not a latency benchmark)."""
    proxy = make_proxy()
    proxy.set_upstream(engine.upstream)
    wide = b'{"model":"x","a":[' + b"[]," * 20_000_000 + b'[]]}'
    answers: list[bytes] = []
    uploads = [threading.Thread(target=lambda: answers.append(exchange(proxy.port, post("/v1/completions", wide),
                                                                      timeout=120)))
               for _ in range(2)]
    for thread in uploads:
        thread.start()
    eventually(lambda: proxy.dispatcher.scanner is not None, "a scan to start in the worker thread", timeout=60)
    slowest = 0.0
    while any(thread.is_alive() for thread in uploads):
        started = time.monotonic()
        assert httpx.get(proxy.url + "/health", trust_env=False, timeout=5).status_code == 200
        slowest = max(slowest, time.monotonic() - started)
        threading.Event().wait(0.05)
    assert [status_of(a) for a in answers] == [400, 400] and engine.seen == []
    assert slowest < 2.5


def test_model_and_stream_are_read_from_the_top_level_object_once() -> None:
    info = requestinfo.scan(b'{"tools": [{"model": "b", "stream": true}], "model": "a", "n": {"stream": 1}}')
    assert info is not None and info.model == "a" and info.stream is False
    body = b'{"messages": [{"content": "say \\"model\\": x"}],\n "model" : "caf\\u00e9", "stream": true}'
    info = requestinfo.scan(body)
    assert info is not None and info.model == "caf\u00e9" and info.stream is True
    rewritten = requestinfo.rewrite_model(body, info, "served")
    assert json.loads(rewritten) == {**json.loads(body), "model": "served"}
    assert rewritten.startswith(b'{"messages": [{"content": "say \\"model\\": x"}],\n "model" : "served"')
    assert requestinfo.scan(b"[1, 2]") == requestinfo.NO_INFO
    assert requestinfo.scan(b'{"model": "x", "a": [' + b'"s\\n",' * 30000 + b'""]}', 20000) is None  # thread


def test_every_body_is_read_as_the_engines_read_it() -> None:
    """Review L1 (issue 35): the scan used to skip bodies without a literal "model"/"stream", bodies that did not
    begin with `{` (a BOM, an array) and escaped keys, so the nesting limit did not reach the engines and the
    endpoint and the engine could read different `model`/`stream` values."""
    deep = b"[" * 200 + b"]" * 200
    for body in (b'{"messages":' + deep + b"}", b"[" + deep + b"]", b'  [{"model": "x", "a": ' + deep + b"}]"):
        with pytest.raises(requestinfo.BadBody, match="nested deeper"):
            requestinfo.scan(body)
    with pytest.raises(requestinfo.BadBody, match="byte-order mark"):
        requestinfo.scan(b'\xef\xbb\xbf{"model": "x"}')
    escaped = b'{"model": "a", "mod\\u0065l": "b", "stream": false, "str\\u0065am": true}'
    info = requestinfo.scan(escaped)
    assert info is not None and (info.model, info.stream) == (json.loads(escaped)["model"], True) == ("b", True)
    assert json.loads(requestinfo.rewrite_model(escaped, info, "served"))["model"] == "served"
    last = requestinfo.scan(b'{"model": "a", "model": {"x": 1}}')
    assert last is not None and last.model is None  # the engine reads the object: no name to route by


def test_a_bom_or_a_deep_array_is_refused_before_the_engine(make_proxy: Callable[..., ProxyServer],
                                                           engine: RecordingEngine) -> None:
    proxy = make_proxy()
    proxy.set_upstream(engine.upstream)
    for body in (b'\xef\xbb\xbf{"model":"x","messages":' + b"[" * 1000 + b"]" * 1000 + b"}",
                 b"[" * 100000 + b"]" * 100000):
        assert status_of(exchange(proxy.port, post("/v1/chat/completions", body))) == 400
    assert engine.seen == []


def test_the_log_names_the_model_that_was_routed_to(engine: RecordingEngine) -> None:
    """The old log took the first "model" anywhere in the body (a regex); routing took the top-level one."""
    proxy = ProxyServer(port=0, model_name="stable")
    proxy.set_models({"a": {}, "b": {}})
    records: list[RequestRecord] = []
    proxy.subscribe(records.append)
    proxy.start()
    try:
        proxy.set_upstream(engine.upstream, model="a")
        body = b'{"tools": [{"type": "function", "model": "b"}], "model": "a", "prompt": "hi"}'
        assert status_of(exchange(proxy.port, post("/v1/completions", body))) == 200
        eventually(lambda: len(records) == 1, "the request record")
        assert records[0].model == "a" and records[0].upstream == engine.upstream.name
    finally:
        proxy.stop()


# --- the queue cannot be inflated by one connection (review #9) --------------------------------------------------
def test_one_connections_pipelined_burst_cannot_fill_the_queue(make_proxy: Callable[..., ProxyServer],
                                                               engine: RecordingEngine) -> None:
    proxy = make_proxy(limits=Limits(queued=64))  # no engine yet: requests wait
    burst = post("/v1/completions").replace(b"Connection: close\r\n", b"") + \
        b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 5000
    a = socket.create_connection(("127.0.0.1", proxy.port), timeout=20)
    a.sendall(burst)
    eventually(lambda: proxy.queued >= 1, "client A's request to wait")
    assert proxy.queued <= Limits().pipelined + 1
    results: list[int] = []
    b = threading.Thread(target=lambda: results.append(httpx.post(
        proxy.url + "/v1/completions", json={"prompt": "b"}, trust_env=False, timeout=30).status_code))
    b.start()
    eventually(lambda: proxy.queued >= 2, "client B's request to wait too")
    proxy.set_upstream(engine.upstream)
    b.join(30)
    a.close()
    assert results == [200]


# --- a failed loading stream is recorded like any other answer (review #16) -------------------------------------
def test_a_stream_whose_model_never_loads_leaves_no_inflight_entry() -> None:
    log = RequestLog()
    proxy = ProxyServer(port=0, model_name="stable", wait_timeout=30)
    loads: list[str] = []
    proxy.set_models({"m": {}}, on_demand=loads.append, loading_status=["m"])
    proxy.router.routes["m"].idle = True
    log.attach(proxy)
    proxy.start()
    try:
        events: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", proxy.url + "/v1/chat/completions", trust_env=False, timeout=30,
                              json={"model": "m", "stream": True, "messages": []}) as response:
                events.extend(response.iter_lines())

        client = threading.Thread(target=stream)
        client.start()
        eventually(lambda: loads == ["m"] and len(log.inflight()) == 1, "the load to be asked for")
        started = log.inflight()[0]
        eventually(lambda: any(line.startswith(": loading model m") for line in events), "a loading note")
        proxy.set_upstream(None, down_reason="the model does not fit", model="m")
        client.join(30)
        assert any(line.startswith(": loading model m") for line in events)
        assert any("the model does not fit" in line for line in events if line.startswith("data:"))
        eventually(lambda: log.inflight() == [], "the in-flight entry to be gone")
        finished = log.recent()[-1]
        assert (finished.seq, finished.model, finished.client) == (started.seq, "m", started.client)
        assert finished.failed and not finished.client_error
    finally:
        proxy.stop()


# --- a client's 4xx is not a failure (issue 24 item 6) -----------------------------------------------------------
def test_client_errors_are_counted_apart_from_failures(make_proxy: Callable[..., ProxyServer]) -> None:
    def answer_400(conn: socket.socket, _index: int) -> None:
        leftover = b""
        while True:
            _head, _body, leftover = read_request(conn, leftover)
            body = b'{"error": {"message": "bad prompt"}}'
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))

    bad = RawEngine(answer_400)
    try:
        proxy = make_proxy(retry_window=1.0)
        records: list[RequestRecord] = []
        proxy.subscribe(records.append)
        proxy.set_upstream(bad.upstream)
        assert httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, trust_env=False).status_code == 400
        eventually(lambda: len(records) == 1, "the record")
        assert proxy.counters["client_errors"] == 1 and proxy.counters["failed"] == 0
        assert records[0].client_error and not records[0].failed
        assert not [s for s in records[0].to_samples() if s.series == "proxy_failed"]
        proxy.set_upstream(Upstream("gone", "gone", f"http://127.0.0.1:{find_free_port()}", "m"))  # refuses
        response = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, trust_env=False, timeout=60)
        assert response.status_code in (502, 503)
        eventually(lambda: len(records) == 2, "the second record")
        assert proxy.counters["failed"] == 1 and records[1].failed
    finally:
        bad.close()
    assert RequestRecord(0, "POST", "/", None, 200, True, None, 1.0, 3, "stream cut").failed
    assert RequestRecord(0, "POST", "/", None, 499, True, None, 1.0, None, "left").client_error


# --- Windows: no select.poll (issue 21 item 5) -------------------------------------------------------------------
def test_the_pool_reuses_connections_without_select_poll(monkeypatch: pytest.MonkeyPatch,
                                                         make_proxy: Callable[..., ProxyServer],
                                                         engine: RecordingEngine,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delattr(select, "poll")
    proxy = make_proxy()
    proxy.set_upstream(engine.upstream)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, trust_env=False).status_code == 200
    assert engine.accepted == 1  # one pooled engine connection carried all three
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# --- the real llama-server behind the endpoint -------------------------------------------------------------------
@pytest.mark.engine
@pytest.mark.llamacpp
def test_real_llama_server_admin_routes_are_closed_and_inference_still_works(llama_server: Any) -> None:
    base = llama_server.base_url
    proxy = ProxyServer(port=0, model_name="stable", extra_routes=[])
    opted = ProxyServer(port=0, model_name="stable", extra_routes=["/props"])
    upstream = Upstream("llama.cpp@real", "llama.cpp", base, llama_server.plan.served_model_name)
    proxy.start()
    opted.start()
    try:
        proxy.set_upstream(upstream)
        opted.set_upstream(upstream)
        with httpx.Client(trust_env=False, timeout=120) as client:
            assert client.get(base + "/slots").status_code == 200  # the engine has them (with --slots, --metrics)
            assert client.get(base + "/props").status_code == 200
            for method, path in [("GET", "/slots"), ("GET", "/props"), ("POST", "/slots/0?action=erase"),
                                 ("GET", "/metrics"), ("POST", "/props"), ("POST", "/lora-adapters")]:
                response = client.request(method, proxy.url + path, json={} if method == "POST" else None)
                assert response.status_code == 404, (method, path, response.text[:200])
                assert "the endpoint forwards only" in response.json()["error"]["message"]
            assert client.get(opted.url + "/props").status_code == 200  # opted in: forwarded
            chat = client.post(proxy.url + "/v1/chat/completions", json={
                "model": "anything", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
            assert chat.status_code == 200 and chat.json()["choices"][0]["message"]
            for path, body in [("/v1/embeddings", {"model": "x", "input": "hello"}),
                               ("/v1/responses", {"model": "x", "input": "Hi", "max_output_tokens": 4})]:
                direct = client.post(base + path, json=body)
                through = client.post(proxy.url + path, json=body)
                # Forwarded: the engine's own answer (200, or its "start with --embeddings"), never the endpoint's 404.
                assert through.status_code == direct.status_code, (path, through.text[:300], direct.text[:300])
                assert "the endpoint forwards only" not in through.text
    finally:
        proxy.stop()
        opted.stop()


@pytest.mark.engine
@pytest.mark.vllm
def test_real_vllm_side_routes_are_closed_through_the_endpoint(vllm_server: Any) -> None:
    """vLLM's /invocations is the same inference as /v1 without its key check; /tokenize, /pause, /pooling,
    /metrics answer anyone on its port. None is reachable through the endpoint; /v1/completions is."""
    base = vllm_server.base_url
    proxy = ProxyServer(port=0, model_name="stable")
    proxy.start()
    try:
        proxy.set_upstream(Upstream("vllm@real", "vllm", base, vllm_server.plan.served_model_name))
        body = {"model": "x", "prompt": "Hi", "max_tokens": 2}
        with httpx.Client(trust_env=False, timeout=300) as client:
            assert client.post(base + "/tokenize", json={"prompt": "Hi"}).status_code == 200  # open on its port
            for path in ["/invocations", "/tokenize", "/pause", "/pooling", "/metrics", "/collective_rpc",
                         "/sleep?level=1"]:
                response = client.post(proxy.url + path, json=body)
                assert response.status_code == 404, (path, response.text[:200])
            assert client.get(base + "/health").status_code == 200  # /pause never reached it: still serving
            through = client.post(proxy.url + "/v1/completions", json=body)
            assert through.status_code == 200 and through.json()["choices"]
    finally:
        proxy.stop()
