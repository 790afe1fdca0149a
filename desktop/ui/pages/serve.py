"""Serve: start/stop an engine, its state and cold-start timeline, the endpoint URL, live charts, the log, and
the one-click switch to the other engine."""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QComboBox,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from desktop.core.common.defaults import DEFAULT_CTX_PER_REQUEST, DEFAULT_SLOTS
from desktop.core.common.errors import SwitchyardError
from desktop.ui.charts import ChartBoard, LiveChart, pause_checkbox
from desktop.ui.chat import ChatPane
from desktop.ui.engine_session import EngineSession, engine_choices
from desktop.ui.requests_panel import RequestsPanel
from desktop.ui.widgets import LogPane, Notice, PhaseTimeline
from desktop.ui.workers import submit

CHARTS: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("Throughput", "tokens/s", {"generation_tokens_per_s": "generated", "prompt_tokens_per_s": "prompt"}),
    ("Latency", "ms", {"ttft_ms": "TTFT", "tpot_ms": "TPOT / ITL", "proxy_ttft_ms": "TTFT at endpoint"}),
    ("Requests", "requests", {"requests_running": "running", "requests_waiting": "waiting"}),
    ("KV cache", "%", {"kv_cache_percent": "KV cache used"}),
    # One unit per chart, so a series in GiB is not flattened under one in percent.
    ("Utilization", "%", {"cpu_percent": "engine CPU (100 = one core)", "gpu_util": "GPU"}),
    ("Memory", "GiB", {"rss_gib": "engine RSS (process tree)", "gpu_mem_used_gib": "GPU memory used"}),
)
# telemetry series -> (chart series, scale)
SERIES_MAP: dict[str, tuple[str, float]] = {
    "generation_tokens_per_s": ("generation_tokens_per_s", 1.0),
    "prompt_tokens_per_s": ("prompt_tokens_per_s", 1.0),
    "ttft_s": ("ttft_ms", 1000.0),
    "itl_s": ("tpot_ms", 1000.0),
    "proxy_ttft_s": ("proxy_ttft_ms", 1000.0),
    "requests_running": ("requests_running", 1.0),
    "requests_waiting": ("requests_waiting", 1.0),
    "kv_cache_usage": ("kv_cache_percent", 100.0),
    "gpu_util": ("gpu_util", 1.0),
    "gpu_mem_used_bytes": ("gpu_mem_used_gib", 1.0 / 1024**3),
    "cpu_percent": ("cpu_percent", 1.0),
    "rss_bytes": ("rss_gib", 1.0 / 1024**3),
}


LIVE_MS = 500
HYBRID = "auto"  # the engine list's hybrid entry (`serve --engine auto`)
MOVES = {"hand_over": "llama.cpp → vLLM", "switch_stop_first": "llama.cpp → vLLM (stop-first)",
         "retire": "vLLM → llama.cpp"}


def autopilot_text(status: dict[str, Any]) -> str:
    """The hybrid endpoint in words, from its status (`status --json`'s "autopilot"): its state and last decision,
    then the last engine move it made and how it went (kept while later ticks decide "stay")."""
    last = status.get("last") or {}
    text = f"Hybrid ({status['state']}): {last.get('action', 'watching')} — {last.get('reason', 'no decision yet')}"
    done = next((d for d in reversed(status.get("decisions") or []) if "switch" in d.get("numbers", {})), None)
    if done is not None:
        switch = done["numbers"]["switch"]
        cut = switch.get("cut_requests") or 0
        text += (f"\nLast move: {done['action']} {MOVES.get(done['action'], '')} at "
                 f"{time.strftime('%H:%M:%S', time.localtime(done['t']))} — {switch['kind']} switch in "
                 f"{switch['seconds']:.1f} s, no engine served for {switch.get('gap_s') or 0.0:.1f} s, "
                 f"{cut} request{'s' if cut != 1 else ''} cut")
    return text


def capabilities_text(rows: list[dict[str, Any]], check: str | None = None) -> str:
    """The capability table (serving.capabilities.table) in a line per capability the traffic used: when, and what
    the serving plan and the one a switch would go to were launched to support; then `check`, a crash failover's
    capability check (the manager's `capability_note`), when there is one."""
    used = [r for r in rows if r.get("traffic_s_ago") is not None]
    if not used:
        return "Capabilities: the traffic used none of tools, JSON schemas, images, reasoning so far"
    lines = ["Capabilities the traffic used (a switch probes the next engine for each first):"]
    for row in used:
        other = f", other engine: {row['other']}" if row.get("other") else ""
        lines.append(f"  {row['capability']} ({row['traffic_s_ago']:.0f} s ago) — serving: {row.get('active') or '-'}"
                     f"{other}")
    if check:
        lines.append(check[0].upper() + check[1:])
    return "\n".join(lines)


def engine_short(process: Any) -> str:
    """"llama.cpp", "vLLM": the engine's name without its server's."""
    return str(process.adapter.display_name).split(" (")[0] if process is not None else ""


def engines_line(serving: Any, starting: Any, shown: Any = None) -> str:
    """Both engines' states in one line: what serves, and what starts (how long so far, in which phase)."""
    from desktop.core.runtime.supervisor import PHASE_BY_KEY

    parts = []
    if serving is not None:
        parts.append(f"serving: {engine_short(serving)}" if serving.state.value == "ready"
                     else f"{serving.state.value}: {engine_short(serving)}")
    if starting is not None and starting.is_running():
        phase = starting.cold_start.current_phase()
        label = PHASE_BY_KEY[phase].label if phase else "ready"
        parts.append(f"starting: {engine_short(starting)} {starting.elapsed():.0f} s, {label}")
    if not parts and shown is not None:  # an engine that crashed or stopped, or the very first start
        parts.append(f"{shown.state.value}: {engine_short(shown)}")
    return " · ".join(parts) or "stopped"


def form_plan(engine: str, model: str, ctx: int, parallel: int, flags: str = "") -> Any:
    """What the form asks for, as a plan not yet checked (the session's endpoint checks it before it starts).
    `flags`: the engine's own flags as typed (engines.engine_args counts, refuses or passes each through)."""
    import shlex

    from desktop.core.engines import get_adapter
    from desktop.core.engines.engine_args import plan_fields_from_args
    from desktop.core.planning.planner import ask

    asked: dict[str, Any] = {"ctx_per_request": ctx, "slots": parallel}
    if flags.strip():
        try:
            words = shlex.split(flags)
        except ValueError as exc:
            raise SwitchyardError(f"the engine flags do not parse: {exc}", "check the quotes") from None
        asked.update(plan_fields_from_args(get_adapter(engine).name, words))
    return ask(engine, model, asked)


def plan_for_form(engine: str, model: str, ctx: int, parallel: int, flags: str = "") -> Any:
    """The checked LaunchPlan the Start button would launch on this machine (installs and starts nothing)."""
    from desktop.core.machine.hardware import detect
    from desktop.core.planning.planner import replan

    return replan(form_plan(engine, model, ctx, parallel, flags), detect()).plan


class ServePage(QWidget):
    title = "Serve"
    engine_ready = Signal(object)

    def __init__(self, session: EngineSession, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.samples_received = 0
        self.endpoint_state = "stopped"
        self.export_dialog: Any = None

        # --- launch controls ---
        self.engine_box = QComboBox()
        for key, label in engine_choices():  # the adapter registry: a new engine shows up here by itself
            self.engine_box.addItem(label, key)
        self.engine_box.addItem("Hybrid (auto)", HYBRID)
        self.engine_box.setItemData(self.engine_box.count() - 1, "llama.cpp serves at once; vLLM is brought in "
                                    "when sustained load passes this machine's crossover, and retired when idle",
                                    Qt.ItemDataRole.ToolTipRole)
        self.engine_box.setAccessibleName("Engine")
        self.model_edit = QLineEdit("demo")
        self.model_edit.setAccessibleName("Model")
        self.model_edit.setMinimumWidth(64)  # "demo" stays readable when the row is crowded (it was cut to "emo")
        self.model_edit.setToolTip("`demo`, a GGUF file (llama.cpp) or a Hugging Face folder (vLLM)")
        self.ctx_spin = QSpinBox()
        self.ctx_spin.setRange(256, 1_048_576)
        self.ctx_spin.setSingleStep(1024)
        self.ctx_spin.setValue(DEFAULT_CTX_PER_REQUEST)
        self.ctx_spin.setAccessibleName("Context length")
        self.parallel_spin = QSpinBox()
        self.parallel_spin.setRange(1, 1024)
        self.parallel_spin.setValue(DEFAULT_SLOTS)
        self.parallel_spin.setAccessibleName("Parallel sequences")
        self.flags_edit = QLineEdit()
        self.flags_edit.setAccessibleName("Engine flags")
        self.flags_edit.setPlaceholderText("engine flags")
        self.flags_edit.setToolTip("The engine's own flags, as after `switchyard serve ... --`: the fit counts "
                                   "--n-cpu-moe, --cpu-moe, -ctk/-ctv (llama.cpp) and --cpu-offload-gb (vLLM); "
                                   "flags the plan owns are refused; the rest pass through unaccounted")
        self.start_button = QPushButton("&Start")
        self.stop_button = QPushButton("S&top")
        self.switch_button = QPushButton("S&witch engine")
        self.export_button = QPushButton("E&xport…")
        self.export_button.setToolTip("This launch plan as a shell command, docker run, Compose, Kubernetes, Ray "
                                      "or Helm")
        self.export_button.clicked.connect(lambda: self.open_export())
        self.prepare_button = QPushButton("&Prepare vLLM")
        self.prepare_button.setToolTip("Start vLLM once on this model and plan and stop it, so its compile cache "
                                       "is warm and the real first start (or a switch) is much shorter")
        self.prepare_button.clicked.connect(lambda: self.prepare_vllm())
        self.preparing = False
        self.start_button.clicked.connect(self.start_clicked)
        self.stop_button.clicked.connect(self.stop_clicked)
        self.switch_button.clicked.connect(self.switch_clicked)
        controls = QHBoxLayout()
        for caption, widget in (("&Engine:", self.engine_box), ("&Model:", self.model_edit),
                                ("&Context:", self.ctx_spin), ("&Parallel:", self.parallel_spin),
                                ("F&lags:", self.flags_edit)):
            buddy = QLabel(caption)
            buddy.setBuddy(widget)
            controls.addWidget(buddy)
            controls.addWidget(widget, 2 if widget is self.model_edit else 0)
        controls.addWidget(self.start_button)
        controls.addWidget(self.stop_button)
        controls.addWidget(self.switch_button)
        controls.addWidget(self.export_button)
        controls.addWidget(self.prepare_button)

        # --- state, endpoint, timeline ---
        self.state_label = QLabel("stopped")
        self.state_label.setObjectName("engineState")
        self.state_label.setAccessibleName("Engine state")
        self.endpoint_edit = QLineEdit()
        self.endpoint_edit.setReadOnly(True)
        self.endpoint_edit.setPlaceholderText("The endpoint appears here once an engine serves")
        self.endpoint_edit.setAccessibleName("Endpoint URL")
        self.copy_button = QPushButton("C&opy")
        self.copy_button.setToolTip("Copy the endpoint URL to the clipboard")
        self.copy_button.clicked.connect(self.copy_endpoint)
        self.notice = Notice()
        self.switch_label = QLabel("")
        self.switch_label.setAccessibleName("Last switch")
        self.timeline = PhaseTimeline()
        self.autopilot_label = QLabel("")  # the hybrid endpoint (serve --engine auto): its state and last decision
        self.autopilot_label.setObjectName("autopilotDecision")
        self.autopilot_label.setAccessibleName("Hybrid mode decision")
        self.autopilot_label.setWordWrap(True)
        self.autopilot_label.hide()
        self.capabilities_label = QLabel("")  # what the traffic used, and what each plan supports (issue 41)
        self.capabilities_label.setObjectName("capabilities")
        self.capabilities_label.setAccessibleName("Capabilities the traffic used")
        self.capabilities_label.setWordWrap(True)
        self.capabilities_label.hide()
        status = QGridLayout()
        status.addWidget(QLabel("State:"), 0, 0)
        status.addWidget(self.state_label, 0, 1)
        endpoint_label = QLabel("E&ndpoint:")
        endpoint_label.setBuddy(self.endpoint_edit)
        status.addWidget(endpoint_label, 0, 2)
        status.addWidget(self.endpoint_edit, 0, 3)
        status.addWidget(self.copy_button, 0, 4)
        status.addWidget(self.switch_label, 1, 0, 1, 5)
        status.addWidget(self.autopilot_label, 2, 0, 1, 5)
        status.addWidget(self.capabilities_label, 3, 0, 1, 5)
        status.setColumnStretch(3, 1)

        # --- charts ---
        self.board = ChartBoard(self)
        self.charts: dict[str, LiveChart] = {}
        grid = QGridLayout()
        for index, (title, unit, series) in enumerate(CHARTS):
            chart = self.board.add(LiveChart(title, unit), series)
            self.charts[title] = chart
            grid.addWidget(chart, index // 3, index % 3)
        self.pause_box = pause_checkbox(self.board)
        charts_box = QGroupBox("Live")
        charts_layout = QVBoxLayout(charts_box)
        charts_layout.addWidget(self.pause_box)
        charts_layout.addLayout(grid)

        self.log_pane = LogPane()
        self.chat = ChatPane()
        upper = QWidget()
        upper_layout = QVBoxLayout(upper)
        upper_layout.setContentsMargins(0, 0, 0, 0)
        upper_layout.addLayout(controls)
        upper_layout.addLayout(status)
        upper_layout.addWidget(self.notice)
        upper_layout.addWidget(self.timeline)
        upper_layout.addWidget(charts_box, 1)
        splitter = QSplitter(Qt.Orientation.Vertical)
        splitter.addWidget(upper)
        self.requests_panel = RequestsPanel(session)  # the request log, live (desktop/ui/requests_panel.py)
        self.bottom_tabs = QTabWidget()
        self.bottom_tabs.addTab(self.log_pane, "Engine &log")
        self.bottom_tabs.addTab(self.requests_panel, self.requests_panel.title)
        self.requests_panel.title_changed.connect(
            lambda title: self.bottom_tabs.setTabText(self.bottom_tabs.indexOf(self.requests_panel), title))
        self.bottom_tabs.addTab(self.chat, "T&ry it (chat)")
        from desktop.ui.models_editor import ModelsEditor

        self.models_editor = ModelsEditor(self.model_state)  # the endpoint's models.yaml, as the CLI reads it
        self.bottom_tabs.addTab(self.models_editor, self.models_editor.title)
        self.bottom_tabs.setAccessibleName("Engine log, requests and chat")
        splitter.addWidget(self.bottom_tabs)
        splitter.setStretchFactor(0, 4)
        splitter.setStretchFactor(1, 1)
        layout = QVBoxLayout(self)
        layout.addWidget(splitter)

        session.state_changed.connect(self.on_state)
        session.phase_reached.connect(lambda _name, _seconds: self.refresh_live())
        session.watching.connect(lambda _name: self.refresh_live())
        session.log_lines.connect(self.log_pane.append_lines)
        session.progress.connect(lambda text: self.notice.show_message(text))
        session.ready.connect(self.on_ready)
        session.failed.connect(self.on_failed)
        session.stopped.connect(self.on_stopped)
        session.endpoint_changed.connect(self.on_endpoint)
        session.samples.connect(self.on_samples)
        session.switched.connect(self.on_switched)
        self.board.start()
        self._serving_source: str | None = None  # the upstream whose telemetry the charts show
        self._rows: dict[int, Any] = {}  # the engine processes on the cold-start bar, by row key
        self.live_timer = QTimer(self)  # the bar grows and the engines' line counts while an engine starts
        self.live_timer.setInterval(LIVE_MS)
        self.live_timer.timeout.connect(self.refresh_live)
        self.live_timer.start()
        self._update_buttons()

    # --- actions ---
    def launch(self, plan: Any) -> None:
        """Serve `plan` (a LaunchPlan: the form's asks, or the Recommend page's checked plan)."""
        index = self.engine_box.findData(plan.engine)
        if index >= 0:
            self.engine_box.setCurrentIndex(index)
        model = plan.model or str(plan.model_path)
        self.model_edit.setText(model)
        self.ctx_spin.setValue(plan.ctx_per_request)
        self.parallel_spin.setValue(plan.slots)
        self.timeline.clear()
        self.notice.show_message(f"Starting {plan.engine} on {model}…")
        self.session.start(plan)
        self._update_buttons()

    def start_clicked(self) -> None:
        if self.engine_box.currentData() == HYBRID:
            self.launch_hybrid()
            return
        try:
            plan = form_plan(self.engine_box.currentData(), self.model_edit.text().strip() or "demo",
                             self.ctx_spin.value(), self.parallel_spin.value(), self.flags_edit.text())
        except SwitchyardError as exc:
            self.notice.show_message(f"{exc.message}" + (f" ({exc.hint})" if exc.hint else ""), "error")
            return
        self.launch(plan)

    def launch_hybrid(self) -> None:
        """Hybrid mode, as `serve --engine auto`: the session plans both engines, starts llama.cpp and the loop."""
        model = self.model_edit.text().strip() or "demo"
        self.timeline.clear()
        self.notice.show_message(f"Starting hybrid mode on {model}: llama.cpp first, vLLM when the load pays…")
        self.session.start_hybrid(model, {"ctx_per_request": self.ctx_spin.value(),
                                          "slots": self.parallel_spin.value()})
        self._update_buttons()

    def form_engine(self) -> str:
        """The engine the form names (hybrid mode starts on llama.cpp: its plan is the one to export)."""
        engine = str(self.engine_box.currentData())
        return "llama.cpp" if engine == HYBRID else engine

    def stop_clicked(self) -> None:
        self.notice.show_message("Stopping…")
        self.session.stop()

    def other_engine(self) -> str:
        current = self.session.process.adapter.name if self.session.process is not None else self.form_engine()
        names = [name for name, _label in engine_choices()]
        return names[(names.index(current) + 1) % len(names)] if current in names else names[0]

    def switch_clicked(self) -> None:
        target = self.other_engine()
        preview = self.session.switch_preview(target)
        self.switch_label.setText(f"Switching to {target}… ({preview or 'the current engine keeps serving meanwhile'})")
        self.session.switch_to(target)
        index = self.engine_box.findData(target)
        self.engine_box.setCurrentIndex(index)

    def prepare_vllm(self) -> bool:
        """"Prepare vLLM" for the form's model and plan in the background (desktop.core.serving.prepare)."""
        from desktop.core.serving.prepare import prepare

        if self.preparing:
            return False
        spec = form_plan("vllm", self.model_edit.text().strip() or "demo", self.ctx_spin.value(),
                         self.parallel_spin.value())
        self.preparing = True
        self.prepare_button.setEnabled(False)
        self.notice.show_message("Preparing vLLM: one start to fill its compile cache (the engines above keep "
                                 "serving)…")
        submit(prepare, spec, eager=self.session.vllm_eager, progress=self.session._progress,
               on_finished=self._prepared, on_error=self._prepare_failed)
        return True

    def _prepared(self, done: Any) -> None:
        self.preparing = False
        self.prepare_button.setEnabled(True)
        cold = done.cold_start
        self.notice.show_message(
            f"vLLM prepared on {done.model}: compile cache {done.compile_cache or 'not reported'} "
            f"({'was already warm' if done.was_warm else 'filled now'}); that start took "
            f"{(cold.get('t3_first_request_s') or 0):.1f} s. The next start of this plan loads compiled graphs.")

    def _prepare_failed(self, message: str) -> None:
        self.preparing = False
        self.prepare_button.setEnabled(True)
        self.notice.show_message(f"Preparing vLLM failed: {message}", "error")

    def open_export(self, modal: bool = True) -> None:
        """The export dialog for the plan being served, else for what the form says (resolved off the GUI
        thread: `demo` may have to be built first)."""
        process = self.session.process
        if process is not None:
            self._show_export(process.plan, modal)
            return
        self.export_button.setEnabled(False)
        self.notice.show_message("Preparing the launch plan…")
        submit(plan_for_form, self.form_engine(), self.model_edit.text().strip() or "demo",
               self.ctx_spin.value(), self.parallel_spin.value(), self.flags_edit.text(),
               on_finished=lambda plan: self._show_export(plan, modal), on_error=self._export_failed)

    def _export_failed(self, message: str) -> None:
        self.export_button.setEnabled(True)
        self.notice.show_message(message, "error")

    def _show_export(self, plan: Any, modal: bool) -> None:
        from desktop.ui.export_dialog import ExportDialog

        self.export_button.setEnabled(True)
        if self.notice.text() == "Preparing the launch plan…":
            self.notice.show_message("")
        self.export_dialog = ExportDialog(plan, parent=self)
        if modal:
            self.export_dialog.exec()
            self.export_dialog.deleteLater()
            self.export_dialog = None
        else:
            self.export_dialog.show()

    def copy_endpoint(self) -> None:
        if self.endpoint_edit.text():
            QGuiApplication.clipboard().setText(self.endpoint_edit.text())
            self.notice.show_message("Endpoint URL copied to the clipboard")

    # --- session events ---
    def on_state(self, state: str) -> None:
        self.state_label.setAccessibleDescription(state)
        self.refresh_live()
        if state == "crashed" and self.session.process is not None:
            outcome = self.session.process.outcome
            reason = outcome.reason if outcome else None
            if reason:
                self.notice.show_message(f"The engine stopped: {reason.reason}\nHint: {reason.suggestion}", "error")
        self._update_buttons()

    def on_ready(self, cold: Any) -> None:
        process = self.session.process
        if process is None:
            return
        self.endpoint_edit.setText(self.session.endpoint_url or f"{process.base_url}/v1")
        self.chat.set_endpoint(self.endpoint_edit.text(), getattr(self.session.proxy, "model_name", None))
        t2 = cold.t2_first_token_s
        self.notice.show_message(
            f"{process.adapter.display_name} serves {process.plan.model_path.name} (engine at {process.base_url})"
            f" — health OK after {cold.t1_health_s:.2f} s" + (f", first token after {t2:.2f} s" if t2 else ""))
        gpu = getattr(self.session.telemetry, "gpu", None)
        if gpu is None or gpu.unavailable:
            for title in ("Utilization", "Memory"):
                self.charts[title].plot.getPlotItem().setTitle(f"{title} (no GPU telemetry)")
        self.refresh_live()
        self._update_buttons()
        self._preview_switch()
        self.engine_ready.emit(cold)

    def _preview_switch(self) -> None:
        """Say on the switch button which kind of switch it will be and how long it should take."""
        if self._hybrid_running():
            return  # _update_buttons says why there is no manual switch
        preview = self.session.switch_preview(self.other_engine())
        self.switch_button.setToolTip(f"Switch to {self.other_engine()}: {preview}" if preview else "")

    def on_failed(self, message: str) -> None:
        if "endpoint cannot listen" in message:
            message += "\nOr change the endpoint port in File → Settings."
        self.notice.show_message(message, "error")
        self.switch_label.setText("")
        self._update_buttons()

    def on_stopped(self) -> None:
        self.refresh_live()
        self.chat.stop()
        self.chat.set_endpoint(None)
        if self.notice.level != "error":
            self.notice.show_message("Engine stopped")
        self._update_buttons()

    def on_samples(self, samples: list[Any]) -> None:
        serving = self._serving_source
        for sample in samples:
            if "@" in sample.source and serving is not None and sample.source != serving:
                continue  # an engine that is starting or draining: the charts show the one that serves
            route = SERIES_MAP.get(sample.series)
            if route is not None and self.board.push(route[0], sample.value * route[1], sample.t):
                self.samples_received += 1

    def on_switched(self, result: Any) -> None:
        self.refresh_live()
        failed = getattr(result, "failed_requests", 0)
        if getattr(result, "kind", "warm") == "stop-first":
            self.switch_label.setText(
                f"Switched {result.from_engine} → {result.to_engine} stop-first in {result.seconds:.1f} s (both did "
                f"not fit in memory): no engine served for {result.gap_s:.1f} s while requests waited; clients saw "
                f"{failed} failed request{'s' if failed != 1 else ''}"
                + (f"; {result.from_engine} sleeps for a quick switch back" if result.old_sleeping else ""))
            self._update_buttons()
            self._preview_switch()
            return
        self.switch_label.setText(
            f"Switched {result.from_engine} → {result.to_engine} in {result.seconds:.1f} s behind the same URL; "
            f"clients saw {failed} failed request{'s' if failed != 1 else ''} "
            f"(requests kept going to {result.from_engine} until {result.to_engine} served"
            + ("; in-flight requests drained)" if result.drained else ")"))
        self._update_buttons()
        self._preview_switch()

    def on_endpoint(self, state: str, message: str) -> None:
        self.endpoint_state = state
        if state in ("down", "failover"):
            self.notice.show_message(message, "error" if state == "down" else "warning")
        self._update_buttons()

    def model_state(self, entry: dict[str, Any]) -> str:
        """A models-list entry's state here: served / starting by this window's endpoint, or not loaded."""
        from desktop.core.engines import get_adapter

        serving, starting = self.engines()
        plan = self.session.plan
        for process, word in ((serving, "serving"), (starting, "starting")):
            if process is not None and plan is not None and process.adapter.name == \
                    get_adapter(entry["engine"]).name and (plan.model or str(plan.model_path)) == entry["model"]:
                return word
        return "not loaded"

    # --- live state of both engines, the bar, hand-over marks ---
    def engines(self) -> tuple[Any, Any]:
        """(serving engine process, starting engine process), either None."""
        manager = self.session.manager
        if manager is None:
            return None, None
        active, starting = manager.active, manager.starting
        return (active.process if active is not None else None,
                starting.process if starting is not None else None)

    def refresh_live(self) -> None:
        """The engines' line ("serving: llama.cpp · starting: vLLM 23 s, compile"), the rows of the cold-start
        bar (the starting one growing), and the hand-over mark when the serving engine changed."""
        serving, starting = self.engines()
        manager = self.session.manager
        source = manager.active.upstream.name if manager is not None and manager.active is not None else None
        if source != self._serving_source:
            if self._serving_source is not None and source is not None:
                self.board.mark(f"→ {engine_short(serving)}")
            self._serving_source = source
        line = engines_line(serving, starting, self.session.process)
        self.state_label.setText(line)
        self._show_autopilot(getattr(manager, "autopilot", None) if manager is not None else None)
        table = getattr(manager, "capability_table", None) if manager is not None else None
        self.capabilities_label.setVisible(table is not None)
        if table is not None:
            self.capabilities_label.setText(capabilities_text(table(), getattr(manager, "capability_note", None)))
        ready = serving is not None and serving.state.value == "ready"
        self.chat.show_engine_state(engine_short(serving) if ready else None,
                                    line.split(" · ")[-1] if starting is not None else None)
        for process in (serving, starting, self.session.process):
            if process is not None:
                self._rows[id(process)] = process
        for process in list(self._rows.values())[-4:]:
            self._show_row(process)  # a start that failed or was stopped stops growing too
        for key in [k for k in self._rows if k not in self.timeline.rows]:
            self._rows.pop(key)  # rows the bar no longer keeps

    def _show_autopilot(self, autopilot: Any) -> None:
        """Hybrid mode: "Hybrid (starting vLLM): start_standby — in-flight p95 9 over 5 min > crossover 4; ...";
        hidden when the endpoint serves one engine."""
        if autopilot is None:
            self.autopilot_label.hide()
            return
        self.autopilot_label.setText(autopilot_text(autopilot.status()))
        self.autopilot_label.show()

    def _show_row(self, process: Any) -> None:
        cold = process.cold_start
        running = cold.t3_first_request_s is None and process.is_running()
        phases = cold.phases(now=process.elapsed() if running else None)
        cache = cold.compile_cache
        note = {"hit": "compile cache hit", "miss": "compile cache miss (compiled and saved)",
                "stale": "compile cache found but not loadable (compiled again)",
                "warm": "compile cache warm (Inductor)",
                "off": "no compile (eager)"}.get(cache or "", "")
        self.timeline.show_start(id(process), engine_short(process), phases, running, note)

    def _hybrid_running(self) -> bool:
        autopilot = getattr(self.session.manager, "autopilot", None)
        return autopilot is not None and autopilot.state != "off"

    def _update_buttons(self) -> None:
        running = self.session.is_running()
        busy = self.session.busy
        self.start_button.setEnabled(not running and not busy)
        self.stop_button.setEnabled(running or busy)
        hybrid = self._hybrid_running()  # the loop switches: a manual switch would fight it
        self.switch_button.setEnabled(running and not busy and not hybrid)
        self.switch_button.setText(f"S&witch to {self.other_engine()}")
        if hybrid:
            self.switch_button.setToolTip("Hybrid mode switches by itself (see its decision above); stop it and "
                                          "start one engine to switch by hand")

    def shutdown(self) -> None:
        self.live_timer.stop()
        self.chat.shutdown()
        self.board.stop()
        self.requests_panel.shutdown()
