"""Create the QApplication (Fusion style, OS light/dark palette, icons) and run the main window."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

from desktop.ui import gc_policy, resources

if TYPE_CHECKING:
    from desktop.ui.main_window import MainWindow


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


def run(quit_when_ready: bool = False, with_window: Callable[[MainWindow], object] | None = None) -> int:
    """Show the main window and run the event loop. `with_window` is called with the window once the loop runs
    (`switchyard gui --screenshots` passes the screenshot driver, which closes the window when done: this module
    does not import the driver, which imports this one)."""
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
    if with_window is not None:
        QTimer.singleShot(0, lambda: with_window(window))
    return app.exec()
