"""Ollama's API on the endpoint: `/api/chat`, `/api/generate` and `/api/embed` translated to the engine's OpenAI
routes and their answers back into Ollama's shapes (NDJSON lines for a stream, not SSE), and the routes the
endpoint answers itself (`/api/version`, `/api/tags`, `/api/show`, `/api/ps`; model management refused, naming
the app's own commands).

Written by hand: no library translates between the two. The shapes are Ollama's own (ollama/ollama api/types.go,
server/routes.go at v0.33) as far as the official `ollama` Python client parses them (ollama-python _types.py:
every stream line is one JSON object and a newline, a blank line breaks it; `model_info` is required by `show`;
errors are `{"error": "..."}`). The engine's SSE is read with the one SSE decoder (common.sse); what the endpoint
meters is the engine's stream, before this translation."""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from desktop.core.common.sse import SSEDecoder, parse_chunk

VERSION = "0.33.0"  # the Ollama API these shapes follow; apps gate features on it
API_PREFIX = "/api/"
ENGINE_ROUTES = {"/api/chat": "/v1/chat/completions", "/api/generate": "/v1/chat/completions",
                 "/api/embed": "/v1/embeddings", "/api/embeddings": "/v1/embeddings"}
LOCAL_ROUTES = frozenset({"/api/version", "/api/tags", "/api/show", "/api/ps"})
# what a user does here instead of Ollama's model management
MANAGEMENT = {
    "/api/pull": "download models with `switchyard pull ORG/NAME:QUANT` or the app's Models page",
    "/api/push": "pushing models is not something Switchyard does",
    "/api/create": "give a model another name or settings in models.yaml (`switchyard serve --config`)",
    "/api/copy": "give a model another name in models.yaml (`switchyard serve --config`)",
    "/api/delete": "delete downloaded models with `switchyard rm` or the app's Models page",
}
THINK_EFFORT = {True: "medium", False: "none", "low": "low", "medium": "medium", "high": "high", "max": "high"}
IMAGE_TYPES = {"iVBOR": "png", "/9j/": "jpeg", "R0lGOD": "gif", "UklGR": "webp"}
DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop", "content_filter": "stop"}
WHOLE_LIMIT = 64 << 20  # a whole answer held for translation (an embedding of many inputs is large)


class OllamaRefusal(Exception):
    """A request the endpoint answers itself, in Ollama's error shape."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class OllamaCall:
    """One Ollama request on its way to the engine: what its answer must be translated back into."""

    path: str  # the client's route: /api/chat, /api/generate, /api/embed, /api/embeddings
    model: str  # the name the client asked for, echoed in every answer
    stream: bool
    raw: bool = False  # /api/generate with raw: the engine's /v1/completions
    started: float = field(default_factory=time.monotonic)
    notes: list[str] = field(default_factory=list)  # what the endpoint could not carry over (num_ctx, ...)

    @property
    def chat(self) -> bool:
        return self.path == "/api/chat"


def now_iso() -> str:
    """Ollama's `created_at`: RFC 3339 in UTC with fractions (Go's RFC3339Nano)."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def error_line(message: str) -> bytes:
    """An error in an NDJSON stream: the client raises ResponseError on it."""
    return error_body(message) + b"\n"


# --- requests -----------------------------------------------------------------------------------------------
def translate(path: str, body: bytes) -> tuple[OllamaCall, str, dict[str, Any]]:
    """(call, engine route, OpenAI body) for an Ollama request; OllamaRefusal for one that cannot be served."""
    try:
        data = json.loads(body or b"{}")
    except ValueError as exc:
        raise OllamaRefusal(400, f"invalid JSON in the request body: {exc}") from None
    if not isinstance(data, dict):
        raise OllamaRefusal(400, "the request body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise OllamaRefusal(400, "model is required")
    if path in ("/api/embed", "/api/embeddings"):
        return _embed(path, model, data)
    call = OllamaCall(path, model, stream=data.get("stream", True) is not False)
    out: dict[str, Any] = {"model": model, "stream": call.stream}
    if call.stream:
        out["stream_options"] = {"include_usage": True}
    if path == "/api/chat":
        messages = data.get("messages") or []
        if not isinstance(messages, list):
            raise OllamaRefusal(400, "messages must be a list")
        out["messages"] = _messages(messages)
        tools = data.get("tools")
        if tools:
            out["tools"] = tools
    else:
        for name in ("suffix", "template"):
            if data.get(name):
                raise OllamaRefusal(400, f"`{name}` is not supported here: the engine renders the model's own chat "
                                         "template")
        if data.get("context"):
            call.notes.append("context (token ids of an earlier answer) ignored: send the conversation to /api/chat")
        prompt = data.get("prompt") or ""
        if not prompt and not data.get("images"):
            raise _Load(call)
        if data.get("raw"):
            call.raw = True
            out["prompt"] = prompt
        else:
            messages = [{"role": "system", "content": data["system"]}] if data.get("system") else []
            messages.append(_message({"role": "user", "content": prompt, "images": data.get("images")}))
            out["messages"] = messages
    if not (out.get("messages") or out.get("prompt")):
        raise _Load(call)
    effort = _think(data.get("think"))
    if effort is not None:
        out["reasoning_effort"] = effort
    fmt = _format(data.get("format"))
    if fmt is not None:
        out["response_format"] = fmt
    out.update(_options(data.get("options"), call))
    return call, "/v1/completions" if call.raw else "/v1/chat/completions", out


class _Load(OllamaRefusal):
    """An empty prompt: Ollama's way to load a model, answered at once (the engine is loaded or loading)."""

    def __init__(self, call: OllamaCall) -> None:
        super().__init__(200, "")
        self.call = call


def load_answer(call: OllamaCall) -> dict[str, Any]:
    answer: dict[str, Any] = {"model": call.model, "created_at": now_iso(), "done": True, "done_reason": "load"}
    if call.chat:
        answer["message"] = {"role": "assistant", "content": ""}
    else:
        answer["response"] = ""
    return answer


def is_load(exc: OllamaRefusal) -> OllamaCall | None:
    return exc.call if isinstance(exc, _Load) else None


def _embed(path: str, model: str, data: dict[str, Any]) -> tuple[OllamaCall, str, dict[str, Any]]:
    given = data.get("input") if path == "/api/embed" else data.get("prompt")
    if given is None or given == [] or given == "":
        raise OllamaRefusal(400, "input is required" if path == "/api/embed" else "prompt is required")
    if not isinstance(given, str | list):
        raise OllamaRefusal(400, "input must be a string or a list of strings")
    out: dict[str, Any] = {"model": model, "input": given}
    if isinstance(data.get("dimensions"), int):
        out["dimensions"] = data["dimensions"]
    return OllamaCall(path, model, stream=False), "/v1/embeddings", out


def _messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The conversation, a tool's answer tied to the call it answers: Ollama names the tool (`tool_name`), OpenAI
    the call's id, so the id is the one given to the last call of that name."""
    out, ids = [], {}
    for message in messages:
        converted = _message(message)
        for call in converted.get("tool_calls") or []:
            ids[call["function"]["name"]] = call["id"]
        if converted["role"] == "tool" and not message.get("tool_call_id") and message.get("tool_name") in ids:
            converted["tool_call_id"] = ids[message["tool_name"]]
        out.append(converted)
    return out


def _message(message: Any) -> dict[str, Any]:
    """An Ollama chat message as OpenAI's: images as image parts, tool-call arguments as JSON text, the
    assistant's earlier thinking left out (templates render their own)."""
    if not isinstance(message, dict):
        raise OllamaRefusal(400, "each message must be an object")
    role = message.get("role") or "user"
    content = message.get("content") or ""
    out: dict[str, Any] = {"role": role, "content": content}
    images = message.get("images") or []
    if images:
        parts: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
        parts += [{"type": "image_url", "image_url": {"url": _data_url(str(image))}} for image in images]
        out["content"] = parts
    calls = message.get("tool_calls") or []
    if calls and role == "assistant":
        out["tool_calls"] = [{
            "id": str(call.get("id") or f"call_{index}"), "type": "function",
            "function": {"name": (call.get("function") or {}).get("name", ""),
                         "arguments": _arguments_text((call.get("function") or {}).get("arguments"))},
        } for index, call in enumerate(calls)]
    if role == "tool":
        out["tool_call_id"] = str(message.get("tool_call_id") or message.get("tool_name") or "call_0")
    return out


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments or {})


def _data_url(image: str) -> str:
    if image.startswith("data:"):
        return image
    kind = next((name for prefix, name in IMAGE_TYPES.items() if image.startswith(prefix)), "png")
    return f"data:image/{kind};base64,{image}"


def _think(value: Any) -> str | None:
    if value is None:
        return None
    if value not in THINK_EFFORT:
        raise OllamaRefusal(400, f"think must be true, false, \"low\", \"medium\" or \"high\", not {value!r}")
    return THINK_EFFORT[value]


def _format(value: Any) -> dict[str, Any] | None:
    if value in (None, ""):
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "ollama_format", "schema": value}}
    raise OllamaRefusal(400, f"format must be \"json\" or a JSON schema, not {value!r}")


# options Ollama and the OpenAI routes share a name for (llama-server reads top_k, min_p, repeat_penalty too)
SAME_NAME = ("temperature", "top_p", "top_k", "min_p", "seed", "frequency_penalty", "presence_penalty",
             "repeat_penalty")


def _options(options: Any, call: OllamaCall) -> dict[str, Any]:
    if not isinstance(options, dict):
        return {}
    out = {name: options[name] for name in SAME_NAME if options.get(name) is not None}
    if "repeat_penalty" in out:
        out["repetition_penalty"] = out["repeat_penalty"]  # vLLM's name; each engine ignores the other's
    predict = options.get("num_predict")
    if isinstance(predict, int) and predict > 0:
        out["max_tokens"] = predict
    stop = options.get("stop")
    if stop:
        out["stop"] = stop if isinstance(stop, list) else [stop]
    if options.get("num_ctx") is not None:
        call.notes.append(f"num_ctx {options['num_ctx']} ignored: the context is the one the model is served "
                          "with (serve --ctx, or ctx in models.yaml)")
    return out


# --- answers ------------------------------------------------------------------------------------------------
@dataclass
class _Counts:
    prompt: int | None = None
    output: int | None = None
    prompt_ms: float | None = None  # llama-server's own timings, where it sends them
    predicted_ms: float | None = None
    first_token: float | None = None

    def take(self, data: dict[str, Any]) -> None:
        usage = data.get("usage") or {}
        if isinstance(usage.get("prompt_tokens"), int):
            self.prompt = usage["prompt_tokens"]
        if isinstance(usage.get("completion_tokens"), int):
            self.output = usage["completion_tokens"]
        timings = data.get("timings") or {}
        if isinstance(timings.get("prompt_ms"), int | float):
            self.prompt_ms = float(timings["prompt_ms"])
        if isinstance(timings.get("predicted_ms"), int | float):
            self.predicted_ms = float(timings["predicted_ms"])


def _final(call: OllamaCall, counts: _Counts, finish: str | None) -> dict[str, Any]:
    """The done fields: counts from the engine's usage, durations (ns) from its timings or the endpoint's clock."""
    end = time.monotonic()
    first = counts.first_token or end
    prompt_ns = int(counts.prompt_ms * 1e6) if counts.prompt_ms is not None else int((first - call.started) * 1e9)
    eval_ns = int(counts.predicted_ms * 1e6) if counts.predicted_ms is not None else int((end - first) * 1e9)
    done: dict[str, Any] = {"done": True, "done_reason": DONE_REASONS.get(finish or "stop", "stop"),
                            "total_duration": int((end - call.started) * 1e9), "load_duration": 0,
                            "prompt_eval_count": counts.prompt or 0, "prompt_eval_duration": prompt_ns,
                            "eval_count": counts.output or 0, "eval_duration": eval_ns}
    return done


def _piece(call: OllamaCall, content: str, thinking: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    line: dict[str, Any] = {"model": call.model, "created_at": now_iso()}
    if call.chat:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        line["message"] = message
    else:
        line["response"] = content
        if thinking:
            line["thinking"] = thinking
    return line


def _reasoning(message: dict[str, Any]) -> str:
    return str(message.get("reasoning_content") or message.get("reasoning") or "")


def _ollama_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for call in calls:
        function = call.get("function") or {}
        text = function.get("arguments") or "{}"
        try:
            arguments = json.loads(text) if isinstance(text, str) else text
        except ValueError:
            arguments = {"_raw": text}  # the model wrote arguments that are no JSON: shown, not lost
        out.append({"function": {"name": function.get("name", ""), "arguments": arguments}})
    return out


class NdjsonStream:
    """The engine's chat (or raw completion) SSE stream as Ollama's NDJSON lines: one per delta with text, the
    tool calls gathered into one line, then the done line with the counts."""

    def __init__(self, call: OllamaCall) -> None:
        self.call = call
        self.decoder = SSEDecoder()
        self.counts = _Counts()
        self.finish: str | None = None
        self.calls: dict[int, dict[str, Any]] = {}
        self.failed = False

    def feed(self, data: bytes) -> bytes:
        return b"".join(self._lines(self.decoder.feed(data)))

    def end(self) -> bytes:
        out = b"".join(self._lines(self.decoder.flush()))
        if self.failed:
            return out
        if self.calls:
            gathered = [self.calls[index] for index in sorted(self.calls)]
            out += _dump(_piece(self.call, "", "", _ollama_calls(gathered)))
        return out + _dump({**_piece(self.call, "", ""), **_final(self.call, self.counts, self.finish)})

    def _lines(self, payloads: list[str]) -> list[bytes]:
        lines = []
        for payload in payloads:
            delta = parse_chunk(payload)
            if delta is None or self.failed:
                continue
            if delta.error is not None:
                self.failed = True
                lines.append(error_line(delta.error))
                continue
            self.counts.take(delta.raw)
            for choice in delta.raw.get("choices") or []:
                if choice.get("finish_reason"):
                    self.finish = choice["finish_reason"]
                if self.call.raw:
                    content, thinking = str(choice.get("text") or ""), ""
                else:
                    message = choice.get("delta") or {}
                    content, thinking = str(message.get("content") or ""), _reasoning(message)
                    for part in message.get("tool_calls") or []:
                        self._gather(part)
                if content or thinking:
                    if self.counts.first_token is None:
                        self.counts.first_token = time.monotonic()
                    lines.append(_dump(_piece(self.call, content, thinking)))
        return lines

    def _gather(self, part: dict[str, Any]) -> None:
        index = int(part.get("index") or 0)
        held = self.calls.setdefault(index, {"function": {"name": "", "arguments": ""}})
        function = part.get("function") or {}
        held["function"]["name"] += function.get("name") or ""
        held["function"]["arguments"] += function.get("arguments") or ""


class WholeAnswer:
    """A whole engine answer (chat, raw completion or embeddings), held until complete, as one Ollama object."""

    def __init__(self, call: OllamaCall) -> None:
        self.call = call
        self.parts: list[bytes] = []
        self.size = 0

    def feed(self, data: bytes) -> bytes:
        self.size += len(data)
        if self.size <= WHOLE_LIMIT:
            self.parts.append(data)
        return b""

    def end(self) -> bytes:
        if self.size > WHOLE_LIMIT:
            return error_body(f"the engine's answer is over {WHOLE_LIMIT >> 20} MiB, more than the endpoint "
                              "translates; ask the OpenAI route /v1 instead")
        try:
            data = json.loads(b"".join(self.parts))
        except ValueError:
            return error_body("the engine's answer was not JSON")
        if not isinstance(data, dict):
            return error_body("the engine's answer was not a JSON object")
        return json.dumps(translate_whole(self.call, data)).encode()


def translate_whole(call: OllamaCall, data: dict[str, Any]) -> dict[str, Any]:
    counts = _Counts()
    counts.take(data)
    if call.path in ("/api/embed", "/api/embeddings"):
        vectors = [item.get("embedding") for item in sorted(data.get("data") or [], key=lambda d: d.get("index", 0))]
        if call.path == "/api/embeddings":
            return {"embedding": vectors[0] if vectors else []}
        end = time.monotonic()
        return {"model": call.model, "embeddings": vectors, "total_duration": int((end - call.started) * 1e9),
                "load_duration": 0, "prompt_eval_count": counts.prompt or 0}
    choice = (data.get("choices") or [{}])[0]
    if call.raw:
        content, thinking, calls = str(choice.get("text") or ""), "", []
    else:
        message = choice.get("message") or {}
        content, thinking = str(message.get("content") or ""), _reasoning(message)
        calls = _ollama_calls(message.get("tool_calls") or [])
    counts.first_token = call.started
    return {**_piece(call, content, thinking, calls), **_final(call, counts, choice.get("finish_reason"))}


class ErrorAnswer:
    """An engine's error answer as Ollama's `{"error": "..."}` (its message kept, the OpenAI wrapping gone)."""

    def __init__(self, call: OllamaCall, status: int, hint: str = "") -> None:
        self.call, self.status, self.hint = call, status, hint
        self.parts: list[bytes] = []

    def feed(self, data: bytes) -> bytes:
        if sum(len(p) for p in self.parts) < 1 << 20:
            self.parts.append(data)
        return b""

    def end(self) -> bytes:
        return error_body(engine_message(b"".join(self.parts), self.status) + self.hint)


def engine_message(body: bytes, status: int) -> str:
    """The message inside an engine's (OpenAI-shaped) error answer, else its text."""
    text = body.decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:2000] or f"the engine answered HTTP {status}"
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    if error:
        return str(error)
    return str(data.get("message") or data.get("detail") or text)[:2000] if isinstance(data, dict) else text[:2000]


EMBED_HINT = ("; to embed, serve an embedding model: a models.yaml entry with the model and `kind: embedding` "
              "(`switchyard serve --config models.yaml`)")


Rewriter = NdjsonStream | WholeAnswer | ErrorAnswer


def rewriter_for(call: OllamaCall, status: int, streamed: bool) -> Rewriter:
    if status >= 400:
        embed = call.path in ("/api/embed", "/api/embeddings")
        return ErrorAnswer(call, status, EMBED_HINT if embed else "")
    return NdjsonStream(call) if streamed else WholeAnswer(call)


def content_type(streamed: bool) -> bytes:
    return b"application/x-ndjson" if streamed else b"application/json; charset=utf-8"


def _dump(line: dict[str, Any]) -> bytes:
    return json.dumps(line, ensure_ascii=False).encode() + b"\n"


# --- what the endpoint answers itself -------------------------------------------------------------------------
@dataclass(frozen=True)
class Served:
    """One model the endpoint serves, as Ollama's listings show it."""

    name: str
    model: str  # the GGUF path, Hugging Face folder, repo id or `demo` the engine serves
    engine: str | None  # None while nothing serves it (a models.yaml model not loaded)
    context: int  # tokens per request, 0 when unknown
    started_at: float  # wall clock: when the endpoint began serving it
    vision: bool = False  # it sees images: Ollama's "vision" capability (apps offer an image upload on it)
    kind: str = "chat"  # models.yaml `kind`: an embedder's capability is Ollama's "embedding"


@functools.lru_cache(maxsize=32)
def _facts(model: str) -> Any:
    """The served model's facts, read once per path: the listings are answered on the endpoint's event loop, and
    a large GGUF's header is not read again for every /api/tags."""
    from desktop.core.models.facts import facts_for

    try:
        return facts_for(model)
    except Exception:  # a listing never fails for one model's metadata: it shows less
        return None


def _details(model: str) -> dict[str, Any]:
    facts = _facts(model)
    if facts is None:
        return {"parent_model": "", "format": "", "family": "", "families": [], "parameter_size": "",
                "quantization_level": ""}
    family = str(getattr(facts, "architecture", "") or "")
    params = float(getattr(facts, "params", 0) or 0)
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M" if params else ""
    quant = str(getattr(facts, "quantization", "") or "").removeprefix("gguf:").upper()
    return {"parent_model": "", "format": "gguf" if getattr(facts, "is_gguf", False) else "safetensors",
            "family": family, "families": [family] if family else [], "parameter_size": size,
            "quantization_level": quant}


def _digest(served: Served) -> str:
    import hashlib

    return hashlib.sha256(f"{served.name}\0{served.model}".encode()).hexdigest()


def _listed(served: Served) -> dict[str, Any]:
    facts = _facts(served.model)
    stamp = datetime.fromtimestamp(served.started_at, UTC).isoformat().replace("+00:00", "Z")
    return {"name": served.name, "model": served.name, "modified_at": stamp,
            "size": int(getattr(facts, "weights_bytes", 0) or 0), "digest": _digest(served),
            "details": _details(served.model)}


def find(served: list[Served], name: str) -> Served | None:
    """The served model a client names: exactly, or without Ollama's `:latest` tag."""
    for entry in served:
        if name in (entry.name, f"{entry.name}:latest"):
            return entry
    return None


def local_answer(path: str, method: str, body: bytes, served: list[Served]) -> tuple[int, dict[str, Any]]:
    """(status, JSON) for the routes the endpoint answers itself."""
    if path == "/api/version":
        return 200, {"version": VERSION}
    if path == "/api/tags":
        return 200, {"models": [_listed(entry) for entry in served]}
    if path == "/api/ps":
        return 200, {"models": [{**_listed(entry), "size_vram": 0, "expires_at": "0001-01-01T00:00:00Z",
                                 "context_length": entry.context} for entry in served if entry.engine]}
    if path == "/api/show":
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            return 400, {"error": "invalid JSON in the request body"}
        name = str((data.get("model") or data.get("name") or "") if isinstance(data, dict) else "")
        entry = find(served, name)
        if entry is None:
            return 404, {"error": f"model '{name}' not found"}
        return 200, _show(entry)
    return 404, {"error": f"no route {method} {path}"}


def _show(entry: Served) -> dict[str, Any]:
    facts = _facts(entry.model)
    family = str(getattr(facts, "architecture", "") or "")
    info: dict[str, Any] = {"general.architecture": family,
                            "general.parameter_count": int(getattr(facts, "params", 0) or 0)}
    if family and facts is not None:
        info[f"{family}.context_length"] = int(getattr(facts, "context_length", 0) or 0)
    listed = _listed(entry)
    parameters = f"num_ctx {entry.context}" if entry.context else ""
    return {"modelfile": "", "parameters": parameters, "template": "", "details": listed["details"],
            "model_info": info, "capabilities": capabilities(entry), "modified_at": listed["modified_at"]}


def capabilities(entry: Served) -> list[str]:
    """Ollama's capability names for a served model (`/api/show`), as its own server reports them."""
    if entry.kind != "chat":  # a reranker has no Ollama capability: /api/embed is an embedder's
        return ["embedding"] if entry.kind == "embedding" else []
    return ["completion", "tools", *(["vision"] if entry.vision else [])]


def management(path: str) -> str | None:
    """What to do instead, for Ollama's model-management routes (None for any other path)."""
    for route, instead in MANAGEMENT.items():
        if path == route or path.startswith("/api/blobs"):
            return f"{path} is not supported here: {instead if path == route else 'models are files here'}"
    return None
