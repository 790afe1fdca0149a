"""Progress of long work (installs, downloads, engine starts, benchmarks) as plain callbacks carrying a dataclass,
so core stays Qt-free: the GUI adapts them to signals, the CLI prints them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ProgressEvent:
    """One step of a long operation (install, download): a line of text and an optional fraction."""

    message: str
    fraction: float | None = None


ProgressCallback = Callable[[ProgressEvent], None]


def no_progress(_event: ProgressEvent) -> None:
    """Default progress sink."""
