"""What Claude Code and Codex send, through the endpoint to the real engines (issue 48).

The bodies are built after the ones the real agents sent through the endpoint (Claude Code 2.1.197, Codex 0.171.0,
recorded with the stand-in's --bodies in tests/test_coding_agents.py), cut to a size the demo model answers in
seconds on 2 cores: Claude Code's system blocks (its attribution line first, alone in its block), a mid-conversation
`system` message, tools with input_schema, `thinking: adaptive`, `max_tokens: 32000`; Codex's developer messages
(one of them after the conversation began), a `web_search` tool beside functions, `reasoning`, `store: false`,
`include`, `prompt_cache_key`. The expected numbers come from the engines: count_tokens against the usage the same
engine reports for the same request (Anthropic's total input = input_tokens + cache_read_input_tokens +
cache_creation_input_tokens), the prefix cache from the usage's cache_read_input_tokens.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import run_cli, serve_until_ready
from gguf_tools import with_chat_template

from desktop.core.runtime.ports import find_free_port

TEMPLATES = Path(__file__).parent / "data" / "templates"
HEADERS = {"x-api-key": "none", "anthropic-version": "2023-06-01", "content-type": "application/json",
           "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,mid-conversation-system-2026-04-07"}
# ~1,300 tokens of standing instructions, as Claude Code's (5,672 characters there) and Codex's (16,979) are long
INSTRUCTIONS = "\n".join(f"Rule {i}: read the file before an edit, keep the change to what rule {i} of the task asks, "
                         f"and say in one line why it was needed." for i in range(1, 21))
CLAUDE_TOOLS = [
    {"name": "Bash", "description": "Executes a given bash command and returns its output.",
     "input_schema": {"type": "object", "properties": {"command": {"type": "string"},
                                                       "timeout": {"type": "number"}}, "required": ["command"]}},
    {"name": "Read", "description": "Reads a file from the local filesystem.",
     "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}},
    {"name": "Edit", "description": "Performs exact string replacements in files.",
     "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"},
                                                       "old_string": {"type": "string"},
                                                       "new_string": {"type": "string"}},
                      "required": ["file_path", "old_string", "new_string"]}},
]


def claude_code_body(attribution: str, max_tokens: int = 32000) -> dict[str, Any]:
    """A first turn of `claude -p "Say hi."` as Claude Code 2.1.197 sends it, with a shorter system prompt."""
    return {
        "model": "switchyard", "max_tokens": max_tokens, "temperature": 0,
        "system": [{"type": "text", "text": attribution},
                   {"type": "text", "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK.",
                    "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "\nYou are an interactive agent that helps users with software "
                                            "engineering tasks.\n\n" + INSTRUCTIONS,
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>\nToday's date is 2026-12-05.\n</system-reminder>\n\n"},
                {"type": "text", "text": "Say hi.", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Available agent types for the Agent tool:\n- claude: Catch-all."},
        ],
        "tools": CLAUDE_TOOLS,
        "metadata": {"user_id": json.dumps({"device_id": "feff5c46", "session_id": "62b1ff00"})},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
    }


def _developer(text: str, ident: str) -> dict[str, Any]:
    return {"type": "message", "id": ident, "role": "developer", "content": [{"type": "input_text", "text": text}]}


def _user(text: str, ident: str) -> dict[str, Any]:
    return {"type": "message", "id": ident, "role": "user", "content": [{"type": "input_text", "text": text}]}


def codex_body() -> dict[str, Any]:
    """A second turn of `codex exec` as Codex 0.171.0 sends it: no `instructions`, developer messages first and
    one after the first answer (a changed collaboration mode), a web_search tool beside the functions."""
    shell = {"type": "function", "name": "exec_command", "description": "Runs a command in a PTY.", "strict": False,
             "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                            "additionalProperties": False}}
    plan = {"type": "function", "name": "update_plan", "description": "Updates the task plan.", "strict": False,
            "parameters": {"type": "object", "properties": {"explanation": {"type": "string"}},
                           "additionalProperties": False}}
    return {
        "model": "switchyard", "stream": True, "max_output_tokens": 16,
        "input": [
            _developer("You are a coding agent running in the Codex CLI.\n" + INSTRUCTIONS, "msg_1"),
            _developer("<permissions instructions>workspace-write</permissions instructions>", "msg_2"),
            _user("<environment_context>\n  <cwd>/work</cwd>\n  <shell>bash</shell>\n</environment_context>", "msg_3"),
            _user("List the files.", "msg_4"),
            {"type": "message", "id": "msg_5", "role": "assistant",
             "content": [{"type": "output_text", "text": "There are no files here."}]},
            _developer("<collaboration_mode>The user changed the mode to plan.</collaboration_mode>", "msg_6"),
            _user("Say hi.", "msg_7"),
        ],
        "tools": [shell, plan, {"type": "web_search", "external_web_access": False}],
        "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "01a24775-fb7a-7ac2-82fb-107af49eb6e9",
    }


def post(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.post(base + path, json=body, headers=HEADERS, trust_env=False, timeout=600)
    assert answer.status_code == 200, (path, answer.status_code, answer.text[:2000])
    data: dict[str, Any] = answer.json()
    return data


def total_input(usage: dict[str, Any]) -> int:
    """Anthropic's whole prompt: input_tokens counts only what the prefix cache did not serve."""
    return int(usage["input_tokens"]) + sum(int(usage.get(k) or 0) for k in ("cache_read_input_tokens",
                                                                              "cache_creation_input_tokens"))


def count_tokens_matches_usage(base: str, engine: str, attribution: str) -> int:
    """count_tokens of a Claude Code request, then the request itself: the engine's two counts agree."""
    body = claude_code_body(attribution, max_tokens=8)
    counted = post(base, "/v1/messages/count_tokens", {k: v for k, v in body.items() if k not in (
        "max_tokens", "temperature", "metadata", "context_management", "output_config")})["input_tokens"]
    usage = post(base, "/v1/messages", body)["usage"]
    assert counted == total_input(usage) > 1000, (engine, counted, usage)
    return int(counted)


def responses_stream(base: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed /v1/responses request's events, as Codex reads them."""
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", base + "/v1/responses", json=body, trust_env=False, timeout=600) as answer:
        assert answer.status_code == 200, (answer.status_code, answer.read()[:2000])
        for line in answer.iter_lines():
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                events.append(json.loads(line[5:]))
    return events


def claude_code_budget_and_thinking(base: str, engine: str, port: str) -> None:
    """Claude Code's 32,000-token budget is lowered to the served context (said in X-Switchyard-Adjusted and the
    request log) and streams; its next turn sends the first answer's thinking block back with an empty signature,
    and the engine takes it."""
    body = {**claude_code_body("x-anthropic-billing-header: cc_version=2.1.197.0f0; cc_entrypoint=cli; cch=77e7e;"),
            "stream": True}
    with httpx.stream("POST", base + "/v1/messages", json=body, headers=HEADERS, trust_env=False,
                      timeout=600) as answer:
        assert answer.status_code == 200, (engine, answer.read()[:2000])
        adjusted = answer.headers.get("x-switchyard-adjusted", "")
        for line in answer.iter_lines():  # the first token is enough: the engine took the budget
            if line == "event: content_block_delta":
                break
    assert "max_tokens 32000 -> 4096 (the context served per request)" in adjusted, (engine, adjusted)
    listed = json.loads(run_cli("requests", "--json", "--port", port, "-n", "1").stdout)["requests"]
    assert "max_tokens 32000 -> 4096" in (listed[-1].get("note") or ""), (engine, listed)
    turn = claude_code_body("x-anthropic-billing-header: cc_version=2.1.197.0f1; cc_entrypoint=cli; cch=88e8e;",
                            max_tokens=8)
    turn["messages"] = [*turn["messages"], {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "The user wants a greeting.", "signature": ""},
        {"type": "text", "text": "Hi!"}]}, {"role": "user", "content": "Once more."}]
    assert post(base, "/v1/messages", turn)["type"] == "message"


def codex_turn_completes(base: str, engine: str) -> None:
    events = responses_stream(base, codex_body())
    kinds = [e.get("type") for e in events]
    assert kinds and kinds[0] == "response.created" and kinds[-1] == "response.completed", (engine, kinds)
    assert "response.output_item.done" in kinds, (engine, kinds)  # Codex takes its last message from it
    done = events[-1]["response"]
    assert done["status"] in ("completed", "incomplete") and done["usage"]["input_tokens"] > 1000, (engine, done)


def stop(proc: subprocess.Popen[str], port: int) -> None:
    if proc.poll() is None:
        run_cli("stop", "--port", str(port))
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def llama_endpoint(llama_install: Any, demo_model: Any) -> Iterator[str]:
    """`switchyard serve` of the demo on llama-server, one slot, as a user serves it (prefix cache on)."""
    port = find_free_port()
    proc, ready = serve_until_ready("--engine", "llama.cpp", "--model", "demo", "--ctx", "4096", "--parallel", "1",
                                    "--proxy-port", str(port), "--vllm-eager")  # a switch's vLLM: no torch.compile
    try:
        assert ready.startswith(f"ready: http://127.0.0.1:{port}/v1"), ready
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc, port)


@pytest.mark.engine
@pytest.mark.llamacpp
def test_count_tokens_equals_the_usage_of_the_same_claude_code_request_on_llama_server(llama_endpoint: str) -> None:
    count_tokens_matches_usage(llama_endpoint, "llama.cpp",
                               "x-anthropic-billing-header: cc_version=2.1.197.5e1; cc_entrypoint=cli; cch=0a0a0;")


@pytest.mark.engine
@pytest.mark.llamacpp
def test_claude_codes_changing_attribution_line_keeps_the_prefix_cache_on_llama_server(llama_endpoint: str) -> None:
    """Two turns that differ only in the attribution line (its version fingerprint and its cch both change, as
    they do from one request to the next): the second evaluates under 10% of the first's prompt."""
    first = post(llama_endpoint, "/v1/messages", claude_code_body(
        "x-anthropic-billing-header: cc_version=2.1.197.a3f; cc_entrypoint=cli; cch=91b0c;", max_tokens=8))["usage"]
    second = post(llama_endpoint, "/v1/messages", claude_code_body(
        "x-anthropic-billing-header: cc_version=2.1.197.7d2; cc_entrypoint=cli; cch=e04a1;", max_tokens=8))["usage"]
    assert total_input(second) == total_input(first) > 1000, (first, second)
    assert second["input_tokens"] < 0.1 * total_input(first), (first, second)  # evaluated, not read from the cache


@pytest.mark.engine
@pytest.mark.llamacpp
def test_claude_codes_budget_and_empty_thinking_signature_on_llama_server(llama_endpoint: str) -> None:
    claude_code_budget_and_thinking(llama_endpoint, "llama.cpp", llama_endpoint.rsplit(":", 1)[1])


@pytest.mark.engine
@pytest.mark.llamacpp
@pytest.mark.vllm
def test_a_codex_turn_completes_on_llama_server_and_after_a_switch_on_vllm(llama_endpoint: str,
                                                                           vllm_install: Any) -> None:
    """Codex's stream with a web_search tool and a developer message mid-conversation ends in response.completed
    on both engines; on vLLM, count_tokens agrees with its own usage, and Claude Code's budget and empty thinking
    signature are taken too."""
    codex_turn_completes(llama_endpoint, "llama.cpp")
    port = llama_endpoint.rsplit(":", 1)[1]
    switched = run_cli("switch", "--to", "vllm", "--port", port, "--json", timeout=900)
    assert switched.returncode == 0, switched.stderr
    assert json.loads(run_cli("status", "--json", "--port", port).stdout)["active"]["engine"] == "vllm"
    codex_turn_completes(llama_endpoint, "vllm")
    claude_code_budget_and_thinking(llama_endpoint, "vllm", port)
    count_tokens_matches_usage(llama_endpoint, "vllm",
                               "x-anthropic-billing-header: cc_version=2.1.197.c4d; cc_entrypoint=cli; cch=5b5b5;")


# --- a model whose chat template takes system messages only first (Qwen3.5's, as llama.cpp ships it) -------------
@pytest.fixture(scope="module")
def system_first_endpoint(llama_install: Any, demo_model: Any, tmp_path_factory: pytest.TempPathFactory
                          ) -> Iterator[str]:
    """The demo's weights with Qwen3.5's template, which raises "System message must be at the beginning." for a
    system message anywhere else, served by the real llama-server through the endpoint."""
    model = with_chat_template(demo_model.gguf_path, tmp_path_factory.mktemp("qwen-template") / "demo-qwen.gguf",
                               (TEMPLATES / "Qwen3.5-4B.jinja").read_text())
    port = find_free_port()
    proc, ready = serve_until_ready("--engine", "llama.cpp", "--model", str(model), "--ctx", "4096",
                                    "--parallel", "1", "--proxy-port", str(port))
    try:
        assert ready.startswith(f"ready: http://127.0.0.1:{port}/v1"), ready
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc, port)


@pytest.mark.engine
@pytest.mark.llamacpp
def test_mid_conversation_system_messages_reach_a_template_that_takes_them_only_first(
        system_first_endpoint: str) -> None:
    """Each agent's own place for a late instruction: a chat `system` message after the first answer, Codex's
    `developer` item, Claude Code's `system` entry in `messages`. The endpoint moves them to the front (and says
    so in X-Switchyard-Adjusted), so the template renders instead of raising."""
    chat = {"model": "switchyard", "max_tokens": 8, "temperature": 0, "messages": [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "There are none."},
        {"role": "system", "content": "The user changed the mode to plan."}, {"role": "user", "content": "Say hi."}]}
    answer = httpx.post(system_first_endpoint + "/v1/chat/completions", json=chat, trust_env=False, timeout=600)
    assert answer.status_code == 200, answer.text[:2000]
    assert "system/developer message" in answer.headers.get("x-switchyard-adjusted", ""), answer.headers
    codex_turn_completes(system_first_endpoint, "llama.cpp (Qwen3.5 template)")
    claude = claude_code_body("x-anthropic-billing-header: cc_version=2.1.197.e2e; cc_entrypoint=cli; cch=1c1c1;",
                              max_tokens=8)
    assert post(system_first_endpoint, "/v1/messages", claude)["type"] == "message"
    counted = post(system_first_endpoint, "/v1/messages/count_tokens", {
        k: v for k, v in claude.items() if k in ("model", "system", "messages", "tools", "thinking")})
    assert counted["input_tokens"] > 1000, counted
