"""`switchyard gui --screenshots DIR`: drive the real window through every page with real data (hardware, the
demo model, a recommendation, llama.cpp serving, a short benchmark sweep) and save one PNG per page."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import QEventLoop
from PySide6.QtWidgets import QApplication


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    """Run the event loop until `predicate()` holds or `timeout` seconds pass."""
    app = QApplication.instance()
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 50)  # type: ignore[union-attr]
        time.sleep(0.01)
    return True


def _save(window: Any, out: Path, index: int, name: str) -> Path:
    window.show_page(name)
    wait_until(lambda: False, 0.6)  # let charts redraw and layouts settle
    path = out / f"{index}-{name.lower()}.png"
    window.grab().save(str(path))
    print(f"saved {path}", file=sys.stderr, flush=True)
    return path


def take_screenshots(window: Any, out: Path) -> None:
    try:
        _drive(window, out)
    finally:
        window.close()


def _drive(window: Any, out: Path) -> None:
    machine = window.show_page("Machine")
    wait_until(lambda: machine.snapshot is not None, 30)
    _save(window, out, 1, "Machine")

    models = window.show_page("Models")
    wait_until(lambda: bool(models.library), 60)
    _save(window, out, 2, "Models")

    recommend = window.show_page("Recommend")
    recommend.compute()
    if not wait_until(lambda: recommend.recommendation is not None or recommend.notice.level == "error", 60):
        print("the recommendation did not arrive in time", file=sys.stderr)
    _save(window, out, 3, "Recommend")

    serve = window.show_page("Serve")
    request = recommend.launch_request()
    if request is not None and request.engine != "llama.cpp":
        from dataclasses import replace

        request = replace(request, engine="llama.cpp", model="demo")
    window.launch(request or _default_request())
    if not wait_until(lambda: bool(serve.endpoint_edit.text()) or serve.notice.level == "error", 900):
        print("the engine did not become ready in time", file=sys.stderr)
    compare = window.show_page("Compare")
    if serve.endpoint_edit.text():
        compare.levels_edit.setText("1, 4")
        compare.requests_spin.setValue(12)
        compare.start()
        wait_until(lambda: not compare.running, 600)
        wait_until(lambda: serve.samples_received > 20, 20)
    _save(window, out, 4, "Serve")
    _save(window, out, 5, "Compare")
    window.show_page("History")
    _save(window, out, 6, "History")


def _default_request() -> Any:
    from desktop.ui.engine_session import LaunchRequest

    return LaunchRequest("llama.cpp", "demo")
