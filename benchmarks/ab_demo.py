"""The committed A/B run: llama.cpp vs vLLM on the demo model (identical float32 weights in GGUF and safetensors),
matched settings, cold start, sweep at 1, 8 and 32, written to benchmarks/results/ab/ with a short summary.md.

    .venv/bin/python benchmarks/ab_demo.py [--repetitions 2] [--requests 32] [--eager]

The machine's 1-minute load average is sampled every 5 s during the run and written into summary.md: on a shared
machine, other work changes the numbers more than anything else.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from desktop.commands._common import stderr_progress  # noqa: E402
from desktop.core.measure.ab import ABConfig, ABResult, run_ab  # noqa: E402
from desktop.core.measure.reports import write_ab_report  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "ab"


class LoadSampler:
    """The 1-minute load average every `interval` seconds, in a thread, while the A/B runs."""

    def __init__(self, interval: float = 5.0) -> None:
        self.values: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)

    def _run(self, interval: float) -> None:
        while not self._stop.is_set():
            self.values.append(os.getloadavg()[0])
            self._stop.wait(interval)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def to_json(self) -> dict[str, Any]:
        values = self.values or [os.getloadavg()[0]]
        return {"min": round(min(values), 2), "median": round(statistics.median(values), 2),
                "max": round(max(values), 2), "samples": len(values), "cores": os.cpu_count()}


def summary_markdown(result: ABResult, load: dict[str, Any] | None = None) -> str:
    a, b = (e.engine for e in result.engines)
    cfg = result.config
    lines = [f"# A/B on this machine: {a} vs {b} ({result.machine})", "",
             f"Model `{cfg.model}` ({cfg.dtype}), context {cfg.ctx}/request, {cfg.slots} slots = max_num_seqs, prefix "
             f"cache off, {cfg.requests_per_level} requests/level, {cfg.input_len} in / {cfg.output_len} out tokens "
             f"(ignore_eos), {cfg.repetitions} repetition(s), {cfg.threads or 'default'} CPU threads per engine, vLLM {'eager (--enforce-eager)' if cfg.eager else 'with torch.compile'}. Versions: "
             + ", ".join(f"{e.display_name} {e.version}" for e in result.engines) + ".", "",
             *([f"Machine load during the run (1-min load average on {load['cores']} cores): median "
                f"{load['median']}, range {load['min']}–{load['max']} ({load['samples']} samples every 5 s). Other "
                "work on a shared machine slows both engines; compare ratios, not absolute numbers.", ""]
               if load else []),
             "| cold start (s) | " + a + " | " + b + " | ratio " + b + "/" + a + " |", "|---|---|---|---|"]
    for phase in ("t1_health_s", "t2_first_token_s", "t3_first_request_s"):
        row = result.cold_start[phase]
        lines.append(f"| {phase} | {_f(row[a])} | {_f(row[b])} | {_f(row['ratio'], 3)} |")
    rss = result.cold_start["peak_rss_mib"]
    lines += [f"| peak RSS (MiB) | {_n(rss[a])} | {_n(rss[b])} | |", "",
              f"| concurrency | {a} tok/s | {b} tok/s | ratio | {a} TTFT p50 / p95 ms | {b} TTFT p50 / p95 ms | TTFT p50 ratio |",
              "|---|---|---|---|---|---|---|"]
    for row in result.comparison:
        t, p50, p95 = row["output_throughput"], row["median_ttft_ms"], row["p95_ttft_ms"]
        lines.append(f"| {row['concurrency']} | {_f(t[a])} | {_f(t[b])} | {_f(t['ratio'], 3)} | "
                     f"{_f(p50[a], 0)} / {_f(p95[a], 0)} | {_f(p50[b], 0)} / {_f(p95[b], 0)} | {_f(p50['ratio'], 3)} |")
    lines += ["", f"**Verdict:** {result.amortization.get('verdict')}", "", "| scenario | concurrency | lifetime | "
              f"{a}: cold s / tok/s / cost per 1M | {b}: cold s / tok/s / cost per 1M | winner |", "|---|---|---|---|---|---|"]
    for s in result.scenarios:
        cells = []
        for name in (a, b):
            e = s["engines"][name]
            cells.append(f"{_n(e['cold_start_s'], 1)} / {_n(e['output_throughput'], 1)} / "
                         f"{_n(e['cost_per_million_output_tokens'], 2)}")
        life = f"{s['lifetime_s'] / 3600:g} h" if s["lifetime_s"] >= 3600 else f"{s['lifetime_s'] / 60:g} min"
        lines.append(f"| {s['scenario']} | {s['concurrency']} | {life} | {cells[0]} | {cells[1]} | {s['winner']} |")
    unit = result.costs[0]["unit"] if result.costs else ""
    lines += ["", f"Costs in {unit} per million output tokens (set --price-per-hour or --power-watts/--price-per-kwh).",
              "Ratios are means over repetitions; (low–high) ranges are in ab.html. Errors: "
              + ("; ".join(result.errors) or "none") + "."]
    return "\n".join(lines) + "\n"


def _f(cell: dict[str, object] | None, digits: int = 2) -> str:
    if not cell or cell.get("mean") is None:
        return "–"
    text = f"{float(cell['mean']):.{digits}f}"  # type: ignore[arg-type]
    if int(cell.get("n", 0) or 0) > 1:  # type: ignore[call-overload]
        text += f" ({float(cell['low']):.{digits}f}–{float(cell['high']):.{digits}f})"  # type: ignore[arg-type]
    return text


def _n(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repetitions", type=int, default=1)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--eager", action="store_true", help="vLLM --enforce-eager (no torch.compile)")
    parser.add_argument("--threads", type=int, help="CPU threads per engine (default: each engine's own)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    config = ABConfig(model="demo", engines=("llama.cpp", "vllm"),
                      concurrency=tuple(int(c) for c in args.concurrency.split(",")),
                      repetitions=args.repetitions, requests_per_level=args.requests, input_len=args.input_len,
                      output_len=args.output_len, eager=args.eager, threads=args.threads)
    with LoadSampler() as load:
        result = run_ab(config, progress=stderr_progress)
    paths = write_ab_report(result, args.out)
    data = json.loads(paths.json.read_text())
    paths.json.write_text(json.dumps({**data, "machine_load": load.to_json()}, indent=2, default=str) + "\n")
    summary = summary_markdown(result, load.to_json())
    (args.out / "summary.md").write_text(summary)
    print(summary)
    print(f"report: {paths.html}", file=sys.stderr)
    return 1 if result.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
