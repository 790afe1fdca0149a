"""Every launch leaves a row in history: its cold start (T1–T3) and the memory the engine reported or used at
load. The recommender reads these rows back (desktop.core.planning.evidence): cold starts replace its defaults,
and the memory corrects the next fit for the same model on this machine.

Memory comes from what is there without slowing serving: the engine's own load lines when it prints them
(vLLM at its default verbosity: weights, KV cache, CUDA graphs; llama.cpp only at -v/-lv 4, which the app's
normal launches do not use: `switchyard calibrate` makes a short -v probe instead), and always the resident
memory of the engine's process tree once it has served a first request. The engine's lines are parsed by
engines.memory_report and stored as per-component calibration points (planning.calibration) next to the fit's
prediction for the launched plan, keyed by this machine's accelerator set.
"""

from __future__ import annotations

import logging
from typing import Any

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.memory_report import MemoryReport, parse
from desktop.core.runtime.proctree import tree_rss
from desktop.core.runtime.supervisor import LOG_TAIL_LINES, EngineProcess
from desktop.core.storage.history import MemoryPoint, RunRecord, Store

log = logging.getLogger("switchyard.launches")

GIB = 1024**3
# Log-marker facts (see the adapters' log_markers) that are memory, and what part of the fit they measure.
MEMORY_FACTS = {
    "model_buffer.mib": ("weights_gib", 1 / 1024),
    "kv_buffer.mib": ("kv_cache_gib", 1 / 1024),
    "compute_buffer.mib": ("compute_gib", 1 / 1024),
    "model_loading.gib": ("weights_gib", 1.0),
    "kv_memory.gib": ("kv_cache_gib", 1.0),
    "activation_peak.gib": ("activation_gib", 1.0),
    "graph_capture.gib": ("cuda_graphs_gib", 1.0),
}


def tree_rss_gib(pid: int | None) -> float | None:
    """Resident memory of a process tree (proctree.tree_rss), in GiB; None when gone or nothing resident."""
    total = tree_rss(pid)
    return round(total / GIB, 3) if total else None


def load_memory(facts: dict[str, str], rss_gib: float | None) -> dict[str, Any]:
    """The measured memory of one launch: parts from log facts, and the process tree's RSS after load."""
    out: dict[str, Any] = {}
    for key, (name, scale) in MEMORY_FACTS.items():
        raw = facts.get(key)
        if raw is None:
            continue
        try:
            out[name] = round(float(str(raw).replace(",", "")) * scale, 3)
        except ValueError:
            continue
    if facts.get("kv_tokens.tokens"):
        try:
            out["kv_cache_tokens"] = int(str(facts["kv_tokens.tokens"]).replace(",", ""))
        except ValueError:
            pass
    if rss_gib is not None:
        out["rss_gib"] = rss_gib
    return out


def engine_report(process: EngineProcess) -> MemoryReport:
    """The engine's own memory lines from this launch's log (engines.memory_report): vLLM prints them at its
    default verbosity; llama-server only at -v, so its normal launches usually yield an empty report."""
    return parse(process.adapter.name, process.log_tail(LOG_TAIL_LINES))


def launch_record(process: EngineProcess, model: str, source: str = "serve") -> RunRecord:
    """The history row for a launch that is ready now (call right after `wait_ready`)."""
    cold = process.cold_start
    memory = load_memory(cold.facts, tree_rss_gib(process.pid))
    report = engine_report(process)
    if not report.empty():
        memory["engine_report"] = {**report.summary_gib(), "lines": report.lines}
    summary = {"cold_start": cold.to_json(), "load_memory": memory, "source": source}
    return RunRecord(kind="launch", engine=process.adapter.name, engine_version=process.install.version,
                     model=model, settings=process.plan.to_json(), summary=summary,
                     label=f"launch {process.adapter.name} ({source})")


def memory_points(process: EngineProcess, model: str, run_id: int | None,
                  report: MemoryReport | None = None) -> list[MemoryPoint]:
    """The launch's engine-reported memory next to what the fit predicts for its plan, one row per component:
    the same rows `switchyard calibrate` stores, so every launch corrects the next fit on these accelerators."""
    from desktop.core.machine.hardware import detect
    from desktop.core.models.facts import facts_from_path
    from desktop.core.planning import calibration
    from desktop.core.planning.fit import estimate

    report = report if report is not None else engine_report(process)
    if report.empty():
        return []
    hardware = detect()
    fit = estimate(facts_from_path(process.plan.model_path), hardware, process.plan)
    return calibration.points_for(process.adapter.name, process.install.version, model, report, fit, hardware,
                                  "launch", run_id, process.plan.to_json())


def record_launch(process: EngineProcess, model: str, source: str = "serve", store: Store | None = None) -> int | None:
    """Store the launch in history, and the engine's memory lines as calibration points; history trouble never
    stops serving (it is logged and skipped)."""
    try:
        record = launch_record(process, model, source)
        if store is not None:
            run_id = store.add_run(record)
            _add_points(store, process, model, run_id)
            return run_id
        with Store() as own:
            run_id = own.add_run(record)
            _add_points(own, process, model, run_id)
            return run_id
    except (SwitchyardError, OSError) as exc:
        log.warning("could not record the launch in history: %s", exc)
        return None


def _add_points(store: Store, process: EngineProcess, model: str, run_id: int) -> None:
    try:
        store.add_memory_points(memory_points(process, model, run_id))
    except (SwitchyardError, OSError, ValueError) as exc:  # a model the fit cannot read: the launch row stays
        log.warning("could not compare the launch's memory with the fit: %s", exc)
