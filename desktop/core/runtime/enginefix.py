"""Launch arguments this machine has taught an engine build: a start that crashed in a way the adapter knows
an argument avoids (`EngineAdapter.crash_retry`: llama-server's SIGILL in its CPU weight repack -> --no-repack)
is retried once with it, and when that start serves, the fix is stored in history (a run of kind "engine-fix",
so the History page shows it) for this engine build, model file and machine. Every later start of the same
model on the same build begins with it (`EngineProcess.start`), whichever path launches it, so it crashes once,
not on every launch. A new engine build (another version or binary) starts without it and learns again.
"""

from __future__ import annotations

import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.base import CrashRetry, EngineInstall
from desktop.core.storage.history import RunRecord, Store, machine_name

log = logging.getLogger("switchyard.enginefix")

KIND = "engine-fix"
_LOOKBACK = 200  # fixes are rare: the newest of this engine's fix rows


@dataclass(frozen=True)
class LearnedFix:
    """Arguments an earlier start of this model on this build needed, and why (the retry's own words)."""

    args: tuple[str, ...]
    why: str
    run_id: int | None = None


def _matches(run: RunRecord, engine: str, install: EngineInstall, model_path: Path) -> bool:
    return (run.engine == engine and run.machine == machine_name() and run.engine_version == install.version
            and run.settings.get("executable") == str(install.executable) and run.model == str(model_path))


def learned(engine: str, install: EngineInstall, model_path: Path, store: Store | None = None) -> LearnedFix | None:
    """The newest fix stored for `engine` at `install`'s version and binary on `model_path` here, or None.
    History trouble is no reason not to start: it is logged and the start goes on without a fix."""
    try:
        if store is not None:
            runs = store.runs(limit=_LOOKBACK, kind=KIND, engine=engine)
        else:
            with Store() as own:
                runs = own.runs(limit=_LOOKBACK, kind=KIND, engine=engine)
    except (SwitchyardError, OSError, sqlite3.Error) as exc:
        log.warning("could not read the launch fixes learned here: %s", exc)
        return None
    for run in runs:
        if _matches(run, engine, install, model_path):
            args = tuple(str(a) for a in run.settings.get("args") or ())
            return LearnedFix(args, str(run.summary.get("why") or ""), run.id) if args else None
    return None


def remember(engine: str, install: EngineInstall, model_path: Path, retry: CrashRetry, exit_code: int | None,
             store: Store | None = None) -> int | None:
    """Store that `retry`'s arguments made this model start on this build here (call once the retry serves)."""
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
