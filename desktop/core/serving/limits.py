"""How much one client, and all of them together, may make the endpoint hold: the Limits that both the HTTP/1.1
transport (http1) and the front end's guard (guard) read. In a module of its own so that neither of them imports
the other for it (http1 re-exports it: `from desktop.core.serving.http1 import Limits` keeps working)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Limits:
    """How much one client, and all of them together, may make the endpoint hold (docs/endpoint.md, "Security
    defaults and limits", states these numbers).

    A connection may have `pipelined` requests in hand, the one being answered included, and read ahead
    `readahead_bytes` of their bodies; past either, the endpoint stops reading that connection (TCP pushes back
    on the client) until the answer is done. A request past `pipelined` that was already read (one read can hold
    many small ones) is answered 429 and the connection closed after it; past `queued` requests across all
    connections (read ahead or waiting for an engine) the answer is 503, and past `body_budget` bytes of request
    bodies held across all connections too. Both carry Retry-After: `retry_after_s`.

    A request head must arrive whole within `head_timeout_s` of its first byte; a body, once `body_grace_s` has
    passed, must have arrived at `body_min_rate` bytes a second on average since (a byte now and then does not
    keep a connection) and within every `body_grace_s` since (bytes sent first buy no stalling later), and whole
    within `body_timeout_s`; a kept-alive connection may wait `idle_timeout_s` for its next request.
    Bodies are reserved in the budget as their bytes arrive, not as declared.

    Answers wait in a connection's write buffer up to `write_buffer_bytes`; past it the endpoint stops reading
    that client (and the engine's stream) until it has read them, and a client that reads nothing for
    `idle_timeout_s` is dropped. A connection that is closed flushes what is written for at most `drain_s`, then
    its socket is dropped. At most `connections` connections are held (fewer when the file-descriptor limit is
    low: guard.connection_cap), at most `per_peer` from one address (every loopback address is one peer); at
    either cap the longest-idle connection, one that never showed a valid key first, makes room.
    """

    pipelined: int = 16
    readahead_bytes: int = 1 << 20
    queued: int = 1024
    retry_after_s: int = 1
    body_budget: int = 256 << 20
    head_timeout_s: float = 30.0
    idle_timeout_s: float = 60.0
    connections: int = 1024
    per_peer: int = 512
    body_grace_s: float = 10.0
    body_min_rate: int = 16 << 10
    body_timeout_s: float = 300.0
    write_buffer_bytes: int = 64 << 10
    drain_s: float = 5.0
