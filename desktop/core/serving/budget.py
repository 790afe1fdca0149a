"""The memory the endpoint's engines share, and what each checked plan holds there: whether two engines run side by
side or one must stop first (standby, stop-first switching, the fleet's LRU swap and reloads)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from desktop.core.engines.base import LaunchPlan
from desktop.core.machine.hardware import HardwareSnapshot, detect
from desktop.core.planning.swap import Need, engine_need

log = logging.getLogger("switchyard.endpoint")


@dataclass
class MemoryBudget:
    """The memory the endpoint's engines share (free VRAM per GPU on a GPU machine, and RAM) and what each checked
    plan holds there, both from the fit, so the endpoint can tell whether two engines run side by side or one must
    stop first. Needs are compared per GPU: a TP=2 vLLM must fit on each of its two GPUs, not in their sum. Tests
    inject a simulated budget (`free_bytes` and `need`, one shared pool)."""

    free_bytes: float
    hardware: HardwareSnapshot | None = None
    need: Callable[[LaunchPlan], float] | None = None
    label: str = "GPU memory"
    _cache: dict[str, Need] = field(default_factory=dict)

    def need_of(self, plan: LaunchPlan) -> Need:
        key = repr(replace(plan, port=0, api_key=None))
        if key not in self._cache:
            if self.need is not None:
                self._cache[key] = Need({-1: self.need(plan)}, 0.0)
            else:
                assert self.hardware is not None
                self._cache[key] = engine_need(plan, self.hardware)
        return self._cache[key]

    def _free(self) -> dict[int, float]:
        if self.need is not None or self.hardware is None:
            return {-1: self.free_bytes}
        return {g.index: float(g.memory_free_bytes) for g in self.hardware.gpus if g.memory_total_bytes > 0}

    def fits(self, plans: Iterable[LaunchPlan]) -> bool:
        used: dict[int, float] = {}
        ram = 0.0
        for plan in plans:
            need = self.need_of(plan)
            ram += need.ram
            for index, amount in need.gpu.items():
                used[index] = used.get(index, 0.0) + amount
        free = self._free()
        if any(amount > free.get(index, 0.0) for index, amount in used.items()):
            return False
        return self.hardware is None or self.need is not None or ram <= self.hardware.ram_available_bytes

    def describe(self, plans: Iterable[LaunchPlan]) -> str:
        chosen = list(plans)
        needs = " + ".join(f"{p.engine} {self.need_of(p).gpu_total / 2**30:.2f}" for p in chosen)
        free = self._free()
        per_gpu = "" if len(free) < 2 else " (" + ", ".join(f"GPU {i}: {b / 2**30:.2f}" for i, b in free.items()) + ")"
        return f"{needs} GiB vs {self.free_bytes / 2**30:.2f} GiB of free {self.label}{per_gpu}"


def machine_budget(hardware: HardwareSnapshot | None = None) -> MemoryBudget | None:
    """The budget on a machine with a GPU (its free VRAM now); None on a CPU-only one, where engines share RAM and
    a warm switch is decided by memory_allows_standby as before."""
    try:
        snapshot = hardware or detect()
    except Exception:  # detection problems must not stop serving: warm switches, as before
        log.exception("hardware detection failed; switches start the new engine before stopping the old one")
        return None
    gpus = [g for g in snapshot.gpus if g.memory_total_bytes > 0 and not g.unified_memory]
    if not gpus:
        return None
    return MemoryBudget(float(sum(g.memory_free_bytes for g in gpus)), hardware=snapshot)


def memory_allows_standby(engine_rss_bytes: float, available_bytes: float, headroom: float = 1.5) -> bool:
    """Keep an engine warm only when the machine would still have `headroom` × its size free."""
    return engine_rss_bytes > 0 and available_bytes > engine_rss_bytes * headroom
