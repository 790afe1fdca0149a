"""Issue 20's "one door": on recorded GPU machines (an RTX 4090 whose desktop holds 4 of its 24 GiB, and a box with a
4090 beside a 3060), every path that starts an engine launches exactly the planner's checked plan, and a plan that
does not fit is refused on that path with one line naming the fix, before any process exists.

The engines are recorded, never started: the supervisor's EngineProcess is replaced by `Recorded`, which keeps the
plan and the argv it would run (the real adapter's build_command) and pretends to serve. The proxy is real."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from desktop.cli import main
from desktop.core.common.errors import EngineFailed, SwitchyardError
from desktop.core.engines import get_adapter
from desktop.core.engines.base import EngineInstall, FailureReason, LaunchPlan
from desktop.core.engines.llamacpp import LlamaCppAdapter
from desktop.core.engines.vllm import SLEEP_MODE_FLAG, VllmAdapter
from desktop.core.machine.hardware import GIB, HardwareSnapshot
from desktop.core.planning.launch import PlanRefused
from desktop.core.planning.planner import ask, asks_of, plan_launch, replan
from desktop.core.runtime.ports import find_free_port
from desktop.core.runtime.supervisor import ColdStart, EngineOutcome, EngineState
from desktop.core.serving import loading as loading_module
from desktop.core.serving.endpoint import EndpointManager, LoadOutOfMemory, MemoryBudget, machine_budget
from desktop.core.serving.fleet import Fleet, parse_models_config, plan_models
from desktop.core.serving.proxy import ProxyServer

HERE = Path(__file__).parent
DESKTOP = HardwareSnapshot.load(HERE / "snapshots" / "rtx4090_20free.json")
MIXED = HardwareSnapshot.load(HERE / "snapshots" / "rtx4090_rtx3060.json")
MACHINES = {"rtx4090_20free": DESKTOP, "rtx4090_rtx3060": MIXED}
FIXTURES = HERE / "fixtures" / "models"
INSTALLS = {"llama.cpp": EngineInstall("llama.cpp", "recorded", "cache", Path("/opt/llama.cpp/bin/llama-server")),
            "vllm": EngineInstall("vllm", "recorded", "cache", Path("/opt/vllm/venv/bin/python"),
                                  details={"backend": "cuda"})}  # the CUDA build: sleep mode is kept


class Recorded:
    """Stands in for runtime.supervisor.EngineProcess: records what would run, never starts a process."""

    launched: list[Recorded] = []
    fail_ctx_above: int | None = None  # an "out of memory" load for plans with more context than this
    fail_log: list[str] = []  # what the failed load printed (its log tail)
    refuse_start = False  # stop right at start (the CLI's plain serve, bench and the A/B end there)

    def __init__(self, adapter: Any, plan: LaunchPlan, install: EngineInstall, tcp: bool = False) -> None:
        self.adapter, self.install = adapter, install
        self.plan = replace(plan, port=plan.port or find_free_port())
        self.argv = adapter.build_command(self.plan, install).argv
        self.state = EngineState.STARTING
        self.cold_start = ColdStart(t1_health_s=0.1, t2_first_token_s=0.2, t3_first_request_s=0.3)
        self.outcome: EngineOutcome | None = None
        self.pid: int | None = None
        self.log_path = Path("/dev/null")
        Recorded.launched.append(self)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.plan.port}"

    @property
    def address_tag(self) -> str:
        return str(self.plan.port)

    socket_path: str | None = None  # a TCP "engine": the endpoint asks listener_holds() per connection

    def listener_holds(self) -> bool:
        return True

    def start(self) -> None:
        if Recorded.refuse_start:
            raise SwitchyardError("recorded, not started")

    def wait_ready(self, timeout: float = 0, first_request: bool = True) -> ColdStart:
        if Recorded.fail_ctx_above is not None and self.plan.ctx_per_request > Recorded.fail_ctx_above:
            reason = FailureReason("the engine ran out of memory while loading", "lower the context", memory=True)
            self.outcome = EngineOutcome(EngineState.CRASHED, 1, reason, str(self.log_path))
            raise EngineFailed(reason.reason, reason.suggestion)
        self.state = EngineState.READY
        return self.cold_start

    def subscribe(self, _listener: Any) -> None:
        pass

    def log_tail(self, lines: int = 200) -> list[str]:
        return Recorded.fail_log[-lines:]

    def stop(self) -> None:
        self.state = EngineState.STOPPED

    def is_running(self) -> bool:
        return self.state == EngineState.READY

    def __enter__(self) -> Recorded:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def argv(plan: LaunchPlan) -> list[str]:
    """The argv a plan runs with, port and per-launch key aside (the endpoint fills those in)."""
    return get_adapter(plan.engine).build_command(replace(plan, port=1, api_key=None), INSTALLS[plan.engine]).argv


def launched_argv(index: int = -1) -> list[str]:
    return argv(Recorded.launched[index].plan)


@pytest.fixture(autouse=True)
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import desktop.core.measure.ab as ab_module
    import desktop.core.runtime.supervisor as supervisor

    Recorded.launched = []
    Recorded.fail_ctx_above = None
    Recorded.refuse_start = False
    for where in (supervisor, loading_module, ab_module):
        monkeypatch.setattr(where, "EngineProcess", Recorded)
    monkeypatch.setattr(supervisor, "reap_orphans", lambda: [])
    monkeypatch.setattr(loading_module, "reap_orphans", lambda: [])
    monkeypatch.setattr(loading_module, "record_launch", lambda *a, **k: None)
    monkeypatch.setattr(LlamaCppAdapter, "find_install", lambda self: INSTALLS["llama.cpp"])
    monkeypatch.setattr(VllmAdapter, "find_install", lambda self: INSTALLS["vllm"])
    yield


@pytest.fixture
def proxy() -> Iterator[ProxyServer]:
    server = ProxyServer(port=find_free_port(), wait_timeout=30)
    server.start()
    yield server
    server.stop()


def manager(proxy: ProxyServer, hardware: HardwareSnapshot, **kwargs: Any) -> EndpointManager:
    return EndpointManager(proxy, hardware=hardware, record_launches=False, ready_timeout=5,
                           launcher=lambda plan: (get_adapter(plan.engine), plan, INSTALLS[plan.engine]), **kwargs)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def refused_in_one_line(err: str) -> None:
    """The CLI's refusal: one error line and the hint with the fix; nothing was recorded as launched."""
    lines = [line for line in err.splitlines() if line.startswith("switchyard: ")]
    assert [line.split(":")[1].strip() for line in lines] == ["error", "hint"], err
    assert Recorded.launched == []


LLAMA_ONLY = LlamaCppAdapter.plan_fields - VllmAdapter.plan_fields
DEFAULTS = LaunchPlan(engine="", model_path=Path("m"))


def no_llama_fields(plan: LaunchPlan) -> None:
    for name in LLAMA_ONLY:
        assert getattr(plan, name) == getattr(DEFAULTS, name), name
    assert plan.kv_cache_type in (None, "auto", "fp8")


# --- serve ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("machine", MACHINES)
def test_serve_launches_the_planners_plan_and_dry_run_prints_it(machine: str, capsys: pytest.CaptureFixture[str]
                                                                ) -> None:
    snapshot = str(HERE / "snapshots" / f"{machine}.json")
    for engine in ("llama.cpp", "vllm"):
        Recorded.launched, Recorded.refuse_start = [], True
        expected = plan_launch(engine, "demo", MACHINES[machine], {"slots": 2}).plan
        code, out, _err = cli(capsys, "serve", "--engine", engine, "--model", "demo", "--parallel", "2",
                              "--hardware", snapshot, "--dry-run", "--json")
        assert code == 0 and json.loads(out)["argv"][1:] == planned_argv_tail(expected)
        assert Recorded.launched == []  # a dry run starts nothing
        code, _out, _err = cli(capsys, "serve", "--engine", engine, "--model", "demo", "--parallel", "2",
                               "--hardware", snapshot)
        assert code != 0 and len(Recorded.launched) == 1  # stopped by the recorder right at start
        assert launched_argv() == argv(expected)
    if machine == "rtx4090_20free":  # the desktop's 4 GiB: vLLM asks for what is free, not its 0.9
        assert expected.gpu_memory_utilization is not None and expected.gpu_memory_utilization < 0.9
        assert SLEEP_MODE_FLAG in expected.extra_args


def planned_argv_tail(plan: LaunchPlan) -> list[str]:
    from desktop.core.planning.launch import planned_command

    return planned_command(plan, INSTALLS[plan.engine]).argv[1:]


def test_serve_refuses_a_plan_that_does_not_fit_and_a_foreign_setting(capsys: pytest.CaptureFixture[str]) -> None:
    snapshot = str(HERE / "snapshots" / "rtx4090_20free.json")
    code, _out, err = cli(capsys, "serve", "--engine", "vllm", "--model", "demo", "--util", "0.95",
                          "--hardware", snapshot)
    assert code != 0 and "does not fit" in err and "--util 0." in err
    refused_in_one_line(err)
    code, _out, err = cli(capsys, "serve", "--engine", "llama.cpp", "--model", "demo", "--util", "0.5",
                          "--hardware", snapshot, "--dry-run")
    assert code != 0 and "--util is a vLLM setting" in err
    refused_in_one_line(err)


def test_a_serve_util_half_plan_is_budgeted_at_half() -> None:
    half = plan_launch("vllm", "demo", DESKTOP, {"gpu_memory_utilization": 0.5}).plan
    assert half.gpu_memory_utilization == 0.5 and "--gpu-memory-utilization" in argv(half)
    budget = machine_budget(DESKTOP)
    assert budget is not None
    need = budget.need_of(half).gpu[0]
    total = DESKTOP.gpus[0].memory_total_bytes
    assert 0.5 * total * 0.93 <= need <= 0.5 * total * 1.08  # half of the GPU (CUDA graphs counted outside)
    usual = plan_launch("vllm", "demo", DESKTOP).plan
    assert budget.need_of(usual).gpu[0] > need * 1.4


def test_tensor_parallel_needs_are_compared_per_gpu_not_with_the_sum() -> None:
    budget = machine_budget(MIXED)
    assert budget is not None
    tp2 = plan_launch("vllm", "demo", MIXED, {"tensor_parallel": 2, "gpu_memory_utilization": 0.5}).plan
    need = budget.need_of(tp2)
    assert sorted(need.gpu) == [0, 1]  # one rank on each GPU, each charged
    assert need.gpu[0] > need.gpu[1] * 1.8  # the 4090's rank takes half of 24 GiB, the 3060's half of 12
    assert budget.fits([tp2]) and not budget.fits([tp2, replace(tp2, served_model_name="second")])
    # one vLLM on the 3060 beside llama.cpp's layers split over both: the sum of free VRAM would say "fits"
    one = plan_launch("vllm", "demo", MIXED).plan
    llama = plan_launch("llama.cpp", str(FIXTURES / "llama8b-q4_k_m.gguf"), MIXED).plan
    assert budget.need_of(one).gpu_total + budget.need_of(llama).gpu_total < budget.free_bytes
    assert not budget.fits([one, llama])


# --- the endpoint: switch, standby, auto-fit retry ----------------------------------------------------------------
def test_switch_and_standby_launch_the_planners_plans(proxy: ProxyServer) -> None:
    endpoint = manager(proxy, DESKTOP, budget=machine_budget(DESKTOP), keep_standby=True)
    try:
        endpoint.start(ask("llama.cpp", "demo", {"slots": 2}))
        assert launched_argv() == argv(plan_launch("llama.cpp", "demo", DESKTOP, {"slots": 2}).plan)
        preview = endpoint.switch_preview("vllm")
        to_vllm = endpoint.switch("vllm")
        expected = plan_launch("vllm", "demo", DESKTOP, {"slots": 2}).plan
        assert launched_argv() == argv(expected) and preview["argv"][1:] == planned_argv_tail(expected)
        assert to_vllm.to_engine == "vllm"
        other = str(FIXTURES / "llama8b-q4_k_m.gguf")
        endpoint.switch("llama.cpp", other)  # another engine and model
        assert launched_argv() == argv(plan_launch("llama.cpp", other, DESKTOP, {"slots": 2}).plan)
        served = endpoint.plan
        assert served is not None
        standby = replan(served, DESKTOP, engine="vllm", model="demo").plan  # what `--standby vllm` plans
        endpoint.prepare_standby(standby)
        assert launched_argv() == argv(standby)
    finally:
        endpoint.close()


def test_switch_after_an_auto_fit_retry_carries_no_llamacpp_field_to_vllm(proxy: ProxyServer) -> None:
    endpoint = manager(proxy, DESKTOP, auto_fit=True)  # the demo's trained window is 4,096: asks within it
    Recorded.fail_ctx_above = 2048
    try:
        endpoint.start(ask("llama.cpp", "demo", {"ctx_per_request": 4096, "slots": 2}))
        first, retry = Recorded.launched
        assert first.plan.ctx_per_request == 4096 and retry.plan.ctx_per_request == 2048
        assert retry.plan.kv_cache_type == "q8_0" and "q8_0" in retry.argv  # the retry quantized the KV cache
        assert endpoint.active is not None and endpoint.active.retried
        # the retry is the planner's plan for those asks
        assert argv(retry.plan) == argv(plan_launch("llama.cpp", "demo", DESKTOP, {
            "ctx_per_request": 2048, "slots": 2, "kv_cache_type": "q8_0",
            "gpu_layers": retry.plan.gpu_layers}).plan)
        Recorded.fail_ctx_above = None
        endpoint.switch("vllm")
        vllm = Recorded.launched[-1]
        no_llama_fields(vllm.plan)
        assert "--kv-cache-dtype" not in vllm.argv and "q8_0" not in vllm.argv and "--n-gpu-layers" not in vllm.argv
        assert argv(vllm.plan) == argv(plan_launch("vllm", "demo", DESKTOP, {"ctx_per_request": 2048,
                                                                             "slots": 2}).plan)
    finally:
        endpoint.close()


def test_vllm_out_of_memory_retry_takes_the_length_vllm_printed(proxy: ProxyServer) -> None:
    """vLLM V1's "KV cache is needed, which is larger than the available KV cache memory ... the estimated maximum
    model length is M" (a recorded log, its numbers set for this plan): --auto-fit retries with max_model_len M,
    checked by the planner, instead of halving the context blindly."""
    recorded = (HERE / "data" / "vllm-v1" / "kv-cache-too-small.log").read_text()
    endpoint = manager(proxy, DESKTOP, auto_fit=True)
    Recorded.fail_ctx_above = 6000
    Recorded.fail_log = re.sub(r"estimated maximum model length is \d+", "estimated maximum model length is 6000",
                               re.sub(r"max seq len \(\d+\)", "max seq len (8192)", recorded)).splitlines()
    try:
        endpoint.start(ask("vllm", "demo", {"ctx_per_request": 8192, "slots": 2}))
        first, retry = Recorded.launched
        assert first.plan.ctx_per_request == 8192 and retry.plan.ctx_per_request == 6000  # not 4096 (half)
        assert endpoint.active is not None and "6000" in (endpoint.active.retried or "")
        assert argv(retry.plan) == argv(plan_launch("vllm", "demo", DESKTOP, {"ctx_per_request": 6000,
                                                                              "slots": 2}).plan)
    finally:
        Recorded.fail_log = []
        endpoint.close()


def test_llamacpp_plans_never_carry_vllm_fields_either(proxy: ProxyServer) -> None:
    endpoint = manager(proxy, MIXED)
    try:
        endpoint.start(ask("vllm", "demo", {"gpu_memory_utilization": 0.5, "tensor_parallel": 2}))
        assert "--tensor-parallel-size" in launched_argv()
        endpoint.switch("llama.cpp")
        llama = Recorded.launched[-1].plan
        assert llama.gpu_memory_utilization is None and llama.tensor_parallel == 1
        assert launched_argv() == argv(plan_launch("llama.cpp", "demo", MIXED).plan)
    finally:
        endpoint.close()


def test_switch_and_start_refuse_a_plan_that_does_not_fit_before_anything_starts(proxy: ProxyServer) -> None:
    endpoint = manager(proxy, DESKTOP, engine_overrides={"vllm": {"gpu_memory_utilization": 0.95}})
    try:
        endpoint.start(ask("llama.cpp", "demo"))
        serving = endpoint.active
        Recorded.launched = []
        with pytest.raises(PlanRefused, match="does not fit") as refused:
            endpoint.switch("vllm")
        assert "\n" not in refused.value.message and "--util" in (refused.value.hint or "")
        with pytest.raises(PlanRefused):
            endpoint.switch_preview("vllm")  # `switch --dry-run` says the same
        with pytest.raises(PlanRefused):
            endpoint.prepare_standby(ask("vllm", "demo"))
        assert Recorded.launched == [] and endpoint.active is serving
    finally:
        endpoint.close()
    fresh = manager(proxy, DESKTOP)
    try:
        with pytest.raises(PlanRefused):
            fresh.start(ask("vllm", str(FIXTURES / "llama70b-bf16")))
        assert Recorded.launched == [] and fresh.active is None
    finally:
        fresh.close()


# --- serve --config: every entry, swaps, TTL reloads ------------------------------------------------------------
def two_models(**beta: Any) -> Any:
    return parse_models_config({"models": [
        {"name": "chat", "engine": "llama.cpp", "model": "demo", "ctx": 1024, "parallel": 2},
        {"name": "big", "engine": "vllm", "model": "demo", "ctx": 2048, "parallel": 4, **beta}]}, "models.yaml")


@pytest.mark.parametrize("machine", MACHINES)
def test_every_fleet_entry_swap_and_reload_launches_its_checked_plan(proxy: ProxyServer, machine: str) -> None:
    hardware = MACHINES[machine]
    config = parse_models_config({"models": [
        {"name": "big", "engine": "vllm", "model": "demo", "ctx": 2048, "parallel": 4},
        {"name": "q4", "engine": "llama.cpp", "model": str(FIXTURES / "llama8b-q4_k_m.gguf"), "parallel": 2}]})
    plans = plan_models(config, hardware)
    fleet = Fleet(proxy, config, hardware=hardware, budget=machine_budget(hardware), ready_timeout=5,
                  launcher=lambda plan: (get_adapter(plan.engine), plan, INSTALLS[plan.engine]))
    for lane in fleet.lanes.values():
        lane.record_launches = False
    try:
        fleet.start(preload=False)
        for name, other in (("big", "q4"), ("q4", "big"), ("big", "q4")):
            fleet.load(name)  # vLLM's share of the GPU and llama.cpp's layers do not fit together: a swap
            assert launched_argv() == argv(plans[name].plan)
            assert fleet.lanes[name].loaded and not fleet.lanes[other].loaded
        assert fleet.lanes["big"].unload("ttl")
        fleet.load("big")  # a TTL reload: planned again, the same plan on the same machine
        assert launched_argv() == argv(plans["big"].plan) and len(Recorded.launched) == 4
    finally:
        fleet.close()


def test_serve_config_dry_run_prints_every_plan_and_refuses_one_that_does_not_fit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "models.yaml"
    config.write_text("models:\n  - {name: chat, engine: llama.cpp, model: demo, ctx: 1024, parallel: 2}\n"
                      "  - {name: big, engine: vllm, model: demo, parallel: 4}\n")
    snapshot = str(HERE / "snapshots" / "rtx4090_20free.json")
    code, out, _err = cli(capsys, "serve", "--config", str(config), "--hardware", snapshot, "--dry-run", "--json")
    plans = plan_models(two_models(ctx=2048), DESKTOP)
    shown = json.loads(out)["models"]
    assert code == 0 and set(shown) == {"chat", "big"}
    for name in shown:
        assert shown[name]["argv"][1:] == planned_argv_tail(plans[name].plan)
    config.write_text(f"models:\n  - {{name: huge, engine: vllm, model: {FIXTURES / 'llama70b-bf16'}}}\n")
    code, _out, err = cli(capsys, "serve", "--config", str(config), "--hardware", snapshot, "--dry-run")
    assert code != 0 and "'huge'" in err and "does not fit" in err
    refused_in_one_line(err)
    with pytest.raises(PlanRefused):  # and the fleet itself refuses before anything loads
        Fleet(ProxyServer(port=find_free_port()), parse_models_config(
            {"models": [{"name": "huge", "engine": "vllm", "model": str(FIXTURES / "llama70b-bf16")}]}),
            hardware=DESKTOP)
    assert Recorded.launched == []


# --- bench --engine and ab (and the GUI's Measure it here, which runs the same A/B) --------------------------------
def test_bench_engine_launches_the_planners_plan(capsys: pytest.CaptureFixture[str]) -> None:
    snapshot = str(HERE / "snapshots" / "rtx4090_rtx3060.json")
    # bench measures every request's whole prompt, as the A/B does: its plan asks the prefix cache off
    expected = plan_launch("vllm", "demo", MIXED, {"ctx_per_request": 1024, "slots": 8, "prefix_cache": False}).plan
    assert "--no-enable-prefix-caching" in argv(expected)
    code, out, _err = cli(capsys, "bench", "--engine", "vllm", "--model", "demo", "--ctx", "1024",
                          "--concurrency", "1,8", "--hardware", snapshot, "--dry-run", "--json")
    assert code == 0 and json.loads(out)["argv"][1:] == planned_argv_tail(expected) and Recorded.launched == []
    Recorded.refuse_start = True
    code, _out, _err = cli(capsys, "bench", "--engine", "vllm", "--model", "demo", "--ctx", "1024",
                           "--concurrency", "1,8", "--hardware", snapshot, "--no-history")
    assert code != 0 and launched_argv() == argv(expected)
    Recorded.launched = []
    code, _out, err = cli(capsys, "bench", "--engine", "vllm", "--model", str(FIXTURES / "llama70b-bf16"),
                          "--hardware", snapshot, "--dry-run")
    assert code != 0 and "does not fit" in err
    refused_in_one_line(err)


def test_ab_launches_both_planners_plans_and_refuses_before_starting_either(capsys: pytest.CaptureFixture[str]
                                                                             ) -> None:
    from desktop.core.measure.ab import ABConfig, plan_ab, run_ab

    config = ABConfig(model="demo", concurrency=(1, 4), ctx=512)
    expected = {engine: checked.plan for engine, checked in plan_ab(config, DESKTOP).items()}
    Recorded.refuse_start = True
    run_ab(config, hardware=DESKTOP)
    assert [argv(r.plan) for r in Recorded.launched] == [argv(expected["llama.cpp"]), argv(expected["vllm"])]
    no_llama_fields(expected["vllm"])
    # a fair A/B: the prefix cache off on both (an ask now that serving plans have it on), no RAM prompt cache
    assert "--no-cache-prompt" in argv(expected["llama.cpp"]) and "--no-enable-prefix-caching" in argv(expected["vllm"])
    assert expected["llama.cpp"].cache_ram_mib == 0 and "prefix_cache" in expected["llama.cpp"].pinned
    assert expected["llama.cpp"].kv_cache_gib is None  # the A/B's vLLM CPU KV space never reaches llama.cpp
    Recorded.launched = []
    snapshot = str(HERE / "snapshots" / "rtx4090_20free.json")
    code, out, _err = cli(capsys, "ab", "--hardware", snapshot, "--ctx", "512", "--concurrency", "1,4",
                          "--dry-run", "--json")
    shown = json.loads(out)["engines"]
    assert code == 0 and {k: v["argv"][1:] for k, v in shown.items()} == {
        k: planned_argv_tail(v) for k, v in expected.items()} and Recorded.launched == []
    with pytest.raises(PlanRefused):
        run_ab(ABConfig(model=str(FIXTURES / "llama70b-bf16"), engines=("vllm", "llama.cpp")), hardware=DESKTOP)
    assert Recorded.launched == []


# --- the GUI's Launch it: the Recommend page's plan, checked again, is launched as recommended ---------------------
@pytest.mark.parametrize("machine", MACHINES)
def test_launch_it_launches_the_recommended_plan(proxy: ProxyServer, machine: str) -> None:
    from desktop.core.models.facts import facts_for
    from desktop.core.planning.recommend import Workload, recommend

    hardware = MACHINES[machine]
    model = str(FIXTURES / "llama8b-bf16")
    rec = recommend(facts_for(model), hardware, Workload(concurrency=4))
    assert rec.engine == "vllm"
    asked = replace(rec.plan, model=model, pinned=tuple(sorted(asks_of(rec.plan))))  # RecommendPage.launch_request
    endpoint = manager(proxy, hardware)
    try:
        endpoint.start(asked)
        # exactly what was recommended; on CUDA with vLLM's sleep mode added (a stop-first switch can wake it)
        assert launched_argv() == argv(rec.plan) + [SLEEP_MODE_FLAG]
    finally:
        endpoint.close()


def test_an_out_of_memory_retry_that_no_longer_fits_is_refused(proxy: ProxyServer) -> None:
    endpoint = manager(proxy, DESKTOP, auto_fit=False)
    Recorded.fail_ctx_above = 1024
    try:
        with pytest.raises(LoadOutOfMemory) as caught:
            endpoint.start(ask("llama.cpp", "demo", {"ctx_per_request": 4096}))
        assert "--auto-fit" in (caught.value.hint or "") and len(Recorded.launched) == 1
    finally:
        endpoint.close()


def test_a_budget_from_plans_tells_stop_first_on_the_desktop_gpu() -> None:
    budget = machine_budget(DESKTOP)
    assert isinstance(budget, MemoryBudget)
    llama = plan_launch("llama.cpp", str(FIXTURES / "llama8b-q4_k_m.gguf"), DESKTOP).plan
    vllm = plan_launch("vllm", str(FIXTURES / "llama8b-bf16"), DESKTOP).plan
    assert budget.fits([llama]) and budget.fits([vllm]) and not budget.fits([llama, vllm])
    assert budget.need_of(vllm).gpu[0] <= DESKTOP.gpus[0].memory_free_bytes
    assert budget.need_of(llama).gpu[0] < 8 * GIB


def test_plan_fields_of_one_engine_are_named_in_its_adapter_only() -> None:
    names = {f.name for f in fields(LaunchPlan)}
    assert LlamaCppAdapter.plan_fields <= names and VllmAdapter.plan_fields <= names


def test_switch_dry_run_asks_the_running_endpoint_which_plan_it_would_start(capsys: pytest.CaptureFixture[str]
                                                                             ) -> None:
    from desktop.core.serving import control

    proxy = ProxyServer(port=find_free_port(), wait_timeout=30)
    endpoint = manager(proxy, DESKTOP)
    token = control.new_token()
    proxy.add_routes(control.control_routes(control.EndpointControl(endpoint), token))
    proxy.start()
    discovery = control.write_discovery(proxy.port, proxy.url, token)
    try:
        endpoint.start(ask("llama.cpp", "demo", {"slots": 2}))
        code, out, _err = cli(capsys, "switch", "--to", "vllm", "--dry-run", "--port", str(proxy.port), "--json")
        preview = json.loads(out)
        assert code == 0 and preview["argv"][1:] == planned_argv_tail(
            plan_launch("vllm", "demo", DESKTOP, {"slots": 2}).plan)
        assert len(Recorded.launched) == 1 and endpoint.active is not None  # nothing else started
        endpoint.engine_overrides["vllm"] = {"gpu_memory_utilization": 0.95}
        code, _out, err = cli(capsys, "switch", "--to", "vllm", "--dry-run", "--port", str(proxy.port))
        assert code != 0 and "does not fit" in err and len(Recorded.launched) == 1
    finally:
        control.remove_discovery(discovery)
        endpoint.close()
        proxy.stop()


def test_engine_slots_keep_role_and_slot_in_agreement() -> None:
    from desktop.core.serving.managed import EngineSlots, ManagedEngine

    def engine(name: str) -> ManagedEngine:
        return ManagedEngine(ask("llama.cpp", "demo"), None, None, "new")  # type: ignore[arg-type]

    slots, a, b = EngineSlots(), engine("a"), engine("b")
    slots.put("starting", a)
    slots.put("active", a)  # promoted: it leaves "starting"
    assert slots.get("starting") is None and slots.get("active") is a and a.role == "active"
    slots.put("standby", b)
    slots.put("active", b)  # the standby takes over
    assert slots.get("standby") is None and slots.get("active") is b and b.role == "active"
    slots.release(a, "draining")
    assert a.role == "draining" and slots.role_of(a) is None and slots.role_of(b) == "active"
    slots.retired.append(a)
    assert slots.take_all() == [b, a] and slots.get("active") is None
