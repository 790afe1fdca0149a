"""Run core calls off the GUI thread: a QRunnable on the global QThreadPool whose signals report
started / progress / finished / errored back on the GUI thread.

Why: every core call may block (probing drivers, downloads, engine start), and the event loop must keep
painting. Core reports progress through plain callbacks; the worker turns each call into a Qt signal, which Qt
delivers to the receiver's (GUI) thread.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, QRunnable, QThreadPool, Signal

log = logging.getLogger("switchyard.ui.workers")


class WorkerSignals(QObject):
    started = Signal()
    progress = Signal(object)  # whatever core passed to its progress callback (ProgressEvent, Sample, ...)
    finished = Signal(object)  # the return value
    errored = Signal(str)  # a readable message, never a traceback


def readable_error(exc: BaseException) -> str:
    """What the user sees for an exception: SwitchyardError's message and hint; anything else in one line."""
    from desktop.core.errors import SwitchyardError

    if isinstance(exc, SwitchyardError):
        return exc.message + (f"\nHint: {exc.hint}" if exc.hint else "")
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").startswith("desktop.core"):
        return f"This feature is not available yet ({exc.name} is not part of this build)."
    text = str(exc).strip() or type(exc).__name__
    return f"Unexpected error: {text} ({type(exc).__name__}; details in the log)"


class Worker(QRunnable):
    """Runs `fn(*args, progress=<callback>, **kwargs)` if `with_progress`, else `fn(*args, **kwargs)`."""

    def __init__(self, fn: Callable[..., Any], *args: Any, with_progress: bool = False, **kwargs: Any) -> None:
        super().__init__()
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.with_progress = with_progress
        self.signals = WorkerSignals()
        self.setAutoDelete(True)

    def run(self) -> None:
        signals = self.signals
        signals.started.emit()
        try:
            if self.with_progress:
                result = self.fn(*self.args, progress=signals.progress.emit, **self.kwargs)
            else:
                result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a readable message
            log.debug("worker %s failed:\n%s", getattr(self.fn, "__name__", self.fn), traceback.format_exc())
            if not _is_expected(exc):
                log.warning("worker %s failed: %r", getattr(self.fn, "__name__", self.fn), exc)
            signals.errored.emit(readable_error(exc))
        else:
            signals.finished.emit(result)


def _is_expected(exc: BaseException) -> bool:
    from desktop.core.errors import SwitchyardError

    return isinstance(exc, SwitchyardError | ModuleNotFoundError)


# Workers whose signals objects must outlive the runnable until delivered (Qt deletes the runnable itself).
_live: set[WorkerSignals] = set()


def submit(
    fn: Callable[..., Any],
    *args: Any,
    on_finished: Callable[[Any], None] | None = None,
    on_error: Callable[[str], None] | None = None,
    on_progress: Callable[[Any], None] | None = None,
    on_started: Callable[[], None] | None = None,
    **kwargs: Any,
) -> Worker:
    """Start `fn` on the global thread pool and wire its signals (delivered on the GUI thread, where the
    signals object lives). `fn` gets a `progress` callback only when `on_progress` is given. Bound methods of
    widgets are disconnected by Qt when the widget is destroyed, so a closed page never gets a late callback."""
    worker = Worker(fn, *args, with_progress=on_progress is not None, **kwargs)
    signals = worker.signals
    _live.add(signals)

    def release(*_: Any) -> None:
        # No deleteLater: the worker thread may still be inside emit(); its own reference keeps the object
        # alive until run() returns, and Python frees it after the last reference goes.
        _live.discard(signals)

    if on_started:
        signals.started.connect(on_started)
    if on_progress:
        signals.progress.connect(on_progress)
    if on_finished:
        signals.finished.connect(on_finished)
    if on_error:
        signals.errored.connect(on_error)
    signals.finished.connect(release)
    signals.errored.connect(release)
    QThreadPool.globalInstance().start(worker)
    return worker


def wait_idle(timeout_ms: int = 30_000) -> bool:
    """Block until the pool has no running work (used at quit and by tests)."""
    return QThreadPool.globalInstance().waitForDone(timeout_ms)
