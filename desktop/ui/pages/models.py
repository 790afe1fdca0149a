"""Models: search the Hugging Face Hub, see a repo's variants with fit tags (GGUF → llama.cpp, safetensors →
vLLM), download with progress / pause / resume / cancel, and the local library (desktop.core.hub)."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from desktop.ui.widgets import Notice
from desktop.ui.workers import submit

GIB = 1024**3
FIT_LABELS = {"yes": "fits", "partial": "partial (CPU offload)", "experts-in-ram": "partial (experts in RAM)",
              "no": "won't fit", "unknown": "unknown"}


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


def local_library() -> list[Any]:
    """The models on disk plus the embedded demo model pair (always available)."""
    from desktop.core.hub import list_local
    from desktop.core.models.demo import ensure_demo_model

    demo = ensure_demo_model()
    rows: list[Any] = [
        {"name": "demo (llama.cpp)", "format": "gguf", "quantization": "F32",
         "size_bytes": demo.gguf_path.stat().st_size, "path": str(demo.gguf_path)},
        {"name": "demo (vLLM)", "format": "safetensors", "quantization": "F32",
         "size_bytes": (demo.hf_dir / "model.safetensors").stat().st_size, "path": str(demo.hf_dir)},
    ]
    for model in list_local():
        rows.append({"name": model.name, "format": model.format, "quantization": model.quantization or "",
                     "size_bytes": model.size_bytes, "path": str(model.path)})
    return rows


class ModelsPage(QWidget):
    title = "Models"

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.hits: list[Any] = []
        self.variants: Any = None
        self.control: Any = None
        self.library: list[Any] = []
        self.downloading = False

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
        self.variants_table = _table(["Variant", "Engine", "Quantization", "Size", "Fit", ""], "Variants")
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
        hub_layout.addWidget(split, 1)
        hub_layout.addLayout(download_row)
        hub_layout.addWidget(self.progress_label)

        self.library_table = _table(["Model", "Format", "Quantization", "Size", "Path"], "Local library")
        self.refresh_button = QPushButton("&Refresh library")
        self.refresh_button.clicked.connect(self.refresh_library)
        library_box = QGroupBox("On this machine")
        library_layout = QVBoxLayout(library_box)
        library_layout.addWidget(self.library_table)
        library_layout.addWidget(self.refresh_button, 0, Qt.AlignmentFlag.AlignLeft)

        self.notice = Notice()
        layout = QVBoxLayout(self)
        layout.addWidget(self.notice)
        layout.addWidget(hub_box, 3)
        layout.addWidget(library_box, 2)
        self.refresh_library()

    # --- library ---
    def refresh_library(self) -> None:
        submit(local_library, on_finished=self.show_library, on_error=lambda m: self.notice.show_message(m, "error"))

    def show_library(self, rows: list[Any]) -> None:
        self.library = rows
        from desktop.ui.widgets import quant_label

        _fill(self.library_table, [[r["name"], r["format"], quant_label(r["quantization"] or None),
                                    f"{r['size_bytes'] / GIB:.2f} GiB",
                                    r["path"]] for r in rows])

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
        _fill(self.variants_table, [[v.name, v.engine, v.quantization or v.dtype or "", f"{v.size_bytes / GIB:.2f} GiB",
                                     FIT_LABELS.get(v.fit, v.fit), "★ recommended" if v.recommended else ""]
                                    for v in variants.variants])

    # --- downloads ---
    def download(self) -> None:
        rows = self.variants_table.selectionModel().selectedRows()
        if not rows or self.variants is None:
            return
        from desktop.core.hub import DownloadControl

        variant = self.variants.variants[rows[0].row()]
        spec = f"{self.variants.repo_id}:{variant.name}"
        self.control = DownloadControl()
        self.downloading = True
        self._set_download_controls(True)
        self.progress_label.setText(f"Downloading {spec}…")
        submit(_pull, spec, self.control, on_progress=self.show_progress, on_finished=self.download_done,
               on_error=self.download_failed)

    def show_progress(self, progress: Any) -> None:
        self.progress.setRange(0, 1000)
        self.progress.setValue(int(progress.fraction * 1000))
        eta = f", {progress.eta_s:.0f} s left" if progress.eta_s else ""
        self.progress_label.setText(f"{progress.state}: {progress.done_bytes / GIB:.2f} of "
                                    f"{progress.total_bytes / GIB:.2f} GiB at {progress.speed_bps / 1024**2:.1f} MiB/s{eta}")

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
        self.progress.setValue(self.progress.maximum())
        self.progress_label.setText(f"Downloaded to {getattr(result, 'path', '')}")
        self.refresh_library()

    def download_failed(self, message: str) -> None:
        self.downloading = False
        self._set_download_controls(False)
        self.progress_label.setText(message)

    def _set_download_controls(self, active: bool) -> None:
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
