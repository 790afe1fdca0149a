"""What a pull reports, and the bookkeeping behind it: each file's bytes and state, sampled into one snapshot
with speed and ETA for the progress callback (the GUI's bar, the CLI's line).

Kept apart from `desktop.core.hub.download`, which moves and verifies the bytes: the transfer only says what
happened to a file (`advance`, `set_state`, `set_done`), and this book decides what a listener hears and when.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from desktop.core.hub.variants import RemoteFile


@dataclass
class FileProgress:
    path: str
    total: int
    done: int = 0
    state: str = "queued"  # queued|downloading|retrying|paused|verifying|complete|reused|failed
    attempts: int = 0
    error: str | None = None


@dataclass
class DownloadProgress:
    """One snapshot of a pull, emitted ~10 times a second and on every state change."""

    repo_id: str
    variant: str | None
    state: str  # downloading|paused|retrying|verifying|complete|failed|cancelled
    done_bytes: int
    total_bytes: int
    speed_bps: float
    eta_s: float | None
    message: str
    files: list[FileProgress] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 1.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["fraction"] = self.fraction
        return out


ProgressCallback = Callable[[DownloadProgress], None]


class ProgressBook:
    """The files of one pull with the bytes each has (from any transfer thread), the bytes fetched and reused,
    and the samples that make speed and ETA; `emit` hands the callback a snapshot at most every 0.1 s unless
    forced (a state change always goes out)."""

    def __init__(self, repo_id: str, variant: str | None, files: Iterable[RemoteFile],
                 on_progress: ProgressCallback | None) -> None:
        self.repo_id = repo_id
        self.variant = variant
        self.on_progress = on_progress
        self.files = {f.path: FileProgress(f.path, f.size) for f in files}
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, int]] = deque(maxlen=64)
        self._last_emit = 0.0
        self.downloaded = 0
        self.reused = 0

    def _done(self) -> int:
        return sum(p.done for p in self.files.values())

    def emit(self, state: str, message: str, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            done = self._done()
            self._samples.append((now, done))
            if not force and now - self._last_emit < 0.1:
                return
            self._last_emit = now
            while len(self._samples) > 2 and now - self._samples[0][0] > 3.0:
                self._samples.popleft()
            t0, d0 = self._samples[0]
            speed = (done - d0) / (now - t0) if now - t0 > 0.05 else 0.0
            total = sum(p.total for p in self.files.values())
            eta = (total - done) / speed if speed > 0 else None
            event = DownloadProgress(
                repo_id=self.repo_id,
                variant=self.variant,
                state=state,
                done_bytes=done,
                total_bytes=total,
                speed_bps=speed,
                eta_s=eta,
                message=message,
                files=[FileProgress(**asdict(p)) for p in self.files.values()],
            )
        if self.on_progress is not None:
            self.on_progress(event)

    def advance(self, path: str, n: int) -> None:
        with self._lock:
            self.files[path].done += n
            self.downloaded += n
        if time.monotonic() - self._last_emit >= 0.1:
            self.emit("downloading", f"{self.repo_id}: {path}")

    def set_state(self, path: str, state: str, message: str, error: str | None = None) -> None:
        with self._lock:
            self.files[path].state = state
            self.files[path].error = error
        self.emit(state, message, force=True)

    def set_done(self, path: str, done: int) -> None:
        """The bytes of `path` on disk now (its partial file found, or dropped to start over)."""
        with self._lock:
            self.files[path].done = done

    def reuse(self, path: str, size: int) -> None:
        """`path` was already in the cache, whole."""
        with self._lock:
            self.files[path].done = size
            self.reused += size

    def count_attempt(self, path: str) -> None:
        with self._lock:
            self.files[path].attempts += 1
