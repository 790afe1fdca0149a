"""Issue 25 with a real llama-server behind the real endpoint: traffic at concurrency 1 for a while, then 8;
`/metrics` (Prometheus text, parsed with prometheus_client's parser) counts what the request log stored;
`switchyard profile --json` reports the p95 concurrency and token lengths that were sent; `recommend
--from-traffic` uses them (typed numbers override); the recorded traffic replays open loop with its arrival gaps,
in-process and through `switchyard ab --replay`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import serve_until_ready
from prometheus_client.parser import text_string_to_metric_families

from desktop.core.measure.loadgen import LoadConfig, RandomWorkload, Target, run_load_sync, tokenizer_counter
from desktop.core.measure.loadgen.replay import ReplaySchedule, run_replay_sync
from desktop.core.runtime.ports import find_free_port

pytestmark = [pytest.mark.engine, pytest.mark.llamacpp]

PROMPT, OUTPUT = 64, 16
LOW, HIGH = 1, 8
LOW_REQUESTS, HIGH_REQUESTS = 16, 64


def _cli(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "desktop", *args], capture_output=True, text=True,  # noqa: S603
                          timeout=timeout, env=env)


def _counters(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


@pytest.fixture(scope="module")
def traffic(tmp_path_factory: pytest.TempPathFactory, llama_install: Any, demo_model: Any
            ) -> Iterator[dict[str, Any]]:
    """A `switchyard serve --endpoint` in its own home, the c=1 then c=8 traffic, its /metrics while it ran,
    then the stopped endpoint's history."""
    home = tmp_path_factory.mktemp("traffic-home")
    env = {**os.environ, "SWITCHYARD_HOME": str(home)}
    port = find_free_port()
    proc, ready = serve_until_ready("--engine", "llama.cpp", "--model", "demo", "--proxy-port", str(port),
                                    "--parallel", str(HIGH), "--ctx", "512", env=env)
    try:
        assert ready.startswith(f"ready: http://127.0.0.1:{port}/v1"), ready
        target = Target(f"http://127.0.0.1:{port}/v1", model="switchyard")
        counter = tokenizer_counter(demo_model.hf_dir / "tokenizer.json")
        workload = RandomWorkload(input_len=PROMPT, output_len=OUTPUT)
        low = run_load_sync(target, workload, LoadConfig(concurrency=LOW, num_requests=LOW_REQUESTS),
                            token_counter=counter)
        high = run_load_sync(target, workload, LoadConfig(concurrency=HIGH, num_requests=HIGH_REQUESTS),
                             token_counter=counter)
        assert low.summary.failed == high.summary.failed == 0
        sent = LOW_REQUESTS + HIGH_REQUESTS  # the model is named and prompts are sized locally: nothing else
        deadline = time.monotonic() + 30
        metrics = ""
        while time.monotonic() < deadline:  # the last record lands just after its answer: poll, do not sleep
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", trust_env=False, timeout=10).text
            total = sum(v for (name, _), v in _counters(metrics).items() if name == "switchyard_requests_total")
            if total >= sent:
                break
        stopped = _cli(env, "stop", "--port", str(port))
        assert stopped.returncode == 0, stopped.stderr
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    yield {"env": env, "home": home, "metrics": metrics, "low": low, "high": high,
           "sent_prompt": (low.sent_prompt_tokens or 0.0, high.sent_prompt_tokens or 0.0)}


def _history_rows(env: dict[str, str]) -> list[dict[str, Any]]:
    out = _cli(env, "requests", "--history", "--json", "--limit", "1000")
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout)["requests"])


def test_metrics_parse_and_match_the_request_log(traffic: dict[str, Any]) -> None:
    counters = _counters(traffic["metrics"])
    rows = _history_rows(traffic["env"])
    assert len(rows) == LOW_REQUESTS + HIGH_REQUESTS
    by_key: dict[tuple[str, str, str], int] = {}
    for row in rows:
        key = (row["model"] or "", row["engine"] or "", str(row["status"]))
        by_key[key] = by_key.get(key, 0) + 1
    scraped = {(dict(labels)["model"], dict(labels)["engine"], dict(labels)["status"]): value
               for (name, labels), value in counters.items() if name == "switchyard_requests_total"}
    assert scraped == {k: float(v) for k, v in by_key.items()}
    assert ("switchyard", "llama.cpp", "200") in scraped
    labels = (("engine", "llama.cpp"), ("model", "switchyard"))
    assert counters[("switchyard_output_tokens_total", labels)] == sum(r["output_tokens"] for r in rows)
    assert counters[("switchyard_prompt_tokens_total", labels)] == sum(r["prompt_tokens"] for r in rows)
    assert counters[("switchyard_ttft_seconds_count", labels)] == len(rows)
    assert counters[("switchyard_inter_token_latency_seconds_count", labels)] == len(rows)
    assert counters[("switchyard_requests_in_flight", ())] == 0.0
    # the launch's cold start, by phase, from history
    assert counters[("switchyard_cold_start_seconds_count", (("engine", "llama.cpp"), ("phase", "t1_health")))] == 1


def test_profile_reports_what_was_sent(traffic: dict[str, Any]) -> None:
    out = _cli(traffic["env"], "profile", "--since", "1h", "--json")
    assert out.returncode == 0, out.stderr
    profile = json.loads(out.stdout)
    assert profile["requests"] == LOW_REQUESTS + HIGH_REQUESTS and profile["failed"] == 0
    concurrency = profile["concurrency"]
    assert abs(concurrency["p95"] - HIGH) <= 0.1 * HIGH and concurrency["max"] == HIGH
    sent_prompt = max(traffic["sent_prompt"])
    assert abs(profile["prompt_tokens"]["p50"] - sent_prompt) <= 0.1 * sent_prompt
    assert abs(profile["output_tokens"]["p50"] - OUTPUT) <= 0.1 * OUTPUT
    assert abs(profile["output_tokens"]["p95"] - OUTPUT) <= 0.1 * OUTPUT
    assert profile["enough"] is True and profile["summary"].startswith(f"from {LOW_REQUESTS + HIGH_REQUESTS} requests")
    assert len(profile["lifetimes"]) == 1 and profile["lifetimes"][0]["engine"] == "llama.cpp"
    assert profile["captured_bodies"] == 0 and profile["shared_prefix_share"] is None  # works without bodies
    human = _cli(traffic["env"], "profile", "--since", "1h")
    assert "p95 8" in human.stdout and "prompt tokens: p50" in human.stdout


def test_recommend_from_traffic_uses_the_profile_and_typed_numbers_override(traffic: dict[str, Any]) -> None:
    out = _cli(traffic["env"], "recommend", "demo", "--from-traffic", "--since", "1h", "--json")
    assert out.returncode == 0, out.stderr
    workload = json.loads(out.stdout)["workload"]
    assert workload["concurrency"] == HIGH and workload["output_len"] == OUTPUT
    assert workload["source"].startswith(f"from {LOW_REQUESTS + HIGH_REQUESTS} requests over") \
        and "p95 concurrency 8" in workload["source"]
    typed = _cli(traffic["env"], "recommend", "demo", "--from-traffic", "--since", "1h", "--concurrency", "2",
                 "--json")
    data = json.loads(typed.stdout)["workload"]
    assert data["concurrency"] == 2 and data["output_len"] == OUTPUT and "--concurrency override" in data["source"]
    human = _cli(traffic["env"], "recommend", "demo", "--from-traffic", "--since", "1h")
    assert human.stdout.startswith(f"Workload from {LOW_REQUESTS + HIGH_REQUESTS} requests"), human.stdout
    empty = _cli({**traffic["env"], "SWITCHYARD_HOME": str(traffic["home"] / "empty")}, "recommend", "demo",
                 "--from-traffic")
    assert empty.returncode != 0 and "too little traffic for --from-traffic" in empty.stderr


def test_replay_keeps_the_recorded_arrival_gaps_open_loop(traffic: dict[str, Any], llama_server: Any) -> None:
    rows = sorted(_history_rows(traffic["env"]), key=lambda row: row["t"])[LOW_REQUESTS - 6: LOW_REQUESTS + 18]
    schedule = ReplaySchedule.from_rows(rows, source="test")  # the last c=1 requests, then the c=8 ones
    recorded = [row["t"] - rows[0]["t"] for row in rows]
    speed = 2.0
    result = run_replay_sync(Target(llama_server.base_url), schedule, speed=speed)
    assert result.summary.failed == 0 and result.summary.completed == len(recorded)
    for planned, offset in zip(result.scheduled_s, recorded, strict=True):
        assert planned == pytest.approx(offset / speed, abs=1e-5)
    lags = sorted(abs(lag) for lag in result.send_lags)
    assert lags[int(0.95 * (len(lags) - 1))] < 0.050, lags  # sends within 50 ms of the schedule (p95)
    # open loop: in the recorded c=8 part requests overlap on the client too (a closed loop at 1 would not)
    overlapping = sum(1 for a, b in zip(result.requests, result.requests[1:], strict=False) if b.start < a.end)
    assert overlapping >= 8
    assert [r.output_tokens for r in result.requests] == [row["output_tokens"] for row in rows]


def test_ab_replay_drives_both_sides_and_the_report_shows_replay_and_sweep(traffic: dict[str, Any],
                                                                           llama_server: Any,
                                                                           tmp_path: Path) -> None:
    out = _cli(traffic["env"], "ab", "--replay", "--since", "1h", "--replay-max", "12", "--speed", "4x",
               "--engines", f"llama.cpp,endpoint:{llama_server.base_url}", "--concurrency", "1", "--requests", "4",
               "--report", str(tmp_path / "ab"), "--json", "--no-history", timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["replay"]["schedule"]["requests"] == 12 and result["replay"]["speed"] == 4.0
    for engine in result["engines"]:
        rep = engine["repetitions"][0]
        assert rep["sweep"]["levels"][0]["completed"] == 4  # the closed-loop sweep ran
        assert rep["replay"]["completed"] == 12 and rep["replay"]["failed"] == 0
        assert rep["replay"]["send_lag"]["p95_ms"] < 50.0, rep["replay"]["send_lag"]
    html = (tmp_path / "ab" / "ab.html").read_text()
    assert "Replay of the recorded traffic (open loop, 4x)" in html and "Crossover" in html
    bad = _cli(traffic["env"], "ab", "--replay", "--since", "1s", "--engines", "llama.cpp,vllm")
    assert bad.returncode != 0 and "no recorded requests to replay" in bad.stderr
