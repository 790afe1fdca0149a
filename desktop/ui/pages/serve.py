"""Serve: start/stop an engine, its state and cold-start timeline, the endpoint URL, live charts, the log, and
the one-click switch to the other engine. The page composes its parts (serve_launch: the launch settings;
serve_state: the engines' state, messages and cold-start bar; serve_charts: the live charts; serve_tabs: log,
requests, chat, models; serve_clients: what to paste to connect an app) and turns the session's events and the
buttons into actions on them."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import QHBoxLayout, QVBoxLayout, QWidget

from desktop.core.common.errors import SwitchyardError
from desktop.core.hub.names import display_name
from desktop.ui.engine_session import EngineSession, engine_choices
from desktop.ui.pages.serve_charts import ServeCharts
from desktop.ui.pages.serve_clients import ConnectApp
from desktop.ui.pages.serve_connection import ClientModel
from desktop.ui.pages.serve_events import ServeEvents
from desktop.ui.pages.serve_headline import Headline
from desktop.ui.pages.serve_launch import HYBRID, LaunchForm, form_plan, plan_for_form, prepared_text
from desktop.ui.pages.serve_state import (
    ServeState,
    autopilot_text,
    capabilities_text,
    engine_short,
)
from desktop.ui.pages.serve_tabs import ServeTabs
from desktop.ui.workers import submit

__all__ = ["HYBRID", "ServePage", "autopilot_text", "capabilities_text"]  # tests import these from here

LIVE_MS = 500


class ServePage(ServeEvents, QWidget):
    title = "Serve"
    engine_ready = Signal(object)

    def __init__(self, session: EngineSession, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.samples_received = 0
        self.endpoint_state = "stopped"
        self.export_dialog: Any = None

        # --- launch settings ---
        self.launch_form = LaunchForm()
        form = self.launch_form
        self.engine_box, self.model_edit, self.ctx_spin = form.engine_box, form.model_edit, form.ctx_spin
        self.parallel_spin, self.flags_edit = form.parallel_spin, form.flags_edit
        self.start_button, self.stop_button, self.switch_button = form.start_button, form.stop_button, form.switch_button
        self.export_button, self.prepare_button = form.export_button, form.prepare_button
        self.export_button.clicked.connect(lambda: self.open_export())
        self.prepare_button.clicked.connect(lambda: self.prepare_vllm())
        self.preparing = False
        self.start_button.clicked.connect(self.start_clicked)
        self.stop_button.clicked.connect(self.stop_clicked)
        self.switch_button.clicked.connect(self.switch_clicked)

        # --- state, endpoint, timeline ---
        self.state_view = view = ServeState()
        self.state_label, self.endpoint_edit, self.copy_button = view.state_label, view.endpoint_edit, view.copy_button
        self.notice, self.switch_label, self.timeline = view.notice, view.switch_label, view.timeline
        self.autopilot_label, self.capabilities_label = view.autopilot_label, view.capabilities_label

        # --- charts ---
        self.live = ServeCharts()
        self.board, self.charts, self.pause_box = self.live.board, self.live.charts, self.live.pause_box

        self.headline = Headline()  # tokens/s, TTFT p50, in flight: the figures a person checks first
        self.client_model = ClientModel()  # the connection card's model id, beside the endpoint URL above

        # --- tabs: chat (first, with room), the charts, engine log, requests, models ---
        self.bottom_tabs = ServeTabs(session, self.model_state)
        self.log_pane, self.chat = self.bottom_tabs.log_pane, self.bottom_tabs.chat
        self.requests_panel, self.models_editor = self.bottom_tabs.requests_panel, self.bottom_tabs.models_editor
        self.bottom_tabs.insertTab(1, self.live, "C&harts")
        self.connect_app = ConnectApp()  # what to paste into coding agents and SDK clients, with the key on demand
        self.bottom_tabs.insertTab(2, self.connect_app, "Connect an &app")
        self.bottom_tabs.setCurrentWidget(self.chat)
        layout = QVBoxLayout(self)
        layout.addWidget(form)
        layout.addWidget(view)
        figures = QHBoxLayout()
        figures.addWidget(self.headline, 1)
        figures.addWidget(form.reasoning_box)
        figures.addWidget(self.client_model)
        layout.addLayout(figures)
        layout.addWidget(self.bottom_tabs, 1)

        session.state_changed.connect(self.on_state)
        session.phase_reached.connect(lambda _name, _seconds: self.refresh_live())
        session.watching.connect(lambda _name: self.refresh_live())
        session.log_lines.connect(self.log_pane.append_lines)
        session.progress.connect(self.on_progress)
        session.status_changed.connect(self.on_status)
        session.ready.connect(self.on_ready)
        session.failed.connect(self.on_failed)
        session.stopped.connect(self.on_stopped)
        session.endpoint_changed.connect(self.on_endpoint)
        session.samples.connect(self.on_samples)
        session.switched.connect(self.on_switched)
        session.ready.connect(lambda _cold: self.client_model.show_model(getattr(session.proxy, "model_name", None)))
        session.stopped.connect(lambda: self.client_model.show_model(None))
        form.reasoning_box.currentIndexChanged.connect(lambda _index: self._set_reasoning())
        for signal in (session.status_changed, session.stopped):
            signal.connect(lambda *_: self.connect_app.show_status(session.manager, session.proxy))
        self.board.start()
        self._serving_source: str | None = None  # the upstream whose telemetry the charts show
        self.live_timer = QTimer(self)  # the bar grows and the engines' line counts while an engine starts
        self.live_timer.setInterval(LIVE_MS)
        self.live_timer.timeout.connect(self.refresh_live)
        self.live_timer.start()
        self._update_buttons()

    def _set_reasoning(self) -> None:
        """The Thinking choice: the app's endpoint's setting for the next request, and when it next opens."""
        effort = self.session.reasoning_effort = self.launch_form.reasoning_box.currentData()
        if self.session.proxy is not None:
            self.session.proxy.set_reasoning(effort)

    # --- actions ---
    def launch(self, plan: Any) -> None:
        """Serve `plan` (a LaunchPlan: the form's asks, or the Recommend page's checked plan)."""
        model = self.launch_form.show_plan(plan)
        self.timeline.clear()
        self.notice.show_message(f"Starting {plan.engine} on {display_name(model)}…", action="start")
        self.session.start(plan)
        self._update_buttons()

    def choose_model(self, model: str, engine: str | None = None) -> None:
        """A model chosen elsewhere (the Models page's Serve or Serve now): its engine and the model picked in the
        form, ready to Start (nothing starts by itself)."""
        if engine:
            self.engine_box.setCurrentIndex(self.engine_box.findData(engine))
        self.model_edit.choose(model)
        self.model_edit.refresh(self.launch_form.engine_choice())  # lists a fresh download; keeps the choice
        self.notice.show_message(f"{display_name(model)} chosen: Start serves it on {self.launch_form.engine()}")

    def showEvent(self, event: Any) -> None:  # noqa: N802 - Qt's name
        """Read the library again when the page comes into view: a download may have finished meanwhile."""
        super().showEvent(event)
        if not self.model_edit.loading:
            self.model_edit.refresh(self.launch_form.engine_choice())

    def start_clicked(self) -> None:
        if self.launch_form.hybrid():
            self.launch_hybrid()
            return
        try:
            plan = form_plan(*self.launch_form.asks())
        except SwitchyardError as exc:
            self.notice.show_message(f"{exc.message}" + (f" ({exc.hint})" if exc.hint else ""), "error")
            return
        self.launch(plan)

    def launch_hybrid(self) -> None:
        """Hybrid mode, as `serve --engine auto`: the session plans both engines, starts llama.cpp and the loop."""
        model = self.launch_form.model()
        self.timeline.clear()
        self.notice.show_message(f"Starting hybrid mode on {display_name(model)}: llama.cpp first, vLLM when the "
                                 "load pays…", action="start")
        self.session.start_hybrid(model, {"ctx_per_request": self.ctx_spin.value(),
                                          "slots": self.parallel_spin.value()})
        self._update_buttons()

    def form_engine(self) -> str:
        """The engine the form names (hybrid mode starts on llama.cpp: its plan is the one to export)."""
        return self.launch_form.engine()

    def stop_clicked(self) -> None:
        self.notice.show_message("Stopping…", action="stop")
        self.session.stop()

    def other_engine(self) -> str:
        current = self.session.process.adapter.name if self.session.process is not None else self.form_engine()
        names = [name for name, _label in engine_choices()]
        return names[(names.index(current) + 1) % len(names)] if current in names else names[0]

    def switch_clicked(self) -> None:
        target = self.other_engine()
        preview = self.session.switch_preview(target)
        self.switch_label.setText(f"Switching to {target}… ({preview or 'the current engine keeps serving meanwhile'})")
        self.session.switch_to(target)  # the engine box follows when the switch is done: until then the old serves

    def prepare_vllm(self) -> bool:
        """"Prepare vLLM" for the form's model and plan in the background (desktop.core.serving.prepare)."""
        from desktop.core.serving.prepare import prepare

        if self.preparing:
            return False
        spec = form_plan("vllm", self.launch_form.model(), self.ctx_spin.value(), self.parallel_spin.value())
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
        self.notice.show_message(prepared_text(done))

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
        _engine, model, ctx, parallel, flags = self.launch_form.asks()
        submit(plan_for_form, self.form_engine(), model, ctx, parallel, flags,
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
        serving, starting = self.session.engines()
        return serving, starting

    def refresh_live(self) -> None:
        """The rows of the cold-start bar (the starting one growing), hybrid mode's and the capabilities' lines,
        and the hand-over mark when the serving engine changed (the state label follows the session's status)."""
        serving, starting = self.engines()
        manager = self.session.manager
        source = manager.active.upstream.name if manager is not None and manager.active is not None else None
        if source != self._serving_source:
            if self._serving_source is not None and source is not None:
                self.board.mark(f"→ {engine_short(serving)}")
            self._serving_source = source
        line = self.state_view.show_engines(manager, serving, starting, self.session.process)
        ready = serving is not None and serving.state.value == "ready"
        self.chat.show_engine_state(engine_short(serving) if ready else None,
                                    line.split(" · ")[-1] if starting is not None else None)

    def _show_autopilot(self, autopilot: Any) -> None:
        self.state_view.show_autopilot(autopilot)

    def _hybrid_running(self) -> bool:
        autopilot = getattr(self.session.manager, "autopilot", None)
        return autopilot is not None and autopilot.state != "off"

    def _update_buttons(self) -> None:
        self.launch_form.show_buttons(self.session.is_running(), self.session.busy, self._hybrid_running(),
                                      self.other_engine())

    def shutdown(self) -> None:
        self.live_timer.stop()
        self.chat.shutdown()
        self.board.stop()
        self.requests_panel.shutdown()
