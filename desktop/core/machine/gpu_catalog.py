"""A table of common datacenter and workstation accelerators, so `fit --gpu NAME` can answer for hardware the
user does not have, and so throughput guesses have a memory bandwidth to start from.

Figures are vendors' published dense BF16 tensor TFLOPS (no sparsity), memory bandwidth in GB/s, and the memory
NVML reports (`memory_mib`, a little under the marketing GiB). Rounded; good for planning, not for benchmarks.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from desktop.core.common.errors import SwitchyardError


@dataclass(frozen=True)
class GpuSpec:
    name: str
    vendor: str  # nvidia | amd | apple | intel
    memory_gib: float  # marketing size
    memory_mib: int  # what NVML / the driver reports as total
    bf16_tflops: float
    bandwidth_gbs: float
    compute_capability: str | None  # NVIDIA "8.9"; AMD gfx target; None elsewhere
    aliases: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["aliases"] = list(self.aliases)
        return data


GPU_TABLE: tuple[GpuSpec, ...] = (
    GpuSpec("NVIDIA H200", "nvidia", 141, 143771, 989, 4800, "9.0", ("h200", "h200 sxm")),
    GpuSpec("NVIDIA H100 80GB HBM3", "nvidia", 80, 81559, 989, 3350, "9.0", ("h100", "h100 sxm", "h100 80gb")),
    GpuSpec("NVIDIA H100 PCIe", "nvidia", 80, 81559, 756, 2000, "9.0", ("h100 pcie",)),
    GpuSpec("NVIDIA H100 NVL", "nvidia", 94, 95830, 835, 3900, "9.0", ("h100 nvl",)),
    GpuSpec("NVIDIA GH200", "nvidia", 96, 97871, 989, 4000, "9.0", ("gh200",)),
    GpuSpec("NVIDIA B200", "nvidia", 180, 183359, 2250, 8000, "10.0", ("b200",)),
    GpuSpec("NVIDIA A100-SXM4-80GB", "nvidia", 80, 81920, 312, 2039, "8.0", ("a100", "a100 80gb", "a100-80gb")),
    GpuSpec("NVIDIA A100-SXM4-40GB", "nvidia", 40, 40960, 312, 1555, "8.0", ("a100 40gb", "a100-40gb")),
    GpuSpec("NVIDIA L40S", "nvidia", 48, 46068, 362, 864, "8.9", ("l40s",)),
    GpuSpec("NVIDIA L40", "nvidia", 48, 46068, 181, 864, "8.9", ("l40",)),
    GpuSpec("NVIDIA L4", "nvidia", 24, 23034, 121, 300, "8.9", ("l4",)),
    GpuSpec("NVIDIA A10", "nvidia", 24, 23028, 125, 600, "8.6", ("a10", "a10g")),
    GpuSpec("NVIDIA A40", "nvidia", 48, 46068, 150, 696, "8.6", ("a40",)),
    GpuSpec("NVIDIA RTX A6000", "nvidia", 48, 49140, 155, 768, "8.6", ("a6000", "rtx a6000")),
    GpuSpec("NVIDIA RTX 6000 Ada Generation", "nvidia", 48, 49140, 365, 960, "8.9", ("rtx 6000 ada", "6000 ada")),
    GpuSpec("NVIDIA RTX PRO 6000 Blackwell", "nvidia", 96, 97887, 500, 1790, "12.0", ("rtx pro 6000",)),
    GpuSpec("NVIDIA V100-SXM2-32GB", "nvidia", 32, 32768, 125, 900, "7.0", ("v100", "v100 32gb")),
    GpuSpec("NVIDIA T4", "nvidia", 16, 15360, 65, 320, "7.5", ("t4",)),
    GpuSpec("NVIDIA GeForce RTX 5090", "nvidia", 32, 32607, 209, 1792, "12.0", ("5090", "rtx 5090")),
    GpuSpec("NVIDIA GeForce RTX 4090", "nvidia", 24, 24564, 165, 1008, "8.9", ("4090", "rtx 4090")),
    GpuSpec("NVIDIA GeForce RTX 4080", "nvidia", 16, 16376, 97, 717, "8.9", ("4080", "rtx 4080")),
    GpuSpec("NVIDIA GeForce RTX 4070", "nvidia", 12, 12282, 58, 504, "8.9", ("4070", "rtx 4070")),
    GpuSpec("NVIDIA GeForce RTX 4060 Ti 16GB", "nvidia", 16, 16380, 44, 288, "8.9", ("4060 ti", "rtx 4060 ti")),
    GpuSpec("NVIDIA GeForce RTX 4060", "nvidia", 8, 8188, 30, 272, "8.9", ("4060", "rtx 4060")),
    GpuSpec("NVIDIA GeForce RTX 3090", "nvidia", 24, 24576, 71, 936, "8.6", ("3090", "rtx 3090")),
    GpuSpec("NVIDIA GeForce RTX 3080", "nvidia", 10, 10240, 59, 760, "8.6", ("3080", "rtx 3080")),
    GpuSpec("NVIDIA GeForce RTX 3060", "nvidia", 12, 12288, 25, 360, "8.6", ("3060", "rtx 3060")),
    GpuSpec("AMD Instinct MI300X", "amd", 192, 196592, 1307, 5300, "gfx942", ("mi300x",)),
    GpuSpec("AMD Instinct MI250X", "amd", 128, 131072, 383, 3277, "gfx90a", ("mi250x",)),
    GpuSpec("AMD Radeon RX 7900 XTX", "amd", 24, 24560, 123, 960, "gfx1100", ("7900 xtx", "rx 7900 xtx")),
    GpuSpec("Apple M2 Max", "apple", 32, 32768, 27, 400, None, ("m2 max",)),
    GpuSpec("Apple M3 Max", "apple", 64, 65536, 28, 400, None, ("m3 max",)),
    GpuSpec("Apple M2 Ultra", "apple", 192, 196608, 54, 800, None, ("m2 ultra",)),
)


def _normalise(name: str) -> str:
    text = name.lower().replace("nvidia", "").replace("geforce", "").replace("_", " ")
    return re.sub(r"\s+", " ", text).strip()


def find_gpu(name: str) -> GpuSpec | None:
    """The table entry for a GPU name as NVML or a user writes it ("4090", "H100 80GB HBM3"), or None."""
    wanted = _normalise(name)
    if not wanted:
        return None
    for spec in GPU_TABLE:
        if wanted == _normalise(spec.name) or wanted in spec.aliases:
            return spec
    # Longest alias contained in the name wins, so "RTX 4060 Ti" does not match plain "4060".
    best: tuple[int, GpuSpec] | None = None
    for spec in GPU_TABLE:
        for alias in (*spec.aliases, _normalise(spec.name)):
            if re.search(rf"(?<![\w]){re.escape(alias)}(?![\w])", wanted) and (best is None or len(alias) > best[0]):
                best = (len(alias), spec)
    return best[1] if best else None


def require_gpu(name: str) -> GpuSpec:
    spec = find_gpu(name)
    if spec is None:
        known = ", ".join(sorted({s.aliases[0] if s.aliases else s.name for s in GPU_TABLE}))
        raise SwitchyardError(f"unknown GPU '{name}'", f"pick one of: {known}, or pass --gpu-mem-gib instead")
    return spec
