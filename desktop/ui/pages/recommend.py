"""Recommend: a few questions about the workload → engine + quantization + settings with reasons and the
runner-up (desktop.core.planning.recommend); one click launches it on the Serve page.

The answer rests on this machine's history (desktop.core.planning.evidence): each figure says whether it was
measured (run id, date) or is a default, and the memory the last launch of the model used stands next to the
fit's prediction. When defaults decide a close call, "Measure it here" runs a short A/B on the Compare page."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QDoubleSpinBox,
    QFormLayout,
    QFrame,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QSpinBox,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from desktop.ui.widgets import Notice
from desktop.ui.workers import submit

TRAFFIC_MIN_HEIGHT = 260  # the traffic and crossover charts below the answer, at the least


def compute_recommendation(model: str, concurrency: int, prompt_len: int, output_len: int,
                           lifetime_hours: float, restarts_per_day: float, use_history: bool = True) -> Any:
    from desktop.core.common.errors import SwitchyardError
    from desktop.core.machine.hardware import detect
    from desktop.core.models.facts import facts_for
    from desktop.core.planning.evidence import Evidence, gather
    from desktop.core.planning.recommend import Workload, recommend

    workload = Workload(concurrency=concurrency, prompt_len=prompt_len, output_len=output_len,
                        lifetime_hours=lifetime_hours, restarts_per_day=restarts_per_day)
    facts = facts_for(model)
    evidence = Evidence.none(facts.name)
    if use_history:
        try:
            evidence = gather(facts)
        except SwitchyardError as exc:  # a broken history file must not block the advice
            evidence = Evidence.none(facts.name, f"history unreadable ({exc.message}): default figures")
    return recommend(facts, detect(), workload, evidence=evidence)


def _numbered(ask: int, *args: Any) -> tuple[int, Any]:
    """`compute_recommendation(*args)` with the number of the ask it answers (worker thread)."""
    return ask, compute_recommendation(*args)


def figure_lines(rec: Any) -> list[str]:
    """The figures the decision used, each with where it came from (measured run or default, planning.basis)."""
    from desktop.core.planning.basis import memory_check, quality_lines

    figures = rec.numbers.get("figures") or {}
    lines = []
    for engine, fig in (figures.get("cold_start_s") or {}).items():
        lines.append(f"cold start {engine}: {fig['value']:.2f} s ({_tag(fig)})")
    for engine, fig in (figures.get("throughput_tok_s") or {}).items():
        lines.append(f"throughput {engine} at c={rec.numbers.get('concurrency')}: {fig['value']:.1f} tok/s "
                     f"({_tag(fig)})")
    for engine, fig in (figures.get("ttft_p50_ms") or {}).items():
        lines.append(f"TTFT p50 {engine} at c={rec.numbers.get('concurrency')}: {fig['value']:.0f} ms ({_tag(fig)})")
    gain = figures.get("vllm_throughput_gain")
    if gain:
        lines.append(f"vLLM / llama.cpp throughput: {gain['value']:.2f}x ({_tag(gain)})")
    for check in rec.numbers.get("memory_checks") or []:
        lines.append(memory_check(check))
    return lines + quality_lines(rec.numbers.get("quality"))



def _tag(fig: dict[str, Any]) -> str:
    from desktop.core.planning.basis import figure_basis

    return figure_basis(fig.get("source") == "measured", fig.get("run_date"), fig.get("run_id"), fig.get("note"))


class RecommendPage(QWidget):
    title = "Recommend"
    launch_requested = Signal(object)  # LaunchPlan
    measure_requested = Signal(dict)  # a Compare-page A/B job that measures the engines here

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.recommendation: Any = None
        self.asks = 0  # Recommend presses (and recomputations); the answer shown is the newest one's
        self.model_edit = QLineEdit("demo")
        self.model_edit.setToolTip("`demo`, a GGUF file, a Hugging Face folder, or a Hub repo id")
        self.concurrency = QSpinBox()
        self.concurrency.setRange(1, 4096)
        self.concurrency.setValue(4)
        self.prompt_len = QSpinBox()
        self.prompt_len.setRange(1, 1_000_000)
        self.prompt_len.setValue(512)
        self.output_len = QSpinBox()
        self.output_len.setRange(1, 1_000_000)
        self.output_len.setValue(256)
        self.lifetime = QDoubleSpinBox()
        self.lifetime.setRange(0.1, 24 * 365)
        self.lifetime.setValue(8.0)
        self.lifetime.setSuffix(" h")
        self.restarts = QDoubleSpinBox()
        self.restarts.setRange(0, 1440)
        self.restarts.setValue(0)
        self._apply_default_workload()
        form = QHBoxLayout()  # two columns of questions: the answer below gets the page's height
        for rows in ((("&Model:", self.model_edit), ("How many requests at &once at busy times?", self.concurrency),
                      ("Typical &prompt length (tokens):", self.prompt_len)),
                     (("Typical &answer length (tokens):", self.output_len),
                      ("How long does one server &live?", self.lifetime),
                      ("&Restarts or model switches per day:", self.restarts))):
            column = QFormLayout()
            for label, field in rows:
                column.addRow(label, field)
            form.addLayout(column, 1)
        self.recommend_button = QPushButton("&Recommend")
        self.recommend_button.setDefault(True)
        self.recommend_button.clicked.connect(self.compute)
        self.launch_button = QPushButton("&Launch it")
        self.launch_button.setEnabled(False)
        self.launch_button.clicked.connect(self.launch)
        buttons = QHBoxLayout()
        buttons.addWidget(self.recommend_button)
        buttons.addWidget(self.launch_button)
        self.export_button = QPushButton("E&xport…")
        self.export_button.setToolTip("The recommended plan as a shell command, docker run, Compose, Kubernetes, "
                                      "Ray or Helm")
        self.export_button.setEnabled(False)
        self.export_button.clicked.connect(lambda: self.open_export())
        buttons.addWidget(self.export_button)
        self.measure_button = QPushButton("&Measure it here")
        self.measure_button.setToolTip("A short A/B of both engines on this model here: the advice then rests "
                                       "on measurements instead of defaults")
        self.measure_button.setVisible(False)
        self.measure_button.clicked.connect(self.measure)
        buttons.addWidget(self.measure_button)
        self.measure_job: dict[str, Any] | None = None
        from desktop.ui.quality_action import QualityAction  # issue 56: measured quality for the figures

        self.notice = Notice()
        self.quality = QualityAction(lambda: self.model_edit.text().strip() or "demo", self.notice, self)
        self.quality.measured.connect(self._quality_measured)
        buttons.addWidget(self.quality.button)
        buttons.addStretch(1)
        self.traffic_button = QToolButton()
        self.traffic_button.setText("Traffic and crossover")
        self.traffic_button.setCheckable(True)
        self.traffic_button.setChecked(True)
        self.traffic_button.setToolTip("Show or hide your profiled traffic and the engines' crossover charts")
        buttons.addWidget(self.traffic_button)
        # The answer first, whole (never an inner scrollbar: it takes the height its text needs), then the traffic
        # and crossover charts in what is left; a window too small for both scrolls the page as a whole.
        self.result_box = QGroupBox("Recommendation")
        self.result_label = QLabel("Answer the questions and press Recommend.")
        self.result_label.setWordWrap(True)
        self.result_label.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.result_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        QVBoxLayout(self.result_box).addWidget(self.result_label)
        body = QWidget()
        layout = _PageLayout(body)
        layout.addLayout(form)
        layout.addLayout(buttons)
        layout.addWidget(self.notice)
        layout.addWidget(self.quality.status)
        from desktop.ui.traffic_panel import TrafficPanel  # issue 25: the profiled traffic and the crossover

        self.traffic = TrafficPanel(self)
        self.traffic.setMinimumHeight(TRAFFIC_MIN_HEIGHT)
        # The charts take the height left under the answer, never more: their own size hint would make the page
        # taller than the window and scroll it.
        self.traffic.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Ignored)
        self.traffic.use_requested.connect(self.use_traffic)
        self.traffic_button.toggled.connect(self.traffic.setVisible)
        layout.addWidget(self.result_box)
        layout.addWidget(self.traffic, 1)
        layout.addStretch(0)
        self.page_scroll = QScrollArea()
        self.page_scroll.setWidgetResizable(True)
        self.page_scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.page_scroll.setWidget(body)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(self.page_scroll)
        self.traffic.refresh(self.model_edit.text().strip())
        self.traffic_workload: Any = None  # the profile's workload while the questions still hold its numbers

    def _apply_default_workload(self) -> None:
        """Pre-fill the questions from the default workload in settings."""
        try:
            from desktop.core.storage import settings as core_settings

            workload = core_settings.load().default_workload
        except Exception:  # settings problems are shown by the settings dialog
            return
        presets = {"chat": (4, 512, 256), "long-context": (1, 16384, 512), "many-users": (32, 512, 256),
                   "batch": (64, 1024, 512)}
        concurrency, prompt, output = presets.get(workload, presets["chat"])
        self.concurrency.setValue(concurrency)
        self.prompt_len.setValue(prompt)
        self.output_len.setValue(output)

    def use_traffic(self, workload: Any) -> None:
        """Fill the questions from the profile and answer for them (the answer shown, or the one being computed,
        was for the old numbers); any number changed afterwards overrides it. The first automatic fill, before
        anything was asked, only fills the questions."""
        self.concurrency.setValue(workload.concurrency)
        self.prompt_len.setValue(workload.prompt_len)
        self.output_len.setValue(workload.output_len)
        self.lifetime.setValue(workload.lifetime_hours)
        self.restarts.setValue(workload.restarts_per_day)
        self.traffic_workload = (self.concurrency.value(), self.prompt_len.value(), self.output_len.value(),
                                 self.lifetime.value(), self.restarts.value())
        if self.asks or not self.traffic.auto_filling:
            self.compute()

    def compute(self) -> None:
        self.recommend_button.setEnabled(False)
        self.launch_button.setEnabled(False)
        self.export_button.setEnabled(False)
        self.notice.show_message("Looking at the model and this machine…")
        self.asks += 1  # only the newest ask's answer is shown: an older one still computing was for old numbers
        submit(_numbered, self.asks, self.model_edit.text().strip() or "demo", self.concurrency.value(),
               self.prompt_len.value(), self.output_len.value(), self.lifetime.value(), self.restarts.value(),
               on_finished=self._answered, on_error=self.show_error)

    def _answered(self, numbered: tuple[int, Any]) -> None:
        ask, rec = numbered
        if ask == self.asks:
            self.show_recommendation(rec)

    def show_error(self, message: str) -> None:
        self.recommend_button.setEnabled(True)
        self.notice.show_message(message, "error")

    def show_recommendation(self, rec: Any) -> None:
        self.recommendation = rec
        self.recommend_button.setEnabled(True)
        self.launch_button.setEnabled(True)
        self.export_button.setEnabled(True)
        self.notice.show_message("")
        self._offer_measurement(rec)
        settings = ", ".join(f"{k} {v}" for k, v in rec.key_settings.items() if v is not None)
        from desktop.ui.widgets import quant_label

        dtype = getattr(rec.plan, "dtype", None) if rec.plan is not None else None
        lines = [f"<h3>{rec.engine} · {_escape(quant_label(rec.quant, dtype))}</h3>", *self._traffic_line(),
                 f"<p><b>Settings:</b> {settings}</p>",
                 "<p><b>Why:</b></p><ul>" + "".join(f"<li>{_escape(r)}</li>" for r in rec.reasons) + "</ul>"]
        runner = rec.runner_up
        if runner:
            why = runner.get("why_lost") or ""
            lines.append(f"<p><b>Runner-up:</b> {runner.get('engine')} {runner.get('quant') or ''} — {_escape(why)}</p>")
        if rec.fit is not None:
            lines.append(f"<p><b>Memory:</b> {rec.fit.total_gib:.2f} GiB of {rec.fit.available_gib:.1f} GiB "
                         f"available on {rec.fit.device} ({rec.fit.fits})</p>")
        figures = figure_lines(rec)
        if figures:
            lines.append("<p><b>Figures:</b></p><ul>" + "".join(f"<li>{_escape(f)}</li>" for f in figures) + "</ul>")
        self.result_label.setText("".join(lines))
        self._fit_answer()

    def _fit_answer(self) -> None:
        """The answer's label takes the whole height its wrapped text needs at its width."""
        width = self.result_label.width()
        if width > 0:
            self.result_label.setMinimumHeight(self.result_label.heightForWidth(width))

    def resizeEvent(self, event: Any) -> None:  # noqa: N802 (Qt's name)
        super().resizeEvent(event)
        self._fit_answer()

    def answer_visible_whole(self) -> bool:
        """Whether the whole answer is on screen without scrolling: its label is as tall as its wrapped text needs,
        and it ends inside the page's viewport with the page scrolled to its top (what the GUI test checks)."""
        label = self.result_label
        needed = label.heightForWidth(label.width())
        viewport = self.page_scroll.viewport()
        bottom = label.mapTo(viewport, label.rect().bottomLeft()).y()
        return label.height() >= needed and self.page_scroll.verticalScrollBar().value() == 0 and \
            bottom <= viewport.height()

    def _traffic_line(self) -> list[str]:
        """Says the workload came from the traffic while the questions still hold the profile's numbers."""
        asked = (self.concurrency.value(), self.prompt_len.value(), self.output_len.value(), self.lifetime.value(),
                 self.restarts.value())
        picture = self.traffic.picture
        if self.traffic_workload is None or picture is None or asked != self.traffic_workload:
            return []
        return [f"<p><b>Workload:</b> {_escape(picture['profile'].summary_line())}</p>"]

    def _offer_measurement(self, rec: Any) -> None:
        """Offer a short A/B when defaults decide and the two engines are close."""
        from desktop.core.planning.evidence import measure_job

        numbers = rec.numbers
        runner = rec.runner_up or {}
        offer = bool(numbers.get("rests_on_defaults") and numbers.get("close_call") and runner.get("fits") != "no")
        self.measure_job = None
        if offer:
            model = self.model_edit.text().strip() or "demo"
            job, seconds = measure_job(model, int(numbers.get("concurrency") or 1),
                                       dict(numbers.get("cold_start_s") or {}))
            self.measure_job = job
            self.measure_button.setText(f"&Measure it here (~{max(1, round(seconds / 60))} min A/B)")
        self.measure_button.setVisible(offer)

    def _quality_measured(self, _report: Any, _run_id: int) -> None:
        """Answer again after a quality run: the figures then show it (planning.basis.quality_lines)."""
        self.compute()

    def measure(self) -> None:
        if self.measure_job is not None:
            self.measure_requested.emit(self.measure_job)

    def launch_request(self) -> Any:
        """The recommended plan as the Serve page launches it: the fit's plan, every field it checked kept as an
        ask (per-request context, slots, -ngl, KV type, util, TP), checked again by the planner when it starts."""
        from dataclasses import replace

        from desktop.core.planning.planner import asks_of

        rec = self.recommendation
        if rec is None:
            return None
        plan = rec.plan
        typed = self.model_edit.text().strip() or "demo"
        # `demo` stays `demo`: it resolves to each engine's format, so a later switch to the other engine works
        model = typed if typed == "demo" else str(plan.model_path or typed)
        return replace(plan, model=model, pinned=tuple(sorted(asks_of(plan))))

    def open_export(self, modal: bool = True) -> Any:
        """The export dialog for the recommended launch plan (tests pass modal=False and drive it)."""
        from desktop.ui.export_dialog import ExportDialog

        if self.recommendation is None:
            return None
        model = self.model_edit.text().strip()
        hub_id = model if "/" in model and not model.startswith(("/", ".", "~")) else None
        dialog = ExportDialog(self.recommendation.launch_plan(), model=hub_id, parent=self)
        if modal:
            dialog.exec()
            dialog.deleteLater()
        else:
            dialog.show()
        return dialog

    def launch(self) -> None:
        request = self.launch_request()
        if request is not None:
            self.launch_requested.emit(request)


class _PageLayout(QVBoxLayout):
    """The page's layout, telling its scroll area it has no height-for-width: the area then sizes the page by its
    minimum (the whole answer, the charts' minimum) instead of every chart's preferred height, so the page scrolls
    only in a window too small for the answer and the charts' minimum."""

    def hasHeightForWidth(self) -> bool:  # noqa: N802 (Qt's name)
        return False


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
