"""The endpoint under hostile local clients: a well-behaved client streaming at concurrency 4 (the real `openai`
library, no retries) beside pipelined non-readers, trickling bodies (keyless and keyed), 4 MiB `model` names,
header bombs, mid-stream hang-ups and `/metrics` scrapes, all at once against one `ProxyServer` in its own process
in front of a stand-in engine (SSE, 16 tokens 5 ms apart). Prints the good client's TTFT p95 quiet and under
attack (their ratio), its failed requests, the endpoint's peak RSS growth, and the slowest and largest scrape.

    .venv/bin/python benchmarks/bench_hostile.py [--seconds 60] [--json] [--output FILE]

tests/test_endpoint_hostile.py runs the same attack for 60 s in CI and asserts 0 failed requests and the RSS
bound; the TTFT ratio is measured here, on a quiet machine, not asserted there. Loopback only; no real engine (the
point is the endpoint's front end, and a stand-in answers fast enough to keep the endpoint the bottleneck).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
KEY = "hostile-bench-key"
FOUR_MIB = 4 << 20


# --- the endpoint, in its own process -----------------------------------------------------------------------
def child_main(engine_url: str, key: str, limits_json: str) -> None:
    """`--endpoint`: a ProxyServer with its request log and `/metrics` (as EndpointHost composes them) in front of
    `engine_url`; prints `PORT TOKEN`, serves until stdin closes."""
    sys.path.insert(0, str(ROOT))
    from desktop.core.serving import control
    from desktop.core.serving.http1 import Limits
    from desktop.core.serving.proxy import ProxyServer, Upstream
    from desktop.core.serving.requestlog import RequestLog

    proxy = ProxyServer(port=0, model_name="stable", api_key=key or None, limits=Limits(**json.loads(limits_json)))
    request_log = RequestLog()
    request_log.attach(proxy)
    token = control.new_token()
    proxy.add_routes(control.request_routes(request_log, token, lambda: False, model_names=proxy.served_names))
    proxy.start()
    proxy.set_upstream(Upstream("stand-in", "standin", engine_url, "m"))
    print(proxy.port, token, flush=True)
    sys.stdin.read()
    proxy.stop()
    request_log.stop()


class Child:
    """One part of the run in a process of its own (this file, in one of its child modes): it prints a line of
    words when ready and runs until its stdin closes."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env)
        assert self.process.stdout is not None
        self.words = self.process.stdout.readline().split()
        if not self.words:
            self.close()
            raise RuntimeError(f"{' '.join(args[:1])} did not start")
        self.ps = psutil.Process(self.process.pid)

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


class ChildEndpoint(Child):
    """The endpoint process: its port, control token and RSS."""

    def __init__(self, engine_url: str, key: str = KEY, **limits: Any) -> None:
        super().__init__("--endpoint", engine_url, key, json.dumps(limits))
        self.port, self.token = int(self.words[0]), self.words[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def rss(self) -> int:
        return int(self.ps.memory_info().rss)

    def client_sockets(self) -> int:
        """Established TCP connections the endpoint holds on its port."""
        return sum(1 for c in self.ps.net_connections("tcp")
                   if c.laddr and c.laddr.port == self.port and c.status == psutil.CONN_ESTABLISHED)


# --- a stand-in engine ----------------------------------------------------------------------------------------
class StandInEngine:
    """Answers every request on a TCP port: an SSE stream of `tokens` completions chunks `gap_s` apart when the body
    asks to stream, else a small JSON answer. Thread per connection; reads whole bodies (4 MiB names too)."""

    def __init__(self, tokens: int = 16, gap_s: float = 0.005) -> None:
        self.tokens, self.gap_s = tokens, gap_s
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(256)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.requests = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each token leaves at once, as an engine's
        with conn:
            data = b""
            try:
                while True:
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(1 << 20)
                        if not chunk:
                            return
                        data += chunk
                    head, _, data = data.partition(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    while len(data) < length:
                        chunk = conn.recv(1 << 20)
                        if not chunk:
                            return
                        data += chunk
                    body, data = data[:length], data[length:]
                    self.requests += 1
                    self._answer(conn, b'"stream": true' in body or b'"stream":true' in body)
            except OSError:
                return

    def _answer(self, conn: socket.socket, stream: bool) -> None:
        if not stream:
            payload = b'{"choices":[{"text":"ok","index":0}],"usage":{"prompt_tokens":1,"completion_tokens":1}}'
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(payload), payload))
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for index in range(self.tokens):
            event = b'data: {"id":"c","object":"text_completion","choices":[{"text":"t%d","index":0}]}\n\n' % index
            conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
            time.sleep(self.gap_s)  # the stand-in's generation time, not synchronisation
        done = b"data: [DONE]\n\n"
        conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

    def close(self) -> None:
        self.listener.close()


def engine_main() -> None:
    """`--engine`: the stand-in engine; prints its URL."""
    engine = StandInEngine()
    print(engine.url, flush=True)
    sys.stdin.read()
    engine.close()


def attack_main(port: int) -> None:
    """`--attack PORT`: every attacker against the endpoint on PORT until stdin closes (in a process of its own,
    so that the good client's TTFT is not the attackers' share of one interpreter)."""
    stop = threading.Event()
    threads = [threading.Thread(target=attack, args=(port, stop), kwargs=options, daemon=True)
               for _name, count, attack, options in ATTACKERS for _ in range(count)]
    for thread in threads:
        thread.start()
    print("attacking", flush=True)
    sys.stdin.read()
    stop.set()
    for thread in threads:
        thread.join(30)


# --- the clients ----------------------------------------------------------------------------------------------
@dataclass
class GoodClient:
    """Streams completions through the real openai library at concurrency `concurrency`, no retries."""

    url: str
    concurrency: int = 4
    ttfts: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    done: int = 0

    def run(self, stop: threading.Event) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._loop, args=(stop,), daemon=True) for _ in range(self.concurrency)]
        for thread in threads:
            thread.start()
        return threads

    def _loop(self, stop: threading.Event) -> None:
        import httpx
        import openai

        client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=60,
                               http_client=httpx.Client(trust_env=False, timeout=60))
        while not stop.is_set():
            started = time.perf_counter()
            first: float | None = None
            try:
                text = ""
                for chunk in client.completions.create(model="stable", prompt="hi", max_tokens=16, stream=True):
                    if chunk.choices and chunk.choices[0].text:
                        if first is None:
                            first = time.perf_counter() - started
                        text += chunk.choices[0].text
                if first is None or not text.startswith("t0"):
                    raise RuntimeError(f"an incomplete answer: {text!r}")
                self.ttfts.append(first)
                self.done += 1
            except Exception as exc:  # every failure is counted and named
                self.failures.append(f"{type(exc).__name__}: {exc}"[:300])
        client.close()


def _connect(port: int, rcvbuf: int = 0) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(2)
    sock.connect(("127.0.0.1", port))
    return sock


def _reset(sock: socket.socket) -> None:
    """Hang up hard (RST), as a killed client does."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def pipelined_non_reader(port: int, stop: threading.Event, hold_s: float = 5.0) -> None:
    """Pipelines 404s that quote a long path and `/v1/models`, never reads; sends until TCP blocks, holds, again."""
    one = b"GET /" + b"a" * 30000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    while not stop.is_set():
        try:
            sock = _connect(port, rcvbuf=4096)
            try:
                for _ in range(1000):
                    sock.sendall(one)
            except OSError:
                pass  # blocked (the endpoint stopped reading) or dropped
            stop.wait(hold_s)
            _reset(sock)
        except OSError:
            stop.wait(0.1)


def trickling_body(port: int, stop: threading.Event, keyed: bool) -> None:
    """Declares a body (64 MiB when keyed, else 100 kB) and sends a byte now and then."""
    auth = f"Authorization: Bearer {KEY}\r\n" if keyed else ""
    size = 64 << 20 if keyed else 100000
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Length: {size}\r\n\r\n{{".encode()
    while not stop.is_set():
        try:
            with _connect(port) as sock:
                sock.sendall(head)
                while not stop.wait(0.5):
                    sock.sendall(b" ")
        except OSError:
            stop.wait(0.1)  # refused or timed out by the endpoint: again


def huge_names(port: int, stop: threading.Event) -> None:
    """Keyed, non-streamed requests whose `model` is 4 MiB, a new name each time."""
    index = 0
    while not stop.is_set():
        index += 1
        body = json.dumps({"model": f"m{index}-{os.getpid()}-" + "x" * FOUR_MIB, "prompt": "hi"}).encode()
        try:
            with _connect(port) as sock:
                sock.settimeout(30)
                sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                             f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
                while sock.recv(65536):
                    pass
        except OSError:
            stop.wait(0.1)


def header_bombs(port: int, stop: threading.Event) -> None:
    """Heads over 64 KiB: one endless header line, then 2,000 small headers."""
    bombs = [b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Bomb: " + b"a" * 70000 + b"\r\n\r\n",
             b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(2000))
             + b"\r\n"]
    index = 0
    while not stop.is_set():
        index += 1
        try:
            with _connect(port) as sock:
                sock.sendall(bombs[index % 2])
                while sock.recv(65536):
                    pass
        except OSError:
            stop.wait(0.05)


def mid_stream_hangups(port: int, stop: threading.Event) -> None:
    """Keyed streams hung up (RST) after the first bytes of the answer."""
    body = json.dumps({"model": "stable", "prompt": "hi", "max_tokens": 16, "stream": True}).encode()
    while not stop.is_set():
        try:
            sock = _connect(port)
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            sock.recv(200)
            _reset(sock)
        except OSError:
            stop.wait(0.05)


@dataclass
class Scrapes:
    """`GET /metrics` now and then: the slowest answer and the largest."""

    slowest_s: float = 0.0
    largest_bytes: int = 0
    failed: int = 0

    def loop(self, url: str, stop: threading.Event, every_s: float = 1.0) -> None:
        import httpx

        with httpx.Client(trust_env=False, timeout=30) as client:
            while not stop.wait(every_s):
                started = time.perf_counter()
                try:
                    answer = client.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
                    answer.raise_for_status()
                except httpx.HTTPError:
                    self.failed += 1
                    continue
                self.slowest_s = max(self.slowest_s, time.perf_counter() - started)
                self.largest_bytes = max(self.largest_bytes, len(answer.content))


ATTACKERS: list[tuple[str, int, Callable[..., None], dict[str, Any]]] = [
    ("pipelined non-reader", 4, pipelined_non_reader, {}),
    ("keyless trickling body", 8, trickling_body, {"keyed": False}),
    ("keyed trickling 64 MiB body", 4, trickling_body, {"keyed": True}),
    ("4 MiB model name", 2, huge_names, {}),
    ("header bomb", 2, header_bombs, {}),
    ("mid-stream hang-up", 2, mid_stream_hangups, {}),
]


@dataclass
class Phase:
    """One phase of the run: the good client's numbers and the endpoint's memory."""

    attacked: bool
    seconds: float
    requests: int
    failed: int
    failures: list[str]
    ttft_p50_ms: float
    ttft_p95_ms: float
    rss_start_mib: float
    rss_peak_mib: float
    scrape_slowest_s: float
    scrape_largest_bytes: int
    scrape_failed: int


def run_phase(endpoint: ChildEndpoint, seconds: float, attacked: bool) -> Phase:
    """The good client for `seconds`, with every attacker beside it when `attacked`; RSS sampled every 20 ms."""
    stop = threading.Event()
    start_rss = endpoint.rss()
    peak = [start_rss]

    def sample() -> None:
        while not stop.wait(0.02):
            try:
                peak[0] = max(peak[0], endpoint.rss())
            except psutil.Error:
                return

    good = GoodClient(endpoint.url)
    scrapes = Scrapes()
    threads = [threading.Thread(target=sample, daemon=True),
               threading.Thread(target=scrapes.loop, args=(endpoint.url, stop), daemon=True)]
    attackers = Child("--attack", str(endpoint.port)) if attacked else None
    for thread in threads:
        thread.start()
    started = time.monotonic()
    threads += good.run(stop)
    stop.wait(seconds)
    stop.set()
    if attackers is not None:
        attackers.close()
    for thread in threads:
        thread.join(60)
    ttfts = sorted(good.ttfts) or [float("nan")]
    return Phase(attacked, time.monotonic() - started, good.done, len(good.failures), good.failures[:5],
                 statistics.median(ttfts) * 1000, ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.95))] * 1000,
                 start_rss / 2**20, peak[0] / 2**20, scrapes.slowest_s, scrapes.largest_bytes, scrapes.failed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    engine = Child("--engine")
    endpoint = ChildEndpoint(engine.words[0])
    try:
        run_phase(endpoint, 3, attacked=False)  # warm-up: imports, pools, the first allocations
        quiet = run_phase(endpoint, args.seconds / 2, attacked=False)
        attack = run_phase(endpoint, args.seconds, attacked=True)
        after = endpoint.rss() / 2**20
    finally:
        endpoint.close()
        engine.close()
    result = {"load_avg_1m_before": load, "cores": os.cpu_count(), "quiet": asdict(quiet), "attack": asdict(attack),
              "rss_after_mib": after,
              "ttft_p95_ratio_attack_vs_quiet": attack.ttft_p95_ms / quiet.ttft_p95_ms,
              "rss_peak_growth_mib": attack.rss_peak_mib - quiet.rss_start_mib}
    text = json.dumps(result, indent=2)
    if args.output:
        args.output.write_text(text + "\n")
    if args.json:
        print(text)
        return
    print(f"load average before: {load:.2f} on {os.cpu_count()} cores")
    for phase in (quiet, attack):
        print(f"{'under attack' if phase.attacked else 'quiet':>12}: {phase.requests} requests, {phase.failed} failed, "
              f"TTFT p50 {phase.ttft_p50_ms:.1f} ms p95 {phase.ttft_p95_ms:.1f} ms, RSS {phase.rss_start_mib:.0f} -> "
              f"peak {phase.rss_peak_mib:.0f} MiB, slowest /metrics {phase.scrape_slowest_s * 1000:.0f} ms "
              f"({phase.scrape_largest_bytes} bytes)")
    print(f"TTFT p95 under attack / quiet: {result['ttft_p95_ratio_attack_vs_quiet']:.2f}; "
          f"RSS peak growth {result['rss_peak_growth_mib']:.0f} MiB; RSS after {after:.0f} MiB")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--endpoint":
        child_main(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1:] == ["--engine"]:
        engine_main()
    elif len(sys.argv) == 3 and sys.argv[1] == "--attack":
        attack_main(int(sys.argv[2]))
    else:
        main()
