"""Create the QApplication (Fusion style, OS light/dark palette, icons) and run the main window."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

from desktop.ui import gc_policy, resources


def seconds_since_process_start() -> float:
    import psutil

    return time.time() - psutil.Process().create_time()


def create_app(argv: list[str] | None = None) -> QApplication:
    existing = QApplication.instance()
    if isinstance(existing, QApplication):
        return existing
    QGuiApplication.setHighDpiScaleFactorRoundingPolicy(Qt.HighDpiScaleFactorRoundingPolicy.PassThrough)
    app = QApplication(argv if argv is not None else [sys.argv[0]])
    app.setApplicationName("Switchyard")
    app.setOrganizationName("Switchyard")
    app.setDesktopFileName("switchyard")
    app.setStyle("Fusion")  # Fusion follows the OS colour scheme (light/dark) on every platform
    app.setWindowIcon(resources.app_icon())
    app.setStyleSheet(resources.style_sheet())
    gc_policy.collect_on_gui_thread()  # cycles holding Qt objects die on this thread only (see gc_policy)
    return app


def apply_chart_theme(app: QApplication) -> None:
    """pyqtgraph draws its own background: match it to the palette, now and on every OS theme change."""
    import pyqtgraph as pg

    palette = app.palette()
    background = palette.color(QPalette.ColorRole.Base)
    foreground = palette.color(QPalette.ColorRole.Text)
    pg.setConfigOptions(background=background, foreground=foreground, antialias=False)
    for widget in app.allWidgets():
        if isinstance(widget, pg.PlotWidget):
            widget.setBackground(background)
            for axis in ("left", "bottom"):
                widget.getPlotItem().getAxis(axis).setPen(foreground)
                widget.getPlotItem().getAxis(axis).setTextPen(foreground)


def run(screenshots: Path | None = None, quit_when_ready: bool = False) -> int:
    if screenshots is not None:
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    app = create_app()
    from desktop.ui.main_window import MainWindow

    window = MainWindow()
    app.styleHints().colorSchemeChanged.connect(lambda _scheme: apply_chart_theme(app))
    window.show()
    if quit_when_ready:
        def report() -> None:
            print(f"interactive after {seconds_since_process_start():.3f} s", flush=True)
            window.close()
        QTimer.singleShot(0, report)
    if screenshots is not None:
        from desktop.ui.screenshots import take_screenshots

        QTimer.singleShot(0, lambda: take_screenshots(window, screenshots))
    return app.exec()
