"""The GUI's handle on what it serves: the stable endpoint (`desktop.core.serving.proxy` + `endpoint`), its engines and
their telemetry, driven through thread-pool workers.

Core calls block (install, wait until ready, switch with drain), so each runs in a worker. Supervisor and
telemetry callbacks arrive on background threads: state/phase/sample callbacks are re-emitted as Qt signals
(queued to the GUI thread); log lines are batched and drained by a GUI timer so a chatty engine cannot flood
the event loop.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QObject, QTimer, Signal
from shiboken6 import isValid

from desktop.ui.session_endpoint import open_endpoint
from desktop.ui.session_status import SessionStatus
from desktop.ui.workers import submit

if TYPE_CHECKING:
    from desktop.core.engines.base import LaunchPlan

LOG_DRAIN_MS = 100


def engine_choices() -> list[tuple[str, str]]:
    """(name, display name) of every registered engine, for the pages' engine lists."""
    from desktop.core.engines import ADAPTERS

    return [(adapter.name, adapter.display_name) for adapter in ADAPTERS.values()]


class EngineSession(SessionStatus, QObject):
    state_changed = Signal(str)  # the engine process's state
    endpoint_changed = Signal(str, str)  # endpoint state, readable message
    phase_reached = Signal(str, float)
    watching = Signal(str)  # a new engine process is now the one shown (its display name)
    log_lines = Signal(list)
    progress = Signal(str, str)  # text, and the step it belongs to as it stood when said (serve_status tags)
    ready = Signal(object)  # ColdStart
    failed = Signal(str)
    stopped = Signal()
    samples = Signal(list)  # list[telemetry.Sample]
    switched = Signal(object)  # endpoint.SwitchResult (+ .failed_requests)
    requests_changed = Signal()  # the request log moved: call request_snapshot() (coalesced: one pending at most)
    status_changed = Signal(object)  # serving.serve_status.ServeStatus: what the page, status bar and notices read

    def __init__(self, parent: QObject | None = None, endpoint_port: int | None = None) -> None:
        super().__init__(parent)
        self.endpoint_port = endpoint_port
        self.proxy: Any = None
        self.telemetry: Any = None
        self.manager: Any = None
        self.request_log: Any = None  # serving.requestlog.RequestLog, once the endpoint runs
        self.capture_bodies = False
        self._requests_pending = False
        self.plan: LaunchPlan | None = None  # what was asked to serve (the planner checks it in the worker)
        self.busy = self.switching = self.stopping = False
        self._last_status: Any = None
        self.vllm_eager = False  # vLLM without torch.compile: starts much sooner on CPU (tests, quick tries)
        self.telemetry_interval = 1.0  # seconds between scrapes of each engine (tests shorten it)
        self.launcher: Any = None  # how engines are launched (None: make_launcher, installing what is missing)
        self.autopilot_settings: Any = None  # hybrid mode's thresholds (None: the policy's defaults)
        self.reasoning_effort = "auto"  # the Serve page's Thinking choice: set on the endpoint when it opens
        self._stop_requested = False
        self._watched: Any = None  # the EngineProcess whose log we show
        self._pending_lines: deque[str] = deque(maxlen=5000)
        self._lines_lock = threading.Lock()
        self._setup_lock = threading.Lock()
        from desktop.ui.app_control import AppControl

        self.remote = AppControl(self)  # `switchyard status|switch|stop` from a shell reach this session
        self.host: Any = None  # serving.host.EndpointHost, once the endpoint runs
        self.log_timer = QTimer(self)
        self.log_timer.setInterval(LOG_DRAIN_MS)
        self.log_timer.timeout.connect(self._tick)
        self.state_changed.connect(lambda _state: self.publish_status())
        self.endpoint_changed.connect(lambda _state, _message: self.publish_status())

    # --- queries ---
    @property
    def process(self) -> Any:
        """The engine shown: the one starting (during a start or switch), else the active one."""
        manager = self.manager
        if manager is None:
            return None
        engine = manager.starting or manager.active
        return engine.process if engine is not None else None

    @property
    def endpoint_url(self) -> str | None:
        return f"{self.proxy.url}/v1" if self.proxy is not None else None

    def is_running(self) -> bool:
        process = self.process
        return process is not None and process.is_running()

    # --- endpoint setup (worker thread) ---
    def _ensure_endpoint(self) -> None:
        """The app's endpoint: the core's EndpointHost (as `switchyard serve --endpoint` builds it) with this
        session's listeners; `switchyard status|switch|stop|requests` from a shell reach it like the CLI's."""
        with self._setup_lock:
            if self.manager is not None:
                return
            host, manager = open_endpoint(
                self.endpoint_port, capture_bodies=self.capture_bodies, telemetry_interval=self.telemetry_interval,
                launcher=self.launcher, progress=self._progress, control=self.remote, on_request=self._on_request,
                on_samples=self._on_samples, on_event=self._on_endpoint_event)
            self.host = host
            self.proxy, self.telemetry, self.manager, self.request_log = \
                host.proxy, host.telemetry, manager, host.request_log
            self.proxy.set_reasoning(self.reasoning_effort)

    def set_capture_bodies(self, on: bool) -> None:
        """Keep request/response bodies in the request log from now on (the GUI's endpoint has no API key)."""
        self.capture_bodies = on
        if self.proxy is not None:
            self.proxy.set_capture_bodies(on)

    def _progress(self, event: Any) -> None:
        """A core step's message (any thread), tagged with the step underway when it was said: by the time the GUI
        shows it that step may be over (serve_status.notice_ends)."""
        from desktop.core.serving.serve_status import pending_tag

        status = self.status()
        self.progress.emit(getattr(event, "message", str(event)), status.action or pending_tag(status))

    # --- start ---
    def start(self, plan: LaunchPlan) -> None:
        """Serve `plan` (asked by a page: the planner checks it in the worker, a refusal arrives as `failed`)."""
        if self.busy:
            self.failed.emit("Switchyard is already starting or switching an engine: wait for it to finish.")
            return
        if self.is_running():
            self.failed.emit("An engine is already serving: stop it first, or use Switch.")
            return
        self.busy = True
        self._stop_requested = False
        self.plan = plan
        self.log_timer.start()
        self.publish_status()
        submit(self._start, plan, on_finished=self._on_ready, on_error=self._on_error)

    def _start(self, plan: LaunchPlan) -> Any:
        self._ensure_endpoint()
        self._apply_options()
        self.manager.autopilot = None  # one engine: a hybrid run before this one (stopped by close) is over
        return self.manager.start(plan)

    def start_hybrid(self, model: str, asks: dict[str, Any]) -> None:
        """Hybrid mode (`serve --engine auto`): both engines planned and fit-checked up front, llama.cpp serves at
        once, the autopilot brings vLLM in when the load makes it pay (serving.autopilot builds it for both)."""
        if self.busy or self.is_running():
            self.failed.emit("Switchyard is already serving or starting an engine: stop it first.")
            return
        self.busy = True
        self._stop_requested = False
        self.log_timer.start()
        self.publish_status()
        submit(self._start_hybrid, model, asks, on_finished=self._on_ready, on_error=self._on_error)

    def _start_hybrid(self, model: str, asks: dict[str, Any]) -> Any:
        from desktop.core.serving.autopilot import build_autopilot, plan_hybrid

        self._ensure_endpoint()
        self._apply_options()
        manager = self.manager
        manager.autopilot = None
        hardware = manager.machine()
        plans = plan_hybrid(model, hardware, asks, progress=self._progress,
                            hint="pick a smaller model, context or parallel count")
        store = self.host.store if self.host is not None else None
        autopilot = build_autopilot(manager, plans, hardware=hardware, budget=manager.budget,
                                    runs=store.runs(limit=500) if store is not None else [], model=model,
                                    settings=self.autopilot_settings, journal=self.request_log.note)
        self.plan = plans.first.plan
        try:
            cold = manager.start(plans.first.plan)
        except BaseException:
            manager.autopilot = None  # nothing serves: no loop to show
            raise
        autopilot.start()
        return cold

    def _apply_options(self) -> None:
        """vLLM without torch.compile when asked: an ask the planner checks like any other (start and switch)."""
        self.manager.engine_overrides["vllm"] = {"eager": True} if self.vllm_eager else {}

    def _on_ready(self, cold: Any) -> None:
        self.busy = False
        self._tick()
        self.publish_status()
        if not self._stop_requested:
            self.ready.emit(cold)

    def _on_error(self, message: str) -> None:
        self.busy = False
        self.switching = False
        self._tick()
        self.publish_status()
        if not self._stop_requested:  # stopped by the user while starting: not an error
            self.failed.emit(message)

    # --- switch ---
    def switch_to(self, engine: str) -> None:
        """Move the stable endpoint to `engine` on the same model; clients keep their URL and see no failure."""
        if self.manager is None or self.manager.active is None:
            self.failed.emit("Nothing is being served yet: start an engine first.")
            return
        if self.busy:
            self.failed.emit("Switchyard is already starting or switching an engine: wait for it to finish.")
            return
        self.busy = self.switching = True
        self._stop_requested = False
        self.publish_status()
        self.progress.emit(f"Switching to {engine}: starting it while the current engine keeps serving", "switch")
        submit(self._switch, engine, on_finished=self._on_switched, on_error=self._on_error)

    def _switch(self, engine: str, model: str | None = None) -> Any:
        failed_before = self.proxy.counters.get("failed", 0)
        self._apply_options()
        result = self.manager.switch(engine, model)
        result.failed_requests = self.proxy.counters.get("failed", 0) - failed_before
        self.plan = self.manager.plan
        return result

    def _on_switched(self, result: Any) -> None:
        self.busy = self.switching = False
        self._tick()
        self.publish_status()
        self.switched.emit(result)
        process = self.process
        if process is not None:
            self.ready.emit(process.cold_start)

    # --- stop ---
    def stop(self, then: Any = None) -> None:
        """Stop every engine off the GUI thread (the endpoint stays up, answering 'no engine'); then `then()`."""
        self._stop_requested = True
        manager = self.manager
        self.stopping = manager is not None
        self.publish_status()

        def done(_: Any = None) -> None:
            if not isValid(self):  # the window went away while engines stopped: finish without Qt
                self._shutdown_core()
                return
            self.stopping = False
            self._tick()
            self.publish_status()
            self.log_timer.stop()
            self.stopped.emit()
            if then is not None:
                then()

        if manager is None:
            done()
            return
        def failed(message: str) -> None:
            if isValid(self):
                self.failed.emit(message)
            done()

        submit(manager.close, on_finished=done, on_error=failed)

    def shutdown(self) -> None:
        """Stop engines, telemetry and the endpoint now, on the calling thread (quit path)."""
        self._stop_requested = True
        self.log_timer.stop()
        self._shutdown_core()

    def _shutdown_core(self) -> None:
        """The Qt-free part of shutting down, safe even after this QObject was deleted: the host tears down its
        parts in order (first the discovery file: `switchyard status` must not find an endpoint going away)."""
        if self.telemetry is not None:
            self.telemetry.unsubscribe(self._on_samples)
        host, self.host = self.host, None
        if host is not None:
            host.close()

    # --- callbacks from core threads: dropped once this object is gone (the window closed meanwhile) ---
    def _on_samples(self, samples: list[Any]) -> None:
        if isValid(self):
            self.samples.emit(samples)

    def _on_request(self, _kind: str, _record: Any) -> None:  # the endpoint's loop: one queued signal at most
        if not self._requests_pending and isValid(self):
            self._requests_pending = True
            self.requests_changed.emit()

    def _on_endpoint_event(self, event: Any) -> None:
        if isValid(self):
            self.endpoint_changed.emit(event.state, event.message)

    # --- engine events ---
    def _tick(self) -> None:
        process = self.process
        if process is not None and process is not self._watched:
            self._watch(process)
        self.publish_status()
        with self._lines_lock:
            if not self._pending_lines:
                return
            lines = list(self._pending_lines)
            self._pending_lines.clear()
        self.log_lines.emit(lines)

    def _watch(self, process: Any) -> None:
        """Follow a new engine process: its log so far, its phases so far, then live events."""
        self._watched = process
        with self._lines_lock:
            self._pending_lines.append(f"──── {process.adapter.display_name} · {process.base_url} · log: {process.log_path}")
            self._pending_lines.extend(process.log_tail(500))
        process.subscribe(lambda event, watched=process: self._on_event(watched, event))
        self.watching.emit(process.adapter.display_name)
        self.state_changed.emit(process.state.value)
        cold = process.cold_start
        for name, seconds in sorted(cold.markers.items(), key=lambda kv: kv[1]):
            self.phase_reached.emit(name, seconds)
        for name, value in cold.event_phases().items():
            self.phase_reached.emit(name, value)

    def _on_event(self, process: Any, event: Any) -> None:  # engine log thread
        if process is not self._watched or not isValid(self):
            return  # an engine we no longer show (e.g. the old one stopping after a switch)
        if event.kind == "log":
            with self._lines_lock:
                self._pending_lines.append(event.line)
        elif event.kind == "state" and event.state is not None:
            self.state_changed.emit(event.state.value)
        elif event.kind == "phase":
            self.phase_reached.emit(event.phase, float(event.seconds or 0.0))
