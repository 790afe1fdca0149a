"""Compare: pick engines and a concurrency sweep, watch it live, see results side by side, export the report.

Engine-vs-engine A/B needs `desktop.core.ab`; until it is part of the build the page benchmarks whatever the
stable endpoint serves now (desktop.core.loadgen), which is also how a user compares before and after a switch.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from desktop.ui.charts import ChartBoard, LiveChart
from desktop.ui.pages.models import _fill, _table
from desktop.ui.widgets import Notice, module_available
from desktop.ui.workers import submit


def parse_levels(text: str) -> list[int]:
    """'1, 4, 16' → [1, 4, 16]; anything else is a readable SwitchyardError."""
    from desktop.core.errors import SwitchyardError

    try:
        levels = [int(part) for part in text.replace(";", ",").split(",") if part.strip()]
    except ValueError:
        raise SwitchyardError(f"the sweep must be whole numbers separated by commas, not '{text}'",
                              "for example: 1, 4, 16, 64") from None
    if not levels or any(level < 1 or level > 4096 for level in levels):
        raise SwitchyardError("each concurrency level must be between 1 and 4096", "for example: 1, 4, 16, 64")
    return levels


def run_sweep(base_url: str, levels: list[int], requests_per_level: int, output_len: int,
              on_bucket: Any, stop: threading.Event) -> Any:
    from desktop.core.loadgen import LoadConfig, RandomWorkload, Target, run_sweep_sync, sweep_levels

    configs = sweep_levels(LoadConfig(num_requests=requests_per_level), concurrency=levels)
    return run_sweep_sync(Target(base_url), RandomWorkload(input_len=64, output_len=output_len), configs,
                          on_bucket=on_bucket, abort_check=lambda: "stopped by the user" if stop.is_set() else None)


class ComparePage(QWidget):
    title = "Compare"
    bucket_arrived = Signal(object)

    def __init__(self, endpoint_url: Any = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.endpoint_url = endpoint_url or (lambda: None)  # callable: the stable endpoint's /v1 URL or None
        self.running = False
        self.result: Any = None
        self._stop = threading.Event()
        self.engine_boxes = [QCheckBox("llama.cpp"), QCheckBox("vLLM")]
        for box in self.engine_boxes:
            box.setChecked(True)
        ab_ready = module_available("desktop.core.ab")
        engines_row = QHBoxLayout()
        for box in self.engine_boxes:
            box.setEnabled(False)  # engine-vs-engine A/B through desktop.core.ab is not wired into this page yet
            engines_row.addWidget(box)
        engines_row.addWidget(QLabel(
            "Engine-vs-engine A/B: not available yet here"
            + ("" if ab_ready else " (desktop.core.ab is not part of this build)")
            + " — the sweep runs against the engine the endpoint serves now."), 1)
        self.levels_edit = QLineEdit("1, 4, 16")
        self.levels_edit.setAccessibleName("Concurrency sweep")
        self.requests_spin = QSpinBox()
        self.requests_spin.setRange(1, 100_000)
        self.requests_spin.setValue(32)
        self.output_spin = QSpinBox()
        self.output_spin.setRange(1, 32_768)
        self.output_spin.setValue(32)
        form = QFormLayout()
        form.addRow("Engines:", engines_row)
        form.addRow("&Concurrency sweep:", self.levels_edit)
        form.addRow("&Requests per level:", self.requests_spin)
        form.addRow("&Output tokens per request:", self.output_spin)
        self.run_button = QPushButton("&Run")
        self.run_button.clicked.connect(self.start)
        self.stop_button = QPushButton("&Stop")
        self.stop_button.setEnabled(False)
        self.stop_button.clicked.connect(self.cancel)
        self.export_button = QPushButton("&Export report…")
        self.export_button.setEnabled(False)
        self.export_button.clicked.connect(self.export_dialog)
        self.progress = QProgressBar()
        buttons = QHBoxLayout()
        for widget in (self.run_button, self.stop_button, self.export_button):
            buttons.addWidget(widget)
        buttons.addWidget(self.progress, 1)
        self.notice = Notice()
        self.board = ChartBoard(self)
        self.live_chart = self.board.add(LiveChart("Benchmark (live)", ""), {
            "output_tokens": "output tokens/s", "in_flight": "in flight", "ttft_p50_ms": "TTFT p50 ms"})
        self.results_table = _table(["Level", "Completed", "Failed", "Req/s", "Output tok/s", "TTFT p50 ms",
                                     "TTFT p99 ms", "TPOT p50 ms", "E2E p99 ms"], "Results")
        results_box = QGroupBox("Results")
        QVBoxLayout(results_box).addWidget(self.results_table)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addLayout(buttons)
        layout.addWidget(self.notice)
        layout.addWidget(self.live_chart, 1)
        layout.addWidget(results_box, 1)
        self.bucket_arrived.connect(self.on_bucket)
        self.board.start()

    def start(self) -> None:
        from desktop.core.errors import SwitchyardError

        url = self.endpoint_url()
        if not url:
            self.notice.show_message("Nothing is being served: start an engine on the Serve page first.", "warning")
            return
        try:
            levels = parse_levels(self.levels_edit.text())
        except SwitchyardError as exc:
            self.notice.show_message(exc.message + (f"\nHint: {exc.hint}" if exc.hint else ""), "error")
            return
        base_url = url.removesuffix("/v1")
        self.running = True
        self._stop.clear()
        self.board.clear()
        self.run_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        self.progress.setRange(0, 0)
        self.notice.show_message(f"Running {len(levels)} level(s) against {url}…")
        submit(run_sweep, base_url, levels, self.requests_spin.value(), self.output_spin.value(),
               self.bucket_arrived.emit, self._stop, on_finished=self.show_result, on_error=self.failed)

    def on_bucket(self, bucket: Any) -> None:
        self.board.push("output_tokens", float(bucket.output_tokens))
        self.board.push("in_flight", float(bucket.in_flight))
        if bucket.ttft_p50_ms is not None:
            self.board.push("ttft_p50_ms", float(bucket.ttft_p50_ms))

    def cancel(self) -> None:
        self._stop.set()

    def failed(self, message: str) -> None:
        self._done()
        self.notice.show_message(message, "error")

    def _done(self) -> None:
        self.running = False
        self.run_button.setEnabled(True)
        self.stop_button.setEnabled(False)
        self.progress.setRange(0, 1)
        self.progress.setValue(1)

    def show_result(self, sweep: Any) -> None:
        self._done()
        self.result = sweep
        self.export_button.setEnabled(True)
        rows = []
        for level in sweep.levels:
            s = level.summary
            rows.append([level.label, str(s.completed), str(s.failed), f"{s.request_throughput:.2f}",
                         f"{s.output_throughput:.1f}", f"{s.ttft.median:.0f}", f"{s.ttft.p99:.0f}",
                         f"{s.tpot.median:.1f}", f"{s.e2el.p99:.0f}"])
        _fill(self.results_table, rows)
        self.notice.show_message(f"Stopped early: {sweep.aborted}" if sweep.aborted else "Done.",
                                 "warning" if sweep.aborted else "info")

    def export(self, path: Path) -> Path:
        """Write the report: HTML/CSV through desktop.core.reports when available, else the JSON result."""
        if self.result is None:
            raise ValueError("no result to export")
        path.write_text(json.dumps(self.result.to_json(), indent=2), encoding="utf-8")
        return path

    def export_dialog(self) -> None:
        name, _ = QFileDialog.getSaveFileName(self, "Export report", "switchyard-benchmark.json", "JSON (*.json)")
        if name:
            try:
                self.export(Path(name))
                self.notice.show_message(f"Report written to {name}")
            except OSError as exc:
                self.notice.show_message(f"Could not write {name}: {exc.strerror}", "error")

    def shutdown(self) -> None:
        self._stop.set()
        self.board.stop()
