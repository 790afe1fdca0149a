"""Tool-call and reasoning parsers on launch plans (issue 34, item 1): chosen from the model's own metadata, named
as the pinned vLLM registers them, on the plan's argv for both engines, overridable per model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import installed_vllm_package

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines import get_adapter
from desktop.core.engines.base import EngineInstall, LaunchPlan
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.models import demo
from desktop.core.models.parsers import (
    FAMILIES,
    VLLM_REASONING_PARSERS,
    VLLM_TOOL_PARSERS,
    check_parser,
    choose,
    parsers_for,
)
from desktop.core.planning.export.plan import ExportPlan
from desktop.core.planning.planner import plan_launch, replan
from desktop.core.serving.fleet import parse_models_config

SNAPSHOTS = Path(__file__).parent / "snapshots"

# Chat-template fragments as the real models ship them (enough of each to carry its markers).
QWEN3_HYBRID = "{%- if tools %}<tools>{% endif %}<tool_call>\n{{ tool_call | tojson }}\n</tool_call>" \
               "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>{% endif %}"
QWEN3_INSTRUCT_2507 = "{%- if tools %}<tools>{% endif %}<tool_call>\n{{ tool_call | tojson }}\n</tool_call>"
QWEN3_CODER = "<tool_call>\n<function={{ tool_call.name }}>\n<parameter={{ name }}>"
QWQ = "<tool_call>{{ tool_call | tojson }}</tool_call>{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
GPT_OSS = "<|start|>assistant<|channel|>analysis<|message|>"
LLAMA31 = "Given the following functions, please respond with a JSON for a function call with its proper arguments"
MISTRAL = "[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]"
MAGISTRAL = MISTRAL + "[THINK]"
R1_DISTILL = "{{ '<｜User｜>' + content }}{{ '<｜Assistant｜><think>\\n' }}"
R1 = R1_DISTILL + "{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' }}"


@pytest.mark.parametrize("arch, template, tool, reasoning", [
    ("qwen3", QWEN3_HYBRID, "hermes", "qwen3"),
    ("qwen3moe", QWEN3_INSTRUCT_2507, "hermes", None),  # qwen3's parser would take every answer for reasoning
    ("qwen3_moe", QWEN3_CODER, "qwen3_coder", None),
    ("qwen2", QWQ, "hermes", "deepseek_r1"),
    ("qwen2", QWEN3_INSTRUCT_2507, "hermes", None),  # Qwen2.5
    ("gpt-oss", "", "openai", "openai_gptoss"),  # GGUF architecture alone
    ("gpt_oss", GPT_OSS, "openai", "openai_gptoss"),
    ("llama", LLAMA31, "llama3_json", None),
    ("llama", MISTRAL, "mistral", None),
    ("mistral3", MAGISTRAL, "mistral", "mistral"),
    ("qwen2", R1_DISTILL, None, "deepseek_r1"),
    ("qwen2", R1, None, "deepseek_r1"),  # a distill's template carries R1's tool markers: still no tool parser
    ("deepseek2", R1, "deepseek_v3", "deepseek_r1"),  # the full R1 (GGUF architecture of DeepSeek V2/V3/R1)
    ("deepseek_v3", R1, "deepseek_v3", "deepseek_r1"),
    ("glm4moe", "", "glm45", "glm45"),
    ("llama", demo.CHAT_TEMPLATE, "hermes", None),
])
def test_families_get_the_parsers_of_vllms_recipes(arch: str, template: str, tool: str | None,
                                                    reasoning: str | None) -> None:
    chosen = choose(arch, template)
    assert (chosen.tool, chosen.reasoning) == (tool, reasoning), chosen.family


# Families llama.cpp ships no template of (tests/test_parser_tables.py covers those it does): recognised by their
# architecture, or by the marker their vLLM parser reads (vllm/tool_parsers/*, vllm/parser/*).
@pytest.mark.parametrize("arch, template, tool, reasoning", [
    ("jamba", "", "jamba", None),
    ("internlm2", "", "internlm", None),
    ("llama", "<|action_start|><|plugin|>\n{{ call | tojson }}<|action_end|>", "internlm", None),
    ("hunyuan-moe", "", "hunyuan_a13b", "hunyuan_a13b"),
    ("olmo3", "<function_calls>{{ calls }}</function_calls>", "olmo3", None),
    ("olmo3", "<function_calls>{{ calls }}</function_calls><think>", "olmo3", "olmo3"),
    ("longcat_flash", "", "longcat", None),
    ("phi3", "<|system|>{{ system }}<|tool|>{{ tools }}<|/tool|><|end|>", "phi4_mini_json", None),
    ("phi3", "<|system|>{{ system }}<|end|>", None, None),  # Phi-3.5: no tools
    ("gemma3", "<start_function_call>call:{{ name }}{<end_function_call>", "functiongemma", None),
    ("dots1", "<dots_function_call>", "dots", None),
    ("gpt_bigcode", "<function_call> {{ call | tojson }}", "granite-20b-fc", None),
    ("llama", "<ifm|tool_calls>", "k2_horizon", "k2_horizon"),
    ("llama", "<|content_invoke_tool_json|>", "inkling", "inkling"),
    ("plamo3", "", "plamo3", "plamo3"),
    ("step3_vl", "", "step3", "step3"),
    ("mimo_v2", "", "mimo", "mimo"),
    ("ernie4_5_moe", "<think>", "ernie45", "ernie45"),
    ("llama4", "", "llama4_pythonic", None),
    ("granite", "<|start_of_role|>available_tools<|end_of_role|><|tool_call|>", "granite", None),
    ("granite", "<|start_of_role|>... Here is my thought process: ... <|tool_call|>", "granite", "granite"),
    ("granite", "<|start_of_role|><tool_call>\n<function=x>\n<parameter=y><think>", "qwen3_coder",
     "granite_thinking_parser"),
])
def test_families_without_a_llama_cpp_template_are_recognised(arch: str, template: str, tool: str | None,
                                                              reasoning: str | None) -> None:
    chosen = choose(arch, template)
    assert (chosen.tool, chosen.reasoning) == (tool, reasoning), chosen.family


def test_a_family_without_a_tool_parser_says_why_in_the_note() -> None:
    distill = choose("qwen2", R1)
    assert distill.note is not None and "R1 series without tool calling" in distill.note
    assert "cohere_melody" in (choose("cohere2", "<|START_ACTION|>").note or "")


def test_an_unknown_model_gets_no_parser_and_a_note_naming_the_override() -> None:
    chosen = choose("llama", "{{ messages[0]['content'] }}")
    assert (chosen.tool, chosen.reasoning, chosen.family) == (None, None, None)
    assert chosen.note is not None and "tool_parser:" in chosen.note and "400" in chosen.note
    assert choose("qwen3", QWEN3_HYBRID).note is None


def test_every_name_in_the_table_is_one_the_pinned_vllm_registers() -> None:
    for family in FAMILIES:
        assert family.tool is None or family.tool in VLLM_TOOL_PARSERS, family.name
        assert family.reasoning is None or family.reasoning in VLLM_REASONING_PARSERS, family.name
        assert family.source.startswith("https://"), family.name


def test_the_name_lists_are_the_installed_vllms_registries() -> None:
    """Read from the pinned vLLM's own registries (vllm/tool_parsers, vllm/reasoning), not from memory: a vLLM
    upgrade that renames a parser fails here."""
    package = installed_vllm_package()
    if package is None:
        pytest.skip("vLLM is not installed here (`switchyard engines install vllm`)")
    registered = re.compile(r'^\s+"([\w.\-]+)": \(', re.M)
    tools = set(registered.findall((package / "tool_parsers" / "__init__.py").read_text()))
    reasoning = set(registered.findall((package / "reasoning" / "__init__.py").read_text()))
    assert tools == VLLM_TOOL_PARSERS
    assert reasoning == VLLM_REASONING_PARSERS


def test_check_parser_names_the_choices() -> None:
    assert check_parser("tool", " Hermes ") == "hermes"
    assert check_parser("reasoning", "none") == "none"
    with pytest.raises(SwitchyardError) as refused:
        check_parser("tool", "qwen3")  # the pinned vLLM has qwen3_coder/qwen3_json/qwen3_xml, no plain qwen3
    assert "qwen3_coder" in (refused.value.hint or "") and "'none'" in (refused.value.hint or "")


def _gguf(path: Path, arch: str, template: str) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_chat_template(template)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_parsers_are_read_from_a_gguf_and_from_each_place_a_folder_keeps_its_template(tmp_path: Path) -> None:
    assert parsers_for(_gguf(tmp_path / "q.gguf", "qwen3", QWEN3_HYBRID)).reasoning == "qwen3"
    jinja = tmp_path / "jinja"
    jinja.mkdir()
    (jinja / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    (jinja / "chat_template.jinja").write_text(QWEN3_CODER)
    assert parsers_for(jinja).tool == "qwen3_coder"
    named = tmp_path / "named"
    named.mkdir()
    (named / "config.json").write_text(json.dumps({"model_type": "mistral3", "text_config": {"model_type": "x"}}))
    (named / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": MAGISTRAL}]}))
    assert (parsers_for(named).tool, parsers_for(named).reasoning) == ("mistral", "mistral")
    assert parsers_for(tmp_path / "missing").tool is None  # unreadable: no parser (the fit reports the model)
    (tmp_path / "broken.gguf").write_bytes(b"GGUF\x03")
    assert parsers_for(tmp_path / "broken.gguf").tool is None


@pytest.fixture(scope="module")
def laptop() -> HardwareSnapshot:
    return HardwareSnapshot.load(SNAPSHOTS / "cpu_laptop.json")


def _argv(plan: LaunchPlan) -> list[str]:
    executable = Path("/opt/engine/bin/python" if plan.engine == "vllm" else "/opt/engine/llama-server")
    return get_adapter(plan.engine).build_command(plan, EngineInstall(plan.engine, "x", "path", executable)).argv


def _after(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_the_demo_plan_gets_hermes_on_vllm_and_nothing_llama_cpp_lacks(laptop: HardwareSnapshot) -> None:
    vllm = plan_launch("vllm", "demo", laptop).plan
    assert vllm.tool_parser == "hermes"
    argv = _argv(vllm)
    assert "--enable-auto-tool-choice" in argv and _after(argv, "--tool-call-parser") == "hermes"
    assert "--reasoning-parser" not in argv
    llama = plan_launch("llama.cpp", "demo", laptop).plan
    assert llama.tool_parser == "hermes" and "--reasoning-format" not in _argv(llama)


def test_a_reasoning_model_gets_the_reasoning_flags_of_both_engines(tmp_path: Path,
                                                                   laptop: HardwareSnapshot) -> None:
    qwq = LaunchPlan(engine="llama.cpp", model_path=tmp_path / "m.gguf", tool_parser="hermes",
                     reasoning_parser="deepseek_r1")
    assert _after(_argv(qwq), "--reasoning-format") == "deepseek"
    argv = _argv(LaunchPlan(engine="vllm", model_path=tmp_path, tool_parser="none", reasoning_parser="qwen3"))
    assert _after(argv, "--reasoning-parser") == "qwen3"
    assert "--enable-auto-tool-choice" not in argv and "--tool-call-parser" not in argv


def test_asked_parsers_win_and_survive_a_switch_and_the_export(laptop: HardwareSnapshot) -> None:
    checked = plan_launch("llama.cpp", "demo", laptop, {"tool_parser": "none", "reasoning_parser": "deepseek_r1"})
    assert (checked.plan.tool_parser, checked.plan.reasoning_parser) == ("none", "deepseek_r1")
    assert not any("tool-call parser" in note for note in checked.fit.notes)  # asked for: no note
    switched = replan(checked.plan, laptop, engine="vllm").plan
    argv = _argv(switched)
    assert "--tool-call-parser" not in argv and _after(argv, "--reasoning-parser") == "deepseek_r1"
    exported = ExportPlan.from_launch_plan(plan_launch("vllm", "demo", laptop).plan)
    assert _after(list(exported.extra_args), "--tool-call-parser") == "hermes"
    with pytest.raises(SwitchyardError, match="unknown tool parser"):
        plan_launch("vllm", "demo", laptop, {"tool_parser": "hermes2"})


def test_an_unknown_model_plan_says_how_to_set_a_parser(tmp_path: Path, laptop: HardwareSnapshot) -> None:
    folder = tmp_path / "plain"
    demo_hf = demo.ensure_demo_model().hf_dir
    folder.mkdir()
    for item in demo_hf.iterdir():
        (folder / item.name).symlink_to(item)
    (folder / "tokenizer_config.json").unlink()
    config = json.loads((demo_hf / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    checked = plan_launch("vllm", str(folder), laptop)
    assert checked.plan.tool_parser is None and "--tool-call-parser" not in _argv(checked.plan)
    assert any("tool_parser:" in note for note in checked.fit.notes), checked.fit.notes


def test_models_yaml_sets_or_refuses_parsers_per_entry() -> None:
    config = parse_models_config({"models": [
        {"name": "chat", "engine": "vllm", "model": "demo", "tool_parser": "none"},
        {"name": "think", "engine": "vllm", "model": "demo", "reasoning_parser": "deepseek_r1"},
    ]})
    chat, think = config.models
    assert chat.asks()["tool_parser"] == "none" and "reasoning_parser" not in chat.asks()
    assert think.asks()["reasoning_parser"] == "deepseek_r1" and "tool_parser" not in think.asks()
    with pytest.raises(SwitchyardError, match=r"models\[0\] \('chat'\): tool_parser: unknown tool parser"):
        parse_models_config({"models": [{"name": "chat", "engine": "vllm", "model": "demo", "tool_parser": "qwen"}]})
