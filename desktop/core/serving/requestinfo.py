"""What the endpoint reads from a request body, read once per request: the top-level JSON `model` (routing, the
model rewrite and the request log all use this one value), `stream`, and the capabilities it uses (tools, JSON
schemas, images, reasoning: serving.capabilities, which a switch checks the next engine for).

Found by a scan that builds no objects and never recurses: strings are skipped by one regex match each (in C),
brackets are counted, so a 60 MiB body costs a pass over its bytes rather than a parse tree (json.loads of such a
body took 6.9 s and 1.5 GiB on the endpoint's one thread), and nesting of any depth is a counter, not a
RecursionError. The scan runs on the event loop for bodies with few JSON tokens (every ordinary request); one
with more is scanned in a worker thread, and past MAX_TOKENS or MAX_DEPTH it is refused with a 400.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from desktop.core.serving.capabilities import MARK_MAX, capability_at

MAX_DEPTH = 128  # JSON nesting the endpoint forwards (a request's own JSON schema nests a few dozen at most)
LOOP_TOKENS = 20_000  # brackets and strings scanned on the event loop (~10 ms); past this, in a worker thread
MAX_TOKENS = 4_000_000  # strings, escapes and brackets in one body, at most (~2 s in the worker thread)

_STRUCTURAL = re.compile(rb'[\[\]{}"]')
_QUOTE_OR_ESCAPE = re.compile(rb'["\\]')
_SPACE = re.compile(rb"[ \t\r\n]*+")
_OPEN, _CLOSE, _QUOTE = frozenset(b"[{"), frozenset(b"]}"), 0x22


class BadBody(ValueError):
    """The body cannot be forwarded as it is (nested too deep, too many tokens): a 400 for the client."""


@dataclass(frozen=True)
class RequestInfo:
    """The request's top-level `model` (None when absent or not a string) and `stream` (True only for `true`);
    `model_span`: where the model's JSON string sits in the body (start, end), for the rewrite."""

    model: str | None = None
    stream: bool = False
    model_span: tuple[int, int] | None = None
    capabilities: frozenset[str] = frozenset()  # what else it asks of the engine (serving.capabilities.capability_at)


NO_INFO = RequestInfo()


def scan(body: bytes, max_tokens: int | None = MAX_TOKENS) -> RequestInfo | None:
    """RequestInfo of a JSON object body (NO_INFO for anything else: the engine judges it). None when more than
    `max_tokens` tokens would have to be scanned (the caller then scans again in a worker thread); BadBody past
    MAX_DEPTH or MAX_TOKENS, or for a byte-order mark. Every body is scanned (an array's nesting too), and keys
    are compared as JSON reads them (`"mod\u0065l"` is `model`; the last of duplicates wins, as in the engines'
    parsers), so the endpoint and the engine never read different values. Malformed JSON is not an error here:
    what was found so far is returned, and the engine answers the malformed body."""
    start = _space_end(body, 0)
    top = body[start:start + 1]
    if top == b"\xef" and body.startswith(b"\xef\xbb\xbf", start):
        raise BadBody("the request body starts with a UTF-8 byte-order mark: send JSON without one")
    if top not in (b"{", b"["):
        return NO_INFO  # empty, a scalar or not JSON: nothing nests, the engine judges it
    keyed = top == b"{"  # a top-level array has no keys, but its nesting counts
    limit = MAX_TOKENS if max_tokens is None else min(max_tokens, MAX_TOKENS)
    model: str | None = None
    span: tuple[int, int] | None = None
    stream = False
    used: set[str] = set()
    depth, pos, tokens = 1, start + 1, 0
    search, space = _STRUCTURAL.search, _space_end
    while True:
        found = search(body, pos)
        if found is None:
            break  # unterminated: the engine will say so
        tokens += 1
        if tokens > limit:
            _over_limit(max_tokens)
            return None
        at = found.start()
        char = body[at]
        if char in _OPEN:
            depth += 1
            if depth > MAX_DEPTH:
                raise BadBody(f"the request body's JSON is nested deeper than {MAX_DEPTH} levels")
            pos = at + 1
            continue
        if char in _CLOSE:
            depth -= 1
            if depth == 0:
                break
            pos = at + 1
            continue
        pos, steps = _string_end(body, at, limit - tokens)
        tokens += steps
        if pos == -2:
            _over_limit(max_tokens)
            return None
        if pos < 0:
            break
        if pos - at <= MARK_MAX and (capability := capability_at(body, at, pos)) is not None:
            used.add(capability)
        if depth != 1 or not keyed:
            continue
        # A key of the top-level object (values are stepped over below, so every string seen here is a key).
        colon = space(body, pos)
        if body[colon:colon + 1] != b":":
            break
        value = space(body, colon + 1)
        key = body[at + 1:pos - 1]
        if b"\\" in key:  # compared as JSON reads it
            decoded = _decode(body[at:pos])
            key = decoded.encode("utf-8", "surrogatepass") if decoded is not None else key
        if body[value:value + 1] == b'"':
            end, steps = _string_end(body, value, limit - tokens)
            tokens += steps
            if end == -2:
                _over_limit(max_tokens)
                return None
            if end < 0:
                break
            if key == b"model":
                model, span = _decode(body[value:end]), (value, end)
            elif key == b"stream":
                stream = False
            pos = end
            continue
        if key == b"model":
            model, span = None, None  # a later non-string model replaces an earlier string one (last wins)
        elif key == b"stream":
            stream = body.startswith(b"true", value) and body[value + 4:value + 5] in (b"", b",", b"}", b" ",
                                                                                      b"\t", b"\r", b"\n")
        pos = value  # a container or a literal: the loop steps over it
    return RequestInfo(model, stream, span, frozenset(used))


def _space_end(body: bytes, pos: int) -> int:
    found = _SPACE.match(body, pos)
    return found.end() if found is not None else pos


def _over_limit(max_tokens: int | None) -> None:
    """Past the loop's share: return (the caller scans again off the loop); past MAX_TOKENS: refuse."""
    if max_tokens is not None and max_tokens < MAX_TOKENS:
        return
    raise BadBody(f"the request body holds more than {MAX_TOKENS:,} JSON strings, escapes and brackets")


def _string_end(body: bytes, at: int, budget: int) -> tuple[int, int]:
    """(the end of the JSON string opening at `at`, -1 if unterminated, -2 past `budget` escapes; the escapes
    stepped through). A string with no backslash before its closing quote costs two memchr calls; one with
    escapes, a step per escape."""
    quote = body.find(b'"', at + 1)
    if quote < 0:
        return -1, 0
    if body.find(b"\\", at + 1, quote) < 0:
        return quote + 1, 0
    steps, pos, search = 0, at + 1, _QUOTE_OR_ESCAPE.search
    while True:
        found = search(body, pos)
        if found is None:
            return -1, steps
        if body[found.start()] == _QUOTE:
            return found.start() + 1, steps
        pos = found.start() + 2
        steps += 1
        if steps > budget:
            return -2, steps


def _decode(quoted: bytes) -> str | None:
    if b"\\" not in quoted:
        return quoted[1:-1].decode("utf-8", "replace")
    try:
        value = json.loads(quoted)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def rewrite_model(body: bytes, info: RequestInfo, served: str) -> bytes:
    """The body with its `model` replaced by the engine's served name, every other byte as the client sent it."""
    if info.model_span is None or info.model == served:
        return body
    start, end = info.model_span
    view = memoryview(body)
    return b"".join((view[:start], json.dumps(served).encode(), view[end:]))
