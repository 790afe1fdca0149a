"""An engine's output, read on its log thread: every byte goes to a log file that rotates (`RotatingLog`); each
line, but the app's own polls, to a tail kept in memory and to subscribers; and while the engine loads, the lines
are matched against its adapter's cold-start markers, stamping the `ColdStart` phases. The reader can lag the
health poll, so it keeps matching for a while after health answered, and `EngineLog.catch_up` lets readiness
wait (briefly, on the reader's signal) for the markers printed before it. `supervisor.EngineProcess` holds one."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from desktop.core.common import private
from desktop.core.engines.base import EngineAdapter
from desktop.core.runtime.lifecycle import SERVING_PHASES, ColdStart, EngineEvent

LOG_TAIL_LINES = 2000
LOG_MAX_BYTES = 20 * 1024 * 1024  # per file; then it rotates to .1, .2, .3 (llama-server -lv 4 writes ~7 kB/request)
LOG_BACKUPS = 3


class RotatingLog:
    """An engine's log file that rotates at LOG_MAX_BYTES (keeping LOG_BACKUPS older files), so a server that
    runs for days keeps its latest lines on disk without filling it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sink = self._open()
        self._size = self._sink.tell()

    def _open(self) -> Any:
        """Append, 0600: logs hold what the engine prints (llama-server shows part of its key)."""
        return os.fdopen(private.open_private(self.path), "ab")

    def write(self, block: bytes) -> None:
        if self._size + len(block) > LOG_MAX_BYTES and self._size > 0:
            self._rotate()
        self._sink.write(block)
        self._sink.flush()
        self._size += len(block)

    def _rotate(self) -> None:
        self._sink.close()
        for index in range(LOG_BACKUPS - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{index + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        self._sink = self._open()
        self._size = 0

    def close(self) -> None:
        self._sink.close()


class EngineLog:
    """One engine's log: the file at `path`, the last LOG_TAIL_LINES lines, and the cold-start markers found in
    them (into `cold_start`, with a "phase" event each). `loading` says whether the engine still loads (markers
    are looked for then, and for 2000 lines after); `elapsed` gives seconds since the spawn."""

    def __init__(self, adapter: EngineAdapter, cold_start: ColdStart, path: Path, *, elapsed: Callable[[], float],
                 loading: Callable[[], bool], emit: Callable[[EngineEvent], None]) -> None:
        self.path = path
        self._adapter = adapter
        self._cold_start = cold_start
        self._elapsed = elapsed
        self._loading = loading
        self._emit = emit
        self._tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self._marker_lines_left = 2000
        self._marker_seen = threading.Condition()  # a marker was matched: catch_up waits on it

    def tail(self, lines: int = 200) -> list[str]:
        return list(self._tail)[-lines:]

    def copy(self, fd: int) -> None:
        """Copy the engine's output to the log file and subscribers until it closes. Reads whole blocks: under
        load an engine writes thousands of lines a second, and one write per block (not per line) keeps that
        cheap."""
        log_file = RotatingLog(self.path)
        pending = b""
        try:
            while block := os.read(fd, 65536):
                log_file.write(block)
                *lines, pending = (pending + block).split(b"\n")
                for raw in lines:
                    self._line(raw)
            if pending:
                self._line(pending)
        finally:
            log_file.close()

    def _line(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip()
        if self._adapter.is_polling_line(line):
            return  # the app's own /health, /metrics, /slots polls: kept in the file, not in the pane or tail
        self._tail.append(line)
        # Cold-start markers come before the engine serves; this thread may still be catching up on them when
        # health says ready, so it keeps looking for a while (at most a pipe buffer's worth of lines).
        if self._loading():
            self._match_markers(line)
        elif self._marker_lines_left > 0:
            self._marker_lines_left -= 1
            self._match_markers(line)
        self._emit(EngineEvent("log", line=line))

    def catch_up(self, deadline: float, exited: threading.Event) -> None:
        """Health answered; the reader thread may still hold the log lines printed before it (their markers
        stamped late, their phase events after T1). Wait, briefly and on the reader's own signal, until every
        phase this plan expects before serving has ended; a marker that never comes costs the wait until `deadline`."""
        before_serving = [key for key in self._cold_start.expected if key not in SERVING_PHASES]
        with self._marker_seen:
            while any(key not in self._cold_start.phase_ends for key in before_serving):
                left = deadline - time.monotonic()
                if left <= 0 or exited.is_set():
                    return
                self._marker_seen.wait(left)

    def _match_markers(self, line: str) -> None:
        for marker in self._adapter.log_markers:
            match = marker.match(line)
            if not match:
                continue
            seconds = round(self._elapsed(), 3)
            if self._cold_start.t1_health_s is not None:  # printed before health answered, read after it
                seconds = min(seconds, self._cold_start.t1_health_s)
            first = marker.name not in self._cold_start.markers
            self._cold_start.markers.setdefault(marker.name, seconds)
            if marker.ends and first:
                self._cold_start.end_phase(marker.ends, seconds)
            for key, value in match.groupdict().items():
                if value is not None:
                    self._cold_start.facts[f"{marker.name}.{key}"] = value
            self._emit(EngineEvent("phase", phase=marker.name, seconds=seconds))
            with self._marker_seen:
                self._marker_seen.notify_all()
