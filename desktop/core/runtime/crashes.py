"""Why an engine process died, in words a user can act on, and what its crashes taught.

The adapter reads the log tail into a `FailureReason`; a crash while loading that the adapter knows arguments
avoid (`crash_retry`) is remembered for this engine build on this CPU (`runtime.enginefix`, engines.kernels), so
every later start here begins with them (`with_learned_fix`) and the caller retries at once. `failure` turns how the engine ended
into the `EngineFailed` that readiness raises. `supervisor.EngineProcess` calls these; nothing here holds state."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from desktop.core.common.errors import EngineFailed
from desktop.core.engines.base import CrashRetry, EngineAdapter, EngineInstall, FailureReason, LaunchPlan
from desktop.core.runtime import enginefix
from desktop.core.runtime.lifecycle import EngineOutcome

log = logging.getLogger("switchyard.supervisor")


def with_learned_fix(adapter: EngineAdapter, install: EngineInstall, plan: LaunchPlan
                     ) -> tuple[LaunchPlan, enginefix.LearnedFix | None]:
    """`plan` with the arguments this build needs on this CPU (the kernel probe's or an earlier crash's lesson,
    runtime.enginefix), and that lesson (None when there is none to add): a llama-server whose repacked kernels
    fault here starts with --no-repack, whatever the model."""
    fix = enginefix.learned(install)
    missing = tuple(a for a in fix.args if a not in plan.extra_args) if fix else ()
    if fix is None or not missing:
        return plan, None
    log.info("%s starts with %s (learned here: %s)", adapter.name, " ".join(missing), fix.why)
    return replace(plan, extra_args=(*plan.extra_args, *missing)), fix


def explain_crash(adapter: EngineAdapter, install: EngineInstall, plan: LaunchPlan, code: int | None,
                  tail: Callable[[int], list[str]], *, loading: bool) -> tuple[FailureReason, CrashRetry | None]:
    """Why the engine exited on its own (the adapter reads `tail`, the log's last lines), and the arguments that
    avoid a crash while `loading` where the adapter knows them (`crash_retry`): remembered for this build and
    CPU (every later start here begins with them; the caller retries at once), and the reason says so."""
    reason = adapter.explain_failure(code, tail(adapter.failure_tail_lines))
    if not loading:
        return reason, None
    fix = adapter.crash_retry(code, tail(400), plan)
    if fix is None:
        return reason, None
    enginefix.remember(adapter.name, install, plan.model_path, fix, code)
    return replace(reason, suggestion=f"every start of this engine build here adds {' '.join(fix.args)} from "
                                      "now on (remembered for this CPU)"), fix


def failure(adapter: EngineAdapter, outcome: EngineOutcome | None, log_path: Path) -> EngineFailed:
    """The error that says how the engine ended before it was ready, with the way on and its log."""
    reason = outcome.reason if outcome else None
    code = outcome.exit_code if outcome else None
    message = f"{adapter.display_name} stopped before it was ready"
    if reason:
        message = f"{adapter.display_name} failed: {reason.reason}"
    hint = f"{reason.suggestion}; log: {log_path}" if reason else f"exit code {code}; log: {log_path}"
    return EngineFailed(message, hint)
