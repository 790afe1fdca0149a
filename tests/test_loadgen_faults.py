"""Load generator against fake servers on loopback: faults a real engine will not produce on demand."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from desktop.cli import main
from desktop.core.measure.loadgen import LoadConfig, RandomWorkload, Target, run_load, run_sweep, sweep_levels
from desktop.core.storage.history import Store

# --- fake servers: raw asyncio on loopback, full control of the bytes ------------------------------------
Handler = Callable[["FakeServer", dict[str, Any], asyncio.StreamWriter], Awaitable[None]]


def sse(payload: dict[str, Any] | str) -> bytes:
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {text}\n\n".encode()


def token_chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def usage_chunk(prompt: int, completion: int) -> dict[str, Any]:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                     "total_tokens": prompt + completion}}


STREAM_HEADERS = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"


class FakeServer:
    """Accepts HTTP/1.1 requests on 127.0.0.1 and lets a handler write whatever bytes it likes."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.tls = tls
        self.requests: list[dict[str, Any]] = []
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> FakeServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"

    async def shutdown(self) -> None:
        """Stop listening and drop every open connection (a server that dies)."""
        if self.server is not None:
            self.server.close()
            for writer in list(self.writers):
                writer.transport.abort()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = next((int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length")), 0)
            body = json.loads(await reader.readexactly(length)) if length else {}
            request = {"method": method, "path": path, "body": body}
            if path == "/v1/models":
                payload = json.dumps({"data": [{"id": "fake-model"}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            elif not path.startswith("/v1/"):  # e.g. /tokenize: an OpenAI-only server has none
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            else:
                self.requests.append(request)
                await self.handler(self, body, writer)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()


async def stream_tokens(writer: asyncio.StreamWriter, tokens: int, *, prompt: int = 5, usage: bool = True,
                        split: int | None = None) -> None:
    """A well-behaved stream: `tokens` chunks, then usage, then [DONE]; optionally written in `split`-byte pieces."""
    data = bytearray(STREAM_HEADERS)
    for i in range(tokens):
        data += sse(token_chunk(f" tok{i}é", "length" if i == tokens - 1 else None))
    if usage:
        data += sse(usage_chunk(prompt, tokens))
    data += sse("[DONE]")
    if split is None:
        writer.write(bytes(data))
        await writer.drain()
        return
    for start in range(0, len(data), split):
        writer.write(bytes(data[start:start + split]))
        await writer.drain()
        await asyncio.sleep(0)  # hand the piece to the socket before the next one


WORKLOAD = RandomWorkload(input_len=8, output_len=6)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_ok_stream_counts_and_request_body() -> None:
    async def handler(server: FakeServer, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        await stream_tokens(writer, body["max_tokens"], prompt=9)

    async def main() -> Any:
        async with FakeServer(handler) as server:
            result = await run_load(Target(server.url), WORKLOAD, LoadConfig(concurrency=4, num_requests=12))
            return result, server.requests

    result, requests = run(main())
    s = result.summary
    assert (s.completed, s.failed) == (12, 0)
    assert s.total_output_tokens == 12 * 6 and s.total_input_tokens == 12 * 9
    assert not s.tokens_estimated
    assert result.model == "fake-model"
    body = requests[0]["body"]
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 6
    assert body["model"] == "fake-model"
    assert all(len(r.itl) == 5 for r in result.requests)
    assert s.max_concurrent_requests >= 1 and s.output_throughput > 0


def test_sse_split_at_odd_boundaries() -> None:
    async def handler(server: FakeServer, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        await stream_tokens(writer, 6, split=3)  # cuts "data:", JSON and the 2-byte 'é' apart

    async def main() -> Any:
        async with FakeServer(handler) as server:
            return await run_load(Target(server.url), WORKLOAD, LoadConfig(concurrency=2, num_requests=4))

    result = run(main())
    assert result.summary.completed == 4 and result.summary.failed == 0
    assert [r.output_tokens for r in result.requests] == [6, 6, 6, 6]
    assert all(len(r.itl) == 5 for r in result.requests)


def test_no_usage_means_estimated_tokens() -> None:
    async def handler(server: FakeServer, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        await stream_tokens(writer, 5, usage=False)

    async def main() -> Any:
        async with FakeServer(handler) as server:
            return await run_load(Target(server.url), WORKLOAD, LoadConfig(concurrency=1, num_requests=2))

    result = run(main())
    assert result.summary.tokens_estimated and result.summary.total_output_tokens == 10
    assert any("estimated" in w for w in result.warnings)


def test_all_requests_failing() -> None:
    async def handler(server: FakeServer, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        payload = json.dumps({"error": {"message": "model 'x' not found", "code": 404}}).encode()
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)

    async def main() -> Any:
        async with FakeServer(handler) as server:
            return await run_load(Target(server.url), WORKLOAD, LoadConfig(concurrency=3, num_requests=6))

    result = run(main())
    s = result.summary
    assert (s.completed, s.failed, s.error_rate) == (0, 6, 1.0)
    assert s.errors == {"HTTP 404": 6}
    assert result.aborted is not None and "all 6 requests failed" in result.aborted
    assert "model 'x' not found" in result.aborted
    assert s.output_throughput == 0 and s.ttft.median == 0


def test_zero_length_outputs_fail_clearly() -> None:
    async def handler(server: FakeServer, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        writer.write(STREAM_HEADERS + sse(token_chunk("", "stop")) + sse({"choices": [], "usage": {
            "prompt_tokens": 3, "completion_tokens": 0}}) + sse("[DONE]"))

    async def main() -> Any:
        async with FakeServer(handler) as server:
            return await run_load(Target(server.url), WORKLOAD, LoadConfig(concurrency=2, num_requests=3))

    result = run(main())
    assert result.summary.completed == 0 and result.summary.failed == 3
    assert all(r.error and r.error.startswith("empty output") for r in result.requests)


def test_server_that_does_not_stream() -> None:
    async def handler(server: FakeServer, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        payload = json.dumps({"choices": [{"text": "a b c", "finish_reason": "length"}],
                              "usage": {"prompt_tokens": 4, "completion_tokens": 3}}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)

    async def main() -> Any:
        async with FakeServer(handler) as server:
            return await run_load(Target(server.url), WORKLOAD, LoadConfig(concurrency=2, num_requests=4))

    result = run(main())
    s = result.summary
    assert s.completed == 4 and s.total_output_tokens == 12 and s.not_streamed == 4
    assert all(r.ttft == r.latency and not r.itl for r in result.requests)
    assert any("not streamed" in w for w in result.warnings)


def test_stuck_request_times_out() -> None:
    release = asyncio.Event()

    async def handler(server: FakeServer, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        if len(server.requests) == 2:  # the second request hangs after one token
            writer.write(STREAM_HEADERS + sse(token_chunk("x")))
            await writer.drain()
            await release.wait()
            return
        await stream_tokens(writer, 3)

    async def main() -> Any:
        async with FakeServer(handler) as server:
            try:
                return await run_load(Target(server.url), WORKLOAD,
                                      LoadConfig(concurrency=1, num_requests=3, request_timeout_s=0.5))
            finally:
                release.set()

    result = run(main())
    assert result.summary.completed == 2 and result.summary.failed == 1
    stuck = result.requests[1]
    assert stuck.error is not None and stuck.error.startswith("timeout") and "1 tokens" in stuck.error
    assert 0.5 <= stuck.elapsed < 5


def test_server_dies_mid_run_keeps_partial_results() -> None:
    async def handler(server: FakeServer, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        if len(server.requests) <= 5:
            await stream_tokens(writer, 4)
            return
        writer.write(STREAM_HEADERS + sse(token_chunk("x")))  # the sixth request: one token, then death
        await writer.drain()
        await server.shutdown()

    async def main() -> Any:
        async with FakeServer(handler) as server:
            levels = sweep_levels(LoadConfig(num_requests=40), concurrency=[1, 4])
            return await run_sweep(Target(server.url), WORKLOAD, levels)

    sweep = run(main())
    assert len(sweep.levels) == 1  # the sweep stops at the level where the server died
    result = sweep.levels[0]
    assert result.summary.completed == 5
    assert result.requests[5].error is not None and result.requests[5].error.startswith("connection lost")
    assert result.aborted is not None and "stopped accepting connections" in result.aborted
    assert len(result.requests) < 40  # it stopped sending instead of failing all 40
    assert sweep.aborted == result.aborted


def test_warmup_and_cooldown_are_excluded_and_keep_load_steady() -> None:
    async def handler(server: FakeServer, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        await stream_tokens(writer, 3)

    async def main() -> Any:
        async with FakeServer(handler) as server:
            config = LoadConfig(concurrency=2, num_requests=6, warmup_requests=2, cooldown_requests=10)
            return await run_load(Target(server.url), WORKLOAD, config), len(server.requests)

    result, sent = run(main())
    phases = [r.phase for r in result.requests]
    assert phases[:2] == ["warmup", "warmup"] and phases[2:8] == ["measure"] * 6
    assert result.summary.completed == 6
    assert 8 <= sent <= 18  # cool-down requests stop once the measured ones are done


def test_open_loop_rate_and_duration_bound() -> None:
    async def handler(server: FakeServer, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        await stream_tokens(writer, 2)

    async def main() -> Any:
        async with FakeServer(handler) as server:
            config = LoadConfig(concurrency=None, rate=40.0, arrival="constant", num_requests=None, duration_s=1.0)
            return await run_load(Target(server.url), WORKLOAD, config)

    result = run(main())
    assert 30 <= result.summary.completed <= 42
    assert result.summary.failed == 0
    starts = [r.start for r in result.requests]
    assert starts[-1] - starts[0] == pytest.approx(1.0, abs=0.15)


def test_live_buckets_reach_the_callback() -> None:
    async def handler(server: FakeServer, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        await stream_tokens(writer, 2)

    seen: list[Any] = []

    async def main() -> Any:
        async with FakeServer(handler) as server:
            config = LoadConfig(concurrency=2, num_requests=None, duration_s=2.2)
            return await run_load(Target(server.url), WORKLOAD, config, on_bucket=seen.append)

    result = run(main())
    assert len(seen) >= 2 and seen == result.buckets
    assert [b.second for b in seen[:2]] == [1, 2]
    assert sum(b.completed for b in seen) <= len(result.requests)
    assert seen[0].output_tokens > 0 and seen[0].ttft_p50_ms is not None
    assert 0.0 <= result.client_cpu <= 1.5


class ThreadedServer:
    """A FakeServer on its own event loop in a thread, for code that runs its own loop (the CLI)."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = FakeServer(handler, tls)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.__aenter__(), self.loop).result(10)
        return self.server

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def test_cli_bench_endpoint_writes_json_and_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))

    async def handler(server: FakeServer, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        await stream_tokens(writer, body["max_tokens"])

    with ThreadedServer(handler) as server:
        code = main(["bench", "--endpoint", server.url, "--concurrency", "1,2", "--requests", "3",
                     "--output-len", "4", "--json", str(tmp_path / "r.json"), "--report", str(tmp_path / "rep")])
    assert code == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert [lvl["completed"] for lvl in data["levels"]] == [3, 3]
    assert data["levels"][1]["max_concurrency"] == 2 and data["levels"][0]["total_output_tokens"] == 12
    assert "concurrency 2" in capsys.readouterr().out
    assert (tmp_path / "rep" / "bench.html").is_file()
    with Store() as store:
        (run,) = store.runs()
        assert run.kind == "bench" and run.summary["levels"][0]["completed"] == 3


def test_cli_bench_dead_endpoint_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    with socket.socket() as probe:  # a port with nobody listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = main(["bench", "--endpoint", f"http://127.0.0.1:{port}", "--concurrency", "1", "--requests", "5",
                 "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code != 0
    # checked before the load starts: one line naming the address, not five failed requests
    assert f"cannot reach http://127.0.0.1:{port}: connection refused" in err and "Traceback" not in err
    assert not (tmp_path / "r.json").exists()


# --- TTFT at the first generated token: reasoning (both names) and tool calls count (issue 34) ----------------
def _reasoning_chunk(name: str) -> dict[str, Any]:
    if name == "tool_calls":
        return {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
            "finish_reason": None}]}
    return {"choices": [{"index": 0, "delta": {name: "Let me think."}, "finish_reason": None}]}


@pytest.mark.parametrize("first", ["reasoning", "reasoning_content", "tool_calls"])
def test_parse_chunk_counts_reasoning_and_tool_call_deltas_as_tokens(first: str) -> None:
    from desktop.core.common.sse import parse_chunk

    delta = parse_chunk(json.dumps(_reasoning_chunk(first)))
    assert delta is not None and delta.has_token
    assert delta.text == ("" if first == "tool_calls" else "Let me think.")
    both = parse_chunk(json.dumps({"choices": [{"delta": {"reasoning": "x", "reasoning_content": "x"}}]}))
    assert both is not None and both.text == "x"  # one text under two names, counted once
    empty = parse_chunk(json.dumps({"choices": [{"delta": {"role": "assistant", "content": ""}}]}))
    assert empty is not None and not empty.has_token


CONTENT_AFTER_S = 1.5  # how long the stand-in thinks before the first answer token


@pytest.mark.parametrize("first", ["reasoning", "reasoning_content", "tool_calls"])
def test_cli_bench_endpoint_reads_ttft_at_the_first_reasoning_or_tool_call_token(
        first: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that streams reasoning (vLLM's and llama.cpp's names) or a tool call at once and its answer 1.5 s
    later: TTFT is the first of those, as the user sees tokens arrive, not the first answer token."""
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))

    async def handler(server: FakeServer, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        writer.write(STREAM_HEADERS + sse(_reasoning_chunk(first)))
        await writer.drain()
        await asyncio.sleep(CONTENT_AFTER_S)  # the server's behaviour under test, not a wait for the client
        data = b"".join(sse({"choices": [{"index": 0, "delta": {"content": f" tok{i}"},
                                          "finish_reason": "length" if i == 2 else None}]}) for i in range(3))
        writer.write(data + sse(usage_chunk(5, 4)) + sse("[DONE]"))
        await writer.drain()

    with ThreadedServer(handler) as server:
        code = main(["bench", "--endpoint", server.url, "--concurrency", "1", "--requests", "2",
                     "--output-len", "4", "--json", str(tmp_path / "r.json")])
    assert code == 0
    (level,) = json.loads((tmp_path / "r.json").read_text())["levels"]
    assert level["completed"] == 2
    assert level["median_ttft_ms"] < CONTENT_AFTER_S * 1000 / 2, level["median_ttft_ms"]
    assert level["median_e2el_ms"] >= CONTENT_AFTER_S * 1000
