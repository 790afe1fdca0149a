"""The Recommend page's traffic panel: the workload profile from the endpoint's request log
(desktop.core.measure.profile) and the crossover chart (desktop.core.planning.crossover) — measured throughput
against concurrency for both engines on this machine, the workload's operating point and the crossover, each curve
tagged "as measured on this machine on DATE" or "default". Thin: the numbers come from the core; this draws them.
"""

from __future__ import annotations

import math
from typing import Any

import pyqtgraph as pg
from PySide6.QtCore import Signal
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import QApplication, QGroupBox, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from desktop.ui.charts import PALETTE
from desktop.ui.workers import submit


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
    return {"profile": profile, "crossover": crossover(curves, operating_concurrency=operating)}


class TrafficPanel(QGroupBox):
    """Profile summary, "Use my traffic" and the crossover chart."""

    use_requested = Signal(object)  # a planning.recommend.Workload from the profile

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Your traffic and the crossover", parent)
        self.picture: dict[str, Any] | None = None
        self._auto = True  # with enough traffic the questions are filled from it once; edits override
        self.summary = QLabel("Reading the endpoint's request log…")
        self.summary.setWordWrap(True)
        self.summary.setAccessibleName("traffic profile")
        self.verdict = QLabel("")
        self.verdict.setWordWrap(True)
        self.verdict.setAccessibleName("crossover verdict")
        self.use_button = QPushButton("&Use my traffic")
        self.use_button.setToolTip("Fill the questions from the profiled traffic; change any number to override it")
        self.use_button.setEnabled(False)
        self.use_button.clicked.connect(self.use)
        palette = QApplication.palette()
        self.plot = pg.PlotWidget(background=palette.color(QPalette.ColorRole.Base))
        self.plot.setMinimumHeight(180)
        self.plot.setAccessibleName("crossover chart")
        item = self.plot.getPlotItem()
        item.setTitle("Output throughput vs concurrency", color=palette.color(QPalette.ColorRole.Text))
        item.setLabel("bottom", "concurrency (requests in flight)")
        item.setLabel("left", "tokens/s")
        item.showGrid(x=True, y=True, alpha=0.25)
        self.legend = QLabel("")
        self.legend.setWordWrap(True)
        self.legend.setAccessibleName("crossover chart legend")
        self.series: dict[str, list[tuple[float, float]]] = {}  # what the chart shows (engine -> points)
        self.marks: dict[str, float] = {}  # "operating" / "crossover" -> concurrency
        row = QHBoxLayout()
        row.addWidget(self.summary, 1)
        row.addWidget(self.use_button)
        layout = QVBoxLayout(self)
        layout.addLayout(row)
        layout.addWidget(self.legend)
        layout.addWidget(self.plot)
        layout.addWidget(self.verdict)

    def refresh(self, model: str) -> None:
        submit(traffic_picture, model or "demo", on_finished=self.show_picture,
               on_error=lambda message: self.summary.setText(f"Traffic unavailable: {message}"))

    def show_picture(self, picture: dict[str, Any]) -> None:
        self.picture = picture
        profile, x = picture["profile"], picture["crossover"]
        if profile.enough:
            self.summary.setText(f"From your traffic: {profile.summary_line()}. Burstiness "
                                 f"{profile.burstiness if profile.burstiness is not None else '-'} (peak/mean).")
        elif profile.requests:
            self.summary.setText(f"{profile.summary_line()} — too little traffic to replace your numbers yet.")
        else:
            self.summary.setText("No traffic through the endpoint yet: the answer uses the numbers you type.")
        self.use_button.setEnabled(profile.enough)
        self.draw(x)
        if profile.enough and self._auto:
            self._auto = False
            self.use()

    def draw(self, x: Any) -> None:
        """Both curves on log2 concurrency, the operating point and the crossover as vertical lines."""
        item = self.plot.getPlotItem()
        item.clear()
        self.series, self.marks = {}, {}
        legend = []
        for index, curve in enumerate(x.curves):
            points = [(math.log2(p.concurrency), p.output_tok_s) for p in curve.points]
            self.series[curve.engine] = [(float(p.concurrency), p.output_tok_s) for p in curve.points]
            color = PALETTE[index % len(PALETTE)]
            pen = pg.mkPen(color, width=2, style=pg.QtCore.Qt.PenStyle.SolidLine if curve.measured
                           else pg.QtCore.Qt.PenStyle.DashLine)
            item.plot([p[0] for p in points], [p[1] for p in points], pen=pen, symbol="o", symbolSize=6,
                      symbolBrush=color)
            unit = " (relative to llama.cpp = 1)" if curve.relative else ""
            legend.append(f'<span style="color:{color}">■</span> {curve.engine}: {curve.tag}{unit}')
        for name, value, color in (("crossover", x.crossover_concurrency, "#888888"),
                                   ("operating", x.operating_concurrency, "#d62728")):
            if value is not None and value > 0:
                self.marks[name] = float(value)
                item.addItem(pg.InfiniteLine(math.log2(value), angle=90, pen=pg.mkPen(color, width=1),
                                             label=f"{name} c={value:g}", labelOpts={"position": 0.9}))
        levels = sorted({p.concurrency for c in x.curves for p in c.points})
        item.getAxis("bottom").setTicks([[(math.log2(c), str(c)) for c in levels]])  # log2 axis, labelled in c
        self.legend.setText(" · ".join(legend))
        self.verdict.setText(x.verdict)

    def use(self) -> None:
        if self.picture is not None and self.picture["profile"].enough:
            self.use_requested.emit(self.picture["profile"].workload())
