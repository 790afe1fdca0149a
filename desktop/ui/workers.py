"""Run core calls off the GUI thread: a QRunnable on the global QThreadPool whose signals report
started / progress / finished / errored back on the GUI thread.

Why: every core call may block (probing drivers, downloads, engine start), and the event loop must keep
painting. Core reports progress through plain callbacks; the worker turns each call into a Qt signal, which Qt
delivers to the receiver's (GUI) thread.
"""

from __future__ import annotations

import functools
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, QRunnable, QThreadPool, Signal

log = logging.getLogger("switchyard.ui.workers")


class WorkerSignals(QObject):
    """One job's signals, created and dropped on the GUI thread; the pool thread never touches them."""

    started = Signal()
    progress = Signal(object)  # whatever core passed to its progress callback (ProgressEvent, Sample, ...)
    finished = Signal(object)  # the return value
    errored = Signal(str)  # a readable message, never a traceback


def readable_error(exc: BaseException) -> str:
    """What the user sees for an exception: SwitchyardError's message and hint; anything else in one line."""
    from desktop.core.common.errors import SwitchyardError

    if isinstance(exc, SwitchyardError):
        return exc.message + (f"\nHint: {exc.hint}" if exc.hint else "")
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").startswith("desktop.core"):
        return f"This feature is not available yet ({exc.name} is not part of this build)."
    text = str(exc).strip() or type(exc).__name__
    return f"Unexpected error: {text} ({type(exc).__name__}; details in the log)"


@dataclass
class _Job:
    """What the GUI keeps of a job until its end is delivered: its signals and the callable with its arguments,
    so their last references are dropped here on the GUI thread, never on the pool thread (qt-threads.md, 2-3)."""

    signals: WorkerSignals
    call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class _Dispatcher(QObject):
    """The one long-lived GUI-thread object workers report to: a (job id, kind, payload) posted from a pool
    thread is queued to the GUI thread, re-emitted there on that job's own signals, and the job is forgotten
    after its last report. Per-job signals keep Qt's rule that a destroyed receiver gets no late callback."""

    posted = Signal(int, str, object)

    def __init__(self) -> None:
        super().__init__()
        self.jobs: dict[int, _Job] = {}
        self._next_id = 0
        self.posted.connect(self._deliver)

    def add(self, job: _Job) -> int:
        self._next_id += 1
        self.jobs[self._next_id] = job
        return self._next_id

    def _deliver(self, job_id: int, kind: str, payload: Any) -> None:
        job = self.jobs.get(job_id)
        if job is None:
            return
        if kind == "started":
            job.signals.started.emit()
        else:
            getattr(job.signals, kind).emit(payload)
        if kind in ("finished", "errored"):
            del self.jobs[job_id]  # the job's callables and signals die here, on the GUI thread


_dispatcher: _Dispatcher | None = None


def _gui_dispatcher() -> _Dispatcher:
    """Created by the first `submit`, which runs on the GUI thread, and kept for the process's life."""
    global _dispatcher
    if _dispatcher is None:
        _dispatcher = _Dispatcher()
    return _dispatcher


def _post(dispatcher: _Dispatcher, job_id: int, kind: str, payload: Any = None) -> None:
    dispatcher.posted.emit(job_id, kind, payload)


class Worker(QRunnable):
    """Runs `fn(*args, progress=<callback>, **kwargs)` if `with_progress`, else `fn(*args, **kwargs)`, and posts
    started / progress / finished or errored to the dispatcher. Qt deletes the runnable on the pool thread, so it
    lets go of the callable and its arguments before it reports the end (the GUI's copy is then the last)."""

    def __init__(self, dispatcher: _Dispatcher, job_id: int, call: tuple[Callable[..., Any], tuple[Any, ...],
                 dict[str, Any]], *, with_progress: bool) -> None:
        super().__init__()
        self.dispatcher = dispatcher
        self.job_id = job_id
        self.call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None = call
        self.with_progress = with_progress
        self.setAutoDelete(True)

    def run(self) -> None:
        dispatcher, job_id = self.dispatcher, self.job_id
        assert self.call is not None, "a worker runs once"
        fn, args, kwargs = self.call
        self.call = None
        name = getattr(fn, "__name__", repr(fn))
        _post(dispatcher, job_id, "started")
        kind, payload = "finished", None
        try:
            if self.with_progress:
                payload = fn(*args, progress=functools.partial(_post, dispatcher, job_id, "progress"), **kwargs)
            else:
                payload = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a readable message
            log.debug("worker %s failed:\n%s", name, traceback.format_exc())
            if not _is_expected(exc):
                log.warning("worker %s failed: %r", name, exc)
            kind, payload = "errored", readable_error(exc)
        fn = args = kwargs = None  # type: ignore[assignment]  # before the end is reported (see the class)
        _post(dispatcher, job_id, kind, payload)


def _is_expected(exc: BaseException) -> bool:
    from desktop.core.common.errors import SwitchyardError

    return isinstance(exc, SwitchyardError | ModuleNotFoundError)


def submit(
    fn: Callable[..., Any],
    *args: Any,
    on_finished: Callable[[Any], None] | None = None,
    on_error: Callable[[str], None] | None = None,
    on_progress: Callable[[Any], None] | None = None,
    on_started: Callable[[], None] | None = None,
    **kwargs: Any,
) -> WorkerSignals:
    """Start `fn` on the global thread pool and wire its signals (delivered on the GUI thread). Call on the GUI
    thread. `fn` gets a `progress` callback only when `on_progress` is given. Bound methods of widgets are
    disconnected by Qt when the widget is destroyed, so a closed page never gets a late callback."""
    dispatcher = _gui_dispatcher()
    signals = WorkerSignals()
    if on_started:
        signals.started.connect(on_started)
    if on_progress:
        signals.progress.connect(on_progress)
    if on_finished:
        signals.finished.connect(on_finished)
    if on_error:
        signals.errored.connect(on_error)
    call = (fn, args, kwargs)
    job_id = dispatcher.add(_Job(signals, call))
    QThreadPool.globalInstance().start(Worker(dispatcher, job_id, call, with_progress=on_progress is not None))
    return signals


def wait_idle(timeout_ms: int = 30_000) -> bool:
    """Block until the pool has no running work (used at quit and by tests)."""
    return QThreadPool.globalInstance().waitForDone(timeout_ms)


class BenchJob(QObject):
    """A benchmark in a child process (`switchyard gui --run-job`, see desktop/core/measure/jobs.py), its JSON-line
    events turned into signals on the GUI thread.

    Why a process and not a worker thread: the load generator's asyncio loop, inside the GUI process, took the
    GIL often enough to delay painting by 150 ms at concurrency 64; the child reports about one line a second.
    """

    progress = Signal(str, object)  # message, fraction or None
    bucket = Signal(dict)  # a LiveBucket as JSON, plus "engine" and "overall" (0-1)
    finished = Signal(dict)  # {"result": ..., "report": {"json", "csv", "html"}, "run_id": ...}
    failed = Signal(str)  # readable; also when the user stopped an A/B
    ended = Signal()  # after finished/failed: the process is gone

    STDERR_KEEP = 40

    def __init__(self, job: dict[str, Any], parent: QObject | None = None) -> None:
        super().__init__(parent)
        import json

        from PySide6.QtCore import QProcess

        from desktop._frozen import self_command

        self.job = job
        self.outcome: str | None = None  # "finished" | "failed" | "cancelled"
        self._stderr: list[str] = []
        self._buffer = b""
        self.process = QProcess(self)
        command = [*self_command(), "gui", "--run-job", json.dumps(job)]
        self.process.setProgram(command[0])
        self.process.setArguments(command[1:])
        self.process.readyReadStandardOutput.connect(self._read_stdout)
        self.process.readyReadStandardError.connect(self._read_stderr)
        self.process.finished.connect(self._on_exit)
        self.process.errorOccurred.connect(self._on_process_error)

    def start(self) -> None:
        self.process.start()

    def running(self) -> bool:
        from PySide6.QtCore import QProcess

        return self.process.state() != QProcess.ProcessState.NotRunning

    def stop(self) -> None:
        """Ask the child to stop (a sweep keeps what it measured; an A/B stops its engine)."""
        if self.running():
            self.process.write(b"stop\n")

    def shutdown(self, timeout_ms: int = 60_000) -> None:
        """Stop and wait (quit path): the child stops its engine itself; kill it only if it hangs."""
        if not self.running():
            return
        self.stop()
        self.process.closeWriteChannel()
        if not self.process.waitForFinished(timeout_ms):
            log.warning("the benchmark process did not stop in time: killing it")
            self.process.kill()
            self.process.waitForFinished(5_000)

    def _read_stdout(self) -> None:
        import json

        self._buffer += bytes(self.process.readAllStandardOutput().data())
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            if not raw.strip():
                continue
            try:
                event = json.loads(raw)
            except ValueError:
                log.info("benchmark: %s", raw.decode(errors="replace"))
                continue
            self._dispatch(event)

    def _dispatch(self, event: dict[str, Any]) -> None:
        kind = event.pop("event", None)
        if kind == "progress":
            self.progress.emit(str(event.get("message", "")), event.get("fraction"))
        elif kind == "bucket":
            self.bucket.emit(event)
        elif kind == "result":
            self.outcome = "finished"
            self.finished.emit(event)
        elif kind in ("error", "cancelled"):
            self.outcome = "failed" if kind == "error" else "cancelled"
            hint = event.get("hint")
            self.failed.emit(str(event.get("message", "")) + (f"\nHint: {hint}" if hint else ""))

    def _read_stderr(self) -> None:
        text = bytes(self.process.readAllStandardError().data()).decode(errors="replace")
        for line in text.splitlines():
            log.debug("benchmark stderr: %s", line)
            self._stderr.append(line)
        del self._stderr[:-self.STDERR_KEEP]

    def _on_exit(self, code: int, _status: object) -> None:
        self._read_stdout()
        if self.outcome is None:  # died without saying why (killed, crashed interpreter)
            self.outcome = "failed"
            tail = next((line for line in reversed(self._stderr) if line.strip()), "")
            self.failed.emit(f"The benchmark process ended unexpectedly (exit code {code})"
                             + (f": {tail}" if tail else ""))
        self.ended.emit()

    def _on_process_error(self, error: object) -> None:
        from PySide6.QtCore import QProcess

        if error == QProcess.ProcessError.FailedToStart and self.outcome is None:
            self.outcome = "failed"
            self.failed.emit(f"Could not start the benchmark process: {self.process.errorString()}")
            self.ended.emit()
