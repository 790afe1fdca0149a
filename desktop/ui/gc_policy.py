"""Python's cyclic garbage collector runs on the GUI thread only.

Why: CPython collects on whichever thread allocates when a generation fills: a thread-pool worker, the telemetry
or engine-log thread, the endpoint's event loop. A cycle that owns a Qt object (a chart, a page, a worker's
signals) is then freed there, so Qt's destructor runs off the GUI thread (or, for QWidget, is queued into the GUI
thread at any bytecode boundary, e.g. in the middle of a paint) and can deadlock on one of Qt's signal/slot
mutexes against the GUI thread (shared/reference/review/qt-threads.md). With automatic collection off and
pyqtgraph's `GarbageCollector` collecting from a GUI-thread QTimer, every cycle dies on the GUI thread. The test
configuration fails any test during which a collection starts elsewhere (tests/conftest.py).
"""

from __future__ import annotations

import gc

from pyqtgraph.util.garbage_collector import GarbageCollector
from PySide6.QtCore import QCoreApplication, QEvent

_collector: GarbageCollector | None = None


def collect_on_gui_thread(interval_s: float = 1.0) -> GarbageCollector:
    """Turn automatic collection off for the whole process and collect from a GUI-thread timer instead (each
    generation when its threshold is passed, as CPython would). Call on the GUI thread; idempotent."""
    global _collector
    if _collector is None:
        _collector = GarbageCollector(interval=interval_s)  # gc.disable(), then a QTimer on this thread
    gc.disable()  # again: whatever turned it back on meanwhile
    return _collector


def collect_now() -> int:
    """A full collection, then the deferred deletions it queued, both on the calling (GUI) thread: what a window
    close or a test's teardown does so nothing it dropped waits for another thread. Returns the objects found."""
    found = gc.collect()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
    return found
