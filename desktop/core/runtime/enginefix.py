"""Launch arguments this machine has taught an engine build. When a start crashes while loading in a way the
adapter knows arguments avoid (`EngineAdapter.crash_retry`: llama-server's SIGILL, or a crash at its first
multiply, in its CPU weight repack -> --no-repack), the fix is a fact of the build and this CPU, not of the model
(engines.kernels): it is stored in the build's kernel record, so every later start of *any* model on that build
here begins with it (`EngineProcess.start`), and every plan counts it; the endpoint, a plain serve and a memory
probe retry at once with it. A run of kind "engine-fix" in history says when and why (the History page shows it).
Another build (version or binary) starts without it and learns again, or the kernel probe tells it first.
"""

from __future__ import annotations

import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines import kernels
from desktop.core.engines.base import CrashRetry, EngineInstall
from desktop.core.storage.history import RunRecord, Store

log = logging.getLogger("switchyard.enginefix")

KIND = "engine-fix"


@dataclass(frozen=True)
class LearnedFix:
    """Arguments this build needs on this CPU, and why (the probe's or the retry's own words)."""

    args: tuple[str, ...]
    why: str


def learned(install: EngineInstall) -> LearnedFix | None:
    """The arguments `install` starts with on this CPU (engines.kernels: the probe's or a crash's lesson), or None.
    A record that cannot be read is no reason not to start: it is logged and the start goes on without it."""
    found = kernels.avoidance(install)
    return LearnedFix(found.args, found.why) if found else None


def remember(engine: str, install: EngineInstall, model_path: Path, retry: CrashRetry, exit_code: int | None,
             store: Store | None = None) -> int | None:
    """Store that this build needs `retry`'s arguments on this CPU (a start of `model_path` crashed without
    them): in the build's kernel record, for every model, and as a history run that says so."""
    kernels.remember(install, retry.args, retry.why, source="crash")
    record = RunRecord(kind=KIND, engine=engine, engine_version=install.version, model=str(model_path),
                       settings={"executable": str(install.executable), "args": list(retry.args)},
                       summary={"why": retry.why, "exit_code": exit_code},
                       label=f"{engine} starts with {' '.join(retry.args)} here")
    try:
        if store is not None:
            return store.add_run(record)
        with Store() as own:
            return own.add_run(record)
    except (SwitchyardError, OSError, sqlite3.Error) as exc:
        log.warning("could not store the launch fix (%s): the next start may crash once more", exc)
        return None
