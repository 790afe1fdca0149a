"""A short probe launch that asks the engine itself how much memory a plan takes.

llama-server prints its buffer sizes only at `-v` (its INFO lines map to trace verbosity), which also logs every
request: so the app's normal launches stay quiet and a *probe* launch adds `-v --no-warmup`, waits for health,
and stops it (the per-device breakdown table is printed at shutdown). vLLM prints its memory lines at its
default verbosity; its probe is the plan as is. Used by `switchyard calibrate`, `switchyard fit --engine-check`
and benchmarks/fit_vs_engine.py, so all three read the same lines the same way (engines.memory_report).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.base import CrashRetry, EngineAdapter, EngineInstall, LaunchPlan
from desktop.core.engines.memory_report import MemoryReport, memory_lines_done, parse
from desktop.core.runtime.supervisor import EngineEvent, EngineProcess, EngineState

PROBE_ARGS = {"llama.cpp": ("-v", "--no-warmup")}  # the launch as the app makes it, plus its memory lines


@dataclass
class ProbeResult:
    """What one probe launch measured: the engine's report, how it was launched, and whether it started."""

    engine: str
    version: str
    argv: list[str]
    env: dict[str, str]
    plan: LaunchPlan
    report: MemoryReport
    started: bool
    error: str | None = None
    seconds: float = 0.0
    log_path: str | None = None
    tail: list[str] = field(default_factory=list)
    exit_code: int | None = None  # how the engine ended when it crashed while loading
    retried: str | None = None  # the first launch crashed and this one ran with the arguments that avoid it: why

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "engine": self.engine, "version": self.version, "argv": self.argv, "env": self.env,
            "plan": self.plan.to_json(), "report": self.report.to_json(), "started": self.started,
            "error": self.error, "seconds": round(self.seconds, 2), "log_path": self.log_path}
        if self.retried:
            data["retried"] = self.retried
        return data


def probe_plan(adapter: EngineAdapter, plan: LaunchPlan) -> LaunchPlan:
    extra = tuple(a for a in PROBE_ARGS.get(adapter.name, ()) if a not in plan.extra_args)
    return replace(plan, extra_args=(*plan.extra_args, *extra))


def probe(adapter: EngineAdapter, install: EngineInstall, plan: LaunchPlan, *, timeout: float = 600.0,
          log_dir: Path | None = None) -> ProbeResult:
    """Launch `plan` briefly with the engine's memory lines on, read them, stop the engine.

    A plan the engine refuses (not enough memory, a KV cache too small for one request) is a result too:
    `started` is False and `error` says why, which is what a verdict check needs. A crash the adapter knows
    arguments avoid (llama-server's SIGILL in its weight repack) is retried once with them, as the endpoint
    does (the supervisor remembers them for later starts: runtime.enginefix); `retried` says so."""
    result, fix = _probe_once(adapter, install, plan, timeout, log_dir)
    if fix is None or all(arg in plan.extra_args for arg in fix.args):
        return result
    again, _ = _probe_once(adapter, install, replace(plan, extra_args=(*plan.extra_args, *fix.args)), timeout,
                           log_dir)
    again.retried = f"the first start crashed; retried once: {fix.why}"
    return again


def _probe_once(adapter: EngineAdapter, install: EngineInstall, plan: LaunchPlan, timeout: float,
                log_dir: Path | None) -> tuple[ProbeResult, CrashRetry | None]:
    """One probe launch, and the arguments that avoid its crash when it crashed in a way the adapter knows."""
    plan = probe_plan(adapter, plan)
    lines: list[str] = []
    lock = threading.Lock()

    def listen(event: EngineEvent) -> None:
        if event.kind == "log":
            with lock:
                lines.append(event.line)

    process = EngineProcess(adapter, plan, install, log_dir=log_dir)
    process.subscribe(listen)
    started_at = time.monotonic()
    error: str | None = None
    started = False
    try:
        process.start()
        command = adapter.build_command(process.plan, install)
        process.wait_ready(timeout=timeout, first_request=False)
        started = True
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and adapter.name != "llama.cpp":  # vLLM: lines may trail health
            with lock:
                if memory_lines_done(adapter.name, lines):
                    break
            threading.Event().wait(0.1)
    except SwitchyardError as exc:
        error = f"{exc}"
        command = adapter.build_command(process.plan, install)
    finally:
        process.stop()
    with lock:
        captured = list(lines)
    report = parse(adapter.name, captured)
    env = {k: v for k, v in command.env.items() if k.startswith(("VLLM_CPU", "OMP_", "CUDA_VISIBLE"))}
    outcome = process.outcome
    crashed = not started and outcome is not None and outcome.state == EngineState.CRASHED
    result = ProbeResult(adapter.name, install.version, command.argv, env, process.plan, report, started, error,
                         time.monotonic() - started_at, str(process.log_path), captured[-40:],
                         exit_code=outcome.exit_code if crashed and outcome is not None else None)
    return result, process.crash_fix if not started else None
