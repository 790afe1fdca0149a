"""File → Settings: edit the typed settings (desktop.core.storage.settings); bad values are explained, nothing is lost."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QLineEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from desktop.ui.widgets import Notice


class SettingsDialog(QDialog):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        from desktop.core.storage import settings as core_settings

        self.core = core_settings
        self.setWindowTitle("Settings")
        current = core_settings.load()
        self.engines_dir = QLineEdit(current.engines_dir)
        self.engines_dir.setPlaceholderText("default (per-user data folder)")
        self.models_dir = QLineEdit(current.models_dir)
        self.models_dir.setPlaceholderText("default (Hugging Face cache)")
        self.port = QSpinBox()
        self.port.setRange(1024, 65535)
        self.port.setValue(current.endpoint_port)
        self.workload = QComboBox()
        self.workload.addItems(list(core_settings.WORKLOADS))
        self.workload.setCurrentText(current.default_workload)
        self.engine = QComboBox()
        self.engine.addItems(list(core_settings.ENGINES))
        self.engine.setCurrentText(current.preferred_engine)
        self.kld_budget = QDoubleSpinBox()
        self.kld_budget.setDecimals(3)
        self.kld_budget.setRange(0.001, 10.0)
        self.kld_budget.setSingleStep(0.01)
        self.kld_budget.setValue(current.kld_budget)
        self.kld_budget.setToolTip("The largest mean KL divergence from a higher-precision reference a recommended "
                                   "quantization may have, where `switchyard quality` measured it (docs/quality.md)")
        self.notice = Notice("\n".join(current.notes))
        form = QFormLayout()
        form.addRow("&Engines folder:", self.engines_dir)
        form.addRow("&Models folder:", self.models_dir)
        form.addRow("Endpoint &port:", self.port)
        form.addRow("Default &workload:", self.workload)
        form.addRow("Preferred e&ngine:", self.engine)
        form.addRow("&Quality budget (mean KLD):", self.kld_budget)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.save)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.notice)
        layout.addWidget(buttons)
        self._current = current

    def values(self) -> Any:  # core Settings
        return replace(self._current, engines_dir=self.engines_dir.text().strip(),
                       models_dir=self.models_dir.text().strip(), endpoint_port=self.port.value(),
                       default_workload=self.workload.currentText(), preferred_engine=self.engine.currentText(),
                       kld_budget=round(self.kld_budget.value(), 3), notes=())

    def save(self) -> bool:
        from desktop.core.common.errors import SwitchyardError

        try:
            self.core.save(self.values())
        except SwitchyardError as exc:
            self.notice.show_message(exc.message + (f"\nHint: {exc.hint}" if exc.hint else ""), "error")
            return False
        self.accept()
        return True
