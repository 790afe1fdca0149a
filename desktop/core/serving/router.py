"""Routing on the endpoint: which engine (upstream) takes a new request, requests waiting while none can, and the
in-flight count per upstream that lets a switch drain the old engine before stopping it.

All state here is owned by the endpoint's event loop: the methods are called from that loop only (ProxyServer
offers the thread-safe entry points)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
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
    vision: bool = False  # it sees images (capabilities.takes_images): marked in /v1/models
    messages_api: bool = False  # answers Anthropic Messages (/v1/messages): EngineAdapter.anthropic_messages
    closes_after_stream: bool = False  # EngineAdapter.closes_after_stream: don't pool after a streamed answer
    context: int = 0  # tokens one request may use (the plan's ctx_per_request; 0: unknown)
    window: int = 0  # the model's own context window (0: unknown), for the endpoint's context message
    system_first: bool = False  # its chat template takes system messages only first (serving.normalize rule 3)
    # For an engine on TCP: whether its listener still belongs to the engine's process tree, asked on every new
    # connection before the key or a prompt is written (a port freed by a dead engine can be bound by anyone).
    listener_check: Callable[[], bool] | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        data = asdict(replace(self, listener_check=None))
        data.pop("api_key")
        data.pop("listener_check")
        return data


class Unavailable(Exception):
    """No upstream could take the request before its deadline."""


@dataclass
class Route:
    """One model name's way to an engine: the upstream serving it now, or why none does. The endpoint has one
    route for every name (single-model mode), or one per configured model (routed by the request's `model`)."""

    active: Upstream | None = None
    down_reason: str | None = None
    idle: bool = False  # unloaded (idle TTL, or swapped out): the next request asks for a load
    loading_since: float | None = None  # time.monotonic() when a load began, while it runs
    waiting: int = 0  # requests waiting here for an engine
    # of those, how many wait for an engine other than the named one (it failed them twice): they cannot be let in
    avoiding: dict[str, int] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # for /v1/models: engine, model, ttl, ...
    loading_status: bool = False  # streaming clients that wait hear ": loading model X (12 s)" comments
    extra_routes: frozenset[str] = frozenset()  # paths forwarded besides the inference routes (opted in)
    reasoning_effort: str = "auto"  # the model's reasoning setting, where a request sets none (normalize rule 6)


OnDemand = Callable[[str], None]


class Router:
    """The active upstream per route, or why there is none, and how many requests each upstream has in flight."""

    def __init__(self, counters: dict[str, int]) -> None:
        self.counters = counters  # shared with the endpoint: "waited" is counted here
        self.default = Route()
        self.routes: dict[str, Route] = {}  # by model name; empty in single-model mode
        self.on_demand: OnDemand | None = None  # called on the loop when a request finds its route idle
        self.last_used: dict[str, float] = {}  # upstream name -> time.monotonic() of its last acquire/release
        self._inflight: dict[str, int] = {}
        self._changed: asyncio.Condition | None = None
        self._draining = 0  # drain()/settle() calls waiting: only they need waking when a request ends

    @property
    def active(self) -> Upstream | None:
        return self.default.active

    @property
    def down_reason(self) -> str | None:
        return self.default.down_reason

    @property
    def multi(self) -> bool:
        return bool(self.routes)

    def route(self, model: str | None) -> Route | None:
        """The route for a request's `model`: the one route in single-model mode; None for an unknown name."""
        if not self.routes:
            return self.default
        if model is None and len(self.routes) == 1:
            return next(iter(self.routes.values()))
        return self.routes.get(model) if model is not None else None

    def extra_route(self, path: str) -> bool:
        """Whether some route opted `path` in (which model's engine takes it is decided by the body)."""
        if not self.routes:
            return path in self.default.extra_routes
        return any(path in route.extra_routes for route in self.routes.values())

    def opted_in(self, path: str) -> str | None:
        """The one model whose route opted `path` in, when exactly one did (a GET carries no model to route on)."""
        names = [name for name, route in self.routes.items() if path in route.extra_routes]
        return names[0] if len(names) == 1 else None

    def bind(self) -> None:
        """Create the loop-bound parts; called on the endpoint's loop before it serves."""
        self._changed = asyncio.Condition()

    async def set_upstream(self, upstream: Upstream | None, down_reason: str | None, model: str | None = None,
                           idle: bool = False) -> None:
        assert self._changed is not None
        route = self.routes[model] if model is not None else self.default
        async with self._changed:
            route.active = upstream
            route.down_reason = None if upstream else down_reason
            route.idle = upstream is None and idle
            route.loading_since = None if upstream is not None or idle or down_reason else route.loading_since
            if route.idle and route.waiting and model is not None and self.on_demand is not None:
                self._ask_load(route, model)  # requests wait here already: they would otherwise wait in vain
            self._changed.notify_all()
        where = f" for {model}" if model is not None else ""
        log.info("endpoint now forwards%s to %s", where,
                 upstream.name if upstream else f"nothing ({down_reason or ('idle' if idle else 'waiting')})")

    def mark_loading(self, model: str | None) -> None:
        route = self.routes[model] if model is not None else self.default
        if route.loading_since is None:
            route.loading_since = time.monotonic()

    def inflight(self, name: str | None = None) -> int:
        counts = dict(self._inflight)
        return counts.get(name, 0) if name is not None else sum(counts.values())

    async def drain(self, name: str, timeout: float) -> bool:
        """Wait until no request is in flight on upstream `name`; False if some still are after `timeout`."""
        return await self._wait_until(lambda: self._inflight.get(name, 0) == 0, timeout)

    async def settle(self, model: str, timeout: float) -> bool:
        """Wait until no request waits on route `model` while it has an engine (they have all been let in), so
        taking the engine away next does not starve requests that arrived during its load."""
        route = self.routes[model]

        def settled() -> bool:
            active = route.active
            return active is None or route.waiting - route.avoiding.get(active.name, 0) == 0

        return await self._wait_until(settled, timeout)

    async def _wait_until(self, condition: Callable[[], bool], timeout: float) -> bool:
        assert self._changed is not None
        self._draining += 1
        try:
            with contextlib.suppress(TimeoutError):
                async with self._changed:
                    await asyncio.wait_for(self._changed.wait_for(condition), timeout)
        finally:
            self._draining -= 1
        return condition()

    def try_acquire(self, avoid: Upstream | None, route: Route | None = None) -> Upstream | None:
        """The fast path, without touching the condition: an engine is there and may be used."""
        upstream = (route or self.default).active
        if upstream is None or upstream is avoid:
            return None
        self._inflight[upstream.name] = self._inflight.get(upstream.name, 0) + 1
        self.last_used[upstream.name] = time.monotonic()
        return upstream

    async def acquire(self, deadline: float, avoid: Upstream | None = None, route: Route | None = None,
                      model: str | None = None) -> Upstream:
        """The upstream to use now, waiting (until `deadline`) while there is none or only `avoid`. An idle
        route asks for its engine to be loaded (on_demand) and waits for it like any other."""
        assert self._changed is not None
        loop = asyncio.get_running_loop()
        chosen = route or self.default
        async with self._changed:
            def usable() -> bool:
                return (chosen.active is not None and chosen.active is not avoid) or chosen.down_reason is not None

            if chosen.idle and chosen.active is None and model is not None and self.on_demand is not None:
                self._ask_load(chosen, model)
            if not usable():
                self.counters["waited"] += 1
                chosen.waiting += 1
                if avoid is not None:
                    chosen.avoiding[avoid.name] = chosen.avoiding.get(avoid.name, 0) + 1
                try:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait_for(usable), max(0.0, deadline - loop.time()))
                finally:
                    chosen.waiting -= 1
                    if avoid is not None:
                        left = chosen.avoiding.pop(avoid.name) - 1
                        if left:
                            chosen.avoiding[avoid.name] = left
                    if self._draining:
                        self._changed.notify_all()
            upstream = self.try_acquire(avoid, chosen)
            if upstream is None:
                raise Unavailable(chosen.down_reason or "no engine became ready in time")
            return upstream

    def _ask_load(self, route: Route, model: str) -> None:
        """Ask (once, until the route is idle again) for `model`'s engine to be loaded; on the loop, under the
        condition."""
        assert self.on_demand is not None
        route.idle = False
        route.down_reason = None
        route.loading_since = time.monotonic()
        self.on_demand(model)

    def release(self, upstream: Upstream) -> None:
        """Count one request off `upstream`; when it was the last, wake any drain() waiting for that."""
        self.last_used[upstream.name] = time.monotonic()
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
