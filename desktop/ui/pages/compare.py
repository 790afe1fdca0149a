"""Compare: an engine-vs-engine A/B on one model (desktop.core.measure.ab: cold start in phases, a concurrency sweep on
each engine in turn, ratios and the amortization verdict), or a sweep against whatever the stable endpoint
serves now. Live buckets feed the charts; results appear side by side; the report (JSON, CSV, HTML from
desktop.core.measure.reports) can be exported and opened. An A/B can also replay the endpoint's recorded traffic
(issue 25, `ab --replay`): after each engine's closed-loop sweep the request log's arrivals and token lengths are
sent open loop (desktop.core.measure.loadgen.replay), and a second table shows both engines on it.

The benchmark runs in a child process (workers.BenchJob) so the load generator never competes with painting.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from PySide6.QtCore import QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from desktop.ui.charts import ChartBoard, LiveChart
from desktop.ui.pages.compare_form import CompareForm, parse_levels
from desktop.ui.pages.compare_results import CompareResults
from desktop.ui.pages.compare_tables import engine_label, replay_rows
from desktop.ui.widgets import Notice
from desktop.ui.workers import BenchJob

__all__ = ["ComparePage", "parse_levels", "replay_rows"]  # parse_levels lives with the form now

LIVE_CHARTS = (("output_tokens", "Output tokens/s (live)", "tokens/s"),
               ("ttft_p50_ms", "TTFT p50 (live)", "ms"),
               ("in_flight", "Requests in flight (live)", "requests"))


class ComparePage(QWidget):
    title = "Compare"
    run_finished = Signal(dict)  # the child's result event: {"result", "report", "run_id"}

    def __init__(self, endpoint_url: Any = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.endpoint_url = endpoint_url or (lambda: None)  # callable: the stable endpoint's /v1 URL or None
        self.running = False
        self.result: dict[str, Any] | None = None
        self.report: dict[str, str] | None = None
        self.job: BenchJob | None = None
        self.buckets_received = 0
        self._engine_started: dict[str, float] = {}  # engine → wall time of its first bucket

        # --- what to run ---
        self.form = CompareForm(self.endpoint_url)
        form = self.form
        # the form's inputs, on the page where tests and the screenshot driver reach them
        self.ab_radio, self.endpoint_radio, self.mode_group = form.ab_radio, form.endpoint_radio, form.mode_group
        self.engine_a, self.engine_b, self.model_edit = form.engine_a, form.engine_b, form.model_edit
        self.repetitions_spin, self.ab_options = form.repetitions_spin, form.ab_options
        self.levels_edit, self.requests_spin, self.output_spin = form.levels_edit, form.requests_spin, form.output_spin
        self.replay_check, self.replay_since = form.replay_check, form.replay_since
        self.replay_speed, self.replay_max = form.replay_speed, form.replay_max
        self.replay_options, self.replay_info = form.replay_options, form.replay_info

        # --- actions ---
        self.run_button = QPushButton("&Run")
        self.run_button.clicked.connect(lambda: self.start())
        self.stop_button = QPushButton("&Stop")
        self.stop_button.setEnabled(False)
        self.stop_button.clicked.connect(self.cancel)
        self.export_button = QPushButton("E&xport report…")
        self.export_button.setToolTip("Copy the report (JSON, CSV and a self-contained HTML page) into a folder")
        self.export_button.setEnabled(False)
        self.export_button.clicked.connect(self.export_dialog)
        self.open_button = QPushButton("Open re&port")
        self.open_button.setToolTip("Open the HTML report in the browser")
        self.open_button.setEnabled(False)
        self.open_button.clicked.connect(self.open_report)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setValue(0)
        self.progress.setAccessibleName("Benchmark progress")
        self.status_label = QLabel("")
        self.status_label.setAccessibleName("Benchmark status")
        buttons = QHBoxLayout()
        for widget in (self.run_button, self.stop_button, self.export_button, self.open_button):
            buttons.addWidget(widget)
        buttons.addWidget(self.progress, 1)
        self.notice = Notice()

        # --- live charts: shown from a run's start; after it, only those that got data (no empty band) ---
        self.board = ChartBoard(self)
        self.live_charts: dict[str, LiveChart] = {}
        self.charts_box = QWidget()
        self.charts_box.setVisible(False)
        charts_row = QHBoxLayout(self.charts_box)
        charts_row.setContentsMargins(0, 0, 0, 0)
        for key, title, unit in LIVE_CHARTS:
            chart = self.board.add(LiveChart(title, unit, follow_time=False, symbols=True), {})
            chart.plot.getPlotItem().setLabel("bottom", "seconds into each engine's load")
            self.live_charts[key] = chart
            charts_row.addWidget(chart)

        # --- results: the answer under the buttons, over the charts that led to it ---
        self.results = CompareResults()
        self.results.setVisible(False)
        self.results_table, self.replay_table = self.results.results_table, self.results.replay_table
        self.verdict_label = self.results.verdict_label

        body = QWidget()
        layout = QVBoxLayout(body)
        layout.addWidget(form)
        layout.addLayout(buttons)
        layout.addWidget(self.status_label)
        layout.addWidget(self.notice)
        layout.addWidget(self.results)  # as tall as its rows: the page scrolls when they need more
        layout.addWidget(self.charts_box, 1)  # the room that is left, never less than a readable chart
        layout.addStretch(0)  # without charts, the space is left at the bottom, not spread between the boxes
        self.page_scroll = QScrollArea()
        self.page_scroll.setWidgetResizable(True)
        self.page_scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.page_scroll.setWidget(body)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(self.page_scroll)
        self.board.start()

    # --- the form's answers ---
    def replaying(self) -> bool:
        return self.form.replaying()

    def refresh_replay(self) -> None:
        self.form.refresh_replay()

    def job_for_inputs(self) -> dict[str, Any]:
        """The child-process job for what the form says (raises SwitchyardError on bad input)."""
        return self.form.job_for_inputs()

    @property
    def replay_schedule(self) -> dict[str, Any] | None:
        """What the replay would send (the form's preview), None until read or when there is nothing."""
        return self.form.replay_schedule

    @property
    def replay_error(self) -> str:
        return self.form.replay_error

    # --- running ---
    def start(self, job: dict[str, Any] | None = None) -> bool:
        from desktop.core.common.errors import SwitchyardError

        if self.running:
            return False
        try:
            job = job or self.job_for_inputs()
        except SwitchyardError as exc:
            self.notice.show_message(exc.message + (f"\nHint: {exc.hint}" if exc.hint else ""), "warning")
            return False
        self.running = True
        self.result = self.report = None
        self.buckets_received = 0
        self._engine_started.clear()
        for chart in self.live_charts.values():
            self.board.remove_all_series(chart)
        self.results.clear()
        self.show_charts(running=True)
        for button, enabled in ((self.run_button, False), (self.stop_button, True), (self.export_button, False),
                                (self.open_button, False)):
            button.setEnabled(enabled)
        self.progress.setRange(0, 0)  # busy until the first bucket says how far along it is
        what = (f"A/B {job['config']['engines'][0]} vs {job['config']['engines'][1]} on {job['config']['model']}"
                if job["kind"] == "ab" else f"a sweep against {job['base_url']}/v1")
        if job["kind"] == "ab" and job["config"].get("replay"):
            what += f", then a replay of the recorded traffic at {float(job['config'].get('replay_speed', 1)):g}x"
        self.notice.show_message(f"Running {what}…" + (
            "\nAn engine is serving on the Serve page: it shares the CPU and memory with the A/B and skews it."
            if job["kind"] == "ab" and self.endpoint_url() else ""), "warning" if job["kind"] == "ab" and
            self.endpoint_url() else "info")
        self.status_label.setText("Starting the benchmark process…")
        self.job = BenchJob(job, self)
        self.job.progress.connect(self.on_progress)
        self.job.bucket.connect(self.on_bucket)
        self.job.finished.connect(self.show_result)
        self.job.failed.connect(self.failed)
        self.job.ended.connect(self._ended)
        self.job.start()
        return True

    def show_charts(self, running: bool) -> None:
        """All live charts while a run measures; afterwards only those that got a point, and none at all when
        no bucket came (a result handed in, a run that failed at once): a chart without data is a blank band."""
        any_data = False
        for chart in self.live_charts.values():
            has_data = any(curve.buffer.count for curve in chart.curves.values())
            chart.setVisible(running or has_data)
            any_data = any_data or has_data
        self.charts_box.setVisible(running or any_data)

    def on_progress(self, message: str, _fraction: object) -> None:
        self.status_label.setText(message)

    def on_bucket(self, bucket: dict[str, Any]) -> None:
        """One second of the run: one point per live chart for the engine being measured. Each engine's curve
        starts at 0 s when its load starts, so the engines overlay (an A/B runs them one after the other)."""
        import time

        self.buckets_received += 1
        engine = str(bucket.get("engine") or "endpoint")
        label = engine_label(engine)
        now = time.time()
        t = self.board.origin + now - self._engine_started.setdefault(engine, now)
        for key, chart in self.live_charts.items():
            series = f"{engine}:{key}"
            if series not in chart.curves:
                self.board.add_series(chart, series, label)
            value = bucket.get(key)
            if value is not None:
                self.board.push(series, float(value), t)
        overall = bucket.get("overall")
        if overall is not None:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(float(overall) * 1000))

    def cancel(self) -> None:
        if self.job is not None and self.running:
            self.status_label.setText("Stopping… (a sweep keeps what it measured; an A/B stops its engine)")
            self.job.stop()

    def failed(self, message: str) -> None:
        self.notice.show_message(message, "warning" if self.job and self.job.outcome == "cancelled" else "error")

    def _ended(self) -> None:
        self.running = False
        self.show_charts(running=False)  # a run that ended without a point leaves no empty charts
        self.run_button.setEnabled(True)
        self.stop_button.setEnabled(False)
        self.progress.setRange(0, 1000)
        self.progress.setValue(1000 if self.result is not None else self.progress.value())
        if self.job is not None:
            self.job.deleteLater()
            self.job = None

    def show_result(self, event: dict[str, Any]) -> None:
        result, report = event["result"], event.get("report")
        self.result, self.report = result, report
        self.export_button.setEnabled(bool(report))
        self.open_button.setEnabled(bool(report))
        self.results.show_result(result)
        self.board.tick()  # the last buckets, drawn now rather than on their chart's next turn
        self.show_charts(running=False)
        problems = result.get("errors") or ([result["aborted"]] if result.get("aborted") else [])
        where = f"Report: {report['html']}" if report else ""
        if problems:
            self.notice.show_message("Incomplete: " + "; ".join(problems) + (f"\n{where}" if where else ""),
                                     "warning")
        else:
            self.notice.show_message(f"Done. {where}")
        self.status_label.setText("")
        self.run_finished.emit(event)

    # --- report ---
    def export_to(self, directory: Path) -> list[Path]:
        """Copy the report files (JSON, CSV, HTML, written by desktop.core.measure.reports) into `directory`."""
        from desktop.core.common.errors import SwitchyardError

        if not self.report:
            raise SwitchyardError("there is no report yet", "run a comparison first")
        written = []
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for key in ("json", "csv", "html"):
                source = Path(self.report[key])
                written.append(Path(shutil.copy2(source, directory / source.name)))
        except OSError as exc:
            raise SwitchyardError(f"cannot write the report into {directory}: {exc.strerror or exc}",
                                  "pick a writable folder") from exc
        self.report = {**self.report, **{p.suffix.lstrip("."): str(p) for p in written}}
        return written

    def export_dialog(self) -> None:
        from desktop.core.common.errors import SwitchyardError

        name = QFileDialog.getExistingDirectory(self, "Export the report into a folder", str(Path.home()))
        if not name:
            return
        try:
            written = self.export_to(Path(name))
        except SwitchyardError as exc:
            self.notice.show_message(exc.message + (f"\nHint: {exc.hint}" if exc.hint else ""), "error")
            return
        self.notice.show_message("Report written: " + ", ".join(str(p) for p in written))

    def open_report(self) -> bool:
        if not self.report:
            return False
        opened = QDesktopServices.openUrl(QUrl.fromLocalFile(self.report["html"]))
        if not opened:
            self.notice.show_message(f"Could not open a browser: the report is {self.report['html']}", "warning")
        return opened

    def shutdown(self) -> None:
        if self.job is not None:
            self.job.shutdown()
        self.board.stop()
