""""Prepare vLLM": one start of exactly the plan the endpoint will launch, through its first request, then a
stop - so vLLM's torch.compile cache for that model and plan (kept per plan in the app's cache folder, see
`engines.vllm.compile_cache_root`) is filled and the user's real first start loads compiled graphs instead of
compiling them. The start is recorded in history (source "prepare"), where the recommender finds the warm
cold start afterwards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from desktop.core.common.progress import ProgressCallback, ProgressEvent, no_progress
from desktop.core.engines.base import LaunchPlan
from desktop.core.machine.hardware import HardwareSnapshot, detect
from desktop.core.planning.planner import replan
from desktop.core.runtime.launches import record_launch
from desktop.core.runtime.supervisor import EngineProcess, start_ready
from desktop.core.serving.endpoint import make_launcher


@dataclass(frozen=True)
class Prepared:
    """What a prepare run did: the engine, where the cache is, whether it was already warm, the start's phases."""

    engine: str
    model: str
    cache_dir: str | None
    was_warm: bool
    compile_cache: str | None
    cold_start: dict[str, Any]
    log_path: str

    def to_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "model": self.model, "cache_dir": self.cache_dir, "was_warm": self.was_warm,
                "compile_cache": self.compile_cache, "cold_start": self.cold_start, "log": self.log_path}


def checked_prepare_plan(asked: LaunchPlan, *, eager: bool = False,
                         hardware: HardwareSnapshot | None = None) -> LaunchPlan:
    """The plan the endpoint would launch for `asked` (a LaunchPlan of asks, planner.ask), checked by the planner
    on this machine: the same plan, so the same compile-cache folder, as the real start."""
    changes = {"eager": True} if eager else None
    return replan(asked, hardware or detect(), changes=changes).plan


def prepare(asked: LaunchPlan, *, eager: bool = False, progress: ProgressCallback = no_progress,
            ready_timeout: float = 1800.0, install_missing: bool = False,
            hardware: HardwareSnapshot | None = None) -> Prepared:
    """Start `asked` as the endpoint would (the planner's checked plan through the same launcher, so the same
    cache folder), wait for its first request, stop it. Raises EngineFailed with the engine's own reason (or
    PlanRefused with the fix) when it cannot start."""
    checked = checked_prepare_plan(asked, eager=eager, hardware=hardware)
    adapter, plan, install = make_launcher(progress, install_missing=install_missing)(checked)
    model = asked.model or str(asked.model_path)
    cache = adapter.compile_cache_dir(plan)
    was_warm = _prepared(adapter.name, plan)
    progress(ProgressEvent(f"Preparing {adapter.display_name} on {plan.model_path.name}: one start to fill its "
                           f"compile cache ({'already warm' if was_warm else 'empty'})"))
    with start_ready(lambda p: EngineProcess(adapter, p, install), plan, timeout=ready_timeout,
                     say=lambda text: progress(ProgressEvent(text))) as process:
        cold = process.cold_start
        record_launch(process, model, source="prepare")
    progress(ProgressEvent(f"{adapter.display_name} prepared: cold start {cold.t3_first_request_s or 0:.1f} s, "
                           f"compile cache {cold.compile_cache or 'not reported'}", 1.0))
    return Prepared(adapter.name, model, str(cache) if cache else None, was_warm, cold.compile_cache,
                    cold.to_json(), str(process.log_path))


def _prepared(engine: str, plan: Any) -> bool:
    from desktop.core.engines.vllm import compile_cache_prepared

    return engine == "vllm" and compile_cache_prepared(plan)


def is_prepared(asked: LaunchPlan, *, eager: bool = False, hardware: HardwareSnapshot | None = None) -> bool:
    """Whether a start of `asked` would find its compile cache filled (no engine started, nothing installed)."""
    plan = checked_prepare_plan(asked, eager=eager, hardware=hardware)
    return _prepared(plan.engine, plan)
