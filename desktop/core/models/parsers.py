"""Which tool-call and reasoning parsers a model needs, so that agents keep working whichever engine serves it.

vLLM does not detect a parser (0.32 has no `--tool-call-parser auto`): without `--enable-auto-tool-choice
--tool-call-parser P` every request that carries `tools` is a 400 (it defaults `tool_choice` to "auto"), and
without `--reasoning-parser R` a thinking model's chain of thought lands in `content`. llama-server renders tools
through the model's own Jinja template (on by default) and splits reasoning out with `--reasoning-format`.

The choice is read from what ships with the weights, the same way for a GGUF file and a Hugging Face folder: the
architecture (`general.architecture`, config `model_type`/`architectures`) and markers in the chat template
(`<tool_call>`, `[TOOL_CALLS]`, `<|channel|>` ...): the family table is `parser_families`. The families and parser
names follow vLLM's recipes, docs and parser sources (listed beside each family); every name is one the pinned vLLM
registers (checked by the tests against its registry). A model with no parser gets a note saying why; models.yaml
(`tool_parser:`, `reasoning_parser:`) or `serve --tool-parser/--reasoning-parser` set or switch them off ("none").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from desktop.core.common.errors import SwitchyardError
from desktop.core.models.parser_families import FAMILIES, Family

__all__ = ["FAMILIES", "NONE", "VLLM_REASONING_PARSERS", "VLLM_TOOL_PARSERS", "ChatParsers", "Family", "chat_template",
           "check_parser", "choose", "parsers_for"]

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
class ChatParsers:
    """The parsers a model needs (None: none known), the family that decided it, and a note when unknown."""

    tool: str | None
    reasoning: str | None
    family: str | None = None
    source: str = ""
    reason: str = ""  # the family's reason for having no tool parser

    @property
    def note(self) -> str | None:
        if self.tool:
            return None
        why = self.reason or "no tool-call parser is known for this model"
        return (f"tools: {why}, so vLLM answers 400 to requests that carry `tools`; set `tool_parser:` in "
                "models.yaml (or --tool-parser) to one of vLLM's parsers")


def choose(arch: str, chat_template: str) -> ChatParsers:
    """The parsers for a model of architecture `arch` (GGUF general.architecture or HF model_type) whose chat
    template is `chat_template` ("" when it ships none). The first family of `FAMILIES` that matches decides."""
    arch = arch.lower()
    # Templates write a newline inside a Jinja string as the two characters \n: markers are matched on newlines.
    template = chat_template.replace("\\n", "\n")
    for family in FAMILIES:
        if not family.matches(arch, template):
            continue
        reasoning = family.reasoning
        if family.reasoning_marker is not None and family.reasoning_marker not in template:
            reasoning = None
        return ChatParsers(family.tool, reasoning, family.name, family.source, family.reason)
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
