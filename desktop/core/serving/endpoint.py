"""The engine manager behind the stable endpoint: which engine is active, which is kept warm as standby, how a
switch happens without failing a request, and what happens when the active engine dies.

A switch: start the other engine (or take the warm standby), wait until it really serves (health + a first real
completion), point the proxy at it in one step, let in-flight requests on the old one finish (drain), then stop
the old one or keep it warm when memory allows. If the new engine fails to start, the old one keeps serving.

The manager holds the state and the entry points; the steps live beside it, each taking what it needs of the
manager as a Protocol: one engine's load and its retry (serving.loading), each kind of switch (serving.switching),
and what the control surface shows (serving.endpoint_status).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from desktop.core.common.defaults import DEFAULT_READY_TIMEOUT
from desktop.core.common.errors import SwitchyardError
from desktop.core.engines import get_adapter
from desktop.core.engines.base import LaunchPlan
from desktop.core.hub.names import counterpart
from desktop.core.machine.hardware import HardwareSnapshot, detect
from desktop.core.planning.planner import plan_launch, replan
from desktop.core.runtime.supervisor import ColdStart, EngineEvent, EngineState
from desktop.core.runtime.telemetry import Telemetry
from desktop.core.serving import endpoint_status, loading, switching
from desktop.core.serving.budget import MemoryBudget, machine_budget, memory_allows_standby
from desktop.core.serving.defaults import DEFAULT_DRAIN_TIMEOUT
from desktop.core.serving.loading import Launcher, default_launcher, make_launcher
from desktop.core.serving.managed import (
    EndpointEvent,
    EndpointListener,
    EngineSlots,
    LoadCrashed,
    LoadOutOfMemory,
    ManagedEngine,
    SlotView,
    SwitchResult,
)
from desktop.core.serving.proxy import ProxyServer
from desktop.core.serving.router import Upstream

log = logging.getLogger("switchyard.endpoint")


class EndpointManager:
    """Owns the engines behind one ProxyServer (or behind one model name of it: `route`, in multi-model mode).
    Thread-safe; switch() and start() block until done.

    A switch is warm (the new engine starts while the old one serves) unless `budget` says the two do not fit in
    memory together; then it is stop-first: new requests wait at the endpoint, in-flight ones drain (until
    `drain_timeout`, after which the rest end with a retryable error), the old engine stops (a vLLM with sleep
    mode sleeps instead, so switching back skips its cold start), the new one starts, requests flow."""

    def __init__(
        self,
        proxy: ProxyServer,
        *,
        telemetry: Telemetry | None = None,
        launcher: Launcher = default_launcher,
        ready_timeout: float = DEFAULT_READY_TIMEOUT,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        keep_standby: bool = False,
        failover: bool = False,
        record_launches: bool = True,
        budget: MemoryBudget | None = None,
        auto_fit: bool = False,
        hardware: HardwareSnapshot | None = None,
        route: str | None = None,
        meter: bool = True,
        engine_overrides: Mapping[str, Mapping[str, Any]] | None = None,
        redetect: Callable[[], HardwareSnapshot] | None = None,
    ) -> None:
        self.proxy = proxy
        self.record_launches = record_launches  # each ready engine's cold start and load memory go to history
        self.telemetry = telemetry
        self.launcher = launcher
        self.ready_timeout = ready_timeout
        self.drain_timeout = drain_timeout
        self.keep_standby = keep_standby
        self.failover = failover
        self.budget = budget
        self.auto_fit = auto_fit
        self.hardware = hardware or (budget.hardware if budget else None)
        self.route = route
        # how to read this machine's memory again (NVML) once a vLLM sleeps: the next plans are checked against
        # what it left. None for a recorded snapshot (`--hardware`): there the fit's model of the sleeper is used.
        self.redetect = redetect if redetect is not None else (detect if self.hardware is None else None)
        self._beside: tuple[ManagedEngine, HardwareSnapshot] | None = None  # the sleeper and the machine beside it
        # asks this endpoint adds to every plan of one engine (engine name -> plan fields), e.g. the GUI's eager
        # vLLM: checked with the plan like any other ask
        self.engine_overrides: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (engine_overrides or {}).items()}
        self.state = "starting"
        self.last_error: str | None = None
        self.capability_note: str | None = None  # a crash failover's capability check: pending, or what it found
        self.plan: LaunchPlan | None = None  # what this endpoint (or model) serves, also while it is unloaded
        self.slots = EngineSlots()  # the one state: which engine is active, standby, starting, sleeping
        self.cold_starts: dict[str, float] = {}  # engine -> seconds its last cold start took (switch previews)
        self.down = threading.Event()  # set when the endpoint can no longer serve (active died, no failover)
        self._switch_lock = threading.Lock()
        self.lock = threading.RLock()
        self._listeners: list[EndpointListener] = []
        self.closed = False  # set by close(): an engine that finishes loading afterwards is stopped at once
        self.autopilot: Any = None  # serve --engine auto: the hybrid loop (serving.autopilot), shown in status
        if telemetry is not None and meter:
            proxy.subscribe(lambda record: telemetry.publish(record.to_samples()))

    active = SlotView("active")
    standby = SlotView("standby")
    starting = SlotView("starting")
    sleeping = SlotView("sleeping")  # a vLLM put to sleep by a stop-first switch

    # --- observation ---
    def subscribe(self, listener: EndpointListener) -> None:
        self._listeners.append(listener)

    def emit(self, state: str, message: str) -> None:
        self.state = state
        log.info("endpoint%s %s: %s", f" [{self.route}]" if self.route else "", state, message)
        event = EndpointEvent(state, message)
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                log.exception("endpoint listener failed")

    def status(self) -> dict[str, Any]:
        """What the control channel, `serve --json` and the GUI show (serving.endpoint_status)."""
        return endpoint_status.status(self)

    def capability_table(self) -> list[dict[str, Any]]:
        """What the traffic used, and what the serving plan and a switch's target were launched to support."""
        return endpoint_status.capability_table(self)

    def set_upstream(self, upstream: Upstream | None, down_reason: str | None = None, idle: bool = False) -> None:
        self.proxy.set_upstream(upstream, down_reason, model=self.route, idle=idle)

    # --- lifecycle ---
    def machine(self) -> HardwareSnapshot:
        """The machine without our engines: the one given, else this one as detected once."""
        if self.hardware is None:
            self.hardware = detect()
        return self.hardware

    def planning_hardware(self) -> HardwareSnapshot:
        """The machine the plans are checked against: while a vLLM sleeps, as it was read after it went to sleep
        (its CUDA context and graph pool stay on the GPU, level 1 pins its weights in RAM); else `machine()`."""
        with self.lock:
            beside = self._beside
            if beside is not None and beside[0] is self.sleeping:
                return beside[1]
        return self.machine()

    def beside_sleeper(self, sleeper: ManagedEngine, modelled: HardwareSnapshot) -> HardwareSnapshot:
        """`sleeper` went to sleep: read the memory again (`redetect`, NVML), or take the fit's model of what it
        left for a recorded snapshot. Plans are checked against that for as long as it sleeps."""
        fresh = modelled
        if self.redetect is not None:
            try:
                fresh = self.redetect()
            except Exception:  # detection problems must not stop serving: the fit's model stands in
                log.exception("reading the GPU memory again after the sleep failed; using the fit's estimate")
        with self.lock:
            self._beside = (sleeper, fresh)
        return fresh

    def check(self, plan: LaunchPlan, *, engine: str | None = None, model: str | None = None,
              changes: Mapping[str, Any] | None = None, hardware: HardwareSnapshot | None = None) -> LaunchPlan:
        """The planner's checked plan for `plan`'s asks (for `engine`/`model` when given), with this endpoint's
        per-engine asks (the GUI's eager vLLM): what every launch of this endpoint runs, on `hardware` (default:
        the memory free now, see `planning_hardware`). Raises PlanRefused."""
        target = get_adapter(engine or plan.engine).name
        extra = {**self.engine_overrides.get(target, {}), **(changes or {})}
        return replan(plan, hardware or self.planning_hardware(), engine=engine, model=model, changes=extra).plan

    def launch(self, plan: LaunchPlan) -> ManagedEngine:
        """Check `plan` with the planner, start it and wait until it serves, retrying once after a load that ran
        out of memory or crashed in a known way (serving.loading.launch)."""
        return loading.launch(self, plan)

    def start(self, plan: LaunchPlan) -> ColdStart:
        """Start the first engine and make it active (the plan checked again by the planner). Requests that arrive
        meanwhile wait in the proxy."""
        with self._switch_lock:
            with self.lock:
                self.closed = False  # a start after close() (the GUI's Stop, then Start) serves again
            self.plan = plan
            self.emit("starting", f"starting {plan.engine} on {switching.shown(plan)}")
            self.proxy.mark_loading(self.route)
            try:
                managed = self.launch(plan)
            except SwitchyardError as exc:
                self.last_error = str(exc)
                self.set_upstream(None, down_reason=exc.message, idle=self.route is not None)
                self.emit("down", exc.message)
                raise
            switching.promote(self, managed)
            self.emit("serving", f"{managed.upstream.name} serves {self.proxy.url}/v1"
                                  + (f" as '{self.route}'" if self.route else "")
                                  + (f" (retried smaller: {managed.retried})" if managed.retried else ""))
            return managed.process.cold_start

    def unload(self, reason: str) -> bool:
        """Take the active engine away (idle TTL, or to make room for another model): new requests wait and ask
        for a load, in-flight ones drain (bounded), the engine stops. False when none was loaded."""
        with self._switch_lock:
            with self.lock:
                old = self.active
            if old is None:
                return False
            if self.route is not None:
                self.proxy.settle(self.route, 10.0)  # requests that waited for this load are let in first
            self.set_upstream(None, idle=True)
            with self.lock:
                self.active = None
            switching.drain_or_cut(self, old)
            self.retire(old, drain=False)
            self.emit("idle", f"{old.upstream.name} stopped: {reason}")
            return True

    @property
    def loaded(self) -> bool:
        return self.active is not None

    def prepare_standby(self, plan: LaunchPlan) -> None:
        """Start `plan` (checked by the planner) now and keep it warm, so a later switch to it is instant."""
        with self._switch_lock:
            managed = self.launch(plan)
            with self.lock:
                previous, self.standby = self.standby, managed
            if previous is not None:
                self.retire(previous, drain=False)

    def _one_model(self, name: str | None) -> None:
        if name is not None and name != self.route:
            raise SwitchyardError(f"this endpoint serves one model; there is no '{name}' to pick", "drop --name")

    def switch(self, engine: str, model: str | None = None, name: str | None = None) -> SwitchResult:
        """Move the endpoint to `engine` (and `model`, default: the active one's) without failing requests."""
        self._one_model(name)
        if not self._switch_lock.acquire(blocking=False):
            raise SwitchyardError("a switch is already in progress", "wait for it to finish (switchyard status)")
        try:
            return self._switch(engine, model)
        finally:
            self._switch_lock.release()

    def target(self, engine: str, model: str | None = None) -> LaunchPlan:
        """The checked plan a switch to `engine` (and `model`, default: the one served) would start: planned again
        from the served plan's asks, so fields of the old engine never reach the new one. Raises PlanRefused."""
        with self.lock:
            old = self.active
        base = old.plan if old else self.plan
        if base is None:
            if model is None:
                raise SwitchyardError("nothing is running to switch from; give --model")
            return plan_launch(engine, model, self.planning_hardware(), self.engine_overrides.get(get_adapter(engine).name))\
                .plan
        if model is None:  # a downloaded repo with a GGUF beside its safetensors: the copy the new engine loads
            model = counterpart(base.model or str(base.model_path), engine)
        with self.lock:
            sleeper = self.sleeping
        if sleeper is not None:  # waking the sleeper needs no room beside itself: its plan on the machine
            try:
                own = self.check(base, engine=engine, model=model, hardware=self.machine())
            except SwitchyardError:
                own = None
            if own is not None and switching.same(sleeper, own):
                return own
        return self.check(base, engine=engine, model=model)

    def switch_preview(self, engine: str, model: str | None = None, name: str | None = None) -> dict[str, Any]:
        """Which kind of switch it would be, about how long it should take and the exact plan it would start (argv
        and env, secrets masked): for the GUI to say beforehand and for `switch --dry-run`."""
        self._one_model(name)
        return switching.preview(self, self.target(engine, model))

    def _switch(self, engine: str, model: str | None) -> SwitchResult:
        started = time.monotonic()
        with self.lock:
            old = self.active
        try:
            plan = self.target(engine, model)
        except SwitchyardError as exc:  # refused by the planner: nothing started, the old engine keeps serving
            self.last_error = str(exc)
            self.emit("serving" if old else "down", f"switch to {engine} refused, "
                      f"{old.upstream.name if old else 'nothing'} keeps serving: {exc.message}")
            raise
        if switching.same(old, plan):
            assert old is not None
            raise SwitchyardError(f"{old.upstream.name} already serves {switching.shown(plan)}", "nothing to switch")
        kind = switching.kind_of(self, plan)
        if old is not None and kind in ("wake", "stop-first"):
            return switching.stop_first(self, old, plan, started, self.sleeping if kind == "wake" else None)
        return switching.warm(self, old, plan, kind, started)

    def retire(self, managed: ManagedEngine, drain: bool = False) -> None:
        """Stop `managed` (after draining it, with `drain`); it leaves whatever role it held."""
        with self.lock:
            self.slots.release(managed, "stopping")
        if drain:
            self.proxy.drain(managed.upstream, self.drain_timeout)
        if self.telemetry is not None:
            self.telemetry.unwatch(managed.upstream.name)
        managed.process.stop()
        managed.role = "stopped"

    def on_engine_event(self, managed: ManagedEngine, event: EngineEvent) -> None:
        """Runs on the engine's log thread: never stop() that engine here (it would join its own thread)."""
        if event.kind == "state" and event.state == EngineState.CRASHED:
            switching.on_crash(self, managed)

    def close(self) -> None:
        """Stop every engine (in-flight requests are cut); the proxy is stopped by its owner."""
        if self.autopilot is not None:  # it acts through this manager: it stops first
            self.autopilot.stop()
        with self.lock:
            self.closed = True
            engines = self.slots.take_all()
        if self.telemetry is not None:
            for managed in engines:
                self.telemetry.unwatch(managed.upstream.name)
        for managed in engines:
            managed.process.stop()
        self.emit("stopped", "all engines stopped")


__all__ = ["EndpointEvent", "EndpointListener", "EndpointManager", "Launcher", "LoadCrashed", "LoadOutOfMemory",
           "ManagedEngine", "MemoryBudget", "SwitchResult", "default_launcher", "machine_budget", "make_launcher",
           "memory_allows_standby"]
