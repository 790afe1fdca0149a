"""History: past benchmark and A/B runs from the SQLite history (desktop.core.storage.history), newest first, and
re-opening their reports (the HTML in the browser, or the folder with JSON and CSV)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from PySide6.QtCore import QUrl
from PySide6.QtGui import QDesktopServices, QShowEvent
from PySide6.QtWidgets import QHBoxLayout, QHeaderView, QPushButton, QVBoxLayout, QWidget

from desktop.ui.pages.models import _fill, _table
from desktop.ui.widgets import Notice
from desktop.ui.workers import submit

HEADERS = ["When", "Kind", "What", "Model", "Summary", "Report"]


def load_runs(limit: int = 200) -> list[Any]:
    """The newest runs (RunRecord) from the history under SWITCHYARD_HOME / the data dir."""
    from desktop.core.storage.history import Store

    with Store() as store:
        return store.runs(limit=limit)


def phase_summary(cold: dict[str, Any]) -> list[str]:
    """"compile 30.1 s (cache hit)"-style parts for the longest engine phases of a stored launch."""
    from desktop.core.runtime.supervisor import SERVING_PHASES, phases_of

    engine_phases = [p for p in phases_of(cold) if p["phase"] not in SERVING_PHASES]
    longest = sorted(engine_phases, key=lambda p: -float(p["seconds"]))[:3]
    parts = [f"{p['label']} {float(p['seconds']):.1f} s" for p in longest]
    if cold.get("compile_cache") in ("hit", "miss", "stale", "warm"):
        parts.append(f"compile cache {cold['compile_cache']}")
    return parts


def summarize(run: Any) -> str:
    """One line a person can scan: the A/B verdict, or a bench's best throughput and failures."""
    summary = run.summary or {}
    if run.kind == "ab":
        errors = summary.get("errors") or []
        verdict = (summary.get("amortization") or {}).get("verdict") or ""
        return ("incomplete: " + "; ".join(errors)) if errors else verdict
    if run.kind == "launch":  # recorded by every launch: what the recommender learns cold starts and memory from
        cold = summary.get("cold_start") or {}
        memory = summary.get("load_memory") or {}
        t3 = cold.get("t3_first_request_s") or cold.get("t1_health_s")
        parts = [f"cold start {t3:.2f} s" if isinstance(t3, (int, float)) else "cold start not measured"]
        parts += phase_summary(cold)
        if isinstance(memory.get("rss_gib"), (int, float)):
            parts.append(f"{memory['rss_gib']:.2f} GiB resident after load")
        return "; ".join(parts)
    if run.kind == "engine-fix":  # runtime.enginefix: arguments a crash taught this engine build here
        return str(summary.get("why") or "")
    levels = summary.get("levels") or []
    if not levels:
        return "no results"
    best = max(levels, key=lambda level: level.get("output_throughput") or 0.0)
    failed = sum(int(level.get("failed") or 0) for level in levels)
    text = (f"{len(levels)} level(s); best {best.get('output_throughput', 0.0):.1f} output tok/s at "
            f"{best.get('label')}; {failed} failed")
    return text + (f"; stopped: {summary['aborted']}" if summary.get("aborted") else "")


def describe(run: Any) -> str:
    if run.label:
        return str(run.label)
    return str(run.engine or "")


class HistoryPage(QWidget):
    title = "History"

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.runs: list[Any] = []
        self.loading = False
        layout = QVBoxLayout(self)
        self.notice = Notice()
        layout.addWidget(self.notice)
        self.table = _table(HEADERS, "Past runs")
        header = self.table.horizontalHeader()
        for column in range(len(HEADERS)):
            header.setSectionResizeMode(column, QHeaderView.ResizeMode.Stretch if HEADERS[column] == "Summary"
                                        else QHeaderView.ResizeMode.ResizeToContents)
        self.table.itemSelectionChanged.connect(self._update_buttons)
        self.table.cellDoubleClicked.connect(lambda row, _col: self.open_report(row))
        self.refresh_button = QPushButton("&Refresh")
        self.refresh_button.clicked.connect(self.refresh)
        self.open_button = QPushButton("&Open report")
        self.open_button.setToolTip("Open the run's HTML report in the browser (or double-click the row)")
        self.open_button.clicked.connect(lambda: self.open_report())
        self.folder_button = QPushButton("Show &folder")
        self.folder_button.setToolTip("Open the folder with the report's JSON, CSV and HTML")
        self.folder_button.clicked.connect(lambda: self.open_folder())
        buttons = QHBoxLayout()
        for button in (self.refresh_button, self.open_button, self.folder_button):
            buttons.addWidget(button)
        buttons.addStretch(1)
        layout.addWidget(self.table, 1)
        layout.addLayout(buttons)
        self._update_buttons()
        self.refresh()

    def showEvent(self, event: QShowEvent) -> None:  # runs recorded since the last visit appear
        super().showEvent(event)
        self.refresh()

    def refresh(self) -> None:
        if self.loading:
            return
        self.loading = True
        submit(load_runs, on_finished=self.show_runs, on_error=self._load_failed)

    def _load_failed(self, message: str) -> None:
        self.loading = False
        self.notice.show_message(message, "error")

    def show_runs(self, runs: list[Any]) -> None:
        self.loading = False
        self.runs = runs
        _fill(self.table, [[time.strftime("%Y-%m-%d %H:%M", time.localtime(run.created_at)), run.kind,
                            describe(run), Path(run.model).name if run.model and "/" in run.model else
                            str(run.model or "—"), summarize(run), "HTML" if self.report_of(run) else "—"]
                           for run in runs])
        for row, run in enumerate(runs):
            summary_item, report_item = self.table.item(row, 4), self.table.item(row, 5)
            if summary_item is not None:
                summary_item.setToolTip(summarize(run))
            if report_item is not None and run.report_path:
                report_item.setToolTip(run.report_path)
        self.table.resizeRowsToContents()
        self.notice.show_message("" if runs else
                                 "No runs yet: benchmarks and A/B comparisons from the Compare page (or "
                                 "`switchyard bench` / `switchyard ab`) appear here.")
        self._update_buttons()

    @staticmethod
    def report_of(run: Any) -> Path | None:
        return Path(run.report_path) if run.report_path and Path(run.report_path).is_file() else None

    def selected(self, row: int | None = None) -> Any:
        if row is None:
            rows = self.table.selectionModel().selectedRows()
            row = rows[0].row() if rows else -1
        return self.runs[row] if 0 <= row < len(self.runs) else None

    def _update_buttons(self) -> None:
        run = self.selected()
        has_report = run is not None and self.report_of(run) is not None
        self.open_button.setEnabled(has_report)
        self.folder_button.setEnabled(has_report)

    def open_report(self, row: int | None = None) -> bool:
        run = self.selected(row)
        if run is None:
            return False
        report = self.report_of(run)
        if report is None:
            self.notice.show_message(f"This run's report is gone ({run.report_path or 'none was written'}).",
                                     "warning")
            return False
        if not QDesktopServices.openUrl(QUrl.fromLocalFile(str(report))):
            self.notice.show_message(f"Could not open a browser: the report is {report}", "warning")
            return False
        return True

    def open_folder(self, row: int | None = None) -> bool:
        run = self.selected(row)
        report = self.report_of(run) if run is not None else None
        return report is not None and QDesktopServices.openUrl(QUrl.fromLocalFile(str(report.parent)))
