"""History: past runs from the SQLite history (desktop.core.store), and re-opening their reports."""

from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import QPushButton, QVBoxLayout, QWidget

from desktop.ui.pages.models import _fill, _table
from desktop.ui.widgets import Notice, module_available, not_available
from desktop.ui.workers import submit


def load_runs() -> list[Any]:
    import importlib

    store: Any = importlib.import_module("desktop.core.store")
    return list(store.Store().runs())


class HistoryPage(QWidget):
    title = "History"

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.runs: list[Any] = []
        layout = QVBoxLayout(self)
        self.notice = Notice()
        layout.addWidget(self.notice)
        self.table = _table(["When", "Kind", "Engine", "Model", "Summary"], "Past runs")
        self.available = module_available("desktop.core.store")
        if not self.available:
            layout.addWidget(not_available("Run history", "desktop.core.store"))
        self.refresh_button = QPushButton("&Refresh")
        self.refresh_button.clicked.connect(self.refresh)
        self.refresh_button.setEnabled(self.available)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.refresh_button)
        if self.available:
            self.refresh()

    def refresh(self) -> None:
        submit(load_runs, on_finished=self.show_runs, on_error=lambda m: self.notice.show_message(m, "error"))

    def show_runs(self, runs: list[Any]) -> None:
        self.runs = runs
        _fill(self.table, [[str(getattr(r, "started_at", "")), str(getattr(r, "kind", "")),
                            str(getattr(r, "engine", "")), str(getattr(r, "model", "")),
                            str(getattr(r, "summary", ""))] for r in runs])
