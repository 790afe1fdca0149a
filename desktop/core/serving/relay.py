"""What an engine's answer becomes on its way to the client, parsed by llhttp (httptools) as its bytes arrive: the
head the endpoint sends instead of the engine's (its own framing, no hop-by-hop or CORS headers), the body passed
on chunk by chunk (metered, rewritten by a reasoning or Responses mirror where one applies), and the engine's
error answers: a 400 to a shaped request held until whole, to be answered in the endpoint's words or retried with
a smaller max_tokens (serving.refusals), an error in a stream the endpoint had begun said as one SSE error event.

ResponseRelay is the parser's protocol object: upstream.Exchange is one, and adds the connection to the engine,
the timeouts and how the exchange ends. Apart from it so that each holds one concern; the parser's callbacks are
the Exchange's own methods (inherited), so a streamed chunk takes no extra call.
"""

from __future__ import annotations

import json

import httptools

from desktop.core.common.sse import LAST_CHUNK, chunk, error_event
from desktop.core.serving import ollama, refusals, structured
from desktop.core.serving.http1 import HOP_HEADERS, Incoming
from desktop.core.serving.metering import StreamMeter
from desktop.core.serving.reasoning import StreamMirror, WholeMirror
from desktop.core.serving.responses import ResponsesCompleter, rewriter_for
from desktop.core.serving.router import Upstream

KEPT_BODY_BYTES = 1 << 20  # of a non-streamed answer, for its token count


class ResponseRelay:
    """The state of one engine answer relayed to the client, and the parser callbacks that build it: bytes for
    the client accumulate in `out` (written by Exchange._flush, once per batch of upstream bytes)."""

    parser: httptools.HttpResponseParser  # fed by the Exchange, whose callbacks these are

    def __init__(self, request: Incoming, upstream: Upstream, meter: StreamMeter, head_sent: bool) -> None:
        self.request = request
        self.upstream = upstream
        self.meter = meter
        self.now = 0.0  # when upstream bytes last arrived; 0.0 until the first do (Exchange.data_received)
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.answered = False  # the response head was sent to the client: no retry from here on
        self.streamed = False
        self.framing = "length"  # to the client: "length", "chunked", "close" or "none"
        self.upstream_framed = True  # the engine said how long its body is (length or chunked)
        self.upstream_chunked = False
        self.upstream_keep_alive = False  # the engine will take another request on this connection
        self.complete = False
        self.out: list[bytes] = []  # what is to be written to the client (Exchange._flush)
        self.kept: list[bytes] = []
        self.kept_size = 0
        # The endpoint already sent a 200 event-stream head (it told the client its model loads): the engine's
        # head is not passed on, its body is chunked, and an engine error becomes an SSE error event.
        self.head_sent = head_sent
        self.engine_error = False
        # one reasoning schema (serving.reasoning); a Responses stream finished (serving.responses)
        self.mirror: StreamMirror | WholeMirror | ResponsesCompleter | ollama.Rewriter | None = None
        # An engine's error answer to a shaped request, held until it is complete: it may be a refusal the
        # endpoint answers in its own words or retries with a smaller max_tokens (serving.refusals).
        self.holding = False
        self.held_head = b""
        # A streamed structured-output request: its head is held until the first event, which may be the engine
        # refusing the schema (vLLM streams that as a 200), to be answered as a 400 instead (serving.structured).
        self.first_event_only = False
        self.replaced = False  # the endpoint answered instead: the rest of the engine's answer is dropped
        self.retry_wanted = False
        self.told_instead: str | None = None  # the endpoint's own answer replaced the engine's (its message)

    # --- httptools callbacks ---
    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        request = self.request
        if self.head_sent:
            self.streamed = any(n.lower() == b"content-type" and b"text/event-stream" in v for n, v in self.headers)
            self.engine_error = self.status >= 400
            self.framing = "chunked"
            self.upstream_framed = any(n.lower() in (b"content-length", b"transfer-encoding") for n, _ in self.headers)
            self.answered = True
            self.mirror = rewriter_for(request.path, self.status, self.streamed)
            return
        # (an Ollama request's errors go through its translation, never held: serving.ollama.ErrorAnswer)
        self.holding = self.status == 400 and request.shape is not None and request.ollama is None
        lines = [b"HTTP/1.1 %d %s" % (self.status, self.reason or b"Status")]
        note = adjusted(request)
        if note:
            lines.append(b"X-Switchyard-Adjusted: " + ascii_header(note))
        length: bytes | None = None
        chunked = False
        for name, value in self.headers:
            lower = name.lower()
            if lower == b"content-length":
                length = value
            elif lower == b"transfer-encoding":
                chunked = self.upstream_chunked = b"chunked" in value.lower()
            elif lower.startswith(b"access-control-"):
                continue  # CORS is the endpoint's decision (request.cors), not the engine's
            elif lower.decode("latin-1") not in HOP_HEADERS:
                if lower == b"content-type" and b"text/event-stream" in value:
                    self.streamed = True
                if lower == b"content-type" and request.ollama is not None:
                    continue  # the translation's own (below)
                lines.append(name + b": " + value)
        no_body = request.method == "HEAD" or self.status < 200 or self.status in (204, 304)
        close = not request.keep_alive
        if request.ollama is not None:
            lines.append(b"Content-Type: " + ollama.content_type(self.streamed and self.status < 400))
            self.mirror = None if no_body else ollama.rewriter_for(request.ollama, self.status, self.streamed)
        else:
            self.mirror = None if no_body else rewriter_for(request.path, self.status, self.streamed)
        if no_body:
            self.framing = "none"
            if length is not None:
                lines.append(b"Content-Length: " + length)
        elif length is not None and not chunked and self.mirror is None:
            self.framing = "length"
            lines.append(b"Content-Length: " + length)
        elif not request.http10:  # (a rewritten answer's length is known only at its end: chunked)
            self.framing = "chunked"
            self.upstream_framed = chunked or length is not None
            lines.append(b"Transfer-Encoding: chunked")
        else:
            self.framing = "close"
            self.upstream_framed = chunked or length is not None
            close = True
        if close:
            lines.append(b"Connection: close")
            request.keep_alive = False
        if self.status == 200 and self.streamed and request.shape is not None and request.ollama is None \
                and not request.http10 and structured.asked(request.path, request.shape.doc) is not None:
            self.holding = self.first_event_only = True
        self.out.append(b"\r\n".join(lines) + b"\r\n" + request.cors + b"\r\n")
        if self.holding:
            self.held_head = self.out.pop()
            return
        self.answered = True
        if no_body:
            self.complete = True

    def on_body(self, body: bytes) -> None:
        if self.complete or self.replaced:
            return
        if self.holding:
            self.kept.append(body)
            self.kept_size += len(body)
            if self.first_event_only:
                self._judge_first_event(False)
            elif self.kept_size > refusals.HOLD_BYTES:
                self._release_held()  # too large to be a refusal the endpoint reads: the engine's answer goes on
            return
        if self.engine_error:  # said as one SSE error event when the body is complete
            self.kept.append(body)
            return
        if self.streamed:
            self.meter.feed(body, self.now)
        elif self.kept_size < KEPT_BODY_BYTES:
            self.kept.append(body)
            self.kept_size += len(body)
        if self.mirror is not None:
            body = self.mirror.feed(body)
            if not body:
                return
        if self.framing == "chunked":
            self.out.append(chunk(body))
        else:
            self.out.append(body)

    def on_message_complete(self) -> None:
        if self.complete:
            return
        if self.holding and self.first_event_only:
            self._judge_first_event(True)  # before `complete`: what it passes on goes through on_body
        self.complete = True
        self.upstream_keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the callback returns
        if self.holding:
            self._judge_held()
            if self.holding:
                return
        if self.engine_error:
            held = b"".join(self.kept)
            refusal = refusals.read(self.status, held) if self.request.shape is not None else None
            if refusal is not None:  # the client has the endpoint's event-stream head: the refusal as an event
                self.told_instead = refusals.context_message(refusal, self.request.info.model or "", self.upstream.engine,
                                                             self.upstream.window)
                self.out.append(chunk(refusals.stream_error(self.request.path, self.told_instead)))
            elif (refused := self._schema_refusal(held)) is not None:
                self.told_instead = refused[0]
                self.out.append(chunk(error_event(refused[0], "invalid_request_error", 400)))
            else:
                text = held.decode("utf-8", "replace")[:2000]
                self.out.append(chunk(error_event(f"the engine answered HTTP {self.status}: {text}", "upstream_error",
                                                  self.status, anthropic=self.request.path.startswith("/v1/messages"))))
        self._end_body()

    def _judge_held(self) -> None:
        """The engine's whole 400 to a shaped request: a refusal to answer in the endpoint's words or to retry
        with a smaller max_tokens (serving.refusals), else the engine's own answer as it came."""
        request, upstream, shape = self.request, self.upstream, self.request.shape
        held = b"".join(self.kept)
        refusal = refusals.read(self.status, held)
        if refusal is None:
            refused = self._schema_refusal(held)
            if refused is None:
                self._release_held()
            else:
                self._answer_instead(*refused)
            return
        if refusal.prompt_fits and shape is not None and shape.cap is None:
            shape.cap = refusal.context - refusal.prompt
            self.retry_wanted = True  # the engine generated nothing: send it again at once (Forwarder)
            return
        message = refusals.context_message(refusal, request.info.model or upstream.served_model_name,
                                           upstream.engine, upstream.window)
        self._answer_instead(message, refusals.error_body(request.path, message))

    def _schema_refusal(self, held: bytes) -> tuple[str, dict[str, object]] | None:
        shape = self.request.shape
        return structured.schema_refusal(self.request.path, shape.doc, self.upstream.engine, held) \
            if shape is not None else None

    def _answer_instead(self, message: str, error: dict[str, object]) -> None:
        """A 400 in the endpoint's words replaces the engine's held answer."""
        request = self.request
        body = json.dumps(error).encode()
        head = [b"HTTP/1.1 400 Bad Request", b"Content-Type: application/json",
                b"Content-Length: %d" % len(body)]
        if not request.keep_alive:
            head.append(b"Connection: close")
        self.out.append(b"\r\n".join(head) + b"\r\n" + request.cors + b"\r\n" + body)
        self.framing = "length"
        self.kept = [body]
        self.kept_size = len(body)
        self.holding = self.first_event_only = False
        self.answered = True
        self.told_instead = message

    def _judge_first_event(self, whole: bool) -> None:
        """A streamed structured request's first event (or its whole answer, `whole`): the engine refusing the
        schema becomes a 400; anything else goes on as the engine sent it, from its first byte."""
        held = b"".join(self.kept)
        event = structured.first_event(held) or (held if whole else None)
        if event is None and self.kept_size <= refusals.HOLD_BYTES:
            return  # the first event is not whole yet
        refused = self._schema_refusal(event) if event is not None else None
        if refused is not None:
            self.status = 400
            self.streamed = False
            self.mirror = None
            self._answer_instead(*refused)
            self.replaced = True
            return
        self.holding = self.first_event_only = False
        self.kept, self.kept_size = [], 0
        self.answered = True
        self.out.append(self.held_head)
        self.held_head = b""
        if held:  # (an empty chunk would end a chunked answer early)
            self.on_body(held)

    def _release_held(self) -> None:
        """Pass the held answer on as the engine sent it."""
        self.holding = False
        self.answered = True
        held = b"".join(self.kept)
        self.out.append(self.held_head + (chunk(held) if self.framing == "chunked" and held else held))
        self.held_head = b""

    def _end_body(self) -> None:
        rest = self.mirror.end() if self.mirror is not None else b""
        if rest:
            self.out.append(chunk(rest) if self.framing == "chunked" else rest)
        if self.framing == "chunked":
            self.out.append(LAST_CHUNK)


def adjusted(request: Incoming) -> str | None:
    """What the endpoint changed in the request: the rules' notes (serving.normalize), and what an Ollama
    request could not carry over (serving.ollama: num_ctx, context)."""
    notes = [request.shape.note] if request.shape is not None and request.shape.notes else []
    notes += request.ollama.notes if request.ollama is not None else []
    return "; ".join(n for n in notes if n) or None


def ascii_header(text: str | None) -> bytes:
    """A note as a header value: printable ASCII only, at most 400 characters (a client named the tools)."""
    value = "".join(c if " " <= c <= "~" else "?" for c in (text or ""))[:400]
    return value.encode("ascii")
