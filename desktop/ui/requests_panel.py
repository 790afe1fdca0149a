"""The Serve page's request log: the requests in flight (live) above the last finished ones, with TTFT, tokens,
status and client, and the bodies of a selected request when capture is on. A thin view over the core's
RequestLog (desktop.core.serving.requestlog), redrawn when the session says the log moved."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPlainTextEdit,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from desktop.ui.widgets import muted

HEADERS = ["Time", "Model", "Engine", "Status", "Prompt", "Output", "TTFT ms", "Duration s", "Client", "Request"]
SHOWN = 200  # finished requests in the table
TICK_MS = 500  # in-flight durations tick while any request is in flight
REFRESH_MS = 250  # at most four table rebuilds a second, however fast requests arrive (a sweep sends hundreds)


def row_for(record: Any, now: float) -> list[str]:
    """One table row for a RequestRecord (in flight: status "…" and the time so far)."""
    def number(value: Any, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, (int, float)) else "–"

    in_flight = record.in_flight
    return [
        time.strftime("%H:%M:%S", time.localtime(record.t)),
        record.model or "–",
        record.engine or ("waiting" if in_flight else "–"),
        "…" if in_flight else str(record.status),
        number(record.prompt_tokens, "d"),
        number(record.output_tokens, "d"),
        number(record.ttft_s * 1000 if record.ttft_s is not None else None, ".0f"),
        number(max(0.0, now - record.t), ".1f") + " …" if in_flight else number(record.e2e_s, ".2f"),
        record.client or "–",
        f"{record.method} {record.path}",
    ]


class RequestsPanel(QWidget):
    """Requests through the endpoint. Fed by EngineSession.requests_changed (coalesced), never polled."""

    title_changed = Signal(str)  # "Requests" or "Requests (N in flight)", for the tab that holds the panel

    def __init__(self, session: Any, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.title = "Requests"
        self.records: list[Any] = []  # as shown: in flight first (newest first), then finished (newest first)
        self.table = QTableWidget(0, len(HEADERS))
        self.table.setHorizontalHeaderLabels(HEADERS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.setAccessibleName("Requests through the endpoint")
        self.table.itemSelectionChanged.connect(self._show_selected)
        self.summary = QLabel("No requests yet: they appear here as clients use the endpoint.")
        self.summary.setAccessibleName("Request summary")
        self.capture_box = QCheckBox("Capture &bodies")
        self.capture_box.setToolTip("Keep the prompts and answers of new requests in the log (off by default; "
                                    "they stay on this machine, in the history database)")
        self.capture_box.setChecked(bool(getattr(session, "capture_bodies", False)))
        self.capture_box.toggled.connect(self._capture_toggled)
        self.details = QPlainTextEdit()
        self.details.setReadOnly(True)
        self.details.setPlaceholderText("Select a request for its details (bodies only when captured)")
        self.details.setAccessibleName("Request details")
        top = QHBoxLayout()
        top.addWidget(self.summary, 1)
        top.addWidget(self.capture_box)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(top)
        split = QSplitter(Qt.Orientation.Horizontal)  # the table keeps the height; details sit beside it
        split.addWidget(self.table)
        split.addWidget(self.details)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 1)
        layout.addWidget(split, 1)
        self.ticker = QTimer(self)  # only while requests are in flight: their durations count up
        self.ticker.setInterval(TICK_MS)
        self.ticker.timeout.connect(self.refresh)
        self.pending = QTimer(self)  # coalesces bursts of requests_changed into one refresh
        self.pending.setSingleShot(True)
        self.pending.setInterval(REFRESH_MS)
        self.pending.timeout.connect(self.refresh)
        self.stale = False  # the table missed refreshes while hidden: rebuild it when shown
        session.requests_changed.connect(self._changed)

    def _changed(self) -> None:
        if not self.pending.isActive():
            self.pending.start()

    def showEvent(self, event: Any) -> None:
        super().showEvent(event)
        if self.stale:
            self.refresh()

    def refresh(self) -> None:
        inflight, finished = self.session.request_snapshot(SHOWN)
        self.stale = not self.isVisible()
        if self.stale:  # only the tab title shows: rebuilding a hidden table costs the GUI thread for nothing
            self._title(inflight)
            return
        self.records = [*reversed(inflight), *reversed(finished)]
        now = time.time()
        selected = self._selected_seq()
        self.table.setUpdatesEnabled(False)
        self.table.setRowCount(len(self.records))
        grey = muted(self.palette().text().color())
        for row, record in enumerate(self.records):
            failed = not record.in_flight and (record.failed or record.client_error)
            for column, text in enumerate(row_for(record, now)):
                item = self.table.item(row, column)
                if item is None:
                    item = QTableWidgetItem()
                    self.table.setItem(row, column, item)
                item.setText(text)
                item.setForeground(QColor("#c0392b") if failed else grey if record.in_flight
                                   else self.palette().text().color())
            if record.seq == selected:
                self.table.selectRow(row)
        self.table.setUpdatesEnabled(True)
        self._summarize(inflight, finished)
        self._title(inflight)

    def _title(self, inflight: list[Any]) -> None:
        title = f"Requests ({len(inflight)} in flight)" if inflight else "Requests"
        if title != self.title:
            self.title = title
            self.title_changed.emit(title)
        if inflight and not self.ticker.isActive():
            self.ticker.start()
        elif not inflight:
            self.ticker.stop()

    def _summarize(self, inflight: list[Any], finished: list[Any]) -> None:
        if not inflight and not finished:
            return
        ttfts = [r.ttft_s for r in finished if r.ttft_s is not None]
        failed = sum(1 for r in finished if r.failed)
        refused = sum(1 for r in finished if r.client_error)  # the client's 4xx: not a failure
        median = f", median TTFT {statistics.median(ttfts) * 1000:.0f} ms" if ttfts else ""
        self.summary.setText(f"{len(inflight)} in flight · last {len(finished)} finished{median}, {failed} failed"
                             + (f", {refused} client errors" if refused else ""))

    def _selected_seq(self) -> int | None:
        rows = self.table.selectionModel().selectedRows()
        if not rows or rows[0].row() >= len(self.records):
            return None
        return int(self.records[rows[0].row()].seq)

    def _show_selected(self) -> None:
        rows = self.table.selectionModel().selectedRows()
        if not rows or rows[0].row() >= len(self.records):
            self.details.clear()
            return
        record = self.records[rows[0].row()]
        data = {k: v for k, v in record.to_json().items() if k not in ("request_body", "response_body")}
        text = json.dumps(data, indent=1)
        if record.request_body is not None:
            text += f"\n\n▶ request\n{record.request_body}\n\n◀ response\n{record.response_body or ''}"
        self.details.setPlainText(text)

    def _capture_toggled(self, on: bool) -> None:
        try:
            self.session.set_capture_bodies(on)
        except Exception as exc:  # e.g. an endpoint with an API key: say why, and show it off
            self.capture_box.blockSignals(True)
            self.capture_box.setChecked(False)
            self.capture_box.blockSignals(False)
            self.summary.setText(str(getattr(exc, "message", exc)))

    def shutdown(self) -> None:
        self.ticker.stop()
        self.pending.stop()
