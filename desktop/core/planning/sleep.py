"""A vLLM put to sleep before the next engine starts (a stop-first switch on one GPU): what it still holds on the
GPU and in host RAM, which sleep level host RAM allows, and the hardware the next engine is planned against."""

from __future__ import annotations

from dataclasses import dataclass, replace

from desktop.core.common.errors import SwitchyardError
from desktop.core.machine.hardware import GIB, GpuInfo, HardwareSnapshot
from desktop.core.planning.fit import VLLM_DRIVER_RESERVED_BYTES, FitResult, sized_gpus


@dataclass(frozen=True)
class SleepFootprint:
    """What a vLLM put to sleep still holds, per GPU of its group and in host RAM (bytes)."""

    level: int
    gpu_bytes_per_gpu: int  # CUDA context, cuBLAS/NCCL, the CUDA-graph pool: not in vLLM's CuMemAllocator pools
    host_bytes: int  # level 1: the weights, offloaded to pinned host RAM; level 2: discarded


def sleeping_vllm_footprint(result: FitResult, level: int = 1) -> SleepFootprint:
    """vLLM's worker `sleep()` releases only its CuMemAllocator pools (weights, KV cache) and logs "Sleep mode
    freed X GiB, Y GiB memory is still in use": the CUDA context, non-torch buffers and the CUDA-graph pool stay
    on every GPU. Level 1 keeps the weights in pinned host RAM (all ranks together), level 2 drops them."""
    if level not in (1, 2):
        raise SwitchyardError(f"vLLM sleep level must be 1 or 2, not {level}")
    if result.engine != "vllm" or result.device == "CPU":
        raise SwitchyardError("only vLLM on a GPU has a sleep mode")
    breakdown = result.breakdown
    context = int(VLLM_DRIVER_RESERVED_BYTES // 2)  # the CUDA context itself (not part of non_torch's buffers)
    leftover = int((breakdown.get("non_torch", 0.0) + breakdown.get("cuda_graphs", 0.0)) * GIB) + context
    tp = result.plan.tensor_parallel if result.plan is not None else 1
    host = int(result.weights_gib * GIB) * tp if level == 1 else 0
    return SleepFootprint(level, leftover, host)


SLEEP_HOST_MARGIN_BYTES = 2 * GIB  # what the rest of the machine keeps after the weights are pinned


def level1_sleep_allowed(weights_bytes: int, ram_available_bytes: int, next_host_bytes: int = 0) -> bool:
    """Whether host RAM can take the weights a level-1 sleep pins there, beside the next engine's RAM part and
    a margin. When not, the manager stops the vLLM instead (a level-2 wake must reload the weights itself)."""
    return weights_bytes + next_host_bytes + SLEEP_HOST_MARGIN_BYTES <= ram_available_bytes


def sleep_level(result: FitResult, hardware: HardwareSnapshot, next_host_bytes: int = 0) -> int:
    """1 when host RAM holds the weights a level-1 sleep pins (plus what the next engine needs in RAM and a
    margin), else 2 (weights dropped: the wake reloads them from disk)."""
    need = sleeping_vllm_footprint(result, 1).host_bytes + next_host_bytes + SLEEP_HOST_MARGIN_BYTES
    return 1 if need <= hardware.ram_available_bytes else 2


def hardware_with_sleeping(hardware: HardwareSnapshot, footprint: SleepFootprint,
                           gpus: list[GpuInfo]) -> HardwareSnapshot:
    """`hardware` as the next engine finds it while that vLLM sleeps on `gpus`: their free memory less what the
    sleeper still holds, RAM available less the pinned weights. The next engine is sized against this."""
    held = {id(g) for g in gpus}
    keys = {(g.uuid, g.index) for g in gpus}
    changed = []
    for gpu in hardware.gpus:
        if id(gpu) in held or (gpu.uuid, gpu.index) in keys:
            free = max(0, gpu.memory_free_bytes - footprint.gpu_bytes_per_gpu)
            gpu = replace(gpu, memory_free_bytes=free, memory_used_bytes=gpu.memory_total_bytes - free,
                          other_processes_bytes=gpu.other_processes_bytes + footprint.gpu_bytes_per_gpu)
        changed.append(gpu)
    return replace(hardware, gpus=changed,
                   ram_available_bytes=max(0, hardware.ram_available_bytes - footprint.host_bytes))


def plan_after_sleep(result: FitResult, hardware: HardwareSnapshot, next_host_bytes: int = 0,
                     next_gpu_bytes: int = 0) -> tuple[int | None, HardwareSnapshot]:
    """How to put a vLLM away before the next engine starts: the sleep level (1, 2, or None = stop it), and the
    hardware the next engine is planned against. Level 1 needs host RAM for the weights; any level needs the
    next engine's GPU part (`next_gpu_bytes`, 0 = unknown) to fit beside the sleeper's leftovers."""
    if result.plan is None:
        return None, hardware
    gpus = sized_gpus("vllm", hardware, result.plan)
    level = sleep_level(result, hardware, next_host_bytes)
    footprint = sleeping_vllm_footprint(result, level)
    after = hardware_with_sleeping(hardware, footprint, gpus)
    if next_gpu_bytes and gpus and sum(g.memory_free_bytes for g in after.gpus) < next_gpu_bytes:
        return None, hardware  # the leftovers would not leave room: stop it instead
    return level, after
