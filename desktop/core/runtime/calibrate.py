"""Calibration on this machine: a short probe launch per engine, its memory report stored against the fit.

Each engine is launched briefly at a small context (llama-server with its memory lines on, vLLM as the app
launches it) on the user's model or the demo; the predicted and measured bytes per component are stored in
history for this machine's accelerator set (planning.calibration), which the next fit corrects by. Used by
`switchyard calibrate` and the Machine page's Calibrate button.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from desktop.core.common.errors import SwitchyardError

CALIBRATE_CTX = 1024
# What a probe on a machine without the engine's GPU cannot measure: those parts of the fit stay the formula's.
GPU_ONLY = {
    "llama.cpp": "the GPU's buffers (weights, KV cache and compute of the layers -ngl offloads) and the "
                 "CUDA/Vulkan context",
    "vllm": "the activation peak, CUDA graphs and the CUDA context (vLLM's CPU build reports its weights and KV "
            "space only)",
}


def gpu_only_note(engine: str, hardware: Any) -> str | None:
    """The line that says what only a GPU measures, on a machine whose `engine` runs without one; None on a GPU
    (there the probe measures those parts too)."""
    from desktop.core.planning.fit import normalise_engine

    name = normalise_engine(engine)
    gpus = hardware.cuda_gpus if name == "vllm" else hardware.gpus
    if gpus or name not in GPU_ONLY:
        return None
    return f"measured only on a GPU (none here): {GPU_ONLY[name]}; the fit keeps its formula for them"


def model_for(engine: str, model: str) -> Path | None:
    """The file or folder `engine` loads for `model`, or None when the model has no form that engine reads."""
    from desktop.core.engines import get_adapter

    if model == "demo":
        from desktop.core.models.demo import ensure_demo_model

        return ensure_demo_model().path_for(get_adapter(engine).model_format)
    path = Path(model).expanduser()
    if not path.exists():
        raise SwitchyardError(f"{model} does not exist", "pass a .gguf file, a Hugging Face folder, or demo")
    wants_gguf = get_adapter(engine).model_format == "gguf"
    is_gguf = path.is_file() and path.suffix.lower() == ".gguf"
    if wants_gguf != is_gguf:
        return None
    return path.resolve()


def calibrate(engine: str, model: str = "demo", ctx: int = CALIBRATE_CTX, timeout: float = 900.0,
              store: Any = None) -> dict[str, Any]:
    """Probe one engine on `model`, store its memory points, and return predicted vs measured per component."""
    from desktop.core.engines import get_adapter
    from desktop.core.engines.base import LaunchPlan
    from desktop.core.machine.hardware import detect
    from desktop.core.models.facts import facts_from_path
    from desktop.core.planning import calibration
    from desktop.core.planning.fit import estimate, exact_bytes, launch_dtype
    from desktop.core.runtime.memprobe import probe
    from desktop.core.storage.history import Store

    adapter = get_adapter(engine)
    path = model_for(adapter.name, model)  # a bad model is the user's error, named before anything else
    facts = facts_from_path(path) if path is not None else None  # a corrupt file is refused before a launch
    install = adapter.find_install()
    if install is None:
        return {"engine": adapter.name, "skipped": f"{adapter.name} is not installed"}
    if path is None or facts is None:
        return {"engine": adapter.name, "skipped": f"{model} is not in a format {adapter.name} loads"}
    hardware = detect()
    vllm = adapter.name == "vllm"
    plan = LaunchPlan(engine=adapter.name, model_path=path, ctx_per_request=ctx, slots=1, eager=vllm,
                      kv_cache_gib=1.0 if vllm and not hardware.cuda_gpus else None,
                      dtype=launch_dtype(adapter.name, demo=model == "demo", cuda=bool(hardware.cuda_gpus)))
    fit = estimate(facts, hardware, plan)
    result = probe(adapter, install, fit.plan or plan, timeout=timeout)
    out: dict[str, Any] = {"engine": adapter.name, "version": install.version, "model": str(path),
                           "accelerators": calibration.accelerator_set(hardware, adapter.name),
                           "started": result.started, "error": result.error, "argv": result.argv,
                           "lines": result.report.lines}
    if result.retried:
        out["retried"] = result.retried
    note = gpu_only_note(adapter.name, hardware)
    if note:
        out["gpu_only"] = note
    if not result.started:
        return out
    # compared with the fit of what was launched: a crash retry or a learned fix may have added --no-repack
    fit = estimate(facts, hardware, result.plan)
    pairs = calibration.components(adapter.name, result.report, fit)
    out["components"] = {k: {"predicted_bytes": p, "measured_bytes": m, "ratio": round(m / p, 4) if p else None}
                         for k, (p, m) in pairs.items()}
    points = calibration.points_for(adapter.name, install.version, str(path), result.report, fit, hardware,
                                    "calibrate", settings=(fit.plan or plan).to_json())
    if store is None:
        with Store() as own:
            own.add_memory_points(points)
            out["corrected"] = _corrected(fit, hardware, own, exact_bytes)
    else:
        store.add_memory_points(points)
        out["corrected"] = _corrected(fit, hardware, store, exact_bytes)
    opinion = calibration.second_opinion(result.report, fit)
    if opinion is not None:
        out["engine_fit"] = opinion.to_json()
    return out


def _corrected(fit: Any, hardware: Any, store: Any, exact_bytes: Any) -> dict[str, Any]:
    from desktop.core.planning import calibration

    fixed = calibration.corrected(fit, hardware, store)
    return {"total_gib": fixed.total_gib, "notes": fixed.notes[-1:], "bytes": exact_bytes(fixed)}


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:10.2f}"


def describe(found: dict[str, Any]) -> list[str]:
    """Predicted vs measured per component, as lines (the CLI prints them, the Machine page shows them)."""
    lines: list[str] = []
    if "skipped" in found:
        return [f"{found['engine']}: skipped ({found['skipped']})"]
    lines.append(f"{found['engine']} {found['version']} on {found['accelerators']}: {found['model']}")
    if found.get("retried"):
        lines.append(f"  {found['retried']}")
    if not found["started"]:
        lines.append(f"  did not start: {found['error']}")
        return lines
    lines.append(f"  {'component':12}{'predicted MiB':>16}{'measured MiB':>16}{'measured/predicted':>20}")
    for name, row in found["components"].items():
        if name == "kv_tokens":
            lines.append(f"  {'KV tokens':12}{row['predicted_bytes']:>16,.0f}{row['measured_bytes']:>16,.0f}"
                  f"{row['ratio']:>20.3f}")
            continue
        lines.append(f"  {name:12}{_mib(row['predicted_bytes']):>16}{_mib(row['measured_bytes']):>16}{row['ratio']:>20.3f}")
    if found.get("engine_fit"):
        opinion = found["engine_fit"]
        lines.append(f"  llama-server's own --fit projects {opinion['engine_mib']:.1f} MiB; ours {opinion['ours_mib']:.1f} MiB"
              + (f" ({opinion['explanation']})" if opinion.get("explanation") else ""))
    for note in found["corrected"]["notes"]:
        lines.append(f"  next fit: {note}")
    if found.get("gpu_only"):
        lines.append(f"  {found['gpu_only']}")
    return lines
