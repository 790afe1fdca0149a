"""Issue 54, item 2: one reasoning setting. Rule 6 (serving.normalize) on hand-written bodies, with the fields
each engine's own source reads (llama.cpp b11434 server-common.cpp: chat_template_kwargs, reasoning_effort "none",
reasoning_budget_tokens; vLLM 0.32 chat_completion/protocol.py: reasoning_effort, chat_template_kwargs); the
models.yaml key as YAML writes it; and behind the endpoint a stand-in that thinks as a reasoning model does unless
a request turns thinking off in llama-server's ways: with the setting off (the model's, or Ollama's `think: false`)
it streams no reasoning, and the fields it received are llama-server's."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import serve_until_ready
from test_coding_agents import STANDIN, STANDIN_BINARY, Endpoint, stop

from desktop.core.common.errors import SwitchyardError
from desktop.core.runtime.ports import find_free_port
from desktop.core.serving.fleet import parse_models_config
from desktop.core.serving.models_file import dump_models_yaml
from desktop.core.serving.normalize import Target, parse

ASK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
LLAMA_OFF = {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": False},
             "reasoning_budget_tokens": 0}
VLLM_OFF = {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": False}}


def sent(body: dict[str, Any], engine: str, model_setting: str = "auto") -> tuple[dict[str, Any], str | None]:
    shape = parse("/v1/chat/completions", json.dumps(body).encode())
    assert shape is not None
    out = shape.body_for(Target("served", engine=engine, reasoning=model_setting))
    return (json.loads(out) if out is not None else body), shape.note


@pytest.mark.parametrize(("engine", "fields"), [("llama.cpp", LLAMA_OFF), ("vllm", VLLM_OFF)])
def test_off_reaches_each_engine_as_its_own_fields(engine: str, fields: dict[str, Any]) -> None:
    body, note = sent(ASK, engine, "off")  # the model's setting, the request says nothing
    assert {k: body.get(k) for k in fields} == fields and set(body) - set(ASK) == set(fields)
    assert note is not None and "reasoning off (the model's setting)" in note and engine in note
    asked, _ = sent({**ASK, "reasoning_effort": "none"}, engine)  # OpenAI's own word, asked by the client
    assert {k: asked.get(k) for k in fields} == fields


def test_the_request_wins_over_the_model_and_the_clients_template_settings_stay() -> None:
    body, _ = sent({**ASK, "reasoning_effort": "high"}, "llama.cpp", "off")
    assert body["reasoning_effort"] == "high" and "chat_template_kwargs" not in body
    body, _ = sent({**ASK, "chat_template_kwargs": {"enable_thinking": True, "x": 1}}, "vllm", "off")
    assert body["chat_template_kwargs"] == {"enable_thinking": True, "x": 1} and body["reasoning_effort"] == "none"
    untouched, note = sent(ASK, "vllm", "auto")
    assert untouched == ASK and note is None
    level, _ = sent(ASK, "vllm", "low")
    assert level["reasoning_effort"] == "low"


def test_models_yaml_takes_reasoning_effort_and_writes_it_back() -> None:
    text = "models:\n  - name: quiet\n    engine: llama.cpp\n    model: demo\n    reasoning_effort: off\n" \
           "    reasoning_parser: none\n"
    config = parse_models_config(yaml.safe_load(text))  # YAML 1.1 reads a bare `off` as false: still off
    assert config.models[0].reasoning_effort == "off"
    again = parse_models_config(yaml.safe_load(dump_models_yaml(config)))
    assert again.models[0].reasoning_effort == "off" and again.models[0].reasoning_parser == "none"
    with pytest.raises(SwitchyardError, match="reasoning_effort must be one of off, low, medium, high, auto"):
        parse_models_config({"models": [{"name": "x", "engine": "vllm", "model": "demo", "reasoning_effort": "max"}]})


@pytest.fixture
def thinking(tmp_path: Path, demo_model: Any) -> Iterator[tuple[Endpoint, Endpoint]]:
    """Two endpoints on a stand-in that thinks: one with the model's setting off, one left to the model (auto)."""
    running: list[Any] = []
    endpoints: list[Endpoint] = []
    try:
        for setting in ("off", "auto"):
            bodies = tmp_path / f"bodies-{setting}.jsonl"
            script = tmp_path / f"llama-server-{setting}"
            script.write_text(f"#!{sys.executable}\n" + STANDIN_BINARY.format(
                standin=str(STANDIN), options=["--think", "--bodies", str(bodies)]))
            script.chmod(0o755)
            port = find_free_port()
            proc, ready = serve_until_ready("--engine", "llama.cpp", "--model", "demo", "--proxy-port", str(port),
                                            "--reasoning-effort", setting,
                                            env={**os.environ, "SWITCHYARD_LLAMA_SERVER": str(script)})
            running.append(proc)
            assert ready.startswith(f"ready: http://127.0.0.1:{port}/v1"), ready
            endpoints.append(Endpoint(port, bodies))
        yield endpoints[0], endpoints[1]
    finally:
        for proc in running:
            stop(proc)


def _streamed_reasoning(port: int, **extra: Any) -> tuple[str, str]:
    import httpx
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                           http_client=httpx.Client(trust_env=False, timeout=60))
    content, reasoning = "", ""
    for chunk in client.chat.completions.create(model="switchyard", stream=True, messages=ASK["messages"],  # type: ignore[call-overload]
                                                **extra):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
    return content, reasoning


def test_a_thinking_engine_streams_no_reasoning_once_the_setting_is_off(thinking: tuple[Endpoint, Endpoint]) -> None:
    import ollama

    off, auto = thinking
    content, reasoning = _streamed_reasoning(auto.port)
    assert reasoning == "standin thinks. " and content  # left to the model, it thinks
    content, reasoning = _streamed_reasoning(off.port)
    assert reasoning == "" and content  # the model's setting off: llama-server's fields, so no thinking
    assert {k: off.seen()[-1]["body"].get(k) for k in LLAMA_OFF} == LLAMA_OFF
    content, reasoning = _streamed_reasoning(off.port, reasoning_effort="medium")  # the request wins
    assert reasoning == "standin thinks. "
    # Ollama's `think` is the same setting: false on the thinking model streams no thinking, true shows it
    client = ollama.Client(host=f"http://127.0.0.1:{auto.port}", trust_env=False, timeout=60)
    quiet = list(client.chat(model="switchyard", messages=ASK["messages"], think=False, stream=True))
    assert not any(p.message.thinking for p in quiet) and "".join(p.message.content for p in quiet)
    assert {k: auto.seen()[-1]["body"].get(k) for k in LLAMA_OFF} == LLAMA_OFF
    thought = client.chat(model="switchyard", messages=ASK["messages"], think=True, stream=False)
    assert thought.message.thinking == "standin thinks. " and thought.message.content == "hi from standin"


@pytest.mark.gui
@pytest.mark.qt_log_ignore("propagateSizeHints")
def test_the_serve_pages_thinking_choice_is_the_app_endpoints_setting(qtbot: Any) -> None:
    """The Serve page's Thinking box sets the app's endpoint (its single route) for the next request, with or
    without an endpoint yet, and through a restart of the endpoint."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from desktop.ui.engine_session import EngineSession
    from desktop.ui.pages.serve import ServePage

    session = EngineSession(endpoint_port=find_free_port())
    page = ServePage(session)
    qtbot.addWidget(page)
    try:
        box = page.launch_form.reasoning_box
        assert box.currentData() == "auto"
        box.setCurrentIndex(box.findData("off"))
        assert session.reasoning_effort == "off"
        session._ensure_endpoint()  # the endpoint a first Start opens (no engine needed for its routes)
        assert session.proxy.router.default.reasoning_effort == "off"
        box.setCurrentIndex(box.findData("high"))
        assert session.proxy.router.default.reasoning_effort == "high"
    finally:
        page.shutdown()
        session.shutdown()
