"""The Serve page's connection card, beside the endpoint URL: the model id a client puts in its requests
(`"model": "switchyard"`, the endpoint's served name) with its own Copy, so pointing a client at the endpoint
needs nothing but these two fields."""

from __future__ import annotations

from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QHBoxLayout, QLabel, QLineEdit, QPushButton, QWidget


class ClientModel(QWidget):
    """"Clients send model: [switchyard] [Copy]"; empty while nothing serves."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.id_edit = QLineEdit()
        self.id_edit.setReadOnly(True)
        self.id_edit.setAccessibleName("Model id clients send")
        self.id_edit.setPlaceholderText("appears once an engine serves")
        self.id_edit.setToolTip('What a client puts in "model" when it asks this endpoint')
        self.copy_button = QPushButton("Copy &id")
        self.copy_button.setToolTip("Copy the model id to the clipboard")
        self.copy_button.clicked.connect(self.copy_model)
        caption = QLabel("Clients send &model:")
        caption.setBuddy(self.id_edit)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(caption)
        layout.addWidget(self.id_edit)
        layout.addWidget(self.copy_button)
        self.show_model(None)

    def show_model(self, name: str | None) -> None:
        self.id_edit.setText(name or "")
        self.copy_button.setEnabled(bool(name))

    def copy_model(self) -> None:
        if self.id_edit.text():
            QGuiApplication.clipboard().setText(self.id_edit.text())
