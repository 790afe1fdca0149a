""""Prepare vLLM": one start of exactly the plan the endpoint will launch, through its first request, then a
stop - so vLLM's torch.compile cache for that model and plan (kept per plan in the app's cache folder, see
`engines.vllm.compile_cache_root`) is filled and the user's real first start loads compiled graphs instead of
compiling them. The start is recorded in history (source "prepare"), where the recommender finds the warm
cold start afterwards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from desktop.core.common.progress import ProgressCallback, ProgressEvent, no_progress
from desktop.core.runtime.launches import record_launch
from desktop.core.runtime.supervisor import EngineProcess
from desktop.core.serving.endpoint import EngineSpec, make_launcher


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


def prepare(spec: EngineSpec, *, eager: bool = False, progress: ProgressCallback = no_progress,
            ready_timeout: float = 1800.0, install_missing: bool = False) -> Prepared:
    """Start `spec` as the endpoint would (same launcher, so the same plan and cache folder), wait for its
    first request, stop it. Raises EngineFailed with the engine's own reason when it cannot start."""
    adapter, plan, install = make_launcher(progress, install_missing=install_missing, vllm_eager=eager)(spec)
    cache = adapter.compile_cache_dir(plan)
    was_warm = _prepared(adapter.name, plan)
    progress(ProgressEvent(f"Preparing {adapter.display_name} on {plan.model_path.name}: one start to fill its "
                           f"compile cache ({'already warm' if was_warm else 'empty'})"))
    with EngineProcess(adapter, plan, install) as process:
        process.start()
        cold = process.wait_ready(timeout=ready_timeout, first_request=True)
        record_launch(process, spec.model, source="prepare")
    progress(ProgressEvent(f"{adapter.display_name} prepared: cold start {cold.t3_first_request_s or 0:.1f} s, "
                           f"compile cache {cold.compile_cache or 'not reported'}", 1.0))
    return Prepared(adapter.name, spec.model, str(cache) if cache else None, was_warm, cold.compile_cache,
                    cold.to_json(), str(process.log_path))


def _prepared(engine: str, plan: Any) -> bool:
    from desktop.core.engines.vllm import compile_cache_prepared

    return engine == "vllm" and compile_cache_prepared(plan)


def is_prepared(spec: EngineSpec, *, eager: bool = False) -> bool:
    """Whether a start of `spec` would find its compile cache filled (no engine started, nothing installed)."""
    from dataclasses import replace

    from desktop.core.engines import get_adapter
    from desktop.core.engines.model_path import resolve_model

    adapter = get_adapter(spec.engine)
    plan = spec.launch_plan(adapter.name, resolve_model(spec.model, adapter))
    return _prepared(adapter.name, replace(plan, eager=eager) if eager else plan)
