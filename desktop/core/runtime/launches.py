"""Every launch leaves a row in history: its cold start (T1–T3) and the memory the engine reported or used at
load. The recommender reads these rows back (desktop.core.planning.evidence): cold starts replace its defaults,
and the memory corrects the next fit for the same model on this machine.

Memory comes from what is there without slowing serving: the engine's own load lines when it prints them
(vLLM at its default verbosity: weights, KV cache, CUDA graphs; llama.cpp only at -lv 4, which the app no
longer uses), and always the resident memory of the engine's process tree once it has served a first request.
"""

from __future__ import annotations

import logging
from typing import Any

from desktop.core.common.errors import SwitchyardError
from desktop.core.runtime.proctree import tree_rss
from desktop.core.runtime.supervisor import EngineProcess
from desktop.core.storage.history import RunRecord, Store

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


def launch_record(process: EngineProcess, model: str, source: str = "serve") -> RunRecord:
    """The history row for a launch that is ready now (call right after `wait_ready`)."""
    cold = process.cold_start
    summary = {"cold_start": cold.to_json(), "load_memory": load_memory(cold.facts, tree_rss_gib(process.pid)),
               "source": source}
    return RunRecord(kind="launch", engine=process.adapter.name, engine_version=process.install.version,
                     model=model, settings=process.plan.to_json(), summary=summary,
                     label=f"launch {process.adapter.name} ({source})")


def record_launch(process: EngineProcess, model: str, source: str = "serve", store: Store | None = None) -> int | None:
    """Store the launch in history; history trouble never stops serving (it is logged and skipped)."""
    try:
        record = launch_record(process, model, source)
        if store is not None:
            return store.add_run(record)
        with Store() as own:
            return own.add_run(record)
    except (SwitchyardError, OSError) as exc:
        log.warning("could not record the launch in history: %s", exc)
        return None
