"""Models: search the Hugging Face Hub, see a repo's variants with fit tags (GGUF → llama.cpp, safetensors →
vLLM), download with progress / pause / resume / cancel, and the local library (desktop.core.hub) with Serve and
Delete (models_library.py). A finished download offers Serve now; serve_requested hands a model to the Serve page."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from desktop.core.hub.library_view import LibraryRow, delete_question, engine_for
from desktop.core.hub.names import display_name
from desktop.ui.pages.models_library import LibraryPanel, local_library  # noqa: F401 - where callers look for it
from desktop.ui.widgets import FIT_LABELS, Notice, fit_chip, fit_columns, size_text
from desktop.ui.workers import submit

GIB = 1024**3


def _table(headers: list[str], name: str) -> QTableWidget:
    table = QTableWidget(0, len(headers))
    table.setHorizontalHeaderLabels(headers)
    table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
    table.verticalHeader().setVisible(False)
    table.setAccessibleName(name)
    return table


def _fill(table: QTableWidget, rows: list[list[str]]) -> None:
    table.setRowCount(len(rows))
    for r, row in enumerate(rows):
        for c, value in enumerate(row):
            table.setItem(r, c, QTableWidgetItem(value))


class ModelsPage(QWidget):
    title = "Models"
    serve_requested = Signal(str, str)  # (model as the Serve form takes it: a path or "demo", engine)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.hits: list[Any] = []
        self.variants: Any = None
        self.control: Any = None
        self.downloading = False
        self.serve_after = False  # serve the download when it finishes (the Machine page's "Download & serve")
        self.downloaded: tuple[str, str] | None = None  # (path, engine) of the last finished download

        self.query = QLineEdit()
        self.query.setPlaceholderText("Search the Hugging Face Hub, e.g. qwen2.5 0.5b instruct")
        self.query.setAccessibleName("Hub search")
        self.query.returnPressed.connect(self.search)
        self.format_box = QComboBox()
        self.format_box.addItem("any format", None)
        for fmt in ("gguf", "safetensors", "awq", "gptq", "fp8"):
            self.format_box.addItem(fmt, fmt)
        self.format_box.setAccessibleName("Format filter")
        self.search_button = QPushButton("&Search")
        self.search_button.clicked.connect(self.search)
        search_row = QHBoxLayout()
        label = QLabel("&Find:")
        label.setBuddy(self.query)
        search_row.addWidget(label)
        search_row.addWidget(self.query, 1)
        search_row.addWidget(self.format_box)
        search_row.addWidget(self.search_button)

        self.hits_table = _table(["Repository", "Downloads", "Likes", "Formats", "Gated"], "Search results")
        self.hits_table.itemSelectionChanged.connect(self.load_variants)
        self.variants_table = _table(["Variant", "Engine", "Quantization", "Size", "Fit", "", "Mean KLD"],
                                     "Variants")
        self.download_button = QPushButton("&Download")
        self.download_button.setEnabled(False)
        self.download_button.clicked.connect(self.download)
        self.variants_table.itemSelectionChanged.connect(
            lambda: self.download_button.setEnabled(bool(self.variants_table.selectedItems()) and not self.downloading))
        self.pause_button = QPushButton("&Pause")
        self.pause_button.setCheckable(True)
        self.pause_button.toggled.connect(self.toggle_pause)
        self.cancel_button = QPushButton("&Cancel")
        self.cancel_button.clicked.connect(self.cancel)
        self.progress = QProgressBar()
        self.progress.setAccessibleName("Download progress")
        self.progress_label = QLabel("")
        self.serve_now_button = QPushButton("Serve &now")
        self.serve_now_button.setAccessibleName("Serve the downloaded model")
        self.serve_now_button.setToolTip("Open the Serve page with the model just downloaded")
        self.serve_now_button.setEnabled(False)
        self.serve_now_button.clicked.connect(self.serve_downloaded)
        label_row = QHBoxLayout()
        label_row.addWidget(self.progress_label, 1)
        label_row.addWidget(self.serve_now_button)
        download_row = QHBoxLayout()
        for widget in (self.download_button, self.pause_button, self.cancel_button):
            download_row.addWidget(widget)
        download_row.addWidget(self.progress, 1)
        self._set_download_controls(False)

        hub_box = QGroupBox("Hugging Face Hub")
        hub_layout = QVBoxLayout(hub_box)
        hub_layout.addLayout(search_row)
        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(self.hits_table)
        split.addWidget(self.variants_table)
        split.setSizes([540, 500])
        fit_columns(self.hits_table)
        fit_columns(self.variants_table, stretch=5)
        hub_layout.addWidget(split, 1)
        hub_layout.addLayout(download_row)
        hub_layout.addLayout(label_row)

        self.notice = Notice()
        self.library_box = LibraryPanel(self.notice, lambda row: self.confirm_delete(row))
        self.library_box.serve_requested.connect(self.serve_requested)
        self.library_table = self.library_box.table
        self.refresh_button = self.library_box.refresh_button

        layout = QVBoxLayout(self)
        layout.addWidget(self.notice)
        layout.addWidget(hub_box, 3)
        layout.addWidget(self.library_box, 2)
        self.refresh_library()

    # --- library ---
    @property
    def library(self) -> list[LibraryRow]:
        return self.library_box.rows

    def refresh_library(self) -> None:
        self.library_box.refresh()

    def show_library(self, rows: list[LibraryRow]) -> None:
        self.library_box.show_rows(rows)

    def confirm_delete(self, row: LibraryRow) -> bool:
        """Ask before a Delete, saying the disk it frees (tests replace this)."""
        title = "Forget this model?" if row["forget_only"] else "Delete this model?"
        answer = QMessageBox.question(self, title, delete_question(row),
                                      QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
                                      QMessageBox.StandardButton.No)
        return answer == QMessageBox.StandardButton.Yes

    # --- search ---
    def search(self) -> None:
        query = self.query.text().strip()
        if not query:
            self.notice.show_message("Type what to look for first.", "warning")
            return
        from functools import partial

        fmt = self.format_box.currentData()
        self.search_button.setEnabled(False)
        self.notice.show_message(f"Searching the Hub for “{query}”…")
        fn = partial(_search, query, [fmt] if fmt else None)
        submit(fn, on_finished=self.show_hits, on_error=self._search_failed)

    def _search_failed(self, message: str) -> None:
        self.search_button.setEnabled(True)
        self.notice.show_message(message, "error")

    def show_hits(self, hits: list[Any]) -> None:
        self.search_button.setEnabled(True)
        self.hits = hits
        self.notice.show_message("" if hits else "Nothing found: try fewer words or another format.")
        _fill(self.hits_table, [[h.repo_id, f"{h.downloads:,}", f"{h.likes:,}", ", ".join(h.formats),
                                 "yes" if h.gated else ""] for h in hits])

    def load_variants(self) -> None:
        rows = self.hits_table.selectionModel().selectedRows()
        if not rows:
            return
        repo = self.hits[rows[0].row()].repo_id
        self.notice.show_message(f"Listing the variants of {repo} and checking what fits…")
        submit(_variants, repo, on_finished=self.show_variants, on_error=lambda m: self.notice.show_message(m, "error"))

    def show_variants(self, variants: Any) -> None:
        self.variants = variants
        self.notice.show_message("")
        _fill(self.variants_table, [[v.name, v.engine, v.quantization or v.dtype or "", size_text(v.size_bytes),
                                     FIT_LABELS.get(v.fit, v.fit), "★ recommended" if v.recommended else "",
                                     f"{v.mean_kld:.4f}" if v.mean_kld is not None else ""]
                                    for v in variants.variants])
        for row, variant in enumerate(variants.variants):
            cell = self.variants_table.item(row, 4)
            if cell is not None:
                fit_chip(cell, variant.fit)
            mark = self.variants_table.item(row, 5)
            if mark is not None and variant.reason:
                mark.setToolTip(variant.reason)  # why this one: measured within the quality budget, or the bits rule

    # --- downloads ---
    def download(self) -> None:
        rows = self.variants_table.selectionModel().selectedRows()
        if not rows or self.variants is None:
            return
        variant = self.variants.variants[rows[0].row()]
        self.download_spec(f"{self.variants.repo_id}:{variant.name}")

    def download_spec(self, spec: str, serve_after: bool = False) -> None:
        """Download "org/name:VARIANT" into the Hub cache; with serve_after, serve it when it is done (the
        Machine page's "Download & serve" comes here)."""
        from desktop.core.hub import DownloadControl

        if self.downloading:
            self.notice.show_message(f"A download is running: wait for it or cancel it, then download {spec}.",
                                     "warning")
            return
        self.control = DownloadControl()
        self.downloading = True
        self.serve_after = serve_after
        self.downloaded = None
        self.serve_now_button.setEnabled(False)
        self._set_download_controls(True)
        self.progress.setValue(0)
        then = " and then serving it" if serve_after else ""
        self.progress_label.setText(f"Downloading {spec}{then}…")
        submit(_pull, spec, self.control, on_progress=self.show_progress, on_finished=self.download_done,
               on_error=self.download_failed)

    def show_progress(self, progress: Any) -> None:
        self.progress.setRange(0, 1000)
        self.progress.setValue(int(progress.fraction * 1000))
        eta = f", {progress.eta_s:.0f} s left" if progress.eta_s else ""
        self.progress_label.setText(f"{progress.state}: {size_text(progress.done_bytes)} of "
                                    f"{size_text(progress.total_bytes)} at {progress.speed_bps / 1024**2:.1f} MiB/s{eta}")

    def toggle_pause(self, paused: bool) -> None:
        if self.control is None:
            return
        if paused:
            self.control.pause()
            self.pause_button.setText("&Resume")
        else:
            self.control.resume()
            self.pause_button.setText("&Pause")

    def cancel(self) -> None:
        if self.control is not None:
            self.control.cancel()

    def download_done(self, result: Any) -> None:
        self.downloading = False
        self._set_download_controls(False)
        self.progress.setRange(0, 1000)
        self.progress.setValue(1000)
        path = str(result.path)
        self.downloaded = (path, engine_for(result.path))
        self.progress_label.setText(f"Downloaded to this machine: {display_name(path)}")
        self.progress_label.setToolTip(path)
        self.serve_now_button.setEnabled(True)
        self.refresh_library()
        if self.serve_after:
            self.serve_after = False
            self.serve_downloaded()

    def serve_downloaded(self) -> None:
        if self.downloaded is not None:
            self.serve_requested.emit(*self.downloaded)

    def download_failed(self, message: str) -> None:
        self.downloading = False
        self.serve_after = False
        self._set_download_controls(False)
        self.progress_label.setText(message)

    def _set_download_controls(self, active: bool) -> None:
        self.download_button.setEnabled(not active and bool(self.variants_table.selectedItems()))
        self.pause_button.setEnabled(active)
        self.cancel_button.setEnabled(active)
        if not active:
            self.pause_button.setChecked(False)

    def shutdown(self) -> None:
        if self.control is not None:
            self.control.cancel()


def _search(query: str, formats: list[str] | None) -> list[Any]:
    from desktop.core.hub import search

    return search(query, formats=formats, limit=30)


def _variants(repo: str) -> Any:
    from desktop.core.hub import list_variants

    return list_variants(repo)


def _pull(spec: str, control: Any, progress: Any) -> Any:
    from desktop.core.hub import pull

    return pull(spec, on_progress=progress, control=control)
