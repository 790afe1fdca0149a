"""Machine: what was detected (GPUs, CPU, RAM, disk, notes), the engine builds this machine should run (and
whether the installed ones waste the GPU), live free VRAM / RAM, refreshed every 2 s, and a Calibrate button:
each installed engine is launched briefly and its own memory report corrects the fit here
(desktop.core.runtime.calibrate; the page only shows its predicted-vs-measured lines)."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import (
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from desktop.ui.widgets import Notice
from desktop.ui.workers import submit

GIB = 1024**3
REFRESH_MS = 2000


def detect_hardware() -> Any:
    from desktop.core.machine.hardware import detect
    from desktop.core.storage import settings as settings_module

    models_dir = settings_module.load().models_dir or None
    return detect(models_dir)


def calibrate_engines() -> list[list[str]]:
    """Every engine's calibration (`switchyard calibrate` on the demo), as the lines it prints."""
    from desktop.core.engines import engine_names
    from desktop.core.runtime.calibrate import calibrate, describe

    return [describe(calibrate(engine)) for engine in engine_names()]


def engine_builds(snapshot: Any) -> Any:
    from desktop.core.engines import engine_builds as builds_for

    return builds_for(snapshot)


class MachinePage(QWidget):
    title = "Machine"
    download_requested = Signal(str)  # "org/name:Q4_K_M": the suggested first model, to download and serve

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.snapshot: Any = None
        self._refreshing = False
        self.notice = Notice("Detecting hardware…")
        self.summary = QFormLayout()
        summary_box = QGroupBox("This machine")
        summary_box.setLayout(self.summary)
        self.builds: Any = None
        self.builds_box = QGroupBox("Engine builds for this machine")
        self.builds_layout = QFormLayout(self.builds_box)
        self.live_box = QGroupBox("Free memory (live)")
        self.live_layout = QFormLayout(self.live_box)
        self.bars: dict[str, QProgressBar] = {}
        # the first thing read: what this machine serves, and a first model that fits (planning.first_model)
        self.sentence = QLabel("")
        self.sentence.setObjectName("machineSentence")
        self.sentence.setAccessibleName("What this machine can serve")
        self.sentence.setWordWrap(True)
        self.sentence.setStyleSheet("font-size: 14pt; font-weight: 600;")
        self.suggestion_label = QLabel("")
        self.suggestion_label.setWordWrap(True)
        self.download_button = QPushButton("&Download && serve")
        self.download_button.setAccessibleName("Download and serve the suggested model")
        self.download_button.hide()
        self.download_button.clicked.connect(self._download_suggested)
        self.suggested: Any = None
        suggestion_row = QHBoxLayout()
        suggestion_row.addWidget(self.suggestion_label, 1)
        suggestion_row.addWidget(self.download_button)
        # the probes' own words (NVML missing, no amdgpu device, ...) are for when something looks wrong
        self.details_button = QToolButton()
        self.details_button.setText("Details of the GPU probes")
        self.details_button.setCheckable(True)
        self.details_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.details_button.setArrowType(Qt.ArrowType.RightArrow)
        self.details_button.setAccessibleName("Show the GPU probes' messages")
        self.details_button.hide()  # until a snapshot has notes to show
        self.notes_label = QLabel("")
        self.notes_label.setAccessibleName("GPU probe messages")
        self.notes_label.setWordWrap(True)
        self.notes_label.hide()
        self.details_button.toggled.connect(self._show_details)
        self.refresh_button = QPushButton("&Refresh")
        self.refresh_button.clicked.connect(self.refresh)
        self.calibrate_box = QGroupBox("Memory calibration")
        calibrate_layout = QVBoxLayout(self.calibrate_box)
        self.calibrate_button = QPushButton("&Calibrate memory (launches each engine briefly)")
        self.calibrate_button.setAccessibleName("Calibrate memory")
        self.calibrate_button.clicked.connect(self.calibrate)
        self.calibration_label = QLabel("Not calibrated on this machine yet: the fit uses its formulas alone.")
        self.calibration_label.setWordWrap(True)
        self.calibration_label.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.calibration_label.setAccessibleName("Calibration result")
        calibrate_layout.addWidget(self.calibrate_button)
        calibrate_layout.addWidget(self.calibration_label)
        layout = QVBoxLayout(self)
        layout.addWidget(self.sentence)
        layout.addLayout(suggestion_row)
        layout.addWidget(self.notice)
        layout.addWidget(summary_box)
        layout.addWidget(self.builds_box)
        layout.addWidget(self.live_box)
        layout.addWidget(self.calibrate_box)
        layout.addWidget(self.details_button)
        layout.addWidget(self.notes_label)
        layout.addWidget(self.refresh_button)
        layout.addStretch(1)
        self.timer = QTimer(self)
        self.timer.setInterval(REFRESH_MS)
        self.timer.timeout.connect(self.refresh)
        self.refresh()
        self.timer.start()

    def refresh(self) -> None:
        if self._refreshing:
            return  # never pile up probes
        self._refreshing = True
        submit(detect_hardware, on_finished=self.show_snapshot, on_error=self.show_error)

    def calibrate(self) -> None:
        self.calibrate_button.setEnabled(False)
        self.calibration_label.setText("Calibrating: launching each installed engine at a small context…")
        submit(calibrate_engines, on_finished=self.show_calibration, on_error=self.show_calibration_error)

    def show_calibration(self, results: list[list[str]]) -> None:
        self.calibrate_button.setEnabled(True)
        self.calibration_label.setText("\n".join(line for lines in results for line in lines))

    def show_calibration_error(self, message: str) -> None:
        self.calibrate_button.setEnabled(True)
        self.calibration_label.setText(f"Calibration failed: {message}")

    def show_error(self, message: str) -> None:
        self._refreshing = False
        self.notice.show_message(message, "error")

    def show_snapshot(self, snapshot: Any) -> None:
        self._refreshing = False
        first = self.snapshot is None
        self.snapshot = snapshot
        if first:
            self.notice.show_message("")
            self._fill_summary(snapshot)
            self._show_first_run(snapshot)
            submit(engine_builds, snapshot, on_finished=self.show_builds, on_error=self.show_error)
        self._update_bar("RAM", snapshot.ram_available_bytes, snapshot.ram_total_bytes)
        for gpu in snapshot.gpus:
            self._update_bar(f"GPU {gpu.index} VRAM", gpu.memory_free_bytes, gpu.memory_total_bytes)

    def _show_first_run(self, snapshot: Any) -> None:
        """The one sentence and the suggested first model, sized by the fit for this machine."""
        from desktop.core.hub.names import DEMO_NOTE
        from desktop.core.planning.first_model import first_run

        answer = first_run(snapshot)
        self.sentence.setText(answer.sentence + ".")
        self.suggested = answer.suggestion
        if answer.suggestion is None:
            self.suggestion_label.setText(f"Try the built-in demo on the Serve page ({DEMO_NOTE}).")
            self.download_button.hide()
            return
        starter = answer.suggestion
        slower = ""
        if answer.largest is not None and answer.largest != starter and not snapshot.gpus:
            slower = f" Up to {answer.largest.label} fits too, but answers slowly on a CPU."
        self.suggestion_label.setText(f"A first model that fits: {starter.spec} ({starter.label} parameters, "
                                      f"{starter.size_bytes / 1e9:.2f} GB download), served by llama.cpp.{slower}")
        self.download_button.setToolTip(f"Download {starter.file} from the Hugging Face Hub, then serve it")
        self.download_button.show()

    def _download_suggested(self) -> None:
        if self.suggested is not None:
            self.download_requested.emit(self.suggested.spec)

    def _show_details(self, shown: bool) -> None:
        self.notes_label.setVisible(shown)
        self.details_button.setArrowType(Qt.ArrowType.DownArrow if shown else Qt.ArrowType.RightArrow)

    def _fill_summary(self, snapshot: Any) -> None:
        cpu = snapshot.cpu
        features = ", ".join(name for name in ("avx2", "avx512", "amx", "neon") if getattr(cpu, name)) or "none"
        rows = [
            ("OS", snapshot.os),
            ("CPU", f"{cpu.model} ({cpu.physical_cores} cores / {cpu.logical_cores} threads, {cpu.arch}; {features})"),
            ("RAM", f"{snapshot.ram_total_bytes / GIB:.1f} GiB"),
        ]
        if not snapshot.gpus:
            rows.append(("GPUs", "none found: models run on the CPU (llama.cpp)"))
        for gpu in snapshot.gpus:
            extra = ", ".join(x for x in (f"compute {gpu.compute_capability}" if gpu.compute_capability else "",
                                          f"driver {gpu.driver_version}" if gpu.driver_version else "") if x)
            rows.append((f"GPU {gpu.index}", f"{gpu.name} — {gpu.memory_total_bytes / GIB:.1f} GiB, {gpu.backend}"
                         + (f" ({extra})" if extra else "")))
        if snapshot.disk_free_bytes is not None:
            rows.append(("Models folder", f"{snapshot.models_dir} ({snapshot.disk_free_bytes / GIB:.1f} GiB free)"))
        for key, value in rows:
            label = QLabel(value)
            label.setWordWrap(True)
            self.summary.addRow(f"{key}:", label)
        self.notes_label.setText("\n".join(f"• {note}" for note in snapshot.notes))
        self.details_button.setVisible(bool(snapshot.notes))  # nothing to open where every probe went well

    def show_builds(self, builds: Any) -> None:
        """One row per engine: the build for this machine (or why it cannot run here) and what is installed."""
        self.builds = builds
        while self.builds_layout.rowCount():
            self.builds_layout.removeRow(0)
        warnings = []
        for item in builds:
            if item.build is not None:
                text = f"{item.build.variant} build ({item.build.source}): {item.build.reason}"
            else:
                text = f"not on this machine: {item.blocker} — {item.fix}"
            installed = item.installed_variant or ("installed" if item.install else "not installed")
            label = QLabel(f"{text}\nInstalled: {installed}")
            label.setWordWrap(True)
            label.setAccessibleName(f"{item.display_name} build")
            self.builds_layout.addRow(f"{item.display_name}:", label)
            if item.warning:
                warnings.append(f"{item.warning}. Fix: {item.warning_fix}")
        if warnings:
            self.notice.show_message(" ".join(warnings), "warning")

    def _update_bar(self, name: str, free: int, total: int) -> None:
        bar = self.bars.get(name)
        if bar is None:
            bar = QProgressBar()
            bar.setAccessibleName(f"{name} free")
            self.bars[name] = bar
            self.live_layout.addRow(f"{name}:", bar)
        bar.setRange(0, max(1, total // (1024**2)))
        bar.setValue(free // (1024**2))
        bar.setFormat(f"{free / GIB:.1f} GiB free of {total / GIB:.1f} GiB")

    def shutdown(self) -> None:
        self.timer.stop()
