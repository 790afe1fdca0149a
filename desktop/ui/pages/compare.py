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
    QButtonGroup,
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QRadioButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from desktop.ui.charts import ChartBoard, LiveChart
from desktop.ui.engine_session import engine_choices
from desktop.ui.pages.models import _fill, _table
from desktop.ui.widgets import Notice
from desktop.ui.workers import BenchJob, submit


def engine_label(name: str) -> str:
    """An engine's display name, from the adapter registry."""
    return dict(engine_choices()).get(name, name)

LIVE_CHARTS = (("output_tokens", "Output tokens/s (live)", "tokens/s"),
               ("ttft_p50_ms", "TTFT p50 (live)", "ms"),
               ("in_flight", "Requests in flight (live)", "requests"))
COLD_PHASES = (("t1_health_s", "Cold start T1: health OK (s)"),
               ("t2_first_token_s", "Cold start T2: first token (s)"),
               ("t3_first_request_s", "Cold start T3: first request done (s)"))
LEVEL_METRICS = (("output_throughput", "output tok/s", 1), ("median_ttft_ms", "TTFT p50 (ms)", 0),
                 ("p95_ttft_ms", "TTFT p95 (ms)", 0), ("request_throughput", "requests/s", 2))


def parse_levels(text: str) -> list[int]:
    """'1, 4, 16' → [1, 4, 16]; anything else is a readable SwitchyardError."""
    from desktop.core.common.errors import SwitchyardError

    try:
        levels = [int(part) for part in text.replace(";", ",").split(",") if part.strip()]
    except ValueError:
        raise SwitchyardError(f"the sweep must be whole numbers separated by commas, not '{text}'",
                              "for example: 1, 4, 16, 64") from None
    if not levels or any(level < 1 or level > 4096 for level in levels):
        raise SwitchyardError("each concurrency level must be between 1 and 4096", "for example: 1, 4, 16, 64")
    return levels


def _number(value: Any, digits: int) -> str:
    return "–" if value is None else f"{float(value):.{digits}f}"


def _spread(cell: dict[str, Any] | None, digits: int) -> str:
    """mean, with the range over repetitions when there were several."""
    if not cell or cell.get("mean") is None:
        return "–"
    text = _number(cell["mean"], digits)
    if cell.get("n", 0) > 1:
        text += f" ({_number(cell['low'], digits)}–{_number(cell['high'], digits)})"
    return text


def phase_table_rows(result: dict[str, Any], a: str, b: str) -> list[list[str]]:
    """Each cold-start phase's seconds (first repetition) per engine, named as on the Serve page's bar."""
    from desktop.core.runtime.supervisor import COLD_START_PHASES, phases_of

    seconds: dict[str, dict[str, float]] = {}
    for engine in result.get("engines", []):
        reps = engine.get("repetitions") or []
        cold = reps[0].get("cold_start") if reps else None
        if isinstance(cold, dict) and not cold.get("attached"):
            seconds[engine["engine"]] = {p["phase"]: float(p["seconds"]) for p in phases_of(cold)}
    rows = []
    for phase in COLD_START_PHASES:
        va, vb = seconds.get(a, {}).get(phase.key), seconds.get(b, {}).get(phase.key)
        if va is None and vb is None:
            continue
        rows.append([f"Cold-start phase: {phase.label} (s)", _number(va, 2), _number(vb, 2),
                     _number(vb / va if va and vb else None, 2)])
    return rows


def ab_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The side-by-side table of an A/B result (its JSON): the engines as columns, B/A as the last one."""
    a, b = (engine["engine"] for engine in result["engines"])
    headers = ["Metric", engine_label(a), engine_label(b), f"{engine_label(b)} / {engine_label(a)}"]
    rows: list[list[str]] = []
    cold = result.get("cold_start", {})
    for key, label in COLD_PHASES:
        cell = cold.get(key, {})
        rows.append([label, _spread(cell.get(a), 2), _spread(cell.get(b), 2), _spread(cell.get("ratio"), 2)])
    rows += phase_table_rows(result, a, b)
    rss = cold.get("peak_rss_mib", {})
    ratio = rss[b] / rss[a] if rss.get(a) and rss.get(b) else None
    rows.append(["Peak memory (MiB, process tree)", _number(rss.get(a), 0), _number(rss.get(b), 0),
                 _number(ratio, 2)])
    for row in result.get("comparison", []):
        for key, label, digits in LEVEL_METRICS:
            cell = row.get(key, {})
            rows.append([f"concurrency {row['concurrency']}: {label}", _spread(cell.get(a), digits),
                         _spread(cell.get(b), digits), _spread(cell.get("ratio"), 2)])
    return headers, rows


def sweep_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["Level", "Completed", "Failed", "Req/s", "Output tok/s", "TTFT p50 ms", "TTFT p95 ms",
               "TPOT p50 ms", "E2E p99 ms"]
    rows = [[str(level.get("label")), str(level.get("completed")), str(level.get("failed")),
             _number(level.get("request_throughput"), 2), _number(level.get("output_throughput"), 1),
             _number(level.get("median_ttft_ms"), 0), _number(level.get("p95_ttft_ms"), 0),
             _number(level.get("median_tpot_ms"), 1), _number(level.get("p99_e2el_ms"), 0)]
            for level in result.get("levels", [])]
    return headers, rows


REPLAY_SPANS = (("last hour", "1h"), ("last day", "1d"), ("last 7 days", "7d"))
REPLAY_METRICS = (("completed", "completed", 0), ("failed", "failed", 0), ("output_throughput", "output tok/s", 1),
                  ("request_throughput", "requests/s", 2), ("median_ttft_ms", "TTFT p50 (ms)", 0),
                  ("p95_ttft_ms", "TTFT p95 (ms)", 0), ("p95_e2el_ms", "E2E p95 (ms)", 0),
                  ("send_lag_p95_ms", "send lag p95 (ms, late vs the schedule)", 1))


def replay_preview(since: str, max_requests: int | None) -> dict[str, Any]:
    """What a replay of the request log since `since` would send (worker thread): the schedule's summary, or why
    there is nothing to send, with the span and limit it answers (a later question may be pending)."""
    from desktop.core.common.errors import SwitchyardError
    from desktop.core.measure.loadgen.replay import schedule_from_log

    key = (since, max_requests or 0)
    try:
        return {"key": key, "schedule": schedule_from_log(since, max_requests=max_requests).to_json(), "error": ""}
    except SwitchyardError as exc:
        return {"key": key, "schedule": None, "error": exc.message + (f"\nHint: {exc.hint}" if exc.hint else "")}


def replay_summary(schedule: dict[str, Any], speed: float) -> str:
    """'12 recorded requests over 5.5 s (none with a captured body): 1.4 s per engine at 4x'."""
    bodies = schedule.get("captured_bodies") or 0
    span = float(schedule.get("span_s") or 0.0)
    return (f"{schedule['requests']} recorded requests over {span:.1f} s "
            f"({bodies if bodies else 'none'} with a captured body; prompts "
            f"{_number(schedule.get('prompt_tokens_mean'), 0)} / outputs {_number(schedule.get('output_tokens_mean'), 0)}"
            f" tokens on average): sent in {span / speed:.1f} s per engine at {speed:g}x")


def replay_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Both engines on the replayed traffic (the A/B result's `replay`), B/A as the last column."""
    replay = result.get("replay") or {}
    a, b = (engine["engine"] for engine in result["engines"])
    headers = ["Replayed traffic", engine_label(a), engine_label(b), f"{engine_label(b)} / {engine_label(a)}"]
    cells = replay.get("engines") or {}
    rows = []
    for key, label, digits in REPLAY_METRICS:
        va, vb = ((cells.get(e) or {}).get(key) for e in (a, b))
        ratio = vb / va if key not in ("completed", "failed") and va and vb is not None else None
        rows.append([label, _number(va, digits), _number(vb, digits), _number(ratio, 2)])
    return headers, rows


def verdict_text(result: dict[str, Any]) -> str:
    lines = []
    verdict = result.get("amortization", {}).get("verdict")
    if verdict:
        lines.append(f"Verdict: {verdict}")
    for scenario in result.get("scenarios", []):
        winner = scenario.get("winner")
        if winner:
            lines.append(f"• {scenario['scenario']} (concurrency {scenario['concurrency']}): "
                         f"{engine_label(winner)}")
    lines += replay_verdict(result)
    return "\n".join(lines)


def replay_verdict(result: dict[str, Any]) -> list[str]:
    """Open loop, both engines get the same arrivals: the one that keeps TTFT p95 lower serves the traffic better."""
    replay = result.get("replay") or {}
    cells = {e: c for e, c in (replay.get("engines") or {}).items() if c and c.get("p95_ttft_ms") is not None}
    if len(cells) != 2:
        return []
    (a, ca), (b, cb) = cells.items()
    best, other = (a, b) if ca["p95_ttft_ms"] <= cb["p95_ttft_ms"] else (b, a)
    lines = [f"• your replayed traffic ({replay['schedule']['requests']} requests at {float(replay['speed']):g}x): "
             f"{engine_label(best)}, TTFT p95 {cells[best]['p95_ttft_ms']:.0f} ms vs "
             f"{cells[other]['p95_ttft_ms']:.0f} ms"]
    lines += [f"  {engine_label(e)}: {w}" for e, c in cells.items() for w in c.get("warnings") or []]
    return lines


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
        self.ab_radio = QRadioButton("Engine &A/B on one model (starts each engine in turn)")
        self.endpoint_radio = QRadioButton("The &endpoint serving now")
        self.ab_radio.setChecked(True)
        self.mode_group = QButtonGroup(self)
        self.mode_group.addButton(self.ab_radio)
        self.mode_group.addButton(self.endpoint_radio)
        self.ab_radio.toggled.connect(self._mode_changed)
        self.engine_a = QComboBox()
        self.engine_b = QComboBox()
        for box, default in ((self.engine_a, 0), (self.engine_b, 1)):
            for key, label in engine_choices():
                box.addItem(label, key)
            box.setCurrentIndex(default)
        self.engine_a.setAccessibleName("Engine A")
        self.engine_b.setAccessibleName("Engine B")
        self.model_edit = QLineEdit("demo")
        self.model_edit.setAccessibleName("Model")
        self.model_edit.setToolTip("`demo` (the same weights for both engines), or a model both engines can load")
        self.repetitions_spin = QSpinBox()
        self.repetitions_spin.setRange(1, 20)
        self.repetitions_spin.setValue(1)
        self.repetitions_spin.setToolTip("Cold starts and sweeps per engine; more repetitions show the spread")
        engines_row = QHBoxLayout()
        engines_row.addWidget(self.engine_a)
        engines_row.addWidget(QLabel("vs"))
        engines_row.addWidget(self.engine_b)
        engines_row.addWidget(QLabel("on"))
        engines_row.addWidget(self.model_edit, 1)
        engines_row.addWidget(QLabel("repetitions:"))
        engines_row.addWidget(self.repetitions_spin)
        self.ab_options = QWidget()
        self.ab_options.setLayout(engines_row)
        engines_row.setContentsMargins(0, 0, 0, 0)
        mode_row = QHBoxLayout()
        mode_row.addWidget(self.ab_radio)
        mode_row.addWidget(self.endpoint_radio)
        mode_row.addStretch(1)
        self.levels_edit = QLineEdit("1, 4, 16")
        self.levels_edit.setAccessibleName("Concurrency sweep")
        self.requests_spin = QSpinBox()
        self.requests_spin.setRange(1, 100_000)
        self.requests_spin.setValue(32)
        self.output_spin = QSpinBox()
        self.output_spin.setRange(1, 32_768)
        self.output_spin.setValue(32)
        self.replay_check = QCheckBox("&Replay it open loop after each sweep")
        self.replay_check.setToolTip("Send the endpoint's logged requests again - their arrival times and token "
                                     "lengths, bodies where captured - to both engines (`switchyard ab --replay`)")
        self.replay_since = QComboBox()
        for label, span in REPLAY_SPANS:
            self.replay_since.addItem(label, span)
        self.replay_since.setCurrentIndex(1)
        self.replay_since.setAccessibleName("Replay span")
        self.replay_speed = QDoubleSpinBox()
        self.replay_speed.setRange(0.1, 100.0)
        self.replay_speed.setValue(1.0)
        self.replay_speed.setSuffix("x")
        self.replay_speed.setAccessibleName("Replay speed")
        self.replay_speed.setToolTip("2x sends twice as fast as recorded")
        self.replay_max = QSpinBox()
        self.replay_max.setRange(0, 1_000_000)
        self.replay_max.setSpecialValueText("all")
        self.replay_max.setAccessibleName("Replay at most")
        self.replay_max.setToolTip("At most this many requests, oldest first (all: the whole span)")
        replay_row = QHBoxLayout()
        replay_row.setContentsMargins(0, 0, 0, 0)
        replay_row.addWidget(self.replay_check)
        for caption, option in (("from the", self.replay_since), ("speed", self.replay_speed),
                                ("at most", self.replay_max)):
            replay_row.addWidget(QLabel(caption))
            replay_row.addWidget(option)
        replay_row.addStretch(1)
        self.replay_options = QWidget()
        self.replay_options.setLayout(replay_row)
        self.replay_info = QLabel("")
        self.replay_info.setWordWrap(True)
        self.replay_info.setAccessibleName("Replay schedule")
        self.replay_schedule: dict[str, Any] | None = None  # the preview of what the replay sends
        self.replay_error = ""  # why there is nothing to replay (an empty log in that span)
        self._preview_key: tuple[str, int] | None = None
        self.replay_check.toggled.connect(self.refresh_replay)
        self.replay_since.currentIndexChanged.connect(self.refresh_replay)
        self.replay_max.valueChanged.connect(self.refresh_replay)
        self.replay_speed.valueChanged.connect(self._show_replay_schedule)
        self._replay_widgets(False)
        form = QFormLayout()
        form.addRow("Compare:", mode_row)
        form.addRow("Engines:", self.ab_options)
        form.addRow("&Concurrency sweep:", self.levels_edit)
        form.addRow("&Requests per level:", self.requests_spin)
        form.addRow("&Output tokens per request:", self.output_spin)
        form.addRow("Recorded traffic:", self.replay_options)
        form.addRow("", self.replay_info)

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

        # --- live charts ---
        self.board = ChartBoard(self)
        self.live_charts: dict[str, LiveChart] = {}
        charts_row = QHBoxLayout()
        for key, title, unit in LIVE_CHARTS:
            chart = self.board.add(LiveChart(title, unit, follow_time=False, symbols=True), {})
            chart.plot.getPlotItem().setLabel("bottom", "seconds into each engine's load")
            self.live_charts[key] = chart
            charts_row.addWidget(chart)

        # --- results ---
        self.results_table = _table(["Metric", "A", "B", "B / A"], "Results")
        self.verdict_label = Notice()
        self.verdict_label.setAccessibleName("Verdict")
        results_box = QGroupBox("Results")
        results_layout = QVBoxLayout(results_box)
        results_layout.addWidget(self.results_table, 1)
        self.replay_table = _table(["Replayed traffic", "A", "B", "B / A"], "Replay results")
        self.replay_table.setVisible(False)
        results_layout.addWidget(self.replay_table, 1)
        results_layout.addWidget(self.verdict_label)

        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addLayout(buttons)
        layout.addWidget(self.status_label)
        layout.addWidget(self.notice)
        layout.addLayout(charts_row, 2)
        layout.addWidget(results_box, 3)
        self.board.start()

    # --- setup ---
    def _mode_changed(self) -> None:
        self.ab_options.setEnabled(self.ab_radio.isChecked())
        self.replay_options.setEnabled(self.ab_radio.isChecked())  # a replay needs engines the A/B starts
        self.refresh_replay()

    def _replay_widgets(self, on: bool) -> None:
        for widget in (self.replay_since, self.replay_speed, self.replay_max):
            widget.setEnabled(on)
        self.replay_info.setVisible(on)

    def replaying(self) -> bool:
        return self.replay_check.isChecked() and self.ab_radio.isChecked()

    def _replay_key(self) -> tuple[str, int]:
        return str(self.replay_since.currentData()), self.replay_max.value()

    def refresh_replay(self) -> None:
        """Read what the replay would send from the request log (worker thread) and say it under the form."""
        on = self.replaying()
        self._replay_widgets(on)
        if not on:
            return
        key = self._replay_key()
        self._preview_key = key
        self.replay_schedule, self.replay_error = None, ""
        self.replay_info.setText("Reading the endpoint's request log…")
        submit(replay_preview, key[0], key[1] or None, on_finished=self._replay_read, on_error=self._replay_failed)

    def _replay_read(self, answer: dict[str, Any]) -> None:
        if tuple(answer["key"]) != self._preview_key:  # a later span or limit was asked for meanwhile
            return
        self.replay_schedule, self.replay_error = answer["schedule"], answer["error"]
        self._show_replay_schedule()

    def _replay_failed(self, message: str) -> None:  # an unreadable history file, say
        self.replay_error = message
        self._show_replay_schedule()

    def _show_replay_schedule(self) -> None:
        if self.replay_schedule is not None:
            self.replay_info.setText("Replays " + replay_summary(self.replay_schedule, self.replay_speed.value()))
        elif self.replay_error:
            self.replay_info.setText(self.replay_error)

    def job_for_inputs(self) -> dict[str, Any]:
        """The child-process job for what the form says (raises SwitchyardError on bad input)."""
        from desktop.core.common.errors import SwitchyardError

        levels = parse_levels(self.levels_edit.text())
        if self.endpoint_radio.isChecked():
            url = self.endpoint_url()
            if not url:
                raise SwitchyardError("Nothing is being served: start an engine on the Serve page first.",
                                      "or compare two engines with Engine A/B")
            return {"kind": "sweep", "base_url": url.removesuffix("/v1"), "levels": levels,
                    "requests": self.requests_spin.value(), "output_len": self.output_spin.value()}
        engines = (self.engine_a.currentData(), self.engine_b.currentData())
        if engines[0] == engines[1]:
            raise SwitchyardError("an A/B needs two different engines", "pick llama.cpp and vLLM")
        config: dict[str, Any] = {
            "model": self.model_edit.text().strip() or "demo", "engines": list(engines), "concurrency": levels,
            "repetitions": self.repetitions_spin.value(), "requests_per_level": self.requests_spin.value(),
            "output_len": self.output_spin.value()}
        if self.replaying():
            if self.replay_schedule is None and self.replay_error:
                first, _, hint = self.replay_error.partition("\nHint: ")
                raise SwitchyardError(first, hint or None)
            config["replay"] = {"since": self._replay_key()[0], "max_requests": self._replay_key()[1] or None}
            config["replay_speed"] = self.replay_speed.value()
        return {"kind": "ab", "config": config}

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
        _fill(self.results_table, [])
        _fill(self.replay_table, [])
        self.replay_table.setVisible(False)
        self.verdict_label.show_message("")
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
        headers, rows = ab_rows(result) if result.get("kind") == "ab" else sweep_rows(result)
        self.results_table.setColumnCount(len(headers))
        self.results_table.setHorizontalHeaderLabels(headers)
        _fill(self.results_table, rows)
        self.results_table.resizeColumnsToContents()
        self.results_table.resizeRowsToContents()
        self.board.tick()  # the last buckets, drawn now rather than on their chart's next turn
        replayed = result.get("kind") == "ab" and bool(result.get("replay"))
        if replayed:
            headers, rows = replay_rows(result)
            self.replay_table.setColumnCount(len(headers))
            self.replay_table.setHorizontalHeaderLabels(headers)
            _fill(self.replay_table, rows)
            self.replay_table.resizeColumnsToContents()
            self.replay_table.resizeRowsToContents()
            self.replay_table.setToolTip(replay_summary(result["replay"]["schedule"], float(result["replay"]["speed"])))
        self.replay_table.setVisible(replayed)
        self.verdict_label.show_message(verdict_text(result) if result.get("kind") == "ab" else "")
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
