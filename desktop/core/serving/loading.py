"""How the endpoint loads one engine: the checked plan made into what the supervisor needs (`make_launcher`: the
engine's install, no orphans), the start behind the endpoint's private socket and per-launch key, the wait until it
really serves (health and a first real completion), and the one retry after a load that ran out of memory (the size
the engine said would start, else the fit's next smaller plan) or crashed in a way its adapter knows arguments
avoid. Apart from the manager (serving.endpoint) so that the engines' start and the endpoint's switches and
control surface are read one at a time; it takes what it needs of the manager as a `LoadHost`."""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from desktop.core.common.errors import EngineFailed, SwitchyardError
from desktop.core.common.progress import ProgressCallback, ProgressEvent, no_progress
from desktop.core.engines import get_adapter, require_install
from desktop.core.engines.base import EngineAdapter, EngineInstall, LaunchPlan
from desktop.core.engines.vllm import sleep_mode_supported
from desktop.core.hub.names import display_name
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.planning.swap import SmallerPlan, plan_facts, smaller_plan
from desktop.core.runtime.launches import record_launch
from desktop.core.runtime.supervisor import EngineEvent, EngineProcess, EngineState, reap_orphans
from desktop.core.runtime.telemetry import EngineScraper, Telemetry
from desktop.core.serving import normalize
from desktop.core.serving.capabilities import takes_images
from desktop.core.serving.managed import LoadCrashed, LoadOutOfMemory, ManagedEngine
from desktop.core.serving.router import Upstream
from desktop.core.serving.switching import shown

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
        progress(ProgressEvent(f"Starting {adapter.display_name} on {display_name(plan.model or plan.model_path)}; "
                              "waiting until it serves"))
        return adapter, plan, install

    return launch


default_launcher = make_launcher()


class LoadHost(Protocol):
    """What a load needs of the engine manager (serving.endpoint.EndpointManager): its settings, the `starting`
    role and its lock, the planner's check with the endpoint's own asks, and where a loaded engine's events go."""

    starting: ManagedEngine | None

    @property
    def lock(self) -> threading.RLock: ...
    @property
    def launcher(self) -> Launcher: ...
    @property
    def ready_timeout(self) -> float: ...
    @property
    def auto_fit(self) -> bool: ...
    @property
    def record_launches(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    @property
    def cold_starts(self) -> dict[str, float]: ...
    @property
    def telemetry(self) -> Telemetry | None: ...

    def emit(self, state: str, message: str) -> None: ...
    def planning_hardware(self) -> HardwareSnapshot: ...
    def check(self, plan: LaunchPlan, *, engine: str | None = None, model: str | None = None,
              changes: Mapping[str, Any] | None = None, hardware: HardwareSnapshot | None = None) -> LaunchPlan: ...
    def on_engine_event(self, managed: ManagedEngine, event: EngineEvent) -> None: ...


def launch(m: LoadHost, plan: LaunchPlan) -> ManagedEngine:
    """Check `plan` with the planner, start it and wait until it serves. A load that crashed in a way the adapter
    knows arguments avoid, or ran out of memory, goes back through the planner once with what `retry_for` changes
    (with auto_fit for the memory; without, the error says what the retry would be) and starts once more."""
    plan = m.check(plan)
    try:
        return launch_once(m, plan)
    except (LoadCrashed, LoadOutOfMemory) as exc:
        retry = retry_for(m, plan, exc)
        checked = m.check(plan, changes=retry.changes)
        m.emit("retrying", f"{exc.message}; {retry.said}")
        managed = launch_once(m, checked)
        managed.retried = retry.retried
        return managed


@dataclass(frozen=True)
class Retry:
    """The one retry of a failed load: the plan fields it changes (checked again by the planner), how the endpoint
    says it, and what the engine records as `retried` (None after a crash: the plan is the same size)."""

    changes: Mapping[str, Any]
    said: str
    retried: str | None = None


def retry_for(m: LoadHost, plan: LaunchPlan, exc: LoadCrashed | LoadOutOfMemory) -> Retry:
    """What the retry after `exc` changes: after a crash the adapter knows arguments avoid (llama-server's SIGILL in
    its weight repack; the supervisor remembered them for later starts), those arguments; after running out of
    memory, what the engine's log says would start, else the fit's next smaller plan. Raises `exc` when there is
    none, and without auto_fit an out-of-memory error that names the retry."""
    if isinstance(exc, LoadCrashed):
        if exc.fix is None or all(arg in plan.extra_args for arg in exc.fix.args):
            raise exc
        return Retry({"extra_args": (*plan.extra_args, *exc.fix.args)}, f"retrying once with {' '.join(exc.fix.args)}")
    told = get_adapter(plan.engine).memory_retry(exc.log_text, plan)
    if told is not None:  # the engine said what would start: retry with exactly that
        said, why = told
        if not m.auto_fit:
            raise LoadOutOfMemory(exc.message, f"{exc.hint}. The engine says this would start: {why} "
                                               "(serve with --auto-fit to retry with it by itself)") from exc
        return Retry(said, f"retrying once as the engine said: {why}", why)
    smaller = next_smaller(m, plan)
    if smaller is None:
        raise exc
    if not m.auto_fit:
        raise LoadOutOfMemory(exc.message, f"{exc.hint}. The next smaller plan: {smaller.describe()} "
                                           "(serve with --auto-fit to retry with it by itself)") from exc
    changes: dict[str, Any] = {"ctx_per_request": smaller.ctx}
    if smaller.kv_type != plan.kv_cache_type:
        changes["kv_cache_type"] = smaller.kv_type
    if smaller.gpu_layers != plan.gpu_layers:
        changes["gpu_layers"] = smaller.gpu_layers
    return Retry(changes, f"retrying once with a smaller plan: {smaller.describe()}", smaller.describe())


def next_smaller(m: LoadHost, plan: LaunchPlan) -> SmallerPlan | None:
    """The fit's next smaller plan on the memory free now, or None when there is none to try."""
    try:
        return smaller_plan(plan.engine, plan_facts(plan), plan.ctx_per_request, plan.slots, m.planning_hardware(),
                            gpu_layers=plan.gpu_layers, kv_type=plan.kv_cache_type)
    except SwitchyardError as exc:  # e.g. a model whose facts cannot be read: no retry, the OOM is reported
        log.warning("no smaller plan for %s: %s", shown(plan), exc)
        return None


def launch_once(m: LoadHost, checked: LaunchPlan) -> ManagedEngine:
    """Start an engine for the checked plan and wait until it really serves; stop it again if it does not."""
    adapter, plan, install = m.launcher(checked)
    sleep_flag = adapter.sleep_mode_flag
    if sleep_flag and sleep_flag in plan.extra_args and not sleep_mode_supported(install):
        # vLLM's CPU build rejects --enable-sleep-mode (an NVIDIA box can run it all the same)
        plan = replace(plan, extra_args=tuple(a for a in plan.extra_args if a != sleep_flag))
    if not plan.api_key:  # a per-launch key only the endpoint holds: the engine's own port is no side door
        plan = replace(plan, api_key=secrets.token_urlsafe(32))
    # behind the endpoint an engine listens on its private socket, whatever port a plan carries (a TCP port
    # only where the platform has no Unix sockets, then with the key above)
    plan = replace(plan, port=0)
    process = EngineProcess(adapter, plan, install)
    process.start()
    window, system_first = normalize.engine_rules(checked)
    upstream = Upstream(name=f"{adapter.name}@{process.address_tag}", engine=adapter.name,
                        base_url=process.base_url, served_model_name=process.plan.served_model_name,
                        api_key=process.plan.api_key, model=str(process.plan.model_path),
                        vision=takes_images(process.plan),
                        messages_api=adapter.anthropic_messages,
                        closes_after_stream=adapter.closes_after_stream,
                        context=plan.ctx_per_request, window=window, system_first=system_first,
                        listener_check=None if process.socket_path else process.listener_holds)
    managed = ManagedEngine(checked, process, upstream, "starting")
    with m.lock:
        m.starting = managed
    try:
        process.wait_ready(timeout=m.ready_timeout, first_request=True)
    except EngineFailed as exc:
        process.stop()
        reason = process.outcome.reason if process.outcome else None
        if reason is not None and reason.memory:
            oom = LoadOutOfMemory(exc.message, exc.hint)
            oom.log_text = "\n".join(process.log_tail(400))
            raise oom from exc
        if process.crash_fix is not None:  # a crash the adapter knows arguments avoid
            crashed = LoadCrashed(exc.message, exc.hint)
            crashed.fix = process.crash_fix
            raise crashed from exc
        raise
    except BaseException:
        process.stop()
        raise
    finally:
        with m.lock:
            m.starting = None
    def on_event(event: EngineEvent) -> None:
        m.on_engine_event(managed, event)

    process.subscribe(on_event)
    if process.state != EngineState.READY:  # died between ready and subscribe
        process.stop()
        raise process.failure()
    if m.closed:  # the endpoint was closed while this engine loaded
        process.stop()
        raise SwitchyardError("the endpoint was stopped while the engine was starting")
    if m.record_launches:
        record_launch(process, checked.model or str(checked.model_path), source="endpoint")
    if process.cold_start.t1_health_s is not None:
        m.cold_starts[adapter.name] = process.cold_start.t1_health_s
    if m.telemetry is not None:
        m.telemetry.watch(EngineScraper(upstream.name, adapter, process.base_url, process.pid,
                                           api_key=process.plan.api_key))
    return managed
