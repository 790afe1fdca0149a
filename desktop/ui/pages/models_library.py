"""The Models page's "On this machine" box: the library (desktop.core.hub.library_view's rows) with Serve and
Delete for the selected model. Serving hands the model to the Serve page; deleting asks first, says the disk it
frees, and runs off the GUI thread."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QGroupBox,
    QHBoxLayout,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from desktop.core.hub.library_view import DEMO_CANNOT_DELETE, ENGINE_LABELS, LibraryRow, human_bytes
from desktop.ui.quality_action import QualityAction
from desktop.ui.widgets import Notice, fit_columns, quant_label, size_text
from desktop.ui.workers import submit

GIB = 1024**3
LIBRARY_COLUMNS = ["Model", "Quantization", "Size", "Engine", "Notes", "Path"]


def local_library() -> list[LibraryRow]:
    """The embedded demo pair (always available) and the models on disk, as the table shows them."""
    from desktop.core.hub.library_view import library_rows

    return library_rows()


def _delete(name: str) -> Any:
    from desktop.core.hub import delete

    return delete(name)


class LibraryPanel(QGroupBox):
    """The table and its buttons; `confirm` asks before a Delete (the page's, so tests can answer it)."""

    serve_requested = Signal(str, str)  # (model as the Serve form takes it, engine)

    def __init__(self, notice: Notice, confirm: Callable[[LibraryRow], bool], parent: QWidget | None = None) -> None:
        super().__init__("On this machine", parent)
        self.notice = notice
        self.confirm = confirm
        self.rows: list[LibraryRow] = []
        self.deleting = False

        self.table = QTableWidget(0, len(LIBRARY_COLUMNS))
        self.table.setHorizontalHeaderLabels(LIBRARY_COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        fit_columns(self.table, stretch=0)
        self.table.verticalHeader().setVisible(False)
        self.table.setAccessibleName("Local library")
        self.table.itemSelectionChanged.connect(self._update_buttons)
        self.table.doubleClicked.connect(lambda _index: self.serve_selected())

        self.serve_button = QPushButton("S&erve")
        self.serve_button.setAccessibleName("Serve the selected model")
        self.serve_button.setToolTip("Open the Serve page with this model and the engine for its format chosen")
        self.serve_button.clicked.connect(self.serve_selected)
        self.delete_button = QPushButton("De&lete…")
        self.delete_button.setAccessibleName("Delete the selected model")
        self.delete_button.clicked.connect(self.delete_selected)
        self.refresh_button = QPushButton("&Refresh library")
        self.refresh_button.clicked.connect(self.refresh)
        self.quality = QualityAction(self._gguf_selected, notice, self)
        buttons = QHBoxLayout()
        for button in (self.serve_button, self.delete_button, self.quality.button, self.refresh_button):
            buttons.addWidget(button)
        buttons.addStretch(1)
        layout = QVBoxLayout(self)
        layout.addWidget(self.table)
        layout.addLayout(buttons)
        layout.addWidget(self.quality.status)
        self._update_buttons()

    # --- listing ---
    def refresh(self) -> None:
        submit(local_library, on_finished=self.show_rows, on_error=lambda m: self.notice.show_message(m, "error"))

    def show_rows(self, rows: list[LibraryRow]) -> None:
        selected = self.selected()
        self.rows = rows
        self.table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            cells = [row["name"], quant_label(row["quantization"] or None), size_text(row['size_bytes']),
                     ENGINE_LABELS[row["engine"]], row["notes"], row["path"]]
            for c, value in enumerate(cells):
                item = QTableWidgetItem(value)
                item.setToolTip(row["path"] if c == 0 else value)
                self.table.setItem(r, c, item)
        again = next((i for i, row in enumerate(rows) if selected and row["path"] == selected["path"]), None)
        if again is not None:
            self.table.selectRow(again)
        self._update_buttons()

    def selected(self) -> LibraryRow | None:
        chosen = self.table.selectionModel().selectedRows()
        if not chosen or chosen[0].row() >= len(self.rows):
            return None
        return self.rows[chosen[0].row()]

    def _gguf_selected(self) -> str | None:
        """The selected model as `switchyard quality` takes it, when llama.cpp's tools can measure it (GGUF)."""
        row = self.selected()
        return row["serve_model"] if row is not None and row["engine"] == "llama.cpp" else None

    def _update_buttons(self) -> None:
        row = self.selected()
        self.serve_button.setEnabled(row is not None)
        self.quality.set_available(self._gguf_selected() is not None)
        deletable = row is not None and row["delete_name"] is not None and not self.deleting
        self.delete_button.setEnabled(deletable)
        if row is not None and row["delete_name"] is None:
            self.delete_button.setToolTip(DEMO_CANNOT_DELETE)
        elif row is not None and row["forget_only"]:
            self.delete_button.setToolTip("Drop this path from the list; its files stay where they are")
        else:
            self.delete_button.setToolTip("Delete the model's files from the Hugging Face cache (asks first)")

    # --- actions ---
    def serve_selected(self) -> None:
        row = self.selected()
        if row is not None:
            self.serve_requested.emit(row["serve_model"], row["engine"])

    def delete_selected(self) -> None:
        row = self.selected()
        if row is None or row["delete_name"] is None or self.deleting:
            return
        if not self.confirm(row):
            return
        self.deleting = True
        self._update_buttons()
        self.notice.show_message(f"{'Forgetting' if row['forget_only'] else 'Deleting'} {row['name']}…")
        submit(_delete, row["delete_name"], on_finished=lambda result: self._deleted(row, result),
               on_error=self._delete_failed)

    def _deleted(self, row: LibraryRow, result: Any) -> None:
        self.deleting = False
        if getattr(result, "forgotten", False):
            self.notice.show_message(f"Forgot {row['name']}: its files stay in {row['path']}.")
        else:
            self.notice.show_message(f"Deleted {row['name']}: freed {human_bytes(result.freed_bytes)}.")
        self.refresh()

    def _delete_failed(self, message: str) -> None:
        self.deleting = False
        self._update_buttons()
        self.notice.show_message(message, "error")

