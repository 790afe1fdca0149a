"""What `/metrics` costs the endpoint, as ratios against the endpoint without it.

1. Per request: the listener that feeds the Prometheus counters runs on the endpoint's loop for every finished
   request. Times `RequestLog.finished` with and without `EndpointMetrics` subscribed (microseconds per request).
2. Per scrape: `render()` after N requests over a few label sets (milliseconds per scrape).
3. End to end: streaming load at concurrency C through a real in-process endpoint (ProxyServer + RequestLog)
   against a fake engine that streams T chunks at once, interleaved rounds without metrics and with metrics plus a
   scraper hitting /metrics every `--scrape-interval` s: throughput with / without (goal >= 0.99) and the TTFT p50
   difference.

Numbers come from a quiet machine (the lead measures); `--smoke` runs everything tiny to prove the script works.

    .venv/bin/python benchmarks/bench_metrics.py [--requests 20000] [--concurrency 32] [--rounds 6]
        [--load-requests 512] [--scrape-interval 1.0] [--smoke] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from desktop.core.runtime.ports import find_free_port  # noqa: E402
from desktop.core.serving import control  # noqa: E402
from desktop.core.serving.metering import RequestRecord  # noqa: E402
from desktop.core.serving.metrics import EndpointMetrics  # noqa: E402
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

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.port = find_free_port()
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


def end_to_end(concurrency: int, requests: int, rounds: int, interval: float, tokens: int) -> dict[str, Any]:
    engine = FakeEngine(tokens)
    results: dict[str, list[tuple[float, float, int]]] = {"without": [], "with": []}
    for round_index in range(rounds):
        for mode in (("without", "with") if round_index % 2 == 0 else ("with", "without")):
            proxy = ProxyServer(port=find_free_port(), model_name="bench")
            log = RequestLog(capacity=1000)
            log.attach(proxy)
            if mode == "with":
                proxy.add_routes(control.request_routes(log, control.new_token()))
            proxy.start()
            try:
                proxy.set_upstream(Upstream(name="fake", engine="fake", base_url=f"http://127.0.0.1:{engine.port}",
                                            served_model_name="fake"))
                scrape = proxy.url + "/metrics" if mode == "with" else None
                results[mode].append(asyncio.run(_load(proxy.url + "/v1/completions", concurrency, requests,
                                                       scrape, interval)))
            finally:
                proxy.stop()
                log.stop()
    without = statistics.median(r[0] for r in results["without"])
    with_ = statistics.median(r[0] for r in results["with"])
    return {"concurrency": concurrency, "requests_per_round": requests, "rounds": rounds,
            "scrape_interval_s": interval, "req_per_s_without": round(without, 2), "req_per_s_with": round(with_, 2),
            "throughput_ratio_with_over_without": round(with_ / without, 4),
            "ttft_p50_ms_without": round(statistics.median(r[1] for r in results["without"]), 3),
            "ttft_p50_ms_with": round(statistics.median(r[1] for r in results["with"]), 3),
            "scrapes": sum(r[2] for r in results["with"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000, help="records for the per-request timing")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--load-requests", type=int, default=512, help="streamed requests per round")
    parser.add_argument("--tokens", type=int, default=32, help="chunks the fake engine streams per answer")
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    parser.add_argument("--smoke", action="store_true", help="tiny settings: proves the script runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.rounds, args.load_requests, args.concurrency = 500, 2, 16, 4
        args.scrape_interval = 0.05
    out = {"per_request": per_request(args.requests),
           "end_to_end": end_to_end(args.concurrency, args.load_requests, args.rounds, args.scrape_interval,
                                    args.tokens),
           "smoke": args.smoke, "quiet_machine_needed": True}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        p, e = out["per_request"], out["end_to_end"]
        print(f"per request: {p['us_per_request_without']:.2f} us without, {p['us_per_request_with']:.2f} us with "
              f"(+{p['added_us_per_request']:.2f} us); a scrape renders in {p['render_ms_per_scrape']:.2f} ms")
        print(f"end to end at c={e['concurrency']}: {e['req_per_s_with']:.1f} / {e['req_per_s_without']:.1f} req/s "
              f"= {e['throughput_ratio_with_over_without']:.3f}x with metrics ({e['scrapes']} scrapes); TTFT p50 "
              f"{e['ttft_p50_ms_with']:.2f} vs {e['ttft_p50_ms_without']:.2f} ms")
        if args.smoke:
            print("(smoke settings: not a measurement)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
