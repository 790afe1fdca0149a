"""Where llama.cpp keeps a MoE's expert tensors: on the GPU with their layer, or in RAM.

A MoE that does not fit whole keeps every layer on the GPU and only the experts of some layers in RAM
(llama-server --n-cpu-moe K: the first K layers'): attention, KV and routing stay on the GPU, only those layers'
sparse expert matmuls run on the CPU. Pointless on unified memory (one pool). Kept apart from planning/fit.py so
the fit's memory arithmetic reads a placement, whatever asked for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from desktop.core.machine.hardware import GIB, HardwareSnapshot
from desktop.core.models.facts import ModelFacts
from desktop.core.planning.weights import llama_expert_bytes


@dataclass(frozen=True)
class ExpertPlacement:
    """The layers -ngl puts on the GPU and, per layer, the expert bytes kept in RAM."""

    gpu_layers: int  # -ngl: the last N layers (N = n_layers + 1 with the output)
    experts: tuple[int, ...] = ()  # per layer, its MoE expert bytes (empty: a dense model, or one memory pool)
    in_ram: tuple[int, ...] = ()  # per layer, the expert bytes kept in RAM whichever device the layer is on
    n_cpu_moe: int = 0  # --n-cpu-moe K: the experts of the first K layers

    def moved(self, on_gpu_layers: int) -> int:
        """Expert bytes in RAM that belong to layers on the GPU (-ngl N puts the last N there): what leaves it."""
        first = len(self.experts) - on_gpu_layers
        return sum(size for layer, size in enumerate(self.in_ram) if layer >= first)

    def expert_share(self, cpu_layers: int, moved: int) -> float | None:
        """The share of all expert bytes on the CPU (those of its whole layers and those moved); None: no MoE."""
        total = sum(self.experts)
        return (sum(self.experts[:cpu_layers]) + moved) / total if total else None

    def partial_note(self, moved: int) -> str:
        return (f"partial: experts of {self.n_cpu_moe} layers in RAM (--n-cpu-moe {self.n_cpu_moe}, "
                f"{_gib(moved):.2f} GiB); every layer's attention, KV and routing on the GPU, only those layers' "
                "expert matmuls on the CPU")

    def no_room_note(self, moved: int) -> str:
        return f"the experts of {self.n_cpu_moe} layers ({_gib(moved):.2f} GiB) do not fit in free RAM either"

    @property
    def any_in_ram(self) -> bool:
        return any(self.in_ram)


def _gib(value: float) -> float:
    return round(value / GIB, 3)


def place(facts: ModelFacts, hw: HardwareSnapshot, weights: int, quant: str, *, n_cpu_moe: int | None,
          gpu_layers: int | None, full_gpu: int, gpu_free: int, layers_that_fit: Callable[[], int],
          notes: list[str]) -> ExpertPlacement:
    """-ngl and the experts in RAM for a GPU plan: what was asked (-ngl, --n-cpu-moe, 0 too: every layer on the
    GPU), else everything when it fits, else every layer with the experts of the fewest first layers in RAM, else
    the whole layers that fit. `full_gpu`: the GPU bytes of every layer and the output; `gpu_free`: free now."""
    n_layers = facts.n_layers
    experts = [] if hw.has_unified_memory else llama_expert_bytes(facts, weights, quant)
    if n_cpu_moe is not None and not experts:
        notes.append("--n-cpu-moe has no effect here: the model has no MoE expert tensors")
    k = min(n_cpu_moe or 0, n_layers) if experts else 0
    if gpu_layers is not None:
        layers = min(gpu_layers, n_layers + 1)
    elif n_cpu_moe is not None and experts:  # asked for (0 too): every layer on the GPU, those experts not
        layers = n_layers + 1
    elif full_gpu <= gpu_free:
        layers = n_layers + 1
    elif experts and full_gpu - sum(experts) <= gpu_free:
        layers = n_layers + 1
        k = next(k for k in range(1, n_layers + 1) if full_gpu - sum(experts[:k]) <= gpu_free)
    else:
        layers = layers_that_fit()
    in_ram = tuple(size if layer < k else 0 for layer, size in enumerate(experts))
    return ExpertPlacement(layers, tuple(experts), in_ram, k)
