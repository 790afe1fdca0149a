"""The one planner: every engine the app starts runs a plan from here, checked by the fit.

`plan_launch(engine, model, hardware, asks)` takes what a person (or a workload, or the --auto-fit retry) asked
for, fills in everything else the way the fit finds it fits on `hardware` (-ngl, KV type, vLLM's utilization for
the memory that is free, the CPU KV space, dtype, the build), and returns the checked plan, or raises `PlanRefused`
with the one fix. `serve`, each `serve --config` entry, `switch`, `--standby`, `bench --engine`, `ab` and the
GUI's Launch it / Measure it here call it; the endpoint calls `replan` for switches, retries, swaps and reloads.

A plan remembers what it was asked with (`LaunchPlan.model`, `LaunchPlan.pinned`), so planning again for another
engine keeps only the asks every engine reads the same way: a llama.cpp KV type never becomes vLLM's
--kv-cache-dtype, -ngl never reaches vLLM, a utilization never reaches llama.cpp.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from desktop.core.common.errors import SwitchyardError
from desktop.core.common.progress import ProgressCallback, no_progress
from desktop.core.engines import ADAPTERS, get_adapter, kernels, vllm
from desktop.core.engines.base import (
    COMMON_PLAN_FIELDS,
    PLANNER_FIELDS,
    EngineAdapter,
    EngineInstall,
    LaunchPlan,
)
from desktop.core.engines.model_path import resolve_model
from desktop.core.engines.pooling import args_kind
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.models.facts import ModelFacts, facts_for
from desktop.core.models.parsers import check_parser, parsers_for
from desktop.core.models.projector import DEFAULT_IMAGES_PER_PROMPT, projector_for
from desktop.core.planning import repack
from desktop.core.planning.fit import FitResult, estimate, sized_gpus, sizing_of, vllm_utilization
from desktop.core.planning.launch import PlanRefused, describe, require_fit

_DEFAULTS = LaunchPlan(engine="", model_path=Path("model"))
ASKABLE = frozenset(f.name for f in fields(LaunchPlan)) - PLANNER_FIELDS
# Asks that belong to one model file: planning for another model drops them (its layers, its quantization).
MODEL_FIELDS = frozenset({"gpu_layers", "n_cpu_moe", "override_tensors", "cpu_offload_gb", "extra_args",
                          "quantization", "tokenizer_path", "tool_parser", "reasoning_parser", "mmproj",
                          "image_max_tokens", "images_per_prompt"})
PARSER_FIELDS = {"tool_parser": "tool", "reasoning_parser": "reasoning"}
# Asks that name one process: another engine or model gets its own port and key.
PROCESS_FIELDS = frozenset({"port", "api_key"})
FLAGS = {"gpu_layers": "--gpu-layers", "kv_cache_type": "--kv-type", "gpu_memory_utilization": "--util",
         "tensor_parallel": "--tp", "dtype": "--dtype", "ctx_per_request": "--ctx", "slots": "--parallel"}


@dataclass(frozen=True)
class Checked:
    """A plan the fit said fits, and that fit (the memory breakdown a dry run prints)."""

    plan: LaunchPlan
    fit: FitResult

    def describe(self, install: EngineInstall | None = None) -> dict[str, Any]:
        """The plan, its exact argv and env (secrets masked) and the memory breakdown."""
        return describe(replace(self.fit, plan=self.plan), install)


def engine_fields(adapter: EngineAdapter) -> frozenset[str]:
    """The plan fields `adapter`'s engine reads: the common ones and its own."""
    return COMMON_PLAN_FIELDS | adapter.plan_fields


def asks(**values: Any) -> dict[str, Any]:
    """Plan fields a person set: None (not given) and values equal to LaunchPlan's default are no asks."""
    unknown = sorted(set(values) - ASKABLE)
    if unknown:
        raise SwitchyardError(f"not a launch plan setting: {', '.join(unknown)}",
                              f"settings are: {', '.join(sorted(ASKABLE))}")
    return {k: v for k, v in values.items() if v is not None and v != getattr(_DEFAULTS, k)}


def asks_of(plan: LaunchPlan) -> dict[str, Any]:
    """A whole plan (recommend's, an export's) as asks: every field of its engine that differs from the default."""
    own = engine_fields(get_adapter(plan.engine)) - PROCESS_FIELDS
    return asks(**{name: getattr(plan, name) for name in own})


def pinned(plan: LaunchPlan) -> dict[str, Any]:
    """What `plan` was asked with (the planner chose the rest)."""
    return {name: getattr(plan, name) for name in plan.pinned}


def ask_key(plan: LaunchPlan) -> tuple[Any, ...]:
    """Two plans asked the same (same engine, model and asks, whatever their port or key): the same launch."""
    return (plan.engine, plan.model or str(plan.model_path),
            tuple(sorted((k, repr(v)) for k, v in pinned(plan).items() if k not in PROCESS_FIELDS)))


def _owner(name: str, adapter: EngineAdapter) -> str:
    owners = [a.display_name for a in ADAPTERS.values() if a is not adapter and name in a.plan_fields]
    return " / ".join(owners) or "another engine"


def ask(engine: str, model: str, overrides: Mapping[str, Any] | None = None) -> LaunchPlan:
    """A plan that holds only what was asked (engine, model as typed, the set fields), not yet checked: what a
    form or a page hands on. Every launch checks it (`replan`, as the endpoint does) before anything starts."""
    adapter = get_adapter(engine)
    wanted = asks(**dict(overrides or {}))
    return LaunchPlan(engine=adapter.name, model_path=Path(model), model=model, pinned=tuple(sorted(wanted)),
                      **wanted)


def plan_launch(engine: str, model: str, hardware: HardwareSnapshot, overrides: Mapping[str, Any] | None = None,
                *, model_path: Path | None = None, facts: ModelFacts | None = None,
                progress: ProgressCallback = no_progress) -> Checked:
    """The checked plan for `model` on `engine` on `hardware` with `overrides` (plan fields a person set), or
    `PlanRefused` naming the fix. `model` as typed: `demo`, a GGUF file, a Hugging Face folder."""
    adapter = get_adapter(engine)
    wanted = asks(**dict(overrides or {}))
    foreign = sorted(set(wanted) - engine_fields(adapter))
    if foreign:
        name = foreign[0]
        raise PlanRefused(f"{FLAGS.get(name, name)} is a {_owner(name, adapter)} setting, not one of "
                          f"{adapter.display_name}", f"drop {FLAGS.get(name, name)}, or pick the engine it is for")
    for name, kind in PARSER_FIELDS.items():
        if name in wanted:
            wanted[name] = check_parser(kind, wanted[name])
    path = model_path or resolve_model(model, adapter, progress)
    if facts is None:
        facts = facts_for("demo" if model == "demo" else str(path))
    serves = args_kind(adapter.name, wanted.get("extra_args") or (), path)
    if facts.encoder and serves == "chat":
        raise PlanRefused(encoder_refusal(model, facts), encoder_hint(facts, adapter.name))
    base = LaunchPlan(engine=adapter.name, model_path=path, model=model, pinned=tuple(sorted(wanted)), **wanted)
    family = sizing_of(adapter.name)
    if family == "llama.cpp" and "mmproj" not in wanted and not _no_projector(wanted.get("extra_args") or ()):
        base = replace(base, mmproj=projector_for(path, facts.hidden_size))  # a vision GGUF sees through it
    if family == "vllm" and facts.vision is not None and "images_per_prompt" not in wanted:
        base = replace(base, images_per_prompt=DEFAULT_IMAGES_PER_PROMPT)  # vLLM's own default is far more
    if facts.encoder:  # no KV cache to reuse, and vLLM's scheduler fails on one turned on ("no cacheable group")
        base = replace(base, prefix_cache=False)
    if sizing_of(adapter.name) == "vllm" and "gpu_memory_utilization" not in wanted and hardware.cuda_gpus:
        # vLLM refuses to start below total x utilization free: ask for what is free on a desktop with a browser
        base = replace(base, gpu_memory_utilization=vllm_utilization(hardware))
    avoided = kernel_avoidance(adapter, hardware) if family == "llama.cpp" else None
    if avoided is not None:  # before the fit: it counts what is really loaded (no repacked copy)
        base = replace(base, extra_args=kernels.with_avoidance(base.extra_args, avoided))
    result = estimate(facts, hardware, base)
    if avoided is not None:
        result = replace(result, notes=[*result.notes, f"{adapter.display_name} starts with "
                                        f"{' '.join(avoided.args)} on this CPU: {avoided.why}"])
    plan = require_fit(result, model)
    if serves == "chat":  # an embedder or reranker calls no tools and writes no reasoning
        plan = _with_parsers(plan, result, wanted)
    unaccounted = [str(a) for a in wanted.get("extra_args") or ()
                   if not (sizing_of(adapter.name) == "llama.cpp" and str(a) in repack.FLAGS)]
    if unaccounted:  # what the person passed through: launched as given, not in the memory check
        result = replace(result, notes=[*result.notes, "not accounted by the fit: " + " ".join(unaccounted)])
    # the engine's own device selection where the snapshot cannot pin the sized GPUs (llama.cpp's Vulkan build)
    plan = adapter.select_devices(plan, sized_gpus(adapter.name, hardware, plan))
    flag = adapter.sleep_mode_flag
    if flag and plan.backend == "cuda" and flag not in plan.extra_args:
        # sleep mode lets a stop-first switch free vLLM's GPU memory and wake it again without a cold start
        plan = replace(plan, extra_args=(*plan.extra_args, flag))
    if family == "vllm":  # on one compute core the model runs in vLLM's EngineCore: one process, one import less
        plan = vllm.worker_in_engine_core(plan, adapter, hardware.cpu.logical_cores)
    return Checked(plan, replace(result, plan=plan))


def kernel_avoidance(adapter: EngineAdapter, hardware: HardwareSnapshot) -> kernels.Avoidance | None:
    """The arguments the build that would start needs on `hardware`'s CPU (engines.kernels: a kernel that faults
    there, found by the probe or by a crash), or None. A snapshot of another CPU gets none: the lesson is this
    machine's."""
    install = adapter.find_install()
    return kernels.avoidance(install, hardware.cpu) if install is not None else None


def _no_projector(args: Any) -> bool:
    """llama-server told to load no projector found here (`--no-mmproj`, `--no-mmproj-auto`), or one by URL."""
    return any(str(a) in ("--no-mmproj", "--no-mmproj-auto", "--mmproj-url", "-mmu") or
               str(a).startswith("--mmproj-url=") for a in args)


def encoder_refusal(model: str, facts: ModelFacts) -> str:
    """Why a text encoder is not served as a chat model."""
    does = "scores (reranks) text" if facts.scores else "embeds text"
    return f"{model} is a text encoder ({facts.architecture}): it {does} and cannot chat or complete"


def encoder_hint(facts: ModelFacts, engine: str) -> str:
    kind = "rerank" if facts.scores else "embedding"
    flag = "--runner pooling" if get_adapter(engine).name == "vllm" else \
        "--reranking" if facts.scores else "--embeddings"
    return (f"serve it as `kind: {kind}` in a models.yaml entry beside a chat model (`switchyard serve --config "
            f"models.yaml`), or give the engine's own switch after `--`: {flag}")


def _with_parsers(plan: LaunchPlan, result: FitResult, wanted: Mapping[str, Any]) -> LaunchPlan:
    """The model's own tool-call and reasoning parsers (models.parsers) where none was asked for; a note in the
    fit when no tool-call parser is known (vLLM then answers 400 to requests with tools)."""
    if all(name in wanted for name in PARSER_FIELDS):
        return plan
    chosen = parsers_for(plan.model_path)
    if "tool_parser" not in wanted:
        plan = replace(plan, tool_parser=chosen.tool)
        if chosen.note:
            result.notes.append(chosen.note)
    if "reasoning_parser" not in wanted:
        plan = replace(plan, reasoning_parser=chosen.reasoning)
    return plan


def replan(plan: LaunchPlan, hardware: HardwareSnapshot, *, engine: str | None = None, model: str | None = None,
           changes: Mapping[str, Any] | None = None, progress: ProgressCallback = no_progress) -> Checked:
    """Plan again from what `plan` was asked with: for another engine (only the asks every engine reads the same
    way carry over), another model, the --auto-fit retry's `changes`, or a reload on the memory free now."""
    adapter = get_adapter(engine or plan.engine)
    typed = model or plan.model or str(plan.model_path)
    wanted = pinned(plan)
    same_engine = adapter.name == plan.engine
    same_model = typed == (plan.model or str(plan.model_path))
    if not same_engine:
        wanted = {k: v for k, v in wanted.items() if k in COMMON_PLAN_FIELDS}
    if not same_model:
        wanted = {k: v for k, v in wanted.items() if k not in MODEL_FIELDS}
    if not (same_engine and same_model):
        wanted = {k: v for k, v in wanted.items() if k not in PROCESS_FIELDS}
    wanted.update(changes or {})
    path = plan.model_path if same_engine and same_model and plan.model_path.exists() else None
    return plan_launch(adapter.name, typed, hardware, wanted, model_path=path, progress=progress)
