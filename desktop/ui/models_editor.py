"""The Serve page's models editor: the endpoint's models (name, engine, model, ctx, parallel, ttl, state) with
add / edit / remove, validated by the same parser the CLI uses, saved to the same `models.yaml` that
`switchyard serve --config` reads (desktop.core.serving.models_file)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from desktop.ui.widgets import Notice

COLUMNS = ("Name", "Engine", "Model", "Context", "Parallel", "TTL", "State")
FORM_KEYS = ("name", "engine", "model", "ctx", "parallel", "ttl", "kind")  # what the entry dialog edits


class EntryDialog(QDialog):
    """One model's fields; OK only when the whole list with this entry validates."""

    def __init__(self, entry: dict[str, Any] | None, check: Callable[[dict[str, Any]], str | None],
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Model" if entry is None else f"Model {entry.get('name', '')}")
        entry = entry or {}
        self.check = check
        self.original = entry  # its other keys (args, parsers ...) are kept: the form edits only its own
        self.name_edit = QLineEdit(str(entry.get("name", "")))
        self.name_edit.setAccessibleName("Model name clients send")
        self.engine_box = QComboBox()
        for key, label in (("llama.cpp", "llama.cpp"), ("vllm", "vLLM")):
            self.engine_box.addItem(label, key)
        index = self.engine_box.findData(entry.get("engine", "llama.cpp"))
        self.engine_box.setCurrentIndex(max(0, index))
        self.model_edit = QLineEdit(str(entry.get("model", "demo")))
        self.model_edit.setAccessibleName("Model to serve")
        self.kind_box = QComboBox()
        self.kind_box.setAccessibleName("What the model serves")
        for key, label in (("chat", "chat and completions"), ("embedding", "embeddings"), ("rerank", "reranking")):
            self.kind_box.addItem(label, key)
        self.kind_box.setCurrentIndex(max(0, self.kind_box.findData(entry.get("kind", "chat"))))
        self.ctx_spin = QSpinBox()
        self.ctx_spin.setRange(1, 10_000_000)
        self.ctx_spin.setValue(int(entry.get("ctx", 2048)))
        self.parallel_spin = QSpinBox()
        self.parallel_spin.setRange(1, 1024)
        self.parallel_spin.setValue(int(entry.get("parallel", 4)))
        self.ttl_spin = QDoubleSpinBox()
        self.ttl_spin.setRange(0, 10_000_000)
        self.ttl_spin.setDecimals(0)
        self.ttl_spin.setSpecialValueText("never")  # 0 = no ttl
        self.ttl_spin.setValue(float(entry.get("ttl") or 0))
        self.ttl_spin.setSuffix(" s")
        self.notice = Notice()
        form = QFormLayout()
        form.addRow("&Name:", self.name_edit)
        form.addRow("&Engine:", self.engine_box)
        form.addRow("&Model:", self.model_edit)
        form.addRow("&Serves:", self.kind_box)
        form.addRow("&Context per request:", self.ctx_spin)
        form.addRow("&Parallel requests:", self.parallel_spin)
        form.addRow("Stop after &idle:", self.ttl_spin)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.try_accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.notice)
        layout.addWidget(buttons)

    def data(self) -> dict[str, Any]:
        data: dict[str, Any] = {key: value for key, value in self.original.items() if key not in FORM_KEYS}
        data.update({"name": self.name_edit.text().strip(), "engine": self.engine_box.currentData(),
                     "model": self.model_edit.text().strip(), "ctx": self.ctx_spin.value(),
                     "parallel": self.parallel_spin.value()})
        if self.ttl_spin.value() > 0:
            data["ttl"] = int(self.ttl_spin.value())
        if self.kind_box.currentData() != "chat":
            data["kind"] = self.kind_box.currentData()
        return data

    def try_accept(self) -> bool:
        problem = self.check(self.data())
        if problem:
            self.notice.show_message(problem, "error")
            return False
        self.accept()
        return True


class ModelsEditor(QWidget):
    """The list, its buttons and the file it is saved to."""

    title = "Mo&dels"

    def __init__(self, state_of: Callable[[dict[str, Any]], str] | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        from desktop.core.serving.models_file import default_models_path

        self.state_of = state_of or (lambda _entry: "")
        self.entries: list[dict[str, Any]] = []
        self.path_edit = QLineEdit(str(default_models_path()))
        self.path_edit.setAccessibleName("models.yaml path")
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setAccessibleName("Models behind the endpoint")
        self.table.doubleClicked.connect(lambda _index: self.edit_selected())
        self.add_button = QPushButton("&Add…")
        self.edit_button = QPushButton("&Edit…")
        self.remove_button = QPushButton("&Remove")
        self.load_button = QPushButton("&Load")
        self.save_button = QPushButton("&Save")
        self.add_button.clicked.connect(lambda: self.add())
        self.edit_button.clicked.connect(lambda: self.edit_selected())
        self.remove_button.clicked.connect(self.remove_selected)
        self.load_button.clicked.connect(lambda: self.load())
        self.save_button.clicked.connect(lambda: self.save())
        self.notice = Notice()
        row = QHBoxLayout()
        for button in (self.add_button, self.edit_button, self.remove_button):
            row.addWidget(button)
        row.addStretch(1)
        row.addWidget(self.path_edit, 3)
        row.addWidget(self.load_button)
        row.addWidget(self.save_button)
        layout = QVBoxLayout(self)
        layout.addLayout(row)
        layout.addWidget(self.table)
        layout.addWidget(self.notice)
        self.dialog: EntryDialog | None = None  # the open one (tests fill it in)
        if Path(self.path_edit.text()).is_file():
            self.load()

    # --- the list ---
    def problem_with(self, entries: list[dict[str, Any]]) -> str | None:
        from desktop.core.common.errors import SwitchyardError
        from desktop.core.serving.models_file import validate_entries

        if not entries:
            return None
        try:
            validate_entries(entries)
        except SwitchyardError as exc:
            return exc.message
        return None

    def refresh(self) -> None:
        self.table.setRowCount(len(self.entries))
        for row, entry in enumerate(self.entries):
            ttl = entry.get("ttl")
            cells = (entry["name"], entry["engine"], entry["model"], str(entry.get("ctx", 2048)),
                     str(entry.get("parallel", 4)), f"{ttl:g} s" if ttl else "never", self.state_of(entry))
            for column, text in enumerate(cells):
                self.table.setItem(row, column, QTableWidgetItem(text))
        self.edit_button.setEnabled(bool(self.entries))
        self.remove_button.setEnabled(bool(self.entries))

    def _selected(self) -> int | None:
        rows = sorted({index.row() for index in self.table.selectedIndexes()})
        return rows[0] if rows else (0 if len(self.entries) == 1 else None)

    def add(self, modal: bool = True) -> EntryDialog:
        return self._open(None, None, modal)

    def edit_selected(self, modal: bool = True) -> EntryDialog | None:
        row = self._selected()
        if row is None:
            self.notice.show_message("Select a model to edit", "warning")
            return None
        return self._open(row, self.entries[row], modal)

    def _open(self, row: int | None, entry: dict[str, Any] | None, modal: bool) -> EntryDialog:
        def check(data: dict[str, Any]) -> str | None:
            others = [e for i, e in enumerate(self.entries) if i != row]
            return self.problem_with([*others, data] if row is None else
                                     [*others[:row], data, *others[row:]])

        dialog = EntryDialog(entry, check, self)
        self.dialog = dialog

        def accepted() -> None:
            from desktop.core.serving.models_file import entry_data, validate_entries

            if row is None:
                self.entries.append(dialog.data())
            else:
                self.entries[row] = dialog.data()
            # as the file will hold them (defaults left out), so the list shown is the list saved
            self.entries = [entry_data(e) for e in validate_entries(self.entries).models]
            self.refresh()
            self.notice.show_message("Not saved yet: Save writes " + self.path_edit.text())

        dialog.accepted.connect(accepted)
        if modal:
            dialog.exec()
        else:
            dialog.show()
        return dialog

    def remove_selected(self) -> None:
        row = self._selected()
        if row is None:
            self.notice.show_message("Select a model to remove", "warning")
            return
        del self.entries[row]
        self.refresh()

    # --- the file ---
    def load(self, path: str | None = None) -> bool:
        from desktop.core.common.errors import SwitchyardError
        from desktop.core.serving.fleet import load_models_config
        from desktop.core.serving.models_file import entry_data

        if path is not None:
            self.path_edit.setText(path)
        try:
            config = load_models_config(self.path_edit.text())
        except SwitchyardError as exc:
            self.notice.show_message(exc.message, "error")
            return False
        self.entries = [entry_data(entry) for entry in config.models]
        self.refresh()
        self.notice.show_message(f"{len(self.entries)} model(s) from {self.path_edit.text()}")
        return True

    def save(self, path: str | None = None) -> bool:
        from desktop.core.common.errors import SwitchyardError
        from desktop.core.serving.models_file import validate_entries, write_models_config

        if path is not None:
            self.path_edit.setText(path)
        try:
            written = write_models_config(validate_entries(self.entries, self.path_edit.text()),
                                          self.path_edit.text())
        except SwitchyardError as exc:
            self.notice.show_message(exc.message, "error")
            return False
        self.notice.show_message(f"Saved {len(self.entries)} model(s) to {written}: "
                                 f"`switchyard serve --config {written}` serves them")
        return True
