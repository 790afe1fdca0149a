"""What the Compare page runs: the form (engine A/B on one model, or the endpoint serving now; the concurrency
sweep; a replay of the recorded traffic with its preview read off the GUI thread) and the child-process job it
describes. The page composes it with the live charts and the results.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QRadioButton,
    QSpinBox,
    QWidget,
)

from desktop.ui.engine_session import engine_choices
from desktop.ui.pages.compare_tables import replay_summary
from desktop.ui.workers import submit


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


REPLAY_SPANS = (("last hour", "1h"), ("last day", "1d"), ("last 7 days", "7d"))


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


class CompareForm(QWidget):
    """The inputs of a comparison; `job_for_inputs()` turns them into the benchmark child's job."""

    def __init__(self, endpoint_url: Any, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.endpoint_url = endpoint_url  # callable: the stable endpoint's /v1 URL or None
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
        form = QFormLayout(self)
        form.setContentsMargins(0, 0, 0, 0)
        form.addRow("Compare:", mode_row)
        form.addRow("Engines:", self.ab_options)
        form.addRow("&Concurrency sweep:", self.levels_edit)
        form.addRow("&Requests per level:", self.requests_spin)
        form.addRow("&Output tokens per request:", self.output_spin)
        form.addRow("Recorded traffic:", self.replay_options)
        form.addRow("", self.replay_info)

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
