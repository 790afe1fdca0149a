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
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import psutil

from desktop.core.common import unixhttp
from desktop.core.common.errors import EngineFailed, EngineNotInstalled, SwitchyardError
from desktop.core.common.progress import ProgressCallback, ProgressEvent, no_progress
from desktop.core.engines import get_adapter
from desktop.core.engines.base import EngineAdapter, EngineInstall, LaunchPlan
from desktop.core.engines.model_path import resolve_model
from desktop.core.engines.vllm import SLEEP_MODE_FLAG, has_cuda, sleep_mode_supported
from desktop.core.machine.hardware import HardwareSnapshot, detect
from desktop.core.planning.fit import launch_dtype, level1_sleep_allowed
from desktop.core.planning.swap import SmallerPlan, engine_need_bytes, smaller_plan
from desktop.core.runtime.launches import record_launch
from desktop.core.runtime.supervisor import ColdStart, EngineEvent, EngineProcess, EngineState, reap_orphans
from desktop.core.runtime.telemetry import EngineScraper, Telemetry
from desktop.core.serving.defaults import DEFAULT_DRAIN_TIMEOUT
from desktop.core.serving.proxy import ProxyServer
from desktop.core.serving.router import Upstream

log = logging.getLogger("switchyard.endpoint")



@dataclass(frozen=True)
class EngineSpec:
    """What the user asked to serve: an engine, the model as typed (`demo`, a file, a folder: `demo` resolves to
    each engine's format, so a switch works) and the launch plan. With `plan` (e.g. recommend's, checked by the
    fit) that plan is launched as is, only its model path and port filled in; without one, a plain plan of
    `ctx_per_request` x `slots`."""

    engine: str
    model: str
    ctx_per_request: int = 2048
    slots: int = 4
    port: int = 0
    extra_args: tuple[str, ...] = ()
    gpu_layers: int | None = None  # llama.cpp -ngl; None = the engine's default
    kv_type: str | None = None  # llama.cpp KV cache type (f16, q8_0, ...); None = the engine's default
    plan: LaunchPlan | None = None  # the checked plan (serve, recommend); None: a plain plan from the fields

    def launch_plan(self, engine: str, model_path: Path) -> LaunchPlan:
        if self.plan is not None:
            return replace(self.plan, engine=engine, model_path=model_path, port=self.port or self.plan.port)
        dtype = launch_dtype(engine, demo=self.model == "demo", cuda=has_cuda())
        return LaunchPlan(engine=engine, model_path=model_path, port=self.port, ctx_per_request=self.ctx_per_request,
                          slots=self.slots, dtype=dtype, extra_args=self.extra_args, gpu_layers=self.gpu_layers,
                          kv_cache_type=self.kv_type)

    def to_json(self) -> dict[str, Any]:
        data = asdict(replace(self, plan=None))
        data["extra_args"] = list(self.extra_args)
        data["plan"] = self.plan.to_json() if self.plan else None
        return data


Launcher = Callable[[EngineSpec], tuple[EngineAdapter, LaunchPlan, EngineInstall]]


def make_launcher(progress: ProgressCallback = no_progress, *, install_missing: bool = False,
                  vllm_eager: bool = False, vllm_sleep: bool | None = None) -> Launcher:
    """The one way an EngineSpec becomes what the supervisor needs. The CLI wants a missing engine to be an
    error with the install command; the GUI installs it (once, cached) with progress and, on request, starts vLLM
    eager (no torch.compile: a faster start on a CPU box). vLLM gets sleep mode on CUDA (`vllm_sleep` None: when
    a CUDA GPU is there), so a stop-first switch can put it to sleep and wake it instead of a cold start."""
    sleep = has_cuda() if vllm_sleep is None else vllm_sleep

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
        plan = spec.launch_plan(adapter.name, model_path)
        if vllm_eager and adapter.name == "vllm":
            plan = replace(plan, eager=True)
        if sleep and adapter.name == "vllm" and SLEEP_MODE_FLAG not in plan.extra_args \
                and sleep_mode_supported(install):  # never on vLLM's CPU build, which rejects the flag
            plan = replace(plan, extra_args=(*plan.extra_args, SLEEP_MODE_FLAG))
        return adapter, plan, install

    return launch


default_launcher = make_launcher()


@dataclass
class ManagedEngine:
    """One engine process the endpoint owns, with its proxy identity."""

    spec: EngineSpec
    process: EngineProcess
    upstream: Upstream
    role: str  # "active" | "standby" | "starting" | "draining" | "sleeping"
    retried: str | None = None  # what changed in the retry after an out-of-memory load, if there was one

    @property
    def can_sleep(self) -> bool:
        """vLLM started with sleep mode (CUDA only): it can free its GPU memory and wake without a cold start."""
        return self.process.adapter.name == "vllm" and SLEEP_MODE_FLAG in self.process.plan.extra_args

    def to_json(self) -> dict[str, Any]:
        process = self.process
        return {
            "name": self.upstream.name,
            "role": self.role,
            "retried_smaller": self.retried,
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
    """The memory the endpoint's engines share (free VRAM on a GPU machine) and what each one needs, both from
    the fit, so the endpoint can tell whether two engines run side by side or one must stop first. Tests inject a
    simulated budget (`free_bytes`, and `need` when they like)."""

    free_bytes: float
    hardware: HardwareSnapshot | None = None
    need: Callable[[EngineSpec], float] | None = None
    label: str = "GPU memory"
    _cache: dict[EngineSpec, float] = field(default_factory=dict)

    def need_of(self, spec: EngineSpec) -> float:
        key = replace(spec, port=0)
        if key not in self._cache:
            if self.need is not None:
                self._cache[key] = self.need(spec)
            else:
                assert self.hardware is not None
                self._cache[key] = engine_need_bytes(spec.engine, spec.model, spec.ctx_per_request, spec.slots,
                                                     self.hardware)
        return self._cache[key]

    def fits(self, specs: Iterable[EngineSpec]) -> bool:
        return sum(self.need_of(spec) for spec in specs) <= self.free_bytes

    def describe(self, specs: Iterable[EngineSpec]) -> str:
        chosen = list(specs)
        needs = " + ".join(f"{s.engine} {self.need_of(s) / 2**30:.2f}" for s in chosen)
        return f"{needs} GiB vs {self.free_bytes / 2**30:.2f} GiB of free {self.label}"


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


def _host_holds_weights(engine: ManagedEngine) -> bool:
    """A level-1 sleep pins the weights in host RAM: only when RAM has room for them (else the vLLM is stopped)."""
    model = Path(engine.process.plan.model_path)
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors")) if model.is_dir() else 0
    return level1_sleep_allowed(weights, int(psutil.virtual_memory().available))


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
        ready_timeout: float = 900.0,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        keep_standby: bool = False,
        failover: bool = False,
        record_launches: bool = True,
        budget: MemoryBudget | None = None,
        auto_fit: bool = False,
        hardware: HardwareSnapshot | None = None,
        route: str | None = None,
        meter: bool = True,
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
        self.state = "starting"
        self.last_error: str | None = None
        self.spec: EngineSpec | None = None  # what this endpoint (or model) serves, also while it is unloaded
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
    def _launch(self, spec: EngineSpec) -> ManagedEngine:
        """Start an engine for `spec` and wait until it serves. When it fails for lack of memory: with auto_fit,
        retry once with the fit's next smaller plan and say what changed; without, say what that plan would be."""
        try:
            return self._launch_once(spec)
        except LoadOutOfMemory as exc:
            smaller = self._smaller(spec)
            if smaller is None:
                raise
            if not self.auto_fit:
                raise LoadOutOfMemory(exc.message, f"{exc.hint}. The next smaller plan: {smaller.describe()} "
                                                   "(serve with --auto-fit to retry with it by itself)") from exc
            retry = replace(spec, ctx_per_request=smaller.ctx, gpu_layers=smaller.gpu_layers, kv_type=smaller.kv_type,
                            plan=replace(spec.plan, ctx_per_request=smaller.ctx, gpu_layers=smaller.gpu_layers,
                                         kv_cache_type=smaller.kv_type) if spec.plan else None)
            self._emit("retrying", f"{exc.message}; retrying once with a smaller plan: {smaller.describe()}")
            managed = self._launch_once(retry)
            managed.retried = smaller.describe()
            return managed

    def _smaller(self, spec: EngineSpec) -> SmallerPlan | None:
        try:
            if self.hardware is None:
                self.hardware = detect()
            return smaller_plan(spec.engine, spec.model, spec.ctx_per_request, spec.slots, self.hardware,
                                gpu_layers=spec.gpu_layers, kv_type=spec.kv_type)
        except SwitchyardError as exc:  # e.g. a model whose facts cannot be read: no retry, the OOM is reported
            log.warning("no smaller plan for %s: %s", spec.model, exc)
            return None

    def _launch_once(self, spec: EngineSpec) -> ManagedEngine:
        """Start an engine for `spec` and wait until it really serves; stop it again if it does not."""
        adapter, plan, install = self.launcher(spec)
        if not plan.api_key:  # a per-launch key only the endpoint holds: the engine's own port is no side door
            plan = replace(plan, api_key=secrets.token_urlsafe(32))
        process = EngineProcess(adapter, plan, install)
        process.start()
        upstream = Upstream(name=f"{adapter.name}@{process.address_tag}", engine=adapter.name,
                            base_url=process.base_url, served_model_name=process.plan.served_model_name,
                            api_key=process.plan.api_key, model=str(process.plan.model_path),
                            messages_api=adapter.anthropic_messages,
                            closes_after_stream=adapter.closes_after_stream)
        managed = ManagedEngine(spec, process, upstream, "starting")
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
            record_launch(process, spec.model, source="endpoint")
        if process.cold_start.t1_health_s is not None:
            self.cold_starts[adapter.name] = process.cold_start.t1_health_s
        if self.telemetry is not None:
            self.telemetry.watch(EngineScraper(upstream.name, adapter, process.base_url, process.pid,
                                               api_key=process.plan.api_key))
        return managed

    def start(self, spec: EngineSpec) -> ColdStart:
        """Start the first engine and make it active. Requests that arrive meanwhile wait in the proxy."""
        with self._switch_lock:
            self.spec = spec
            self._emit("starting", f"starting {spec.engine} on {spec.model}")
            self.proxy.mark_loading(self.route)
            try:
                managed = self._launch(spec)
            except SwitchyardError as exc:
                self.last_error = str(exc)
                self._set_upstream(None, down_reason=exc.message, idle=self.route is not None)
                self._emit("down", exc.message)
                raise
            with self._lock:
                managed.role = "active"
                self.active = managed
                self.spec = managed.spec
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

    def _target_spec(self, engine: str, model: str | None) -> EngineSpec:
        with self._lock:
            old = self.active
        base = old.spec if old else self.spec
        if model is None and base is None:
            raise SwitchyardError("nothing is running to switch from; give --model")
        adapter = get_adapter(engine)
        if base is None:
            return EngineSpec(adapter.name, model or "demo")
        same = base.engine == adapter.name and (model is None or model == base.model)
        # a checked plan is per engine and model: another engine or model gets its own plain plan
        return replace(base, engine=adapter.name, model=model or base.model, port=0, plan=base.plan if same else None)

    def switch_preview(self, engine: str, model: str | None = None) -> dict[str, Any]:
        """Which kind of switch it would be and about how long it should take, for the GUI to say beforehand."""
        spec = self._target_spec(engine, model)
        with self._lock:
            old, standby, sleeping = self.active, self.standby, self.sleeping
        if standby is not None and standby.spec == spec:
            return {"kind": "standby", "expected_s": 0.0, "gap_s": 0.0,
                    "message": f"instant: {spec.engine} is already warm"}
        if sleeping is not None and sleeping.spec == spec:
            return {"kind": "wake", "expected_s": 2.0, "gap_s": 2.0,
                    "message": f"stop-first, waking the sleeping {spec.engine} (about a second; requests wait)"}
        cold = self.cold_starts.get(spec.engine)
        took = f"about {cold:.0f} s" if cold else "a cold start"
        if old is not None and self.budget is not None and not self.budget.fits([old.spec, spec]):
            return {"kind": "stop-first", "expected_s": cold, "gap_s": cold,
                    "message": f"stop-first: both engines do not fit ({self.budget.describe([old.spec, spec])}); "
                               f"requests wait for {took}"}
        return {"kind": "warm", "expected_s": cold, "gap_s": 0.0,
                "message": f"warm: {spec.engine} starts beside the current engine "
                           f"({took}); no request waits"}

    def _switch(self, engine: str, model: str | None) -> SwitchResult:
        started = time.monotonic()
        with self._lock:
            old = self.active
        spec = self._target_spec(engine, model)
        if old is not None and old.spec == spec and old.process.state == EngineState.READY:
            raise SwitchyardError(f"{old.upstream.name} already serves {spec.model}", "nothing to switch")
        reused = False
        with self._lock:
            standby, sleeping = self.standby, self.sleeping
        warm_standby = standby is not None and standby.spec == spec and standby.process.state == EngineState.READY
        wake = sleeping if sleeping is not None and sleeping.spec == spec and \
            sleeping.process.state == EngineState.READY else None
        if old is not None and not warm_standby and (
                wake is not None or (self.budget is not None and not self.budget.fits([old.spec, spec]))):
            return self._switch_stop_first(old, spec, started, wake)
        self._emit("switching", f"switching to {spec.engine} on {spec.model}")
        if warm_standby:
            assert standby is not None
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
            self.spec = new.spec
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

    def _switch_stop_first(self, old: ManagedEngine, spec: EngineSpec, started: float,
                           wake: ManagedEngine | None) -> SwitchResult:
        why = f"a sleeping {spec.engine} is woken" if wake is not None else \
            f"both do not fit: {self.budget.describe([old.spec, spec]) if self.budget else ''}"
        self._emit("switching", f"stop-first switch to {spec.engine} on {spec.model} ({why}); new requests wait "
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
                new = self._launch(spec)
        except SwitchyardError as exc:
            self.last_error = str(exc)
            restored = self._restore(old, slept)
            self._emit("serving" if restored else "down",
                       f"switch to {spec.engine} failed ({exc.message}); "
                       + (f"{old.upstream.name} serves again" if restored else "the old engine did not come back"))
            raise
        with self._lock:
            new.role = "active"
            self.active = new
            self.spec = new.spec
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
            url = managed.process.base_url  # the engine's private socket (desktop.core.common.unixhttp)
            with unixhttp.client(url, timeout=timeout) as client:
                response = client.post(unixhttp.http_url(url) + path,
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
        if old.can_sleep and old.process.state == EngineState.READY and _host_holds_weights(old) \
                and self._engine_post(old, "/sleep?level=1"):
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
                back = self._launch(old.spec)
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
