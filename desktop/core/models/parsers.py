"""Which tool-call and reasoning parsers a model needs, so that agents keep working whichever engine serves it.

vLLM does not detect a parser (0.32 has no `--tool-call-parser auto`): without `--enable-auto-tool-choice
--tool-call-parser P` every request that carries `tools` is a 400 (it defaults `tool_choice` to "auto"), and
without `--reasoning-parser R` a thinking model's chain of thought lands in `content`. llama-server renders tools
through the model's own Jinja template (on by default) and splits reasoning out with `--reasoning-format`.

The choice is read from what ships with the weights, the same way for a GGUF file and a Hugging Face folder: the
architecture (`general.architecture`, config `model_type`/`architectures`) and markers in the chat template
(`<tool_call>`, `[TOOL_CALLS]`, `<|channel|>` ...). The families and parser names follow vLLM's recipes and docs
(the sources are listed beside each family); every name is one the pinned vLLM registers (checked by the tests
against its registry). An unknown model gets no parser and a note; models.yaml (`tool_parser:`,
`reasoning_parser:`) or `serve --tool-parser/--reasoning-parser` set or switch them off ("none").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from desktop.core.common.errors import SwitchyardError

NONE = "none"  # an explicit "no parser" (a pinned choice, unlike None: "not decided")

# The names vLLM 0.32.0 (the pinned build) registers: vllm/tool_parsers/__init__.py and vllm/reasoning/__init__.py.
VLLM_TOOL_PARSERS = frozenset({
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4",
    "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45", "glm47", "granite",
    "granite-20b-fc", "granite4", "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "internlm", "jamba",
    "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json", "llama4_json", "llama4_pythonic", "longcat",
    "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral", "muse_glimmer", "olmo3", "openai", "phi4_mini_json",
    "plamo3", "poolside_v1", "pythonic", "qwen3_coder", "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5",
    "xlam",
})
VLLM_REASONING_PARSERS = frozenset({
    "cohere_command3", "cohere_command4", "deepseek_r1", "deepseek_v3", "deepseek_v4", "deepseek_v41", "ernie45",
    "gemma4", "glm45", "glm47", "granite", "granite_thinking_parser", "hf", "holo2", "hunyuan_a13b", "hy_v3", "hy_v4",
    "inkling", "k2_horizon", "kimi_k2", "kimi_k3", "ling3", "mimo", "minicpmv", "minimax_m2",
    "minimax_m2_append_think", "minimax_m3", "mistral", "muse_glimmer", "nemotron_v3", "olmo3", "openai_gptoss",
    "plamo3", "poolside_v1", "qwen3", "seed_oss", "step3", "step3p5",
})


@dataclass(frozen=True)
class Family:
    """One model family: how to recognise it and the parsers vLLM's recipes give it."""

    name: str
    tool: str | None
    reasoning: str | None
    arch: tuple[str, ...] = ()  # GGUF general.architecture / HF model_type values (lower case), any of
    markers: tuple[str, ...] = ()  # chat-template substrings, any of
    reasoning_marker: str | None = None  # reasoning only when the template has this (thinking variants)
    source: str = ""


# First match wins: the specific template formats before the generic <tool_call> (Hermes) one. Sources: vLLM's
# recipes (RECIPES/<org>/<model>), its tool-calling (TOOLS) and reasoning-outputs (REASONING) docs.
RECIPES = "https://recipes.vllm.ai"
TOOLS = "https://docs.vllm.ai/en/latest/features/tool_calling/"
REASONING = "https://docs.vllm.ai/en/latest/features/reasoning_outputs/"
FAMILIES: tuple[Family, ...] = (
    Family("gpt-oss", "openai", "openai_gptoss", arch=("gpt-oss", "gpt_oss"), markers=("<|channel|>",),
           source=f"{RECIPES}/openai/gpt-oss-20b"),
    Family("Qwen3.5 / Qwen3.6", "qwen3_coder", "qwen3", arch=("qwen35", "qwen35moe", "qwen3_5", "qwen3_5_moe"),
           reasoning_marker="<think>", source=f"{RECIPES}/Qwen/Qwen3.5-35B-A3B"),
    Family("Qwen3-Coder", "qwen3_coder", None, markers=("<function=",),
           source=f"{RECIPES}/Qwen/Qwen3-Coder-480B-A35B-Instruct"),
    Family("Mistral / Magistral / Devstral", "mistral", "mistral", markers=("[TOOL_CALLS]",),
           reasoning_marker="[THINK]", source=f"{TOOLS}#mistral-models-mistral; {RECIPES}/mistralai/Magistral"),
    Family("Llama 4", "llama4_pythonic", None, arch=("llama4",), markers=("<|header_start|>",),
           source=f"{TOOLS}#llama-models-llama3_json"),
    Family("Llama 3.1 / 3.2 / 3.3", "llama3_json", None, markers=("<|python_tag|>", "Environment: ipython"),
           source=f"{TOOLS}#llama-models-llama3_json"),
    Family("GLM-4.5 / 4.6 / 4.7", "glm45", "glm45", arch=("glm4moe", "glm4_moe"), markers=("<arg_key>",),
           source=f"{RECIPES}/zai-org/GLM-4.5"),
    Family("Kimi K2", "kimi_k2", "kimi_k2", markers=("<|tool_calls_section_begin|>",), reasoning_marker="<think>",
           source=f"{RECIPES}/moonshotai/Kimi-K2-Instruct; {RECIPES}/moonshotai/Kimi-K2-Thinking"),
    Family("MiniMax-M2", "minimax_m2", "minimax_m2", arch=("minimax_m2", "minimax-m2"),
           markers=("<minimax:tool_call>",), source=f"{RECIPES}/MiniMaxAI/MiniMax-M2"),
    Family("Seed-OSS", "seed_oss", "seed_oss", arch=("seed_oss",), markers=("<seed:tool_call>",),
           source=f"{RECIPES}/ByteDance-Seed/Seed-OSS-36B-Instruct"),
    Family("Gemma 4", "gemma4", "gemma4", arch=("gemma4",), source=f"{RECIPES}/Google/gemma-4-26B-A4B-it"),
    Family("ERNIE 4.5", "ernie45", "ernie45", arch=("ernie4_5", "ernie4_5_moe", "ernie4_5-moe"),
           reasoning_marker="<think>", source=f"{REASONING} (ERNIE-4.5-21B-A3B-Thinking)"),
    Family("DeepSeek-V3.2", "deepseek_v32", "deepseek_v3", arch=("deepseek_v32", "deepseek32"),
           source=f"{RECIPES}/deepseek-ai/DeepSeek-V3.2"),
    Family("DeepSeek V3 / R1", "deepseek_v3", "deepseek_r1", arch=("deepseek_v3",),
           markers=("<｜tool▁calls▁begin｜>",), reasoning_marker="<think>",
           source=f"{RECIPES}/deepseek-ai/DeepSeek-R1; {TOOLS}#deepseek-v3-models-deepseek_v3"),
    Family("DeepSeek-R1 distills", None, "deepseek_r1", markers=("<｜Assistant｜>",),
           source=f"{REASONING} (DeepSeek-R1-Distill-Qwen-1.5B)"),
    Family("Granite 4.0", "granite4", None, arch=("granitemoehybrid", "granitehybrid"),
           source=f"{TOOLS}#ibm-granite"),
    Family("Granite 3", "granite", "granite", arch=("granite", "granitemoe"), reasoning_marker="thinking",
           source=f"{TOOLS}#ibm-granite; {REASONING} (Granite 3.2)"),
    # Instruct-2507 ships no <think> in its template: no reasoning parser (qwen3's would take every answer for
    # reasoning, since vLLM's starts in the reasoning state unless enable_thinking is false).
    Family("Qwen3", "hermes", "qwen3", arch=("qwen3", "qwen3moe", "qwen3_moe"), reasoning_marker="<think>",
           source=f"{RECIPES}/Qwen/Qwen3-8B; {RECIPES}/Qwen/Qwen3-235B-A22B-Instruct-2507"),
    Family("Qwen2.5 / QwQ / Hermes 2-3 and other <tool_call> templates", "hermes", "deepseek_r1",
           markers=("<tool_call>",), reasoning_marker="<think>",
           source=f"{TOOLS}#qwen-models; {TOOLS}#nousresearch-hermes-models; {REASONING} (QwQ-32B)"),
)


@dataclass(frozen=True)
class ChatParsers:
    """The parsers a model needs (None: none known), the family that decided it, and a note when unknown."""

    tool: str | None
    reasoning: str | None
    family: str | None = None
    source: str = ""

    @property
    def note(self) -> str | None:
        if self.tool:
            return None
        return ("tools: no tool-call parser is known for this model, so vLLM answers 400 to requests that carry "
                "`tools`; set `tool_parser:` in models.yaml (or --tool-parser) to one of vLLM's parsers")


def choose(arch: str, chat_template: str) -> ChatParsers:
    """The parsers for a model of architecture `arch` (GGUF general.architecture or HF model_type) whose chat
    template is `chat_template` ("" when it ships none)."""
    arch = arch.lower()
    for family in FAMILIES:
        if arch not in family.arch and not any(marker in chat_template for marker in family.markers):
            continue
        reasoning = family.reasoning
        if family.reasoning_marker is not None and family.reasoning_marker not in chat_template:
            reasoning = None
        return ChatParsers(family.tool, reasoning, family.name, family.source)
    return ChatParsers(None, None)


def parsers_for(model_path: Path) -> ChatParsers:
    """The parsers for the model at `model_path` (a GGUF file or a Hugging Face folder), from its own metadata.
    A model whose metadata cannot be read gets none (the fit has already said what is wrong with it)."""
    try:
        arch, template = _identity(Path(model_path))
    except (OSError, ValueError, SwitchyardError):
        return ChatParsers(None, None)
    return choose(arch, template)


def chat_template(model_path: Path) -> str:
    """The chat template the model at `model_path` ships ("" when none, or when its metadata cannot be read)."""
    try:
        return _identity(Path(model_path))[1]
    except (OSError, ValueError, SwitchyardError):
        return ""


def _identity(path: Path) -> tuple[str, str]:
    """(architecture, chat template) of a GGUF file or a Hugging Face folder."""
    if path.is_file():
        from desktop.core.models.gguf_file import read_gguf_header

        meta = read_gguf_header(path).metadata
        return str(meta.get("general.architecture", "")), str(meta.get("tokenizer.chat_template") or "")
    config = _json(path / "config.json")
    arch = str(config.get("model_type") or "")
    text = config.get("text_config")
    if isinstance(text, dict) and text.get("model_type"):
        arch = str(text["model_type"])
    return arch, _hf_template(path)


def _hf_template(folder: Path) -> str:
    """The chat template a Hugging Face folder ships: chat_template.jinja, chat_template.json or the one in
    tokenizer_config.json (a list of named templates is joined: any of them may carry the markers)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8", errors="replace")
    for name in ("chat_template.json", "tokenizer_config.json"):
        template = _json(folder / name).get("chat_template")
        if isinstance(template, str):
            return template
        if isinstance(template, list):
            return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return ""


def _json(path: Path) -> dict[str, object]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def check_parser(kind: str, name: str) -> str:
    """`name` as a plan holds it ("none", or a name the pinned vLLM registers for `kind`: "tool" or
    "reasoning"), or a SwitchyardError naming the choices."""
    known = VLLM_TOOL_PARSERS if kind == "tool" else VLLM_REASONING_PARSERS
    value = str(name).strip().lower()
    if value == NONE or value in known:
        return value
    raise SwitchyardError(f"unknown {kind} parser {str(name)[:64]!r}",
                          f"use 'none' or one of the pinned vLLM's: {', '.join(sorted(known))}")
