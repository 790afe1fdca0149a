"""Text a client or a remote chose, made safe to keep and to show: control characters as visible escapes, and a
length cap. The endpoint keeps a request's `model` in its request log, in history and in what it says back, and a
client picks its size (a 4 MiB name is one JSON string); a terminal acts on the controls it prints."""

from __future__ import annotations

import re

# C0 and C1 controls, DEL, and the Unicode bidi overrides/isolates and line/paragraph separators: what a
# terminal would act on (retitle, clear, hide lines) or use to reorder what the reader sees.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
RECORDED_CHARS = 256  # a recorded `model` (and a name quoted in an answer), at most


def escape_controls(text: str) -> str:
    """Control characters as visible escapes (`\\x1b`)."""
    return CONTROL.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), text)


def bounded(text: str, limit: int = RECORDED_CHARS) -> str:
    """`text` escaped and cut to at most `limit` characters; a cut one ends by saying how long it was. Applying it
    twice changes nothing (records read back from history are bounded again)."""
    escaped = escape_controls(text[:limit])
    if len(text) <= limit and len(escaped) <= limit:
        return escaped
    suffix = f"…[{len(text)} chars]"
    return escaped[:max(0, limit - len(suffix))] + suffix
