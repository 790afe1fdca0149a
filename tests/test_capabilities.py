"""Issue 41: a switch never drops a capability the traffic uses. The endpoint notes per model which capabilities
requests used (tools, JSON schemas, images, reasoning); before traffic moves the next engine gets one short request
per capability in use, and a refusal keeps the old engine serving (manual switch) or the autopilot where it is,
saying why. Stand-in engines (tests/standin_engine.py `--refuse`, `--requests`) behind a real proxy and manager;
the real engines in test_real_engines_switch_after_tool_calls_keeps_answering_them."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import run_cli
from test_autopilot_live import BOTH_FIT, ONE_FITS, Hybrid, _held, _until
from test_fleet import CPU, standin_launcher, two_models

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.base import LaunchPlan
from desktop.core.planning.planner import ask as ask_plan
from desktop.core.runtime.ports import find_free_port
from desktop.core.serving import capabilities
from desktop.core.serving.capabilities import (
    IMAGES,
    JSON_SCHEMA,
    MAX_MODELS,
    PROBE_USER,
    REASONING,
    TOOLS,
    TrafficCapabilities,
    probe,
)
from desktop.core.serving.endpoint import EndpointEvent, EndpointManager, MemoryBudget
from desktop.core.serving.fleet import Fleet
from desktop.core.serving.proxy import ProxyServer
from desktop.core.serving.requestinfo import scan

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
HELLO = [{"role": "user", "content": "hi"}]


def used_by(raw: bytes) -> frozenset[str]:
    """What the endpoint's one scan of a body finds it uses."""
    info = scan(raw)
    assert info is not None
    return info.capabilities


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "switchyard", "messages": HELLO, **fields}).encode()


# --- reading requests -----------------------------------------------------------------------------------------
def test_each_capability_is_read_from_the_structure_of_a_request() -> None:
    assert used_by(body(tools=[TOOL])) == {TOOLS}
    assert used_by(json.dumps({"model": "x", "max_tokens": 9, "tools": [{"name": "t", "input_schema": {}}],
                               "messages": HELLO}).encode()) == {TOOLS}  # Anthropic's /v1/messages
    assert used_by(body(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {}}})) == \
        {JSON_SCHEMA}
    assert used_by(body(response_format={"type": "json_object"})) == {JSON_SCHEMA}
    image = {"role": "user", "content": [{"type": "text", "text": "what?"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}
    assert used_by(json.dumps({"messages": [image]}).encode()) == {IMAGES}
    anthropic_image = {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "AA=="}}]}
    assert used_by(json.dumps({"messages": [anthropic_image]}).encode()) == {IMAGES}
    assert used_by(body(reasoning_effort="high")) == {REASONING}
    assert used_by(body(thinking={"budget_tokens": 1024, "type": "enabled"})) == {REASONING}
    assert used_by(body(chat_template_kwargs={"enable_thinking": True})) == {REASONING}


def test_text_that_talks_about_capabilities_and_empty_or_disabled_fields_are_not_uses() -> None:
    said = 'please call "tools": [{"type": "image_url"}] with "reasoning_effort": "high"'
    assert used_by(json.dumps({"messages": [{"role": "user", "content": said}]}).encode()) == frozenset()
    assert used_by(body(tools=[])) == frozenset()
    assert used_by(body(thinking={"type": "disabled"})) == frozenset()
    assert used_by(body(response_format={"type": "text"})) == frozenset()
    assert used_by(b"not json at all") == frozenset()


def test_what_is_kept_is_bounded_and_recent_means_the_last_hour() -> None:
    now = [1000.0]
    log = TrafficCapabilities(clock=lambda: now[0])
    for index in range(MAX_MODELS + 40):
        log.note(f"model-{index}", {TOOLS})
    assert log.recent("model-0") == [] and log.recent(f"model-{MAX_MODELS + 39}") == [TOOLS]
    assert len(log.ago(None)) == 1  # one capability across every model kept
    log.note("a", {IMAGES, TOOLS})
    now[0] += capabilities.RECENT_S + 1
    log.note("a", {JSON_SCHEMA})
    assert log.recent("a") == [JSON_SCHEMA]  # tools and images were used more than an hour ago
    assert log.ago("a")[TOOLS] == capabilities.RECENT_S + 1


def test_the_probe_sends_one_short_request_per_capability_and_stops_at_a_refusal() -> None:
    sent: list[dict[str, Any]] = []

    def accept(request: dict[str, Any]) -> tuple[int | None, str]:
        sent.append(request)
        return 200, "{}"

    assert probe(accept, "switchyard", [TOOLS, JSON_SCHEMA, IMAGES, REASONING]) is None
    assert len(sent) == 4 and all(r["max_tokens"] == 1 and r["user"] == PROBE_USER for r in sent)
    assert [sorted(used_by(json.dumps(r).encode())) for r in sent] == [[TOOLS], [JSON_SCHEMA], [IMAGES], [REASONING]]
    sent.clear()

    def refuse_schema(request: dict[str, Any]) -> tuple[int | None, str]:
        sent.append(request)
        return (400, '{"error": {"message": "no grammar"}}') if "response_format" in request else (200, "{}")

    refusal = probe(refuse_schema, "switchyard", [TOOLS, JSON_SCHEMA, IMAGES])
    assert refusal is not None and refusal.capability == JSON_SCHEMA and len(sent) == 2
    assert refusal.message("vllm").startswith("vLLM answered 400 to a JSON-schema (response_format) request")
    assert "no grammar" in refusal.message("vllm")


# --- switches with stand-in engines ---------------------------------------------------------------------------
class Endpoint:
    """A stand-in llama.cpp behind a real proxy and manager; the stand-in vLLM a switch starts gets `vllm_flags`,
    and every engine writes its requests to `requests/<engine>.jsonl`."""

    def __init__(self, tmp_path: Path, vllm_flags: list[str], budget: MemoryBudget | None = None,
                 failover: bool = False) -> None:
        self.dir = tmp_path / "requests"
        self.dir.mkdir()
        self.launched: list[LaunchPlan] = []

        def options(plan: LaunchPlan) -> list[str]:
            return ["--requests", str(self.dir / f"{plan.engine}.jsonl"),
                    *(vllm_flags if plan.engine == "vllm" else [])]

        self.proxy = ProxyServer(port=find_free_port(), wait_timeout=60)
        self.proxy.start()
        self.manager = EndpointManager(self.proxy, hardware=CPU, ready_timeout=60, budget=budget,
                                       launcher=standin_launcher(tmp_path, options, self.launched),
                                       keep_standby=failover, failover=failover)
        self.manager.start(ask_plan("llama.cpp", "demo", {"ctx_per_request": 512}))

    def chat(self, **fields: Any) -> httpx.Response:
        return httpx.post(self.proxy.url + "/v1/chat/completions", content=body(max_tokens=4, **fields),
                          headers={"Content-Type": "application/json"}, timeout=30, trust_env=False)

    def probes(self, engine: str) -> list[list[str]]:
        """The capabilities of each probe `engine` received."""
        path = self.dir / f"{engine}.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [sorted(line["capabilities"]) for line in lines if line["user"] == PROBE_USER]

    def close(self) -> None:
        self.manager.close()
        self.proxy.stop()


@pytest.fixture
def endpoint(tmp_path: Path) -> Iterator[Callable[..., Endpoint]]:
    made: list[Endpoint] = []

    def make(vllm_flags: list[str] | None = None, budget: MemoryBudget | None = None,
             failover: bool = False) -> Endpoint:
        made.append(Endpoint(tmp_path, vllm_flags or [], budget, failover))
        return made[-1]

    yield make
    for one in made:
        one.close()


def test_a_switch_to_an_engine_that_refuses_the_tools_in_use_is_refused_and_nothing_moves(
        endpoint: Callable[..., Endpoint]) -> None:
    e = endpoint(["--refuse", "tools"])
    assert e.chat(tools=[TOOL]).status_code == 200  # llama.cpp answers tool calls
    first = e.manager.active
    preview = e.manager.switch_preview("vllm")
    rows = {row["capability"]: row for row in preview["capabilities"]}
    assert rows[TOOLS]["traffic_s_ago"] is not None and rows[IMAGES]["traffic_s_ago"] is None
    # the demo's chat template renders tools the Hermes way (models/demo.py, DEMO_VERSION 2): its vLLM plan carries
    # the hermes parser, so the table says "yes"; this stand-in vLLM refuses tools all the same, as a build without
    # the parser does, which only the probe finds out
    assert rows[TOOLS]["active"] == "yes" and rows[TOOLS]["target"] == "yes"
    assert preview["plan"]["tool_parser"] == "hermes"
    with pytest.raises(SwitchyardError) as refused:
        e.manager.switch("vllm")
    assert "vLLM answered 400 to a tools request: set tool_parser for this model" in refused.value.message
    assert "--enable-auto-tool-choice" in refused.value.message  # the engine's own words, quoted
    assert e.manager.active is first and first is not None and first.plan.engine == "llama.cpp"
    assert e.probes("vllm") == [[TOOLS]]  # one short request, for the one capability in use
    vllm = [p for p in e.launched if p.engine == "vllm"]
    assert len(vllm) == 1 and e.manager.standby is None  # the refused engine was stopped, not kept
    assert e.chat(tools=[TOOL]).status_code == 200  # and the clients never noticed
    status = e.manager.status()
    assert "answered 400 to a tools request" in status["last_error"]
    assert {row["capability"] for row in status["capabilities"]} == set(capabilities.CAPABILITIES)


def test_a_stop_first_switch_that_is_refused_brings_the_old_engine_back_before_any_request_moves(
        endpoint: Callable[..., Endpoint]) -> None:
    e = endpoint(["--refuse", "images"], ONE_FITS)  # both do not fit: the old engine stops before the new starts
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    assert e.chat(messages=image).status_code == 200
    assert e.manager.switch_preview("vllm")["kind"] == "stop-first"
    with pytest.raises(SwitchyardError, match="vLLM answered 400 to an image request: serve a vision model"):
        e.manager.switch("vllm")
    assert e.probes("vllm") == [[IMAGES]]
    active = e.manager.active
    assert active is not None and active.plan.engine == "llama.cpp"  # started again: it had stopped
    assert [p.engine for p in e.launched] == ["llama.cpp", "vllm", "llama.cpp"]
    assert e.chat(messages=image).status_code == 200 and e.proxy.counters["failed"] == 0


TOOLS_REFUSED = ('vLLM answered 400 to a tools request: set tool_parser for this model (models.yaml `tool_parser:`) '
                 '(it said: "auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set)')


def test_a_switch_while_nothing_serves_probes_the_next_engine_and_refuses_one_that_drops_the_tools_in_use(
        endpoint: Callable[..., Endpoint]) -> None:
    """Nothing serves (the engine was unloaded, as an idle model's is): no request waits on the switch, so there is
    time to probe; an engine that refuses what the traffic used is refused and stopped, as beside a serving one."""
    e = endpoint(["--refuse", "tools"])
    assert e.chat(tools=[TOOL]).status_code == 200
    assert e.manager.unload("unloaded by the test") and e.manager.active is None
    events: list[str] = []
    e.manager.subscribe(lambda event: events.append(event.message))
    with pytest.raises(SwitchyardError) as refused:
        e.manager.switch("vllm")
    assert e.probes("vllm") == [[TOOLS]]
    assert refused.value.message == TOOLS_REFUSED
    assert events[-1] == "switch to vllm refused, nothing serves, as before: " + TOOLS_REFUSED
    assert e.manager.active is None and e.manager.standby is None
    assert [p.engine for p in e.launched] == ["llama.cpp", "vllm"]


def test_a_crash_failover_moves_at_once_then_probes_the_standby_and_says_what_it_refuses(
        endpoint: Callable[..., Endpoint]) -> None:
    """The active engine dies: its warm standby takes over at once (requests do not wait for a probe: the engine
    that answered them is gone), then is probed off the engine's log thread; what it refuses is said in status
    (the CLI's `status` prints it), the endpoint's events (the serve log, the Serve page's notice) and the Serve
    page's capability lines."""
    from desktop.core.serving.control import (
        EndpointControl,
        control_routes,
        new_token,
        remove_discovery,
        write_discovery,
    )
    from desktop.ui.pages.serve import capabilities_text

    e = endpoint(["--refuse", "tools"], failover=True)
    e.manager.prepare_standby(e.manager.target("vllm"))
    first, standby = e.manager.active, e.manager.standby
    assert first is not None and standby is not None and first.process.pid is not None
    assert e.chat(tools=[TOOL]).status_code == 200  # llama.cpp answers tool calls
    events: list[tuple[str, str]] = []
    checked = threading.Event()

    def heard(event: EndpointEvent) -> None:
        events.append((event.state, event.message))
        if "after the crash failover" in event.message:
            checked.set()

    e.manager.subscribe(heard)
    os.kill(first.process.pid, signal.SIGKILL)
    assert checked.wait(30), events
    said = (f"capability check after the crash failover: {TOOLS_REFUSED}; {standby.upstream.name} serves on, and "
            "requests that use it fail until a switch to an engine that answers them")
    assert events[0] == ("failover", f"{first.upstream.name} died ({first.process.failure().message}); "
                                     f"{standby.upstream.name} took over (capability check: not checked before the "
                                     "crash failover; checking tools now)")
    assert events[-1] == ("failover", said)
    assert e.manager.active is standby and e.probes("vllm") == [[TOOLS]]
    assert e.manager.status()["capability_check"] == said
    assert capabilities_text(e.manager.capability_table(), e.manager.capability_note).endswith("\nC" + said[1:])
    assert e.chat().status_code == 200  # plain text still served, by the standby
    token = new_token()
    e.proxy.add_routes(control_routes(EndpointControl(e.manager), token))
    discovery = write_discovery(e.proxy.port, e.proxy.url, token)
    try:
        shown = run_cli("status", "--port", str(e.proxy.port))
    finally:
        remove_discovery(discovery)
    assert shown.returncode == 0 and f"\n  {said}\n" in shown.stdout, shown.stdout + shown.stderr


def test_without_tool_traffic_the_same_switch_goes_through_and_probes_nothing(
        endpoint: Callable[..., Endpoint]) -> None:
    e = endpoint(["--refuse", "tools"])
    assert e.chat().status_code == 200
    result = e.manager.switch("vllm")
    assert result.to_engine == "vllm" and e.probes("vllm") == []


def test_the_table_shows_the_hybrid_pairs_engine_that_does_not_serve(endpoint: Callable[..., Endpoint]) -> None:
    e = endpoint()
    first = e.manager.plan
    e.manager.switch("vllm")  # no capability used: nothing to probe
    vllm = e.manager.plan

    class Pilot:  # what the table reads of the hybrid mode's autopilot: the pair of plans
        first_plan, other_plan = first, vllm

    e.manager.autopilot = Pilot()  # type: ignore[assignment]
    try:
        rows = {r["capability"]: r for r in e.manager.capability_table()}
        assert rows[IMAGES]["active"] == "model" and rows[IMAGES]["other"] == "no"  # vLLM serves, llama.cpp other
    finally:
        e.manager.autopilot = None


def test_a_switch_probes_each_capability_in_use_once_and_goes_through_when_all_answer(
        endpoint: Callable[..., Endpoint]) -> None:
    e = endpoint()
    for fields in ({"tools": [TOOL]}, {"tools": [TOOL]}, {"response_format": {"type": "json_object"}},
                   {"reasoning_effort": "low"}):
        assert e.chat(**fields).status_code == 200
    e.manager.switch("vllm")
    assert e.manager.active is not None and e.manager.active.plan.engine == "vllm"
    assert e.probes("vllm") == [[TOOLS], [JSON_SCHEMA], [REASONING]]  # three capabilities, three requests
    assert e.chat(tools=[TOOL]).status_code == 200
    e.manager.switch("llama.cpp")  # and back: the same three, once each
    assert e.probes("llama.cpp") == [[TOOLS], [JSON_SCHEMA], [REASONING]]


def test_in_a_fleet_each_models_own_traffic_decides_what_its_switch_must_keep(tmp_path: Path) -> None:
    """alpha's clients call tools, beta's do not: alpha's switch to a vLLM that refuses tools is refused, beta's
    switch probes nothing and goes through."""
    requests = tmp_path / "requests.jsonl"

    def options(plan: LaunchPlan) -> list[str]:
        return ["--requests", str(requests), *(["--refuse", "tools"] if plan.engine == "vllm" else [])]

    proxy = ProxyServer(port=find_free_port(), wait_timeout=60)
    proxy.start()
    fleet = Fleet(proxy, two_models(beta={"engine": "llama.cpp"}), hardware=CPU, ready_timeout=60,
                  launcher=standin_launcher(tmp_path, options))
    try:
        fleet.start()
        for model, fields in (("alpha", {"tools": [TOOL]}), ("beta", {})):
            sent = httpx.post(proxy.url + "/v1/chat/completions", timeout=30, trust_env=False,
                              json={"model": model, "messages": HELLO, "max_tokens": 2, **fields})
            assert sent.status_code == 200, sent.text
        rows = {r["capability"]: r for r in fleet.status()["models"]["alpha"]["capabilities"]}
        assert rows[TOOLS]["traffic_s_ago"] is not None
        assert fleet.status()["models"]["beta"]["capabilities"][0]["traffic_s_ago"] is None
        with pytest.raises(SwitchyardError, match="vLLM answered 400 to a tools request"):
            fleet.switch("vllm", name="alpha")
        assert fleet.switch("vllm", name="beta").probed == ()
        lines = [json.loads(line) for line in requests.read_text().splitlines()]
        assert [line["capabilities"] for line in lines if line["user"] == PROBE_USER] == [[TOOLS]]
        alpha = fleet.status()["models"]["alpha"]["active"]
        assert alpha["engine"] == "llama.cpp"
    finally:
        fleet.close()
        proxy.stop()


def test_the_autopilot_stays_on_llamacpp_and_says_why_when_vllm_refuses_the_tools_in_use(
        hybrid_refusing: Hybrid) -> None:
    h = hybrid_refusing
    answer = httpx.post(h.proxy.url + "/v1/chat/completions", content=body(tools=[TOOL], max_tokens=2),
                        headers={"Content-Type": "application/json"}, timeout=30, trust_env=False)
    assert answer.status_code == 200
    load = _held(h, 4)  # above the crossover: the autopilot starts vLLM and wants to hand over
    refused = _until(lambda: next((d for d in h.autopilot.status()["decisions"]
                                   if "answered 400 to a tools request" in d["reason"]), None))
    assert refused and refused["action"] == "stay", h.autopilot.status()["decisions"]
    assert "the hand-over to vLLM failed" in refused["reason"] and "llama.cpp keeps serving" in refused["reason"]
    assert h.active_engine() == "llama.cpp"
    steps = h.autopilot.steps
    assert _until(lambda: h.autopilot.steps >= steps + 10)  # it keeps deciding, and does not ask again
    assert "is not tried again" in h.autopilot.status()["last"]["reason"]
    h.hold.unlink()
    load.__exit__()
    assert load.result.failed == [] and h.active_engine() == "llama.cpp"
    probes = [json.loads(line) for line in (h.requests).read_text().splitlines()]
    assert [p["capabilities"] for p in probes if p["user"] == PROBE_USER] == [[TOOLS]]  # one probe in all


def test_a_hand_back_the_probe_refuses_is_tried_once_per_retry_period_not_once_per_tick(tmp_path: Path) -> None:
    """On vLLM with tools in the traffic, the load ends and the autopilot hands back to a llama.cpp that refuses
    tools (the realistic case: images, which llama.cpp plans carry no projector for): one llama.cpp is started,
    probed and stopped, vLLM keeps serving, and the hand-back waits out the retry period instead of starting a
    fresh llama-server every tick."""
    h = Hybrid(tmp_path, BOTH_FIT)
    try:
        load = _held(h, 4)  # above the crossover: vLLM starts and takes over
        assert _until(lambda: h.active_engine() == "vllm"), h.actions()
        h.llama_options = ["--refuse", "tools"]  # the next llama.cpp cannot do what the traffic does
        answer = httpx.post(h.proxy.url + "/v1/chat/completions", content=body(tools=[TOOL], max_tokens=2),
                            headers={"Content-Type": "application/json"}, timeout=30, trust_env=False)
        assert answer.status_code == 200, answer.text  # vLLM answers tools
        h.hold.unlink()
        load.__exit__()
        refused = _until(lambda: next((d for d in h.autopilot.status()["decisions"]
                                       if "handing back to llama.cpp failed" in d["reason"]), None))
        assert refused and refused["action"] == "stay" and "vLLM keeps serving" in refused["reason"], \
            h.autopilot.status()["decisions"]
        launched = h.engines().count("llama.cpp")
        steps = h.autopilot.steps
        assert _until(lambda: h.autopilot.steps >= steps + 20)  # 20 more ticks: none starts a llama.cpp
        assert h.engines().count("llama.cpp") == launched == 2, h.engines()  # the first, and the refused one
        assert h.active_engine() == "vllm"
        assert "is not tried again" in h.autopilot.status()["last"]["reason"], h.autopilot.status()["last"]
    finally:
        h.close()


@pytest.fixture
def hybrid_refusing(tmp_path: Path) -> Iterator[Hybrid]:
    requests = tmp_path / "vllm-requests.jsonl"
    h = Hybrid(tmp_path, BOTH_FIT, vllm_options=["--refuse", "tools", "--requests", str(requests)])
    h.requests = requests  # type: ignore[attr-defined]
    yield h
    h.close()


@pytest.mark.gui
@pytest.mark.qt_log_ignore("propagateSizeHints")
def test_the_serve_page_shows_what_the_traffic_used_and_what_each_plan_supports(
        qtbot: Any, endpoint: Callable[..., Endpoint]) -> None:
    from desktop.ui.main_window import MainWindow

    window = MainWindow()
    window.session.endpoint_port = 0
    window.confirm_quit = lambda: True
    qtbot.addWidget(window)
    window.show()
    e = endpoint(["--refuse", "tools"])
    try:
        serve = window.show_page("Serve")
        window.session.manager = e.manager
        serve.refresh_live()
        assert serve.capabilities_label.isVisible()
        assert "used none of tools" in serve.capabilities_label.text()
        assert e.chat(tools=[TOOL]).status_code == 200
        serve.refresh_live()
        text = serve.capabilities_label.text()
        assert "tools (" in text and "serving: yes" in text, text
        assert "JSON" not in text.split("\n", 1)[1]  # only what was used is listed
    finally:
        window.session.manager = None
        window.close()
