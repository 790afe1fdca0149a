"""A fit's verdict and the numbers behind it: the one result every sizing path returns (planning.fit) and the
prompt cache's count adds to (planning.promptcache), in a module of its own so that neither imports the other."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from desktop.core.engines.base import LaunchPlan

Verdict = Literal["yes", "partial", "no"]


@dataclass(frozen=True)
class FitResult:
    """The verdict and the numbers behind it. GiB throughout; for vLLM with tensor parallel, per GPU."""

    engine: str
    fits: Verdict
    weights_gib: float
    kv_cache_gib: float
    overhead_gib: float
    total_gib: float
    available_gib: float
    headroom_gib: float
    device: str  # what it runs on: "1x NVIDIA GeForce RTX 4090", "CPU", ...
    ctx: int
    gpu_layers: int | None = None
    total_layers: int | None = None
    cpu_ram_gib: float = 0.0  # host memory the engine needs besides the GPU part
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    quant: str | None = None
    breakdown: dict[str, float] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)  # the engine's own names for what was checked
    notes: list[str] = field(default_factory=list)
    plan: LaunchPlan | None = None  # the plan checked, every memory-relevant field resolved: launch exactly this

    def to_json(self) -> dict[str, Any]:
        data = asdict(replace(self, plan=None))
        data["plan"] = self.plan.to_json() if self.plan else None
        return data


__all__ = ["FitResult", "Verdict"]
