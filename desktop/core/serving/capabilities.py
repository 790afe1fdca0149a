"""What the traffic asks of an engine besides text (tools, JSON schemas, images, reasoning), per model, and whether
an engine about to take that traffic over answers it: a switch is meant to be invisible, so before traffic moves
(a manual switch, the autopilot's hand-over, a model's engine switch in a fleet) the new engine gets one short
request per capability the traffic used recently, and a refusal keeps the old engine serving (issue 41).

Reading a request: in the one scan of the body that finds the model (serving.requestinfo), each short string token is
looked up among a few marks (`"tools"` followed by a non-empty list, `"type"` followed by `"image_url"` ...): JSON
structure only, never text a user typed (its quotes are escaped), and the bytes of long strings are not searched
again (four regex searches over the whole body cost 67 ms for 60 MB; this, nothing measurable). What is kept: per model name, when each capability was last seen; at most
MAX_MODELS names (the oldest forgotten first): bounded whatever the clients send.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from desktop.core.common.text import bounded
from desktop.core.engines.base import LaunchPlan

TOOLS, JSON_SCHEMA, IMAGES, REASONING = "tools", "json_schema", "images", "reasoning"
CAPABILITIES = (TOOLS, JSON_SCHEMA, IMAGES, REASONING)
RECENT_S = 3600.0  # traffic of the last hour decides what a switch must keep
MAX_MODELS = 64
PROBE_TIMEOUT_S = 60.0  # one token on a CPU engine, prompt included
PROBE_USER = "switchyard-capability-probe"  # the OpenAI `user` field of every probe (engines log it)

# The JSON strings (quotes included) that mark a capability, and what must follow them: read at each short string
# token of the one scan of the body (serving.requestinfo), so the bytes inside long strings (a prompt, a base64
# image) are never searched again. `"type"` marks by its value.
_MARKS: dict[bytes, tuple[str | None, re.Pattern[bytes]]] = {
    b'"tools"': (TOOLS, re.compile(rb'\s*:\s*\[\s*\{')),  # OpenAI and Anthropic: a non-empty tools list
    b'"type"': (None, re.compile(rb'\s*:\s*"(json_schema|json_object|image_url|input_image|image)"')),
    b'"reasoning_effort"': (REASONING, re.compile(rb'\s*:\s*"(?!none"|off")')),  # "none": thinking off
    b'"reasoning"': (REASONING, re.compile(rb'\s*:\s*\{')),  # the Responses API's reasoning object
    b'"enable_thinking"': (REASONING, re.compile(rb'\s*:\s*true')),
    b'"thinking"': (REASONING, re.compile(rb'\s*:\s*\{[^{}]{0,256}"type"\s*:\s*"(?:enabled|adaptive)"')),
}
_TYPE_VALUES = {b"json_schema": JSON_SCHEMA, b"json_object": JSON_SCHEMA, b"image_url": IMAGES,
                b"input_image": IMAGES, b"image": IMAGES}
MARK_MAX = max(len(mark) for mark in _MARKS)


def capability_at(body: bytes, start: int, end: int) -> str | None:
    """The capability the JSON string body[start:end] (quotes included) marks, with what follows it, or None."""
    mark = _MARKS.get(body[start:end])
    if mark is None:
        return None
    name, after = mark
    found = after.match(body, end)
    if found is None:
        return None
    return name if name is not None else _TYPE_VALUES[found.group(1)]


# 1x1 transparent PNG: the smallest image every vision engine decodes
_PIXEL = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==")
_ASK = {"role": "user", "content": "Say hi."}
PROBES: dict[str, dict[str, Any]] = {
    TOOLS: {"messages": [_ASK], "tool_choice": "auto", "tools": [{"type": "function", "function": {
        "name": "probe", "description": "A capability probe.", "parameters": {"type": "object", "properties": {}}}}]},
    JSON_SCHEMA: {"messages": [_ASK], "response_format": {"type": "json_schema", "json_schema": {
        "name": "probe", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}}}}},
    IMAGES: {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_PIXEL}"}}]}]},
    REASONING: {"messages": [_ASK], "reasoning_effort": "low"},
}
_LABELS = {TOOLS: "tools", JSON_SCHEMA: "JSON-schema (response_format)", IMAGES: "image", REASONING: "reasoning"}
_HINTS = {
    TOOLS: {"vllm": "set tool_parser for this model (models.yaml `tool_parser:`)",
            "llama.cpp": "use a GGUF whose chat template renders tools"},
    JSON_SCHEMA: {"vllm": "this vLLM build has no structured outputs for this model",
                  "llama.cpp": "this llama-server cannot turn the schema into a grammar"},
    IMAGES: {"vllm": "serve a vision model on vLLM", "llama.cpp": "give llama-server the model's --mmproj file"},
    REASONING: {"vllm": "set reasoning_parser for this model (models.yaml `reasoning_parser:`)",
                "llama.cpp": "set reasoning_parser for this model (models.yaml `reasoning_parser:`)"},
}
_ENGINE_NAMES = {"vllm": "vLLM", "llama.cpp": "llama.cpp"}


class TrafficCapabilities:
    """Per model name, when each capability was last used (monotonic seconds). Thread-safe: the endpoint's loop
    notes, a switch (another thread) reads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, dict[str, float]] = OrderedDict()

    def note(self, model: str, used: Iterable[str]) -> None:
        if not used:
            return
        now = self._clock()
        with self._lock:
            seen = self._seen.setdefault(model, {})
            self._seen.move_to_end(model)
            for name in used:
                seen[name] = now
            while len(self._seen) > MAX_MODELS:
                self._seen.popitem(last=False)

    def recent(self, model: str | None, within_s: float = RECENT_S) -> list[str]:
        """What `model`'s traffic used in the last `within_s` seconds (every model's, for None), in CAPABILITIES
        order."""
        ago = self.ago(model)
        return [name for name in CAPABILITIES if name in ago and ago[name] <= within_s]

    def ago(self, model: str | None) -> dict[str, float]:
        """Capability -> seconds since `model`'s traffic (every model's, for None) last used it."""
        now = self._clock()
        with self._lock:
            rows = list(self._seen.values()) if model is None else [self._seen.get(model, {})]
        out: dict[str, float] = {}
        for seen in rows:
            for name, at in seen.items():
                out[name] = min(out.get(name, float("inf")), round(now - at, 1))
        return out


def plan_supports(plan: LaunchPlan | None) -> dict[str, str]:
    """What a plan was launched to support, per capability: "yes", "no", or "model" (up to the model itself)."""
    if plan is None:
        return {}
    vllm = plan.engine == "vllm"
    parser = plan.tool_parser not in (None, "none")
    reasoning = plan.reasoning_parser not in (None, "none")
    mmproj = plan.mmproj is not None or any(a in ("--mmproj-url", "-mmu") for a in plan.extra_args)
    return {TOOLS: "yes" if parser or not vllm else "no", JSON_SCHEMA: "yes",
            IMAGES: "model" if vllm else "yes" if mmproj else "no", REASONING: "yes" if reasoning else "no"}


def takes_images(plan: LaunchPlan | None) -> bool:
    """Whether the engine launched from `plan` sees images: llama-server given a projector, vLLM allowed images
    (the planner's --limit-mm-per-prompt for a checkpoint with a vision tower): what /v1/models and Ollama mark."""
    if plan is None:
        return False
    if plan.engine != "vllm":
        return plan_supports(plan)[IMAGES] == "yes"
    return bool(plan.images_per_prompt)


def table(used: dict[str, float], **plans: LaunchPlan | None) -> list[dict[str, Any]]:
    """One row per capability: seconds since the traffic last used it (None: not used) and what each named plan
    was launched to support."""
    supports = {role: plan_supports(plan) for role, plan in plans.items()}
    return [{"capability": name, "traffic_s_ago": used.get(name),
             **{role: sup.get(name) for role, sup in supports.items()}} for name in CAPABILITIES]


@dataclass(frozen=True)
class Refusal:
    """An engine's answer to a capability probe that was not a success."""

    capability: str
    status: int | None  # None: it did not answer
    detail: str

    def message(self, engine: str) -> str:
        label = _LABELS[self.capability]
        label = f"{'an' if label[0] in 'aeiou' else 'a'} {label}"
        who = _ENGINE_NAMES.get(engine, engine)
        said = f"answered {self.status} to {label} request" if self.status is not None else \
            f"did not answer {label} request"
        return f"{who} {said}: {_HINTS[self.capability].get(engine, 'check its flags for this model')}" + \
            (f" (it said: {bounded(self.detail, 200)})" if self.detail else "")


Send = Callable[[dict[str, Any]], tuple[int | None, str]]  # body -> (HTTP status or None, answer text)


def probe(send: Send, model_name: str, used: Iterable[str]) -> Refusal | None:
    """One short request per capability in `used` (`max_tokens` 1) until the first refusal; None when all pass."""
    for name in used:
        body = {"model": model_name, "max_tokens": 1, "stream": False, "user": PROBE_USER, **PROBES[name]}
        status, text = send(body)
        if status is None or not 200 <= status < 300:
            return Refusal(name, status, _error_text(text))
    return None


def _error_text(text: str) -> str:
    """The engine's own message out of an OpenAI-style error body, else the text."""
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    if isinstance(data, dict) and isinstance(data.get("detail"), str):
        return str(data["detail"])
    return text.strip()


__all__ = ["CAPABILITIES", "IMAGES", "JSON_SCHEMA", "MARK_MAX", "PROBES", "REASONING", "TOOLS", "Refusal",
           "TrafficCapabilities", "capability_at", "plan_supports", "probe", "table"]
