"""What the hybrid endpoint's autopilot (`serve --engine auto`) adds to each request, as ratios against the same
endpoint without it, measured in one run.

1. Per request: the autopilot hears of every request twice on the endpoint's loop (arrival, finish: a set
   add/discard and a deque append under a lock). Times those two calls per request, with and without the
   autopilot subscribed (microseconds per request).
2. Per decision: one `step()` of the loop (the in-flight samples of the window, the policy) with the samples a
   busy window holds (milliseconds per decision; it runs on its own thread every --tick seconds).
3. End to end: streaming load at concurrency C through a real in-process endpoint (ProxyServer + RequestLog) in
   front of a fake engine that streams T chunks at once, interleaved rounds without and with the autopilot
   deciding every --tick seconds (its crossover set out of reach, so it only decides and never switches):
   throughput with / without (goal >= 0.99) and the TTFT p50 difference. The 1-, 5- and 15-minute load averages
   are printed with the numbers: the ratio means little on a busy machine.

Numbers come from a quiet machine (the lead measures); `--smoke` runs everything tiny to prove the script works.

    .venv/bin/python benchmarks/bench_autopilot.py [--requests 20000] [--concurrency 32] [--rounds 6]
        [--load-requests 512] [--tick 1.0] [--smoke] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_metrics import FakeEngine, _load  # noqa: E402

from desktop.core.runtime.ports import find_free_port  # noqa: E402
from desktop.core.serving.autopilot import Autopilot, AutopilotSettings, forced_crossover  # noqa: E402
from desktop.core.serving.metering import RequestRecord  # noqa: E402
from desktop.core.serving.proxy import ProxyServer, Upstream  # noqa: E402
from desktop.core.serving.requestlog import RequestLog  # noqa: E402

OUT_OF_REACH = 1_000_000.0  # a crossover no load reaches: the autopilot decides "stay" every tick


class _Listeners:
    """What the autopilot needs of a proxy for the per-request timing: somewhere to subscribe."""

    def __init__(self) -> None:
        self.started: list[Any] = []
        self.finished: list[Any] = []

    def subscribe_started(self, listener: Any) -> None:
        self.started.append(listener)

    def subscribe(self, listener: Any) -> None:
        self.finished.append(listener)

    def inflight(self) -> int:
        return 0


def _manager(proxy: Any) -> Any:
    """A manager as far as a deciding autopilot reads it: llama.cpp active, no standby (it never acts here)."""
    plan = SimpleNamespace(engine="llama.cpp")
    return SimpleNamespace(proxy=proxy, active=SimpleNamespace(plan=plan), standby=None)


def _autopilot(proxy: Any, tick: float, window: float = 300.0) -> Autopilot:
    return Autopilot(_manager(proxy), forced_crossover(OUT_OF_REACH, 60.0), plan_stub(), both_fit=True,
                     settings=AutopilotSettings(window_s=window, idle_s=window * 2, tick_s=tick))


def plan_stub() -> Any:
    return SimpleNamespace(engine="vllm")


def _record(seq: int) -> RequestRecord:
    return RequestRecord(t=time.time(), method="POST", path="/v1/completions", upstream="u", status=200,
                         streamed=True, ttft_s=0.05, e2e_s=0.5, output_tokens=32, prompt_tokens=64, seq=seq)


def per_request(count: int) -> dict[str, float]:
    records = [_record(i + 1) for i in range(count)]
    timings = {}
    for mode in ("without", "with"):
        listeners = _Listeners()
        if mode == "with":
            _autopilot(listeners, tick=3600.0)
        started = time.perf_counter()
        for record in records:  # what the proxy's events do per request: tell the arrival, then the finish
            for listener in listeners.started:
                listener(record)
            for listener in listeners.finished:
                listener(record)
        timings[mode] = (time.perf_counter() - started) / count * 1e6
    return {"us_per_request_without": round(timings["without"], 3), "us_per_request_with": round(timings["with"], 3),
            "added_us_per_request": round(timings["with"] - timings["without"], 3)}


def per_decision(samples: int, repeats: int) -> dict[str, float]:
    """One step() over a window holding `samples` level changes (a busy 5-minute window)."""
    listeners = _Listeners()
    autopilot = _autopilot(listeners, tick=3600.0)
    now = time.time()
    autopilot._samples.extend((now - 300.0 + i * 300.0 / samples, float(i % 16)) for i in range(samples))
    started = time.perf_counter()
    for _ in range(repeats):
        autopilot.step()
    return {"window_samples": samples, "ms_per_decision": round((time.perf_counter() - started) / repeats * 1000, 3)}


def end_to_end(concurrency: int, requests: int, rounds: int, tick: float, tokens: int) -> dict[str, Any]:
    engine = FakeEngine(tokens)
    results: dict[str, list[tuple[float, float, int]]] = {"without": [], "with": []}
    decisions = 0
    for round_index in range(rounds):
        for mode in (("without", "with") if round_index % 2 == 0 else ("with", "without")):
            proxy = ProxyServer(port=find_free_port(), model_name="bench")
            log = RequestLog(capacity=1000)
            log.attach(proxy)
            autopilot = _autopilot(proxy, tick) if mode == "with" else None
            proxy.start()
            try:
                proxy.set_upstream(Upstream(name="fake", engine="fake", base_url=f"http://127.0.0.1:{engine.port}",
                                            served_model_name="fake"))
                if autopilot is not None:
                    autopilot.start()
                results[mode].append(asyncio.run(_load(proxy.url + "/v1/completions", concurrency, requests,
                                                       None, 1.0)))
            finally:
                if autopilot is not None:
                    autopilot.stop()
                    decisions += 1 if autopilot.last is not None else 0
                proxy.stop()
                log.stop()
    without = statistics.median(r[0] for r in results["without"])
    with_ = statistics.median(r[0] for r in results["with"])
    return {"concurrency": concurrency, "requests_per_round": requests, "rounds": rounds, "tick_s": tick,
            "req_per_s_without": round(without, 2), "req_per_s_with": round(with_, 2),
            "throughput_ratio_with_over_without": round(with_ / without, 4),
            "ttft_p50_ms_without": round(statistics.median(r[1] for r in results["without"]), 3),
            "ttft_p50_ms_with": round(statistics.median(r[1] for r in results["with"]), 3),
            "rounds_where_it_decided": decisions}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000, help="records for the per-request timing")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--load-requests", type=int, default=512, help="streamed requests per round")
    parser.add_argument("--tokens", type=int, default=32, help="chunks the fake engine streams per answer")
    parser.add_argument("--tick", type=float, default=1.0, help="the autopilot's decision interval (s)")
    parser.add_argument("--window-samples", type=int, default=20000, help="level changes in the decision's window")
    parser.add_argument("--smoke", action="store_true", help="tiny settings: proves the script runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.rounds, args.load_requests, args.concurrency = 500, 2, 16, 4
        args.tick, args.window_samples = 0.05, 500
    load_before = os.getloadavg()
    out = {"per_request": per_request(args.requests),
           "per_decision": per_decision(args.window_samples, 5 if args.smoke else 50),
           "end_to_end": end_to_end(args.concurrency, args.load_requests, args.rounds, args.tick, args.tokens),
           "load_average_before": [round(x, 2) for x in load_before],
           "load_average_after": [round(x, 2) for x in os.getloadavg()],
           "cpus": os.cpu_count(), "smoke": args.smoke, "quiet_machine_needed": True}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        p, d, e = out["per_request"], out["per_decision"], out["end_to_end"]
        print(f"per request: {p['us_per_request_without']:.2f} us without, {p['us_per_request_with']:.2f} us with "
              f"(+{p['added_us_per_request']:.2f} us)")
        print(f"per decision over {d['window_samples']} samples: {d['ms_per_decision']:.2f} ms")
        print(f"end to end at c={e['concurrency']}: {e['req_per_s_with']:.1f} / {e['req_per_s_without']:.1f} req/s "
              f"= {e['throughput_ratio_with_over_without']:.3f}x with the autopilot (tick {e['tick_s']:g} s); TTFT "
              f"p50 {e['ttft_p50_ms_with']:.2f} vs {e['ttft_p50_ms_without']:.2f} ms")
        print(f"load average before {out['load_average_before']}, after {out['load_average_after']} "
              f"on {out['cpus']} CPUs")
        if args.smoke:
            print("(smoke settings: not a measurement)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
