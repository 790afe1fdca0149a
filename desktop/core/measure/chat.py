"""One streamed chat answer from an OpenAI-compatible endpoint, as any client would ask it: the app's "Try it" pane.

The request is built by the load generator's `Target` (same URL, headers and body rules: chat API, `stream`,
`stream_options.include_usage`) and decoded by `common.sse`; here the answer stops at the model's end (no
`ignore_eos`), and its speed is measured from the stream: time to the first token and output tokens per second
over the generation (first token to last). Blocking: the GUI runs it in a worker and calls `stop()` from its own
thread, which closes the streaming connection (the server then stops generating for it); a stop asked before the
response has begun takes effect as soon as it begins.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from desktop.core.common.errors import SwitchyardError
from desktop.core.common.sse import iter_deltas
from desktop.core.measure.loadgen.client import Target, _error_text
from desktop.core.measure.loadgen.workload import RequestSpec

CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ChatAnswer:
    """The answer and how fast it came."""

    text: str
    output_tokens: int
    tokens_counted: bool  # True: the server's usage; False: one per streamed chunk (an estimate)
    ttft_s: float | None
    seconds: float  # request sent -> stream ended
    tokens_per_s: float | None  # generation speed: tokens after the first / (last token - first token)
    finish_reason: str | None
    stopped: bool  # the user stopped it; `text` is what had arrived

    def summary(self) -> str:
        """One line for the pane: '42 tokens · 35.1 tokens/s · first token 0.12 s · 1.3 s'."""
        parts = [f"{self.output_tokens} token{'s' if self.output_tokens != 1 else ''}"
                 + ("" if self.tokens_counted else " (counted from the stream)")]
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:.1f} tokens/s")
        if self.ttft_s is not None:
            parts.append(f"first token {self.ttft_s:.2f} s")
        parts.append(f"{self.seconds:.1f} s")
        if self.stopped:
            parts.append("stopped")
        elif self.finish_reason == "length":
            parts.append("cut at the token limit")
        return " · ".join(parts)


class ChatStream:
    """One chat request; `run()` blocks (call it in a worker), `stop()` may be called from any thread."""

    def __init__(self, base_url: str, messages: list[dict[str, str]], *, model: str | None = None,
                 temperature: float = 0.7, max_tokens: int = 512, api_key: str | None = None,
                 timeout: float = 600.0) -> None:
        self.target = Target(base_url, api="chat", model=model, api_key=api_key, ignore_eos=False,
                             temperature=temperature)
        self.spec = RequestSpec(messages=[dict(m) for m in messages], max_tokens=max_tokens)
        self.timeout = timeout
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._response: httpx.Response | None = None

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Stop the answer now: the connection is closed, so the server stops generating for it."""
        self._stop.set()
        with self._lock:
            response = self._response
        if response is not None:
            try:
                response.close()
            except (httpx.HTTPError, OSError, RuntimeError):  # closing a stream being read: the reader ends
                pass

    def run(self, progress: Callable[[str], None] | None = None) -> ChatAnswer:
        """Send the request and stream the answer, calling `progress(text)` with each new piece of text."""
        sent = time.perf_counter()
        text: list[str] = []
        first: float | None = None
        last = sent
        chunks = 0
        usage: dict[str, Any] | None = None
        finish: str | None = None
        try:
            with self.target.client(timeout=httpx.Timeout(self.timeout, connect=CONNECT_TIMEOUT_S)) as client, \
                    client.stream(
                    "POST", self.target.url, json=self.target.body(self.spec, self.target.model),
                    headers=self.target.headers()) as response:
                with self._lock:
                    self._response = response
                if self._stop.is_set():
                    return self._answer(text, chunks, usage, sent, first, last, finish)
                if response.status_code != 200:
                    body = response.read().decode("utf-8", "replace")
                    raise SwitchyardError(f"the endpoint answered HTTP {response.status_code}: {_error_text(body)}",
                                          "is an engine serving? Start one above, then try again")
                for delta in iter_deltas(response.iter_bytes()):
                    if delta.error:
                        raise SwitchyardError(f"the engine reported an error: {delta.error}")
                    if delta.has_token:
                        last = time.perf_counter()
                        first = first if first is not None else last
                        chunks += 1
                        text.append(delta.text)
                        if progress is not None:
                            progress(delta.text)
                    usage = delta.usage or usage
                    finish = delta.finish_reason or finish
                    if self._stop.is_set():
                        break
        except (httpx.HTTPError, OSError, RuntimeError) as exc:
            if not self._stop.is_set():
                raise SwitchyardError(f"the chat request to {self.target.root} failed: {exc or type(exc).__name__}",
                                      "check that the endpoint is up (the Serve page shows its state)") from None
        finally:
            with self._lock:
                self._response = None
        return self._answer(text, chunks, usage, sent, first, last, finish)

    def _answer(self, text: list[str], chunks: int, usage: dict[str, Any] | None, sent: float,
                first: float | None, last: float, finish: str | None) -> ChatAnswer:
        counted = bool(usage and isinstance(usage.get("completion_tokens"), int)) and not self._stop.is_set()
        tokens = int(usage["completion_tokens"]) if counted and usage else chunks
        rate = (tokens - 1) / (last - first) if first is not None and tokens > 1 and last > first else None
        return ChatAnswer(text="".join(text), output_tokens=tokens, tokens_counted=counted,
                          ttft_s=(first - sent) if first is not None else None,
                          seconds=time.perf_counter() - sent, tokens_per_s=rate, finish_reason=finish,
                          stopped=self._stop.is_set())
