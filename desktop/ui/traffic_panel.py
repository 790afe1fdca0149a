"""The Recommend page's traffic panel: the workload profile from the endpoint's request log
(desktop.core.measure.profile, what `switchyard profile` prints) and the crossover picture
(desktop.core.planning.crossover) — requests per minute over time, measured throughput and TTFT p95 against
concurrency for both engines on this machine, the workload's operating point, the crossover and the break-even
service time, each curve tagged "as measured on this machine on DATE" or "default". Thin: the numbers come from the
core; this draws them.
"""

from __future__ import annotations

import math
from typing import Any

import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import QApplication, QGroupBox, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from desktop.ui.charts import PALETTE, plot_widget
from desktop.ui.workers import submit

RATE_COLOUR = PALETTE[2]  # not an engine's colour: the rate is the traffic's, whichever engine served it


def traffic_picture(model: str, since_s: float = 7 * 86400.0) -> dict[str, Any]:
    """Profile of the last `since_s` seconds and the crossover for `model` at its p95 concurrency (worker thread)."""
    import time

    from desktop.core.engines.vllm import has_cuda
    from desktop.core.measure.profile import load_profile
    from desktop.core.planning.crossover import crossover, curves_from_history
    from desktop.core.storage.history import Store

    with Store() as store:
        profile = load_profile(store, since=time.time() - since_s)
        runs = store.runs(limit=500)
    curves = curves_from_history(runs, model, cpu=not has_cuda())
    operating = profile.concurrency.p95 if profile.concurrency is not None else None
    return {"profile": profile, "crossover": crossover(curves, operating_concurrency=operating,
                                                       operating_source="traffic")}


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def profile_facts(profile: Any) -> list[str]:
    """The profile's facts as short lines, the same figures `switchyard profile` prints."""
    from desktop.core.measure.profile import duration

    if not profile.requests:
        return []
    lines = [f"requests/min: mean {profile.mean_rpm:.2f}, peak {profile.peak_rpm:.2f} (burstiness "
             f"{_g(profile.burstiness)} peak/mean); {profile.failed} failed"]
    c = profile.concurrency
    if c is not None:
        lines.append(f"in flight: p50 {c.p50:g}, p95 {c.p95:g}, max {c.max} (busy {c.busy_share:.0%} of the time)")
    for name, stats in (("prompt tokens", profile.prompt_tokens), ("output tokens", profile.output_tokens)):
        if stats is not None:
            lines.append(f"{name}: p50 {stats.p50:g}, p95 {stats.p95:g}, max {stats.max} (log-normal "
                         f"\N{GREEK SMALL LETTER MU} {stats.lognormal_mu:.2f}, "
                         f"\N{GREEK SMALL LETTER SIGMA} {stats.lognormal_sigma:.2f})")
    if profile.lifetimes:
        life = profile.lifetime_p50_s
        per_day = f" ({profile.restarts_per_day:g}/day)" if profile.restarts_per_day is not None else ""
        lines.append(f"launches: {len(profile.lifetimes)}, restarts {profile.restarts}{per_day}, median lifetime "
                     f"{duration(life) if life is not None else '-'} (estimated)")
    if profile.shared_prefix_share is not None:
        lines.append(f"shared prefix: {profile.shared_prefix_share:.0%} of {profile.captured_bodies} captured prompts")
    else:
        lines.append("shared prefix: unknown (no captured bodies; sizes and timings are always logged)")
    return lines


def _plot(title: str, bottom: str, left: str, axis: dict[str, Any] | None = None) -> pg.PlotWidget:
    palette = QApplication.palette()
    plot = plot_widget(axisItems=axis)
    plot.setMinimumHeight(140)  # below the Recommend page's answer: the page's default height holds both
    plot.setAccessibleName(title)
    item = plot.getPlotItem()
    item.setTitle(title, color=palette.color(QPalette.ColorRole.Text))
    item.setLabel("bottom", bottom)
    item.setLabel("left", left)
    item.showGrid(x=True, y=True, alpha=0.25)
    return plot


class TrafficPanel(QGroupBox):
    """Profile summary and facts, "Use my traffic", the request-rate chart and the crossover charts."""

    use_requested = Signal(object)  # a planning.recommend.Workload from the profile

    RATE_TITLE = "Your requests per minute"
    THROUGHPUT_TITLE = "Throughput vs concurrency"
    TTFT_TITLE = "TTFT p95 vs concurrency"

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Your traffic and the crossover", parent)
        self.picture: dict[str, Any] | None = None
        self.loading = False
        self._auto = True  # with enough traffic the questions are filled from it once; edits override
        self.auto_filling = False  # while that first fill runs (nobody pressed "Use my traffic")
        self.summary = QLabel("Reading the endpoint's request log…")
        self.summary.setWordWrap(True)
        self.summary.setAccessibleName("traffic profile")
        self.facts = QLabel("")
        self.facts.setWordWrap(True)
        self.facts.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.facts.setAccessibleName("traffic profile details")
        self.verdict = QLabel("")
        self.verdict.setWordWrap(True)
        self.verdict.setAccessibleName("crossover verdict")
        self.use_button = QPushButton("&Use my traffic")
        self.use_button.setToolTip("Fill the questions from the profiled traffic; change any number to override it")
        self.use_button.setEnabled(False)
        self.use_button.clicked.connect(self.use)
        self.rate_plot = _plot(self.RATE_TITLE, "time", "requests/min",
                               axis={"bottom": pg.DateAxisItem(orientation="bottom")})
        self.plot = _plot(self.THROUGHPUT_TITLE, "concurrency (requests in flight)", "tokens/s")
        self.plot.setAccessibleName("crossover chart")
        self.ttft_plot = _plot(self.TTFT_TITLE, "concurrency (requests in flight)", "ms")
        self.legend = QLabel("")
        self.legend.setWordWrap(True)
        self.legend.setAccessibleName("crossover chart legend")
        self.rate: list[tuple[float, float]] = []  # what the rate chart shows: (bucket start, requests/min)
        self.series: dict[str, list[tuple[float, float]]] = {}  # throughput chart: engine -> (c, tok/s)
        self.ttft_series: dict[str, list[tuple[float, float]]] = {}  # TTFT chart: engine -> (c, ms)
        self.marks: dict[str, float] = {}  # "operating" / "crossover" -> concurrency
        row = QHBoxLayout()
        row.addWidget(self.summary, 1)
        row.addWidget(self.use_button)
        charts = QHBoxLayout()
        charts.addWidget(self.rate_plot, 1)
        charts.addWidget(self.plot, 1)
        charts.addWidget(self.ttft_plot, 1)
        layout = QVBoxLayout(self)
        layout.addLayout(row)
        layout.addWidget(self.facts)
        layout.addWidget(self.legend)
        layout.addWidget(self.verdict)  # the sentence before the charts it reads: on screen even when they are cut
        layout.addLayout(charts, 1)

    def refresh(self, model: str) -> None:
        self.loading = True
        submit(traffic_picture, model or "demo", on_finished=self.show_picture, on_error=self._failed)

    def _failed(self, message: str) -> None:
        self.loading = False
        self.summary.setText(f"Traffic unavailable: {message}")
        for plot in (self.rate_plot, self.plot, self.ttft_plot):  # nothing to draw: no empty charts
            plot.setVisible(False)

    def _charts_shown(self) -> None:
        self.plot.setVisible(True)

    def show_picture(self, picture: dict[str, Any]) -> None:
        self.picture = picture
        self.loading = False
        profile, x = picture["profile"], picture["crossover"]
        if profile.enough:
            self.summary.setText(f"From your traffic: {profile.summary_line()}.")
        elif profile.requests:
            from desktop.core.measure.profile import MIN_REQUESTS

            self.summary.setText(f"{profile.summary_line()} — too little traffic to replace your numbers yet "
                                 f"(it takes {MIN_REQUESTS} answered requests).")
        else:
            self.summary.setText("No traffic through the endpoint yet: the answer uses the numbers you type.")
        lines = profile_facts(profile)  # two facts a line: the charts keep the height
        self.facts.setText("\n".join("   ·   ".join(lines[i:i + 2]) for i in range(0, len(lines), 2)))
        self.facts.setVisible(bool(profile.requests))
        self.use_button.setEnabled(profile.enough)
        self._charts_shown()
        self.draw_rate(profile)
        self.draw(x)
        if profile.enough and self._auto:
            self._auto = False
            self.auto_filling = True
            try:
                self.use()
            finally:
                self.auto_filling = False

    def draw_rate(self, profile: Any) -> None:
        """Requests per minute per bucket over the profile's span (steps: each bucket's rate holds for its width)."""
        item = self.rate_plot.getPlotItem()
        item.clear()
        self.rate = [(float(t), float(rpm)) for t, rpm in profile.rate]
        self.rate_plot.setVisible(bool(self.rate))  # no traffic: no empty chart, the summary says so
        if not self.rate:
            return
        item.setLabel("bottom", f"time ({profile.bucket_s:g} s buckets)")
        xs = [t for t, _ in self.rate] + [self.rate[-1][0] + profile.bucket_s]
        ys = [rpm for _, rpm in self.rate]
        item.plot(xs, ys, stepMode="center", fillLevel=0, brush=pg.mkBrush(RATE_COLOUR + "60"),
                  pen=pg.mkPen(RATE_COLOUR, width=2))
        mean = pg.InfiniteLine(profile.mean_rpm, angle=0, pen=pg.mkPen("#888888", width=1,
                                                                        style=Qt.PenStyle.DashLine))
        item.addItem(mean)  # its figure in the title: a label on the line was drawn across the bars
        item.setTitle(f"{self.RATE_TITLE} (dashed: mean {profile.mean_rpm:.1f}/min)",
                      color=QApplication.palette().color(QPalette.ColorRole.Text))

    def draw(self, x: Any) -> None:
        """Both engines' curves on log2 concurrency (throughput and TTFT p95), the operating point and the
        crossover as vertical lines on both."""
        self.series, self.ttft_series, self.marks = {}, {}, {}
        from desktop.core.planning.basis import curve_basis, named_basis

        legend = []
        plots = (self.plot.getPlotItem(), self.ttft_plot.getPlotItem())
        for item in plots:
            item.clear()
        for index, curve in enumerate(x.curves):
            color = PALETTE[index % len(PALETTE)]
            style = Qt.PenStyle.SolidLine if curve.measured else Qt.PenStyle.DashLine
            pen = pg.mkPen(color, width=2, style=style)
            self.series[curve.engine] = [(float(p.concurrency), p.output_tok_s) for p in curve.points]
            plots[0].plot([math.log2(c) for c, _ in self.series[curve.engine]],
                          [t for _, t in self.series[curve.engine]], pen=pen, symbol="o", symbolSize=6,
                          symbolBrush=color, name=curve.engine)
            ttft = [(float(p.concurrency), p.ttft_p95_ms) for p in curve.points if p.ttft_p95_ms is not None]
            if ttft:
                self.ttft_series[curve.engine] = ttft
                plots[1].plot([math.log2(c) for c, _ in ttft], [v for _, v in ttft], pen=pen, symbol="o",
                              symbolSize=6, symbolBrush=color, name=curve.engine)
            unit = " (relative to llama.cpp = 1)" if curve.relative else ""
            cold = (f"; {named_basis(f'cold start {curve.cold_start_s:.1f} s', curve.cold_start_tag)}"
                    if curve.cold_start_s is not None else "")
            legend.append(f'<span style="color:{color}">■</span> {curve.engine}: {curve_basis(curve.tag)}{unit}{cold}')
        text = QApplication.palette().color(QPalette.ColorRole.Text)
        relative = any(c.relative for c in x.curves)
        plots[0].setTitle(self.THROUGHPUT_TITLE, color=text)
        plots[0].setLabel("left", "relative to llama.cpp" if relative else "tokens/s")
        plots[1].setTitle(self.TTFT_TITLE, color=text)
        self.ttft_plot.setVisible(bool(self.ttft_series))  # defaults have no TTFT: no empty chart
        for name, value, color in (("crossover", x.crossover_concurrency, "#888888"),
                                   ("operating", x.operating_concurrency, "#d62728")):
            if value is not None and value > 0:
                self.marks[name] = float(value)
                for item in plots:  # named in the legend below: a label on the line crossed the curves
                    item.addItem(pg.InfiniteLine(math.log2(value), angle=90, pen=pg.mkPen(color, width=1)))
                legend.append(f'<span style="color:{color}">&#9474;</span> {name} c={value:g}')
        levels = sorted({p.concurrency for c in x.curves for p in c.points})
        for item in plots:  # log2 axis, labelled in c
            item.getAxis("bottom").setTicks([[(math.log2(c), str(c)) for c in levels]])
        self.legend.setText(" · ".join(legend))
        self.verdict.setText(x.verdict)

    def use(self) -> None:
        if self.picture is not None and self.picture["profile"].enough:
            self.use_requested.emit(self.picture["profile"].workload())

