"""The main window: a page list on the left, the pages on the right (built on first visit, so start-up stays
fast), a menu with settings, and a quit path that stops every engine first."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QSize, Qt, QTimer
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QMessageBox,
    QStackedWidget,
    QWidget,
)

from desktop.ui import resources
from desktop.ui.engine_session import EngineSession
from desktop.ui.workers import wait_idle

log = logging.getLogger("switchyard.ui")

PAGES = ("Machine", "Models", "Recommend", "Serve", "Compare", "History")
PAGE_ICONS = {"Machine": "machine", "Models": "models", "Recommend": "recommend", "Serve": "serve",
              "Compare": "compare", "History": "history"}


class MainWindow(QMainWindow):
    def __init__(self) -> None:
        super().__init__()
        self.setWindowTitle("Switchyard")
        self.setWindowIcon(resources.app_icon())
        self.resize(1280, 860)
        self.session = EngineSession(self)
        self.pages: dict[str, QWidget] = {}
        self._closing = False
        self._stopping = False

        self.nav = QListWidget()
        self.nav.setAccessibleName("Pages")
        self.nav.setIconSize(QSize(24, 24))
        self.nav.setFixedWidth(170)
        self.stack = QStackedWidget()
        self._placeholders: dict[str, QWidget] = {}
        for index, name in enumerate(PAGES):
            item = QListWidgetItem(resources.icon(PAGE_ICONS[name]), name)
            item.setToolTip(f"{name} (Ctrl+{index + 1})")
            self.nav.addItem(item)
            placeholder = QLabel(f"Loading {name}…")
            placeholder.setAlignment(Qt.AlignmentFlag.AlignCenter)
            self._placeholders[name] = placeholder
            self.stack.addWidget(placeholder)
            shortcut = QShortcut(QKeySequence(f"Ctrl+{index + 1}"), self)
            shortcut.activated.connect(lambda name=name: self.show_page(name))
        self.nav.currentRowChanged.connect(lambda row: self.show_page(PAGES[row]))
        central = QWidget()
        layout = QHBoxLayout(central)
        layout.addWidget(self.nav)
        layout.addWidget(self.stack, 1)
        self.setCentralWidget(central)
        self._build_menu()
        self.statusBar().showMessage("Ready")
        self.session.status_changed.connect(self._engine_status)
        self.nav.setCurrentRow(0)

    # --- pages ---
    def _factories(self) -> dict[str, Callable[[], QWidget]]:
        def machine() -> QWidget:
            from desktop.ui.pages.machine import MachinePage
            page = MachinePage()
            if hasattr(page, "download_requested"):  # "Download & serve" of the suggested first model
                page.download_requested.connect(
                    lambda spec: self.show_page("Models").download_spec(spec, serve_after=True))  # type: ignore[attr-defined]
            return page

        def models() -> QWidget:
            from desktop.ui.pages.models import ModelsPage
            page = ModelsPage()
            page.serve_requested.connect(self.serve_model)
            return page

        def recommend() -> QWidget:
            from desktop.ui.pages.recommend import RecommendPage
            page = RecommendPage()
            page.launch_requested.connect(self.launch)
            page.measure_requested.connect(lambda job: self.show_page("Compare").start(job))  # type: ignore[attr-defined]
            return page

        def serve() -> QWidget:
            from desktop.ui.pages.serve import ServePage
            return ServePage(self.session)

        def compare() -> QWidget:
            from desktop.ui.pages.compare import ComparePage
            return ComparePage(endpoint_url=lambda: self.session.endpoint_url if self.session.is_running() else None)

        def history() -> QWidget:
            from desktop.ui.pages.history import HistoryPage
            return HistoryPage()

        return {"Machine": machine, "Models": models, "Recommend": recommend, "Serve": serve,
                "Compare": compare, "History": history}

    def _engine_status(self, status: Any) -> None:
        """The status bar's engine line: the session's one account (serving.serve_status), the same the Serve
        page's state label shows; during a switch it says that the current engine serves meanwhile."""
        self.statusBar().showMessage(status.status_bar)

    def page(self, name: str) -> QWidget:
        """The page widget, built on first use."""
        if name not in self.pages:
            widget = self._factories()[name]()
            widget.setObjectName(f"page{name}")
            self.pages[name] = widget
            placeholder = self._placeholders.pop(name)
            index = self.stack.indexOf(placeholder)
            self.stack.insertWidget(index, widget)
            self.stack.removeWidget(placeholder)
            placeholder.deleteLater()
        return self.pages[name]

    def show_page(self, name: str) -> QWidget:
        widget = self.page(name)
        self.stack.setCurrentWidget(widget)
        row = PAGES.index(name)
        if self.nav.currentRow() != row:
            self.nav.setCurrentRow(row)
        return widget

    def launch(self, plan: Any) -> None:
        """Serve a LaunchPlan (the Recommend page's, or a form's asks) on the Serve page."""
        serve = self.show_page("Serve")
        serve.launch(plan)  # type: ignore[attr-defined]

    def serve_model(self, model: str, engine: str) -> None:
        """Open the Serve page with a library model (a path or "demo") and its engine chosen, ready to start."""
        serve = self.show_page("Serve")
        choose = getattr(serve, "choose_model", None)
        if choose is not None:
            choose(model, engine)

    # --- menu ---
    def _build_menu(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        settings_action = QAction("&Settings…", self)
        settings_action.setShortcut(QKeySequence.StandardKey.Preferences)
        settings_action.triggered.connect(self.open_settings)
        file_menu.addAction(settings_action)
        quit_action = QAction("&Quit", self)
        quit_action.setShortcut(QKeySequence("Ctrl+Q"))
        quit_action.triggered.connect(self.close)
        file_menu.addAction(quit_action)
        help_menu = self.menuBar().addMenu("&Help")
        about = QAction("&About Switchyard", self)
        about.triggered.connect(lambda: QMessageBox.about(
            self, "About Switchyard",
            "Switchyard picks, launches, watches and compares llama.cpp and vLLM on this machine."))
        help_menu.addAction(about)

    def open_settings(self) -> None:
        from desktop.ui.settings_dialog import SettingsDialog

        SettingsDialog(self).exec()

    # --- quitting ---
    def benchmark_running(self) -> bool:
        compare = self.pages.get("Compare")
        return bool(compare is not None and getattr(compare, "running", False))

    def confirm_quit(self) -> bool:
        """Ask before abandoning a running benchmark (tests replace this)."""
        if not self.benchmark_running():
            return True
        answer = QMessageBox.question(self, "Quit Switchyard?",
                                      "A benchmark is running. Quit anyway and stop every engine?",
                                      QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
                                      QMessageBox.StandardButton.No)
        return answer == QMessageBox.StandardButton.Yes

    def closeEvent(self, event: QCloseEvent) -> None:
        if self._closing:
            event.accept()
            return
        if not self.confirm_quit():
            event.ignore()
            return
        compare = self.pages.get("Compare")
        if compare is not None and hasattr(compare, "cancel"):
            compare.cancel()
        if self.session.is_running() or self.session.busy:
            event.ignore()
            if not self._stopping:
                self._stopping = True
                self.statusBar().showMessage("Stopping engines before quitting…")
                self.setEnabled(False)
                # With `self` as context the call is dropped if the window is destroyed first.
                self.session.stop(then=lambda: QTimer.singleShot(0, self, self._finish_close))
            return
        self._finish_close(close_window=False)
        event.accept()

    def _finish_close(self, close_window: bool = True) -> None:
        if getattr(self, "_finished", False):
            return  # already shut down (a close event and the engine-stop callback can both get here)
        self._finished = True
        self._closing = True
        for widget in self.pages.values():
            if hasattr(widget, "shutdown"):
                widget.shutdown()
        self.session.shutdown()
        wait_idle(30_000)
        self.session.shutdown()  # anything a finishing worker started meanwhile
        if close_window:
            self.close()
