"""The engine manager behind the stable endpoint: which engine is active, which is kept warm as standby, how a
switch happens without failing a request, and what happens when the active engine dies.

A switch: start the other engine (or take the warm standby), wait until it really serves (health + a first real
completion), point the proxy at it in one step, let in-flight requests on the old one finish (drain), then stop
the old one or keep it warm when memory allows. If the new engine fails to start, the old one keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import psutil

from desktop.core.common.errors import EngineNotInstalled, SwitchyardError
from desktop.core.common.progress import ProgressCallback, ProgressEvent, no_progress
from desktop.core.engines import get_adapter
from desktop.core.engines.base import EngineAdapter, EngineInstall, LaunchPlan
from desktop.core.engines.model_path import resolve_model
from desktop.core.runtime.launches import record_launch
from desktop.core.runtime.supervisor import ColdStart, EngineEvent, EngineProcess, EngineState, reap_orphans
from desktop.core.runtime.telemetry import EngineScraper, Telemetry
from desktop.core.serving.proxy import ProxyServer
from desktop.core.serving.router import Upstream

log = logging.getLogger("switchyard.endpoint")


@dataclass(frozen=True)
class EngineSpec:
    """What the user asked to serve: engine, model (as typed: `demo`, a file, a folder) and the launch knobs."""

    engine: str
    model: str
    ctx: int = 2048
    parallel: int = 4
    port: int = 0
    extra_args: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["extra_args"] = list(self.extra_args)
        return data


Launcher = Callable[[EngineSpec], tuple[EngineAdapter, LaunchPlan, EngineInstall]]


def make_launcher(progress: ProgressCallback = no_progress, *, install_missing: bool = False,
                  vllm_eager: bool = False) -> Launcher:
    """The one way an EngineSpec becomes what the supervisor needs. The CLI wants a missing engine to be an
    error with the install command; the GUI installs it (once, cached) with progress and, on request, starts vLLM
    eager (no torch.compile: a faster start on a CPU box)."""

    def launch(spec: EngineSpec) -> tuple[EngineAdapter, LaunchPlan, EngineInstall]:
        adapter = get_adapter(spec.engine)
        model_path = resolve_model(spec.model, adapter, progress)
        install = adapter.find_install()
        if install is None and not install_missing:
            raise EngineNotInstalled(f"{adapter.display_name} is not installed",
                                     f"run `switchyard engines install {adapter.name}` first")
        if install is None:
            progress(ProgressEvent(f"{adapter.display_name} is not installed yet: installing it (once, cached)"))
            install = adapter.install(progress)
        reap_orphans()
        progress(ProgressEvent(f"Starting {adapter.display_name} on {model_path.name}; waiting until it serves"))
        plan = LaunchPlan(engine=adapter.name, model_path=model_path, port=spec.port, ctx=spec.ctx,
                          parallel=spec.parallel, extra_args=spec.extra_args,
                          eager=vllm_eager and adapter.name == "vllm")
        return adapter, plan, install

    return launch


default_launcher = make_launcher()


@dataclass
class ManagedEngine:
    """One engine process the endpoint owns, with its proxy identity."""

    spec: EngineSpec
    process: EngineProcess
    upstream: Upstream
    role: str  # "active" | "standby" | "starting" | "draining"

    def to_json(self) -> dict[str, Any]:
        process = self.process
        return {
            "name": self.upstream.name,
            "role": self.role,
            "spec": self.spec.to_json(),
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


def memory_allows_standby(engine_rss_bytes: float, available_bytes: float, headroom: float = 1.5) -> bool:
    """Keep an engine warm only when the machine would still have `headroom` × its size free."""
    return engine_rss_bytes > 0 and available_bytes > engine_rss_bytes * headroom


def _tree_rss(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        root = psutil.Process(pid)
        return float(sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]))
    except psutil.Error:
        return 0.0


class EndpointManager:
    """Owns the engines behind one ProxyServer. Thread-safe; switch() and start() block until done."""

    def __init__(
        self,
        proxy: ProxyServer,
        *,
        telemetry: Telemetry | None = None,
        launcher: Launcher = default_launcher,
        ready_timeout: float = 900.0,
        drain_timeout: float = 600.0,
        keep_standby: bool = False,
        failover: bool = False,
        record_launches: bool = True,
    ) -> None:
        self.proxy = proxy
        self.record_launches = record_launches  # each ready engine's cold start and load memory go to history
        self.telemetry = telemetry
        self.launcher = launcher
        self.ready_timeout = ready_timeout
        self.drain_timeout = drain_timeout
        self.keep_standby = keep_standby
        self.failover = failover
        self.state = "starting"
        self.last_error: str | None = None
        self.active: ManagedEngine | None = None
        self.standby: ManagedEngine | None = None
        self.starting: ManagedEngine | None = None
        self.down = threading.Event()  # set when the endpoint can no longer serve (active died, no failover)
        self._switch_lock = threading.Lock()
        self._lock = threading.RLock()
        self._listeners: list[EndpointListener] = []
        self._retired: list[ManagedEngine] = []
        self._closed = False
        if telemetry is not None:
            proxy.subscribe(lambda record: telemetry.publish(record.to_samples()))

    # --- observation ---
    def subscribe(self, listener: EndpointListener) -> None:
        self._listeners.append(listener)

    def _emit(self, state: str, message: str) -> None:
        self.state = state
        log.info("endpoint %s: %s", state, message)
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
                "model_name": self.proxy.model_name,
                "state": self.state,
                "last_error": self.last_error,
                "active": self.active.to_json() if self.active else None,
                "standby": self.standby.to_json() if self.standby else None,
                "starting": self.starting.to_json() if self.starting else None,
                "engines": len(engines),
                "requests": {**self.proxy.counters, "inflight": self.proxy.inflight()},
                "keep_standby": self.keep_standby,
                "failover": self.failover,
                "gpu_telemetry": (self.telemetry.gpu.unavailable or "ok")
                if self.telemetry and self.telemetry.gpu else "off",
            }

    # --- lifecycle ---
    def _launch(self, spec: EngineSpec) -> ManagedEngine:
        """Start an engine for `spec` and wait until it really serves; stop it again if it does not."""
        adapter, plan, install = self.launcher(spec)
        process = EngineProcess(adapter, plan, install)
        process.start()
        upstream = Upstream(name=f"{adapter.name}@{process.plan.port}", engine=adapter.name,
                            base_url=process.base_url, served_model_name=process.plan.served_model_name,
                            api_key=process.plan.api_key, model=str(process.plan.model_path))
        managed = ManagedEngine(spec, process, upstream, "starting")
        with self._lock:
            self.starting = managed
        try:
            process.wait_ready(timeout=self.ready_timeout, first_request=True)
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
            record_launch(process, spec.model, source="endpoint")
        if self.telemetry is not None:
            self.telemetry.watch(EngineScraper(upstream.name, adapter, process.base_url, process.pid,
                                               api_key=process.plan.api_key))
        return managed

    def start(self, spec: EngineSpec) -> ColdStart:
        """Start the first engine and make it active. Requests that arrive meanwhile wait in the proxy."""
        with self._switch_lock:
            self._emit("starting", f"starting {spec.engine} on {spec.model}")
            try:
                managed = self._launch(spec)
            except SwitchyardError as exc:
                self.last_error = str(exc)
                self.proxy.set_upstream(None, down_reason=exc.message)
                self._emit("down", exc.message)
                raise
            with self._lock:
                managed.role = "active"
                self.active = managed
            self.proxy.set_upstream(managed.upstream)
            self._emit("serving", f"{managed.upstream.name} serves {self.proxy.url}/v1")
            return managed.process.cold_start

    def prepare_standby(self, spec: EngineSpec) -> None:
        """Start `spec` now and keep it warm, so a later switch to it is instant."""
        with self._switch_lock:
            managed = self._launch(spec)
            with self._lock:
                previous, self.standby = self.standby, managed
                managed.role = "standby"
            if previous is not None:
                self._retire(previous, drain=False)

    def switch(self, engine: str, model: str | None = None) -> SwitchResult:
        """Move the endpoint to `engine` (and `model`, default: the active one's) without failing requests."""
        if not self._switch_lock.acquire(blocking=False):
            raise SwitchyardError("a switch is already in progress", "wait for it to finish (switchyard status)")
        try:
            return self._switch(engine, model)
        finally:
            self._switch_lock.release()

    def _switch(self, engine: str, model: str | None) -> SwitchResult:
        started = time.monotonic()
        with self._lock:
            old = self.active
        base = old.spec if old else None
        if model is None and base is None:
            raise SwitchyardError("nothing is running to switch from; give --model")
        adapter = get_adapter(engine)
        spec = replace(base, engine=adapter.name, model=model or base.model, port=0) if base else \
            EngineSpec(adapter.name, model or "demo")
        if old is not None and old.spec == spec and old.process.state == EngineState.READY:
            raise SwitchyardError(f"{old.upstream.name} already serves {spec.model}", "nothing to switch")
        self._emit("switching", f"switching to {spec.engine} on {spec.model}")
        reused = False
        with self._lock:
            standby = self.standby
        if standby is not None and standby.spec == spec and standby.process.state == EngineState.READY:
            new, reused = standby, True
            with self._lock:
                self.standby = None
        else:
            try:
                new = self._launch(spec)
            except SwitchyardError as exc:
                self.last_error = str(exc)
                self._emit("serving" if old else "down",
                           f"switch to {spec.engine} failed, {old.upstream.name if old else 'nothing'} "
                           f"keeps serving: {exc.message}")
                raise
        with self._lock:
            new.role = "active"
            self.active = new
        self.proxy.set_upstream(new.upstream)  # from here on, new requests go to the new engine
        self.down.clear()  # a switch also revives an endpoint whose engine had died
        drained, kept = True, False
        if old is not None:
            old.role = "draining"
            drained = self.proxy.drain(old.upstream, self.drain_timeout)
            kept = self._maybe_keep(old)
        self._emit("serving", f"{new.upstream.name} serves {self.proxy.url}/v1")
        return SwitchResult(old.upstream.engine if old else None, new.upstream.engine,
                            round(time.monotonic() - started, 3), reused, drained, kept,
                            None if reused else new.process.cold_start)

    def _maybe_keep(self, old: ManagedEngine) -> bool:
        available = float(psutil.virtual_memory().available)
        if self.keep_standby and old.process.state == EngineState.READY and \
                memory_allows_standby(_tree_rss(old.process.pid), available):
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
            if managed is self.standby:
                self.standby = None
                self._retired.append(managed)
                log.warning("standby %s died: %s", managed.upstream.name, reason.message)
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
        if self.telemetry is not None:
            threading.Thread(target=self.telemetry.unwatch, args=(managed.upstream.name,), daemon=True).start()
        if standby is not None:
            self.proxy.set_upstream(standby.upstream)
            self._emit("failover", f"{managed.upstream.name} died ({reason.message}); "
                                   f"{standby.upstream.name} took over")
            return
        self.proxy.set_upstream(None, down_reason=reason.message)
        self._emit("down", f"{reason.message} ({reason.hint})")
        self.down.set()

    def close(self) -> None:
        """Stop every engine (in-flight requests are cut); the proxy is stopped by its owner."""
        with self._lock:
            self._closed = True
            engines = [e for e in (self.active, self.standby, self.starting, *self._retired) if e is not None]
            self.active = self.standby = self.starting = None
            self._retired = []
        if self.telemetry is not None:
            for managed in engines:
                self.telemetry.unwatch(managed.upstream.name)
        for managed in engines:
            managed.process.stop()
        self._emit("stopped", "all engines stopped")
