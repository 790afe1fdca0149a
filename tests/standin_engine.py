"""A stand-in engine server for endpoint tests: an OpenAI-ish HTTP server started like a real engine (a process
with a log), which can fail to load with the engine's out-of-memory log line when its context is too large
(a fake memory budget), and which records the calls to vLLM's sleep-mode routes. Stdlib only: it starts in
~0.1 s, so tests of the endpoint's engine management run without the real engines.

Besides the OpenAI completions it answers what the coding agents use (tests/test_coding_agents.py): Anthropic
Messages (`/v1/messages`, whole and streamed with Anthropic's event sequence; `/v1/messages/count_tokens`) for
Claude Code, and the OpenAI Responses API (`/v1/responses`, whole and streamed with the event sequence Codex's
parser reads) for the Codex CLI. Its token counts are `count_tokens`: a quarter of the prompt's JSON characters.
`--omit EVENT` leaves an event out of those streams (a test that a broken stream fails); `--bodies FILE` records
every request's path, headers and body."""

from __future__ import annotations

import argparse
import json
import os
import socketserver
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--uds", help="listen on this Unix socket instead of a TCP port (like vLLM's --uds)")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--name", default="standin")
    parser.add_argument("--fail-ctx-above", type=int, default=0, help="fail to load (OOM line) above this ctx")
    parser.add_argument("--oom-line", default="llama_init_from_model: failed to allocate buffer for kv cache")
    parser.add_argument("--calls", help="append every sleep/wake call to this file")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--hold-file", help="while this file exists, streams pause after their first chunk")
    parser.add_argument("--load-seconds", type=float, default=0.0, help="how long 'loading the model' takes")
    parser.add_argument("--gpu-file", help="the NVML stand-in's free-memory file (NVML_SHIM_FREE_FILE): written with "
                                           "--free-awake once loaded and at a full wake, --free-asleep at /sleep")
    parser.add_argument("--free-awake", default="")
    parser.add_argument("--free-asleep", default="")
    parser.add_argument("--refuse", action="append", default=[], choices=["tools", "json_schema", "images", "reasoning"],
                        help="answer 400 to requests using this capability, as vLLM does without the flag for it")
    parser.add_argument("--embeds", action="store_true", help="answer /v1/embeddings as an embedder does")
    parser.add_argument("--requests", help="append one JSON line per inference request: its path, `user` and "
                                           "capabilities")
    parser.add_argument("--bodies", help="append one JSON line per POST: its path (with the query), headers (keys "
                                         "redacted) and body")
    parser.add_argument("--context", type=int, default=0,
                        help="tokens per request (by count_tokens): refuse a longer prompt in vLLM 0.32's words and "
                             "prompt + max_tokens beyond it in vLLM 0.9's (\"you requested ... in the completion\")")
    parser.add_argument("--think", action="store_true",
                        help="think first, as a reasoning model behind llama-server does: reasoning_content "
                             "deltas (a whole answer's message.reasoning_content) before the answer, unless the "
                             "request turns thinking off in llama-server's own ways (chat_template_kwargs "
                             "enable_thinking false, reasoning_effort \"none\", reasoning_budget_tokens 0)")
    parser.add_argument("--omit", action="append", default=[], metavar="EVENT",
                        help="leave this event type out of /v1/messages and /v1/responses streams")
    args, _rest = parser.parse_known_args()

    print(f"{args.name}: loading model (ctx {args.ctx})", flush=True)
    if args.fail_ctx_above and args.ctx > args.fail_ctx_above:
        print(args.oom_line, flush=True)
        return 1
    threading.Event().wait(args.load_seconds)  # the stand-in's "load" (the test decides how long)
    sleeping = threading.Event()

    def gpu_memory(text: str) -> None:  # what this "engine" holds on the stand-in GPU, as NVML will report it
        if args.gpu_file and text:
            with open(args.gpu_file, "w") as handle:
                handle.write(text)

    gpu_memory(args.free_awake)
    lock = threading.Lock()  # one writer at a time on the --requests / --bodies files
    dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *items: object) -> None:  # noqa: A002
            print(f"{args.name}: {format % items}", flush=True)

        def _json(self, status: int, data: object) -> None:
            body = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": "switchyard", "object": "model"}]})
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            path = self.path.split("?")[0]
            if path in ("/sleep", "/wake_up", "/collective_rpc"):
                if not dev_mode:  # like vLLM: the routes exist only with VLLM_SERVER_DEV_MODE=1
                    self._json(404, {"detail": "Not Found"})
                    return
                if args.calls:
                    method = json.loads(raw or b"{}").get("method") if path == "/collective_rpc" else None
                    with open(args.calls, "a") as handle:
                        handle.write(self.path + (f":{method}" if method else "") + "\n")
                if path == "/sleep":
                    sleeping.set()
                    gpu_memory(args.free_asleep)
                elif self.path in ("/wake_up", "/wake_up?tags=kv_cache"):  # fully awake again
                    sleeping.clear()
                    gpu_memory(args.free_awake)
                self._json(200, {})
                return
            if path == "/v1/embeddings" and args.embeds:  # an embedder's answer (issue 57): a vector per input
                asked = json.loads(raw or b"{}").get("input")
                inputs = asked if isinstance(asked, list) else [asked]
                self._json(200, {"object": "list", "model": args.name, "usage": {"prompt_tokens": len(inputs),
                                                                                 "total_tokens": len(inputs)},
                                 "data": [{"object": "embedding", "index": i, "embedding": [float(len(str(t))), 1.0]}
                                          for i, t in enumerate(inputs)]})
                return
            if path not in INFERENCE:
                self._json(404, {"error": "not found"})
                return
            if sleeping.is_set():
                self._json(503, {"error": "the engine sleeps"})
                return
            body = json.loads(raw or b"{}")
            if args.bodies:
                headers = {k.lower(): ("<redacted>" if k.lower() in SECRET_HEADERS else v)
                           for k, v in self.headers.items()}
                with lock, open(args.bodies, "a") as handle:
                    handle.write(json.dumps({"path": self.path, "headers": headers, "body": body}) + "\n")
            if path == "/v1/messages/count_tokens":
                self._json(200, {"input_tokens": count_tokens(body)})
                return
            chat = path.endswith("chat/completions")
            used = _capabilities(body)
            if args.requests:
                with lock, open(args.requests, "a") as handle:
                    handle.write(json.dumps({"path": path, "user": body.get("user"), "capabilities": used}) + "\n")
            if args.context and path != "/v1/messages/count_tokens":
                too_long = context_refusal(body, args.context)
                if too_long:
                    self._json(400, {"error": {"message": too_long, "type": "BadRequestError", "code": 400}})
                    return
            refused = [name for name in used if name in args.refuse]
            if refused:
                self._json(400, {"error": {"message": REFUSALS[refused[0]], "type": "BadRequestError", "code": 400}})
                return
            if path in ("/v1/messages", "/v1/responses"):
                pieces = [f"{args.name}{index} " for index in range(args.chunks)]
                events = (anthropic_message if path == "/v1/messages" else responses_events)(body, pieces)
                if not body.get("stream"):
                    self._json(200, events[-1][1] if path == "/v1/messages" else events[-1][1]["response"])
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for name, data in events[:-1] if path == "/v1/messages" else events:
                    if name not in args.omit:
                        payload = f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
                        self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                return

            def choice(text: str) -> dict[str, object]:
                return {"index": 0, "delta": {"content": text}, "finish_reason": None} if chat else \
                    {"index": 0, "text": text, "finish_reason": None}

            kwargs = body.get("chat_template_kwargs") or {}
            thinks = chat and args.think and not (kwargs.get("enable_thinking") is False
                                                  or body.get("reasoning_effort") == "none"
                                                  or body.get("reasoning_budget_tokens") == 0)
            thought = f"{args.name} thinks. "
            if not body.get("stream"):
                message = {"index": 0, "message": {"role": "assistant", "content": f"hi from {args.name}"},
                           "finish_reason": "stop"} if chat else {"index": 0, "text": f"hi from {args.name}",
                                                                  "finish_reason": "stop"}
                if thinks:
                    message["message"]["reasoning_content"] = thought  # type: ignore[index]
                self._json(200, {"id": "x", "object": "chat.completion" if chat else "text_completion",
                                 "created": 0, "model": body.get("model", ""), "choices": [message],
                                 "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def send(data: object) -> None:
                payload = f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
                self.wfile.flush()

            if thinks:
                send({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": body.get("model", ""),
                      "choices": [{"index": 0, "delta": {"reasoning_content": thought}, "finish_reason": None}]})
            for index in range(args.chunks):
                send({"id": "x", "object": "chat.completion.chunk" if chat else "text_completion", "created": 0,
                      "model": body.get("model", ""), "choices": [choice(f"{args.name}{index} ")]})
                if index == 0 and args.hold_file:
                    while os.path.exists(args.hold_file):
                        threading.Event().wait(0.05)  # the stand-in "computes" while the test holds it
            send({"id": "x", "object": "text_completion", "created": 0, "model": "", "choices": [],
                  "usage": {"prompt_tokens": 1, "completion_tokens": args.chunks, "total_tokens": args.chunks + 1}})
            send("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    if args.uds:
        class UnixHandler(Handler):
            def address_string(self) -> str:
                return "unix"

        server: socketserver.BaseServer = _UnixHTTPServer(args.uds, UnixHandler)
        print(f"{args.name}: listening on unix://{args.uds}", flush=True)
    else:
        server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
        print(f"{args.name}: listening on http://127.0.0.1:{args.port}", flush=True)
    server.daemon_threads = True  # type: ignore[attr-defined]
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


INFERENCE = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses")
SECRET_HEADERS = ("authorization", "x-api-key")


def count_tokens(body: dict[str, Any]) -> int:
    """The stand-in's token count of a request's prompt: a quarter of its prompt fields' JSON characters (system,
    messages, tools; the Responses API's instructions and input), at least 1. Used for every usage it reports and
    for /v1/messages/count_tokens alike."""
    fields = ("system", "messages", "tools", "instructions", "input", "prompt")
    return max(1, len(json.dumps([body.get(name) for name in fields])) // 4)


def context_refusal(body: dict[str, Any], context: int) -> str | None:
    """vLLM's refusal of a request that does not fit `context` tokens, or None: 0.32's for a prompt too long
    (vllm/renderers/params.py), 0.9's for prompt + max_tokens (serving_engine.py, before get_max_tokens lowered
    it itself)."""
    prompt = count_tokens(body)
    asked = next((body[k] for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")
                  if isinstance(body.get(k), int)), 0)
    if prompt > context:
        return (f"This model's maximum context length is {context} tokens. However, your prompt contains {prompt} "
                "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
                "of the input prompt.")
    if prompt + asked > context:
        return (f"This model's maximum context length is {context} tokens. However, you requested {prompt + asked} "
                f"tokens ({prompt} in the messages, {asked} in the completion). Please reduce the length of the "
                "messages or completion.")
    return None


def anthropic_message(body: dict[str, Any], pieces: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """A streamed Anthropic Messages answer, event by event as the API sends them (message_start, content_block_start,
    ping, content_block_delta..., content_block_stop, message_delta with usage, message_stop), then ("message", the
    whole answer) as the non-streamed reply would be."""
    text, model, ident = "".join(pieces), body.get("model", ""), f"msg_standin{uuid.uuid4().hex[:12]}"
    usage = {"input_tokens": count_tokens(body), "output_tokens": len(pieces),
             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    message = {"id": ident, "type": "message", "role": "assistant", "model": model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 1}}
    return [
        ("message_start", {"type": "message_start", "message": message}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("ping", {"type": "ping"}),
        *[("content_block_delta", {"type": "content_block_delta", "index": 0,
                                   "delta": {"type": "text_delta", "text": piece}}) for piece in pieces],
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"output_tokens": len(pieces)}}),
        ("message_stop", {"type": "message_stop"}),
        ("message", {**message, "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
                     "usage": usage}),
    ]


def responses_events(body: dict[str, Any], pieces: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """A streamed OpenAI Responses answer: response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta..., response.output_text.done,
    response.content_part.done, response.output_item.done, response.completed (with usage; its `response` is the
    non-streamed reply). Codex reads the items from output_item.done and needs response.completed before the end
    of the stream (codex-rs/codex-api/src/sse/responses.rs)."""
    text, ident, item_id = "".join(pieces), f"resp_standin{uuid.uuid4().hex[:12]}", f"msg_standin{uuid.uuid4().hex[:12]}"
    prompt = count_tokens(body)
    response: dict[str, Any] = {"id": ident, "object": "response", "created_at": int(time.time()),
                                "status": "in_progress", "model": body.get("model", ""), "output": [], "usage": None,
                                "error": None, "incomplete_details": None}
    part = {"type": "output_text", "text": "", "annotations": []}
    item = {"id": item_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
    done_part = {**part, "text": text}
    done_item = {**item, "status": "completed", "content": [done_part]}
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": response}),
        ("response.in_progress", {"response": response}),
        ("response.output_item.added", {"output_index": 0, "item": item}),
        ("response.content_part.added", {**where, "part": part}),
        *[("response.output_text.delta", {**where, "delta": piece}) for piece in pieces],
        ("response.output_text.done", {**where, "text": text}),
        ("response.content_part.done", {**where, "part": done_part}),
        ("response.output_item.done", {"output_index": 0, "item": done_item}),
        ("response.completed", {"response": {
            **response, "status": "completed", "output": [done_item],
            "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": len(pieces), "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt + len(pieces)}}}),
    ]
    return [(name, {"type": name, "sequence_number": number, **data}) for number, (name, data) in enumerate(events)]


# vLLM 0.32's own words when the flag for a capability is missing (tools: serving/chat's check)
REFUSALS = {
    "tools": '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
    "json_schema": "structured outputs are not supported by this stand-in",
    "images": "this model does not support image input",
    "reasoning": "reasoning is not supported by this stand-in",
}


def _capabilities(body: dict[str, object]) -> list[str]:
    """What a request uses, read from its parsed body as an engine would."""
    used = []
    if body.get("tools"):
        used.append("tools")
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") in ("json_schema", "json_object"):
        used.append("json_schema")
    messages = body.get("messages") if isinstance(body.get("messages"), list) else []
    if any(isinstance(m, dict) and isinstance(m.get("content"), list) and
           any(isinstance(part, dict) and part.get("type") == "image_url" for part in m["content"])
           for m in messages):  # type: ignore[union-attr]
        used.append("images")
    if body.get("reasoning_effort"):
        used.append("reasoning")
    return used


class _UnixHTTPServer(socketserver.ThreadingUnixStreamServer):
    """http.server over a Unix socket (BaseHTTPRequestHandler wants a host and port it does not need here)."""

    def server_bind(self) -> None:
        socketserver.UnixStreamServer.server_bind(self)
        self.server_name, self.server_port = "localhost", 0


if __name__ == "__main__":
    sys.exit(main())
