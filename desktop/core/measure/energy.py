"""Cost from power: where NVML reports the GPUs' power draw, the A/B's unit cost is also computed from measured
energy (watts integrated over the load level's time x the user's price per kWh), besides the hourly price.

`PowerSampler` records the summed board power of every NVIDIA GPU while an engine runs (nothing, and no error,
where NVML is missing: the report then shows the hourly price alone). `energy_cost` is pure: samples and a time
window in, energy per million output tokens out (trapezoids between samples; the window's edges are held at the
nearest sample, so a level shorter than the sampling interval still gets a number).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

JOULES_PER_KWH = 3.6e6


@dataclass(frozen=True)
class EnergyCost:
    mean_power_w: float
    joules: float
    seconds: float
    wh_per_million_tokens: float
    cost_per_million_output_tokens: float | None  # None without a price per kWh
    samples: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _power_at(samples: Sequence[tuple[float, float]], t: float) -> float:
    """Linear between samples, held at the ends."""
    if t <= samples[0][0]:
        return samples[0][1]
    if t >= samples[-1][0]:
        return samples[-1][1]
    for (t0, w0), (t1, w1) in zip(samples, samples[1:], strict=False):
        if t0 <= t <= t1:
            return w0 if t1 == t0 else w0 + (w1 - w0) * (t - t0) / (t1 - t0)
    return samples[-1][1]  # pragma: no cover


def energy_cost(samples: Sequence[tuple[float, float]], start: float, end: float, output_tokens: int,
                price_per_kwh: float | None) -> EnergyCost | None:
    """Energy of [start, end] from (wall time, watts) samples, per million output tokens; None without samples,
    tokens or time."""
    ordered = sorted(samples)
    if not ordered or output_tokens <= 0 or end <= start:
        return None
    inside = [(t, w) for t, w in ordered if start < t < end]
    points = [(start, _power_at(ordered, start)), *inside, (end, _power_at(ordered, end))]
    joules = sum((t1 - t0) * (w0 + w1) / 2.0 for (t0, w0), (t1, w1) in zip(points, points[1:], strict=False))
    seconds = end - start
    per_million_j = joules / output_tokens * 1e6
    cost = per_million_j / JOULES_PER_KWH * price_per_kwh if price_per_kwh is not None else None
    return EnergyCost(round(joules / seconds, 3), round(joules, 3), round(seconds, 3),
                      per_million_j / 3600.0, cost,
                      len([p for p in ordered if start <= p[0] <= end]))


class PowerSampler:
    """Summed GPU board power (W) every `interval` seconds in a thread, through NVML (runtime.telemetry)."""

    def __init__(self, interval: float = 0.5, gpu: Any = None) -> None:
        if gpu is None:
            from desktop.core.runtime.telemetry import GpuSampler

            gpu = GpuSampler()
        self._gpu = gpu
        self.interval = interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return not getattr(self._gpu, "unavailable", None)

    def sample_once(self) -> None:
        now = time.time()
        watts = [s.value for s in self._gpu.sample_once(now) if s.series == "gpu_power_w"]
        if watts:
            self.samples.append((now, float(sum(watts))))

    def start(self) -> PowerSampler:
        if self.available:
            self._thread = threading.Thread(target=self._run, name="gpu-power", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval)

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return self.samples


__all__ = ["EnergyCost", "PowerSampler", "energy_cost"]
