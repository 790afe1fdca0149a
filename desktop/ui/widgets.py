"""Small shared widgets: the cold-start phase timeline, a coloured, filterable log pane, notices, key/value grids."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import (
    QBrush,
    QColor,
    QFont,
    QGuiApplication,
    QPainter,
    QPalette,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
)
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QSizePolicy,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)


@dataclass
class StartRow:
    """One engine start on the bar: its title, its stacked phases (ColdStart.phases()) and whether it runs."""

    title: str
    phases: list[dict[str, Any]] = field(default_factory=list)
    running: bool = True
    note: str = ""  # e.g. "compile cache hit"


class PhaseTimeline(QWidget):
    """Cold starts as stacked bars, one row per start on one shared time axis (spawn at 0 s): each phase a
    segment in its colour, its duration printed inside when it fits and always in the line under the row, so
    labels never overlap. A row that is still starting grows live (its current phase is drawn hatched)."""

    ROW = 22  # bar height
    GAP = 4

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.rows: dict[object, StartRow] = {}
        self.setMinimumHeight(60)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setAccessibleName("Cold-start phase timeline")

    @property
    def phases(self) -> dict[str, float]:
        """{phase key: end seconds} of the newest start (what tests and the accessible text read)."""
        if not self.rows:
            return {}
        row = list(self.rows.values())[-1]
        return {p["phase"]: float(p["end_s"]) for p in row.phases if not p.get("running")}

    def clear(self) -> None:
        self.rows.clear()
        self._resize()
        self.update()

    def show_start(self, key: object, title: str, phases: list[dict[str, Any]], running: bool,
                   note: str = "") -> None:
        """Set (or add, below the others) the row of one start. Rows are kept to the last four starts."""
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = StartRow(title)
            while len(self.rows) > 4:
                self.rows.pop(next(iter(self.rows)))
        row.title, row.phases, row.running, row.note = title, list(phases), running, note
        text = [f"{r.title}: " + ", ".join(f"{p['label']} {p['seconds']:.2f} s" for p in r.phases)
                + (f" ({r.note})" if r.note else "") for r in self.rows.values()]
        self.setToolTip("\n".join(text))
        self.setAccessibleDescription(self.toolTip())
        self._resize()
        self.update()

    def _row_height(self) -> int:
        return self.ROW + self.fontMetrics().height() + 2 * self.GAP

    def _resize(self) -> None:
        self.setFixedHeight(max(60, 16 + len(self.rows) * self._row_height()))

    def summary(self, row: StartRow) -> str:
        """The line under a bar: every phase with its duration, then the total (or where it is now)."""
        from desktop.core.runtime.supervisor import PHASE_BY_KEY

        shorts = {key: phase.short for key, phase in PHASE_BY_KEY.items()}  # full names are in the tooltip
        parts = [f"{shorts.get(p['phase'], p['phase'])} {p['seconds']:.1f} s" + ("…" if p.get("running") else "")
                 for p in row.phases]
        total = row.phases[-1]["end_s"] if row.phases else 0.0
        tail = f"{'now' if row.running else 'total'} {total:.1f} s" + (f" · {row.note}" if row.note else "")
        return " · ".join([*parts, tail])

    def paintEvent(self, _event: object) -> None:
        from desktop.core.runtime.supervisor import COLD_START_PHASES

        painter = QPainter(self)
        palette = self.palette()
        text = palette.color(QPalette.ColorRole.WindowText)
        painter.setPen(text)
        if not self.rows:
            painter.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter,
                             "Cold-start phases appear here when an engine starts")
            return
        colors = {phase.key: QColor(phase.color) for phase in COLD_START_PHASES}
        shorts = {phase.key: phase.short for phase in COLD_START_PHASES}
        metrics = painter.fontMetrics()
        title_w = max(metrics.horizontalAdvance(r.title) for r in self.rows.values()) + 12
        left, right = 6 + title_w, self.width() - 8
        span = max(1.0, right - left)
        end = max([float(p["end_s"]) for r in self.rows.values() for p in r.phases] + [1.0])
        scale = span / end
        y = 8
        for row in self.rows.values():
            painter.setPen(text)
            painter.drawText(QRectF(4, y, title_w - 8, self.ROW), Qt.AlignmentFlag.AlignVCenter, row.title)
            for phase in row.phases:
                x0 = left + float(phase["start_s"]) * scale
                width = max(1.0, float(phase["seconds"]) * scale)
                color = colors.get(phase["phase"], QColor("#999999"))
                brush_style = Qt.BrushStyle.BDiagPattern if phase.get("running") else Qt.BrushStyle.SolidPattern
                painter.setPen(color.darker(130))
                painter.setBrush(QBrush(color, brush_style))
                painter.drawRect(QRectF(x0, y, width, self.ROW))
                inside = f"{shorts.get(phase['phase'], phase['phase'])} {phase['seconds']:.1f}s"
                if metrics.horizontalAdvance(inside) + 6 <= width:  # printed inside only where it fits
                    painter.setPen(QColor("#ffffff") if not phase.get("running") else text)
                    painter.drawText(QRectF(x0, y, width, self.ROW), Qt.AlignmentFlag.AlignCenter, inside)
            painter.setPen(text)
            line = metrics.elidedText(self.summary(row), Qt.TextElideMode.ElideRight, int(self.width() - left - 4))
            painter.drawText(QRectF(left, y + self.ROW + 2, span, metrics.height()), Qt.AlignmentFlag.AlignLeft, line)
            y += self._row_height()


class LogPane(QWidget):
    """The engine log, bounded to the newest lines: levels coloured (errors red, warnings amber, debug muted), a
    level choice and a filter box that show only matching lines, and find-as-you-type (Enter: next, Shift+Enter:
    previous)."""

    MAX_LINES = 5000
    LEVEL_CHOICES = (("All levels", "debug"), ("Info and above", "info"), ("Warnings and errors", "warning"),
                     ("Errors only", "error"))
    COLORS = {"error": "#c0392b", "warning": "#b36b00"}

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.lines: deque[tuple[str, str]] = deque(maxlen=self.MAX_LINES)  # (level, text), filtered or not
        self._previous_level = "info"
        self.shown = 0
        self.view = QPlainTextEdit()
        self.view.setReadOnly(True)
        self.view.setMaximumBlockCount(self.MAX_LINES)
        self.view.setFont(QFont("Monospace"))
        self.view.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.view.setAccessibleName("Engine log")
        self.formats = self._make_formats()
        self.level_box = QComboBox()
        for label, level in self.LEVEL_CHOICES:
            self.level_box.addItem(label, level)
        self.level_box.setAccessibleName("Log levels shown")
        self.level_box.currentIndexChanged.connect(lambda _index: self.refilter())
        self.filter_edit = QLineEdit()
        self.filter_edit.setPlaceholderText("Show only lines containing…")
        self.filter_edit.setAccessibleName("Filter the log")
        self.filter_edit.setClearButtonEnabled(True)
        self.filter_edit.textChanged.connect(lambda _text: self.refilter())
        self.search = QLineEdit()
        self.search.setPlaceholderText("Find (Enter: next, Shift+Enter: previous)")
        self.search.setAccessibleName("Search the log")
        self.search.setClearButtonEnabled(True)
        self.search.returnPressed.connect(self.find_next)
        self.search.textChanged.connect(lambda _text: self.find_next(from_start=True))
        self.status = QLabel("")
        self.count_label = QLabel("")
        self.count_label.setAccessibleName("Lines shown")
        row = QHBoxLayout()
        for caption, widget, stretch in (("Le&vels:", self.level_box, 0), ("F&ilter:", self.filter_edit, 1),
                                         ("&Find:", self.search, 1)):
            buddy = QLabel(caption)
            buddy.setBuddy(widget)
            row.addWidget(buddy)
            row.addWidget(widget, stretch)
        row.addWidget(self.status)
        row.addWidget(self.count_label)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(row)
        layout.addWidget(self.view)

    def _make_formats(self) -> dict[str, QTextCharFormat]:
        formats: dict[str, QTextCharFormat] = {}
        text = self.view.palette().color(QPalette.ColorRole.Text)
        for level in ("debug", "info", "warning", "error"):
            fmt = QTextCharFormat()
            if level in self.COLORS:
                fmt.setForeground(QColor(self.COLORS[level]))
            elif level == "debug":
                fmt.setForeground(muted(text))
            if level == "error":
                fmt.setFontWeight(QFont.Weight.Bold)
            formats[level] = fmt
        return formats

    def level_shown(self) -> str:
        return str(self.level_box.currentData())

    def _passes(self, level: str, text: str) -> bool:
        from desktop.core.engines.loglevel import at_least

        needle = self.filter_edit.text()
        return at_least(level, self.level_shown()) and (not needle or needle.lower() in text.lower())

    def append_lines(self, lines: list[str]) -> None:
        from desktop.core.engines.loglevel import line_level

        entries = []
        for text in lines:
            level = line_level(text, self._previous_level)
            self._previous_level = level
            entries.append((level, text))
        self.lines.extend(entries)
        self._render([e for e in entries if self._passes(*e)])

    def _render(self, entries: list[tuple[str, str]]) -> None:
        if entries:
            bar = self.view.verticalScrollBar()
            at_bottom = bar.value() >= bar.maximum() - 2
            cursor = QTextCursor(self.view.document())
            cursor.movePosition(QTextCursor.MoveOperation.End)
            cursor.beginEditBlock()
            for level, text in entries:
                if self.shown:
                    cursor.insertBlock()
                cursor.insertText(text, self.formats[level])
                self.shown += 1
            cursor.endEditBlock()
            if at_bottom:
                bar.setValue(bar.maximum())
        self._count()

    def _count(self) -> None:
        filtered = self.level_shown() != "debug" or bool(self.filter_edit.text())
        shown = min(self.shown, self.view.document().blockCount())
        self.count_label.setText(f"{shown} of {len(self.lines)} lines" if filtered else "")

    def refilter(self) -> None:
        """Show the kept lines again through the current level choice and filter."""
        self.view.clear()
        self.shown = 0
        self._render([e for e in self.lines if self._passes(*e)])
        if self.search.text():
            self.find_next(from_start=True)

    def find_next(self, from_start: bool = False, backward: bool | None = None) -> bool:
        needle = self.search.text()
        if not needle:
            self.status.setText("")
            return False
        if backward is None:
            backward = bool(QGuiApplication.keyboardModifiers() & Qt.KeyboardModifier.ShiftModifier)
        flags = QTextDocument.FindFlag.FindBackward if backward else QTextDocument.FindFlag(0)
        if from_start:
            self.view.moveCursor(QTextCursor.MoveOperation.Start)
        found = self.view.find(needle, flags)
        if not found:  # wrap around
            self.view.moveCursor(QTextCursor.MoveOperation.End if backward else QTextCursor.MoveOperation.Start)
            found = self.view.find(needle, flags)
        self.status.setText("" if found else "not found")
        return found

    def text_shown(self) -> str:
        return self.view.toPlainText()

    def clear(self) -> None:
        self.lines.clear()
        self._previous_level = "info"
        self.view.clear()
        self.shown = 0
        self._count()

class Notice(QLabel):
    """A readable message: info, warning or error, word-wrapped and selectable (so it can be copied)."""

    COLORS = {"info": None, "warning": "#b36b00", "error": "#c0392b"}

    def __init__(self, text: str = "", parent: QWidget | None = None) -> None:
        super().__init__(text, parent)
        self.setWordWrap(True)
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.setAccessibleName("Message")
        self.level = "info"
        self.action: str | None = None  # the step this message belongs to: it ends when that step does

    def show_message(self, text: str, level: str = "info", action: str | None = None) -> None:
        self.level = level
        self.action = action
        color = self.COLORS.get(level)
        self.setStyleSheet(f"color: {color};" if color else "")
        self.setText(text)
        self.setVisible(bool(text))


_FLOAT_NAMES = {"f32": "F32", "fp32": "F32", "float32": "F32", "float": "F32", "f16": "F16", "fp16": "F16",
                "float16": "F16", "half": "F16", "bf16": "BF16", "bfloat16": "BF16"}


def quant_label(quant: str | None, dtype: str | None = None) -> str:
    """How weights are stored, in words: a quantization as is ("Q4_K_M", "awq"); unquantized weights as their
    float type ("F32 (unquantized)") - the file's own, or the --dtype vLLM will use - never an empty label."""
    if quant and quant.lower() not in _FLOAT_NAMES:
        return quant
    name = _FLOAT_NAMES.get((quant or dtype or "").lower())
    return f"{name} (unquantized)" if name else "unquantized (the checkpoint's dtype)"


def muted(color: QColor) -> QColor:
    c = QColor(color)
    c.setAlphaF(0.6)
    return c


def size_text(n_bytes: float) -> str:
    """A size people read at a glance: "4.36 GiB", "3.8 MiB", "900 KiB" (a tiny file is not "0.00 GiB")."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.2f} {unit}" if unit == "GiB" else f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes / 1024:.0f} KiB"


FIT_LABELS = {"yes": "fits", "partial": "partial (CPU offload)", "experts-in-ram": "partial (experts in RAM)",
              "no": "won't fit", "unknown": "unknown"}
FIT_CHIPS = {"yes": ("#d9f2d9", "#1d6b1d"), "partial": ("#fcebc9", "#8a5a00"),
             "experts-in-ram": ("#fcebc9", "#8a5a00"), "no": ("#f7d6d6", "#a12020"), "unknown": ("#e6e6e6", "#555555")}


def fit_chip(item: QTableWidgetItem, fit: str) -> QTableWidgetItem:
    """Colour a fit cell like a chip (green fits, amber partial, red won't fit), so the answer reads at a glance."""
    background, foreground = FIT_CHIPS.get(fit, FIT_CHIPS["unknown"])
    item.setBackground(QColor(background))
    item.setForeground(QColor(foreground))
    item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
    return item


def fit_columns(table: QTableWidget, stretch: int = 0) -> None:
    """Columns as wide as what they hold, column `stretch` taking what is left: no name cut to "ariai"."""
    header = table.horizontalHeader()
    for column in range(table.columnCount()):
        header.setSectionResizeMode(column, QHeaderView.ResizeMode.Stretch if column == stretch
                                    else QHeaderView.ResizeMode.ResizeToContents)

