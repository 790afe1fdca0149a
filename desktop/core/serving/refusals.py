"""An engine's refusal of a request that does not fit its context, read and answered in the client's own shape.

Both engines check the prompt against the context before they generate and answer a 400 whose text says how
many tokens the prompt has (a streamed request too: llama-server sends its first error as a plain answer,
server-context.cpp "the first error must be treated as non-stream response"; vLLM validates before it streams).
The endpoint holds such an answer (serving.upstream.Exchange) and reads it here:
- the prompt alone does not fit: the client gets the endpoint's own message, in its API's error shape, with the
  numbers and how to serve more (`--ctx`, or a model with a longer window). It is an HTTP 400, as OpenAI's own.
  The Responses API's error carries no `code`: Codex 0.171.0 replaces the message of any error whose code is
  `context_length_exceeded` (a 400's body or a `response.failed` event) with its own fixed "ran out of room" text,
  which would hide the numbers and the remedy; with the code left out it prints the message;
- the prompt fits but prompt + max_tokens does not (vLLM before 0.10: "... you requested 36000 tokens (4000 in
  the messages, 32000 in the completion)"): the request is sent again at once with max_tokens lowered to what the
  context leaves (serving.normalize, rule 5). vLLM 0.32 lowers max_tokens itself
  (entrypoints/serve/utils/api_utils.py `get_max_tokens`) and llama-server stops at the context's end, so neither
  engine pinned here refuses this; the retry serves the older vLLM an external engine may be.

The engines' wordings are matched from their sources: llama.cpp b11434 tools/server/server-context.cpp
`exceed_context_size_error` with `n_prompt_tokens`/`n_ctx`; vLLM 0.32 vllm/renderers/params.py "This model's
maximum context length is C tokens. However, your prompt contains [at least ]P input tokens" (or "P characters
(more than X characters, which is the upper bound for M input tokens)", a prompt too long to tokenize at all) and
entrypoints/serve/utils/api_utils.py "Input length (P) exceeds model's maximum context length (C)". Tests feed
these texts and the real engines' answers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from desktop.core.common.sse import error_event
from desktop.core.common.text import bounded

HOLD_BYTES = 64 * 1024  # an error answer larger than this is passed on as it is
_VLLM_BUDGET = re.compile(r"maximum context length is (\d+) tokens\. However, you requested (\d+) tokens "
                          r"\((\d+) in the messages, (\d+) in the completion\)")
_VLLM_PROMPT = re.compile(r"maximum context length is (\d+) tokens\. However, your prompt contains (at least )?"
                          r"(\d+) input tokens")
_VLLM_CHARS = re.compile(r"maximum context length is (\d+) tokens\. However, your prompt contains \d+ characters "
                         r"\(more than \d+ characters, which is the upper bound for (\d+) input tokens\)")
_VLLM_INPUT = re.compile(r"Input length \((\d+)\) exceeds model's maximum context length \((\d+)\)")


@dataclass(frozen=True)
class Refusal:
    """What an engine said about a request that does not fit: the prompt's tokens, the context it has, and the
    output budget asked for when that was the part that did not fit (None: the prompt alone is too long)."""

    prompt: int
    context: int
    asked: int | None = None
    at_least: bool = False  # the engine stopped counting: the prompt has `prompt` tokens or more

    @property
    def prompt_fits(self) -> bool:
        return self.asked is not None and self.prompt < self.context


def read(status: int, body: bytes) -> Refusal | None:
    """The refusal an engine's error answer states, or None for any other answer."""
    if status != 400 or len(body) > HOLD_BYTES:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return None
    if error.get("type") == "exceed_context_size_error":  # llama-server
        prompt, context = error.get("n_prompt_tokens"), error.get("n_ctx")
        if isinstance(prompt, int) and isinstance(context, int) and context > 0:
            return Refusal(prompt, context)
        return None
    message = error.get("message")
    if not isinstance(message, str):
        return None
    found = _VLLM_BUDGET.search(message)
    if found is not None:
        context, _total, prompt, asked = (int(g) for g in found.groups())
        return Refusal(prompt, context, asked if prompt < context else None)
    found = _VLLM_PROMPT.search(message)
    if found is not None:
        return Refusal(int(found.group(3)), int(found.group(1)), at_least=found.group(2) is not None)
    found = _VLLM_CHARS.search(message)
    if found is not None:
        return Refusal(int(found.group(2)) + 1, int(found.group(1)), at_least=True)
    found = _VLLM_INPUT.search(message)
    if found is not None:
        return Refusal(int(found.group(1)), int(found.group(2)))
    return None


def suggested_context(prompt: int, window: int) -> int:
    """A context that holds the prompt and a reply of up to 8,192 tokens: the next power of two, at most the
    model's window (0: unknown)."""
    wanted = prompt + 8192
    size = 1 << (wanted - 1).bit_length()
    return min(size, window) if window > prompt else size


def context_message(refusal: Refusal, model: str, engine: str, window: int) -> str:
    """The endpoint's own words for a prompt larger than the served context."""
    served = f"model '{bounded(model, 80)}' is served with a context of {refusal.context} tokens per request ({engine})"
    has = f"at least {refusal.prompt}" if refusal.at_least else str(refusal.prompt)
    head = f"the prompt has {has} tokens, but {served}"
    if window and window <= refusal.prompt:
        return (f"{head}, and the model's own window is {window} tokens: use a model with a longer window, or "
                "send a shorter conversation")
    size = suggested_context(refusal.prompt, window)
    own = f" (the model's own window is {window} tokens)" if window else ""
    return (f"{head}{own}. Serve it with a larger context: `switchyard serve --ctx {size} ...` (or `ctx: {size}` in "
            "models.yaml), or use a model with a longer window")


def error_body(path: str, message: str) -> dict[str, Any]:
    """`message` in the error shape of the client's API: Anthropic's for /v1/messages, OpenAI's otherwise; Chat
    Completions with the `context_length_exceeded` code OpenAI gives it, the Responses API without one (Codex
    would show its fixed text instead of the message, see the module docstring)."""
    if path.startswith("/v1/messages"):
        return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    if path == "/v1/responses":
        return {"error": {"message": message, "type": "invalid_request_error", "param": "input", "code": None}}
    return {"error": {"message": message, "type": "invalid_request_error", "param": "messages",
                      "code": "context_length_exceeded"}}


def stream_error(path: str, message: str) -> bytes:
    """The refusal as one SSE event, for a client whose stream already began (the endpoint told it a model
    loads): `response.failed` for the Responses API (no code, as in error_body), Anthropic's `event: error` for
    the Messages API, an OpenAI error event otherwise."""
    if path == "/v1/responses":
        failed = {"type": "response.failed", "response": {"id": "resp_switchyard", "object": "response",
                                                         "status": "failed", "output": [],
                                                         "error": {"code": "invalid_prompt", "message": message}}}
        return b"event: response.failed\ndata: " + json.dumps(failed).encode() + b"\n\n"
    if path.startswith("/v1/messages"):
        return error_event(message, "invalid_request_error", 400, anthropic=True)
    return b"data: " + json.dumps(error_body(path, message)).encode() + b"\n\n"
