"""The engine manager behind the stable endpoint: which engine is active, which is kept warm as standby, how a
switch happens without failing a request, and what happens when the active engine dies.

A switch: start the other engine (or take the warm standby), wait until it really serves (health + a first real
completion), point the proxy at it in one step, let in-flight requests on the old one finish (drain), then stop
the old one or keep it warm when memory allows. If the new engine fails to start, the old one keeps serving.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import httpx
import psutil

from desktop.core.common.defaults import DEFAULT_READY_TIMEOUT
from desktop.core.common.errors import EngineFailed, SwitchyardError
from desktop.core.common.progress import ProgressCallback, ProgressEvent, no_progress
from desktop.core.engines import get_adapter, require_install
from desktop.core.engines.base import EngineAdapter, EngineInstall, LaunchPlan
from desktop.core.machine.hardware import HardwareSnapshot, detect
from desktop.core.planning.launch import SECRET_ENV, planned_command
from desktop.core.planning.planner import ask_key, plan_launch, replan
from desktop.core.planning.swap import Need, SmallerPlan, engine_need, plan_facts, smaller_plan
from desktop.core.runtime.launches import record_launch
from desktop.core.runtime.proctree import tree_rss
from desktop.core.runtime.supervisor import ColdStart, EngineEvent, EngineProcess, EngineState, reap_orphans
from desktop.core.runtime.telemetry import EngineScraper, Telemetry
from desktop.core.serving.defaults import DEFAULT_DRAIN_TIMEOUT
from desktop.core.serving.proxy import ProxyServer
from desktop.core.serving.router import Upstream

log = logging.getLogger("switchyard.endpoint")



Launcher = Callable[[LaunchPlan], tuple[EngineAdapter, LaunchPlan, EngineInstall]]


def make_launcher(progress: ProgressCallback = no_progress, *, install_missing: bool = False) -> Launcher:
    """The one way a checked plan becomes what the supervisor needs: the engine's install (the CLI wants a missing
    engine to be an error with the install command; the GUI installs it once, cached, with progress) and no
    orphans of earlier runs. The plan is launched exactly as the planner checked it."""

    def launch(plan: LaunchPlan) -> tuple[EngineAdapter, LaunchPlan, EngineInstall]:
        adapter = get_adapter(plan.engine)
        install = require_install(adapter, install_missing=install_missing, progress=progress)
        reap_orphans()
        progress(ProgressEvent(f"Starting {adapter.display_name} on {plan.model_path.name}; waiting until it serves"))
        return adapter, plan, install

    return launch


default_launcher = make_launcher()


@dataclass
class ManagedEngine:
    """One engine process the endpoint owns, with its proxy identity."""

    plan: LaunchPlan  # the checked plan it runs (before its port and per-launch key were filled in)
    process: EngineProcess
    upstream: Upstream
    role: str  # "active" | "standby" | "starting" | "draining" | "sleeping"
    retried: str | None = None  # what changed in the retry after an out-of-memory load, if there was one

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

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
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
    """An engine failed to load for lack of memory (the adapter's explanation says so)."""


@dataclass
class MemoryBudget:
    """The memory the endpoint's engines share (free VRAM per GPU on a GPU machine, and RAM) and what each checked
    plan holds there, both from the fit, so the endpoint can tell whether two engines run side by side or one must
    stop first. Needs are compared per GPU: a TP=2 vLLM must fit on each of its two GPUs, not in their sum. Tests
    inject a simulated budget (`free_bytes` and `need`, one shared pool)."""

    free_bytes: float
    hardware: HardwareSnapshot | None = None
    need: Callable[[LaunchPlan], float] | None = None
    label: str = "GPU memory"
    _cache: dict[str, Need] = field(default_factory=dict)

    def need_of(self, plan: LaunchPlan) -> Need:
        key = repr(replace(plan, port=0, api_key=None))
        if key not in self._cache:
            if self.need is not None:
                self._cache[key] = Need({-1: self.need(plan)}, 0.0)
            else:
                assert self.hardware is not None
                self._cache[key] = engine_need(plan, self.hardware)
        return self._cache[key]

    def _free(self) -> dict[int, float]:
        if self.need is not None or self.hardware is None:
            return {-1: self.free_bytes}
        return {g.index: float(g.memory_free_bytes) for g in self.hardware.gpus if g.memory_total_bytes > 0}

    def fits(self, plans: Iterable[LaunchPlan]) -> bool:
        used: dict[int, float] = {}
        ram = 0.0
        for plan in plans:
            need = self.need_of(plan)
            ram += need.ram
            for index, amount in need.gpu.items():
                used[index] = used.get(index, 0.0) + amount
        free = self._free()
        if any(amount > free.get(index, 0.0) for index, amount in used.items()):
            return False
        return self.hardware is None or self.need is not None or ram <= self.hardware.ram_available_bytes

    def describe(self, plans: Iterable[LaunchPlan]) -> str:
        chosen = list(plans)
        needs = " + ".join(f"{p.engine} {self.need_of(p).gpu_total / 2**30:.2f}" for p in chosen)
        free = self._free()
        per_gpu = "" if len(free) < 2 else " (" + ", ".join(f"GPU {i}: {b / 2**30:.2f}" for i, b in free.items()) + ")"
        return f"{needs} GiB vs {self.free_bytes / 2**30:.2f} GiB of free {self.label}{per_gpu}"


def machine_budget(hardware: HardwareSnapshot | None = None) -> MemoryBudget | None:
    """The budget on a machine with a GPU (its free VRAM now); None on a CPU-only one, where engines share RAM and
    a warm switch is decided by memory_allows_standby as before."""
    try:
        snapshot = hardware or detect()
    except Exception:  # detection problems must not stop serving: warm switches, as before
        log.exception("hardware detection failed; switches start the new engine before stopping the old one")
        return None
    gpus = [g for g in snapshot.gpus if g.memory_total_bytes > 0 and not g.unified_memory]
    if not gpus:
        return None
    return MemoryBudget(float(sum(g.memory_free_bytes for g in gpus)), hardware=snapshot)


def memory_allows_standby(engine_rss_bytes: float, available_bytes: float, headroom: float = 1.5) -> bool:
    """Keep an engine warm only when the machine would still have `headroom` × its size free."""
    return engine_rss_bytes > 0 and available_bytes > engine_rss_bytes * headroom


def _shown(plan: LaunchPlan) -> str:
    """The model as a person typed it (`demo`, a path), for messages."""
    return plan.model or str(plan.model_path)


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
        # asks this endpoint adds to every plan of one engine (engine name -> plan fields), e.g. the GUI's eager
        # vLLM: checked with the plan like any other ask
        self.engine_overrides: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (engine_overrides or {}).items()}
        self.state = "starting"
        self.last_error: str | None = None
        self.plan: LaunchPlan | None = None  # what this endpoint (or model) serves, also while it is unloaded
        self.active: ManagedEngine | None = None
        self.standby: ManagedEngine | None = None
        self.starting: ManagedEngine | None = None
        self.sleeping: ManagedEngine | None = None  # a vLLM put to sleep by a stop-first switch
        self.cold_starts: dict[str, float] = {}  # engine -> seconds its last cold start took (switch previews)
        self.down = threading.Event()  # set when the endpoint can no longer serve (active died, no failover)
        self._switch_lock = threading.Lock()
        self._lock = threading.RLock()
        self._listeners: list[EndpointListener] = []
        self._retired: list[ManagedEngine] = []
        self._closed = False
        if telemetry is not None and meter:
            proxy.subscribe(lambda record: telemetry.publish(record.to_samples()))

    # --- observation ---
    def subscribe(self, listener: EndpointListener) -> None:
        self._listeners.append(listener)

    def _emit(self, state: str, message: str) -> None:
        self.state = state
        log.info("endpoint%s %s: %s", f" [{self.route}]" if self.route else "", state, message)
        event = EndpointEvent(state, message)
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                log.exception("endpoint listener failed")

    def status(self) -> dict[str, Any]:
        with self._lock:
            engines = [e for e in (self.active, self.standby, self.starting) if e is not None]
            return {
                "url": self.proxy.url,
                "openai_base_url": self.proxy.url + "/v1",
                "model_name": self.route or self.proxy.model_name,
                "state": self.state,
                "last_error": self.last_error,
                "active": self.active.to_json() if self.active else None,
                "standby": self.standby.to_json() if self.standby else None,
                "starting": self.starting.to_json() if self.starting else None,
                "sleeping": self.sleeping.to_json() if self.sleeping else None,
                "engines": len(engines),
                "requests": {**self.proxy.counters, "inflight": self.proxy.inflight()},
                "keep_standby": self.keep_standby,
                "failover": self.failover,
                "auto_fit": self.auto_fit,
                "budget_gib": round(self.budget.free_bytes / 2**30, 2) if self.budget else None,
                "gpu_telemetry": (self.telemetry.gpu.unavailable or "ok")
                if self.telemetry and self.telemetry.gpu else "off",
            }

    def _set_upstream(self, upstream: Upstream | None, down_reason: str | None = None, idle: bool = False) -> None:
        self.proxy.set_upstream(upstream, down_reason, model=self.route, idle=idle)

    # --- lifecycle ---
    def _hardware(self) -> HardwareSnapshot:
        """The machine the plans are checked against: the one given, else this one as detected once."""
        if self.hardware is None:
            self.hardware = detect()
        return self.hardware

    def check(self, plan: LaunchPlan, *, engine: str | None = None, model: str | None = None,
              changes: Mapping[str, Any] | None = None) -> LaunchPlan:
        """The planner's checked plan for `plan`'s asks (for `engine`/`model` when given), with this endpoint's
        per-engine asks (the GUI's eager vLLM): what every launch of this endpoint runs. Raises PlanRefused."""
        target = get_adapter(engine or plan.engine).name
        extra = {**self.engine_overrides.get(target, {}), **(changes or {})}
        return replan(plan, self._hardware(), engine=engine, model=model, changes=extra).plan

    def _launch(self, plan: LaunchPlan) -> ManagedEngine:
        """Check `plan` with the planner, start it and wait until it serves. When it fails for lack of memory: with
        auto_fit, retry once with the fit's next smaller plan (checked again) and say what changed; without, say
        what that plan would be."""
        plan = self.check(plan)
        try:
            return self._launch_once(plan)
        except LoadOutOfMemory as exc:
            smaller = self._smaller(plan)
            if smaller is None:
                raise
            if not self.auto_fit:
                raise LoadOutOfMemory(exc.message, f"{exc.hint}. The next smaller plan: {smaller.describe()} "
                                                   "(serve with --auto-fit to retry with it by itself)") from exc
            changes: dict[str, Any] = {"ctx_per_request": smaller.ctx}
            if smaller.kv_type != plan.kv_cache_type:
                changes["kv_cache_type"] = smaller.kv_type
            if smaller.gpu_layers != plan.gpu_layers:
                changes["gpu_layers"] = smaller.gpu_layers
            retry = self.check(plan, changes=changes)
            self._emit("retrying", f"{exc.message}; retrying once with a smaller plan: {smaller.describe()}")
            managed = self._launch_once(retry)
            managed.retried = smaller.describe()
            return managed

    def _smaller(self, plan: LaunchPlan) -> SmallerPlan | None:
        try:
            return smaller_plan(plan.engine, plan_facts(plan), plan.ctx_per_request, plan.slots, self._hardware(),
                                gpu_layers=plan.gpu_layers, kv_type=plan.kv_cache_type)
        except SwitchyardError as exc:  # e.g. a model whose facts cannot be read: no retry, the OOM is reported
            log.warning("no smaller plan for %s: %s", _shown(plan), exc)
            return None

    def _launch_once(self, checked: LaunchPlan) -> ManagedEngine:
        """Start an engine for the checked plan and wait until it really serves; stop it again if it does not."""
        adapter, plan, install = self.launcher(checked)
        if not plan.api_key:  # a per-launch key only the endpoint holds: the engine's own port is no side door
            plan = replace(plan, api_key=secrets.token_urlsafe(32))
        process = EngineProcess(adapter, plan, install)
        process.start()
        upstream = Upstream(name=f"{adapter.name}@{process.plan.port}", engine=adapter.name,
                            base_url=process.base_url, served_model_name=process.plan.served_model_name,
                            api_key=process.plan.api_key, model=str(process.plan.model_path),
                            messages_api=adapter.anthropic_messages,
                            closes_after_stream=adapter.closes_after_stream)
        managed = ManagedEngine(checked, process, upstream, "starting")
        with self._lock:
            self.starting = managed
        try:
            process.wait_ready(timeout=self.ready_timeout, first_request=True)
        except EngineFailed as exc:
            process.stop()
            reason = process.outcome.reason if process.outcome else None
            if reason is not None and reason.memory:
                raise LoadOutOfMemory(exc.message, exc.hint) from exc
            raise
        except BaseException:
            process.stop()
            raise
        finally:
            with self._lock:
                self.starting = None
        def on_event(event: EngineEvent) -> None:
            self._on_engine_event(managed, event)

        process.subscribe(on_event)
        if process.state != EngineState.READY:  # died between ready and subscribe
            process.stop()
            raise process.failure()
        if self._closed:  # the endpoint was closed while this engine loaded
            process.stop()
            raise SwitchyardError("the endpoint was stopped while the engine was starting")
        if self.record_launches:
            record_launch(process, checked.model or str(checked.model_path), source="endpoint")
        if process.cold_start.t1_health_s is not None:
            self.cold_starts[adapter.name] = process.cold_start.t1_health_s
        if self.telemetry is not None:
            self.telemetry.watch(EngineScraper(upstream.name, adapter, process.base_url, process.pid,
                                               api_key=process.plan.api_key))
        return managed

    def start(self, plan: LaunchPlan) -> ColdStart:
        """Start the first engine and make it active (the plan checked again by the planner). Requests that arrive
        meanwhile wait in the proxy."""
        with self._switch_lock:
            self.plan = plan
            self._emit("starting", f"starting {plan.engine} on {_shown(plan)}")
            self.proxy.mark_loading(self.route)
            try:
                managed = self._launch(plan)
            except SwitchyardError as exc:
                self.last_error = str(exc)
                self._set_upstream(None, down_reason=exc.message, idle=self.route is not None)
                self._emit("down", exc.message)
                raise
            with self._lock:
                managed.role = "active"
                self.active = managed
                self.plan = managed.plan
            self._set_upstream(managed.upstream)
            self.down.clear()
            self._emit("serving", f"{managed.upstream.name} serves {self.proxy.url}/v1"
                                  + (f" as '{self.route}'" if self.route else "")
                                  + (f" (retried smaller: {managed.retried})" if managed.retried else ""))
            return managed.process.cold_start

    def unload(self, reason: str) -> bool:
        """Take the active engine away (idle TTL, or to make room for another model): new requests wait and ask
        for a load, in-flight ones drain (bounded), the engine stops. False when none was loaded."""
        with self._switch_lock:
            with self._lock:
                old = self.active
            if old is None:
                return False
            if self.route is not None:
                self.proxy.settle(self.route, 10.0)  # requests that waited for this load are let in first
            self._set_upstream(None, idle=True)
            with self._lock:
                self.active = None
            self._drain_or_cut(old)
            self._retire(old, drain=False)
            self._emit("idle", f"{old.upstream.name} stopped: {reason}")
            return True

    @property
    def loaded(self) -> bool:
        return self.active is not None

    def prepare_standby(self, plan: LaunchPlan) -> None:
        """Start `plan` (checked by the planner) now and keep it warm, so a later switch to it is instant."""
        with self._switch_lock:
            managed = self._launch(plan)
            with self._lock:
                previous, self.standby = self.standby, managed
                managed.role = "standby"
            if previous is not None:
                self._retire(previous, drain=False)

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
        with self._lock:
            old = self.active
        base = old.plan if old else self.plan
        if base is None:
            if model is None:
                raise SwitchyardError("nothing is running to switch from; give --model")
            return plan_launch(engine, model, self._hardware(), self.engine_overrides.get(get_adapter(engine).name))\
                .plan
        return self.check(base, engine=engine, model=model)

    def switch_preview(self, engine: str, model: str | None = None, name: str | None = None) -> dict[str, Any]:
        """Which kind of switch it would be, about how long it should take and the exact plan it would start (argv
        and env, secrets masked): for the GUI to say beforehand and for `switch --dry-run`."""
        self._one_model(name)
        plan = self.target(engine, model)
        kind = self._switch_kind(plan)
        with self._lock:
            old = self.active
        cold = self.cold_starts.get(plan.engine)
        took = f"about {cold:.0f} s" if cold else "a cold start"
        preview: dict[str, Any]
        if kind == "standby":
            preview = {"kind": "standby", "expected_s": 0.0, "gap_s": 0.0,
                       "message": f"instant: {plan.engine} is already warm"}
        elif kind == "wake":
            preview = {"kind": "wake", "expected_s": 2.0, "gap_s": 2.0,
                       "message": f"stop-first, waking the sleeping {plan.engine} (about a second; requests wait)"}
        elif kind == "stop-first" and old is not None and self.budget is not None:
            preview = {"kind": "stop-first", "expected_s": cold, "gap_s": cold,
                       "message": f"stop-first: both engines do not fit ({self.budget.describe([old.plan, plan])}); "
                                  f"requests wait for {took}"}
        else:
            preview = {"kind": "warm", "expected_s": cold, "gap_s": 0.0,
                       "message": f"warm: {plan.engine} starts beside the current engine ({took}); no request waits"}
        command = planned_command(plan)
        preview.update(plan=plan.to_json(), argv=command.argv,
                       env={k: ("***" if k in SECRET_ENV else v) for k, v in command.env.items()})
        return preview

    def _same(self, managed: ManagedEngine | None, plan: LaunchPlan) -> bool:
        return managed is not None and ask_key(managed.plan) == ask_key(plan) and \
            managed.process.state == EngineState.READY

    def _switch_kind(self, plan: LaunchPlan) -> str:
        """standby (a warm one takes over) | wake (a sleeping vLLM) | stop-first (both do not fit) | warm."""
        with self._lock:
            old, standby, sleeping = self.active, self.standby, self.sleeping
        if self._same(standby, plan):
            return "standby"
        if old is not None and self._same(sleeping, plan):
            return "wake"
        if old is not None and self.budget is not None and not self.budget.fits([old.plan, plan]):
            return "stop-first"
        return "warm"

    def _switch(self, engine: str, model: str | None) -> SwitchResult:
        started = time.monotonic()
        with self._lock:
            old = self.active
        try:
            plan = self.target(engine, model)
        except SwitchyardError as exc:  # refused by the planner: nothing started, the old engine keeps serving
            self.last_error = str(exc)
            self._emit("serving" if old else "down", f"switch to {engine} refused, "
                       f"{old.upstream.name if old else 'nothing'} keeps serving: {exc.message}")
            raise
        if self._same(old, plan):
            assert old is not None
            raise SwitchyardError(f"{old.upstream.name} already serves {_shown(plan)}", "nothing to switch")
        kind = self._switch_kind(plan)
        with self._lock:
            standby, sleeping = self.standby, self.sleeping
        if old is not None and kind in ("wake", "stop-first"):
            return self._switch_stop_first(old, plan, started, sleeping if kind == "wake" else None)
        self._emit("switching", f"switching to {plan.engine} on {_shown(plan)}")
        reused = kind == "standby"
        if reused:
            assert standby is not None
            new = standby
            with self._lock:
                self.standby = None
        else:
            try:
                new = self._launch(plan)
            except SwitchyardError as exc:
                self.last_error = str(exc)
                self._emit("serving" if old else "down",
                           f"switch to {plan.engine} failed, {old.upstream.name if old else 'nothing'} "
                           f"keeps serving: {exc.message}")
                raise
        with self._lock:
            new.role = "active"
            self.active = new
            self.plan = new.plan
        self._set_upstream(new.upstream)  # from here on, new requests go to the new engine
        self.down.clear()  # a switch also revives an endpoint whose engine had died
        drained, kept, cut = True, False, 0
        if old is not None:
            old.role = "draining"
            drained, cut = self._drain_or_cut(old)
            kept = self._maybe_keep(old)
        self._emit("serving", f"{new.upstream.name} serves {self.proxy.url}/v1")
        return SwitchResult(old.upstream.engine if old else None, new.upstream.engine,
                            round(time.monotonic() - started, 3), reused, drained, kept,
                            None if reused else new.process.cold_start, kind="standby" if reused else "warm",
                            cut_requests=cut, retried_smaller=new.retried)

    def _drain_or_cut(self, old: ManagedEngine) -> tuple[bool, int]:
        """Let in-flight requests on `old` finish until the drain deadline; end the rest with a retryable error."""
        drained = self.proxy.drain(old.upstream, self.drain_timeout)
        if drained:
            return True, 0
        cut = self.proxy.cut(old.upstream, f"the endpoint switched engines and this request was still running "
                                           f"after the {self.drain_timeout:g} s drain deadline; retry it")
        log.warning("%d request(s) on %s cut at the drain deadline", cut, old.upstream.name)
        return False, cut

    def _switch_stop_first(self, old: ManagedEngine, plan: LaunchPlan, started: float,
                           wake: ManagedEngine | None) -> SwitchResult:
        why = f"a sleeping {plan.engine} is woken" if wake is not None else \
            f"both do not fit: {self.budget.describe([old.plan, plan]) if self.budget else ''}"
        self._emit("switching", f"stop-first switch to {plan.engine} on {_shown(plan)} ({why}); new requests wait "
                                "at the endpoint meanwhile")
        gap_started = time.monotonic()
        self._set_upstream(None)  # new requests wait (none fail) until the new engine serves
        self.proxy.mark_loading(self.route)
        old.role = "draining"
        drained, cut = self._drain_or_cut(old)
        slept = self._put_away(old)
        try:
            new = self._wake(wake) if wake is not None else None
            if new is None:
                new = self._launch(plan)
        except SwitchyardError as exc:
            self.last_error = str(exc)
            restored = self._restore(old, slept)
            self._emit("serving" if restored else "down",
                       f"switch to {plan.engine} failed ({exc.message}); "
                       + (f"{old.upstream.name} serves again" if restored else "the old engine did not come back"))
            raise
        with self._lock:
            new.role = "active"
            self.active = new
            self.plan = new.plan
        self._set_upstream(new.upstream)
        gap = round(time.monotonic() - gap_started, 3)
        self.down.clear()
        self._emit("serving", f"{new.upstream.name} serves {self.proxy.url}/v1 (stop-first; no engine served for "
                              f"{gap:.1f} s, requests waited)")
        return SwitchResult(old.upstream.engine, new.upstream.engine, round(time.monotonic() - started, 3),
                            False, drained, False, None if wake is not None else new.process.cold_start,
                            kind="stop-first", gap_s=gap, cut_requests=cut, woke=wake is not None,
                            old_sleeping=slept, retried_smaller=new.retried)

    def _engine_post(self, managed: ManagedEngine, path: str, timeout: float = 120.0) -> bool:
        key = managed.process.plan.api_key
        try:
            response = httpx.post(managed.process.base_url + path, timeout=timeout, trust_env=False,
                                  headers={"Authorization": f"Bearer {key}"} if key else None)
        except httpx.HTTPError as exc:
            log.warning("%s %s failed: %s", managed.upstream.name, path, exc)
            return False
        if response.status_code >= 300:
            log.warning("%s %s answered HTTP %d", managed.upstream.name, path, response.status_code)
        return response.status_code < 300

    def _put_away(self, old: ManagedEngine) -> bool:
        """Free the old engine's memory: sleep a vLLM that has sleep mode (level 1: weights to host RAM, KV cache
        dropped), stop anything else. True when it sleeps."""
        if old.can_sleep and old.process.state == EngineState.READY and self._engine_post(old, "/sleep?level=1"):
            with self._lock:
                previous, self.sleeping = self.sleeping, old
                old.role = "sleeping"
                if self.active is old:
                    self.active = None
            if previous is not None and previous is not old:
                self._retire(previous, drain=False)
            return True
        self._retire(old, drain=False)
        with self._lock:
            if self.active is old:
                self.active = None
        return False

    def _wake(self, sleeping: ManagedEngine) -> ManagedEngine | None:
        """Wake a sleeping vLLM (POST /wake_up); None (and it is stopped) when it does not wake."""
        with self._lock:
            if self.sleeping is sleeping:
                self.sleeping = None
        if sleeping.process.state == EngineState.READY and self._engine_post(sleeping, "/wake_up"):
            return sleeping
        self._retire(sleeping, drain=False)
        return None

    def _restore(self, old: ManagedEngine, slept: bool) -> bool:
        """After a failed stop-first switch: bring the old engine back (wake it, or start it again)."""
        try:
            back = self._wake(old) if slept else None
            if back is None:
                back = self._launch(old.plan)
        except SwitchyardError as exc:
            log.error("the old engine did not come back: %s", exc)
            self._set_upstream(None, down_reason=f"a switch failed and the old engine did not come back: "
                                                 f"{exc.message}", idle=self.route is not None)
            self.down.set()
            return False
        with self._lock:
            back.role = "active"
            self.active = back
        self._set_upstream(back.upstream)
        return True

    def _maybe_keep(self, old: ManagedEngine) -> bool:
        available = float(psutil.virtual_memory().available)
        if self.keep_standby and old.process.state == EngineState.READY and \
                memory_allows_standby(float(tree_rss(old.process.pid) or 0), available):
            with self._lock:
                previous, self.standby = self.standby, old
                old.role = "standby"
            if previous is not None and previous is not old:
                self._retire(previous, drain=False)
            return True
        self._retire(old, drain=False)
        return False

    def _retire(self, managed: ManagedEngine, drain: bool) -> None:
        if drain:
            self.proxy.drain(managed.upstream, self.drain_timeout)
        if self.telemetry is not None:
            self.telemetry.unwatch(managed.upstream.name)
        managed.process.stop()
        managed.role = "stopped"

    def _on_engine_event(self, managed: ManagedEngine, event: EngineEvent) -> None:
        """Runs on the engine's log thread: never stop() that engine here (it would join its own thread)."""
        if event.kind != "state" or event.state != EngineState.CRASHED:
            return
        reason = managed.process.failure()
        with self._lock:
            if managed is self.standby or managed is self.sleeping:
                if managed is self.standby:
                    self.standby = None
                else:
                    self.sleeping = None
                self._retired.append(managed)
                log.warning("%s %s died: %s", managed.role, managed.upstream.name, reason.message)
                return
            if managed is not self.active:
                return
            self.last_error = str(reason)
            standby = self.standby
            if self.failover and standby is not None and standby.process.state == EngineState.READY:
                self.active, self.standby = standby, None
                standby.role = "active"
                self._retired.append(managed)
            else:
                standby = None
                if self.route is not None:  # a model of several: the next request for it loads it again
                    self.active = None
                    self._retired.append(managed)
        if self.telemetry is not None:
            threading.Thread(target=self.telemetry.unwatch, args=(managed.upstream.name,), daemon=True).start()
        if standby is not None:
            self._set_upstream(standby.upstream)
            self._emit("failover", f"{managed.upstream.name} died ({reason.message}); "
                                   f"{standby.upstream.name} took over")
            return
        self._set_upstream(None, down_reason=reason.message, idle=self.route is not None)
        self._emit("down", f"{reason.message} ({reason.hint})")
        self.down.set()

    def close(self) -> None:
        """Stop every engine (in-flight requests are cut); the proxy is stopped by its owner."""
        with self._lock:
            self._closed = True
            engines = [e for e in (self.active, self.standby, self.starting, self.sleeping, *self._retired)
                       if e is not None]
            self.active = self.standby = self.starting = self.sleeping = None
            self._retired = []
        if self.telemetry is not None:
            for managed in engines:
                self.telemetry.unwatch(managed.upstream.name)
        for managed in engines:
            managed.process.stop()
        self._emit("stopped", "all engines stopped")
