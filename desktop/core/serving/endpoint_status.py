"""What the engine manager shows of itself, for its control surface: its status (the control channel's
/switchyard/status, `serve --json`, `switchyard status`, the GUI's Serve page) and its capability table. Read-only
views of the manager's state, apart from the manager (serving.endpoint) that starts and switches the engines; they
take what they need of it as a `StatusHost`."""

from __future__ import annotations

from typing import Any, Protocol

from desktop.core.serving import capabilities
from desktop.core.serving.managed import ManagedEngine
from desktop.core.serving.switching import SwitchHost, traffic_key


class StatusHost(SwitchHost, Protocol):
    """What the status needs of the engine manager beyond what a switch does: its state, the engine starting, its
    auto-fit setting and the hybrid mode's loop (serving.autopilot), if any."""

    @property
    def state(self) -> str: ...
    @property
    def starting(self) -> ManagedEngine | None: ...
    @property
    def auto_fit(self) -> bool: ...
    @property
    def autopilot(self) -> Any: ...


def status(m: StatusHost) -> dict[str, Any]:
    with m.lock:
        engines = [e for e in (m.active, m.standby, m.starting) if e is not None]
        return {
            "url": m.proxy.url,
            "openai_base_url": m.proxy.url + "/v1",
            "model_name": m.route or m.proxy.model_name,
            "state": m.state,
            "last_error": m.last_error,
            "active": m.active.to_json() if m.active else None,
            "standby": m.standby.to_json() if m.standby else None,
            "starting": m.starting.to_json() if m.starting else None,
            "sleeping": m.sleeping.to_json() if m.sleeping else None,
            "engines": len(engines),
            "requests": {**m.proxy.counters, "inflight": m.proxy.inflight()},
            "keep_standby": m.keep_standby,
            "failover": m.failover,
            "auto_fit": m.auto_fit,
            "budget_gib": round(m.budget.free_bytes / 2**30, 2) if m.budget else None,
            "gpu_telemetry": (m.telemetry.gpu.unavailable or "ok")
            if m.telemetry and m.telemetry.gpu else "off",
            "autopilot": m.autopilot.status() if m.autopilot is not None else None,
            "capabilities": capability_table(m),
            "capability_check": m.capability_note,
        }


def capability_table(m: StatusHost) -> list[dict[str, Any]]:
    """What the traffic used, and what the serving plan and the one a switch would go to (the standby, or the
    hybrid mode's other engine) were launched to support (serving.capabilities.table). Reads each role once,
    without the lock: status() calls it holding it, the Serve page every tick."""
    active_engine, standby = m.active, m.standby
    active = active_engine.plan if active_engine else None
    other = standby.plan if standby else None
    pilot = m.autopilot
    for hybrid in (pilot.other_plan, pilot.first_plan) if pilot is not None and other is None else ():
        if hybrid is not None and (active is None or hybrid.engine != active.engine):
            other = hybrid  # the hybrid pair's engine that does not serve now
            break
    return capabilities.table(m.proxy.capabilities.ago(traffic_key(m)), active=active, other=other)
