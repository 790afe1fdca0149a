"""The model families vLLM has tool-call and reasoning parsers for, and how each is recognised.

A family is recognised by its architecture (GGUF `general.architecture`, HF `model_type`) or by markers in its chat
template, which writes out the very format the model answers in (`<tool_call>`, `[TOOL_CALLS]`, `<｜DSML｜`...): a
parser is right for a template only when the template emits the markers that parser reads (checked against vLLM's
parser sources, linked beside each family). The order matters: first match wins, so specific formats come before
the generic Hermes `<tool_call>` one, and a family that shares markers with another (R1 distills and DeepSeek V3,
Harmony on gpt-oss and elsewhere) comes where the difference is decided. A family with no tool parser says why:
that reason is the note the plan shows. tests/test_parser_tables.py pins the choice for every template llama.cpp
ships and a row for every parser the pinned vLLM registers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One model family: how to recognise it and the parsers vLLM gives it (None: none, for `reason`)."""

    name: str
    tool: str | None
    reasoning: str | None
    arch: tuple[str, ...] = ()  # GGUF general.architecture / HF model_type values (lower case), any of
    markers: tuple[str, ...] = ()  # chat-template substrings, any of
    requires: tuple[str, ...] = ()  # chat-template substrings that must all be there too (with arch or markers)
    reasoning_marker: str | None = None  # reasoning only when the template has this (thinking variants)
    source: str = ""
    reason: str = ""  # why there is no tool parser (or why this one), for the plan's note

    def matches(self, arch: str, template: str) -> bool:
        """Whether a model of `arch` whose (normalised) chat template is `template` is one of this family."""
        found = arch in self.arch or any(marker in template for marker in self.markers)
        return found and all(marker in template for marker in self.requires)


# Sources: vLLM's recipes (RECIPES/<org>/<model>), its tool-calling (TOOLS) and reasoning-outputs (REASONING) docs,
# and the pinned vLLM's parser sources (SRC/<path>), which name the markers each parser reads.
RECIPES = "https://recipes.vllm.ai"
TOOLS = "https://docs.vllm.ai/en/latest/features/tool_calling/"
REASONING = "https://docs.vllm.ai/en/latest/features/reasoning_outputs/"
SRC = "https://github.com/vllm-project/vllm/blob/v0.32.0/vllm"
MELODY = ("vLLM's Cohere parsers import cohere_melody, which the pinned vLLM does not install, so naming one stops "
          "vLLM at start-up; install cohere-melody into the engine and set tool_parser/reasoning_parser: ")
THINK = "<think>"

FAMILIES: tuple[Family, ...] = (
    # Harmony: vLLM parses it only for model_type gpt_oss (serving: is_harmony); elsewhere `openai` is a stub.
    Family("gpt-oss", "openai", "openai_gptoss", arch=("gpt-oss", "gpt_oss"), source=f"{RECIPES}/openai/gpt-oss-20b"),
    Family("Harmony format on another architecture (llm-jp-4)", None, None, markers=("<|channel|>",),
           source=f"{SRC}/tool_parsers/gptoss_tool_parser.py",
           reason="vLLM reads the Harmony format only for gpt-oss models (its `openai` tool parser is a stub "
                  "elsewhere)"),
    Family("Cohere Command A+ (cmd4)", None, None, markers=("<|START_TEXT|>",), requires=("<|START_ACTION|>",),
           source=f"{SRC}/parser/cohere_command.py", reason=MELODY + "cohere_command4"),
    Family("Cohere Command A / R7B (cmd3)", None, None, markers=("<|START_ACTION|>",),
           source=f"{SRC}/parser/cohere_command.py", reason=MELODY + "cohere_command3"),
    Family("Cohere Command R / R+", None, None, markers=("<|CHATBOT_TOKEN|>",), source=f"{TOOLS}",
           reason="Command R/R+ write `Action: ```json [...]```, which no parser of the pinned vLLM reads"),
    Family("Apertus", "apertus", None, markers=("<|tools_prefix|>",), source=f"{TOOLS}#apertus-models-apertus"),
    Family("GigaChat 3", "gigachat3", None, markers=("<|role_sep|>",), source=f"{TOOLS}#gigachat-3-models-gigachat3"),
    Family("Kimi K3", "kimi_k3", "kimi_k3", markers=("<|open|>",), requires=("<|sep|>",),
           source=f"{SRC}/tool_parsers/kimi_k3_tool_parser.py"),
    Family("Kimi K2", "kimi_k2", "kimi_k2", markers=("<|tool_calls_section_begin|>",), reasoning_marker=THINK,
           source=f"{RECIPES}/moonshotai/Kimi-K2-Instruct; {RECIPES}/moonshotai/Kimi-K2-Thinking"),
    Family("MiniMax-M3", "minimax_m3", "minimax_m3", markers=("]<]minimax[>[",),
           source=f"{SRC}/parser/minimax_m3.py"),
    Family("MiniMax-M2", "minimax_m2", "minimax_m2", arch=("minimax_m2", "minimax-m2"),
           markers=("<minimax:tool_call>",), source=f"{RECIPES}/MiniMaxAI/MiniMax-M2"),
    Family("Seed-OSS", "seed_oss", "seed_oss", arch=("seed_oss",), markers=("<seed:tool_call>",),
           source=f"{RECIPES}/ByteDance-Seed/Seed-OSS-36B-Instruct"),
    Family("Muse Glimmer", "muse_glimmer", "muse_glimmer", markers=("<atem:function_calls>",),
           source=f"{SRC}/tool_parsers/muse_glimmer_tool_parser.py"),
    Family("Hy3", "hy_v3", "hy_v3", markers=("<｜hy_Assistant",), requires=("<tool_sep",),
           source=f"{SRC}/tool_parsers/hy_v3_tool_parser.py"),
    Family("Gemma 4", "gemma4", "gemma4", arch=("gemma4",), markers=("<|tool_call>",),
           source=f"{RECIPES}/Google/gemma-4-26B-A4B-it"),
    Family("FunctionGemma", "functiongemma", None, markers=("<start_function_call>",),
           source=f"{TOOLS}#functiongemma-models-functiongemma"),
    # DeepSeek: the DSML formats, then V3.1, then V3/R1 by architecture, then R1 distills (whose templates carry
    # V3's tool markers but whose tokenizers lack V3's tool tokens, and which do not call tools).
    Family("DeepSeek-V3.2", "deepseek_v32", "deepseek_v3", arch=("deepseek_v32", "deepseek32"), markers=("｜DSML｜",),
           requires=("function_calls>",), source=f"{RECIPES}/deepseek-ai/DeepSeek-V3.2"),
    Family("DeepSeek V4", "deepseek_v4", "deepseek_v4", arch=("deepseek_v4",), markers=("｜DSML｜",),
           requires=("tool_calls>",), source=f"{SRC}/parser/deepseek_v4.py"),
    Family("DeepSeek-V3.1", "deepseek_v31", "deepseek_v3", markers=("<｜tool▁sep｜>",), requires=("<think></think>",),
           source=f"{TOOLS}#deepseek-v31-models-deepseek_v31; {REASONING} (DeepSeek-V3.1)"),
    Family("DeepSeek V3 / R1", "deepseek_v3", "deepseek_r1", arch=("deepseek2", "deepseek_v3"),
           requires=("<｜tool▁calls▁begin｜>",), reasoning_marker=THINK,
           source=f"{RECIPES}/deepseek-ai/DeepSeek-R1; {TOOLS}#deepseek-v3-models-deepseek_v3"),
    Family("DeepSeek-R1 distills", None, "deepseek_r1", markers=("<｜Assistant｜>",), requires=(THINK,),
           source=f"{REASONING} (DeepSeek R1 series: deepseek_r1, tool calling ❌)",
           reason="vLLM's reasoning docs list the DeepSeek R1 series without tool calling (the V3 tool markers "
                  "in a distill's template are copied from R1's)"),
    # Qwen3 XML tool calls (<tool_call><function=...><parameter=...>): the families that share it first.
    Family("MiMo-V2", "mimo", "mimo", arch=("mimo_v2", "mimo_v2_flash"), source=f"{SRC}/parser/mimo.py"),
    Family("Nemotron 3", "qwen3_coder", "nemotron_v3", arch=("nemotron_h", "nemotron_h_moe"),
           markers=("<|im_start|>assistant\n<think></think>",), requires=("<function=",),
           source=f"{SRC}/parser/nemotron_v3.py"),
    Family("Step 3.5", "step3p5", "step3p5", arch=("step3p5",), markers=("<|im_start|>tool_response",),
           requires=("<function=",), source=f"{SRC}/parser/step3p5.py"),
    Family("Granite 4.2 (thinking)", "qwen3_coder", "granite_thinking_parser", markers=("<|start_of_role|>",),
           requires=("<tool_call>\n<function=",), reasoning_marker=THINK, source=f"{SRC}/parser/granite_thinking.py"),
    Family("Qwen3.5 / Qwen3.6 / Qwen3-Coder", "qwen3_coder", "qwen3", arch=("qwen35", "qwen35moe", "qwen3_5",
           "qwen3_5_moe"), markers=("<tool_call>\n<function=",), reasoning_marker=THINK,
           source=f"{RECIPES}/Qwen/Qwen3.5-35B-A3B; {RECIPES}/Qwen/Qwen3-Coder-480B-A35B-Instruct"),
    Family("MiniCPM5", "minicpm5", None, markers=('<function name="',),
           source=f"{SRC}/tool_parsers/minicpm5xml_tool_parser.py"),
    Family("Functionary v3.1", None, None, markers=("start_tag => `<function`",), source=f"{TOOLS}",
           reason="Functionary writes `<function=NAME>{...}</function>`, which no parser of the pinned vLLM reads"),
    Family("Functionary v3.2", None, None, markers=(">>>all",), source=f"{TOOLS}",
           reason="Functionary writes `>>>NAME` then the arguments, which no parser of the pinned vLLM reads"),
    Family("Mistral / Magistral / Devstral", "mistral", "mistral", markers=("[TOOL_CALLS]",),
           reasoning_marker="[THINK]", source=f"{TOOLS}#mistral-models-mistral; {RECIPES}/mistralai/Magistral"),
    Family("Llama 4", "llama4_pythonic", None, arch=("llama4",), markers=("<|header_start|>",),
           source=f"{TOOLS}#llama-models-llama3_json"),
    Family("Llama 3.1 / 3.2 / 3.3", "llama3_json", None, markers=("respond with a JSON for a function call",),
           source=f"{TOOLS}#llama-models-llama3_json"),
    Family("Phi-4-mini / FireFunction v2 (functools[...])", "phi4_mini_json", None, markers=("functools[", "<|/tool|>"),
           source=f"{SRC}/tool_parsers/phi4mini_tool_parser.py"),
    # GLM's XML (<tool_call>NAME<arg_key>...): Poolside and Ling first, which write the same and have their own.
    Family("Poolside Laguna", "poolside_v1", "poolside_v1", arch=("laguna",), markers=("〈|EOS|〉",),
           reasoning_marker=THINK, source=f"{SRC}/tool_parsers/poolside_v1_tool_parser.py"),
    Family("Ling 3", "ling3", "ling3", markers=("<role>ASSISTANT</role>",), requires=("<arg_key>",),
           source=f"{SRC}/parser/ling3.py"),
    Family("GLM-4.7", "glm47", "glm47", markers=("clear_thinking",), requires=("<arg_key>",),
           source=f"{TOOLS}#glm-47-models-glm47"),
    Family("GLM-4.5 / 4.6 and GLM-format templates", "glm45", "glm45", arch=("glm4moe", "glm4_moe"),
           markers=("<arg_key>",), source=f"{RECIPES}/zai-org/GLM-4.5"),
    Family("LFM2 / LFM2.5", "lfm2", None, arch=("lfm2", "lfm2moe"), markers=("List of tools: ",),
           source=f"{SRC}/tool_parsers/lfm2_tool_parser.py"),
    Family("ERNIE 4.5", "ernie45", "ernie45", arch=("ernie4_5", "ernie4_5_moe", "ernie4_5-moe"),
           reasoning_marker=THINK, source=f"{REASONING} (ERNIE-4.5-21B-A3B-Thinking)"),
    Family("Hunyuan-A13B", "hunyuan_a13b", "hunyuan_a13b", arch=("hunyuan-moe", "hunyuan_v1_moe"),
           source=f"{TOOLS}#hunyuan-models-hunyuan_a13b"),
    Family("InternLM 2 / 2.5", "internlm", None, arch=("internlm2",), markers=("<|plugin|>",),
           source=f"{TOOLS}#internlm-models-internlm"),
    Family("Jamba 1.5", "jamba", None, arch=("jamba",), source=f"{TOOLS}#jamba-models-jamba"),
    Family("OLMo 3", "olmo3", "olmo3", arch=("olmo3",), markers=("<function_calls>",), reasoning_marker=THINK,
           source=f"{TOOLS}#olmo-3-models-olmo3"),
    Family("LongCat-Flash", "longcat", None, arch=("longcat_flash",), markers=("<longcat_tool_call>",),
           source=f"{TOOLS}#longcat-flash-chat-models-longcat"),
    Family("Step3", "step3", "step3", arch=("step3_vl", "step3_text"), markers=("<｜tool_calls_begin｜>",),
           source=f"{SRC}/tool_parsers/step3_tool_parser.py"),
    Family("dots.llm", "dots", None, markers=("<dots_function_call>",), source=f"{SRC}/tool_parsers/dots_tool_parser.py"),
    Family("Granite 20B FunctionCalling", "granite-20b-fc", None, markers=("<function_call>",),
           source=f"{TOOLS}#ibm-granite"),
    Family("K2 Horizon", "k2_horizon", "k2_horizon", markers=("<ifm|tool_calls>",),
           source=f"{SRC}/tool_parsers/k2_horizon_tool_parser.py"),
    Family("Inkling", "inkling", "inkling", markers=("<|content_invoke_tool_json|>",), source=f"{SRC}/parser/inkling.py"),
    Family("PLaMo 3", "plamo3", "plamo3", arch=("plamo3",), markers=("<|plamo:begin_tool_requests:plamo|>",),
           source=f"{SRC}/parser/plamo3.py"),
    # Granite: 4.x writes <tool_call>{json} under <|start_of_role|>; 3.x <|tool_call|>[json] (3.2's reasoning is
    # "Here is my thought process:", which 3.3's <think>/<response> is not).
    Family("Granite 4.0 / 4.1", "granite4", None, arch=("granitemoehybrid", "granitehybrid"),
           markers=("<|start_of_role|>",), requires=("<tool_call>",), source=f"{TOOLS}#ibm-granite"),
    Family("Granite 3", "granite", "granite", arch=("granite", "granitemoe"), markers=("<|tool_call|>",),
           reasoning_marker="my thought process", source=f"{TOOLS}#ibm-granite; {REASONING} (Granite 3.2)"),
    # Hermes JSON in <tool_call>: Qwen3's hybrid template (thinking unless enable_thinking is false) first.
    # Instruct-2507 ships no <think> in its template: no reasoning parser (qwen3's would take every answer for
    # reasoning, since vLLM's starts in the reasoning state unless enable_thinking is false).
    Family("Qwen3", "hermes", "qwen3", arch=("qwen3", "qwen3moe", "qwen3_moe"), markers=("enable_thinking is false",),
           requires=("<tool_call>",), reasoning_marker=THINK,
           source=f"{RECIPES}/Qwen/Qwen3-8B; {RECIPES}/Qwen/Qwen3-235B-A22B-Instruct-2507"),
    Family("SmolLM3", None, "qwen3", arch=("smollm3",), markers=("named SmolLM",), reasoning_marker=THINK,
           source=f"{SRC}/parser/qwen3.py",
           reason="this SmolLM3 template renders no tools, so the model is never shown a tool-call format"),
    # Apriel's prose names <tool_call> but it answers <tool_calls>[...]: not Hermes.
    Family("Apriel", None, None, markers=("]</tool_calls>",), source=f"{SRC}/tool_parsers/jamba_tool_parser.py",
           reason="Apriel answers `<tool_calls>[...]</tool_calls>`, for which the pinned vLLM has only Jamba's "
                  "parser (it needs `<tool_calls>` as one token of the vocabulary)"),
    # Reasoning only where the generation prompt always opens <think> (QwQ): deepseek_r1 takes an answer without
    # </think> for reasoning, which is wrong where thinking is opt-in (Bielik, Reka: enable_thinking).
    Family("Qwen2.5 / QwQ / Hermes 2-3 and other <tool_call> templates", "hermes", "deepseek_r1",
           markers=("<tool_call>",), reasoning_marker="<|im_start|>assistant\n<think>\n",
           source=f"{TOOLS}#qwen-models; {TOOLS}#nousresearch-hermes-models; {REASONING} (QwQ-32B)"),
)
