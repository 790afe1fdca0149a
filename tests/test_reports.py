"""Reports: vllm-bench field names in JSON, CSV columns, self-contained HTML with inline SVG, history rows."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from desktop.core.measure.ab import ABConfig, EngineResult, Repetition, analyse
from desktop.core.measure.loadgen import LoadConfig, SweepResult, Target
from desktop.core.measure.loadgen.metrics import RequestResult, summarize
from desktop.core.measure.loadgen.runner import LoadResult
from desktop.core.measure.reports import (
    line_chart,
    record_ab,
    record_bench,
    write_ab_report,
    write_bench_report,
)
from desktop.core.storage.history import Store

VLLM_KEYS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
             "max_concurrent_requests", *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p90", "p95", "p99")
                                          for m in ("ttft", "tpot", "itl", "e2el")))


def level(concurrency: int, tokens_per_s: float, ttft: float) -> LoadResult:
    """A synthetic level: 4 requests of 11 tokens at the given speed."""
    results = []
    for i in range(4):
        gap = 1.0 / tokens_per_s
        results.append(RequestResult(index=i, start=i * 0.1, success=True, ttft=ttft, latency=ttft + 10 * gap,
                                     elapsed=ttft + 10 * gap, itl=[gap] * 10, output_tokens=11, prompt_tokens=5))
    config = LoadConfig(concurrency=concurrency, num_requests=4)
    summary = summarize(results, duration=44 / tokens_per_s)  # output_throughput == tokens_per_s
    return LoadResult(config, Target("http://127.0.0.1:1"), {"kind": "random"}, "m", summary, results, [], 0.1)


def sweep(speed: float, ttft: float) -> SweepResult:
    return SweepResult([level(c, speed * c, ttft * c) for c in (1, 8, 32)])


def engine(name: str, speed: float, ttft: float, cold: float) -> EngineResult:
    rep = Repetition({"t1_health_s": cold / 2, "t2_first_token_s": cold * 0.9, "t3_first_request_s": cold,
                      "markers": {"listening": cold / 3}, "facts": {"kv_buffer.mib": "12.0"}},
                     sweep(speed, ttft), {"cold_start": 100.0, "load": 150.0}, [(0.0, 50.0, "cold_start"),
                                                                                (1.0, 150.0, "load")])
    return EngineResult(name, name.upper(), "1.0", "/m", {}, [rep])


def test_bench_report_files(tmp_path: Path) -> None:
    result = sweep(10.0, 0.05)
    meta = {"endpoint": "http://127.0.0.1:1", "engine": "llama.cpp", "model": "demo", "settings": {"x": 1}}
    paths = write_bench_report(result, meta, tmp_path / "out")
    data = json.loads(paths.json.read_text())
    assert data["kind"] == "bench" and len(data["levels"]) == 3
    for key in VLLM_KEYS:
        assert key in data["levels"][0], key
    assert data["levels"][0]["completed"] == 4 and data["levels"][0]["total_output_tokens"] == 44
    rows = list(csv.DictReader(paths.csv.open()))
    assert [r["concurrency"] for r in rows] == ["1", "8", "32"] and "median_ttft_ms" in rows[0]
    page = paths.html.read_text()
    assert page.count("<svg") == 2 and "Output throughput" in page
    assert not re.search(r"<script|<link|<img|(src|href)=\"?https?:", page), "report must work offline"


def test_ab_report_has_ratios_verdict_and_plots(tmp_path: Path) -> None:
    config = ABConfig(concurrency=(1, 8, 32), price_per_hour=2.0, service_lifetime_h=1.0)
    fast_starter = engine("llama.cpp", speed=10.0, ttft=0.05, cold=1.0)
    fast_server = engine("vllm", speed=20.0, ttft=0.04, cold=61.0)
    result = analyse(config, [fast_starter, fast_server], 0.0, 1.0)
    row8 = next(r for r in result.comparison if r["concurrency"] == 8)
    assert abs(row8["output_throughput"]["ratio"]["mean"] - 2.0) < 0.01
    assert result.cold_start["t3_first_request_s"]["ratio"]["mean"] == 61.0
    paths = write_ab_report(result, tmp_path)
    page = paths.html.read_text()
    assert page.count("<svg") == 4  # throughput, TTFT, cold-start phases, memory
    assert "pays back" in page and "Scenarios on this machine" in page
    assert "reasoning none on both: the A/B sends raw /v1/completions" in page  # the same setting, and which
    data = json.loads(paths.json.read_text())
    assert data["engines"][0]["repetitions"][0]["sweep"]["levels"][0]["median_ttft_ms"] > 0
    with Store(tmp_path / "h.db") as store:
        run_id = record_ab(store, result, str(paths.html))
        bench_id = record_bench(store, sweep(1.0, 0.1), {"engine": "llama.cpp", "model": "demo"})
        stored = store.get_run(run_id)
        assert stored is not None and stored.kind == "ab" and stored.report_path == str(paths.html)
        assert stored.summary["amortization"]["break_even_s"] is not None
        assert store.get_run(bench_id) is not None


def test_line_chart_without_data_still_renders() -> None:
    svg = line_chart("empty", {"a": []}, "x", "y")
    assert svg.startswith("<svg") and "no data" in svg
