"""A structured-output request (`response_format`, the Responses API's `text.format`) whose JSON schema the engine
cannot compile, answered as OpenAI answers it: HTTP 400, `invalid_request_error`, `param` naming the field, and a
message that names the engine and gives its own reason.

The engines refuse such a schema in different shapes: llama-server b11434 with a 400 ("JSON schema error at #:
cannot resolve $ref ...", common/json-schema-to-grammar.cpp), vLLM 0.32 with a 400 whose type is
`BadRequestError` ("Grammar error: Pointer '/$defs/missing' does not exist", from its guidance backend) or, for a
streamed request, with a 200 event stream whose first event is that error (entrypoints/openai/chat_completion
validates the constraint inside the stream's generator). The relay holds the first event of a streamed
structured request (serving.relay) so that both come out as the same 400 a client's SDK raises as
BadRequestError. A message is taken for a schema error when it speaks of a schema or a grammar; any other
refusal of such a request passes on as the engine said it.

Also here, normalize's rule 7: llama-server b11434 reads no `text.format` on /v1/responses
(tools/server/server-chat.cpp `server_chat_convert_responses_to_chatcmpl` copies the body to a chat request and
maps input, instructions, tools, max_output_tokens and reasoning only), so a Responses request for JSON got free
text from it. The chat request it builds keeps every other field, so the format is sent to it as the chat
`response_format` it does read.
"""

from __future__ import annotations

import json
from typing import Any

from desktop.core.common.text import bounded

CHAT, RESPONSES = "/v1/chat/completions", "/v1/responses"
ENGINE_NAMES = {"llama.cpp": "llama-server", "vllm": "vLLM"}
_MARKS = ("schema", "grammar")


def asked(path: str, doc: dict[str, Any]) -> tuple[str, str] | None:
    """(the field, what it asks, in words) for a request that asks for JSON of a schema or JSON at all; None for
    any other request."""
    if path == CHAT:
        field, spec = "response_format", doc.get("response_format")
    elif path == RESPONSES:
        text = doc.get("text")
        field, spec = "text.format", text.get("format") if isinstance(text, dict) else None
    else:
        return None
    if not isinstance(spec, dict) or spec.get("type") not in ("json_schema", "json_object"):
        return None
    if spec.get("type") == "json_object":
        return field, f"{field} json_object"
    inner = spec.get("json_schema") if path == CHAT else spec
    name = inner.get("name") if isinstance(inner, dict) else None
    return field, f"{field} '{bounded(name, 64)}'" if isinstance(name, str) else f"{field} json_schema"


def engine_reason(body: bytes) -> str | None:
    """The message of an engine's error answer: a JSON body, or an event stream's first `data:` event, carrying
    `{"error": {"message": ...}}` (both engines) or `{"error": "..."}`; None when it is no such error."""
    text = body.strip()
    if text.startswith(b"data:"):
        text = text[5:].split(b"\n", 1)[0]
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    error = doc.get("error") if isinstance(doc, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    return message if isinstance(message, str) and message else None


def schema_refusal(path: str, doc: dict[str, Any], engine: str, body: bytes) -> tuple[str, dict[str, Any]] | None:
    """(the endpoint's message, the OpenAI error body) when `body` is the engine refusing the schema a
    structured-output request asked for; None otherwise."""
    what = asked(path, doc)
    reason = engine_reason(body) if what is not None else None
    if what is None or reason is None or not any(mark in reason.lower() for mark in _MARKS):
        return None
    field, words = what
    name = ENGINE_NAMES.get(engine, engine)
    message = f"Invalid schema for {words}: {name} could not use it as a constraint: {bounded(reason, 1500)}"
    return message, {"error": {"message": message, "type": "invalid_request_error", "param": field, "code": None}}


def first_event(held: bytes) -> bytes | None:
    """The first whole event of a held event stream (up to its blank line), or None while it is incomplete."""
    for end in (b"\n\n", b"\r\n\r\n"):
        at = held.find(end)
        if at >= 0:
            return held[:at]
    return None


def responses_format_for_llama(doc: dict[str, Any], notes: list[str]) -> None:
    """Rule 7 (serving.normalize): a Responses request's `text.format` (json_schema, json_object) also as the
    chat `response_format` llama-server reads; nothing when the request sets one itself."""
    text = doc.get("text")
    spec = text.get("format") if isinstance(text, dict) else None
    if not isinstance(spec, dict) or "response_format" in doc:
        return
    if spec.get("type") == "json_object":
        doc["response_format"] = {"type": "json_object"}
    elif spec.get("type") == "json_schema" and isinstance(spec.get("schema"), dict):
        inner = {key: spec[key] for key in ("name", "schema", "strict", "description") if key in spec}
        doc["response_format"] = {"type": "json_schema", "json_schema": inner}
    else:
        return
    notes.append(f"text.format {spec['type']} -> response_format (llama-server reads no text.format)")
