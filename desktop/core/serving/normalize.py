"""Requests shaped for the engine that serves them: what coding agents send, answered the way they expect.

Each rule fixes one thing a real client sends that an engine refuses or serves badly (sources: the agents'
own code and their users' issues, ../shared/reference/agents.md). Every rule is tested in tests/test_normalize.py
(by hand-written bodies) and, where an engine is involved, against the real engines:

1. `tools: []` is dropped, and `tool_choice` with it when no tool is left: vLLM refuses an empty list.
2. Tools that are not functions are dropped and named in the request log (Codex sends `web_search`,
   `local_shell`, `image_generation`, `namespace`...; llama-server's chat route refuses them, "'type' of tool must
   be 'function'", and no local engine runs them). A Responses `custom` tool (Codex's freeform `apply_patch`) is
   mapped to a function taking one string, `input`, which is what Codex's function form of the tool takes.
3. System and developer messages that come after the conversation began are moved to the front, into the first
   system message, when the model's chat template refuses them elsewhere (Qwen's "System message must be at the
   beginning.", templates that check that roles alternate); `developer` becomes `system` there too. In an
   Anthropic body (Claude Code's mid-conversation `system` entries) they join the top-level `system`.
4. Claude Code's attribution line (`x-anthropic-billing-header: cc_version=2.1.197.a3f; cc_entrypoint=cli;
   cch=91b0c;`) changes on every request and stands first in the system prompt, so the engine's prefix cache
   missed at its first tokens every time: it is removed (the engines never needed it).
5. `max_tokens` (`max_completion_tokens`, `max_output_tokens`) is lowered to the context served per request (no
   reply can be longer: the prompt takes at least one token of it), and, once the engine has said the prompt fits
   but prompt + max_tokens does not (serving.refusals), to what the context leaves after the prompt: vLLM before
   0.10 refused that, and Claude Code asks for 32,000 output tokens by default. vLLM 0.32 and llama-server b11434
   stop at the context's end themselves; the rule makes the limit visible (X-Switchyard-Adjusted, the request
   log) and spares an older engine's refusal.
6. One reasoning setting, `off|low|medium|high|auto`: the request's own (`reasoning_effort`, Ollama's `think`
   translated to it), else the model's (models.yaml `reasoning_effort:`, `serve --reasoning-effort`), reaches each
   engine as its own mechanism (serving.reasoning.engine_fields): off is `chat_template_kwargs.enable_thinking:
   false` with `reasoning_effort: "none"` on both, and llama-server's `reasoning_budget_tokens: 0` besides (it
   ends a template that always opens its thinking); a level is `reasoning_effort`. What the client set itself in
   `chat_template_kwargs` stays.
7. A Responses request's `text.format` (JSON of a schema, or any JSON object) is also sent to llama-server as the
   chat `response_format`, which is the only one it reads (serving.structured has the source).

Why by hand, and the cost: a body is parsed (json.loads) only on the routes these rules apply to and only up to
PARSE_LIMIT, where the scan of the body already ran (on the event loop for bodies of few JSON tokens, else in the
scan's worker thread). The rules then run on the parsed object when the request is sent, since they depend on
the engine that takes it; an unchanged body is sent as the client's own bytes, a changed one is serialized once
(a 24k-token agent request: about 1 ms).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.base import LaunchPlan
from desktop.core.models.parsers import chat_template
from desktop.core.planning.swap import plan_facts
from desktop.core.serving.requestinfo import BadBody
from desktop.core.serving.structured import responses_format_for_llama

CHAT, MESSAGES, COUNT_TOKENS, RESPONSES = ("/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
                                          "/v1/responses")
RULE_PATHS = frozenset({CHAT, MESSAGES, COUNT_TOKENS, RESPONSES})
PARSE_LIMIT = 16 * 1024 * 1024  # larger bodies (images, mostly) are forwarded as they are
# Claude Code's attribution line: `x-anthropic-billing-header:` then `key=value;` pairs (cc_version, cc_entrypoint,
# cch, ...), as the first text of the system prompt, alone in its block or followed by the prompt itself.
BILLING_MARK = "x-anthropic-billing-header:"
_BILLING = re.compile(r"\A[ \t]*x-anthropic-billing-header:(?:[ \t]*[A-Za-z0-9_.-]+=[^;\n]*;)*[ \t]*\n?")
_RAISES = re.compile(r"raise_exception\(\s*(['\"])(.*?)\1", re.S)
MAX_TOKEN_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
SYSTEM_ROLES = ("system", "developer")


def template_wants_system_first(chat_template: str) -> bool:
    """Whether a chat template refuses a system message after the first message: it raises an error that names
    system messages, or one that checks the order of roles (which a system message in the middle breaks)."""
    for _quote, message in _RAISES.findall(chat_template):
        text = message.lower()
        if "system" in text or "alternate" in text:
            return True
    return False


@dataclass(frozen=True)
class Target:
    """What the rules need to know of the engine a request goes to."""

    served_model_name: str
    system_first: bool = False  # its template refuses system messages after the first message (rule 3)
    context: int = 0  # the tokens it serves per request, a bound on any reply (rule 5); 0: unknown
    engine: str = ""  # llama.cpp | vllm: whose reasoning mechanism (rule 6)
    reasoning: str = "auto"  # the model's reasoning setting, where the request sets none (rule 6)


@dataclass
class Shape:
    """A request body parsed once, and what the rules changed in it for the engine it was last sent to."""

    path: str
    doc: dict[str, Any]
    cap: int | None = None  # rule 5: max_tokens at most this (the engine said what the context leaves)
    notes: list[str] = field(default_factory=list)

    def body_for(self, target: Target) -> bytes | None:
        """The body to send to `target`, or None when every rule left it as the client sent it."""
        doc = copy.copy(self.doc)  # rules replace top-level values; the client's parse stays as it was (retries)
        notes: list[str] = []
        _drop_tools(self.path, doc, notes)
        if self.path in (MESSAGES, COUNT_TOKENS):
            _strip_billing(doc, notes)
        if target.system_first:
            _system_first(self.path, doc, notes)
        if self.cap is not None:
            _cap(doc, self.cap, notes, "what the served context leaves after the prompt")
        elif target.context > 0:
            _cap(doc, target.context, notes, "the context served per request")
        if self.path == CHAT:
            _reasoning(doc, target, notes)
        if self.path == RESPONSES and target.engine == "llama.cpp":
            responses_format_for_llama(doc, notes)
        self.notes = notes
        if not notes:
            return None
        if "model" in doc:
            doc["model"] = target.served_model_name
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()

    def asked_tokens(self) -> int | None:
        """The output budget the client asked for (the first of the max-tokens keys present)."""
        for key in MAX_TOKEN_KEYS:
            value = self.doc.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    @property
    def note(self) -> str | None:
        return "; ".join(self.notes) if self.notes else None


def parse(path: str, body: bytes) -> Shape | None:
    """The Shape of a body on a route with rules, or None (another route, too large). A body that is no JSON
    object is refused here (BadBody: a 400 in the client's own error shape) rather than by the engine: llama-server
    and vLLM answer it in different shapes, vLLM's /v1/messages in OpenAI's rather than Anthropic's."""
    if path not in RULE_PATHS or len(body) > PARSE_LIMIT:
        return None
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise BadBody(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        return None  # (nesting is bounded by the scan before this: MAX_DEPTH)
    if not isinstance(doc, dict):
        raise BadBody(f"the request body must be a JSON object, not {type(doc).__name__ if doc is not None else 'null'}")
    return Shape(path, doc)


# --- the rules ---
def _drop_tools(path: str, doc: dict[str, Any], notes: list[str]) -> None:
    """Rules 1 and 2."""
    tools = doc.get("tools")
    if not isinstance(tools, list):
        return
    anthropic = path in (MESSAGES, COUNT_TOKENS)
    kept: list[Any] = []
    dropped: list[str] = []
    mapped = 0
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or kind == "function":
            kept.append(tool)
        elif anthropic:  # client tools have an input_schema (and "custom" or no type); server tools do not
            if "input_schema" in tool:
                kept.append(tool)
            else:
                dropped.append(str(kind))
        elif kind == "custom" and path == RESPONSES and isinstance(tool.get("name"), str):
            kept.append(_custom_as_function(tool))
            mapped += 1
        else:
            dropped.append(str(kind))
    if not tools:
        notes.append("dropped an empty tools list")
    if dropped:
        notes.append(f"dropped {len(dropped)} tool(s) no local engine runs: {', '.join(sorted(set(dropped)))}")
    if mapped:
        notes.append(f"{mapped} custom tool(s) sent as functions taking one string, input")
    if kept:
        if dropped or mapped:
            doc["tools"] = kept
        return
    del doc["tools"]
    doc.pop("tool_choice", None)
    doc.pop("parallel_tool_calls", None)


def _custom_as_function(tool: dict[str, Any]) -> dict[str, Any]:
    description = str(tool.get("description") or "")
    return {"type": "function", "name": tool["name"], "description": description,
            "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
                           "additionalProperties": False}}


def _strip_billing(doc: dict[str, Any], notes: list[str]) -> None:
    """Rule 4, on an Anthropic body's `system` (a string or a list of text blocks)."""
    system = doc.get("system")
    if isinstance(system, str):
        if BILLING_MARK in system:
            stripped = _BILLING.sub("", system, count=1)
            if stripped != system:
                doc["system"] = stripped
                notes.append("removed the attribution line from the system prompt")
        return
    if not isinstance(system, list):
        return
    blocks: list[Any] = []
    changed = False
    for block in system:
        text = block.get("text") if isinstance(block, dict) else None
        if isinstance(text, str) and BILLING_MARK in text:
            stripped = _BILLING.sub("", text, count=1)
            if stripped != text:
                changed = True
                if not stripped.strip():
                    continue  # the line was the whole block
                block = {**block, "text": stripped}
        blocks.append(block)
    if changed:
        doc["system"] = blocks
        notes.append("removed the attribution line from the system prompt")


def _system_first(path: str, doc: dict[str, Any], notes: list[str]) -> None:
    """Rule 3: chat `messages`, Responses `input` items, or Anthropic `messages` (Claude Code's mid-conversation
    `system` entries, its beta "mid-conversation-system-2026-04-07": appended to the top-level `system`, which
    both engines render as the first message)."""
    if path in (MESSAGES, COUNT_TOKENS):
        _anthropic_system_first(doc, notes)
    elif path == CHAT:
        messages = doc.get("messages")
        if isinstance(messages, list):
            moved = _front(messages)
            if moved is not None:
                doc["messages"], count = moved
                notes.append(f"moved {count} system/developer message(s) to the front (the model's template "
                             "takes them only there)")
    elif path == RESPONSES:
        items = doc.get("input")
        if not isinstance(items, list):
            return
        instructions = doc.get("instructions")
        texts = [instructions] if isinstance(instructions, str) and instructions else []
        rest: list[Any] = []
        count = 0
        for item in items:
            text = _system_text(item)
            if text is None:
                rest.append(item)
            else:
                texts.append(text)
                count += 1
        if count:
            doc["instructions"] = "\n\n".join(texts)
            doc["input"] = rest
            notes.append(f"moved {count} system/developer message(s) into the instructions (the model's template "
                         "takes them only first)")


def _anthropic_system_first(doc: dict[str, Any], notes: list[str]) -> None:
    """Rule 3 on an Anthropic body: each `system` entry of `messages` becomes a text block at the end of the
    top-level `system` (a string `system` becomes blocks); the turns keep their order."""
    messages = doc.get("messages")
    if not isinstance(messages, list):
        return
    texts = [text for m in messages if isinstance(m, dict) and m.get("role") == "system"
             and (text := _system_text(m)) is not None]
    if not texts:
        return
    system = doc.get("system")
    blocks: list[Any] = [{"type": "text", "text": system}] if isinstance(system, str) and system else \
        list(system) if isinstance(system, list) else []
    # llama-server joins system blocks with nothing between them (server-chat.cpp): each moved one starts apart
    doc["system"] = [*blocks, *({"type": "text", "text": f"\n\n{text}" if blocks or i else text}
                                for i, text in enumerate(texts))]
    doc["messages"] = [m for m in messages if not (isinstance(m, dict) and m.get("role") == "system"
                                                   and _system_text(m) is not None)]
    notes.append(f"moved {len(texts)} system message(s) into the system prompt (the model's template takes them "
                 "only first)")


def _front(messages: list[Any]) -> tuple[list[Any], int] | None:
    """Chat messages with every system/developer message merged into one leading system message, or None when
    the only one already leads (a lone `developer` at the front becomes `system`)."""
    systems = [i for i, m in enumerate(messages) if _system_text(m) is not None]
    if not systems or (systems == [0] and messages[0].get("role") == "system"):
        return None
    texts = [_system_text(messages[i]) or "" for i in systems]
    moved = set(systems)
    rest = [m for i, m in enumerate(messages) if i not in moved]
    return [{"role": "system", "content": "\n\n".join(t for t in texts if t)}, *rest], len(systems)


def _system_text(message: Any) -> str | None:
    """The text of a system or developer message (chat message or Responses input item), None for any other
    (or for one with parts that are not text, which is left where it is)."""
    if not isinstance(message, dict) or message.get("role") not in SYSTEM_ROLES:
        return None
    if message.get("type") not in (None, "message"):
        return None
    content = message.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("text", "input_text") \
                or not isinstance(part.get("text"), str):
            return None
        texts.append(part["text"])
    return "\n".join(texts)


def _cap(doc: dict[str, Any], cap: int, notes: list[str], why: str) -> None:
    """Rule 5: every max-tokens key the body has, at most `cap`."""
    for key in MAX_TOKEN_KEYS:
        value = doc.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            doc[key] = cap
            notes.append(f"{key} {value} -> {cap} ({why})")


def _reasoning(doc: dict[str, Any], target: Target, notes: list[str]) -> None:
    """Rule 6: the request's reasoning setting, else the model's, as the engine's own fields."""
    from desktop.core.serving.reasoning import EFFORTS, engine_fields

    asked = doc.get("reasoning_effort")
    effort = ("off" if asked == "none" else asked) if isinstance(asked, str) else target.reasoning
    if effort not in EFFORTS or effort == "auto" or not target.engine:
        return
    fields = engine_fields(target.engine, effort)
    kwargs = doc.get("chat_template_kwargs")
    kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
    changed = []
    for name, value in fields.items():
        if name == "chat_template_kwargs":
            for key, inner in value.items():
                if key not in kwargs:  # the client's own template settings stay
                    kwargs[key] = inner
                    changed.append(f"chat_template_kwargs.{key}={json.dumps(inner)}")
        elif doc.get(name) != value:
            doc[name] = value
            changed.append(f"{name}={json.dumps(value)}")
    if kwargs:
        doc["chat_template_kwargs"] = kwargs
    if changed:
        whose = "asked" if isinstance(asked, str) else "the model's setting"
        notes.append(f"reasoning {effort} ({whose}): {', '.join(changed)} ({target.engine})")


def engine_rules(plan: LaunchPlan) -> tuple[int, bool]:
    """(the model's own context window, 0 when unknown; whether its chat template takes system messages only
    first) for an engine launched on `plan`: read once per launch, never failing it."""
    try:
        window = plan_facts(plan).context_length
    except (OSError, ValueError, SwitchyardError):
        window = 0
    return window, template_wants_system_first(chat_template(plan.model_path))
