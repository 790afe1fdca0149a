"""Keyless traffic never holds what a keyed client needs (issue 50, item 1): `/health` takes no body and control
paths take none without their token (both refused from the head), a connection counts as trusted only once a
request of it showed its credential, and a body must keep arriving and arrive whole within its deadline, so bytes
sent first buy no stalling. Each lock-out here left a keyed request 503 on 7638391 (and on 5c464e9, the commit
before the fix); the expected statuses are the HTTP ones the README's security paragraph states."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from test_endpoint_front import RecordingEngine
from test_endpoint_guard import eventually, find_free_port, make_proxy, read_response

from desktop.core.serving import control
from desktop.core.serving.http1 import Limits
from desktop.core.serving.proxy import ProxyServer
from desktop.core.serving.requestlog import RequestLog

__all__ = ["make_proxy"]
KEY = "sk-keyed-client"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMPLETION = {"model": "stable", "prompt": "hi"}


def head(method: str, path: str, length: int, extra: str = "") -> bytes:
    """A request head announcing a body of `length` bytes, without any key."""
    return f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}Content-Length: {length}\r\n\r\n".encode()


@pytest.fixture
def engine() -> Iterator[RecordingEngine]:
    recording = RecordingEngine()
    yield recording
    recording.close()


def answer_or_drop(sock: socket.socket) -> tuple[int, str, bool] | None:
    """(status, Connection header, whether it says /health takes no body), or None where the socket was dropped
    (one of them makes room for the keyed client)."""
    try:
        status, headers, body, _ = read_response(sock)
    except (OSError, AssertionError):
        return None
    return status, headers.get("connection", ""), b"/health takes no request body" in body


def keyed_post(proxy: ProxyServer) -> int:
    return httpx.post(proxy.url + "/v1/completions", json=COMPLETION, headers=AUTH, trust_env=False,
                      timeout=20).status_code


def test_8_keyless_health_tricklers_at_caps_8_8_leave_a_keyed_request_200(
        make_proxy: Callable[..., ProxyServer], engine: RecordingEngine) -> None:
    proxy = make_proxy(api_key=KEY, limits=Limits(connections=8, per_peer=8))
    proxy.set_upstream(engine.upstream)
    tricklers = []
    try:
        for index in range(8):
            sock = socket.create_connection(("127.0.0.1", proxy.port), 10, (f"127.0.0.{2 + index % 4}", 0))
            sock.sendall(head("POST", "/health", 100000) + b"{")
            tricklers.append(sock)
        eventually(lambda: len(proxy.guard.open) + len(proxy.guard.dying) >= 8 or
                   all(c.lingering for c in list(proxy.connections)), "the tricklers to be held or refused")
        assert keyed_post(proxy) == 200
        answers = [answer_or_drop(sock) for sock in tricklers]  # refused from its head, its body never read
        assert answers.count((400, "close", True)) >= 7 and set(answers) <= {(400, "close", True), None}, answers
        # the keyed body leaves the budget once its answer is done (just after the client has it): none is the tricklers'
        eventually(lambda: proxy.guard.buffered == 0, "the budget to hold no body")
    finally:
        for sock in tricklers:
            sock.close()


def test_512_keyless_health_heads_announcing_a_body_leave_5_keyed_requests_in_a_row_200(
        make_proxy: Callable[..., ProxyServer], engine: RecordingEngine) -> None:
    """Default limits: 512 connections per peer (every loopback address is one), each `POST /health` with
    `Content-Length: 1000` and no body."""
    proxy = make_proxy(api_key=KEY)
    assert proxy.guard.max_per_peer == 512
    proxy.set_upstream(engine.upstream)
    heads = []
    try:
        for _ in range(512):
            sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
            sock.sendall(head("POST", "/health", 1000))
            heads.append(sock)
        assert [keyed_post(proxy) for _ in range(5)] == [200] * 5
        assert not any(c.trusted for c in list(proxy.connections) if c.lingering)
    finally:
        for sock in heads:
            sock.close()


def test_4_keyless_health_bodies_of_64_mib_less_a_byte_that_stall_leave_a_keyed_post_200(
        make_proxy: Callable[..., ProxyServer], engine: RecordingEngine) -> None:
    """4 x (64 MiB - 1) used to fill the 256 MiB body budget until the minimum rate caught up, ~4,100 s later."""
    proxy = make_proxy(api_key=KEY)
    proxy.set_upstream(engine.upstream)
    stalled = []
    try:
        for _ in range(4):
            sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
            stalled.append(sock)
            try:
                sock.sendall(head("POST", "/health", 64 << 20) + b"x" * ((64 << 20) - 1))
            except OSError:
                pass  # refused from its head: the endpoint drops the socket after a few KiB of the body
        assert keyed_post(proxy) == 200
        assert proxy.guard.buffered < 1 << 20
    finally:
        for sock in stalled:
            sock.close()


def test_a_control_request_without_the_token_is_refused_from_its_head_and_its_body_never_read(
        engine: RecordingEngine) -> None:
    token = control.new_token()
    proxy = ProxyServer(port=find_free_port(), model_name="stable", api_key=KEY)
    proxy.add_routes(control.request_routes(RequestLog(), token))
    proxy.start()
    try:
        proxy.set_upstream(engine.upstream)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
            sock.sendall(head("POST", "/switchyard/requests", 1000, f"Authorization: Bearer {KEY}\r\n"))
            status, headers, body, _ = read_response(sock)  # at once: no body was sent, none is waited for
            assert status == 403 and headers.get("connection") == "close"
            assert b"missing or wrong control token" in body
        assert proxy.guard.buffered == 0
        shown = httpx.get(proxy.url + "/switchyard/requests", headers={control.TOKEN_HEADER: token},
                          trust_env=False, timeout=10)
        assert shown.status_code == 200
    finally:
        proxy.stop()


def test_a_keyless_health_check_does_not_make_its_connection_trusted(
        make_proxy: Callable[..., ProxyServer], engine: RecordingEngine) -> None:
    """Caps 2/2: a keyed connection idle the longest and a keyless `/health` one; a third (keyed) makes room by
    dropping the keyless one, not the keyed one that has waited longer."""
    proxy = make_proxy(api_key=KEY, limits=Limits(connections=2, per_peer=2))
    proxy.set_upstream(engine.upstream)
    models = f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as keyed, \
            socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as keyless:
        keyed.sendall(models)
        assert read_response(keyed)[0] == 200
        keyless.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(keyless)[0] == 200
        eventually(lambda: all(c.phase == "idle" for c in list(proxy.connections)), "both to be idle")
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as third:
            third.sendall(models)
            assert read_response(third)[0] == 200
            assert keyless.recv(1) == b""  # dropped to make room
            keyed.sendall(models)
            assert read_response(keyed)[0] == 200  # still held


def test_a_keyed_body_sent_fast_then_stalled_is_closed_within_two_grace_periods(
        make_proxy: Callable[..., ProxyServer]) -> None:
    """1 MiB of a 64 MiB body at once, then nothing: the average since the head (1 KiB/s here) would have kept it
    for ~1,000 s; the rate within each grace period since closes it."""
    proxy = make_proxy(api_key=KEY, limits=Limits(body_grace_s=1.0, body_min_rate=1024))
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(head("POST", "/v1/completions", 64 << 20, f"Authorization: Bearer {KEY}\r\n")
                     + b" " * (1 << 20))
        sent = time.monotonic()
        status, _, body, _ = read_response(sock)
        took = time.monotonic() - sent
    assert status == 408 and b"stalled" in body
    assert took < 6.0, took
    eventually(lambda: proxy.guard.buffered == 0, "the body to leave the budget")


def test_a_keyed_body_must_arrive_whole_within_the_body_deadline(make_proxy: Callable[..., ProxyServer]) -> None:
    proxy = make_proxy(api_key=KEY, limits=Limits(body_timeout_s=1.0))
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=8) as sock:
        sock.sendall(head("POST", "/v1/completions", 1000, f"Authorization: Bearer {KEY}\r\n") + b"{")
        sent = time.monotonic()
        status, _, body, _ = read_response(sock)
        took = time.monotonic() - sent
    assert status == 408 and b"did not arrive within 1 s" in body
    assert 0.9 <= took < 4.0, took
