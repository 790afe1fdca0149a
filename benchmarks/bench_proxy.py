"""How much the stable endpoint costs: the same streaming load against a real llama-server, directly and through
the proxy, interleaved round by round. Prints throughput through the proxy ÷ direct (goal >= 0.97) and the TTFT
p50 the proxy adds (goal <= 2 ms), at concurrency 32, plus the added TTFT p50 of sequential requests.

It measures two engine settings. With a core left free (the usual case: on a GPU the engine keeps one CPU thread
busy), the numbers are the proxy's own cost. With every core given to a CPU-only llama-server, every cycle the
proxy or the client spends stalls the engine's spinning worker threads, so the ratio shows that contention too.

The proxy runs in its own process (as in real use), so it does not share this load generator's interpreter.

    .venv/bin/python benchmarks/bench_proxy.py [--concurrency 32] [--requests 128] [--rounds 6]
        [--engine-threads spare,all] [--api completions|chat|responses] [--json] [--output FILE]

`--api chat` streams /v1/chat/completions instead: the answers the endpoint watches for reasoning to mirror
(serving/reasoning.py), so that run prices that check on every chunk. `--api responses` streams /v1/responses,
whose every event the endpoint parses to finish a stream an engine leaves open (serving/responses.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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


API = {"chat": False, "responses": False}  # --api chat: /v1/chat/completions; --api responses: /v1/responses


async def _one(session: aiohttp.ClientSession, url: str, max_tokens: int) -> tuple[float | None, int]:
    body: dict[str, Any] = {"model": "switchyard", "max_tokens": max_tokens, "stream": True, "temperature": 0,
                            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if API["chat"]:
        body["messages"] = [{"role": "user", "content": "Benchmark the endpoint"}]
    elif API["responses"]:
        body = {"model": "switchyard", "max_output_tokens": max_tokens, "stream": True, "temperature": 0,
                "ignore_eos": True, "input": "Benchmark the endpoint"}
    else:
        body["prompt"] = "Benchmark the endpoint"
    path = "/v1/chat/completions" if API["chat"] else "/v1/responses" if API["responses"] else "/v1/completions"
    sent = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with session.post(url + path, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}")
        buffer = b""
        async for chunk in response.content.iter_any():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                payload = event.split(b"data: ", 1)[-1]  # (a Responses event has an `event:` line first)
                if payload == b"[DONE]":
                    continue
                data = json.loads(payload)
                if API["responses"]:
                    if first is None and data.get("type") == "response.output_text.delta":
                        first = time.perf_counter() - sent
                    if data.get("type") == "response.completed":
                        tokens = int(data["response"]["usage"]["output_tokens"])
                    continue
                if first is None and any(c.get("text") or (c.get("delta") or {}).get("content")
                                         for c in data.get("choices") or []):
                    first = time.perf_counter() - sent
                if data.get("usage"):
                    tokens = int(data["usage"]["completion_tokens"])
    return first, tokens


def _lengths(requests: int, mean: int) -> list[int]:
    """Output lengths spread evenly over [mean/4, 7*mean/4] in a fixed shuffled order, the same every round.
    Equal lengths would make all 32 streams end in the same engine step and the next 32 requests arrive as one
    burst; whether that burst makes the next step or waits one more (tens of ms) would decide the TTFT p50."""
    low, high = max(1, mean // 4), max(1, 7 * mean // 4)
    return [low + (index * 37) % (high - low + 1) for index in range(requests)]


def _session(url: str) -> tuple[aiohttp.ClientSession, str]:
    """A client session for `url` and the URL to send to: an engine on its private Unix socket (the app's engines
    listen there, `desktop.core.common.unixhttp`) is reached with aiohttp's UnixConnector, TCP otherwise. A fresh
    connection per request in both cases: llama-server closes idle kept-alive connections, and a client that
    reuses one just then fails (the proxy retries that case; this client does not)."""
    from desktop.core.common import unixhttp

    socket = unixhttp.socket_of(url)
    connector: aiohttp.BaseConnector = aiohttp.UnixConnector(path=socket, limit=0, force_close=True) if socket \
        else aiohttp.TCPConnector(limit=0, force_close=True)
    session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600))
    return session, unixhttp.http_url(url) if socket else url


async def _round(mode: str, url: str, concurrency: int, requests: int, max_tokens: int) -> Round:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for length in _lengths(requests, max_tokens):
        queue.put_nowait(length)
    ttfts: list[float] = []
    totals = {"tokens": 0, "failed": 0}
    errors: list[str] = []
    session, url = _session(url)
    async with session:
        async def worker() -> None:
            while not queue.empty():
                length = queue.get_nowait()
                try:
                    first, tokens = await _one(session, url, length)
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
    from desktop.core.serving.proxy import ProxyServer, Upstream

    proxy = ProxyServer(port=port)
    proxy.start()
    proxy.set_upstream(Upstream("bench", "llama.cpp", upstream, "switchyard"))
    print("proxy ready", flush=True)
    sys.stdin.read()
    proxy.stop()


async def _mixed_round(urls: dict[str, str], concurrency: int, requests: int, max_tokens: int
                       ) -> dict[str, list[float]]:
    """Half the streams direct, half through the proxy, at the same time against the same engine: both halves
    land in the same engine steps, so their TTFT difference is the proxy's, without the step-to-step noise that
    separate rounds carry."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for length in _lengths(requests, max_tokens):
        queue.put_nowait(length)
    ttfts: dict[str, list[float]] = {mode: [] for mode in urls}
    sessions = {mode: _session(url) for mode, url in urls.items()}
    try:
        modes = list(urls)

        async def worker(index: int) -> None:
            # Each worker alternates between the two paths request by request: a worker's position in the
            # client's loop would otherwise favour one path (an A/A run with a fixed split showed +7 ms).
            while not queue.empty():
                mode = modes[index % len(modes)]
                index += 1
                session, url = sessions[mode]
                first, _tokens = await _one(session, url, queue.get_nowait())
                if first is not None:
                    ttfts[mode].append(first)

        await asyncio.gather(*(worker(index) for index in range(concurrency)))
    finally:
        for session, _url in sessions.values():
            await session.close()
    return ttfts


def _bootstrap_p50_difference(proxied: list[float], direct: list[float], resamples: int = 2000
                              ) -> tuple[float, float]:
    """95% interval of p50(proxied) - p50(direct), resampling requests: how far the noise alone moves it."""
    rng = random.Random(1234)
    differences = sorted(
        statistics.median(rng.choices(proxied, k=len(proxied))) - statistics.median(rng.choices(direct, k=len(direct)))
        for _ in range(resamples))
    return differences[int(0.025 * resamples)], differences[int(0.975 * resamples) - 1]


def _measure(args: argparse.Namespace, threads: int | None) -> dict[str, Any]:
    """One engine configuration: warm-up, then direct and proxied rounds interleaved, then sequential pairs."""
    from desktop.core.engines import get_adapter
    from desktop.core.engines.base import LaunchPlan
    from desktop.core.models.demo import ensure_demo_model
    from desktop.core.runtime.ports import find_free_port
    from desktop.core.runtime.supervisor import EngineProcess

    adapter = get_adapter("llama.cpp")
    install = adapter.find_install() or adapter.install()
    plan = LaunchPlan("llama.cpp", ensure_demo_model().gguf_path, ctx_per_request=512, slots=args.concurrency,
                      threads=threads)
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
            for index in range(args.rounds):
                # ABBA order (direct, proxy, proxy, direct, ...): a drift in the machine's load hits both alike.
                order = list(urls.items()) if index % 2 == 0 else list(urls.items())[::-1]
                for mode, url in order:
                    before = sum(proxy_process.cpu_times()[:2])
                    rounds.append(asyncio.run(_round(mode, url, args.concurrency, args.requests, args.max_tokens)))
                    if mode == "proxy":
                        proxy_cpu += sum(proxy_process.cpu_times()[:2]) - before
            mixed: dict[str, list[float]] = {"direct": [], "proxy": []}
            for _ in range(args.rounds):
                for mode, values in asyncio.run(_mixed_round(urls, args.concurrency, args.requests,
                                                             args.max_tokens)).items():
                    mixed[mode] += values
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
    pairs = list(zip([r for r in rounds if r.mode == "direct"], [r for r in rounds if r.mode == "proxy"],
                     strict=True))
    ratios = [p.throughput / d.throughput for d, p in pairs]
    low, high = _bootstrap_p50_difference([t for r in rounds if r.mode == "proxy" for t in r.ttfts],
                                          [t for r in rounds if r.mode == "direct" for t in r.ttfts])
    mixed_low, mixed_high = _bootstrap_p50_difference(mixed["proxy"], mixed["direct"])
    return {
        "engine": f"llama.cpp {install.version}",
        "engine_threads": threads or "default (all cores)",
        "direct": direct,
        "proxy": proxied,
        "throughput_ratio": proxied["output_tokens_per_s"] / direct["output_tokens_per_s"],
        "throughput_ratio_per_pair": [round(r, 3) for r in ratios],
        "added_ttft_p50_ms": proxied["ttft_p50_ms"] - direct["ttft_p50_ms"],
        "added_ttft_p50_ms_95ci": [low * 1000, high * 1000],
        "added_ttft_p50_ms_paired": (statistics.median(mixed["proxy"]) - statistics.median(mixed["direct"])) * 1000,
        "added_ttft_p50_ms_paired_95ci": [mixed_low * 1000, mixed_high * 1000],
        "paired_requests": {mode: len(values) for mode, values in mixed.items()},
        "added_ttft_p50_ms_sequential": (statistics.median(sequential["proxy"])
                                         - statistics.median(sequential["direct"])) * 1000,
        "proxy_cpu_ms_per_request": proxy_cpu * 1000 / max(1, proxied["requests"]),
        "rounds_detail": [asdict(r) | {"ttfts": len(r.ttfts), "errors": len(r.errors)} for r in rounds],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128, help="requests per round")
    parser.add_argument("--max-tokens", type=int, default=64, help="mean output length (spread 1/4 to 7/4 of it)")
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds per mode (after one warm-up)")
    parser.add_argument("--sequential", type=int, default=30, help="sequential requests for the c=1 TTFT check")
    parser.add_argument("--engine-threads", default="spare,all",
                        help="llama-server --threads settings to measure, comma-separated: 'spare' (all cores but "
                             "one, left to the client and the endpoint, as when a GPU does the engine's work), "
                             "'all' (llama.cpp's default: every core busy with the engine), or a number")
    parser.add_argument("--api", choices=("completions", "chat", "responses"), default="completions",
                        help="which streaming API the load uses (default completions)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--output", type=Path, help="also write the results as JSON to this file")
    parser.add_argument("--proxy-only", nargs=2, metavar=("UPSTREAM", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.proxy_only:
        _proxy_only(args.proxy_only[0], int(args.proxy_only[1]))
        return 0
    API["chat"] = args.api == "chat"
    API["responses"] = args.api == "responses"

    cores = os.cpu_count() or 1
    settings: list[tuple[str, int | None]] = []
    for word in args.engine_threads.split(","):
        word = word.strip()
        if word == "all":
            settings.append((f"all {cores} cores to the engine", None))
        elif word == "spare":
            settings.append((f"engine on {max(1, cores - 1)} of {cores} cores", max(1, cores - 1)))
        else:
            settings.append((f"engine on {int(word)} of {cores} cores", int(word)))
    results = []
    for label, threads in settings:
        load_before = os.getloadavg()[0]  # a busy machine changes the numbers more than the endpoint does
        result = {"setting": label, "api": args.api, "concurrency": args.concurrency, "requests_per_round": args.requests,
                  "max_tokens": args.max_tokens, "rounds": args.rounds, **_measure(args, threads)}
        result["load_average_1min"] = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2),
                                       "cpus": os.cpu_count()}
        results.append(result)
        if not args.json:
            direct, proxied = result["direct"], result["proxy"]
            print(f"[{label}] direct: {direct['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
                  f"{direct['ttft_p50_ms']:.1f} ms; proxy: {proxied['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
                  f"{proxied['ttft_p50_ms']:.1f} ms")
            ratios = result["throughput_ratio_per_pair"]
            low, high = result["added_ttft_p50_ms_95ci"]
            print(f"[{label}] throughput proxy/direct = {result['throughput_ratio']:.3f} (goal >= 0.97; per round "
                  f"pair {min(ratios):.3f}-{max(ratios):.3f}); added TTFT p50 = "
                  f"{result['added_ttft_p50_ms']:+.2f} ms at c={args.concurrency} (goal <= 2 ms; 95% interval "
                  f"{low:+.1f} to {high:+.1f} ms), {result['added_ttft_p50_ms_sequential']:+.2f} ms sequential; "
                  f"proxy CPU {result['proxy_cpu_ms_per_request']:.2f} ms per request", flush=True)
            low, high = result["added_ttft_p50_ms_paired_95ci"]
            print(f"[{label}] paired ({args.concurrency // 2} direct + {args.concurrency // 2} proxied streams at "
                  f"once): added TTFT p50 = {result['added_ttft_p50_ms_paired']:+.2f} ms (95% interval "
                  f"{low:+.1f} to {high:+.1f} ms)", flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n")
    failed = sum(r["direct"]["failed"] + r["proxy"]["failed"] for r in results)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
