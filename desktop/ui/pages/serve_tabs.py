"""The Serve page's tabs: "Chat" against the endpoint (first), the engine log, the request log (live) and the
endpoint's models.yaml editor (the page puts its live charts second). Each tab is its own widget; this one only
holds them and keeps the requests tab's title current.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PySide6.QtWidgets import QTabWidget, QWidget

from desktop.ui.chat import ChatPane
from desktop.ui.engine_session import EngineSession
from desktop.ui.models_editor import ModelsEditor
from desktop.ui.requests_panel import RequestsPanel
from desktop.ui.widgets import LogPane


class ServeTabs(QTabWidget):
    """Engine log, requests, chat, models. `model_state`: a models-list entry's state on this window's endpoint."""

    def __init__(self, session: EngineSession, model_state: Callable[[dict[str, Any]], str],
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.log_pane = LogPane()
        self.chat = ChatPane()
        self.requests_panel = RequestsPanel(session)  # the request log, live (desktop/ui/requests_panel.py)
        self.addTab(self.chat, "&Chat")
        self.addTab(self.log_pane, "Engine &log")
        self.addTab(self.requests_panel, self.requests_panel.title)
        self.requests_panel.title_changed.connect(
            lambda title: self.setTabText(self.indexOf(self.requests_panel), title))
        self.models_editor = ModelsEditor(model_state)  # the endpoint's models.yaml, as the CLI reads it
        self.addTab(self.models_editor, self.models_editor.title)
        self.setAccessibleName("Engine log, requests and chat")
