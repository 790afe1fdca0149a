"""The async HTTP client: one streamed OpenAI-compatible request, timed the way `vllm bench serve` times it.

Stream parsing reuses `desktop.core.common.sse`, so odd chunk boundaries never split an event. Every failure mode ends
as a failed `RequestResult` with a one-line reason, never an exception: a load test must keep its partial data.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import httpx

from desktop.core.common import unixhttp
from desktop.core.common.errors import SwitchyardError
from desktop.core.common.sse import SSEDecoder, StreamDelta, parse_chunk
from desktop.core.measure.loadgen.metrics import RequestResult
from desktop.core.measure.loadgen.workload import RequestSpec

if TYPE_CHECKING:
    from desktop.core.engines.external import ExternalEndpoint

Api = Literal["completions", "chat"]
CONNECT_ERROR = "connection refused"
CONNECT_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Target:
    """An OpenAI-compatible endpoint and how to ask it (fixed max_tokens with ignore_eos, streamed, usage)."""

    base_url: str
    api: Api = "completions"
    model: str | None = None  # None: ask /v1/models
    api_key: str | None = field(default=None, repr=False)
    verify_tls: bool = True
    name: str | None = None  # an attached endpoint's name, for messages
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def attached(cls, endpoint: ExternalEndpoint, *, api: Api = "completions", model: str | None = None,
                 api_key: str | None = None) -> Target:
        """A target for an attached endpoint: its URL, its key (unless `api_key` overrides it), its TLS choice."""
        return cls(endpoint.base_url, api=api, model=model, api_key=api_key or endpoint.api_key,
                   verify_tls=endpoint.verify_tls, name=endpoint.name)

    def to_json(self) -> dict[str, Any]:  # the API key is never recorded
        return {"base_url": self.base_url, "name": self.name, "api": self.api, "model": self.model,
                "has_api_key": self.api_key is not None, "verify_tls": self.verify_tls,
                "ignore_eos": self.ignore_eos, "temperature": self.temperature, "extra_body": dict(self.extra_body)}

    @property
    def root(self) -> str:
        return self.base_url.rstrip("/").removesuffix("/v1")

    @property
    def request_root(self) -> str:
        """`root` as a client from `client()`/`async_client()` asks for it (an engine's socket: http://localhost)."""
        return unixhttp.http_url(self.root)

    @property
    def url(self) -> str:
        return self.request_root + ("/v1/chat/completions" if self.api == "chat" else "/v1/completions")

    def client(self, **options: Any) -> httpx.Client:
        """An httpx client that reaches this target: over the engine's Unix socket when it is on one."""
        return unixhttp.client(self.base_url, verify=self.verify_tls, trust_env=False, follow_redirects=False,
                               **options)

    def async_client(self, **options: Any) -> httpx.AsyncClient:
        return unixhttp.async_client(self.base_url, verify=self.verify_tls, trust_env=False, follow_redirects=False,
                                     **options)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, spec: RequestSpec, model: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "max_tokens": spec.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if model:
            body["model"] = model
        if self.api == "chat":
            body["messages"] = spec.messages or [{"role": "user", "content": spec.prompt or ""}]
        else:
            body["prompt"] = spec.prompt if spec.prompt is not None else " ".join(
                m.get("content", "") for m in spec.messages or [])
        body.update(self.extra_body)
        return body


async def discover_model(client: httpx.AsyncClient, target: Target) -> str | None:
    """The first model the server lists, or None when it does not say (llama-server accepts any name)."""
    try:
        response = await client.get(target.request_root + "/v1/models",
                                    headers=target.headers(), timeout=10.0)
        data = response.json().get("data") or []
        return str(data[0]["id"]) if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


class ServerTokenCounter:
    """Counts tokens with the server's own `/tokenize`, so prompts have the asked length even without a local
    tokenizer (one token per word, the fallback, was ~2.3x off for the demo model). llama-server answers
    `{"content": ...}` with `{"tokens": [...]}`; vLLM answers `{"model": M, "prompt": ...}` with `{"count": N}`.
    Counts leave out special tokens (BOS), like the local tokenizer counter. Results are cached per text."""

    def __init__(self, target: Target, model: str | None, timeout: float = 10.0) -> None:
        self.target = target
        self.model = model
        self.calls = 0
        self._shape: str | None = None
        self._cache: dict[str, int] = {}
        self._client = target.client(timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S),
                                     headers=target.headers())

    def _bodies(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        llama = ("llama", {"content": text, "add_special": False})
        vllm = ("vllm", {"prompt": text, "add_special_tokens": False, **({"model": self.model} if self.model else {})})
        shapes = [llama, vllm]
        return [s for s in shapes if s[0] == self._shape] if self._shape else shapes

    def _ask(self, text: str) -> int | None:
        for shape, body in self._bodies(text):
            self.calls += 1
            try:
                response = self._client.post(self.target.request_root + "/tokenize", json=body)
                data = response.json() if response.status_code == 200 else None
            except (httpx.TimeoutException, httpx.TransportError):
                return None  # not answering at all: no point trying the other shape
            except (httpx.HTTPError, ValueError):
                data = None
            if isinstance(data, dict):
                if isinstance(data.get("count"), int):
                    self._shape = shape
                    return int(data["count"])
                if isinstance(data.get("tokens"), list):
                    self._shape = shape
                    return len(data["tokens"])
        return None

    def probe(self) -> bool:
        """True when the server counts tokens (answered a /tokenize)."""
        return self._ask("hello world") is not None

    def __call__(self, text: str) -> int:
        if text not in self._cache:
            count = self._ask(text)
            if count is None:
                raise SwitchyardError(f"{self.target.root}/tokenize stopped answering while prompts were sized",
                                      "check the server, or give a tokenizer")
            self._cache[text] = count
        return self._cache[text]

    def close(self) -> None:
        self._client.close()


def server_token_counter(target: Target, model: str | None) -> ServerTokenCounter | None:
    """A counter backed by the server's `/tokenize`, or None when the server has none (then words are counted)."""
    counter = ServerTokenCounter(target, model)
    if counter.probe():
        return counter
    counter.close()
    return None


def check_target(target: Target, timeout: float = 120.0) -> str | None:
    """Before a load test: prove the endpoint is reachable, accepts the key and answers one request, so a wrong
    address or key fails in seconds with a reason instead of as N failed requests. Returns the model name to send
    (the target's, else the server's first listed model, else None)."""
    where = f"{target.name} ({target.root})" if target.name and target.name not in target.root else target.root
    key_hint = (f"set the right key: switchyard endpoints add {target.name} {target.root} --api-key-stdin --replace"
                if target.name else "give the key with --api-key-env VAR (or attach the endpoint with its key)")
    model = target.model
    with target.client(timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S), headers=target.headers()) as client:
        try:
            listed = client.get(target.request_root + "/v1/models")
            _refuse_auth(listed.status_code, target, where, key_hint)
            if listed.status_code == 200 and model is None:
                with contextlib.suppress(ValueError, KeyError, TypeError, IndexError, AttributeError):
                    model = str(listed.json()["data"][0]["id"])
            spec = RequestSpec(prompt="Hello", max_tokens=1)
            with client.stream("POST", target.url, json=target.body(spec, model)) as response:
                body = response.read().decode("utf-8", "replace")
        except httpx.ConnectTimeout:
            raise SwitchyardError(f"timed out after {CONNECT_TIMEOUT_S:g} s connecting to {where}",
                                  "check the address and that a firewall lets you through") from None
        except httpx.TimeoutException:
            raise SwitchyardError(f"{where} accepted the connection but did not answer a 1-token request within "
                                  f"{timeout:g} s", "the server may be overloaded or still loading") from None
        except httpx.HTTPError as exc:
            text = str(exc) or type(exc).__name__
            if "CERTIFICATE_VERIFY_FAILED" in text or "SSL" in text:
                raise SwitchyardError(f"the TLS certificate of {where} could not be verified",
                                      "for your own host with a self-signed certificate, attach it with --insecure"
                                      ) from None
            reason = "connection refused" if "refused" in text or "Errno 111" in text else text[:200]
            raise SwitchyardError(f"cannot reach {where}: {reason}",
                                  "check the address and port, and that the server is running") from None
    _refuse_auth(response.status_code, target, where, key_hint)
    if response.is_redirect:
        raise SwitchyardError(f"{target.url} redirects to {response.headers.get('location', '?')}",
                              "Switchyard follows no redirects: give the final address")
    if response.status_code != 200:
        raise SwitchyardError(f"{where} answered a test request with HTTP {response.status_code}: "
                              f"{_error_text(body)}", "check the model name (--model) and the server's log")
    return model


def _refuse_auth(status: int, target: Target, where: str, key_hint: str) -> None:
    if status in (401, 403):
        if target.api_key:
            raise SwitchyardError(f"{where} rejected the API key (HTTP {status})", key_hint)
        raise SwitchyardError(f"{where} requires an API key (HTTP {status})", key_hint)


def _describe(exc: BaseException, timeout: float, tokens: int) -> str:
    if isinstance(exc, (TimeoutError, httpx.TimeoutException)):
        return f"timeout: no complete answer within {timeout:g} s ({tokens} tokens received)"
    if isinstance(exc, httpx.ConnectError):
        return f"{CONNECT_ERROR}: {exc}"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        return f"connection lost: the server closed the stream after {tokens} tokens ({exc or type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"


async def send_request(
    client: httpx.AsyncClient,
    target: Target,
    spec: RequestSpec,
    *,
    index: int,
    model: str | None,
    clock_zero: float,
    timeout: float,
    phase: str = "measure",
    on_chunk: Callable[[RequestResult, bool], None] | None = None,
) -> RequestResult:
    """Send one request and time it; `on_chunk(result, first)` is called on every token-bearing chunk."""
    sent = time.perf_counter()
    result = RequestResult(index=index, start=sent - clock_zero, phase=phase, prompt_tokens=spec.input_tokens,
                           tokens_estimated=True)
    try:
        await _exchange(client, target, spec, model, timeout, on_chunk, result, sent)
    except _StaleConnection:
        # The server closed a kept-alive connection just as we reused it (llama-server caps requests per
        # connection): nothing reached it, so sending again on a fresh connection is safe.
        sent = time.perf_counter()
        result = RequestResult(index=index, start=sent - clock_zero, phase=phase,
                               prompt_tokens=spec.input_tokens, tokens_estimated=True, retried=True)
        try:
            await _exchange(client, target, spec, model, timeout, on_chunk, result, sent)
        except _StaleConnection as exc:
            result.error = f"connection lost: the server closed the connection without answering ({exc})"
    result.elapsed = time.perf_counter() - sent
    if not result.success and result.latency == 0.0:
        result.latency = result.elapsed
    return result


class _StaleConnection(Exception):
    """The server closed the connection before sending any byte of a response."""


async def _exchange(
    client: httpx.AsyncClient,
    target: Target,
    spec: RequestSpec,
    model: str | None,
    timeout: float,
    on_chunk: Callable[[RequestResult, bool], None] | None,
    result: RequestResult,
    sent: float,
) -> RequestResult:
    chunks = 0
    last_token = sent
    usage: dict[str, Any] | None = None
    ended = False  # [DONE] or a finish_reason seen: anything else is a stream cut short
    try:
        async with asyncio.timeout(timeout), client.stream(
            "POST", target.url, json=target.body(spec, model), headers=target.headers()
        ) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {_error_text(body)}"
                return result
            content_type = response.headers.get("content-type", "")
            if "text/event-stream" not in content_type:
                return await _not_streamed(response, result, sent)
            decoder = SSEDecoder()
            async for raw in response.aiter_bytes():
                for payload in decoder.feed(raw):
                    delta = parse_chunk(payload)
                    if delta is None:
                        ended = True
                        continue
                    now = time.perf_counter()
                    if delta.error:
                        result.error = f"server error in stream: {delta.error}"
                        return result
                    if delta.has_token:
                        if chunks == 0:
                            result.ttft = now - sent
                        else:
                            result.itl.append(now - last_token)
                        chunks += 1
                        last_token = now
                        if on_chunk:
                            on_chunk(result, chunks == 1)
                    usage = _merge_usage(usage, delta)
                    if delta.finish_reason:
                        result.finish_reason = delta.finish_reason
                        ended = True
            for payload in decoder.flush():
                delta = parse_chunk(payload)
                if delta is not None:
                    usage = _merge_usage(usage, delta)
    except httpx.RemoteProtocolError as exc:
        if "without sending a response" in str(exc) and not result.retried:
            raise _StaleConnection(str(exc)) from exc
        result.error = _describe(exc, timeout, chunks)
        result.latency = time.perf_counter() - sent
        return result
    except (TimeoutError, httpx.HTTPError, OSError) as exc:
        result.error = _describe(exc, timeout, chunks)
        result.latency = time.perf_counter() - sent
        return result
    result.latency = last_token - sent
    _apply_usage(result, usage, chunks)
    if not ended:
        result.error = f"connection lost: the stream ended without [DONE] after {chunks} tokens"
        return result
    if chunks == 0:
        result.error = "empty output: the server finished the stream without sending a token"
        result.latency = time.perf_counter() - sent
        return result
    result.success = True
    return result


def _error_text(body: str) -> str:
    try:
        data = json.loads(body)
        err = data.get("error", data) if isinstance(data, dict) else data
        message = err.get("message") if isinstance(err, dict) else err
        return str(message)[:300]
    except ValueError:
        return body.strip()[:300] or "(empty body)"


def _merge_usage(usage: dict[str, Any] | None, delta: StreamDelta) -> dict[str, Any] | None:
    return delta.usage if delta.usage else usage


def _apply_usage(result: RequestResult, usage: dict[str, Any] | None, chunks: int) -> None:
    if usage and isinstance(usage.get("completion_tokens"), int):
        result.output_tokens = int(usage["completion_tokens"])
        result.tokens_estimated = False
        if isinstance(usage.get("prompt_tokens"), int):
            result.prompt_tokens = int(usage["prompt_tokens"])
    else:
        result.output_tokens = chunks


async def _not_streamed(response: httpx.Response, result: RequestResult, sent: float) -> RequestResult:
    """A server that ignores `stream`: one JSON body. TTFT equals E2E and there are no ITLs (flagged)."""
    body = await response.aread()
    result.latency = result.ttft = time.perf_counter() - sent
    result.streamed = False
    try:
        data = json.loads(body)
    except ValueError:
        result.error = f"unreadable response (not a stream, not JSON): {body[:120]!r}"
        return result
    text = ""
    for choice in data.get("choices") or []:
        text += choice.get("text") or (choice.get("message") or {}).get("content") or ""
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
    _apply_usage(result, data.get("usage"), len(text.split()))
    if result.output_tokens == 0:
        result.error = "empty output: the server answered without any token"
        return result
    result.success = True
    return result
