"""What the traffic asks of an engine besides text (tools, JSON schemas, images, reasoning), per model, and whether
an engine about to take that traffic over answers it: a switch is meant to be invisible, so before traffic moves
(a manual switch, the autopilot's hand-over, a model's engine switch in a fleet) the new engine gets one short
request per capability the traffic used recently, and a refusal keeps the old engine serving (issue 41).

Reading a request: four byte patterns over the body (C-speed regex, no parse), next to the one scan that finds the
model (serving.requestinfo). A JSON string's own quotes are escaped, so `"type": "image_url"` only matches JSON
structure, never text a user typed. What is kept: per model name, when each capability was last seen; at most
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

_PATTERNS = {
    TOOLS: re.compile(rb'"tools"\s*:\s*\[\s*\{'),  # OpenAI and Anthropic: a non-empty tools list
    JSON_SCHEMA: re.compile(rb'"type"\s*:\s*"json_(?:schema|object)"'),  # response_format / Responses text.format
    IMAGES: re.compile(rb'"type"\s*:\s*"(?:image_url|input_image|image)"'),  # OpenAI chat, Responses, Anthropic
    REASONING: re.compile(rb'"reasoning_effort"\s*:\s*"|"reasoning"\s*:\s*\{|"enable_thinking"\s*:\s*true'
                          rb'|"thinking"\s*:\s*\{[^{}]*"type"\s*:\s*"(?:enabled|adaptive)"'),
}

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


def used_by(body: bytes) -> frozenset[str]:
    """The capabilities a request body uses."""
    return frozenset(name for name, pattern in _PATTERNS.items() if pattern.search(body))


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
    mmproj = any(a in ("--mmproj", "-mm", "--mmproj-url", "-mmu") or a.startswith("--mmproj=") for a in plan.extra_args)
    return {TOOLS: "yes" if parser or not vllm else "no", JSON_SCHEMA: "yes",
            IMAGES: "model" if vllm else "yes" if mmproj else "no", REASONING: "yes" if reasoning else "no"}


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
        who = _ENGINE_NAMES.get(engine, engine)
        said = f"answered {self.status} to a {label} request" if self.status is not None else \
            f"did not answer a {label} request"
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


__all__ = ["CAPABILITIES", "IMAGES", "JSON_SCHEMA", "PROBES", "REASONING", "TOOLS", "Refusal", "TrafficCapabilities",
           "plan_supports", "probe", "table", "used_by"]
