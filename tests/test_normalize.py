"""The request rules (serving.normalize) and the context refusals (serving.refusals) on the bodies real clients
send and the answers real engines give, each expected value written by hand: Claude Code 2.1.197's /v1/messages,
Codex 0.171.0's /v1/responses (shapes as recorded from both through the stand-in engine), chat completions;
llama-server b11434's exceed_context_size_error and vLLM 0.32's context texts (vllm/renderers/params.py,
entrypoints/serve/utils/api_utils.py). Chat templates: tests/data/templates (llama.cpp's own, see its README)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from desktop.core.engines.base import LaunchPlan
from desktop.core.serving import normalize, refusals
from desktop.core.serving.normalize import Target, engine_rules, parse, template_wants_system_first
from desktop.core.serving.refusals import Refusal, context_message, error_body, stream_error
from desktop.core.serving.requestinfo import BadBody

TEMPLATES = Path(__file__).parent / "data" / "templates"
LLAMA8B = Path(__file__).parent / "fixtures" / "models" / "llama8b-bf16"  # max_position_embeddings 131072
SERVED = Target("served-model")
SERVED_SYSTEM_FIRST = Target("served-model", system_first=True)

BILLING = "x-anthropic-billing-header: cc_version=2.1.197.123; cc_entrypoint=sdk-cli; cch=91b0c;"
AGENT_SDK = "You are a Claude agent, built on Anthropic's Claude Agent SDK."
CC_PROMPT = "\nYou are an interactive agent that helps users with software engineering tasks."
CACHE = {"type": "ephemeral"}
BASH_TOOL = {"name": "Bash", "description": "Executes a given bash command.",
             "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                              "required": ["command"], "additionalProperties": False}}
READ_TOOL = {"name": "Read", "description": "Reads a file.", "input_schema": {
    "type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}
WEB_SEARCH_SERVER_TOOL = {"type": "web_search_20250305", "name": "web_search", "max_uses": 8}
USER_HI = [{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}]

DEV_1 = "You are a coding agent running in the Codex CLI, a terminal-based coding assistant."
DEV_2 = "<skills_instructions>\n## Skills\nA skill is a set of local instructions.\n</skills_instructions>"
CODEX_INPUT = [
    {"type": "message", "id": "msg_1", "role": "developer", "content": [{"type": "input_text", "text": DEV_1}]},
    {"type": "message", "id": "msg_2", "role": "developer", "content": [{"type": "input_text", "text": DEV_2}]},
    {"type": "message", "id": "msg_3", "role": "user",
     "content": [{"type": "input_text", "text": "<environment_context>\n  <cwd>/tmp/cx</cwd>\n</environment_context>"}]},
    {"type": "message", "id": "msg_4", "role": "user", "content": [{"type": "input_text", "text": "Say hi"}]},
]
EXEC_COMMAND = {"type": "function", "name": "exec_command", "description": "Runs a command in a PTY.", "strict": False,
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                               "additionalProperties": False}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for spawning and managing sub-agents.",
             "tools": [{"type": "function", "name": "close_agent", "description": "Close an agent.", "strict": False,
                        "parameters": {"type": "object", "properties": {"target": {"type": "string"}},
                                       "required": ["target"], "additionalProperties": False}}]}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}
PATCH_TEXT = "Use the `apply_patch` tool to edit files. This is a FREEFORM tool, so do not wrap the patch in JSON."
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": PATCH_TEXT,
               "format": {"type": "grammar", "syntax": "lark",
                          "definition": "start: begin_patch hunk+ end_patch\nbegin_patch: \"*** Begin Patch\" LF\n"}}
# what Codex's function form of apply_patch takes: one string, `input` (written out, not taken from the module)
APPLY_PATCH_FUNCTION = {"type": "function", "name": "apply_patch", "description": PATCH_TEXT,
                        "parameters": {"type": "object", "properties": {"input": {"type": "string"}},
                                       "required": ["input"], "additionalProperties": False}}


def shaped(path: str, body: dict[str, Any], target: Target = SERVED, cap: int | None = None) -> Any:
    """The JSON the engine gets for `body` (None: the client's own bytes), through parse and body_for."""
    shape = parse(path, json.dumps(body).encode())
    assert shape is not None
    shape.cap = cap
    out = shape.body_for(target)
    return None if out is None else json.loads(out)


def note_of(path: str, body: dict[str, Any], target: Target = SERVED) -> str | None:
    shape = parse(path, json.dumps(body).encode())
    assert shape is not None
    shape.body_for(target)
    return shape.note


# --- Claude Code: rule 4 (the attribution line), rule 2 (server tools), rule 5 ---
def claude_code(system: Any, tools: list[Any] | None = None, **extra: Any) -> dict[str, Any]:
    body = {"model": "claude-sonnet-4-5", "max_tokens": 32000, "messages": USER_HI, "system": system,
            "tools": [BASH_TOOL, READ_TOOL] if tools is None else tools, "stream": True,
            "thinking": {"type": "enabled", "budget_tokens": 31999}, "metadata": {"user_id": "user_abc"}}
    return body | extra


def test_billing_block_of_its_own_is_removed() -> None:
    """The attribution line changes every request: alone in its block, the block goes (prefix cache hits again)."""
    body = claude_code([{"type": "text", "text": BILLING},
                        {"type": "text", "text": AGENT_SDK, "cache_control": CACHE},
                        {"type": "text", "text": CC_PROMPT, "cache_control": CACHE}])
    expected = claude_code([{"type": "text", "text": AGENT_SDK, "cache_control": CACHE},
                            {"type": "text", "text": CC_PROMPT, "cache_control": CACHE}], model="served-model")
    assert shaped("/v1/messages", body) == expected
    assert shaped("/v1/messages/count_tokens", body) == expected


def test_billing_line_before_the_prompt_in_one_block_leaves_the_prompt() -> None:
    """Line, newline, then the real prompt in the same block: only the line and its newline go."""
    body = claude_code([{"type": "text", "text": BILLING + "\n" + AGENT_SDK, "cache_control": CACHE}])
    expected = claude_code([{"type": "text", "text": AGENT_SDK, "cache_control": CACHE}], model="served-model")
    assert shaped("/v1/messages", body) == expected


def test_billing_line_in_a_string_system() -> None:
    body = claude_code(BILLING + "\nBe brief.")
    assert shaped("/v1/messages", body) == claude_code("Be brief.", model="served-model")


def test_billing_mark_not_leading_is_left_alone() -> None:
    """Only the leading attribution line is Claude Code's; the same words inside a prompt are the user's."""
    text = "Explain what x-anthropic-billing-header: cc_version=1; means."
    assert shaped("/v1/messages", claude_code([{"type": "text", "text": text}])) is None
    assert shaped("/v1/messages", claude_code(text)) is None


def test_anthropic_server_tools_are_dropped_client_tools_kept() -> None:
    """web_search_20250305 has no input_schema: no local engine runs it; the client tools stay as sent."""
    custom = {"type": "custom", **BASH_TOOL}
    body = claude_code([{"type": "text", "text": AGENT_SDK}], tools=[custom, WEB_SEARCH_SERVER_TOOL, READ_TOOL])
    expected = claude_code([{"type": "text", "text": AGENT_SDK}], tools=[custom, READ_TOOL], model="served-model")
    assert shaped("/v1/messages", body) == expected
    note = note_of("/v1/messages", body)
    assert note is not None and "web_search_20250305" in note


def test_anthropic_only_server_tools_drops_tools_and_tool_choice() -> None:
    body = claude_code("Be brief.", tools=[WEB_SEARCH_SERVER_TOOL], tool_choice={"type": "auto"})
    expected = {k: v for k, v in claude_code("Be brief.").items() if k != "tools"} | {"model": "served-model"}
    assert shaped("/v1/messages", body) == expected


def test_claude_code_max_tokens_capped_with_the_other_rules() -> None:
    """Claude Code asks 32,000 output tokens; the engine said 3,000 are left: the body says 3,000."""
    body = claude_code([{"type": "text", "text": BILLING}, {"type": "text", "text": AGENT_SDK}])
    expected = claude_code([{"type": "text", "text": AGENT_SDK}], model="served-model", max_tokens=3000)
    assert shaped("/v1/messages", body, cap=3000) == expected


def test_claude_code_body_without_the_line_is_sent_as_is() -> None:
    """CLAUDE_CODE_ATTRIBUTION_HEADER=0: nothing to change, the client's own bytes (model name included)."""
    body = claude_code([{"type": "text", "text": AGENT_SDK}, {"type": "text", "text": CC_PROMPT}])
    assert shaped("/v1/messages", body) is None
    assert shaped("/v1/messages", body, target=SERVED_SYSTEM_FIRST) is None
    assert note_of("/v1/messages", body) is None


# --- Codex: rule 2 (tools), the custom tool as a function, rule 3 (developer items) ---
def codex(tools: list[Any], **extra: Any) -> dict[str, Any]:
    body = {"model": "gpt-5.1-codex", "input": CODEX_INPUT, "tools": tools, "tool_choice": "auto",
            "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False, "stream": True,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "019a-key"}
    return body | extra


def test_codex_tools_for_a_local_engine() -> None:
    """web_search and namespace dropped (named in the log), apply_patch becomes a function of one string."""
    body = codex([EXEC_COMMAND, WEB_SEARCH, NAMESPACE, APPLY_PATCH])
    expected = codex([EXEC_COMMAND, APPLY_PATCH_FUNCTION], model="served-model")
    assert shaped("/v1/responses", body) == expected
    note = note_of("/v1/responses", body)
    assert note is not None and "web_search" in note and "namespace" in note


def test_codex_developer_items_go_into_instructions_where_the_template_wants_it() -> None:
    """Two developer items become one system prompt (Qwen's template takes a single, leading one)."""
    body = codex([EXEC_COMMAND])
    user_items = CODEX_INPUT[2:]
    expected = codex([EXEC_COMMAND], model="served-model", input=user_items, instructions=DEV_1 + "\n\n" + DEV_2)
    assert shaped("/v1/responses", body, target=SERVED_SYSTEM_FIRST) == expected
    assert shaped("/v1/responses", body | {"instructions": "Be brief."}, target=SERVED_SYSTEM_FIRST) == \
        expected | {"instructions": "Be brief.\n\n" + DEV_1 + "\n\n" + DEV_2}


def test_codex_body_needing_nothing_is_sent_as_is() -> None:
    """Function tools only, a template that takes developer messages anywhere: the client's bytes."""
    assert shaped("/v1/responses", codex([EXEC_COMMAND])) is None


def test_codex_only_non_function_tools_drops_tool_choice_and_parallel_calls() -> None:
    body = codex([WEB_SEARCH, NAMESPACE])
    expected = {k: v for k, v in body.items() if k not in ("tools", "tool_choice", "parallel_tool_calls")}
    assert shaped("/v1/responses", body) == expected | {"model": "served-model"}


def test_custom_tool_on_chat_completions_is_dropped_not_mapped() -> None:
    """Chat completions have no custom tools to map: it goes with the other non-functions."""
    chat_fn = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    body = {"model": "m", "messages": USER_HI, "tools": [chat_fn, APPLY_PATCH]}
    assert shaped("/v1/chat/completions", body) == {"model": "served-model", "messages": USER_HI, "tools": [chat_fn]}


# --- chat completions: rule 1, rule 3, rule 5 ---
def test_empty_tools_and_tool_choice_dropped() -> None:
    """vLLM refuses `tools: []`."""
    body = {"model": "qwen", "messages": USER_HI, "tools": [], "tool_choice": "auto", "temperature": 0.2}
    assert shaped("/v1/chat/completions", body) == {"model": "served-model", "messages": USER_HI, "temperature": 0.2}
    assert shaped("/v1/messages", {"model": "c", "max_tokens": 8, "messages": USER_HI, "tools": []}) == \
        {"model": "served-model", "max_tokens": 8, "messages": USER_HI}


MID_SYSTEM = [{"role": "system", "content": "You are terse."},
              {"role": "user", "content": "List the files."},
              {"role": "assistant", "content": "a.py b.py"},
              {"role": "system", "content": [{"type": "text", "text": "Reminder: the plan changed."},
                                             {"type": "text", "text": "Ask before deleting."}]},
              {"role": "user", "content": "Delete b.py"}]


def test_mid_conversation_system_moved_to_the_front_when_the_template_wants() -> None:
    body = {"model": "qwen", "messages": MID_SYSTEM}
    expected_messages = [
        {"role": "system", "content": "You are terse.\n\nReminder: the plan changed.\nAsk before deleting."},
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "a.py b.py"},
        {"role": "user", "content": "Delete b.py"}]
    assert shaped("/v1/chat/completions", body, SERVED_SYSTEM_FIRST) == \
        {"model": "served-model", "messages": expected_messages}
    assert shaped("/v1/chat/completions", body, SERVED) is None


def test_developer_role_becomes_the_leading_system() -> None:
    lone = {"model": "q", "messages": [{"role": "developer", "content": "Be brief."}, *USER_HI]}
    assert shaped("/v1/chat/completions", lone, SERVED_SYSTEM_FIRST) == \
        {"model": "served-model", "messages": [{"role": "system", "content": "Be brief."}, *USER_HI]}
    later = {"model": "q", "messages": [*USER_HI, {"role": "developer", "content": "Use tabs."}]}
    assert shaped("/v1/chat/completions", later, SERVED_SYSTEM_FIRST) == \
        {"model": "served-model", "messages": [{"role": "system", "content": "Use tabs."}, *USER_HI]}
    assert shaped("/v1/chat/completions", later, SERVED) is None


def test_leading_system_alone_is_sent_as_is() -> None:
    body = {"model": "q", "messages": [{"role": "system", "content": "Be brief."}, *USER_HI]}
    assert shaped("/v1/chat/completions", body, SERVED_SYSTEM_FIRST) is None


def test_one_parse_serves_engines_with_different_templates() -> None:
    """A retry on another engine shapes the client's body again: the first engine's shaping must not stick."""
    shape = parse("/v1/chat/completions", json.dumps({"model": "q", "messages": MID_SYSTEM, "tools": []}).encode())
    assert shape is not None
    first = shape.body_for(SERVED_SYSTEM_FIRST)
    assert first is not None and len(json.loads(first)["messages"]) == 4
    second = shape.body_for(Target("other-model"))
    assert second is not None
    assert json.loads(second) == {"model": "other-model", "messages": MID_SYSTEM}


@pytest.mark.parametrize(("path", "body", "expected"), [
    ("/v1/chat/completions", {"model": "q", "messages": USER_HI, "max_completion_tokens": 32000, "max_tokens": 100},
     {"model": "served-model", "messages": USER_HI, "max_completion_tokens": 4000, "max_tokens": 100}),
    ("/v1/chat/completions", {"model": "q", "messages": USER_HI, "max_tokens": 32000},
     {"model": "served-model", "messages": USER_HI, "max_tokens": 4000}),
    ("/v1/responses", {"model": "q", "input": "hi", "max_output_tokens": 32000},
     {"model": "served-model", "input": "hi", "max_output_tokens": 4000}),
])
def test_max_tokens_capped_to_what_the_context_leaves(path: str, body: dict[str, Any],
                                                       expected: dict[str, Any]) -> None:
    assert shaped(path, body, cap=4000) == expected
    assert shaped(path, body) is None  # no cap known: the client's budget stands


def test_max_tokens_over_the_served_context_is_lowered_to_it_before_any_refusal() -> None:
    """No reply is longer than the context served per request (4,096 here): Claude Code's 32,000 goes as 4,096,
    said in the note; an engine's refusal later lowers it to what the context leaves after the prompt."""
    body = {"model": "q", "messages": USER_HI, "max_tokens": 32000}
    served = Target("served-model", context=4096)
    assert shaped("/v1/chat/completions", body, served) == {"model": "served-model", "messages": USER_HI,
                                                            "max_tokens": 4096}
    assert note_of("/v1/chat/completions", body, served) == "max_tokens 32000 -> 4096 (the context served per request)"
    assert shaped("/v1/chat/completions", body, served, cap=1000)["max_tokens"] == 1000
    assert shaped("/v1/chat/completions", {**body, "max_tokens": 4096}, served) is None


def test_max_tokens_under_the_cap_is_sent_as_is() -> None:
    assert shaped("/v1/chat/completions", {"model": "q", "messages": USER_HI, "max_tokens": 512}, cap=4000) is None


# --- parse: what it takes ---
@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", b'{"model": "q", "prompt": "hi", "max_tokens": 8}'),
    ("/v1/embeddings", b'{"model": "q", "input": "hi"}'),
    ("/v1/chat/completions", b"[" * 100_000),  # deeper than json.loads recurses (the scan refuses it first)
])
def test_parse_leaves_other_routes(path: str, body: bytes) -> None:
    assert parse(path, body) is None


@pytest.mark.parametrize(("path", "body", "said"), [
    ("/v1/chat/completions", b'{"model": "q", "messages": [', "not valid JSON: Expecting value: line 1 column 29"),
    ("/v1/messages", b"not json", "not valid JSON: Expecting value: line 1 column 1"),
    ("/v1/responses", b'{"model": "q",}', "not valid JSON: Expecting property name enclosed in double quotes"),
    ("/v1/chat/completions", b'[{"role": "user", "content": "hi"}]', "must be a JSON object, not list"),
    ("/v1/chat/completions", b"null", "must be a JSON object, not null"),
])
def test_parse_refuses_a_body_that_is_no_json_object(path: str, body: bytes, said: str) -> None:
    """Refused by the endpoint (a 400 in the client's error shape: tests/test_agent_clients.py) with json's own account."""
    with pytest.raises(BadBody, match=re.escape(said)):
        parse(path, body)


def test_parse_limit() -> None:
    """Bodies over PARSE_LIMIT (16 MiB: images, mostly) are forwarded untouched; at the limit they are read."""
    head, tail = b'{"model":"q","tools":[],"messages":[],"pad":"', b'"}'
    at_limit = head + b"x" * (16 * 1024 * 1024 - len(head) - len(tail)) + tail
    assert len(at_limit) == normalize.PARSE_LIMIT == 16 * 1024 * 1024
    assert parse("/v1/chat/completions", at_limit) is not None
    assert parse("/v1/chat/completions", at_limit[:-2] + b'x"}') is None


# --- templates ---
@pytest.mark.parametrize(("name", "wants"), [
    ("Qwen3.5-4B.jinja", True),  # "System message must be at the beginning."
    ("google-gemma-2-2b-it.jinja", True),  # "Conversation roles must alternate user/assistant/..."
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", False),  # a system header wherever the message stands
])
def test_template_wants_system_first(name: str, wants: bool) -> None:
    assert template_wants_system_first((TEMPLATES / name).read_text(encoding="utf-8")) is wants


def test_role_alternation_check_alone_wants_system_first() -> None:
    """Gemma 2's alternation check without its 'System role not supported' line (llama.cpp b11434's
    google-gemma-2-2b-it.jinja, cut): the order check by itself refuses a system message in the middle."""
    snippet = ("{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}{% endfor %}")
    assert template_wants_system_first(snippet) is True
    assert template_wants_system_first("") is False  # no template known: leave the order alone


def test_engine_rules_read_window_and_template(tmp_path: Path) -> None:
    """A Hugging Face folder: the window from config.json, the template from chat_template.jinja."""
    qwen, llama = tmp_path / "qwen", tmp_path / "llama"
    for folder, template in ((qwen, "Qwen3.5-4B.jinja"), (llama, "meta-llama-Llama-3.2-3B-Instruct.jinja")):
        folder.mkdir()
        shutil.copy(LLAMA8B / "config.json", folder / "config.json")
        shutil.copy(TEMPLATES / template, folder / "chat_template.jinja")
    assert engine_rules(LaunchPlan(engine="vllm", model_path=qwen)) == (131072, True)
    assert engine_rules(LaunchPlan(engine="vllm", model_path=llama)) == (131072, False)
    assert engine_rules(LaunchPlan(engine="vllm", model_path=tmp_path / "missing")) == (0, False)


# --- refusals.read ---
def vllm_error(message: str, param: str | None = None) -> bytes:
    """vLLM's error JSON (ErrorResponse) around `message`."""
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": param,
                                 "code": 400}}).encode()


# llama-server b11434: server_task_result_error::to_json = format_error_response + n_prompt_tokens, n_ctx
LLAMA_EXCEED = json.dumps({"error": {
    "code": 400, "message": "request (5000 tokens) exceeds the available context size (4096 tokens), try increasing it",
    "type": "exceed_context_size_error", "n_prompt_tokens": 5000, "n_ctx": 4096}}).encode()
VLLM_PROMPT = ("This model's maximum context length is 4096 tokens. However, your prompt contains 5000 input tokens, "
               "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt.")
VLLM_AT_LEAST = VLLM_PROMPT.replace("contains 5000", "contains at least 4097")
VLLM_CHARS = ("This model's maximum context length is 4096 tokens. However, your prompt contains 90000 characters "
              "(more than 16384 characters, which is the upper bound for 4096 input tokens). Please reduce the "
              "length of the input prompt.")
VLLM_INPUT = "Input length (5000) exceeds model's maximum context length (4096)."
VLLM_BUDGET = ("This model's maximum context length is 4096 tokens. However, you requested 36000 tokens (4000 in "
               "the messages, 32000 in the completion). Please reduce the length of the messages or completion.")


@pytest.mark.parametrize(("body", "expected"), [
    (LLAMA_EXCEED, Refusal(prompt=5000, context=4096)),
    (vllm_error(VLLM_PROMPT, "input_tokens"), Refusal(prompt=5000, context=4096)),
    (vllm_error(VLLM_AT_LEAST, "input_tokens"), Refusal(prompt=4097, context=4096, at_least=True)),
    (vllm_error(VLLM_CHARS, "input_text"), Refusal(prompt=4097, context=4096, at_least=True)),
    (vllm_error(VLLM_INPUT), Refusal(prompt=5000, context=4096)),
    (vllm_error(VLLM_BUDGET), Refusal(prompt=4000, context=4096, asked=32000)),
])
def test_read_engine_refusals(body: bytes, expected: Refusal) -> None:
    refusal = refusals.read(400, body)
    assert refusal == expected
    assert refusal is not None and refusal.prompt_fits is (expected.asked is not None)


def test_budget_refusal_with_a_prompt_too_long_is_not_a_retry() -> None:
    """Lowering max_tokens cannot help when the messages alone fill the context."""
    text = VLLM_BUDGET.replace("36000 tokens (4000", "37000 tokens (5000")
    refusal = refusals.read(400, vllm_error(text))
    assert refusal == Refusal(prompt=5000, context=4096)
    assert refusal is not None and not refusal.prompt_fits


@pytest.mark.parametrize(("status", "body"), [
    (200, LLAMA_EXCEED),
    (500, LLAMA_EXCEED),
    (400, json.dumps({"error": {"code": 400, "message": "'type' of tool must be 'function'",
                                "type": "invalid_request_error"}}).encode()),
    (400, vllm_error("[{'type': 'missing', 'loc': ('body', 'messages'), 'msg': 'Field required'}]")),
    (400, b"Bad Request"),
    (400, b'["error"]'),
    (400, LLAMA_EXCEED[:-1] + b" " * (64 * 1024) + b"}"),  # larger than the endpoint holds: passed on as it is
])
def test_read_other_answers(status: int, body: bytes) -> None:
    assert refusals.read(status, body) is None


# --- the endpoint's answer ---
@pytest.mark.parametrize(("prompt", "window", "size"), [
    (5000, 131072, 16384),  # 13192 -> 16384
    (8192, 131072, 16384),  # exactly a power of two
    (8193, 131072, 32768),
    (30000, 32768, 32768),  # 38192 -> 65536, capped at the window
    (5000, 0, 16384),  # window unknown
])
def test_suggested_context(prompt: int, window: int, size: int) -> None:
    assert refusals.suggested_context(prompt, window) == size


def test_context_message_names_the_numbers_and_the_remedy() -> None:
    message = context_message(Refusal(5000, 4096), "qwen3-coder", "llama.cpp", 262144)
    for part in ("5000 tokens", "4096 tokens", "'qwen3-coder'", "262144", "switchyard serve --ctx 16384"):
        assert part in message
    capped = context_message(Refusal(30000, 16384), "qwen3-coder", "vllm", 32768)
    assert "switchyard serve --ctx 32768" in capped and "30000" in capped


def test_context_message_when_the_engine_stopped_counting() -> None:
    message = context_message(Refusal(4097, 4096, at_least=True), "glm", "vllm", 0)
    assert "at least 4097" in message and "switchyard serve --ctx 16384" in message


def test_context_message_when_the_model_window_is_too_small() -> None:
    message = context_message(Refusal(40000, 32768), "gemma", "vllm", 32768)
    assert "40000" in message and "32768" in message and "longer window" in message
    assert "--ctx" not in message


def test_error_body_in_each_clients_shape() -> None:
    text = "the prompt has 5000 tokens"
    anthropic = {"type": "error", "error": {"type": "invalid_request_error", "message": text}}
    assert error_body("/v1/messages", text) == anthropic
    assert error_body("/v1/messages/count_tokens", text) == anthropic
    assert error_body("/v1/chat/completions", text) == {"error": {
        "message": text, "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}
    # Codex 0.171.0 shows its own fixed text for context_length_exceeded: no code, so it prints the message
    assert error_body("/v1/responses", text) == {"error": {
        "message": text, "type": "invalid_request_error", "param": "input", "code": None}}


def sse_data(event: bytes, name: str | None) -> Any:
    """The JSON of one SSE event whose `event:` line is `name` (None: no such line)."""
    head = b"" if name is None else f"event: {name}\n".encode()
    assert event.startswith(head + b"data: ") and event.endswith(b"\n\n")
    return json.loads(event[len(head) + len(b"data: "):])


def test_stream_error_responses_and_chat() -> None:
    text = "the prompt has 5000 tokens"
    failed = sse_data(stream_error("/v1/responses", text), "response.failed")
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"] == text
    assert failed["response"]["error"]["code"] != "context_length_exceeded"  # Codex would hide the message
    assert sse_data(stream_error("/v1/chat/completions", text), None) == {"error": {
        "message": text, "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}


def test_stream_error_messages_is_an_anthropic_error_event() -> None:
    """Anthropic streams an error as `event: error` + `data: {"type": "error", "error": {...}}`."""
    text = "the prompt has 5000 tokens"
    assert sse_data(stream_error("/v1/messages", text), "error") == \
        {"type": "error", "error": {"type": "invalid_request_error", "message": text}}
