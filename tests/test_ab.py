"""A/B analysis (amortization, cost, scenarios) on known numbers, and one short run with both real engines."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
from test_reports import engine

from desktop.core.common.errors import SwitchyardError
from desktop.core.measure.ab import ABConfig, amortization_verdict, analyse, cost_per_million


def test_break_even_lifetime() -> None:
    quick = engine("a", speed=10.0, ttft=0.05, cold=2.0)  # 80 tok/s at c=8
    strong = engine("b", speed=20.0, ttft=0.05, cold=62.0)  # 160 tok/s at c=8
    verdict = amortization_verdict(quick, strong, 8)
    # 80 (L - 2) = 160 (L - 62)  =>  L = (160*62 - 80*2) / 80 = 122 s
    assert verdict["break_even_s"] == pytest.approx(122.0)
    assert "b starts 60.0 s slower" in verdict["verdict"] and "a is ahead" in verdict["verdict"]


def test_dominant_engine_wins_at_any_lifetime() -> None:
    verdict = amortization_verdict(engine("a", 30.0, 0.05, 1.0), engine("b", 10.0, 0.05, 5.0), 8)
    assert verdict["break_even_s"] is None and "wins at any service lifetime" in verdict["verdict"]


def test_cost_per_million_amortizes_cold_start() -> None:
    # 1000 tok/s for one hour at 3.6 per hour: steady 1.0 per 1M tokens; a 360 s cold start adds 10%
    assert cost_per_million(3.6, 1000.0, 0.0, 3600.0) == pytest.approx(1.0)
    assert cost_per_million(3.6, 1000.0, 360.0, 3600.0) == pytest.approx(1.1)


def test_power_price_and_scenarios() -> None:
    config = ABConfig(power_watts=500.0, price_per_kwh=0.2, concurrency=(1, 8, 32))
    assert config.hourly_price() == (pytest.approx(0.1), "currency (power x electricity)")
    result = analyse(config, [engine("a", 10.0, 0.05, 1.0), engine("b", 20.0, 0.05, 600.0)], 0.0, 1.0)
    by_name = {row["scenario"]: row for row in result.scenarios}
    assert by_name["Local development, frequent restarts"]["winner"] == "a"  # 10 min life, 10 min start
    assert by_name["High-concurrency API"]["winner"] == "b"
    assert by_name["High-concurrency API"]["concurrency"] == 32
    assert all(c["unit"].startswith("currency") for c in result.costs)


def test_local_development_is_decided_by_the_first_answer_after_a_restart() -> None:
    """A 4x faster engine that starts 40 s later would serve more tokens in a saturated 10-minute life, but a
    developer who restarts and asks once waits for the first answer: the quick starter wins."""
    config = ABConfig(concurrency=(1, 4))
    result = analyse(config, [engine("quick", 5.0, 0.05, 0.5), engine("fast", 20.0, 0.05, 42.0)], 0.0, 1.0)
    dev = next(row for row in result.scenarios if row["scenario"].startswith("Local development"))
    assert dev["winner"] == "quick"
    assert dev["engines"]["quick"]["first_answer_after_restart_s"] < dev["engines"]["fast"]["first_answer_after_restart_s"]


def test_attached_endpoint_has_no_cold_start_in_verdict_costs_and_report(tmp_path: Path) -> None:
    from desktop.core.measure.ab import NO_COLD_START, EngineResult, Repetition
    from desktop.core.measure.reports import write_ab_report

    local = engine("llama.cpp", 10.0, 0.05, 30.0)
    remote_rep = engine("x", 20.0, 0.05, 0.0).repetitions[0]
    remote = EngineResult("endpoint:team", "team (attached)", "unknown", "m", {"attached": True},
                          [Repetition({"attached": True, "note": NO_COLD_START}, remote_rep.sweep, {}, [])],
                          kind="external", note=NO_COLD_START)
    config = ABConfig(engines=("llama.cpp", "endpoint:team"), concurrency=(1, 8, 32))
    result = analyse(config, [local, remote], 0.0, 1.0)
    assert result.amortization["break_even_s"] is None
    assert "already running" in result.amortization["verdict"] and "2.00x" in result.amortization["verdict"]
    assert result.cold_start["t3_first_request_s"]["endpoint:team"]["n"] == 0
    assert result.cold_start["notes"] == {"endpoint:team": NO_COLD_START}
    steady = {(c["engine"], c["concurrency"]): c for c in result.costs}
    remote_cost = steady[("endpoint:team", 8)]  # nothing to amortize: with-cold-start cost == steady-state cost
    assert remote_cost["cost_per_million_output_tokens"] == pytest.approx(remote_cost["steady_state_cost_per_million"])
    cell = result.scenarios[0]["engines"]["endpoint:team"]
    assert cell["cold_start_s"] is None and cell["attached"] is True
    html = write_ab_report(result, tmp_path).html.read_text()
    assert NO_COLD_START in html and "its costs count no cold start" in html
    with pytest.raises(SwitchyardError, match="names no endpoint"):
        ABConfig(engines=("llama.cpp", "endpoint:"))


def test_config_rejects_bad_input() -> None:
    with pytest.raises(SwitchyardError, match="two different engines"):
        ABConfig(engines=("vllm", "vllm"))
    with pytest.raises(SwitchyardError, match="concurrency"):
        ABConfig(concurrency=(0,))


@pytest.mark.engine
@pytest.mark.llamacpp
@pytest.mark.vllm
def test_ab_cli_both_real_engines(tmp_path: Path, capsys: pytest.CaptureFixture[str], llama_install,  # type: ignore[no-untyped-def]
                                  vllm_install) -> None:
    """One short real A/B: llama.cpp vs vLLM (eager: no torch.compile) on the demo model, through the CLI.
    The engines come from conftest's provisioning fixtures, so a broken `find_install` fails instead of skipping."""
    from desktop.cli import main
    from desktop.core.storage.history import Store

    with Store() as store:
        before = {run.id for run in store.runs(limit=1000, kind="ab")}

    report = tmp_path / "report"
    code = main(["ab", "--model", "demo", "--engines", "llama.cpp,vllm", "--concurrency", "1,4", "--eager",
                 "--requests", "8", "--input-len", "16", "--output-len", "16", "--report", str(report), "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert not data["errors"]
    saved = json.loads((report / "ab.json").read_text())
    assert saved["config"]["eager"] is True and [e["engine"] for e in saved["engines"]] == ["llama.cpp", "vllm"]
    vllm_plan = saved["engines"][1]["plan"]
    assert vllm_plan["eager"] is True and vllm_plan["slots"] == 4
    with open(report / "ab.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert sorted((r["engine"], r["concurrency"]) for r in rows) == [
        ("llama.cpp", "1"), ("llama.cpp", "4"), ("vllm", "1"), ("vllm", "4")]
    html = (report / "ab.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and html.count("<svg") >= 4 and "<script" not in html
    for engine_data in data["engines"]:
        rep = engine_data["repetitions"][0]
        cold = rep["cold_start"]
        assert 0 < cold["t1_health_s"] <= cold["t2_first_token_s"] <= cold["t3_first_request_s"]
        assert engine_data["peak_rss_mib"] > 10
        for level_data in rep["sweep"]["levels"]:
            assert level_data["completed"] == 8 and level_data["failed"] == 0
            assert level_data["total_output_tokens"] == 8 * 16 and not level_data["tokens_estimated"]
            assert level_data["output_throughput"] > 0 and level_data["median_ttft_ms"] > 0
    for phase in ("t1_health_s", "t2_first_token_s", "t3_first_request_s"):
        assert data["cold_start"][phase]["ratio"]["mean"] > 0
    for row in data["comparison"]:
        for key in ("output_throughput", "median_ttft_ms"):
            cells = row[key]
            assert cells["ratio"]["mean"] == pytest.approx(cells["vllm"]["mean"] / cells["llama.cpp"]["mean"])
    assert data["amortization"]["concurrency"] == 4 and data["amortization"]["verdict"]
    # the run went to the session's temp home's history, with the report it wrote
    with Store() as store:
        assert str(store.path).startswith(os.environ["SWITCHYARD_HOME"])
        new_runs = [run for run in store.runs(limit=1000, kind="ab") if run.id not in before]
    assert len(new_runs) == 1 and new_runs[0].model == "demo"
    assert new_runs[0].report_path == str(report / "ab.html")
    assert {e["engine"] for e in new_runs[0].summary["engines"]} == {"llama.cpp", "vllm"}
