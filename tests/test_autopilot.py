"""The crossover picture and the hybrid policy (pure): every branch of the policy with stand-in curves, and the
crossover from real history rows in a real SQLite store."""

from __future__ import annotations

import time

import pytest

from desktop.core.planning.autopilot import PolicyInputs, decide, sustained_load
from desktop.core.planning.crossover import DEFAULT_TAG, EngineCurve, crossover, curves_from_history
from desktop.core.storage.history import RunRecord, Store

NOW = 10_000.0


def _curves(vllm_points: list[tuple[int, float]], cold: float = 95.0) -> list[EngineCurve]:
    llama = EngineCurve.measured_points("llama.cpp", [(1, 40.0, 50.0), (8, 100.0, 300.0), (32, 110.0, 900.0)],
                                        NOW, cold_start_s=5.0)
    vllm = EngineCurve.measured_points("vllm", [(c, t, 100.0) for c, t in vllm_points], NOW, cold_start_s=cold)
    return [llama, vllm]


GPU_LIKE = [(1, 30.0), (8, 200.0), (32, 600.0)]  # vLLM overtakes between 1 and 8
CPU_LIKE = [(1, 20.0), (8, 60.0), (32, 70.0)]  # llama.cpp faster everywhere


def _load(level: float, seconds: float = 400.0, step: float = 1.0) -> list[tuple[float, float]]:
    count = int(seconds / step)
    return [(NOW - seconds + i * step, level) for i in range(count)]


def _inputs(**kw: object) -> PolicyInputs:
    base: dict[str, object] = dict(now=NOW, crossover=crossover(_curves(GPU_LIKE), operating_concurrency=14),
                                   inflight=_load(14), expected_remaining_s=3600.0, both_fit=True)
    base.update(kw)
    return PolicyInputs(**base)  # type: ignore[arg-type]


def test_crossover_found_between_levels_and_break_even_matches_formula() -> None:
    x = crossover(_curves(GPU_LIKE), operating_concurrency=8)
    assert x.base == "llama.cpp" and x.other == "vllm"
    assert x.crossover_concurrency is not None and 1 < x.crossover_concurrency < 8
    ta, tb = 100.0, 200.0
    assert x.break_even_s == pytest.approx((tb * 95.0 - ta * 5.0) / (tb - ta))
    assert x.faster_at_operating == "vllm"
    assert all(c.tag.startswith("as measured on this machine on ") for c in x.curves)


def test_crossover_none_when_llama_faster_everywhere() -> None:
    x = crossover(_curves(CPU_LIKE), operating_concurrency=8)
    assert x.crossover_concurrency is None and x.break_even_s is None
    assert "llama.cpp measures faster at every concurrency" in x.verdict


def test_policy_load_above_crossover_long_lifetime_both_fit_starts_standby() -> None:
    d = decide(_inputs())
    assert d.action == "start_standby"
    assert "in-flight p95 14 over 5 min > crossover" in d.reason and "vLLM cold start 95 s pays back in" in d.reason
    # both fit: only the co-resident share of llama.cpp's output is lost while vLLM loads
    ta, tb = d.numbers["llama_tok_s"], d.numbers["vllm_tok_s"]
    assert d.numbers["payback_s"] == pytest.approx(95.0 + ta * 95.0 * 0.2 / (tb - ta), abs=0.1)


def test_policy_only_one_fits_goes_stop_first_with_the_gap_shown() -> None:
    d = decide(_inputs(both_fit=False))
    assert d.action == "switch_stop_first"
    assert d.numbers["expected_gap_s"] == 95.0 and "no engine serves for about 95 s" in d.reason
    both = decide(_inputs(both_fit=True))
    assert d.numbers["payback_s"] > both.numbers["payback_s"]  # losing all of llama.cpp's output costs more


def test_policy_load_below_crossover_stays() -> None:
    d = decide(_inputs(inflight=_load(1)))
    assert d.action == "stay" and "<= crossover" in d.reason


def test_policy_short_lifetime_stays_even_above_crossover() -> None:
    d = decide(_inputs(expected_remaining_s=60.0))
    assert d.action == "stay" and "expected to end in 60 s" in d.reason


def test_policy_llama_faster_everywhere_stays_and_says_why() -> None:
    d = decide(_inputs(crossover=crossover(_curves(CPU_LIKE), operating_concurrency=14)))
    assert d.action == "stay" and "llama.cpp measures faster at every concurrency (1, 8, 32" in d.reason


def test_policy_watches_until_the_window_is_full_then_hands_over_and_retires() -> None:
    assert decide(_inputs(inflight=_load(14, seconds=60))).action == "watch"
    assert decide(_inputs(vllm_state="starting")).action == "watch"
    assert decide(_inputs(vllm_state="ready")).action == "hand_over"
    busy = decide(_inputs(active="vllm", vllm_state="ready", inflight=_load(14, seconds=700)))
    assert busy.action == "stay"
    idle = decide(_inputs(active="vllm", vllm_state="ready", inflight=_load(0, seconds=700)))
    assert idle.action == "retire" and "retiring vLLM" in idle.reason


def test_sustained_load_is_time_weighted() -> None:
    samples = [(NOW - 300, 2.0), (NOW - 10, 20.0)]  # 20 for the last 10 s of 300: under 5% -> p95 is 2
    assert sustained_load(samples, NOW, 300.0) == (2.0, 300.0)
    samples = [(NOW - 300, 2.0), (NOW - 30, 20.0)]  # 10% of the window at 20
    assert sustained_load(samples, NOW, 300.0)[0] == 20.0


def test_crossover_from_history_tags_measured_and_default(tmp_path: object) -> None:
    from pathlib import Path

    with Store(Path(str(tmp_path)) / "h.sqlite3") as store:
        comparison = [{"concurrency": c, "output_throughput": {"llama.cpp": {"mean": a}, "vllm": {"mean": b}},
                       "p95_ttft_ms": {"llama.cpp": {"mean": 10.0 * c}, "vllm": {"mean": 20.0 * c}}}
                      for c, a, b in ((1, 40.0, 30.0), (8, 100.0, 200.0))]
        created = time.time()
        store.add_run(RunRecord(kind="ab", engine="llama.cpp,vllm", model="demo", created_at=created,
                                summary={"comparison": comparison, "cold_start": {
                                    "t3_first_request_s": {"llama.cpp": {"mean": 3.0}, "vllm": {"mean": 60.0}}}}))
        curves = curves_from_history(store.runs(), "demo", cpu=True)
        other = curves_from_history(store.runs(), "some-other-model", cpu=True)
    assert [c.engine for c in curves] == ["llama.cpp", "vllm"]
    assert curves[1].points[1].output_tok_s == 200.0 and curves[1].points[1].ttft_p95_ms == 160.0
    assert curves[1].cold_start_s == 60.0 and curves[1].tag == f"as measured on this machine on " \
        f"{time.strftime('%Y-%m-%d', time.localtime(created))}"
    assert all(c.tag == DEFAULT_TAG for c in other)
    x = crossover(curves, operating_concurrency=8)
    assert x.crossover_concurrency is not None and 1 < x.crossover_concurrency < 8
