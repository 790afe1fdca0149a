"""The workload profile (pure, on request-log rows and launch runs) and the replay schedule built from the same
rows; bad spans and speeds are one clear error."""

from __future__ import annotations

import json
import math

import pytest

from desktop.core.common.errors import SwitchyardError
from desktop.core.measure.loadgen.replay import ReplaySchedule, parse_speed
from desktop.core.measure.profile import (
    build_profile,
    concurrency_stats,
    parse_since,
    shared_prefix_share,
)
from desktop.core.storage.history import RunRecord


def row(t: float, e2e: float, prompt: int = 100, output: int = 20, status: int = 200,
        body: str | None = None) -> dict[str, object]:
    return {"t": t, "e2e_s": e2e, "path": "/v1/completions", "model": "m", "engine": "llama.cpp",
            "status": status, "prompt_tokens": prompt, "output_tokens": output, "request_body": body}


def test_concurrency_is_a_time_weighted_sweep_over_busy_time() -> None:
    # 0-10 s one request; 10-12 s four at once; then 100 s idle, which does not count
    intervals = [(0.0, 10.0), (10.0, 12.0), (10.0, 12.0), (10.0, 12.0), (10.0, 12.0), (112.0, 113.0)]
    stats = concurrency_stats(intervals, span_s=113.0)
    assert stats is not None
    assert stats.max == 4 and stats.p50 == 1.0 and stats.p95 == 4.0  # 2 of 13 busy seconds at 4 = 15%
    assert stats.busy_s == pytest.approx(13.0) and stats.busy_share == pytest.approx(13.0 / 113.0, abs=1e-3)
    assert stats.mean == pytest.approx((11 * 1 + 2 * 4) / 13, abs=1e-3)
    # back-to-back requests (one ends as the next arrives) are one in flight, not two
    assert concurrency_stats([(0.0, 1.0), (1.0, 2.0)], 2.0).max == 1  # type: ignore[union-attr]


def test_profile_of_rows_lengths_rate_burstiness_and_lifetimes() -> None:
    rows = [row(1000.0 + i, 0.5, prompt=50 + i % 3 * 50, output=10 * (1 + i % 2)) for i in range(60)]
    rows += [row(1100.0 + j * 0.25, 0.5) for j in range(40)]  # a burst: 40 in 10 s
    rows.append(row(1200.0, 0.1, status=502, prompt=0, output=0))
    launches = [RunRecord(kind="launch", engine="llama.cpp", created_at=900.0, id=1),
                RunRecord(kind="launch", engine="vllm", created_at=1050.0, id=2)]
    profile = build_profile(rows, launches, since=0.0, until=2000.0)
    assert profile.requests == 101 and profile.failed == 1 and profile.enough
    assert profile.prompt_tokens is not None and profile.prompt_tokens.p50 == 100.0
    assert profile.prompt_tokens.max == 150
    logs = [math.log(v) for v in [50 + i % 3 * 50 for i in range(60)] + [100] * 40]
    assert profile.prompt_tokens.lognormal_mu == pytest.approx(sum(logs) / len(logs), abs=1e-3)
    assert profile.burstiness is not None and profile.burstiness > 1.0  # the burst minute beats the mean
    assert max(v for _, v in profile.rate) == profile.peak_rpm and profile.mean_rpm <= profile.peak_rpm
    assert profile.concurrency is not None and profile.concurrency.max == 2
    assert [life.lifetime_s for life in profile.lifetimes] == [150.0, pytest.approx(1200.1 - 1050.0)]
    assert [life.ended_by for life in profile.lifetimes] == ["next launch", "last request"]
    assert profile.restarts == 1
    line = profile.summary_line()
    assert line.startswith("from 101 requests over 3 min") and "p95 concurrency 2" in line
    workload = profile.workload(output_len=77)
    assert workload.concurrency == 2 and workload.prompt_len == 100 and workload.output_len == 77
    assert profile.captured_bodies == 0 and profile.shared_prefix_share is None
    json.dumps(profile.to_json())  # serializable for --json


def test_ollama_requests_are_workload_and_listings_are_not() -> None:
    """Requests an Ollama client sent (/api/chat, /api/generate) count as the workload; /api/tags does not."""
    rows = [{**row(1000.0 + i, 0.5), "path": path} for i, path in
            enumerate(["/api/chat", "/api/generate", "/api/tags", "/v1/chat/completions"])]
    assert build_profile(rows, since=0.0, until=2000.0).requests == 3


def test_shared_prefix_share_from_captured_bodies_only() -> None:
    system = "You are a helpful assistant. " * 10
    bodies = [json.dumps({"prompt": system + f"question {i}"}) for i in range(6)]
    bodies += [json.dumps({"messages": [{"role": "user", "content": f"unique {i} " * 40}]}) for i in range(4)]
    rows = [row(float(i), 0.1, body=b) for i, b in enumerate(bodies)] + [row(20.0, 0.1)]
    profile = build_profile(rows)
    assert profile.captured_bodies == 10 and profile.shared_prefix_share == pytest.approx(0.6)
    assert shared_prefix_share(["short", "short"]) == 0.0  # under the prefix length: not "shared"


def test_empty_log_profile_says_what_to_do() -> None:
    profile = build_profile([])
    assert profile.requests == 0 and not profile.enough and "switchyard serve --endpoint" in profile.notes[0]


def test_since_and_speed_parsing_fail_with_one_clear_line() -> None:
    assert parse_since("7d", now=1_000_000.0) == 1_000_000.0 - 7 * 86400
    assert parse_since("90", now=100.0) == 10.0
    for bad in ("x", "-1d", "0h", "nand"):
        with pytest.raises(SwitchyardError):
            parse_since(bad)
    assert parse_speed("2x") == 2.0 and parse_speed("0.5") == 0.5
    for bad in ("fast", "0x", "-2x", "infx"):
        with pytest.raises(SwitchyardError):
            parse_speed(bad)


def test_replay_schedule_keeps_arrival_offsets_sizes_and_captured_bodies() -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    rows = [row(10.5, 1.0, prompt=30, output=7), row(10.0, 1.0, prompt=20, output=5, body=body),
            row(12.0, 1.0, prompt=0, output=0, status=502), {**row(13.0, 1.0), "status": 0}]
    schedule = ReplaySchedule.from_rows(rows)
    assert [i.offset_s for i in schedule.items] == [0.0, 0.5, 2.0]  # sorted by arrival; in-flight rows skipped
    assert schedule.items[0].body is not None and schedule.items[1].body is None
    spec = schedule.items[0].spec(None, 0)
    assert spec.messages == [{"role": "user", "content": "hi"}] and spec.max_tokens == 5
    assert schedule.items[2].prompt_tokens == 16 and schedule.items[2].output_tokens == 64  # a failed one
    assert schedule.to_json()["captured_bodies"] == 1
    with pytest.raises(SwitchyardError, match="no recorded requests to replay"):
        ReplaySchedule.from_rows([])
