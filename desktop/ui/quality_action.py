"""The "Measure quality" action of the Models and Recommend pages (issue 56): asks which quantizations, runs
desktop.core.measure.quality_job.run_quality (llama.cpp's llama-perplexity, recorded in history) on the thread
pool, and shows its progress and figures. One class for both pages, so they measure and report the same way; the
page decides what to do after a run (the Recommend page answers again, its quality lines then show the run)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import QInputDialog, QLabel, QLineEdit, QPushButton, QWidget

from desktop.core.measure.quality_job import DEFAULT_VARIANTS, parse_variants, result_lines, run_quality
from desktop.ui.widgets import Notice
from desktop.ui.workers import submit


class QualityAction(QObject):
    """A button and a status line, and the run behind them. `model` says what to measure now (None: nothing that
    llama.cpp's tools can measure is chosen); errors go to the page's `notice`."""

    measured = Signal(object, int)  # the QualityReport and its history run id, after a recorded run

    def __init__(self, model: Callable[[], str | None], notice: Notice, parent: QWidget) -> None:
        super().__init__(parent)
        self.model = model
        self.notice = notice
        self.running = False
        self.available = True
        self.prompts: str | None = None  # the CLI's --prompts: None is the shipped corpus (tests pass a short one)
        self.ctx: int | None = None  # the CLI's --ctx: None is its default
        self.report: Any = None  # the last run's QualityReport
        self.run_id: int | None = None
        self.button = QPushButton("Measure &quality…")
        self.button.setAccessibleName("Measure quality")
        self.button.setToolTip("How far quantizations (Q8_0, Q4_K_M ...) move this GGUF model's answers: KL "
                               "divergence by llama.cpp's llama-perplexity, measured here and kept in history")
        self.button.clicked.connect(self.start)
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.status.setAccessibleName("Quality measurement")
        self.status.setVisible(False)

    def set_available(self, available: bool) -> None:
        """Whether the page has something to measure (the Models page: a GGUF row is selected)."""
        self.available = available
        self.button.setEnabled(available and not self.running)

    def ask_variants(self, model: str) -> str | None:
        """Which variants, as --variants takes them; None when the user cancels (tests replace this)."""
        parent = self.parent()
        text, ok = QInputDialog.getText(parent if isinstance(parent, QWidget) else None, "Measure quality",
                                        f"Quantizations of {model} to score against it (types or GGUF files, "
                                        "comma-separated):", QLineEdit.EchoMode.Normal, DEFAULT_VARIANTS)
        return text if ok else None

    def start(self) -> None:
        if self.running:
            return
        model = self.model()
        if not model:
            self.notice.show_message("Pick a GGUF model (llama.cpp) to measure first.", "warning")
            return
        answer = self.ask_variants(model)
        if answer is None:
            return
        variants = parse_variants(answer)
        if not variants:
            self.notice.show_message(f"Name the quantizations to measure, e.g. {DEFAULT_VARIANTS}.", "warning")
            return
        self.running = True
        self.set_available(self.available)
        self._say(f"Measuring {', '.join(variants)} of {model} against it (llama-perplexity)…")
        options: dict[str, Any] = {"prompts": self.prompts}
        if self.ctx is not None:
            options["ctx"] = self.ctx
        submit(run_quality, model, variants, on_progress=self._progress, on_finished=self._done,
               on_error=self._failed, **options)

    def _say(self, text: str) -> None:
        self.status.setText(text)
        self.status.setVisible(bool(text))

    def _progress(self, event: Any) -> None:
        self._say(f"Measuring quality: {getattr(event, 'message', event)}")

    def _done(self, result: tuple[Any, int]) -> None:
        self.running = False
        self.set_available(self.available)
        self.report, self.run_id = result
        lines = result_lines(self.report)
        self._say(f"Quality against {Path(self.report.reference).name} (history run #{self.run_id}):\n"
                  + "\n".join(lines))
        self.measured.emit(self.report, self.run_id)

    def _failed(self, message: str) -> None:
        self.running = False
        self.set_available(self.available)
        self._say("")
        self.notice.show_message(f"Measuring quality failed: {message}", "error")
