"""llama.cpp's split of a model between GPU and RAM, once the fit (planning/fit.py) has sized its parts.

It owns the two last steps of a GPU fit: where the bytes land for a given `-ngl` (layers on the GPU, the
experts a MoE keeps in RAM, the repacked copy of what runs on the CPU), and the verdict of that split with
the note that explains it. Kept apart from fit.py so the verdict's order of checks reads in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from desktop.core.machine.hardware import GIB, HardwareSnapshot
from desktop.core.planning.moe import ExpertPlacement
from desktop.core.planning.repack import Repacked


def _gib(value: float) -> float:
    return round(value / GIB, 3)


@dataclass(frozen=True)
class LayerSplit:
    """Where a llama.cpp model's bytes land for one `-ngl`."""

    layers: int  # -ngl: n_layers + 1 offloads the output layer too
    on_gpu_layers: int  # repeating layers on the GPU
    moved: int  # expert bytes kept in RAM although their layers are on the GPU
    gpu_used: int
    cpu_part: int  # host RAM besides the GPU part, the repacked copy included
    copy: int  # the repacked copy of the weights the CPU runs on


def split_layers(moe: ExpertPlacement, rep: Repacked, *, n_layers: int, per_layer: float, fixed: int,
                 output: int, embed: int) -> LayerSplit:
    """The GPU and RAM bytes of the placement `moe` chose; `per_layer` is one layer's weights plus KV cache."""
    layers = moe.gpu_layers
    on_gpu_layers = min(layers, n_layers)
    moved = moe.moved(on_gpu_layers)
    gpu_used = int(on_gpu_layers * per_layer + fixed + (output if layers > n_layers else 0)) - moved
    cpu_part = int((n_layers - on_gpu_layers) * per_layer + embed + (output if layers <= n_layers else 0)) + moved
    cpu_layers = n_layers - on_gpu_layers
    expert_share = moe.expert_share(cpu_layers, moved)
    copy = rep.on_cpu(cpu_layers / n_layers, cpu_layers / n_layers if expert_share is None else expert_share,
                      head=layers <= n_layers)
    return LayerSplit(layers, on_gpu_layers, moved, gpu_used, cpu_part + copy, copy)


def offload_verdict(split: LayerSplit, moe: ExpertPlacement, hw: HardwareSnapshot, *, n_layers: int,
                    gpu_free: int, layers_that_fit: Callable[[], int],
                    notes: list[str]) -> Literal["yes", "partial", "no"]:
    """Whether the split runs here, the first failed check deciding; its reason goes into `notes`."""
    layers, gpu_used, cpu_part, moved = split.layers, split.gpu_used, split.cpu_part, split.moved
    if gpu_used > gpu_free:
        notes.append(f"-ngl {layers} needs {_gib(gpu_used):.2f} GiB of GPU memory but {_gib(gpu_free):.2f} GiB is "
                     f"free: at most {layers_that_fit()} layers fit")
        return "no"
    if hw.has_unified_memory and gpu_used + cpu_part > hw.ram_available_bytes:
        # Apple Silicon: the GPU's working set and the CPU's part come from the same RAM, counted once
        notes.append(f"unified memory: {_gib(gpu_used):.2f} GiB on the GPU + {_gib(cpu_part):.2f} GiB for the CPU "
                     f"part is more than the {_gib(hw.ram_available_bytes):.2f} GiB of RAM available (one pool)")
        return "no"
    if moe.any_in_ram and cpu_part > hw.ram_available_bytes:
        notes.append(moe.no_room_note(moved))
        return "no"
    if layers > n_layers and moe.any_in_ram:
        notes.insert(0, moe.partial_note(moved))
        return "partial"
    if layers > n_layers:
        return "yes"
    if cpu_part > hw.ram_available_bytes:
        notes.append("the layers left on the CPU do not fit in free RAM either")
        return "no"
    if layers == 0:
        notes.append("no layer fits on the GPU: runs on the CPU (the GPU still speeds up prompt processing)")
        return "partial"
    notes.append(f"{split.on_gpu_layers}/{n_layers} layers fit on the GPU (-ngl {split.on_gpu_layers}); the rest "
                 "run on the CPU, so generation is much slower than fully offloaded")
    return "partial"
