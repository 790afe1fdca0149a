"""What the engine manager holds and says: one engine process it owns (`ManagedEngine`), its one state of which engine
holds which role (`EngineSlots`), a switch's result and the events listeners hear."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from desktop.core.common.errors import EngineFailed
from desktop.core.engines.base import CrashRetry, LaunchPlan
from desktop.core.runtime.supervisor import ColdStart, EngineProcess
from desktop.core.serving.router import Upstream

Role = Literal["active", "standby", "starting", "sleeping"]
ROLES: tuple[Role, ...] = ("active", "standby", "starting", "sleeping")


@dataclass
class ManagedEngine:
    """One engine process the endpoint owns, with its proxy identity."""

    plan: LaunchPlan  # the checked plan it runs (before its port and per-launch key were filled in)
    process: EngineProcess
    upstream: Upstream
    role: str  # "active" | "standby" | "starting" | "draining" | "sleeping"
    retried: str | None = None  # what changed in the retry after an out-of-memory load, if there was one
    sleep_level: int = 0  # vLLM sleep level it was put to sleep at (1: weights in host RAM, 2: dropped); 0 awake

    @property
    def can_sleep(self) -> bool:
        """Started with sleep mode (vLLM on CUDA): it can free its GPU memory and wake without a cold start."""
        flag = self.process.adapter.sleep_mode_flag
        return flag is not None and flag in self.process.plan.extra_args

    def to_json(self) -> dict[str, Any]:
        process = self.process
        return {
            "name": self.upstream.name,
            "role": self.role,
            "retried_smaller": self.retried,
            "sleep_level": self.sleep_level,
            "plan": self.plan.to_json(),
            "engine": process.adapter.name,
            "base_url": process.base_url,
            "pid": process.pid,
            "state": process.state.value,
            "model_path": str(process.plan.model_path),
            "cold_start": process.cold_start.to_json(),
            "outcome": process.outcome.to_json() if process.outcome else None,
            "log": str(process.log_path),
        }


@dataclass
class SwitchResult:
    from_engine: str | None
    to_engine: str
    seconds: float
    reused_standby: bool
    drained: bool
    old_kept_as_standby: bool
    cold_start: ColdStart | None
    kind: str = "warm"  # "warm": both ran for a moment; "stop-first": the old one stopped (or slept) first
    gap_s: float = 0.0  # how long no engine served (requests waited at the endpoint meanwhile)
    cut_requests: int = 0  # still in flight at the drain deadline: ended with a retryable error
    woke: bool = False  # the new engine was a sleeping vLLM woken up (no cold start)
    old_sleeping: bool = False  # the old engine sleeps (vLLM sleep mode) instead of stopping
    retried_smaller: str | None = None  # the new engine ran out of memory and was retried with a smaller plan
    probed: tuple[str, ...] = ()  # capabilities the traffic used that the new engine answered before it took over

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["probed"] = list(self.probed)
        data["cold_start"] = self.cold_start.to_json() if self.cold_start else None
        return data


@dataclass
class EndpointEvent:
    """What the endpoint tells its listeners (CLI, GUI): a state and a line a person can read."""

    state: str  # "starting" | "serving" | "switching" | "failover" | "down" | "stopped"
    message: str
    t: float = field(default_factory=time.time)


EndpointListener = Callable[[EndpointEvent], None]


class LoadOutOfMemory(EngineFailed):
    """An engine failed to load for lack of memory (the adapter's explanation says so); `log_text` is the end of
    its log, where an engine may say what would start (vLLM V1's estimated maximum model length)."""

    log_text: str = ""


class LoadCrashed(EngineFailed):
    """An engine crashed while loading in a way its adapter knows arguments avoid (`EngineAdapter.crash_retry`:
    llama-server's SIGILL in its weight repack -> --no-repack): the endpoint retries once with `fix`."""

    fix: CrashRetry | None = None


class EngineSlots:
    """The manager's state as one type: which engine holds each role (at most one per role; an engine in one role
    only), and the engines on their way out. An engine's `role` is the slot it is in, or how it left it
    ("draining", "stopped"), so role and slot cannot disagree."""

    def __init__(self) -> None:
        self._by_role: dict[str, ManagedEngine] = {}
        self.retired: list[ManagedEngine] = []

    def get(self, role: Role) -> ManagedEngine | None:
        return self._by_role.get(role)

    def put(self, role: Role, managed: ManagedEngine | None) -> None:
        """`managed` now holds `role` (leaving any other role); None empties the role."""
        if managed is None:
            self._by_role.pop(role, None)
            return
        for other, engine in list(self._by_role.items()):
            if engine is managed and other != role:
                del self._by_role[other]
        self._by_role[role] = managed
        managed.role = role

    def release(self, managed: ManagedEngine, how: str = "draining") -> None:
        """`managed` leaves whatever role it held (draining to another engine, or stopped)."""
        for role, engine in list(self._by_role.items()):
            if engine is managed:
                del self._by_role[role]
        managed.role = how

    def role_of(self, managed: ManagedEngine) -> str | None:
        return next((role for role, engine in self._by_role.items() if engine is managed), None)

    def take_all(self) -> list[ManagedEngine]:
        """Every engine, in a role or retired, and the state emptied (closing)."""
        engines = [*self._by_role.values(), *self.retired]
        self._by_role.clear()
        self.retired = []
        return engines


class SlotView:
    """`manager.active` (and standby, starting, sleeping): a view of one role of the manager's EngineSlots."""

    def __init__(self, role: Role) -> None:
        self.role: Role = role

    def __get__(self, owner: Any, _type: Any = None) -> ManagedEngine | None:
        if owner is None:  # looked up on the class
            return None
        slots: EngineSlots = owner.slots
        return slots.get(self.role)

    def __set__(self, owner: Any, managed: ManagedEngine | None) -> None:
        owner.slots.put(self.role, managed)

