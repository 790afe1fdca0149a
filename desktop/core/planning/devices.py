"""Which GPUs an engine runs on: the ones the fit sized the plan for, pinned per backend (CUDA by UUID, ROCm by
HIP's numbering; Vulkan is left to the adapter, which knows its build's own device names)."""

from __future__ import annotations

from dataclasses import replace

from desktop.core.engines.base import LaunchPlan
from desktop.core.machine.hardware import GpuInfo, HardwareSnapshot


def pin_devices(plan: LaunchPlan, gpus: list[GpuInfo], hardware: HardwareSnapshot | None = None) -> LaunchPlan:
    """Make the engine run on exactly the GPUs that were sized.

    CUDA: CUDA_VISIBLE_DEVICES by UUID (NVML lists GPUs in PCI order, CUDA fastest first, so an index could name
    another card), and for llama.cpp's CUDA build its own device selection (`--device CUDA0,...`, the pinned GPUs
    in that order). Without UUIDs (a hypothetical GPU) nothing is pinned.

    ROCm: HIP_VISIBLE_DEVICES (the variable llama.cpp's docs/build.md names for its HIP build; vLLM's ROCm build
    reads it too) with each sized GPU's place among the machine's AMD GPUs, which HIP numbers in the KFD topology
    order detection reads them in; llama.cpp then gets `--device ROCm0,...`.

    Vulkan: not pinned by number. `--device VulkanN` and GGML_VK_VISIBLE_DEVICES index the Vulkan loader's own
    order (Mesa's device-select layer puts the GPU driving the display first; Windows follows DXGI), which
    detection cannot see: on a laptop whose Intel iGPU drives the display, "Vulkan0" is that iGPU. And with
    GGML_VK_VISIBLE_DEVICES set, ggml-vulkan.cpp skips its merging of one GPU seen through two drivers (RADV and
    AMDVLK). The planner asks the llama.cpp adapter instead (`select_devices`: the sized GPUs by name as the
    installed Vulkan build listed them); without one, llama.cpp's default is every discrete GPU (an integrated
    one only when there is none)."""
    if plan.backend == "rocm":
        return _pin_rocm(plan, gpus, hardware)
    nvidia = [g for g in gpus if g.vendor == "nvidia"]
    if plan.backend != "cuda" or not nvidia or any(not g.uuid for g in nvidia):
        return plan
    env = {**dict(plan.env), "CUDA_VISIBLE_DEVICES": ",".join(str(g.uuid) for g in nvidia)}
    extra = plan.extra_args
    if plan.engine == "llama.cpp" and "--device" not in extra and "-dev" not in extra:
        extra = (*extra, "--device", ",".join(f"CUDA{i}" for i in range(len(nvidia))))
    return replace(plan, env=env, extra_args=extra)


def _pin_rocm(plan: LaunchPlan, gpus: list[GpuInfo], hardware: HardwareSnapshot | None) -> LaunchPlan:
    """HIP_VISIBLE_DEVICES = the sized AMD GPUs' places among the machine's AMD GPUs (see `pin_devices`)."""
    everyone = [g for g in (hardware.gpus if hardware is not None else gpus) if g.vendor == "amd"]
    keys = [(g.index, g.name) for g in everyone]
    places = [keys.index((g.index, g.name)) for g in gpus if g.vendor == "amd" and (g.index, g.name) in keys]
    if not places:
        return plan
    env = {**dict(plan.env), "HIP_VISIBLE_DEVICES": ",".join(str(i) for i in places)}
    extra = plan.extra_args
    if plan.engine == "llama.cpp" and "--device" not in extra and "-dev" not in extra:
        extra = (*extra, "--device", ",".join(f"ROCm{i}" for i in range(len(places))))
    return replace(plan, env=env, extra_args=extra)
