"""An engine's refusal of a request that does not fit its context, read and answered in the client's own shape.

Both engines check the prompt against the context before they generate and answer a 400 whose text says how
many tokens the prompt has (a streamed request too: llama-server sends its first error as a plain answer,
server-context.cpp "the first error must be treated as non-stream response"; vLLM validates before it streams).
The endpoint holds such an answer (serving.upstream.Exchange) and reads it here:
- the prompt alone does not fit: the client gets the endpoint's own message, in its API's error shape, with the
  numbers and how to serve more (`--ctx`, or a model with a longer window); the Responses API's error carries
  `code: context_length_exceeded` as OpenAI's does. It is an HTTP 400, as OpenAI's own, since Codex prints a
  400's body but shows only its fixed "ran out of room" text for a `response.failed` event;
- the prompt fits but prompt + max_tokens does not (vLLM: "... you requested 36000 tokens (4000 in the
  messages, 32000 in the completion)"): the request is sent again at once with max_tokens lowered to what the
  context leaves (serving.normalize, rule 5); llama-server never refuses this (it stops at the context's end).

The engines' wordings are matched from their sources (llama.cpp b11434 tools/server/server-context.cpp
`exceed_context_size_error` with `n_prompt_tokens`/`n_ctx`; vLLM 0.32 vllm/entrypoints/utils.py and
serving_engine.py "maximum context length"); tests feed both recorded texts and the real engines' answers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from desktop.core.common.text import bounded

HOLD_BYTES = 64 * 1024  # an error answer larger than this is passed on as it is
_VLLM_BUDGET = re.compile(r"maximum context length is (\d+) tokens\. However, you requested (\d+) tokens "
                          r"\((\d+) in the messages, (\d+) in the completion\)")
_VLLM_PROMPT = re.compile(r"maximum (?:context|model) length is (\d+) tokens\.?.*?(?:your request has|your prompt "
                          r"contains|has) (\d+) (?:input |prompt )?tokens", re.S)
_VLLM_PROMPT_OTHER = re.compile(r"(?:prompt|input)[^0-9]{0,40}\(?(\d+)\)? tokens?[^0-9]{0,60}(?:longer than|exceeds?|"
                                r"larger than)[^0-9]{0,40}(?:maximum model length|max_model_len|context)[^0-9]{0,20}"
                                r"\(?(\d+)\)?", re.S | re.I)


@dataclass(frozen=True)
class Refusal:
    """What an engine said about a request that does not fit: the prompt's tokens, the context it has, and the
    output budget asked for when that was the part that did not fit (None: the prompt alone is too long)."""

    prompt: int
    context: int
    asked: int | None = None

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
        return Refusal(int(found.group(2)), int(found.group(1)))
    found = _VLLM_PROMPT_OTHER.search(message)
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
    head = f"the prompt has {refusal.prompt} tokens, but {served}"
    if window and window <= refusal.prompt:
        return (f"{head}, and the model's own window is {window} tokens: use a model with a longer window, or "
                "send a shorter conversation")
    size = suggested_context(refusal.prompt, window)
    own = f" (the model's own window is {window} tokens)" if window else ""
    return (f"{head}{own}. Serve it with a larger context: `switchyard serve --ctx {size} ...` (or `ctx: {size}` in "
            "models.yaml), or use a model with a longer window")


def error_body(path: str, message: str) -> dict[str, Any]:
    """`message` in the error shape of the client's API: Anthropic's for /v1/messages, OpenAI's otherwise (with
    the `context_length_exceeded` code OpenAI gives it)."""
    if path.startswith("/v1/messages"):
        return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    return {"error": {"message": message, "type": "invalid_request_error", "param": "input" if
                      path == "/v1/responses" else "messages", "code": "context_length_exceeded"}}


def stream_error(path: str, message: str) -> bytes:
    """The refusal as one SSE event, for a client whose stream already began (the endpoint told it a model
    loads): `response.failed` with `context_length_exceeded` for the Responses API, an error event otherwise."""
    if path == "/v1/responses":
        failed = {"type": "response.failed", "response": {"id": "resp_switchyard", "object": "response",
                                                         "status": "failed", "output": [],
                                                         "error": {"code": "context_length_exceeded",
                                                                   "message": message}}}
        return b"event: response.failed\ndata: " + json.dumps(failed).encode() + b"\n\n"
    return b"data: " + json.dumps(error_body(path, message)).encode() + b"\n\n"
