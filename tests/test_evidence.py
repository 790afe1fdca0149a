"""The recommender learns from this machine's history: A/B and bench curves, cold starts and load memory of
launches, each figure tagged measured (run id and date) or default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.measure.ab import ABConfig, analyse
from desktop.core.measure.reports import record_ab, record_bench
from desktop.core.models.facts import facts_for, facts_from_config
from desktop.core.planning.evidence import Evidence, from_runs, gather, model_key
from desktop.core.planning.fit import estimate, sizing_plan
from desktop.core.planning.recommend import Workload, recommend
from desktop.core.runtime.launches import record_launch
from desktop.core.storage.history import RunRecord, Store, machine_name
from tests.test_reports import engine, sweep

SNAPDIR = Path(__file__).parent / "snapshots"
CPU = HardwareSnapshot.load(SNAPDIR / "cpu_laptop.json")


def ab_history(store: Store, llama_speed: float, vllm_speed: float, model: str = "demo",
               llama_cold: float = 0.33, vllm_cold: float = 57.0) -> int:
    """An A/B recorded exactly as `switchyard ab` records it (synthetic levels at c=1, 8, 32)."""
    config = ABConfig(model=model, concurrency=(1, 8, 32))
    result = analyse(config, [engine("llama.cpp", llama_speed, 0.05, llama_cold),
                              engine("vllm", vllm_speed, 0.05, vllm_cold)], 0.0, 1.0)
    return record_ab(store, result)


def test_the_engine_ab_measured_faster_wins_and_flips_with_the_curve(tmp_path: Path) -> None:
    demo = facts_for("demo")
    workload = Workload(concurrency=8)
    with Store(tmp_path / "h.sqlite3") as store:
        run = ab_history(store, llama_speed=10.0, vllm_speed=14.0)
        rec = recommend(demo, CPU, workload, evidence=gather(demo, store))
        assert rec.engine == "vllm"  # default figures on a CPU say llama.cpp; the measurement says vLLM
        figures = rec.numbers["figures"]
        assert figures["vllm_throughput_gain"]["source"] == "measured"
        assert figures["vllm_throughput_gain"]["value"] == pytest.approx(1.4)
        for name in ("llama.cpp", "vllm"):
            assert figures["throughput_tok_s"][name]["run_id"] == run
            assert figures["cold_start_s"][name] == {**figures["cold_start_s"][name], "source": "measured",
                                                     "run_id": run}
        assert figures["cold_start_s"]["vllm"]["value"] == pytest.approx(57.0)
        assert figures["ttft_p50_ms"]["vllm"]["source"] == "measured"
        # the A/B sent 64/32-token prompts/outputs, the workload asks 512/256: the nearest settings, said so
        assert "nearest settings" in figures["vllm_throughput_gain"]["note"]
        assert any(f"run #{run}" in r for r in rec.reasons)

        flipped = ab_history(store, llama_speed=14.0, vllm_speed=10.0)  # newer: the curve flips
        rec = recommend(demo, CPU, workload, evidence=gather(demo, store))
        assert rec.engine == "llama.cpp"
        assert rec.numbers["figures"]["vllm_throughput_gain"]["run_id"] == flipped
        assert rec.numbers["figures"]["vllm_throughput_gain"]["value"] == pytest.approx(10 / 14, rel=1e-3)
        assert f"run #{flipped}" in rec.runner_up["why_lost"]

    defaults = recommend(demo, CPU, workload, evidence=Evidence.none("demo"))
    assert defaults.numbers["figures"]["vllm_throughput_gain"]["source"] == "default"
    assert defaults.numbers["cold_start_source"] == {"llama.cpp": "default", "vllm": "default"}


def test_interpolation_between_levels_and_held_outside(tmp_path: Path) -> None:
    with Store(tmp_path / "h.sqlite3") as store:
        ab_history(store, llama_speed=10.0, vllm_speed=20.0)
        found = gather("demo", store).get("vllm")
    assert found is not None
    at8, at4, at64 = found.throughput_at(8), found.throughput_at(4), found.throughput_at(64)
    assert at8 is not None and at8.value == pytest.approx(160.0) and at8.note is None  # 20 tok/s x c
    assert at4 is not None and 20.0 < at4.value < 160.0 and "interpolated between c=1 and c=8" in (at4.note or "")
    assert at4.value == pytest.approx(20.0 + (160.0 - 20.0) * 2 / 3)  # log2 scale: c=4 is 2/3 of the way
    assert at64 is not None and at64.value == pytest.approx(640.0) and "held at c=32" in (at64.note or "")
    ttft = found.ttft_at(8)
    assert ttft is not None and ttft.measured


def test_nearest_model_gives_the_ratio_and_says_so(tmp_path: Path) -> None:
    other = tmp_path / "tiny-llama.gguf"
    with Store(tmp_path / "h.sqlite3") as store:
        ab_history(store, llama_speed=10.0, vllm_speed=30.0, model=str(other))
        evidence = gather("demo", store)
    gain = evidence.gain(8)
    assert gain is not None and gain.value == pytest.approx(3.0)
    assert "nearest measured model" in (gain.note or "") and "tiny-llama" in (gain.note or "")
    assert evidence.cold_start("vllm") is None  # cold starts scale with the model: not borrowed


def test_runs_of_other_machines_and_models_are_ignored(tmp_path: Path) -> None:
    with Store(tmp_path / "h.sqlite3") as store:
        store.add_run(RunRecord(kind="launch", engine="vllm", model="demo", machine="elsewhere",
                                summary={"cold_start": {"t3_first_request_s": 1.0}}))
        store.add_run(RunRecord(kind="launch", engine="vllm", model="other-model",
                                summary={"cold_start": {"t3_first_request_s": 2.0}}))
        evidence = gather("demo", store)
    assert evidence.engines == {} and evidence.notes
    assert model_key("/x/y/Qwen2-0.5B.gguf") == "qwen2-0.5b" == model_key("Qwen/Qwen2-0.5B")


def test_bench_runs_give_a_curve_and_a_cold_start(tmp_path: Path) -> None:
    meta = {"endpoint": "http://127.0.0.1:1", "engine": "llama.cpp", "model": "demo", "settings": {},
            "cold_start": {"t1_health_s": 0.2, "t3_first_request_s": 0.4}}
    with Store(tmp_path / "h.sqlite3") as store:
        run = record_bench(store, sweep(12.0, 0.05), meta)
        found = gather("demo", store).get("llama.cpp")
    assert found is not None and found.cold_start is not None
    assert found.cold_start.value == pytest.approx(0.4) and found.cold_start.run_id == run
    assert found.throughput_at(8) is not None


def test_cli_recommend_reads_history_and_no_history_ignores_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    with Store(home / "history.sqlite3") as store:
        run = ab_history(store, llama_speed=10.0, vllm_speed=16.0)
    env = {**os.environ, "SWITCHYARD_HOME": str(home), "PYTHONPATH": str(Path(__file__).parents[1])}

    def cli(*extra: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "desktop", "recommend", "demo", "--concurrency", "8", "--json",
                              *extra], capture_output=True, text=True, timeout=300, check=False, env=env)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    data = cli()
    assert data["engine"] == "vllm"
    figures = data["numbers"]["figures"]
    assert figures["vllm_throughput_gain"]["source"] == "measured" and figures["vllm_throughput_gain"]["run_id"] == run
    assert {figures["cold_start_s"][e]["run_id"] for e in ("llama.cpp", "vllm")} == {run}
    plain = cli("--no-history")
    assert plain["numbers"]["figures"]["vllm_throughput_gain"]["source"] == "default"
    assert plain["evidence"]["consulted"] is False


def test_a_real_launch_is_recorded_and_corrects_the_next_fit(tmp_path: Path, llama_server) -> None:  # type: ignore[no-untyped-def]
    """A real llama-server launch of the demo (2048 tokens x 8 slots) is recorded; its resident memory is within
    a bound of the fit's prediction for that plan, and the next recommendation carries the measured difference."""
    demo = facts_for("demo")
    with Store(tmp_path / "h.sqlite3") as store:
        run = record_launch(llama_server, "demo", store=store)
        assert run is not None
        record = store.get_run(run)
        assert record is not None and record.kind == "launch" and record.machine == machine_name()
        assert record.summary["cold_start"]["t3_first_request_s"] > 0
        evidence = gather(demo, store)
    llama_fit = estimate(demo, CPU, sizing_plan("llama.cpp", ctx_per_request=2048, slots=8))
    rss = record.summary["load_memory"]["rss_gib"]
    # The process holds what the fit counts plus its own code, libraries and HTTP server: the weights are mapped
    # and read at warm-up, and llama.cpp clears its KV buffer when it makes it, so every counted page is resident
    # (measured here: 8 MiB above the fit at 512x1, 2048x8 and 4096x8). A measurement (or a fit) off by a tenth
    # of a GiB fails, on a 0.24 GiB prediction. The prompt cache (--cache-ram) the fit also counts fills only as
    # prompts come and go later: none of it is resident at load.
    at_load = llama_fit.total_gib - llama_fit.breakdown["prompt_cache"]
    assert llama_fit.breakdown["prompt_cache"] > 0
    assert at_load - 0.05 <= rss <= at_load + 0.1, (rss, llama_fit)
    found = evidence.get("llama.cpp")
    assert found is not None and found.cold_start is not None and found.cold_start.run_id == run
    assert found.load_memory is not None
    rec = recommend(demo, CPU, Workload(concurrency=8), evidence=evidence)
    checks = rec.numbers["memory_checks"]
    assert checks and checks[0]["what"] == "total (process RSS)"
    assert checks[0]["measured_gib"] == pytest.approx(rss, abs=1e-3)
    assert checks[0]["predicted_gib"] == pytest.approx(at_load, abs=1e-3)
    assert rec.engine == "llama.cpp"  # a CPU laptop snapshot and no A/B in this history
    error = checks[0]["error_gib"]
    assert error == pytest.approx(rss - at_load, abs=2e-3)
    if abs(error) >= 0.005:  # below that the correction is rounding and is not applied
        assert rec.fit is not None and rec.fit.breakdown.get("measured_correction") == pytest.approx(error, abs=1e-3)
        assert rec.fit.plan is not None
        uncorrected = estimate(demo, CPU, rec.fit.plan)
        assert rec.fit.total_gib == pytest.approx(uncorrected.total_gib + error, abs=2e-3)
        assert any(f"launch #{run}" in note for note in rec.fit.notes)
    else:  # rounding: the fit is left as it is, and says nothing of a correction
        assert rec.fit is not None and "measured_correction" not in rec.fit.breakdown


def test_from_runs_on_empty_history() -> None:
    evidence = from_runs([], facts_from_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                "num_hidden_layers": 2, "hidden_size": 64,
                                                "num_attention_heads": 4, "vocab_size": 100}))
    assert evidence.engines == {} and evidence.gain(8) is None and evidence.consulted


def test_recommend_page_shows_figures_and_offers_a_measurement_when_defaults_decide(qtbot, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from desktop.ui.pages.recommend import RecommendPage

    page = RecommendPage()
    qtbot.addWidget(page)
    demo = facts_for("demo")
    close = recommend(demo, CPU, Workload(concurrency=8), evidence=Evidence.none("demo"))
    assert close.numbers["rests_on_defaults"] and close.numbers["close_call"]
    page.show_recommendation(close)
    assert not page.measure_button.isHidden() and "min A/B" in page.measure_button.text()
    assert "default" in page.result_label.text()
    with qtbot.waitSignal(page.measure_requested) as signal:
        page.measure_button.click()
    job = signal.args[0]
    assert job["kind"] == "ab" and job["config"]["engines"] == ["llama.cpp", "vllm"]
    assert job["config"]["concurrency"] == [1, 8] and job["config"]["model"] == "demo"

    with Store(tmp_path / "h.sqlite3") as store:
        run = ab_history(store, llama_speed=10.0, vllm_speed=14.0)
        measured = recommend(demo, CPU, Workload(concurrency=8), evidence=gather(demo, store))
    page.show_recommendation(measured)
    assert page.measure_button.isHidden()  # measured: nothing to offer
    assert f"run #{run}" in page.result_label.text()


def test_endpoint_launches_go_to_history_for_the_next_recommendation(llama_install, demo_model) -> None:  # type: ignore[no-untyped-def]
    """The GUI and `serve --endpoint` launch through the endpoint manager: each ready engine leaves a launch row
    (cold start T1-T3, memory) that the next `recommend` reads."""
    from desktop.core.planning.planner import ask
    from desktop.core.runtime.ports import find_free_port
    from desktop.core.serving.endpoint import EndpointManager
    from desktop.core.serving.proxy import ProxyServer

    with Store() as store:
        before = {r.id for r in store.runs(kind="launch")}
    proxy = ProxyServer(port=find_free_port(), wait_timeout=600)
    proxy.start()
    manager = EndpointManager(proxy, ready_timeout=600)
    try:
        manager.start(ask("llama.cpp", "demo", {"slots": 2}))
    finally:
        manager.close()
        proxy.stop()
    with Store() as store:
        new = [r for r in store.runs(kind="launch") if r.id not in before]
        evidence = gather("demo", store)
    assert len(new) == 1 and new[0].engine == "llama.cpp" and new[0].model == "demo"
    assert new[0].summary["source"] == "endpoint" and new[0].summary["cold_start"]["t3_first_request_s"] > 0
    found = evidence.get("llama.cpp")
    assert found is not None and found.cold_start is not None and found.cold_start.measured
    assert found.load_memory is not None and found.load_memory.measured["rss_gib"] > 0


def test_a_launch_that_used_more_memory_than_predicted_corrects_the_next_fit(tmp_path: Path) -> None:
    from desktop.core.planning.evidence import corrected_fit, memory_checks

    demo = facts_for("demo")
    settings = {"ctx": 512, "parallel": 4}
    predicted = estimate(demo, CPU, sizing_plan("llama.cpp", ctx_per_request=512, slots=4))
    measured_total = predicted.available_gib + 1.0  # the launch used more than this machine has free now
    with Store(tmp_path / "h.sqlite3") as store:
        run = store.add_run(RunRecord(kind="launch", engine="llama.cpp", model="demo", settings=settings,
                                      summary={"cold_start": {"t3_first_request_s": 0.5},
                                               "load_memory": {"rss_gib": measured_total}}))
        found = gather(demo, store).get("llama.cpp")
    assert found is not None and found.load_memory is not None and found.load_memory.run_id == run
    checks = memory_checks(demo, CPU, found.load_memory)
    assert [c.what for c in checks] == ["total (process RSS)"]
    cache = predicted.breakdown["prompt_cache"]  # llama-server's prompt cache: counted, but never resident at load
    assert checks[0].predicted_gib == pytest.approx(predicted.total_gib - cache, abs=1e-3)
    corrected = corrected_fit(predicted, checks)
    assert corrected.fits == "no" and corrected.total_gib == pytest.approx(measured_total + cache, abs=1e-2)
    assert any(f"launch #{run}" in note for note in corrected.notes)
    assert corrected_fit(predicted, []) is predicted
