"""llama-server's prompt cache in host RAM: how much of it a plan allows (`--cache-ram N`, MiB) and where the fit
counts it.

With the prefix cache on (`--cache-prompt`, the default), a slot keeps the KV of its last prompt, so the next request
that starts the same way evaluates only what is new. Besides that, llama-server b11434 keeps a host-RAM prompt cache
(tools/server/server-task.h `server_prompt_cache`; server-context.cpp:1484-1492): when a slot is taken over by a
different prompt, the KV of the old one is copied out (`prompt_save`, a `std::vector<uint8_t>` in host memory,
whatever device the layers run on) and loaded back when a request for it returns. Its limit is `--cache-ram N` MiB
(common/arg.cpp:1719, `cache_ram_mib = 8192` in common/common.h:638; -1 = no limit, 0 = no RAM cache); the cache
fills up to that limit as different prompts come and go, so an engine that started within the fit's RAM can grow 8
GiB past it an hour later.

So the plan states the limit and the fit counts it, never the engine's silent default:
- prefix cache off: 0 (a saved prompt would never be reused: `cache_prompt` off evaluates every prompt whole);
- asked for (`-- --cache-ram N`, or a plan that already says it: the argv read back, a running engine's plan):
  that, counted, and the verdict is "no" when it does not fit beside the engine;
- otherwise min(8192 MiB, half of the host RAM the fit leaves free after the engine's own needs): the other half
  stays for everything else on the machine (the desktop, a second engine of the hybrid endpoint or the fleet,
  whose budget adds both engines' RAM), and 0 when nothing is left.
The chosen amount is added to the fit's host-RAM sum (`cpu_ram_gib`; on a CPU plan also its total and headroom).
vLLM needs none of this: its prefix cache reuses blocks of the KV pool the fit already counts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.base import LaunchPlan
from desktop.core.machine.hardware import GIB, MIB, HardwareSnapshot

if TYPE_CHECKING:
    from desktop.core.planning.fit_result import FitResult

LLAMA_CACHE_RAM_DEFAULT_MIB = 8192  # llama.cpp b11434 common/common.h:638 `cache_ram_mib = 8192`
SPARE_SHARE = 0.5  # the share of the RAM left after the engine's own needs the cache may take


def host_need_bytes(result: FitResult, hardware: HardwareSnapshot) -> float:
    """The host RAM the fit says the engine itself needs: its CPU part (all of it on a CPU plan), plus, on unified
    memory, what it holds "on the GPU" (the same RAM)."""
    need = result.cpu_ram_gib * GIB
    if result.device != "CPU" and hardware.has_unified_memory:
        need += float(result.breakdown.get("gpu_used", 0.0)) * GIB
    return need


def chosen_mib(available_bytes: float, need_bytes: float) -> int:
    """min(8192, half of what is left) in whole MiB; 0 when nothing is left."""
    spare = max(0.0, available_bytes - need_bytes) * SPARE_SHARE
    return int(min(LLAMA_CACHE_RAM_DEFAULT_MIB, spare // MIB))


def count(result: FitResult, plan: LaunchPlan, hardware: HardwareSnapshot) -> FitResult:
    """`result` (a llama.cpp fit of `plan`) with the prompt cache counted in its host RAM and its size in
    `settings["cache_ram_mib"]` (the plan's --cache-ram)."""
    if plan.cache_ram_mib is not None and plan.cache_ram_mib < 0:
        raise SwitchyardError(f"--cache-ram {plan.cache_ram_mib}: the fit cannot count an unbounded prompt cache",
                              "give a number of MiB (0 = none), or leave it out for what this machine can spare")
    need = host_need_bytes(result, hardware)
    notes = list(result.notes)
    if not plan.prefix_cache:
        mib = 0
    elif plan.cache_ram_mib is not None:
        mib = plan.cache_ram_mib
    else:
        mib = chosen_mib(hardware.ram_available_bytes, need)
        if mib < LLAMA_CACHE_RAM_DEFAULT_MIB:
            notes.append(f"llama-server's prompt cache gets {mib:,} MiB of RAM (--cache-ram {mib}; its default "
                         f"{LLAMA_CACHE_RAM_DEFAULT_MIB:,}): half of the RAM this plan leaves free")
    cache = mib * MIB
    fits = result.fits
    if cache and need + cache > hardware.ram_available_bytes and fits != "no":
        fits = "no"
        notes.append(f"--cache-ram {mib} (llama-server's prompt cache, {cache / GIB:.2f} GiB) does not fit in the "
                     f"RAM left beside the engine: lower it, or leave it out for what this machine can spare")
    cpu = result.device == "CPU"
    return replace(result, fits=fits, cpu_ram_gib=round(result.cpu_ram_gib + cache / GIB, 3),
                   total_gib=round(result.total_gib + cache / GIB, 3) if cpu else result.total_gib,
                   headroom_gib=round(result.headroom_gib - cache / GIB, 3) if cpu else result.headroom_gib,
                   breakdown={**result.breakdown, "prompt_cache": round(cache / GIB, 3)},
                   settings={**result.settings, "cache_ram_mib": mib}, notes=notes)
