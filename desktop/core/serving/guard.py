"""What bounds the endpoint's front end as a whole, whatever its clients do: how many connections it holds (in
total and per client address, kept below the file-descriptor limit, which is raised to its hard limit at start),
how many request-body bytes it buffers across all connections, and the sweep that closes connections whose head,
body or keep-alive silence ran past its timeout (slowloris).

Owned by the endpoint's event loop (ClientConnection and ProxyServer call it from there only)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Iterable
from typing import Protocol

from desktop.core.serving.limits import Limits

log = logging.getLogger("switchyard.proxy")

FD_RESERVE = 64  # descriptors kept for everything else: engine logs, the history database, telemetry
SWEEP_EVERY_S = 1.0  # at most; a quarter of the shortest timeout when that is shorter


class GuardedConnection(Protocol):
    """What the guard needs of a client connection (http1.ClientConnection is one): who it counts against, how
    long it has waited in which phase, and the means to time it out or drop it. A protocol rather than the class,
    so that this module does not import the transport that imports it."""

    peer_host: str  # peer_class() of its address
    trusted: bool  # a request of it showed its credential: evicted last
    phase: str  # "idle", "head", "body" (or "linger"): what check_time() times
    since: float  # time.monotonic() when that phase began

    def evictable(self) -> bool: ...

    def abort(self) -> None: ...

    def check_time(self, now: float) -> None: ...


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (once: it is per process) and return the soft
    limit now in force; 0 where the platform has no such limit (Windows)."""
    try:
        import resource
    except ImportError:
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_cap(wanted: int, fd_limit: int) -> int:
    """How many client connections to hold: `wanted`, but no more than half of the descriptors left after the
    reserve (each client connection that is being answered holds one towards an engine as well)."""
    if fd_limit <= 0:
        return wanted
    return max(8, min(wanted, (fd_limit - FD_RESERVE) // 2))


def peer_class(host: str) -> str:
    """What the per-peer cap counts a connection against: its address, except that every loopback source
    (127.0.0.0/8, ::1, IPv4-mapped loopback) is one peer, "loopback": they are all this machine's users, and any
    of them can pick a fresh 127.x.y.z address to count as somebody new."""
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return "loopback" if address.is_loopback else str(address)


class Guard:
    """Connection counts and the buffered-body budget of one endpoint."""

    def __init__(self, limits: Limits, fd_limit: int) -> None:
        self.limits = limits
        self.max_connections = connection_cap(limits.connections, fd_limit)
        self.max_per_peer = min(limits.per_peer, self.max_connections)
        self.open: set[GuardedConnection] = set()  # every socket held, until its connection_lost
        self.dying: set[GuardedConnection] = set()  # evicted (aborted): gone within this loop iteration
        self.per_peer: dict[str, int] = {}
        self.buffered = 0  # request-body bytes held (reserved) across all connections
        self._sweep: asyncio.TimerHandle | None = None
        self._every = SWEEP_EVERY_S

    # --- connections ---
    def admit(self, connection: GuardedConnection) -> bool:
        """Take a new connection: at a cap, the longest-idle connection (of that peer, for the per-peer cap) makes
        room, one that never passed screening (showed the key) first; when none can, the newcomer is refused."""
        host = connection.peer_host
        dying_here = sum(1 for c in self.dying if c.peer_host == host)
        if self.per_peer.get(host, 0) - dying_here >= self.max_per_peer and \
                not self._evict(c for c in self.open if c.peer_host == host):
            return False
        if len(self.open) - len(self.dying) >= self.max_connections and not self._evict(self.open):
            return False
        self.open.add(connection)
        self.per_peer[host] = self.per_peer.get(host, 0) + 1
        return True

    def forget(self, connection: GuardedConnection) -> None:
        """The connection's socket is gone (connection_lost): only now does it stop counting."""
        self.dying.discard(connection)
        if connection in self.open:
            self.open.discard(connection)
            left = self.per_peer.get(connection.peer_host, 1) - 1
            if left > 0:
                self.per_peer[connection.peer_host] = left
            else:
                self.per_peer.pop(connection.peer_host, None)

    def _evict(self, candidates: Iterable[GuardedConnection]) -> bool:
        """Drop the connection that never passed screening and has waited longest between requests (then:
        longest in a head, then the trusted ones alike). Aborted, not closed: its socket is gone within this
        loop iteration whatever its client reads (it still counts until then: `dying`)."""
        idle = [c for c in candidates if c not in self.dying and c.evictable()]
        if not idle:
            return False
        victim = min(idle, key=lambda c: (c.trusted, c.phase != "idle", c.since))
        self.dying.add(victim)
        victim.abort()
        return True

    # --- buffered bodies ---
    def reserve(self, size: int) -> bool:
        """Hold `size` more body bytes, if the budget has room."""
        if self.buffered + size > self.limits.body_budget:
            return False
        self.buffered += size
        return True

    def has_room(self, size: int) -> bool:
        """Whether a body of `size` bytes would fit now (checked from its head; reserved as it arrives)."""
        return self.buffered + size <= self.limits.body_budget

    def free(self, size: int) -> None:
        self.buffered -= size

    # --- timeouts ---
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        limits = self.limits
        self._every = max(0.05, min(SWEEP_EVERY_S, limits.head_timeout_s / 4, limits.idle_timeout_s / 4))
        self._sweep = loop.call_later(self._every, self._sweep_now, loop)

    def stop(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    def _sweep_now(self, loop: asyncio.AbstractEventLoop) -> None:
        now = time.monotonic()
        for connection in list(self.open):
            try:
                connection.check_time(now)
            except Exception:  # one broken connection must not end the sweep for all
                log.exception("the endpoint could not time out a client connection")
        self._sweep = loop.call_later(self._every, self._sweep_now, loop)
