"""Export a launch plan as something a person deploys elsewhere: a shell command, `docker run`, Compose,
Kubernetes, Ray or Helm (desktop.core.planning.export), shown as text with Copy and Save."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PySide6.QtGui import QFont, QGuiApplication
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from desktop.ui.widgets import Notice

FORMAT_LABELS = {"shell": "Shell command", "docker": "docker run", "compose": "Docker Compose",
                 "k8s": "Kubernetes", "ray": "Ray (multi-node vLLM)", "helm": "Helm values (production stack)"}
SUFFIXES = {"shell": ".sh", "docker": ".sh", "compose": ".yaml", "k8s": ".yaml", "ray": ".sh", "helm": ".yaml"}


class ExportDialog(QDialog):
    """`plan` is a local LaunchPlan; `model` may replace its local path (e.g. with the Hub repo id)."""

    def __init__(self, plan: Any, model: str | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        from desktop.core.planning.export import FORMATS

        self.setWindowTitle("Export the launch plan")
        self.resize(760, 520)
        self.plan = plan
        self.format_box = QComboBox()
        for fmt in FORMATS:
            self.format_box.addItem(FORMAT_LABELS.get(fmt, fmt), fmt)
        self.format_box.setAccessibleName("Export format")
        self.model_edit = QLineEdit(model or str(plan.model_path))
        self.model_edit.setAccessibleName("Model on the target")
        self.model_edit.setToolTip("What the target loads: a Hugging Face repo id, or a path that exists there")
        self.text = QPlainTextEdit()
        self.text.setReadOnly(True)
        self.text.setFont(QFont("Monospace"))
        self.text.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.text.setAccessibleName("Exported plan")
        self.notice = Notice()
        self.copy_button = QPushButton("&Copy")
        self.copy_button.clicked.connect(self.copy)
        self.save_button = QPushButton("&Save…")
        self.save_button.clicked.connect(self.save_dialog)
        top = QHBoxLayout()
        for caption, widget in (("&Format:", self.format_box), ("&Model:", self.model_edit)):
            label = QLabel(caption)
            label.setBuddy(widget)
            top.addWidget(label)
            top.addWidget(widget, 1 if widget is self.model_edit else 0)
        close = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        close.rejected.connect(self.reject)
        close.addButton(self.copy_button, QDialogButtonBox.ButtonRole.ActionRole)
        close.addButton(self.save_button, QDialogButtonBox.ButtonRole.ActionRole)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.text, 1)
        layout.addWidget(self.notice)
        layout.addWidget(close)
        self.format_box.currentIndexChanged.connect(self.show_export)
        self.model_edit.editingFinished.connect(self.show_export)
        self.show_export()

    @property
    def fmt(self) -> str:
        return str(self.format_box.currentData())

    def set_format(self, fmt: str) -> None:
        self.format_box.setCurrentIndex(self.format_box.findData(fmt))

    def show_export(self) -> str:
        """Show the plan in the chosen format; a plan the format cannot express shows why instead."""
        from desktop.core.common.errors import SwitchyardError
        from desktop.core.planning.export import ExportPlan, export_plan

        try:
            export = ExportPlan.from_launch_plan(self.plan, model=self.model_edit.text().strip() or None)
            text = export_plan(export, self.fmt)
        except SwitchyardError as exc:
            self.text.setPlainText("")
            self.notice.show_message(exc.message + (f"\nHint: {exc.hint}" if exc.hint else ""), "error")
            self._enable(False)
            return ""
        self.text.setPlainText(text)
        self.notice.show_message("" if not self.model_edit.text().startswith("/") else
                                 "The model is a local path: it must exist at the same path on the target, or "
                                 "replace it with the Hugging Face repo id.", "info")
        self._enable(True)
        return text

    def _enable(self, enabled: bool) -> None:
        self.copy_button.setEnabled(enabled)
        self.save_button.setEnabled(enabled)

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.text.toPlainText())
        self.notice.show_message(f"{FORMAT_LABELS.get(self.fmt, self.fmt)} copied to the clipboard")

    def save(self, path: Path) -> Path:
        from desktop.core.common.errors import SwitchyardError

        try:
            path.write_text(self.text.toPlainText(), encoding="utf-8")
        except OSError as exc:
            raise SwitchyardError(f"cannot write {path}: {exc.strerror or exc}", "pick a writable path") from exc
        return path

    def save_dialog(self) -> None:
        from desktop.core.common.errors import SwitchyardError

        suggested = f"switchyard-{self.plan.engine.replace('.', '')}-{self.fmt}{SUFFIXES.get(self.fmt, '.txt')}"
        name, _ = QFileDialog.getSaveFileName(self, "Save the export", str(Path.home() / suggested))
        if not name:
            return
        try:
            self.save(Path(name))
        except SwitchyardError as exc:
            self.notice.show_message(exc.message + (f"\nHint: {exc.hint}" if exc.hint else ""), "error")
            return
        self.notice.show_message(f"Saved to {name}")
