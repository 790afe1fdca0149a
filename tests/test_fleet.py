"""Several models behind one endpoint, idle unload and load on demand, swapping engines that do not fit together,
the stop-first switch (drain deadline, vLLM sleep/wake), and the retry with a smaller plan after an out-of-memory
load. Engines here are stand-in processes (tests/standin_engine.py) started through the real supervisor and the
real engine adapters' command environment; tests/test_switch.py runs the real engines."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.base import CommandLine, EngineAdapter, EngineInstall, LaunchPlan
from desktop.core.engines.llamacpp import LlamaCppAdapter
from desktop.core.engines.vllm import SLEEP_MODE_FLAG, VllmAdapter
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.planning.planner import ask as ask_plan
from desktop.core.planning.swap import smaller_plan
from desktop.core.runtime.ports import find_free_port
from desktop.core.serving.endpoint import (
    EndpointEvent,
    EndpointManager,
    Launcher,
    LoadOutOfMemory,
    MemoryBudget,
)
from desktop.core.serving.fleet import Fleet, ModelsConfig, load_models_config, parse_models_config
from desktop.core.serving.proxy import ProxyServer

STANDIN = Path(__file__).parent / "standin_engine.py"
SNAPSHOTS = Path(__file__).parent / "snapshots"
CPU = HardwareSnapshot.load(SNAPSHOTS / "cpu_laptop.json")  # the plans are checked for this recorded machine
GPU = HardwareSnapshot.load(SNAPSHOTS / "rtx4090.json")  # a CUDA machine: the planner gives vLLM sleep mode


def _standin(base: type[EngineAdapter], options: list[str]) -> EngineAdapter:
    class StandIn(base):  # type: ignore[misc,valid-type]
        """The real adapter's environment and failure explanations; the stand-in script as the server."""

        def build_command(self, plan: LaunchPlan, install: EngineInstall) -> CommandLine:
            real = super().build_command(plan, install)
            where = ["--uds", plan.host] if plan.host.endswith(".sock") else ["--port", str(plan.port)]
            argv = [sys.executable, str(STANDIN), *where, "--ctx", str(plan.ctx_per_request),
                    "--name", f"{self.name}:{plan.model_path.name}", *options]
            return CommandLine(argv, real.env)

    return StandIn()


def standin_launcher(tmp_path: Path, options: Callable[[LaunchPlan], list[str]] | None = None,
                     launched: list[LaunchPlan] | None = None) -> Launcher:
    """Like make_launcher, with stand-in engines: the checked plan is launched as is (only the model file is the
    stand-in's), and recorded in `launched`."""

    def launch(checked: LaunchPlan) -> tuple[EngineAdapter, LaunchPlan, EngineInstall]:
        base: type[EngineAdapter] = LlamaCppAdapter if checked.engine == "llama.cpp" else VllmAdapter
        adapter = _standin(base, options(checked) if options else [])
        model = tmp_path / f"{Path(checked.model).name}-{checked.engine}.bin"
        model.write_bytes(b"stand-in weights")
        if launched is not None:
            launched.append(checked)
        # the stand-in plays the build the checked plan is for (a CUDA vLLM keeps its sleep-mode flag)
        return adapter, replace(checked, model_path=model), EngineInstall(adapter.name, "stand-in", "cache",
                                                                          Path(sys.executable),
                                                                          details={"backend": checked.backend})

    return launch


@pytest.fixture
def proxy() -> Iterator[ProxyServer]:
    server = ProxyServer(port=find_free_port(), wait_timeout=60)
    server.start()
    yield server
    server.stop()


def ask(proxy: ProxyServer, model: str | None, stream: bool = False, timeout: float = 60) -> httpx.Response:
    body: dict[str, Any] = {"prompt": "hi", "max_tokens": 4, "stream": stream}
    if model is not None:
        body["model"] = model
    return httpx.post(proxy.url + "/v1/completions", json=body, timeout=timeout, trust_env=False)


def served_by(response: httpx.Response) -> str:
    """Which stand-in answered (its name is in the text): engine:model."""
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        texts = [json.loads(line[6:]) for line in response.text.splitlines()
                 if line.startswith("data: {")]
        return str(texts[0]["choices"][0]["text"]).split(" ")[0].rstrip("0123456789")
    return str(response.json()["choices"][0]["text"]).removeprefix("hi from ")


class Events:
    """Endpoint events, and waiting (with a deadline) for one that matches."""

    def __init__(self) -> None:
        self.seen: list[EndpointEvent] = []
        self._changed = threading.Condition()

    def __call__(self, event: EndpointEvent) -> None:
        with self._changed:
            self.seen.append(event)
            self._changed.notify_all()

    def count(self, state: str) -> int:
        with self._changed:
            return sum(e.state == state for e in self.seen)

    def wait_for(self, state: str, count: int = 1, timeout: float = 30, also: Callable[[], bool] = lambda: True
                 ) -> bool:
        """Until `count` events of `state` were seen and `also()` holds (checked at each event)."""
        with self._changed:
            return self._changed.wait_for(
                lambda: sum(e.state == state for e in self.seen) >= count and also(), timeout)


def two_models(**overrides: Any) -> ModelsConfig:
    a = {"name": "alpha", "engine": "llama.cpp", "model": "demo", "ctx": 512, "parallel": 2}
    b = {"name": "beta", "engine": "vllm", "model": "demo", "ctx": 512, "parallel": 2}
    a.update(overrides.get("alpha", {}))
    b.update(overrides.get("beta", {}))
    return parse_models_config({"models": [a, b]}, "test.yaml")


# --- the models list ------------------------------------------------------------------------------------------
def test_models_config_is_validated_with_one_clear_line_each(tmp_path: Path) -> None:
    good = tmp_path / "models.yaml"
    good.write_text("loading_status: true\nmodels:\n  - {name: chat, engine: llama-server, model: demo, ttl: 5}\n"
                    "  - {name: big, engine: vllm, model: demo, ctx: 4096, parallel: 8, loading_status: false}\n")
    config = load_models_config(good)
    assert config.names() == ["chat", "big"]
    assert config.models[0].engine == "llama.cpp" and config.models[0].ttl == 5.0
    assert config.models[0].loading_status and not config.models[1].loading_status
    assert config.models[1].asks() == {"ctx_per_request": 4096, "slots": 8}
    bad = {
        "models: []": "non-empty list",
        "- {name: a, engine: llama.cpp}": "`model` is required",
        "- {name: a, engine: tgi, model: demo}": "unknown engine",
        "- {name: a, engine: vllm, model: demo, ctx: big}": "ctx must be a whole number",
        "- {name: a, engine: vllm, model: demo, ttl: -1}": "ttl must be a positive number",
        "- {name: a, engine: vllm, model: demo, gpu: 1}": "unknown key(s) gpu",
        "- {name: a, engine: vllm, model: demo}\n- {name: a, engine: llama.cpp, model: demo}": "used twice",
        "- {name: 'has space', engine: vllm, model: demo}": "characters",
        "models: [\n": "not valid YAML",
    }
    for text, message in bad.items():
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(SwitchyardError, match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
            load_models_config(path)
        assert "\n" not in caught.value.message and str(path) in caught.value.message
    with pytest.raises(SwitchyardError, match="cannot read"):
        load_models_config(tmp_path / "missing.yaml")


def test_requests_are_routed_by_model_and_unknown_names_get_a_404(proxy: ProxyServer, tmp_path: Path) -> None:
    fleet = Fleet(proxy, two_models(), hardware=CPU, launcher=standin_launcher(tmp_path), ready_timeout=60)
    try:
        fleet.start()
        assert served_by(ask(proxy, "alpha")) == "llama.cpp:demo-llama.cpp.bin"
        assert served_by(ask(proxy, "beta")) == "vllm:demo-vllm.bin"
        assert served_by(ask(proxy, "beta", stream=True)) == "vllm:demo-vllm.bin"
        unknown = ask(proxy, "gamma")
        assert unknown.status_code == 404
        error = unknown.json()["error"]
        assert error["code"] == "model_not_found" and "alpha, beta" in error["message"]
        anthropic = pytest.importorskip("anthropic")  # and in the Messages API's own shape, as its SDK reads it
        messages = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0,
                                       http_client=anthropic.DefaultHttpxClient(trust_env=False))
        with pytest.raises(anthropic.NotFoundError) as caught:
            messages.messages.create(model="gamma", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"
        assert "alpha, beta" in caught.value.body["error"]["message"]
        assert ask(proxy, None).status_code == 400
        listed = httpx.get(proxy.url + "/v1/models", trust_env=False).json()["data"]
        assert [m["id"] for m in listed] == ["alpha", "beta"]
        assert {m["switchyard"]["state"] for m in listed} == {"loaded"}
        health = httpx.get(proxy.url + "/health", trust_env=False)
        assert health.status_code == 200 and health.json()["models"] == {"alpha": "loaded", "beta": "loaded"}
        assert fleet.status()["models"]["beta"]["active"]["engine"] == "vllm"
    finally:
        fleet.close()


def test_every_lane_reads_the_machine_again_after_a_sleep_the_way_it_was_told(proxy: ProxyServer,
                                                                             tmp_path: Path) -> None:
    """A fleet lane that puts a vLLM to sleep plans the next model against memory read again (NVML through
    `redetect`), like the single-model endpoint: `serve --config` passes the app's detection unless --hardware."""
    reads: list[str] = []

    def redetect() -> HardwareSnapshot:
        reads.append("read")
        return CPU

    fleet = Fleet(proxy, two_models(), hardware=CPU, launcher=standin_launcher(tmp_path), ready_timeout=60,
                  redetect=redetect)
    try:
        assert all(lane.redetect is redetect for lane in fleet.lanes.values())
        fleet.lanes["alpha"].redetect()  # type: ignore[misc]
        assert reads == ["read"]
        recorded = Fleet(proxy, two_models(), hardware=CPU, launcher=standin_launcher(tmp_path), ready_timeout=60)
        assert all(lane.redetect is None for lane in recorded.lanes.values())  # a snapshot: the fit's model
        recorded.close()
    finally:
        fleet.close()


def test_idle_ttl_stops_the_engine_and_the_next_request_loads_it(proxy: ProxyServer, tmp_path: Path) -> None:
    fleet = Fleet(proxy, two_models(alpha={"ttl": 0.5}), hardware=CPU, launcher=standin_launcher(tmp_path), ready_timeout=60)
    events = Events()
    fleet.subscribe(events)
    try:
        fleet.start()
        first = fleet.lanes["alpha"].active
        assert first is not None and first.process.pid is not None
        first_process = psutil.Process(first.process.pid)
        idled = events.count("idle")  # alpha may idle (and the request below load it again) at any point
        assert served_by(ask(proxy, "alpha")) == "llama.cpp:demo-llama.cpp.bin"
        assert events.wait_for("idle", idled + 1, also=lambda: not fleet.lanes["alpha"].loaded)  # ttl passed
        assert not fleet.lanes["alpha"].loaded and fleet.lanes["beta"].loaded  # beta has no ttl
        assert first.process.state.value == "stopped" and not first_process.is_running()
        listed = {m["id"]: m["switchyard"]["state"] for m in httpx.get(proxy.url + "/v1/models").json()["data"]}
        assert listed == {"alpha": "unloaded", "beta": "loaded"}
        again = ask(proxy, "alpha")  # waits while alpha loads again
        assert served_by(again) == "llama.cpp:demo-llama.cpp.bin"
        second = fleet.lanes["alpha"].active
        assert second is not None and second is not first
        assert proxy.counters["failed"] == 0
    finally:
        fleet.close()


def test_models_that_do_not_fit_together_are_swapped_and_no_request_fails(proxy: ProxyServer,
                                                                          tmp_path: Path) -> None:
    budget = MemoryBudget(free_bytes=1.5, need=lambda spec: 1.0)  # one engine fits, two do not
    fleet = Fleet(proxy, two_models(), hardware=CPU, launcher=standin_launcher(tmp_path), ready_timeout=60, budget=budget)
    try:
        fleet.start()
        assert fleet.lanes["alpha"].loaded and not fleet.lanes["beta"].loaded  # beta did not fit beside alpha
        failures: list[str] = []
        served: list[str] = []

        def client(index: int) -> None:
            for round_ in range(3):
                model = ("alpha", "beta")[(index + round_) % 2]
                response = ask(proxy, model, stream=index % 2 == 0)
                if response.status_code != 200:
                    failures.append(f"{model}: {response.status_code} {response.text[:200]}")
                else:
                    served.append(f"{model}={served_by(response)}")

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        # "never both at once", sampled all along (not only at the end): lanes loaded, and engine processes alive
        overlap: list[str] = []
        done = threading.Event()

        def engines_alive() -> list[int]:
            alive = []
            for child in psutil.Process().children(recursive=True):
                try:
                    if any("standin_engine" in part for part in child.cmdline()):
                        alive.append(child.pid)
                except psutil.Error:
                    continue
            return alive

        def watch() -> None:
            while not done.is_set():
                loaded = [name for name, lane in fleet.lanes.items() if lane.loaded]
                if len(loaded) > 1:
                    overlap.append(f"lanes {loaded}")
                alive = engines_alive()
                if len(alive) > 1:
                    overlap.append(f"engine processes {alive}")
                done.wait(0.01)

        watcher = threading.Thread(target=watch)
        watcher.start()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        done.set()
        watcher.join(10)
        assert failures == []
        assert len(served) == 24
        assert all(s in ("alpha=llama.cpp:demo-llama.cpp.bin", "beta=vllm:demo-vllm.bin") for s in served)
        assert {s.split("=")[0] for s in served} == {"alpha", "beta"}  # so swaps happened while sampled
        assert overlap == [], overlap[:5]  # never both at once, at any sample
        assert sum(lane.loaded for lane in fleet.lanes.values()) == 1
        assert proxy.counters["failed"] == 0
    finally:
        fleet.close()


def test_a_waiting_streaming_client_is_told_that_its_model_loads(proxy: ProxyServer, tmp_path: Path) -> None:
    config = two_models(alpha={"loading_status": True})
    fleet = Fleet(proxy, config, hardware=CPU, launcher=standin_launcher(tmp_path, lambda s: ["--load-seconds", "5"]),
                  ready_timeout=60)
    try:
        fleet.start(preload=False)  # nothing loaded: the first request loads its model
        lines: list[str] = []
        with httpx.stream("POST", proxy.url + "/v1/completions", trust_env=False, timeout=60,
                          json={"model": "alpha", "prompt": "hi", "stream": True}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in response.iter_lines() if line]
        notes = [line for line in lines if line.startswith(":")]
        assert notes and all(line.startswith(": loading model alpha (") and line.endswith(" s)") for line in notes)
        data = [line for line in lines if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]" and "llama.cpp:demo" in data[0]
        assert lines.index(notes[-1]) < lines.index(data[0])  # the notes came before the answer
        # beta has no loading_status: its waiting client hears nothing until the answer
        quiet = ask(proxy, "beta", stream=True)
        assert served_by(quiet) == "vllm:demo-vllm.bin" and not quiet.text.startswith(":")
        assert proxy.counters["failed"] == 0
    finally:
        fleet.close()


# --- out of memory --------------------------------------------------------------------------------------------
def fails_above(limit: int) -> Callable[[LaunchPlan], list[str]]:
    return lambda spec: ["--fail-ctx-above", str(limit)]


def test_an_out_of_memory_load_is_retried_once_with_a_smaller_plan_in_auto_fit(proxy: ProxyServer,
                                                                              tmp_path: Path) -> None:
    events = Events()
    manager = EndpointManager(proxy, hardware=CPU, launcher=standin_launcher(tmp_path, fails_above(2048)), ready_timeout=60,
                              auto_fit=True)
    manager.subscribe(events)
    try:
        manager.start(ask_plan("llama.cpp", "demo", {"ctx_per_request": 4096, "slots": 2}))
        active = manager.active
        assert active is not None and active.plan.ctx_per_request == 2048 and active.process.plan.ctx_per_request == 2048
        assert active.retried is not None and "context 4,096 → 2,048 tokens per request" in active.retried
        assert "KV cache" in active.retried  # what the change saves, from the fit
        retry = next(e for e in events.seen if e.state == "retrying")
        assert "could not allocate memory" in retry.message and "4,096 → 2,048" in retry.message
        assert served_by(ask(proxy, "x")) == "llama.cpp:demo-llama.cpp.bin"
    finally:
        manager.close()


def test_without_auto_fit_the_smaller_plan_is_offered_and_nothing_runs(proxy: ProxyServer, tmp_path: Path) -> None:
    manager = EndpointManager(proxy, hardware=CPU, launcher=standin_launcher(tmp_path, fails_above(1024)), ready_timeout=60)
    try:
        with pytest.raises(LoadOutOfMemory) as caught:
            manager.start(ask_plan("llama.cpp", "demo", {"ctx_per_request": 4096, "slots": 2}))
        assert "could not allocate memory" in caught.value.message
        assert caught.value.hint and "next smaller plan: context 4,096 → 2,048" in caught.value.hint
        assert "--auto-fit" in caught.value.hint
        assert manager.active is None and manager.starting is None
    finally:
        manager.close()


def test_a_retry_that_fails_again_is_reported_and_not_repeated(proxy: ProxyServer, tmp_path: Path) -> None:
    events = Events()
    manager = EndpointManager(proxy, hardware=CPU, launcher=standin_launcher(tmp_path, fails_above(512)), ready_timeout=60,
                              auto_fit=True)
    manager.subscribe(events)
    try:
        with pytest.raises(LoadOutOfMemory):
            manager.start(ask_plan("llama.cpp", "demo", {"ctx_per_request": 4096, "slots": 2}))
        assert [e.state for e in events.seen].count("retrying") == 1
        assert manager.active is None
    finally:
        manager.close()


def test_smaller_plan_on_a_gpu_uses_q8_kv_and_fewer_layers() -> None:
    hardware = HardwareSnapshot.from_json((SNAPSHOTS / "rtx4060_8gb.json").read_text())
    plan = smaller_plan("llama.cpp", "demo", 8192, 4, hardware, gpu_layers=None)
    assert plan is not None and plan.ctx == 4096 and plan.kv_type == "q8_0"
    assert plan.gpu_layers is not None
    assert any(c.startswith("KV cache type f16 → q8_0") for c in plan.changes)
    assert any(c.startswith("GPU layers") for c in plan.changes)
    vllm = smaller_plan("vllm", "demo", 4096, 4, hardware)
    assert vllm is not None and vllm.changes == ["max_model_len 4,096 → 2,048 tokens"]
    assert smaller_plan("vllm", "demo", 256, 4, hardware) is None  # nothing left to shrink


def test_the_machine_budget_is_free_vram_and_needs_come_from_the_fit() -> None:
    from desktop.core.planning.planner import plan_launch
    from desktop.core.serving.endpoint import machine_budget

    cpu = HardwareSnapshot.from_json((SNAPSHOTS / "cpu_laptop.json").read_text())
    assert machine_budget(cpu) is None  # CPU only: engines share RAM, switches stay warm as before
    gpu = HardwareSnapshot.from_json((SNAPSHOTS / "rtx4060_8gb.json").read_text())
    budget = machine_budget(gpu)
    assert budget is not None and budget.free_bytes == sum(g.memory_free_bytes for g in gpu.gpus)
    llama = plan_launch("llama.cpp", "demo", gpu, {"slots": 4}).plan
    vllm = plan_launch("vllm", "demo", gpu).plan
    assert 0 < budget.need_of(llama).gpu_total < budget.need_of(vllm).gpu_total <= budget.free_bytes  # util share
    # the needs ARE the fit's numbers for those very plans on this GPU (llama.cpp: the GPU part it places there)
    from desktop.core.models.facts import facts_for
    from desktop.core.planning.fit import estimate

    llama_fit = estimate(facts_for("demo"), gpu, llama)
    assert llama_fit.device != "CPU"
    assert budget.need_of(llama).gpu_total == pytest.approx(llama_fit.breakdown["gpu_used"] * 2**30, rel=1e-6)
    assert not budget.fits([llama, vllm])  # so a switch between them on this GPU is stop-first
    assert "GiB of free GPU memory" in budget.describe([llama, vllm])


# --- stop-first switch ----------------------------------------------------------------------------------------
def test_vllm_sleep_mode_env_is_part_of_the_command() -> None:
    """Dev mode (its /sleep, /wake_up and unauthenticated /collective_rpc) only on the private socket."""
    install = EngineInstall("vllm", "x", "cache", Path(sys.executable))
    plan = LaunchPlan(engine="vllm", model_path=Path("/m"), host="/run/u/vllm-1.sock", extra_args=(SLEEP_MODE_FLAG,))
    command = VllmAdapter().build_command(plan, install)
    assert SLEEP_MODE_FLAG in command.argv and command.env.get("VLLM_SERVER_DEV_MODE") == "1"
    assert "--port" not in command.argv and command.argv[command.argv.index("--uds") + 1] == plan.host
    on_tcp = VllmAdapter().build_command(LaunchPlan(engine="vllm", model_path=Path("/m"), port=1,
                                                    extra_args=(SLEEP_MODE_FLAG,)), install)
    assert "VLLM_SERVER_DEV_MODE" not in on_tcp.env, "dev mode's routes would answer anyone on a TCP port"
    plain = VllmAdapter().build_command(LaunchPlan(engine="vllm", model_path=Path("/m"), port=1), install)
    assert "VLLM_SERVER_DEV_MODE" not in plain.env


def test_stop_first_switch_sleeps_vllm_and_wakes_it_instead_of_a_cold_start(proxy: ProxyServer,
                                                                           tmp_path: Path) -> None:
    calls = tmp_path / "calls.txt"
    budget = MemoryBudget(free_bytes=1.5, need=lambda spec: 1.0)
    # a CUDA machine: the planner starts vLLM with sleep mode (its flag is in the checked plan)
    manager = EndpointManager(proxy, hardware=GPU, launcher=standin_launcher(tmp_path, lambda s: ["--calls", str(calls)]),
                              ready_timeout=60, budget=budget)
    try:
        manager.start(ask_plan("vllm", "demo"))
        vllm = manager.active
        assert vllm is not None and vllm.can_sleep
        assert manager.switch_preview("llama.cpp")["kind"] == "stop-first"
        to_llama = manager.switch("llama.cpp")
        assert to_llama.kind == "stop-first" and to_llama.old_sleeping and to_llama.drained
        assert to_llama.gap_s > 0 and to_llama.cold_start is not None
        assert manager.sleeping is vllm and vllm.process.is_running()
        assert calls.read_text().split() == ["/sleep?level=1"]
        assert served_by(ask(proxy, "x")) == "llama.cpp:demo-llama.cpp.bin"
        llama = manager.active
        assert manager.switch_preview("vllm")["kind"] == "wake"
        back = manager.switch("vllm")
        assert back.kind == "stop-first" and back.woke and back.cold_start is None
        assert manager.active is vllm and manager.sleeping is None
        assert calls.read_text().split() == ["/sleep?level=1", "/wake_up"]
        assert llama is not None and llama.process.state.value == "stopped"  # llama.cpp cannot sleep: stopped
        assert served_by(ask(proxy, "x")) == "vllm:demo-vllm.bin"
    finally:
        manager.close()


def test_the_drain_is_bounded_and_what_is_left_gets_a_retryable_error(proxy: ProxyServer, tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    budget = MemoryBudget(free_bytes=1.5, need=lambda spec: 1.0)
    manager = EndpointManager(proxy, hardware=CPU, launcher=standin_launcher(
        tmp_path, lambda s: ["--hold-file", str(hold)] if s.engine == "llama.cpp" else []), ready_timeout=30, budget=budget, drain_timeout=0.5)
    lines: list[str] = []
    try:
        manager.start(ask_plan("llama.cpp", "demo"))
        hold.write_text("")  # from now on the stand-in holds its streams after the first chunk
        started = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", proxy.url + "/v1/completions", trust_env=False, timeout=60,
                              json={"model": "x", "prompt": "hi", "stream": True}) as response:
                for line in response.iter_lines():
                    lines.append(line)
                    started.set()

        client = threading.Thread(target=stream)
        client.start()
        assert started.wait(30)
        result = manager.switch("vllm")  # the held stream outlives the 0.5 s drain deadline
        client.join(30)
        assert result.kind == "stop-first" and not result.drained and result.cut_requests == 1
        errors = [json.loads(line[6:])["error"] for line in lines if line.startswith("data: {\"error\"")]
        assert errors and errors[0]["code"] == 503 and errors[0]["retryable"]
        assert "retry it" in errors[0]["message"]
        assert proxy.counters["failed"] == 1
    finally:
        hold.unlink(missing_ok=True)
        manager.close()


# --- real engines ---------------------------------------------------------------------------------------------
@pytest.mark.engine
@pytest.mark.llamacpp
@pytest.mark.vllm
def test_two_models_on_llamacpp_and_vllm_through_one_endpoint_with_the_openai_client(
        llama_install: Any, vllm_install: Any, demo_model: Any, tmp_path: Path) -> None:
    """The Done-when of issue 17 item 1 and 2: the official `openai` client gets answers from both models through
    one endpoint, /v1/models lists both, an unknown name is a 404; with ttl 5 the idle engine process is gone
    after ~5 s and the next request brings it back."""
    openai = pytest.importorskip("openai")
    from desktop.core.serving.endpoint import make_launcher

    config_file = tmp_path / "models.yaml"
    config_file.write_text("models:\n"
                           "  - {name: chat, engine: llama.cpp, model: demo, ctx: 1024, parallel: 2, ttl: 5}\n"
                           "  - {name: big, engine: vllm, model: demo, ctx: 1024, parallel: 2}\n")
    proxy = ProxyServer(port=find_free_port(), wait_timeout=600)
    proxy.start()
    fleet = Fleet(proxy, load_models_config(config_file), launcher=make_launcher(), ready_timeout=900,
                  engine_overrides={"vllm": {"eager": True}})
    events = Events()
    fleet.subscribe(events)
    try:
        fleet.start()
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data] == ["chat", "big"]
        for name, engine in (("chat", "llama.cpp"), ("big", "vllm")):
            answer = client.chat.completions.create(model=name, max_tokens=8, temperature=0,
                                                    messages=[{"role": "user", "content": "Say hi"}])
            assert answer.choices[0].message.content, name
            streamed = client.completions.create(model=name, prompt="Once upon a time", max_tokens=8,
                                                 stream=True)
            assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices), name
            # right after its own requests: chat's ttl of 5 s may run out while vLLM answers on a busy machine
            active = fleet.lanes[name].active
            assert active is not None and active.upstream.engine == engine, name
        with pytest.raises(openai.NotFoundError) as caught:
            client.completions.create(model="nope", prompt="hi", max_tokens=2)
        assert "chat, big" in str(caught.value)
        # ttl 5: the llama.cpp engine stops after ~5 s without requests; vLLM (no ttl) stays.
        idled = events.count("idle")  # chat may have idled already while vLLM loaded
        client.completions.create(model="chat", prompt="Hi", max_tokens=2)  # (re)loads it, and counts as use
        chat = fleet.lanes["chat"].active
        assert chat is not None and chat.process.pid is not None
        chat_process = psutil.Process(chat.process.pid)  # is_running() below also sees a pid reused meanwhile
        assert events.wait_for("idle", idled + 1, timeout=60, also=lambda: not fleet.lanes["chat"].loaded)
        assert chat.process.state.value == "stopped" and not chat_process.is_running()
        assert fleet.lanes["big"].loaded
        again = client.completions.create(model="chat", prompt="Hello", max_tokens=4)  # brings it back
        assert again.choices[0].text is not None
        assert fleet.lanes["chat"].active is not None and fleet.lanes["chat"].active is not chat
        assert proxy.counters["failed"] == 0
    finally:
        fleet.close()
        proxy.stop()
