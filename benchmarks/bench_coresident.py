"""What an idle co-resident engine costs the serving one (issue 25): a warm standby, a second fleet model or the
hybrid's other engine sits next to the engine that serves. The same streaming load (concurrency 32 by default)
against one real llama-server, alone and with an idle second engine alive, rounds alternated in ABBA order
(alone, with, with, alone, ...) so a drift in the machine's load hits both alike; printed as ratios with / alone
measured in this one run, with the load average around every round and the CPU the idle engine used meanwhile.

The idle engine is another llama-server on the demo model (default) or vLLM (`--idle vllm`; CPU build, eager).
Between an "alone" and a "with" round it is
  restart: stopped and started again (alone really means alone: no process, no memory; llama.cpp's default), or
  pause:   SIGSTOP'd for the alone rounds (vLLM's default: its start takes minutes; it keeps its memory while
           paused, so this shows what its CPU costs, not its memory).
A sleeping vLLM (`--enable-sleep-mode`, then /sleep) needs a CUDA build: vLLM's CPU platform rejects sleep mode.
With `--poll-idle S` the idle engine's /health is polled every S seconds during the "with" rounds, as the app's
telemetry does for an engine it supervises.

The client is bench_proxy's (the same streaming rounds, output lengths and socket handling). Numbers come from a
quiet machine (the lead measures); `--smoke` runs everything tiny to prove the script works.

    .venv/bin/python benchmarks/bench_coresident.py [--concurrency 32] [--requests 128] [--rounds 6]
        [--max-tokens 64] [--idle llama.cpp|vllm] [--toggle restart|pause] [--poll-idle 0] [--smoke]
        [--json] [--output FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_proxy import Round, _round  # noqa: E402 - the same client as the proxy benchmark

from desktop.core.engines import get_adapter  # noqa: E402
from desktop.core.engines.base import LaunchPlan  # noqa: E402
from desktop.core.models.demo import ensure_demo_model  # noqa: E402
from desktop.core.runtime.supervisor import EngineProcess  # noqa: E402


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _cpu_s(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def _rss_mib(processes: list[psutil.Process]) -> float:
    total = 0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            total += process.memory_info().rss
    return round(total / 2**20, 1)


class IdleEngine:
    """The co-resident engine: started, stopped, paused and resumed between rounds; never sent a request."""

    def __init__(self, kind: str, toggle: str, poll_s: float) -> None:
        self.kind, self.toggle, self.poll_s = kind, toggle, poll_s
        demo = ensure_demo_model()
        self.adapter = get_adapter(kind)
        self.install = self.adapter.find_install() or self.adapter.install()
        if kind == "vllm":
            self.plan = LaunchPlan("vllm", demo.hf_dir, ctx_per_request=512, slots=4, eager=True, dtype="float32")
        else:
            self.plan = LaunchPlan("llama.cpp", demo.gguf_path, ctx_per_request=512, slots=4)
        self.process: EngineProcess | None = None
        self.starts: list[float] = []
        self._stop_poll = threading.Event()
        self._poller: threading.Thread | None = None
        self.polls = 0

    @property
    def alive(self) -> bool:
        return self.process is not None

    def start(self) -> None:
        started = time.monotonic()
        self.process = EngineProcess(self.adapter, self.plan, self.install)
        self.process.start()
        self.process.wait_ready(timeout=1200)
        self.starts.append(round(time.monotonic() - started, 2))

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    def processes(self) -> list[psutil.Process]:
        return _tree(self.process.pid) if self.process is not None and self.process.pid else []

    def pause(self) -> None:
        for process in self.processes():
            with contextlib.suppress(psutil.Error):
                process.suspend()

    def resume(self) -> None:
        for process in self.processes():
            with contextlib.suppress(psutil.Error):
                process.resume()

    def begin_with_round(self, settle_s: float) -> None:
        """Make it present and idle: started (restart) or resumed (pause), then left alone for `settle_s` so its
        start-up work is not counted; the poller starts if asked."""
        if self.toggle == "restart" and not self.alive:
            self.start()
        elif self.toggle == "pause":
            self.resume()
        time.sleep(settle_s)  # a settle period before measuring, not a synchronisation
        if self.poll_s > 0:
            self._stop_poll.clear()
            self._poller = threading.Thread(target=self._poll, daemon=True, name="idle-poll")
            self._poller.start()

    def end_with_round(self, next_is_with: bool) -> None:
        self._stop_poll.set()
        if self._poller is not None:
            self._poller.join(10)
            self._poller = None
        if next_is_with:
            return
        if self.toggle == "restart":
            self.stop()
        else:
            self.pause()

    def _poll(self) -> None:
        import httpx

        from desktop.core.common import unixhttp

        assert self.process is not None
        url = self.process.base_url
        socket = unixhttp.socket_of(url)
        transport = httpx.HTTPTransport(uds=socket) if socket else None
        with httpx.Client(transport=transport, trust_env=False, timeout=5) as client:
            target = (unixhttp.http_url(url) if socket else url) + "/health"
            while not self._stop_poll.wait(self.poll_s):
                with contextlib.suppress(httpx.HTTPError):
                    client.get(target)
                    self.polls += 1


def _order(rounds: int) -> list[str]:
    """ABBA: alone, with, with, alone, alone, with, ... (2 x rounds entries)."""
    out: list[str] = []
    for index in range(rounds):
        out += ["alone", "with"] if index % 2 == 0 else ["with", "alone"]
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    demo = ensure_demo_model()
    adapter = get_adapter("llama.cpp")
    install = adapter.find_install() or adapter.install()
    plan = LaunchPlan("llama.cpp", demo.gguf_path, ctx_per_request=512, slots=args.concurrency,
                      threads=args.engine_threads)
    idle = IdleEngine(args.idle, args.toggle, args.poll_idle)
    rounds: list[dict[str, Any]] = []
    with EngineProcess(adapter, plan, install) as serving:
        serving.start()
        serving.wait_ready(timeout=600)
        serving_tree = _tree(serving.pid or 0)
        asyncio.run(_round("warm-up", serving.base_url, args.concurrency, args.concurrency, 8))  # not measured
        if args.toggle == "pause":  # started once, paused while the serving engine runs alone
            idle.start()
            idle.pause()
        try:
            order = _order(args.rounds)
            for index, mode in enumerate(order):
                if mode == "with":
                    idle.begin_with_round(args.settle)
                elif index:
                    time.sleep(args.settle)  # the same settle period before an alone round
                idle_tree = idle.processes() if mode == "with" else []
                idle_cpu_before = _cpu_s(idle_tree)
                serving_cpu_before = _cpu_s(serving_tree)
                load_before = _load()
                result: Round = asyncio.run(_round(mode, serving.base_url, args.concurrency, args.requests,
                                                   args.max_tokens))
                row = {"mode": mode, "seconds": round(result.seconds, 3), "output_tokens": result.output_tokens,
                       "tokens_per_s": round(result.throughput, 2), "failed": result.failed,
                       "ttft_p50_ms": round(statistics.median(result.ttfts) * 1000, 2) if result.ttfts else None,
                       "load_1min": {"before": load_before, "after": _load()},
                       "serving_cpu_s": round(_cpu_s(serving_tree) - serving_cpu_before, 2),
                       "errors": sorted(set(result.errors))[:3]}
                if mode == "with":
                    row["idle_cpu_s"] = round(_cpu_s(idle_tree) - idle_cpu_before, 3)
                    row["idle_rss_mib"] = _rss_mib(idle_tree)
                    idle.end_with_round(next_is_with=index + 1 < len(order) and order[index + 1] == "with")
                rounds.append(row)
                if not args.json:
                    print(f"  {mode:<6} {row['tokens_per_s']:8.1f} tok/s  TTFT p50 {row['ttft_p50_ms']} ms  "
                          f"load {load_before:.2f}" + (f"  idle engine CPU {row['idle_cpu_s']:.2f} s"
                                                       if mode == "with" else ""), flush=True)
        finally:
            idle.stop()
    return {"rounds": rounds, "idle_starts_s": idle.starts, "idle_polls": idle.polls,
            "serving_engine": f"llama.cpp {install.version}", "idle_engine": f"{args.idle} {idle.install.version}"}


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def of(mode: str) -> list[dict[str, Any]]:
        return [r for r in rounds if r["mode"] == mode]

    def tput(rows: list[dict[str, Any]]) -> float:
        return sum(r["output_tokens"] for r in rows) / sum(r["seconds"] for r in rows)

    alone, with_ = of("alone"), of("with")
    pairs = [(a["tokens_per_s"], w["tokens_per_s"]) for a, w in zip(alone, with_, strict=True)]
    ttft_alone = statistics.median(r["ttft_p50_ms"] for r in alone if r["ttft_p50_ms"] is not None)
    ttft_with = statistics.median(r["ttft_p50_ms"] for r in with_ if r["ttft_p50_ms"] is not None)
    return {
        "tokens_per_s_alone": round(tput(alone), 2), "tokens_per_s_with": round(tput(with_), 2),
        "throughput_ratio_with_over_alone": round(tput(with_) / tput(alone), 4),
        "throughput_ratio_per_pair": [round(w / a, 3) for a, w in pairs],
        "ttft_p50_ms_alone": round(ttft_alone, 2), "ttft_p50_ms_with": round(ttft_with, 2),
        "ttft_p50_ratio_with_over_alone": round(ttft_with / ttft_alone, 4) if ttft_alone else None,
        "idle_cpu_s_per_with_round": round(statistics.fmean(r["idle_cpu_s"] for r in with_), 3),
        "idle_rss_mib": max(r["idle_rss_mib"] for r in with_),
        "failed": sum(r["failed"] for r in rounds),
        "load_1min_range": [min(r["load_1min"]["before"] for r in rounds),
                            max(r["load_1min"]["after"] for r in rounds)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128, help="requests per round")
    parser.add_argument("--max-tokens", type=int, default=64, help="mean output length (spread 1/4 to 7/4 of it)")
    parser.add_argument("--rounds", type=int, default=6, help="alone/with pairs (ABBA order)")
    parser.add_argument("--idle", choices=("llama.cpp", "vllm"), default="llama.cpp", help="the idle engine")
    parser.add_argument("--toggle", choices=("restart", "pause"), help="how the idle engine is taken away for the "
                        "alone rounds (default: restart for llama.cpp, pause for vLLM)")
    parser.add_argument("--poll-idle", type=float, default=0.0, metavar="S",
                        help="poll the idle engine's /health every S s during with rounds (the app's telemetry)")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds left idle before each round")
    parser.add_argument("--engine-threads", type=int, help="llama-server --threads for the serving engine")
    parser.add_argument("--smoke", action="store_true", help="tiny settings: proves the script runs")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--output", type=Path, help="also write the results as JSON to this file")
    args = parser.parse_args()
    args.toggle = args.toggle or ("pause" if args.idle == "vllm" else "restart")
    if args.smoke:
        args.concurrency, args.requests, args.rounds, args.max_tokens, args.settle = 4, 8, 1, 8, 0.5
    if not args.json:
        print(f"c={args.concurrency}, {args.requests} requests per round, {args.rounds} pairs; idle {args.idle} "
              f"({args.toggle}){'; smoke settings: not a measurement' if args.smoke else ''}", flush=True)
    data = measure(args)
    result = {"concurrency": args.concurrency, "requests_per_round": args.requests, "max_tokens": args.max_tokens,
              "rounds": args.rounds, "idle": args.idle, "toggle": args.toggle, "poll_idle_s": args.poll_idle,
              "cpus": os.cpu_count(), "smoke": args.smoke, **data, **summarize(data["rounds"])}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"with an idle {args.idle} alive: {result['tokens_per_s_with']:.1f} / {result['tokens_per_s_alone']:.1f} "
              f"tok/s = {result['throughput_ratio_with_over_alone']:.3f}x (per pair "
              f"{min(result['throughput_ratio_per_pair']):.3f}-{max(result['throughput_ratio_per_pair']):.3f}); "
              f"TTFT p50 {result['ttft_p50_ms_with']:.1f} vs {result['ttft_p50_ms_alone']:.1f} ms; the idle engine "
              f"used {result['idle_cpu_s_per_with_round']:.2f} s CPU per round and holds {result['idle_rss_mib']} MiB; "
              f"load {result['load_1min_range'][0]}-{result['load_1min_range'][1]} on {result['cpus']} CPUs")
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
