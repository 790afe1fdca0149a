"""What the endpoint asks the fit when it runs several engines on one machine: how much memory an engine's checked
plan holds on each GPU and in RAM, and, after a load failed for lack of memory, the next smaller plan to retry
with and what exactly changed.

The numbers come from `fit.estimate` on the plan itself (its utilization, tensor parallel, KV type, GPU layers
and CPU part): this module only reads the result."""

from __future__ import annotations

from dataclasses import dataclass, field

from desktop.core.common.defaults import DEFAULT_VLLM_UTILIZATION
from desktop.core.engines.base import LaunchPlan
from desktop.core.machine.hardware import GIB, HardwareSnapshot
from desktop.core.models.facts import ModelFacts, facts_for
from desktop.core.planning.fit import (
    VLLM_DRIVER_RESERVED_BYTES,
    FitResult,
    estimate,
    normalise_engine,
    sizing_of,
    sizing_plan,
    vllm_group,
)

MIN_CTX = 256  # below this a retry would serve nothing useful: stop shrinking
SMALLER_KV = "q8_0"  # llama.cpp's KV cache type of the smaller plan (half of f16, near-lossless)


def fit_for(engine: str, facts: ModelFacts, ctx: int, parallel: int, hardware: HardwareSnapshot, *,
            gpu_layers: int | None = None, kv_type: str | None = None) -> FitResult:
    """The fit of one engine with the endpoint's conventions: `ctx` per request, `parallel` the slots /
    max_num_seqs (the plan turns them into each engine's own flags)."""
    plan = sizing_plan(engine, ctx_per_request=ctx, slots=parallel, gpu_layers=gpu_layers, kv_cache_type=kv_type)
    return estimate(facts, hardware, plan)


@dataclass(frozen=True)
class Need:
    """What one engine holds: bytes on each GPU it uses (by GPU index) and bytes of host RAM."""

    gpu: dict[int, float]
    ram: float

    @property
    def gpu_total(self) -> float:
        return float(sum(self.gpu.values()))


def plan_facts(plan: LaunchPlan) -> ModelFacts:
    """The model facts of a plan: the demo's, or read from its model file/folder."""
    return facts_for("demo" if plan.model == "demo" else str(plan.model_path))


def engine_need(plan: LaunchPlan, hardware: HardwareSnapshot, facts: ModelFacts | None = None) -> Need:
    """What `plan` holds on `hardware`, from the fit of that very plan: vLLM its utilization's share of each of
    its tensor-parallel GPUs, llama.cpp its GPU layers spread over the GPUs by free memory plus its CPU part."""
    result = estimate(facts or plan_facts(plan), hardware, plan)
    ram = float(result.cpu_ram_gib) * GIB
    if result.device == "CPU" or not hardware.gpus:
        return Need({}, float(result.total_gib) * GIB)
    if sizing_of(plan.engine) == "vllm":
        # every rank takes utilization x its own GPU's memory (a 4090 rank beside a 3060 one takes more than the
        # 3060's share the fit sized the KV cache by), plus what the fit counts outside that budget
        util = plan.gpu_memory_utilization or DEFAULT_VLLM_UTILIZATION
        outside = max(0.0, float(result.total_gib) - float(result.breakdown.get("budget", result.total_gib))) * GIB
        return Need({g.index: util * (g.memory_total_bytes - min(VLLM_DRIVER_RESERVED_BYTES, g.memory_total_bytes // 20))
                     + outside for g in vllm_group(hardware, plan.tensor_parallel)}, ram)
    gpus = [g for g in hardware.gpus if g.memory_total_bytes > 0]
    used = float(result.breakdown.get("gpu_used", result.total_gib)) * GIB
    free = sum(g.memory_free_bytes for g in gpus) or 1
    return Need({g.index: used * g.memory_free_bytes / free for g in gpus}, ram)


@dataclass(frozen=True)
class SmallerPlan:
    """The settings of the retry after an out-of-memory load, and each change said in words."""

    ctx: int
    gpu_layers: int | None
    kv_type: str | None
    changes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return "; ".join(self.changes)


def smaller_plan(engine: str, model: str | ModelFacts, ctx: int, parallel: int, hardware: HardwareSnapshot, *,
                 gpu_layers: int | None = None, kv_type: str | None = None) -> SmallerPlan | None:
    """One step down from a plan that ran out of memory: half the context, and for llama.cpp on a GPU a q8_0
    KV cache and the layers the fit says fit with that (at least one fewer). None when nothing can shrink."""
    key = normalise_engine(engine)
    facts = model if isinstance(model, ModelFacts) else facts_for(model)
    before = fit_for(key, facts, ctx, parallel, hardware, gpu_layers=gpu_layers, kv_type=kv_type)
    new_ctx = max(MIN_CTX, ctx // 2)
    new_kv, new_layers = kv_type, gpu_layers
    changes: list[str] = []
    on_gpu = bool(hardware.gpus) and before.device != "CPU"
    if key == "llama.cpp" and on_gpu:
        if (kv_type or "f16") not in (SMALLER_KV, "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"):
            new_kv = SMALLER_KV
        current = before.gpu_layers if before.gpu_layers is not None else (before.total_layers or 1)
        fitted = fit_for(key, facts, new_ctx, parallel, hardware, kv_type=new_kv).gpu_layers
        new_layers = max(0, min(current - 1, fitted if fitted is not None else current - 1))
    if new_ctx == ctx and new_kv == kv_type and new_layers == gpu_layers:
        return None
    after = fit_for(key, facts, new_ctx, parallel, hardware, gpu_layers=new_layers, kv_type=new_kv)
    if new_ctx != ctx:
        changes.append(f"context {ctx:,} → {new_ctx:,} tokens per request "
                       f"(KV cache {before.kv_cache_gib:.2f} → {after.kv_cache_gib:.2f} GiB)"
                       if key == "llama.cpp" else f"max_model_len {ctx:,} → {new_ctx:,} tokens")
    if new_kv != kv_type:
        changes.append(f"KV cache type {kv_type or 'f16'} → {new_kv}")
    if new_layers != gpu_layers:
        changes.append(f"GPU layers {before.gpu_layers} → {new_layers} (-ngl; the rest run on the CPU)")
    return SmallerPlan(new_ctx, new_layers, new_kv, changes)
