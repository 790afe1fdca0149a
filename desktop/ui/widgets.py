"""Small shared widgets: the cold-start phase timeline, a coloured, filterable log pane, notices, key/value grids."""

from __future__ import annotations

from collections import deque

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import (
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
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

PHASE_LABELS = {
    "T1_health": "health OK",
    "T2_first_token": "first token",
    "T3_first_request": "first request done",
}


class PhaseTimeline(QWidget):
    """Cold-start phases on one time axis (spawn at 0 s), labelled with their times."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.phases: dict[str, float] = {}
        self.setMinimumHeight(112)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setAccessibleName("Cold-start phase timeline")

    def clear(self) -> None:
        self.phases.clear()
        self.update()

    def add(self, phase: str, seconds: float) -> None:
        self.phases.setdefault(phase, seconds)
        self.setToolTip("\n".join(f"{PHASE_LABELS.get(k, k)}: {v:.2f} s" for k, v in self.phases.items()))
        self.setAccessibleDescription(self.toolTip())
        self.update()

    def paintEvent(self, _event: object) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        palette = self.palette()
        text = palette.color(QPalette.ColorRole.WindowText)
        accent = palette.color(QPalette.ColorRole.Highlight)
        width, height = self.width() - 20, self.height()
        axis_y = height // 2
        painter.setPen(text)
        if not self.phases:
            painter.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter, "Cold-start phases appear here when an engine starts")
            return
        end = max(max(self.phases.values()), 0.1) * 1.05
        painter.drawLine(10, axis_y, 10 + width, axis_y)
        small = QFont(self.font())
        small.setPointSizeF(max(6.0, small.pointSizeF() * 0.85))
        painter.setFont(small)
        line = painter.fontMetrics().height()
        rows = max(2, 2 * ((height // 2 - 6) // line))  # label rows that fit, alternating above and below
        right_edges = [float("-inf")] * rows
        for index, (phase, seconds) in enumerate(sorted(self.phases.items(), key=lambda kv: kv[1])):
            x = 10 + width * seconds / end
            painter.setPen(accent)
            painter.setBrush(accent)
            painter.drawEllipse(QRectF(x - 4, axis_y - 4, 8, 8))
            painter.setPen(text)
            label = f"{PHASE_LABELS.get(phase, phase).replace('_', ' ')} {seconds:.2f}s"
            text_width = painter.fontMetrics().horizontalAdvance(label) + 4
            left = min(max(0.0, x - text_width / 2), self.width() - text_width)
            # the first row (nearest the axis first) where the label does not overlap its left neighbour
            row = next((r for r in range(rows) if right_edges[r] + 4 <= left), index % rows)
            right_edges[row] = left + text_width
            level = row // 2
            y = axis_y - 6 - line * (1 + level) if row % 2 == 0 else axis_y + 6 + line * level
            painter.drawText(QRectF(left, y, text_width, line), Qt.AlignmentFlag.AlignCenter, label)


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

    def show_message(self, text: str, level: str = "info") -> None:
        self.level = level
        color = self.COLORS.get(level)
        self.setStyleSheet(f"color: {color};" if color else "")
        self.setText(text)
        self.setVisible(bool(text))


def muted(color: QColor) -> QColor:
    c = QColor(color)
    c.setAlphaF(0.6)
    return c
