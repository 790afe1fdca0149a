"""The Serve page's Model: a list of what is on this machine (the Models page's library rows: `org/name:Q4_K_M`,
its quantization, size and whether it fits for the chosen engine, plus the demo, labelled as random weights),
that still takes a typed path, folder or repo id. What the form hands the planner is the row's model (a path or
`demo`), never the text shown. The fit comes from the Hub listing's tagger (planning.fit.quick_verdict), the
one sizing function, computed off the GUI thread."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QComboBox, QWidget

from desktop.core.hub.names import DEMO_LABEL, display_name
from desktop.ui.widgets import FIT_LABELS, quant_label, size_text
from desktop.ui.workers import submit

DEMO = "demo"


def library_for_picker(engine: str) -> list[dict[str, Any]]:
    """The library's rows with the fit of each for `engine` ("hybrid" rows: llama.cpp's, which starts first)."""
    import json
    from pathlib import Path

    from desktop.core.hub.library_view import library_rows
    from desktop.core.hub.variants import default_tagger

    tagger = default_tagger()
    rows: list[dict[str, Any]] = []
    for row in library_rows():
        if row["serve_model"] == DEMO:
            continue  # one demo entry, for both engines
        config = None
        if row["format"] == "safetensors":
            try:
                config = json.loads((Path(row["path"]) / "config.json").read_text())
            except (OSError, ValueError):
                config = None
        try:
            fit = tagger(row["engine"], row["size_bytes"], config) if row["size_bytes"] > 0 else "unknown"
        except Exception:  # noqa: BLE001 - a model the estimator cannot judge is still listed
            fit = "unknown"
        rows.append({**row, "fit": fit, "loads": engine in ("auto", row["engine"])})
    return rows


def entry_text(row: dict[str, Any]) -> str:
    """"org/name:Q4_K_M · 4.37 GiB · fits" (the quantization is in the name when the name has one)."""
    quant = quant_label(row["quantization"] or None)
    named = row["quantization"] and row["name"].endswith(f":{row['quantization']}")
    parts = [row["name"]] + ([] if named else [quant]) + [size_text(row["size_bytes"]),
                                                            FIT_LABELS.get(row["fit"], row["fit"])]
    return " · ".join(parts)


class ModelPicker(QComboBox):
    """Editable: choose a library entry or type a path. `text()` / `setText()` read and set the model as the form
    hands it on (the entry's path, `demo`, or what was typed)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setEditable(True)
        self.setInsertPolicy(QComboBox.InsertPolicy.NoInsert)
        self.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.setMinimumContentsLength(18)  # the row keeps the window at its width; the tooltip names it whole
        self.setAccessibleName("Model")
        self.setToolTip("A model on this machine (Models page), or a GGUF file, a Hugging Face folder or `demo`")
        edit = self.lineEdit()
        if edit is not None:
            edit.setPlaceholderText("a model from the library, or a path")
            # show an entry from its start ("demo (random…", "org/name:Q4…"), not scrolled to its end
            self.currentIndexChanged.connect(lambda _index: edit.setCursorPosition(0))
        self.engine = "llama.cpp"
        self.rows: list[dict[str, Any]] = []
        self.loading = False
        self._show([])

    def refresh(self, engine: str | None = None) -> None:
        """Read the library again (a download finished, the engine changed) off the GUI thread."""
        if engine is not None:
            self.engine = engine
        self.loading = True
        submit(library_for_picker, self.engine, on_finished=self._show, on_error=self._failed)

    def _failed(self, _message: str) -> None:
        self.loading = False

    def _show(self, rows: list[dict[str, Any]]) -> None:
        chosen = self.text()
        self.loading = False
        self.rows = rows
        self.blockSignals(True)
        self.clear()
        self.addItem(DEMO_LABEL, DEMO)
        for row in rows:
            self.addItem(entry_text(row), row["serve_model"])
            index = self.count() - 1
            self.setItemData(index, row["path"], Qt.ItemDataRole.ToolTipRole)
            if not row["loads"]:  # the other engine's format: listed, not choosable
                item = self.model().item(index)  # type: ignore[attr-defined]
                item.setEnabled(False)
                item.setToolTip(f"{row['engine']} loads this format: choose that engine to serve it")
        self.blockSignals(False)
        self.setText(chosen)

    def choose(self, model: str) -> None:
        """Choose `model` (a path or `demo`) by its entry; one the list does not hold yet (a download that finished
        before the library was read again) gets an entry named as people name it, so no snapshot path shows."""
        if self.findData(model) < 0:
            self.addItem(display_name(model), model)
            self.setItemData(self.count() - 1, model, Qt.ItemDataRole.ToolTipRole)
        self.setCurrentIndex(self.findData(model))

    def text(self) -> str:
        """The model the form hands on: the chosen entry's, else what was typed (`demo` when empty)."""
        typed = self.currentText().strip()
        index = self.findText(typed, Qt.MatchFlag.MatchExactly)
        if index >= 0:
            return str(self.itemData(index))
        return typed or DEMO

    def setText(self, model: str) -> None:  # noqa: N802 - the QLineEdit spelling the form and tests use
        """Choose the entry serving `model` (a path or `demo`), else show `model` as typed."""
        index = self.findData(model)
        if index >= 0:
            self.setCurrentIndex(index)
        else:
            self.setEditText(model)
        edit = self.lineEdit()
        if edit is not None:  # read from its start ("demo (random…"), not scrolled to its end
            edit.setCursorPosition(0)
