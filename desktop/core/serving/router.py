"""Routing on the endpoint: which engine (upstream) takes a new request, requests waiting while none can, and the
in-flight count per upstream that lets a switch drain the old engine before stopping it.

All state here is owned by the endpoint's event loop: the methods are called from that loop only (ProxyServer
offers the thread-safe entry points)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("switchyard.proxy")


@dataclass(frozen=True)
class Upstream:
    """One engine server the proxy can forward to."""

    name: str  # unique, e.g. "llama.cpp@41234"
    engine: str
    base_url: str
    served_model_name: str
    api_key: str | None = None
    model: str = ""  # what it serves, for /v1/models

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("api_key")
        return data


class Unavailable(Exception):
    """No upstream could take the request before its deadline."""


class Router:
    """The active upstream, or why there is none, and how many requests each upstream has in flight."""

    def __init__(self, counters: dict[str, int]) -> None:
        self.counters = counters  # shared with the endpoint: "waited" is counted here
        self.active: Upstream | None = None
        self.down_reason: str | None = None
        self._inflight: dict[str, int] = {}
        self._changed: asyncio.Condition | None = None
        self._draining = 0  # drain() calls waiting: only they need waking when a request ends

    def bind(self) -> None:
        """Create the loop-bound parts; called on the endpoint's loop before it serves."""
        self._changed = asyncio.Condition()

    async def set_upstream(self, upstream: Upstream | None, down_reason: str | None) -> None:
        assert self._changed is not None
        async with self._changed:
            self.active = upstream
            self.down_reason = None if upstream else down_reason
            self._changed.notify_all()
        log.info("endpoint now forwards to %s", upstream.name if upstream else f"nothing ({down_reason})")

    def inflight(self, name: str | None = None) -> int:
        counts = dict(self._inflight)
        return counts.get(name, 0) if name is not None else sum(counts.values())

    async def drain(self, name: str, timeout: float) -> bool:
        """Wait until no request is in flight on upstream `name`; False if some still are after `timeout`."""
        assert self._changed is not None
        self._draining += 1
        try:
            with contextlib.suppress(TimeoutError):
                async with self._changed:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self._inflight.get(name, 0) == 0),
                                           timeout)
        finally:
            self._draining -= 1
        return self._inflight.get(name, 0) == 0

    def try_acquire(self, avoid: Upstream | None) -> Upstream | None:
        """The fast path, without touching the condition: an engine is there and may be used."""
        upstream = self.active
        if upstream is None or upstream is avoid:
            return None
        self._inflight[upstream.name] = self._inflight.get(upstream.name, 0) + 1
        return upstream

    async def acquire(self, deadline: float, avoid: Upstream | None = None) -> Upstream:
        """The upstream to use now, waiting (until `deadline`) while there is none or only `avoid`."""
        assert self._changed is not None
        loop = asyncio.get_running_loop()
        async with self._changed:
            def usable() -> bool:
                return (self.active is not None and self.active is not avoid) or self.down_reason is not None

            if not usable():
                self.counters["waited"] += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait_for(usable), max(0.0, deadline - loop.time()))
            upstream = self.try_acquire(avoid)
            if upstream is None:
                raise Unavailable(self.down_reason or "no engine became ready in time")
            return upstream

    def release(self, upstream: Upstream) -> None:
        """Count one request off `upstream`; when it was the last, wake any drain() waiting for that."""
        count = self._inflight[upstream.name] - 1
        if count > 0:
            self._inflight[upstream.name] = count
            return
        del self._inflight[upstream.name]
        if self._draining:
            asyncio.ensure_future(self._notify())

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()


class Lease:
    """One request's claim on an upstream (what drain() waits on); released exactly once."""

    __slots__ = ("held", "router", "upstream")

    def __init__(self, router: Router, upstream: Upstream) -> None:
        self.router = router
        self.upstream = upstream
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.router.release(self.upstream)
