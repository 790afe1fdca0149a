"""How much the stable endpoint costs: the same streaming load against a real llama-server, directly and through
the proxy, interleaved round by round. Prints throughput through the proxy ÷ direct (goal >= 0.97) and the TTFT
p50 the proxy adds (goal <= 2 ms), at concurrency 32, plus the added TTFT p50 of sequential requests.

The proxy runs in its own process (as in real use), so it does not share this load generator's interpreter.

    .venv/bin/python benchmarks/bench_proxy.py [--concurrency 32] [--requests 128] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass
class Round:
    mode: str
    seconds: float
    output_tokens: int
    failed: int
    ttfts: list[float]
    errors: list[str]

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.seconds


async def _one(session: aiohttp.ClientSession, url: str, max_tokens: int) -> tuple[float | None, int]:
    body = {"model": "switchyard", "prompt": "Benchmark the endpoint", "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}")
        buffer = b""
        async for chunk in response.content.iter_any():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                payload = event.removeprefix(b"data: ")
                if payload == b"[DONE]":
                    continue
                data = json.loads(payload)
                if first is None and any(c.get("text") for c in data.get("choices") or []):
                    first = time.perf_counter() - sent
                if data.get("usage"):
                    tokens = int(data["usage"]["completion_tokens"])
    return first, tokens


async def _round(mode: str, url: str, concurrency: int, requests: int, max_tokens: int) -> Round:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(requests):
        queue.put_nowait(index)
    ttfts: list[float] = []
    totals = {"tokens": 0, "failed": 0}
    errors: list[str] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # same connection policy as the proxy
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                try:
                    first, tokens = await _one(session, url, max_tokens)
                except Exception as exc:
                    totals["failed"] += 1
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    continue
                totals["tokens"] += tokens
                if first is not None:
                    ttfts.append(first)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    return Round(mode, seconds, totals["tokens"], totals["failed"], ttfts, errors)


def _proxy_only(upstream: str, port: int) -> None:
    """Child mode: run the stable endpoint in front of `upstream` until stdin closes."""
    from desktop.core.proxy import ProxyServer, Upstream

    proxy = ProxyServer(port=port)
    proxy.start()
    proxy.set_upstream(Upstream("bench", "llama.cpp", upstream, "switchyard"))
    print("proxy ready", flush=True)
    sys.stdin.read()
    proxy.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128, help="requests per round")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per mode (after one warm-up)")
    parser.add_argument("--sequential", type=int, default=30, help="sequential requests for the c=1 TTFT check")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--proxy-only", nargs=2, metavar=("UPSTREAM", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.proxy_only:
        _proxy_only(args.proxy_only[0], int(args.proxy_only[1]))
        return 0

    from desktop.core.demo import ensure_demo_model
    from desktop.core.engines import get_adapter
    from desktop.core.engines.base import LaunchPlan
    from desktop.core.ports import find_free_port
    from desktop.core.supervisor import EngineProcess

    adapter = get_adapter("llama.cpp")
    install = adapter.find_install() or adapter.install()
    plan = LaunchPlan("llama.cpp", ensure_demo_model().gguf_path, ctx=512, parallel=args.concurrency)
    port = find_free_port()
    with EngineProcess(adapter, plan, install) as engine:
        engine.start()
        engine.wait_ready(timeout=600)
        child = subprocess.Popen(  # noqa: S603 - this script, child mode
            [sys.executable, __file__, "--proxy-only", engine.base_url, str(port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None
            if child.stdout.readline().strip() != "proxy ready":
                raise SystemExit("the proxy did not start")
            urls = {"direct": engine.base_url, "proxy": f"http://127.0.0.1:{port}"}
            for mode, url in urls.items():  # warm-up, not measured
                asyncio.run(_round(mode, url, args.concurrency, args.concurrency, 8))
            rounds: list[Round] = []
            proxy_process = psutil.Process(child.pid)
            proxy_cpu = 0.0
            for _ in range(args.rounds):
                for mode, url in urls.items():
                    before = sum(proxy_process.cpu_times()[:2])
                    rounds.append(asyncio.run(_round(mode, url, args.concurrency, args.requests, args.max_tokens)))
                    if mode == "proxy":
                        proxy_cpu += sum(proxy_process.cpu_times()[:2]) - before
            sequential: dict[str, list[float]] = {"direct": [], "proxy": []}
            for _ in range(args.sequential):
                for mode, url in urls.items():
                    sequential[mode] += asyncio.run(_round(mode, url, 1, 1, 4)).ttfts
        finally:
            if child.stdin:
                child.stdin.close()
            child.wait(30)

    def summary(mode: str) -> dict[str, Any]:
        mine = [r for r in rounds if r.mode == mode]
        tokens, seconds = sum(r.output_tokens for r in mine), sum(r.seconds for r in mine)
        ttfts = [t for r in mine for t in r.ttfts]
        return {"output_tokens_per_s": tokens / seconds, "ttft_p50_ms": statistics.median(ttfts) * 1000,
                "failed": sum(r.failed for r in mine), "requests": len(ttfts),
                "errors": sorted({e for r in mine for e in r.errors})[:3],
                "rounds_tokens_per_s": [round(r.throughput, 1) for r in mine]}

    direct, proxied = summary("direct"), summary("proxy")
    result = {
        "engine": f"llama.cpp {install.version}",
        "concurrency": args.concurrency,
        "requests_per_round": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "direct": direct,
        "proxy": proxied,
        "throughput_ratio": proxied["output_tokens_per_s"] / direct["output_tokens_per_s"],
        "added_ttft_p50_ms": proxied["ttft_p50_ms"] - direct["ttft_p50_ms"],
        "added_ttft_p50_ms_sequential": (statistics.median(sequential["proxy"])
                                         - statistics.median(sequential["direct"])) * 1000,
        "proxy_cpu_ms_per_request": proxy_cpu * 1000 / max(1, proxied["requests"]),
        "rounds_detail": [asdict(r) | {"ttfts": len(r.ttfts), "errors": len(r.errors)} for r in rounds],
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"direct: {direct['output_tokens_per_s']:.1f} tok/s, TTFT p50 {direct['ttft_p50_ms']:.1f} ms; "
              f"proxy: {proxied['output_tokens_per_s']:.1f} tok/s, TTFT p50 {proxied['ttft_p50_ms']:.1f} ms")
        print(f"throughput proxy/direct = {result['throughput_ratio']:.3f} (goal >= 0.97); "
              f"added TTFT p50 = {result['added_ttft_p50_ms']:+.2f} ms at c={args.concurrency} (goal <= 2 ms), "
              f"{result['added_ttft_p50_ms_sequential']:+.2f} ms sequential; "
              f"proxy CPU {result['proxy_cpu_ms_per_request']:.2f} ms per request")
    return 0 if direct["failed"] == proxied["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
