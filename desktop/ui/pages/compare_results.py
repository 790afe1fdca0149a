"""The Compare page's answer: the verdict and the winner per concurrency on top, then the side-by-side table and
the replay table, each as tall as its rows (the page scrolls, a table never does: in a shared strip the results
showed three and a half rows). The better engine's figure is bold on every row, beside a Better column that names
the engine and the direction the metric wins in (throughput higher, times and memory lower).
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QFont, QResizeEvent
from PySide6.QtWidgets import (
    QAbstractItemView,
    QGroupBox,
    QHeaderView,
    QSizePolicy,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from desktop.ui.pages.compare_tables import (
    ab_rows,
    replay_rows,
    replay_summary,
    sweep_rows,
    verdict_text,
    winner_column,
)
from desktop.ui.widgets import Notice

BETTER_HEADER = "Better (tok/s, req/s: higher; s, ms, MiB: lower)"


class FittedTable(QTableWidget):
    """A read-only table whose height is its header plus every row (and the horizontal scroll bar when the
    columns are wider than the view), so no row hides behind a scroll bar."""

    def __init__(self, headers: list[str], name: str, parent: QWidget | None = None) -> None:
        super().__init__(0, len(headers), parent)
        self.setHorizontalHeaderLabels(headers)
        self.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.verticalHeader().setVisible(False)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setAccessibleName(name)
        self._wide = False  # the columns need the horizontal scroll bar (its height is added)

    def rows_height(self) -> int:
        """What the rows need: the viewport must be at least this tall."""
        return sum(self.rowHeight(r) for r in range(self.rowCount()))

    def _height(self) -> int:
        header = self.horizontalHeader()
        scroll_bar = self.horizontalScrollBar().sizeHint().height() if self._wide else 0
        return 2 * self.frameWidth() + header.sizeHint().height() + self.rows_height() + scroll_bar

    def sizeHint(self) -> QSize:
        return QSize(super().sizeHint().width(), self._height())

    def minimumSizeHint(self) -> QSize:
        return QSize(super().minimumSizeHint().width(), self._height())

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        wide = self.horizontalHeader().length() > self.viewport().width()
        if wide != self._wide:  # the scroll bar came or went: it takes height from the rows
            self._wide = wide
            self.updateGeometry()

    def fill(self, headers: list[str], rows: list[list[str]]) -> None:
        """Headers and rows; on a row with a Better column, the winning engine's figure is bold."""
        self.setColumnCount(len(headers))
        self.setHorizontalHeaderLabels([BETTER_HEADER if c == 4 and text == "Better" else text
                                        for c, text in enumerate(headers)])
        ratio = self.horizontalHeaderItem(3) if len(headers) > 4 and headers[4] == "Better" else None
        if ratio is not None:
            ratio.setToolTip(f"{headers[2]}'s figure divided by {headers[1]}'s: above 1, {headers[2]}'s is the "
                             "larger one; whether larger is better depends on the metric (the last column says it)")
        self.setRowCount(len(rows))
        bold = QFont(self.font())
        bold.setBold(True)
        for r, row in enumerate(rows):
            best = winner_column(headers, row)
            for c, value in enumerate(row):
                item = QTableWidgetItem(value)
                if c == best:
                    item.setFont(bold)
                self.setItem(r, c, item)
        self.resizeColumnsToContents()
        self.resizeRowsToContents()
        self.updateGeometry()


class CompareResults(QGroupBox):
    """The verdict lines, the results table and (after a replay) the replay table, in that order."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Results", parent)
        self.verdict_label = Notice()
        self.verdict_label.setAccessibleName("Verdict")
        self.results_table = FittedTable(["Metric", "A", "B", "B / A"], "Results")
        self.replay_table = FittedTable(["Replayed traffic", "A", "B", "B / A"], "Replay results")
        self.replay_table.setVisible(False)
        layout = QVBoxLayout(self)
        layout.addWidget(self.verdict_label)  # the answer first: the verdict and the winner per level
        layout.addWidget(self.results_table)
        layout.addWidget(self.replay_table)

    def clear(self) -> None:
        for table in (self.results_table, self.replay_table):
            table.setRowCount(0)
            table.updateGeometry()
        self.replay_table.setVisible(False)
        self.verdict_label.show_message("")
        self.setVisible(False)

    def show_result(self, result: dict[str, Any]) -> None:
        """An A/B (its verdict, both tables) or a sweep (one table) from the result's JSON."""
        ab = result.get("kind") == "ab"
        self.results_table.fill(*(ab_rows(result) if ab else sweep_rows(result)))
        replayed = ab and bool(result.get("replay"))
        if replayed:
            self.replay_table.fill(*replay_rows(result))
            self.replay_table.setToolTip(replay_summary(result["replay"]["schedule"], float(result["replay"]["speed"])))
        self.replay_table.setVisible(replayed)
        self.verdict_label.show_message(verdict_text(result) if ab else "")
        self.setVisible(True)
