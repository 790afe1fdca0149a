"""What `/metrics` costs the endpoint, as ratios against the endpoint without it, measured in one run.

1. Per request: the listener that feeds the Prometheus counters runs on the endpoint's loop for every finished
   request. Times `RequestLog.finished` with and without `EndpointMetrics` subscribed (microseconds per request).
2. Per scrape: `render()` after N requests over a few label sets (milliseconds per scrape).
3. End to end: streaming load at concurrency C through two real endpoints (ProxyServer + RequestLog, each in its
   own process as in real use), one without `/metrics` and one with it (`metrics_routes`: the counters fed from
   the request log) and a scraper hitting it every `--scrape-interval` s, both in front of one fake engine (its own
   process) that streams T chunks at once, so the endpoint's own cost is not hidden behind an engine's. Rounds
   alternate ABBA (without, with, with, without, ...) so a drift in the machine's load hits both alike; prints
   throughput with / without (goal >= 0.99), per pair, the TTFT p50 difference, each endpoint's CPU per request
   and the load average around the run. `--upstream URL` puts a real engine (e.g. a llama-server) behind both
   endpoints instead.

Numbers come from a quiet machine (the lead measures); `--smoke` runs everything tiny to prove the script works.

    .venv/bin/python benchmarks/bench_metrics.py [--requests 20000] [--concurrency 32] [--rounds 6]
        [--load-requests 512] [--scrape-interval 1.0] [--upstream URL] [--smoke] [--json] [--output FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from desktop.core.runtime.ports import find_free_port  # noqa: E402
from desktop.core.serving.metering import RequestRecord  # noqa: E402
from desktop.core.serving.metrics import EndpointMetrics, metrics_routes  # noqa: E402
from desktop.core.serving.proxy import ProxyServer, Upstream  # noqa: E402
from desktop.core.serving.requestlog import RequestLog  # noqa: E402


def _record(seq: int) -> RequestRecord:
    return RequestRecord(t=time.time(), method="POST", path="/v1/completions", upstream="u", status=200,
                         streamed=True, ttft_s=0.05, e2e_s=0.5, output_tokens=32, prompt_tokens=64,
                         model=f"m{seq % 4}", engine=("llama.cpp", "vllm")[seq % 2], seq=seq)


def per_request(count: int) -> dict[str, float]:
    records = [_record(i) for i in range(count)]
    timings = {}
    for mode in ("without", "with"):
        log = RequestLog(capacity=1000)
        metrics = EndpointMetrics(log) if mode == "with" else None
        started = time.perf_counter()
        for record in records:
            log.finished(record)
        timings[mode] = (time.perf_counter() - started) / count * 1e6
        if metrics is not None:
            started = time.perf_counter()
            for _ in range(20):
                metrics.render()
            timings["render_ms"] = (time.perf_counter() - started) / 20 * 1000
    return {"us_per_request_without": round(timings["without"], 3), "us_per_request_with": round(timings["with"], 3),
            "added_us_per_request": round(timings["with"] - timings["without"], 3),
            "render_ms_per_scrape": round(timings["render_ms"], 3)}


class FakeEngine:
    """Streams `tokens` OpenAI chunks at once for any /v1/completions."""

    def __init__(self, tokens: int, port: int | None = None) -> None:
        self.tokens = tokens
        self.port = port or find_free_port()
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        ready.set()
        self._loop.run_forever()

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(self.tokens):
            await response.write(b'data: {"choices":[{"text":"x","index":0}]}\n\n')
        await response.write(b'data: {"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":%d}}\n\n'
                             % self.tokens + b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _load(url: str, concurrency: int, requests: int, scrape: str | None, interval: float
                ) -> tuple[float, float, int]:
    ttfts: list[float] = []
    scrapes = 0
    queue = list(range(requests))
    async with httpx.AsyncClient(timeout=60, trust_env=False,
                                 limits=httpx.Limits(max_keepalive_connections=concurrency * 2)) as client:
        done = asyncio.Event()

        async def scraper() -> None:
            nonlocal scrapes
            while not done.is_set():
                assert scrape is not None
                (await client.get(scrape)).raise_for_status()
                scrapes += 1
                try:
                    await asyncio.wait_for(done.wait(), interval)
                except TimeoutError:
                    pass

        async def worker() -> None:
            while queue:
                queue.pop()
                sent = time.perf_counter()
                first = None
                async with client.stream("POST", url, json={"prompt": "hi", "max_tokens": 16, "stream": True}) as r:
                    async for _chunk in r.aiter_bytes():
                        if first is None:
                            first = time.perf_counter() - sent
                ttfts.append(first or 0.0)

        started = time.perf_counter()
        side = asyncio.create_task(scraper()) if scrape else None
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
        done.set()
        if side is not None:
            await side
    return requests / seconds, statistics.median(ttfts) * 1000, scrapes


def _child_engine(tokens: int, port: int) -> None:
    """Child mode: the fake engine until stdin closes."""
    FakeEngine(tokens, port)
    print("ready", flush=True)
    sys.stdin.read()


def _child_endpoint(upstream: str, port: int, with_metrics: bool) -> None:
    """Child mode: one endpoint (proxy + request log, with or without /metrics) until stdin closes."""
    proxy = ProxyServer(port=port, model_name="bench")
    log = RequestLog(capacity=1000)
    log.attach(proxy)
    if with_metrics:
        proxy.add_routes(metrics_routes(log))
    proxy.start()
    proxy.set_upstream(Upstream(name="bench", engine="llama.cpp", base_url=upstream, served_model_name="bench"))
    print("ready", flush=True)
    sys.stdin.read()
    proxy.stop()
    log.stop()


def _spawn(*args: str) -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE,  # noqa: S603 - this script
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    if child.stdout.readline().strip() != "ready":
        raise SystemExit(f"the child {args[0]} did not start")
    return child


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def end_to_end(concurrency: int, requests: int, rounds: int, interval: float, tokens: int,
               upstream: str | None = None) -> dict[str, Any]:
    children = []
    fake = upstream is None
    try:
        if upstream is None:
            engine_port = find_free_port()
            children.append(_spawn("--child-engine", str(tokens), str(engine_port)))
            upstream = f"http://127.0.0.1:{engine_port}"
        ports = {"without": find_free_port(), "with": find_free_port()}
        endpoints = {}
        for mode, port in ports.items():
            child = _spawn("--child-endpoint", upstream, str(port), "1" if mode == "with" else "0")
            children.append(child)
            endpoints[mode] = (child.pid, f"http://127.0.0.1:{port}")
        for _pid, url in endpoints.values():  # warm-up, not measured
            asyncio.run(_load(url + "/v1/completions", concurrency, concurrency, None, interval))
        results: dict[str, list[tuple[float, float, int]]] = {"without": [], "with": []}
        cpu = {"without": 0.0, "with": 0.0}
        load_before = os.getloadavg()[0]
        for round_index in range(rounds):
            for mode in (("without", "with") if round_index % 2 == 0 else ("with", "without")):
                pid, url = endpoints[mode]
                scrape = url + "/metrics" if mode == "with" else None
                before = _cpu_s(pid)
                results[mode].append(asyncio.run(_load(url + "/v1/completions", concurrency, requests, scrape,
                                                       interval)))
                cpu[mode] += _cpu_s(pid) - before
        load_after = os.getloadavg()[0]
    finally:
        for child in children:
            if child.stdin:
                child.stdin.close()
        for child in children:
            child.wait(30)
    total = sum(r[0] for r in results["without"]), sum(r[0] for r in results["with"])
    without = statistics.median(r[0] for r in results["without"])
    with_ = statistics.median(r[0] for r in results["with"])
    served = rounds * requests
    return {"concurrency": concurrency, "requests_per_round": requests, "rounds": rounds,
            "upstream": "fake engine (streams at once)" if fake else upstream,
            "scrape_interval_s": interval, "req_per_s_without": round(without, 2), "req_per_s_with": round(with_, 2),
            "throughput_ratio_with_over_without": round(with_ / without, 4),
            "throughput_ratio_per_pair": [round(w[0] / o[0], 4) for o, w in zip(results["without"],
                                                                                 results["with"], strict=True)],
            "mean_ratio_all_rounds": round(total[1] / total[0], 4),
            "ttft_p50_ms_without": round(statistics.median(r[1] for r in results["without"]), 3),
            "ttft_p50_ms_with": round(statistics.median(r[1] for r in results["with"]), 3),
            "endpoint_cpu_ms_per_request_without": round(cpu["without"] * 1000 / served, 4),
            "endpoint_cpu_ms_per_request_with": round(cpu["with"] * 1000 / served, 4),
            "scrapes": sum(r[2] for r in results["with"]),
            "load_average_1min": {"before": round(load_before, 2), "after": round(load_after, 2),
                                  "cpus": os.cpu_count()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000, help="records for the per-request timing")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--load-requests", type=int, default=512, help="streamed requests per round")
    parser.add_argument("--tokens", type=int, default=32, help="chunks the fake engine streams per answer")
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    parser.add_argument("--smoke", action="store_true", help="tiny settings: proves the script runs")
    parser.add_argument("--upstream", help="a real engine's URL behind both endpoints instead of the fake engine")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--output", type=Path, help="also write the results as JSON to this file")
    parser.add_argument("--child-engine", nargs=2, metavar=("TOKENS", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--child-endpoint", nargs=3, metavar=("UPSTREAM", "PORT", "METRICS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_engine:
        _child_engine(int(args.child_engine[0]), int(args.child_engine[1]))
        return 0
    if args.child_endpoint:
        _child_endpoint(args.child_endpoint[0], int(args.child_endpoint[1]), args.child_endpoint[2] == "1")
        return 0
    if args.smoke:
        args.requests, args.rounds, args.load_requests, args.concurrency = 500, 2, 16, 4
        args.scrape_interval = 0.05
    out = {"per_request": per_request(args.requests),
           "end_to_end": end_to_end(args.concurrency, args.load_requests, args.rounds, args.scrape_interval,
                                    args.tokens, args.upstream),
           "smoke": args.smoke, "quiet_machine_needed": True}
    if args.output:
        args.output.write_text(json.dumps(out, indent=2) + "\n")
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        p, e = out["per_request"], out["end_to_end"]
        print(f"per request: {p['us_per_request_without']:.2f} us without, {p['us_per_request_with']:.2f} us with "
              f"(+{p['added_us_per_request']:.2f} us); a scrape renders in {p['render_ms_per_scrape']:.2f} ms")
        pairs = e["throughput_ratio_per_pair"]
        load = e["load_average_1min"]
        print(f"end to end at c={e['concurrency']}: {e['req_per_s_with']:.1f} / {e['req_per_s_without']:.1f} req/s "
              f"= {e['throughput_ratio_with_over_without']:.3f}x with metrics (per pair {min(pairs):.3f}-"
              f"{max(pairs):.3f}; {e['scrapes']} scrapes); TTFT p50 {e['ttft_p50_ms_with']:.2f} vs "
              f"{e['ttft_p50_ms_without']:.2f} ms; endpoint CPU {e['endpoint_cpu_ms_per_request_with']:.3f} vs "
              f"{e['endpoint_cpu_ms_per_request_without']:.3f} ms per request; load {load['before']}-{load['after']} "
              f"on {load['cpus']} CPUs")
        if args.smoke:
            print("(smoke settings: not a measurement)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
