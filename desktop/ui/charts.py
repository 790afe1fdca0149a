"""Live charts: preallocated numpy ring buffers, and one QTimer that redraws one visible chart per tick.

Why this shape: samples arrive from worker threads at any rate (a concurrency-64 benchmark produces hundreds a
second); appending to a preallocated buffer is O(1) and allocation-free, and redrawing at a fixed pace (not per
sample) bounds the GUI work. Painting a chart's axes costs several milliseconds (text), so each chart is
redrawn once a second (telemetry is 1 Hz anyway), hidden charts not at all, and the charts of a page take turns
on a staggered timer: one event paints one chart, never all six at once, which keeps the event loop's
worst-case delay small.
"""

from __future__ import annotations

import html
import math
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pyqtgraph as pg
from PySide6.QtCore import QObject, Qt, QTimer, Signal
from PySide6.QtGui import QPalette, QShowEvent
from PySide6.QtWidgets import QApplication, QCheckBox, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

WINDOW_S = 600.0  # the rolling window: 10 minutes
DEFAULT_CAPACITY = 4096
REDRAW_MS = 1000  # per chart

PALETTE = ("#2b8cbe", "#e6550d", "#31a354", "#756bb1", "#de2d26", "#636363")
# The smallest y span shown, per unit: a value that barely moves (KV cache at 0.3 %, RSS at 0.52 GiB) stays a flat
# line in a readable range instead of being stretched into noise with ticks like 0.5200001.
MIN_SPAN = {"%": 5.0, "GiB": 0.5, "ms": 10.0, "tokens/s": 5.0, "requests": 2.0}
DEFAULT_MIN_SPAN = 1.0


def y_range(low: float, high: float, min_span: float) -> tuple[float, float] | None:
    """The y range for data between `low` and `high`: None (let the plot fit it) when it spans at least
    `min_span`; else `min_span` centred on the data, moved up to start at 0 rather than show negative values for
    data that has none."""
    if not (math.isfinite(low) and math.isfinite(high)) or high - low >= min_span:
        return None
    middle = (low + high) / 2
    bottom, top = middle - min_span / 2, middle + min_span / 2
    if bottom < 0 <= low:
        bottom, top = 0.0, min_span
    return bottom, top


def plot_widget(**kwargs: object) -> pg.PlotWidget:
    """A pyqtgraph plot that dies with its widget, on the GUI thread: no context menus (the ViewBox's menu is
    never built), and the PlotItem's "Plot Options" menu, which pyqtgraph builds parentless and Python-owned even
    with menus off, handed to the plot widget as a Qt child so Qt destroys it there (qt-threads.md, finding 1)."""
    palette = QApplication.palette()
    plot = pg.PlotWidget(background=palette.color(QPalette.ColorRole.Base), enableMenu=False, **kwargs)
    menu = plot.getPlotItem().ctrlMenu
    if menu is not None:
        menu.setParent(plot, menu.windowFlags())  # stays a popup; owned (and deleted) by the plot widget
    return plot


class RingBuffer:
    """Fixed-capacity (t, value) series. Each value is written twice (at i and i + capacity), so the newest
    `count` points are always one contiguous slice: `view()` is zero-copy and never allocates."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._t = np.zeros(2 * capacity, dtype=np.float64)
        self._v = np.zeros(2 * capacity, dtype=np.float64)
        self._next = 0
        self.count = 0

    def append(self, t: float, value: float) -> None:
        i = self._next
        self._t[i] = self._t[i + self.capacity] = t
        self._v[i] = self._v[i + self.capacity] = value
        self._next = (i + 1) % self.capacity
        self.count = min(self.count + 1, self.capacity)

    def view(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        end = self._next + self.capacity if self.count == self.capacity else self._next
        start = end - self.count
        return self._t[start:end], self._v[start:end]

    def last(self) -> tuple[float, float] | None:
        if not self.count:
            return None
        i = (self._next - 1) % self.capacity
        return float(self._t[i]), float(self._v[i])

    def clear(self) -> None:
        self._next = 0
        self.count = 0


@dataclass
class Curve:
    key: str
    label: str
    buffer: RingBuffer
    item: pg.PlotDataItem
    dirty: bool = False
    color: str = PALETTE[0]


class LiveChart(QWidget):
    """One plot with a few named curves, a hover read-out, follow/zoom (mouse wheel, drag) and a reset button.

    x is seconds since the board started; while following, the view shows the last 10 minutes.
    """

    shown = Signal(object)  # this chart, each time it is shown: its board redraws it at once

    def __init__(self, title: str, unit: str = "", parent: QWidget | None = None, *, follow_time: bool = True,
                 symbols: bool = False, min_span: float | None = None) -> None:
        """`follow_time`: x is wall time and the view follows the last 10 minutes; without it x is whatever the
        caller pushes and the view fits the data. `symbols`: mark each point (sparse series stay visible).
        `min_span`: the smallest y range shown (default: by unit, see MIN_SPAN)."""
        super().__init__(parent)
        self.title = title
        self.min_span = min_span if min_span is not None else MIN_SPAN.get(unit, DEFAULT_MIN_SPAN)
        self.follow_time = follow_time
        self.symbols = symbols
        self.unit = unit
        self.curves: dict[str, Curve] = {}
        self.marks: list[tuple[float, str]] = []  # (seconds since the board started, label): hand-overs
        self.following = True
        self._origin = time.time()
        self._now = 0.0
        palette = QApplication.palette()  # match the OS light/dark theme (app.apply_chart_theme follows changes)
        self.plot = plot_widget()
        foreground = palette.color(QPalette.ColorRole.Text)
        self.plot.setMinimumHeight(140)
        self.plot.setAccessibleName(f"{title} chart")
        self.plot.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
        item = self.plot.getPlotItem()
        item.setTitle(title, color=foreground)
        for axis in ("left", "bottom"):
            item.getAxis(axis).setPen(foreground)
            item.getAxis(axis).setTextPen(foreground)
        item.showGrid(x=True, y=True, alpha=0.25)
        item.setLabel("bottom", "seconds")
        if unit:
            item.setLabel("left", unit)
            item.getAxis("left").enableAutoSIPrefix(False)  # "GiB (x0.001)" helps nobody: units are already scaled
        item.setClipToView(True)
        item.setDownsampling(auto=True, mode="peak")
        item.vb.setMouseEnabled(x=True, y=False)
        item.vb.sigRangeChangedManually.connect(self._user_zoomed)
        # The legend sits above the plot, never over the data it explains.
        self.legend = QLabel("")
        self.legend.setAccessibleName(f"{title} legend")
        self.legend.setWordWrap(True)
        self.readout = QLabel(" ")
        self.readout.setAccessibleName(f"{title} read-out")
        self.reset_button = QPushButton("Follow")
        self.reset_button.setToolTip("Show the last 10 minutes again after zooming")
        self.reset_button.clicked.connect(self.follow)
        header = QHBoxLayout()
        header.addWidget(self.legend, 1)
        header.addWidget(self.reset_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(header)
        layout.addWidget(self.plot)
        layout.addWidget(self.readout)
        self.plot.scene().sigMouseMoved.connect(self._hover)

    def showEvent(self, event: QShowEvent) -> None:  # hidden charts are not redrawn: catch up at once
        super().showEvent(event)
        self.shown.emit(self)

    def add_series(self, key: str, label: str, capacity: int = DEFAULT_CAPACITY) -> None:
        color = PALETTE[len(self.curves) % len(PALETTE)]
        extra = {"symbol": "o", "symbolSize": 5, "symbolBrush": color, "symbolPen": None} if self.symbols else {}
        item = self.plot.plot([], [], name=label, pen=pg.mkPen(color, width=2), **extra)
        self.curves[key] = Curve(key, label, RingBuffer(capacity), item, color=color)
        self.update_legend()

    def update_legend(self) -> None:
        """The series that have data (TPOT on an engine that reports none, or GPU memory on a machine without a
        GPU, are not named), then the dashed marks: the labels live here, never drawn over the data."""
        entries = [f'<span style="color:{curve.color}">&#9632;</span>&nbsp;{html.escape(curve.label)}'
                   for curve in self.curves.values() if curve.buffer.last() is not None]
        if self.marks:
            entries.append(f'<span style="color:#888888">&#9482;</span>&nbsp;{html.escape(self.marks[-1][1])} at '
                           f"{self.marks[-1][0]:.0f} s")
        self.legend.setText("&nbsp;&nbsp; ".join(entries))

    def set_origin(self, origin: float) -> None:
        self._origin = origin

    def mark(self, t: float, label: str) -> None:
        """A vertical line at epoch time `t` with a label (the moment a switch handed the endpoint over)."""
        line = pg.InfiniteLine(pos=t - self._origin, angle=90, movable=False,
                               pen=pg.mkPen("#888888", width=1, style=Qt.PenStyle.DashLine))
        self.plot.getPlotItem().addItem(line)
        self.marks.append((t - self._origin, label))
        self.update_legend()  # the label in the legend: on the plot it crossed the curves

    def push(self, key: str, t: float, value: float) -> bool:
        """Record a sample (t: epoch seconds, as telemetry stamps it). Cheap: no drawing here."""
        curve = self.curves.get(key)
        if curve is None or not math.isfinite(value):
            return False
        last = curve.buffer.last()
        if last is not None and t - self._origin < last[0]:
            return False  # out of order (a late sample): the plot's clip-to-view needs ascending x
        if last is None:
            curve.buffer.append(t - self._origin, value)
            self.update_legend()  # the series' first point: now it has something to name
        else:
            curve.buffer.append(t - self._origin, value)
        curve.dirty = True
        return True

    def redraw(self, now: float) -> int:
        """setData once per dirty curve; returns how many were redrawn."""
        drawn = 0
        rel_now = now - self._origin
        for curve in self.curves.values():
            if not curve.dirty:
                continue
            t, v = curve.buffer.view()
            curve.item.setData(t, v)
            curve.dirty = False
            drawn += 1
        self._now = rel_now
        if self.following and self.follow_time:
            self.plot.getPlotItem().vb.setXRange(max(0.0, rel_now - WINDOW_S), max(rel_now, 60.0), padding=0)
        if self.following and drawn:
            self._fit_y(rel_now)
        return drawn

    def _fit_y(self, rel_now: float) -> None:
        """Auto-range y, but never narrower than `min_span` (see y_range)."""
        low, high = math.inf, -math.inf
        since = rel_now - WINDOW_S if self.follow_time else -math.inf
        for curve in self.curves.values():
            t, v = curve.buffer.view()
            v = v[int(np.searchsorted(t, since)):]
            if len(v):
                low, high = min(low, float(v.min())), max(high, float(v.max()))
        vb = self.plot.getPlotItem().vb
        fixed = y_range(low, high, self.min_span)
        if fixed is None:
            vb.enableAutoRange(axis="y")
        else:
            vb.setYRange(*fixed, padding=0.05)

    def follow(self) -> None:
        self.following = True
        self.plot.getPlotItem().vb.enableAutoRange(axis="y")
        if not self.follow_time:
            self.plot.getPlotItem().vb.enableAutoRange(axis="x")
        self.redraw(time.time())
        self._fit_y(self._now)

    def _user_zoomed(self, *_: object) -> None:
        self.following = False

    def _hover(self, position: object) -> None:
        vb = self.plot.getPlotItem().vb
        if not self.plot.sceneBoundingRect().contains(position):
            return
        x = vb.mapSceneToView(position).x()
        parts = [f"t = {x:.0f} s"]
        for curve in self.curves.values():
            xs, ys = curve.item.getData()
            if xs is None or len(xs) == 0:
                continue
            i = int(np.clip(np.searchsorted(xs, x), 0, len(xs) - 1))
            parts.append(f"{curve.label}: {ys[i]:.4g}")
        self.readout.setText("  ·  ".join(parts))

    def hover_at(self, seconds: float) -> str:
        """Show the read-out for a point in time, in seconds since the start (tests use this)."""
        vb = self.plot.getPlotItem().vb
        self._hover(vb.mapViewToScene(pg.Point(seconds, 0)))
        return self.readout.text()


class ChartBoard(QObject):
    """Owns the charts of a page and the single redraw timer; routes samples by series key."""

    redrawn = Signal(int)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.charts: list[LiveChart] = []
        self.routes: dict[str, LiveChart] = {}
        self.paused = False
        self.origin = time.time()
        self._turn = 0
        self.timer = QTimer(self)
        self.timer.setInterval(REDRAW_MS)
        self.timer.timeout.connect(self._tick_next)

    def add(self, chart: LiveChart, series: dict[str, str]) -> LiveChart:
        chart.set_origin(self.origin)
        chart.shown.connect(self._redraw_shown)  # a signal, not a lambda: no chart -> lambda -> chart cycle
        for key, label in series.items():
            chart.add_series(key, label)
            self.routes[key] = chart
        self.charts.append(chart)
        self.timer.setInterval(max(50, REDRAW_MS // len(self.charts)))  # each chart once per REDRAW_MS
        return chart

    def _redraw_shown(self, chart: LiveChart) -> None:
        if not self.paused:
            chart.redraw(time.time())

    def add_series(self, chart: LiveChart, key: str, label: str) -> None:
        """A series that appears during a run (e.g. the second engine of an A/B)."""
        chart.add_series(key, label)
        self.routes[key] = chart

    def remove_all_series(self, chart: LiveChart) -> None:
        """Forget a chart's series (and their legend entries), e.g. before a new run with other engines."""
        for key, curve in list(chart.curves.items()):
            chart.plot.getPlotItem().removeItem(curve.item)
            self.routes.pop(key, None)
        chart.curves.clear()
        for item in list(chart.plot.getPlotItem().items):
            if isinstance(item, pg.InfiniteLine):  # the old run's hand-over marks go with its series
                chart.plot.getPlotItem().removeItem(item)
        chart.marks.clear()
        chart.update_legend()

    def mark(self, label: str, t: float | None = None) -> None:
        """Mark a moment (a switch's hand-over) on every chart of the board."""
        for chart in self.charts:
            chart.mark(time.time() if t is None else t, label)

    def push(self, key: str, value: float, t: float | None = None) -> bool:
        chart = self.routes.get(key)
        return chart.push(key, time.time() if t is None else t, value) if chart else False

    def start(self) -> None:
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()

    def set_paused(self, paused: bool) -> None:
        """Paused charts keep recording but stop redrawing, so the view holds still for reading."""
        self.paused = paused

    def tick(self) -> None:
        """Redraw every chart now (visible or not)."""
        if self.paused:
            return
        now = time.time()
        self.redrawn.emit(sum(chart.redraw(now) for chart in self.charts))

    def _tick_next(self) -> None:
        """The timer's turn: redraw the next visible chart only."""
        if self.paused or not self.charts:
            return
        for _ in range(len(self.charts)):
            chart = self.charts[self._turn % len(self.charts)]
            self._turn += 1
            if chart.isVisible():
                self.redrawn.emit(chart.redraw(time.time()))
                return

    def clear(self) -> None:
        for chart in self.charts:
            for curve in chart.curves.values():
                curve.buffer.clear()
                curve.dirty = True
            chart.update_legend()  # emptied series have nothing left to name


def pause_checkbox(board: ChartBoard) -> QCheckBox:
    box = QCheckBox("&Pause charts")
    box.setToolTip("Freeze the charts (samples are still recorded)")
    box.toggled.connect(board.set_paused)
    return box
