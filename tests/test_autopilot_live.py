"""The hybrid endpoint live (`serve --engine auto`): the autopilot loop over a real EndpointManager and proxy,
driven through every branch of the policy by the requests really in flight (stand-in engines that hold their
streams while a file exists, tests/standin_engine.py), asserting what it did to the engines, not only what it
decided; the CLI's checks; and one real-engine run (real llama-server, real vLLM CPU build)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_fleet import CPU, standin_launcher
from test_switch import StreamingLoad

from desktop.core.engines.base import LaunchPlan
from desktop.core.planning.crossover import EngineCurve, crossover
from desktop.core.planning.planner import ask as ask_plan
from desktop.core.runtime.ports import find_free_port
from desktop.core.serving.autopilot import Autopilot, AutopilotSettings, both_fit, forced_crossover
from desktop.core.serving.endpoint import EndpointManager, MemoryBudget
from desktop.core.serving.proxy import ProxyServer
from desktop.core.serving.requestlog import RequestLog

FAST = AutopilotSettings(window_s=1.0, idle_s=1.5, tick_s=0.05)
BOTH_FIT = MemoryBudget(free_bytes=2.5, need=lambda plan: 1.0)
ONE_FITS = MemoryBudget(free_bytes=1.5, need=lambda plan: 1.0)


def _until(condition: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Poll `condition()` until it is truthy or the deadline passes (no sleep as synchronisation)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        threading.Event().wait(0.02)
    return condition()


class Hybrid:
    """A stand-in llama.cpp and vLLM behind a real proxy and manager, with the autopilot loop running."""

    def __init__(self, tmp_path: Path, budget: MemoryBudget, settings: AutopilotSettings = FAST,
                 crossover_at: float | None = 2.0, vllm_options: list[str] | None = None) -> None:
        self.hold = tmp_path / "hold"
        self.launched: list[LaunchPlan] = []
        self.llama_options: list[str] = []  # read at each llama.cpp launch (a hand-back's engine may differ)
        self.proxy = ProxyServer(port=find_free_port(), wait_timeout=60)
        self.log = RequestLog()
        self.log.attach(self.proxy)
        self.proxy.start()

        def options(plan: LaunchPlan) -> list[str]:
            return ["--hold-file", str(self.hold), *self.llama_options] if plan.engine == "llama.cpp" else \
                ["--load-seconds", "0.3", *(vllm_options or [])]

        self.manager = EndpointManager(self.proxy, hardware=CPU, ready_timeout=60, budget=budget,
                                       launcher=standin_launcher(tmp_path, options, self.launched))
        self.manager.start(ask_plan("llama.cpp", "demo", {"ctx_per_request": 512}))
        self.first = self.manager.active
        other = self.manager.target("vllm")
        x = forced_crossover(crossover_at, 95.0) if crossover_at is not None else crossover([
            EngineCurve.measured_points("llama.cpp", [(1, 40.0, None), (8, 100.0, None)], time.time(), 5.0),
            EngineCurve.measured_points("vllm", [(1, 20.0, None), (8, 60.0, None)], time.time(), 60.0)])
        assert self.first is not None
        self.autopilot = Autopilot(self.manager, x, other, both_fit=both_fit([self.first.plan, other], budget, CPU),
                                   settings=settings, journal=self.log.note)
        self.manager.autopilot = self.autopilot
        self.autopilot.start()

    def actions(self) -> list[str]:
        return [e["action"] for e in self.log.events()]

    def engines(self) -> list[str]:
        return [p.engine for p in self.launched]

    def active_engine(self) -> str | None:
        active = self.manager.active
        return active.plan.engine if active is not None else None

    def close(self) -> None:
        self.hold.unlink(missing_ok=True)
        self.manager.close()
        self.proxy.stop()
        self.log.stop()


@pytest.fixture
def hybrid(tmp_path: Path) -> Iterator[Callable[..., Hybrid]]:
    made: list[Hybrid] = []

    def make(budget: MemoryBudget = BOTH_FIT, **kw: Any) -> Hybrid:
        made.append(Hybrid(tmp_path, budget, **kw))
        return made[-1]

    yield make
    for one in made:
        one.close()


def _more_decisions(h: Hybrid, count: int = 10) -> None:
    seen = h.autopilot.steps
    assert _until(lambda: h.autopilot.steps >= seen + count), "the loop stopped deciding"


def _held(h: Hybrid, clients: int) -> StreamingLoad:
    """`clients` streaming clients whose requests on llama.cpp hold after their first chunk: `clients` in flight."""
    h.hold.write_text("")
    load = StreamingLoad(h.proxy.url, concurrency=clients, max_tokens=4)
    load.__enter__()
    assert _until(lambda: h.proxy.inflight() >= clients, 10), h.proxy.inflight()
    return load


def test_load_above_the_crossover_both_fit_starts_vllm_hands_over_and_retires_it(
        hybrid: Callable[..., Hybrid]) -> None:
    h = hybrid(BOTH_FIT)
    load = _held(h, 4)  # in-flight 4 > crossover 2, sustained over the window
    assert _until(lambda: "start_standby" in h.actions()), h.actions()
    # the 4 requests stay held on llama.cpp through the hand-over: new ones go to vLLM, these must drain
    assert _until(lambda: h.active_engine() == "vllm"), (h.actions(), h.engines())
    assert h.proxy.inflight() >= 4
    h.hold.unlink()  # the held requests finish on llama.cpp (none is cut), then it stops
    assert h.engines() == ["llama.cpp", "vllm"]  # vLLM was started beside llama.cpp (the warm standby) ...
    assert h.first is not None and _until(lambda: h.first.role == "stopped")  # ... llama.cpp stopped after its drain
    hand_over = _until(lambda: next((d for d in h.autopilot.status()["decisions"]
                                     if d["action"] == "hand_over" and "switch" in d["numbers"]), None))
    assert hand_over and "vLLM is ready: handing over" in hand_over["reason"], h.autopilot.status()
    assert hand_over["numbers"]["switch"]["kind"] == "standby"  # the warm vLLM took over: no cold start waited
    served_by_vllm = h.log.finished_count
    assert _until(lambda: h.log.finished_count > served_by_vllm + 8)  # vLLM serves the load
    load.__exit__()
    assert load.result.failed == [] and h.proxy.counters["failed"] == 0, load.result.failed[:3]
    vllm = h.manager.active
    # no load: after the idle window vLLM is retired and llama.cpp (started again) serves
    assert _until(lambda: h.active_engine() == "llama.cpp"), h.actions()
    assert h.engines() == ["llama.cpp", "vllm", "llama.cpp"]
    assert vllm is not None and _until(lambda: vllm.role == "stopped")
    assert h.manager.standby is None
    actions = h.actions()
    order = [actions.index(a) for a in ("watch", "start_standby", "hand_over", "retire")]
    assert order == sorted(order), actions
    retire = _until(lambda: next((d for d in h.manager.status()["autopilot"]["decisions"]
                                  if d["action"] == "retire" and "switch" in d["numbers"]), None))
    assert retire and "retiring vLLM" in retire["reason"] and retire["numbers"]["switch"]["kind"] == "warm"
    status = h.manager.status()["autopilot"]
    assert status["mode"] == "auto" and status["both_fit"] is True
    assert [e["action"] for e in h.log.events()] == [d["action"] for d in status["decisions"]]


def test_load_below_the_crossover_stays_on_llamacpp(hybrid: Callable[..., Hybrid]) -> None:
    h = hybrid(BOTH_FIT)
    load = _held(h, 1)  # in-flight 1 <= crossover 2
    stayed = _until(lambda: "stay" in h.actions())
    _more_decisions(h)  # none of the next ones starts anything
    h.hold.unlink()
    load.__exit__()
    assert stayed, h.actions()
    assert h.engines() == ["llama.cpp"] and h.manager.standby is None and h.active_engine() == "llama.cpp"
    last = h.autopilot.status()["last"]
    assert last["action"] == "stay" and "<= crossover 2" in last["reason"], last
    assert load.result.failed == []


def test_short_expected_lifetime_stays_even_above_the_crossover(hybrid: Callable[..., Hybrid]) -> None:
    h = hybrid(BOTH_FIT, settings=AutopilotSettings(window_s=1.0, idle_s=1.5, tick_s=0.05, lifetime_s=30.0))
    load = _held(h, 4)
    stayed = _until(lambda: "stay" in h.actions())
    _more_decisions(h)
    h.hold.unlink()
    load.__exit__()
    assert stayed, h.actions()
    assert h.engines() == ["llama.cpp"] and h.manager.standby is None
    reason = h.autopilot.status()["decisions"][-1]["reason"]
    assert "expected to end in" in reason and "before vLLM's cold start 95 s pays back" in reason, reason


def test_only_one_fits_switches_stop_first_and_back_with_no_failed_request(hybrid: Callable[..., Hybrid]) -> None:
    h = hybrid(ONE_FITS)
    assert not h.autopilot.both_fit
    load = _held(h, 4)
    assert _until(lambda: "switch_stop_first" in h.actions()), h.actions()
    first = next(d for d in h.autopilot.status()["decisions"] if d["action"] == "switch_stop_first")
    assert "only one engine fits: stop-first" in first["reason"] and first["numbers"]["expected_gap_s"] == 95.0
    assert "start_standby" not in h.actions()  # never both at once
    h.hold.unlink()
    assert _until(lambda: h.active_engine() == "vllm"), h.actions()
    assert h.first is not None and _until(lambda: h.first.role == "stopped")
    done = _until(lambda: next((d for d in h.autopilot.status()["decisions"]
                               if d["action"] == "switch_stop_first" and "switch" in d["numbers"]), None))
    assert done and done["numbers"]["switch"]["kind"] == "stop-first"
    load.__exit__()
    assert load.result.failed == [] and h.proxy.counters["failed"] == 0, load.result.failed[:3]
    assert _until(lambda: h.active_engine() == "llama.cpp"), h.actions()
    assert h.engines() == ["llama.cpp", "vllm", "llama.cpp"]


def test_where_llamacpp_is_faster_everywhere_it_stays_and_says_why(hybrid: Callable[..., Hybrid]) -> None:
    h = hybrid(BOTH_FIT, crossover_at=None)  # CPU-like curves: no crossover
    load = _held(h, 4)
    stayed = _until(lambda: "stay" in h.actions())
    h.hold.unlink()
    load.__exit__()
    assert stayed and h.engines() == ["llama.cpp"]
    assert "llama.cpp measures faster at every concurrency" in h.autopilot.status()["last"]["reason"]


def test_a_vllm_that_fails_to_start_leaves_llamacpp_serving_and_is_not_retried(
        hybrid: Callable[..., Hybrid]) -> None:
    h = hybrid(BOTH_FIT, vllm_options=["--fail-ctx-above", "1", "--oom-line", "CUDA out of memory"])
    load = _held(h, 4)
    failed = _until(lambda: any("failed" in e["reason"] for e in h.log.events()))
    _more_decisions(h)
    h.hold.unlink()
    load.__exit__()
    assert failed, h.log.events()
    assert h.engines() == ["llama.cpp", "vllm"]  # one try, not one per tick
    assert h.active_engine() == "llama.cpp" and load.result.failed == []
    assert "is not tried again" in h.autopilot.status()["last"]["reason"]


@pytest.mark.gui
@pytest.mark.qt_log_ignore("propagateSizeHints")
def test_the_serve_page_shows_the_hybrid_state_and_last_decision(qtbot: Any, hybrid: Callable[..., Hybrid]
                                                                 ) -> None:
    from desktop.ui.main_window import MainWindow

    window = MainWindow()
    window.session.endpoint_port = 0
    window.confirm_quit = lambda: True
    qtbot.addWidget(window)
    window.show()
    try:
        serve = window.show_page("Serve")
        h = hybrid(BOTH_FIT)
        assert _until(lambda: h.autopilot.last is not None)
        serve._show_autopilot(h.autopilot)
        assert serve.autopilot_label.isVisible()
        assert serve.autopilot_label.text().startswith("Hybrid (watching): ")
        text = serve.autopilot_label.text()
        assert ("watch — watching the load" in text) or ("stay — in-flight p95 0" in text), text
        serve._show_autopilot(None)  # one engine, no hybrid: nothing shown
        assert not serve.autopilot_label.isVisible()
    finally:
        window.close()


def test_decisions_are_kept_in_history_counted_in_metrics_and_shown_by_requests() -> None:
    from desktop.core.planning.autopilot import Decision
    from desktop.core.serving.metrics import EndpointMetrics
    from desktop.core.storage.history import Store

    reason = f"in-flight p95 9 over 5 min > crossover 4 (history test {time.time()})"
    store = Store()
    log = RequestLog(sink=store)
    metrics = EndpointMetrics(log)
    log.start()
    log.note(Decision("start_standby", reason, time.time(), {"inflight_p95": 9.0}).to_json())
    assert log.flush()
    log.stop()
    store.close()
    assert [e["reason"] for e in log.events()] == [reason]
    assert 'switchyard_autopilot_decisions_total{action="start_standby"} 1.0' in metrics.render().decode()
    listed = _cli("requests", "--history", "--json")
    assert listed.returncode == 0, listed.stderr
    kept = [e for e in json.loads(listed.stdout)["events"] if e["reason"] == reason]
    assert kept and kept[0]["kind"] == "autopilot" and kept[0]["numbers"] == {"inflight_p95": 9.0}
    table = _cli("requests", "--history")
    assert f"autopilot: start_standby — {reason}" in table.stdout, table.stdout[-500:]


# --- the CLI -------------------------------------------------------------------------------------------------
def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "desktop", *args], capture_output=True, text=True,  # noqa: S603
                          timeout=timeout, check=False)


def test_cli_auto_plans_both_engines_up_front_and_refuses_in_one_line() -> None:
    dry = _cli("serve", "--engine", "auto", "--model", "demo", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plans = json.loads(dry.stdout)["plans"]
    assert set(plans) == {"llama.cpp", "vllm"} and all(p["fit"]["fits"] for p in plans.values())
    refused = _cli("serve", "--engine", "auto", "--model", "demo", "--ctx", "1000000000", "--endpoint")
    assert refused.returncode != 0
    error = [line for line in refused.stderr.splitlines() if line.startswith("switchyard: error:")]
    assert len(error) == 1 and "neither engine can serve demo" in error[0], refused.stderr
    assert "Traceback" not in refused.stderr and "listening" not in refused.stderr  # nothing started
    wrong = _cli("serve", "--engine", "llama.cpp", "--model", "demo", "--auto-window", "5")
    assert wrong.returncode != 0 and "--auto-window is a setting of the hybrid endpoint" in wrong.stderr


# --- real engines --------------------------------------------------------------------------------------------
@pytest.mark.engine
@pytest.mark.llamacpp
@pytest.mark.vllm
def test_real_engines_hybrid_hands_over_under_load_and_retires(llama_install: Any, vllm_install: Any,
                                                               demo_model: Any) -> None:
    """`serve --engine auto` with real llama-server and the vLLM CPU build, thresholds forced so it runs in about
    two minutes: the endpoint answers within 2 s of llama.cpp's ready, a c=8 streaming load brings vLLM in and the
    hand-over fails no request, after the idle window vLLM is retired; every decision is in `status --json` and
    in the request log."""
    from conftest import serve_until_ready

    from desktop.core.serving import control

    port = find_free_port()
    proc, ready = serve_until_ready("--engine", "auto", "--model", "demo", "--proxy-port", str(port),
                                    "--parallel", "8", "--ctx", "256", "--auto-crossover", "2",
                                    "--auto-window", "2", "--auto-idle", "4", "--auto-tick", "0.2",
                                    "--vllm-eager")  # the standby vLLM: no torch.compile (a minute sooner)
    try:
        ready_at = time.monotonic()
        assert ready.startswith("ready:") and "through llama.cpp" in ready, ready
        url = f"http://127.0.0.1:{port}"
        body = {"model": "switchyard", "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        first = httpx.post(url + "/v1/completions", json=body, timeout=30, trust_env=False)
        assert first.status_code == 200 and time.monotonic() - ready_at < 2.0
        client = control.ControlClient(control.find_instance(port))

        def auto() -> dict[str, Any]:
            return dict(client.status()["autopilot"])

        with StreamingLoad(url, concurrency=8, max_tokens=16) as load:
            assert load.started_ok.wait(60)
            assert _until(lambda: client.status().get("standby") or client.status().get("starting")
                          or auto()["state"] == "starting vLLM", 30), auto()
            llama_ok = load.result.ok
            # llama.cpp keeps answering while vLLM loads in the background
            assert _until(lambda: load.result.ok > llama_ok + 8, 60)
            assert _until(lambda: (client.status()["active"] or {}).get("engine") == "vllm", 400), auto()
            handed_at = load.result.ok
            assert _until(lambda: load.result.ok > handed_at + 8, 120)  # vLLM serves the load
        assert load.result.failed == [], load.result.failed[:3]
        assert _until(lambda: (client.status()["active"] or {}).get("engine") == "llama.cpp", 120), auto()
        status = client.status()
        assert status["standby"] is None and status["requests"]["failed"] == 0
        actions = [d["action"] for d in status["autopilot"]["decisions"]]
        assert [a for a in actions if a in ("start_standby", "hand_over", "retire")] == \
            ["start_standby", "hand_over", "retire"], actions
        # the same decisions from the CLI and in the request log (the loop may have decided once more since)
        cli = _cli("status", "--port", str(port), "--json")
        assert [d["action"] for d in json.loads(cli.stdout)["autopilot"]["decisions"]][:len(actions)] == actions
        logged = json.loads(_cli("requests", "--port", str(port), "--json", "-n", "1000").stdout)["events"]
        assert [e["action"] for e in logged if e["kind"] == "autopilot"][:len(actions)] == actions
        assert all(e["reason"] for e in logged)
    finally:
        proc.terminate()
        proc.wait(60)
