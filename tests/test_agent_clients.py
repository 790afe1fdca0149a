"""Agents keep working after a switch (issue 34): the official openai and anthropic clients send tools through the
stable endpoint to the real llama-server and, after `switchyard switch --to vllm`, to the real vLLM (CPU build),
on the demo model. Before plans carried a tool-call parser, every one of these requests was a 400 on vLLM:
'"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from conftest import run_cli, serve_until_ready

from desktop.core.runtime.ports import find_free_port

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "The weather in a city now",
                     "input_schema": WEATHER["function"]["parameters"]}  # type: ignore[index]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# An agent's second turn: its own tool call (content null) and the tool's answer.
SECOND_TURN = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


def _agent_requests(base: str, engine: str) -> dict[str, Any]:
    """Everything an agent sends, through the official clients (they raise on any 4xx/5xx)."""
    http = httpx.Client(trust_env=False, timeout=300)
    chat = openai.OpenAI(base_url=base + "/v1", api_key="unused", http_client=http, max_retries=0)
    whole = chat.chat.completions.create(model="switchyard", messages=ASK, tools=[WEATHER],  # type: ignore[arg-type, list-item]
                                         max_tokens=8, temperature=0)
    assert whole.choices and whole.choices[0].message.role == "assistant", (engine, whole)
    chunks = list(chat.chat.completions.create(model="switchyard", messages=ASK, tools=[WEATHER],  # type: ignore[arg-type, list-item]
                                               max_tokens=8, temperature=0, stream=True))
    assert chunks and any(c.choices and c.choices[0].finish_reason for c in chunks), (engine, chunks[-1:])
    second = chat.chat.completions.create(model="switchyard", messages=SECOND_TURN, tools=[WEATHER],  # type: ignore[arg-type, list-item]
                                          max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason in ("length", "stop", "tool_calls"), (engine, second)
    messages = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=300,
                                   http_client=anthropic.DefaultHttpxClient(trust_env=False))
    answer = messages.messages.create(model="switchyard", max_tokens=8, tools=[ANTHROPIC_WEATHER],  # type: ignore[list-item]
                                      messages=ASK)  # type: ignore[arg-type]
    assert answer.type == "message" and answer.role == "assistant", (engine, answer)
    with messages.messages.stream(model="switchyard", max_tokens=8, tools=[ANTHROPIC_WEATHER],  # type: ignore[list-item]
                                  messages=ASK) as stream:  # type: ignore[arg-type]
        streamed = stream.get_final_message()
    assert streamed.stop_reason in ("max_tokens", "end_turn", "tool_use"), (engine, streamed)
    http.close()
    return {"chat": whole, "stream": chunks, "messages": answer}


@pytest.mark.engine
@pytest.mark.llamacpp
@pytest.mark.vllm
def test_tools_through_the_endpoint_on_llamacpp_and_after_a_switch_to_vllm(llama_install: Any, vllm_install: Any,
                                                                          demo_model: Any) -> None:
    port = find_free_port()
    base = f"http://127.0.0.1:{port}"
    proc, ready = serve_until_ready("--engine", "llama.cpp", "--model", "demo", "--proxy-port", str(port),
                                    "--parallel", "2")
    try:
        assert ready.startswith(f"ready: {base}/v1"), ready
        _agent_requests(base, "llama.cpp")
        previewed = json.loads(run_cli("switch", "--to", "vllm", "--port", str(port), "--dry-run", "--json").stdout)
        rows = {row["capability"]: row for row in previewed["capabilities"]}
        assert rows["tools"]["traffic_s_ago"] is not None and rows["tools"]["target"] == "yes", rows
        switched = run_cli("switch", "--to", "vllm", "--port", str(port), "--json", timeout=900)
        assert switched.returncode == 0, switched.stderr
        assert json.loads(switched.stdout)["probed"] == ["tools"]  # vLLM answered a tools request first (issue 41)
        status = json.loads(run_cli("status", "--json", "--port", str(port)).stdout)
        assert status["active"]["engine"] == "vllm"
        assert status["active"]["plan"]["tool_parser"] == "hermes"  # from the demo's chat template
        _agent_requests(base, "vllm")
        assert run_cli("stop", "--port", str(port)).returncode == 0
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.engine
@pytest.mark.llamacpp
def test_the_real_llama_server_takes_the_reasoning_format_a_reasoning_plan_gives_it(llama_install: Any,
                                                                                     demo_model: Any) -> None:
    asked = ("serve", "--engine", "llama.cpp", "--model", "demo", "--reasoning-parser", "deepseek_r1")
    planned = run_cli(*asked, "--dry-run", "--json")
    assert planned.returncode == 0, planned.stderr
    argv = json.loads(planned.stdout)["argv"]
    assert argv[argv.index("--reasoning-format") + 1] == "deepseek"
    served = run_cli(*asked, "--prompt", "Hi", "--max-tokens", "4", "--json")
    assert served.returncode == 0, served.stderr  # llama-server refuses a --reasoning-format it does not know
    assert json.loads(served.stdout)["usage"]["completion_tokens"] == 4
