"""The Serve page's account of its engines: the engines' line (what serves, what starts and in which phase), the
endpoint URL to copy, the last switch, hybrid mode's decision, the capabilities the traffic used, the page's
messages and the cold-start bar (a row per engine start). The page hands it the engines it reads off the session.
"""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QGridLayout, QLabel, QLineEdit, QPushButton, QVBoxLayout, QWidget

from desktop.core.serving.serve_status import engine_short as engine_short
from desktop.core.serving.serve_status import serve_status
from desktop.ui.widgets import Notice, PhaseTimeline

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


def engines_line(serving: Any, starting: Any, shown: Any = None) -> str:
    """Both engines' states in one line: what serves, and what starts (how long so far, in which phase)."""
    return serve_status(serving, starting, shown).line


def switched_text(result: Any) -> str:
    """A finished switch (endpoint.SwitchResult + .failed_requests) in words: what moved, how long it took, what
    the clients saw; for a stop-first switch also how long nothing served."""
    failed = getattr(result, "failed_requests", 0)
    if getattr(result, "kind", "warm") == "stop-first":
        return (f"Switched {result.from_engine} → {result.to_engine} stop-first in {result.seconds:.1f} s (both did "
                f"not fit in memory): no engine served for {result.gap_s:.1f} s while requests waited; clients saw "
                f"{failed} failed request{'s' if failed != 1 else ''}"
                + (f"; {result.from_engine} sleeps for a quick switch back" if result.old_sleeping else ""))
    return (f"Switched {result.from_engine} → {result.to_engine} in {result.seconds:.1f} s behind the same URL; "
            f"clients saw {failed} failed request{'s' if failed != 1 else ''} "
            f"(requests kept going to {result.from_engine} until {result.to_engine} served"
            + ("; in-flight requests drained)" if result.drained else ")"))


class ServeState(QWidget):
    """State, endpoint, switch, hybrid and capability lines; the notice; the cold-start bar."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
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
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(status)
        layout.addWidget(self.notice)
        layout.addWidget(self.timeline)
        self._rows: dict[int, Any] = {}  # the engine processes on the cold-start bar, by row key

    def copy_endpoint(self) -> None:
        if self.endpoint_edit.text():
            QGuiApplication.clipboard().setText(self.endpoint_edit.text())
            self.notice.show_message("Endpoint URL copied to the clipboard")

    def show_engines(self, manager: Any, serving: Any, starting: Any, shown: Any) -> str:
        """The engines' line ("serving: llama.cpp · starting: vLLM 23 s, compile"), hybrid mode's decision, the
        capabilities the traffic used and the rows of the cold-start bar (the starting one growing); returns the
        line. `shown`: the session's engine, kept on the bar when it crashed or stopped."""
        line = engines_line(serving, starting, shown)  # the state label shows the session's status (ServePage.on_status)
        self.show_autopilot(getattr(manager, "autopilot", None) if manager is not None else None)
        table = getattr(manager, "capability_table", None) if manager is not None else None
        self.capabilities_label.setVisible(table is not None)
        if table is not None:
            self.capabilities_label.setText(capabilities_text(table(), getattr(manager, "capability_note", None)))
        for process in (serving, starting, shown):
            if process is not None:
                self._rows[id(process)] = process
        for process in list(self._rows.values())[-4:]:
            self._show_row(process)  # a start that failed or was stopped stops growing too
        for key in [k for k in self._rows if k not in self.timeline.rows]:
            self._rows.pop(key)  # rows the bar no longer keeps
        return line

    def show_autopilot(self, autopilot: Any) -> None:
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
