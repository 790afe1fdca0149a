"""Launch arguments this machine has taught an engine build. When a start crashes while loading in a way the
adapter knows arguments avoid (`EngineAdapter.crash_retry`: llama-server's SIGILL in its CPU weight repack ->
--no-repack), the supervisor stores the fix in history (a run of kind "engine-fix", so the History page shows it)
for this engine build, model file and machine; the endpoint (and a memory probe) retries at once with it. Every
later start of the same model on the same build begins with it (`EngineProcess.start`), whichever path launches
it (serve, bench, A/B, calibrate), so it crashes once, not on every launch. Another build (version or binary)
starts without it and learns again.
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
    """The arguments stored for `engine` at `install`'s version and binary on `model_path` here, or None.
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
    found = [run for run in runs if _matches(run, engine, install, model_path)]
    args: list[str] = []
    for run in reversed(found):  # oldest first: the arguments in the order they were learned
        args += [str(a) for a in run.settings.get("args") or () if str(a) not in args]
    if not args:
        return None
    return LearnedFix(tuple(args), "; ".join(dict.fromkeys(str(r.summary.get("why") or "") for r in found)),
                      found[0].id)


def remember(engine: str, install: EngineInstall, model_path: Path, retry: CrashRetry, exit_code: int | None,
             store: Store | None = None) -> int | None:
    """Store that this model on this build needs `retry`'s arguments here (its start crashed without them)."""
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
