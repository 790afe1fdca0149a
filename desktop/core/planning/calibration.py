"""Per-machine memory corrections: what the engines reported here, per component, against what the fit predicted.

`switchyard calibrate` (a short probe launch per installed engine) and every launch the app makes whose engine
printed its memory lines store one row per component (weights, KV cache, compute, total) in history's
`memory_points`, keyed by the *accelerator set* (GPU models and sizes, or the CPU model and its matrix
extensions), not the host name. The next fit on the same accelerators scales each component by the median
measured/predicted ratio of the newest points of that engine (at least one point; at most CORRECTION_WINDOW),
and says so in its notes. On a GPU this is where CUDA graphs, the CUDA context and activation peaks get
measured numbers; on this CPU box it catches what the formulas miss for this build.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any

from desktop.core.engines.memory_report import GIB, MemoryReport
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.planning.fit import FitResult, exact_bytes, normalise_engine
from desktop.core.storage.history import MemoryPoint, Store

PARTS = ("weights", "repacked", "kv_cache", "compute")
CORRECTION_WINDOW = 12  # newest points per component that decide the ratio
MARGIN = 0.002  # below this a ratio is the logs' rounding: the fit is left as it is
ENGINE_FIT_MARGIN = 0.10  # llama-server's own --fit projection vs ours: beyond this the disagreement is explained


def accelerator_set(hardware: HardwareSnapshot, engine: str | None = None) -> str:
    """The key corrections are stored under: the GPUs an engine would use (model and total memory each), or the
    CPU (model and the matrix extensions llama.cpp's CPU backend chooses kernels by)."""
    gpus = hardware.cuda_gpus if engine and normalise_engine(engine) == "vllm" else hardware.gpus
    if gpus:
        return "gpu:" + ",".join(sorted(f"{g.name} {round(g.memory_total_bytes / GIB)}GiB" for g in gpus))
    cpu = hardware.cpu
    flags = [f for f, on in (("avx2", cpu.avx2), ("avx512", cpu.avx512), ("amx", cpu.amx)) if on] if cpu else []
    return "cpu:" + (cpu.model if cpu else "unknown") + (f" [{' '.join(flags)}]" if flags else "")


def components(engine: str, report: MemoryReport, fit: FitResult) -> dict[str, tuple[float, float]]:
    """component -> (predicted bytes, measured bytes), for what the engine reported; `total` over those.
    vLLM's CPU build reports its KV space but no activation peak, so compute is only compared where reported."""
    predicted = exact_bytes(fit)
    out: dict[str, tuple[float, float]] = {}
    for part in PARTS:
        measured = report.components.get(part)
        if measured is not None and measured > 0 and part in predicted:
            out[part] = (float(predicted[part]), float(measured))
        elif part == "repacked" and predicted.get(part) and "weights" in report.components:
            out[part] = (float(predicted[part]), 0.0)  # a copy the fit counted and the engine did not make
    if out:
        out["total"] = (sum(p for p, _ in out.values()), sum(m for _, m in out.values()))
    if normalise_engine(engine) == "vllm" and report.kv_cache_tokens and fit.kv_cache_tokens:
        out["kv_tokens"] = (float(fit.kv_cache_tokens), float(report.kv_cache_tokens))
    return out


def points_for(engine: str, version: str | None, model: str | None, report: MemoryReport, fit: FitResult,
               hardware: HardwareSnapshot, source: str, run_id: int | None = None,
               settings: dict[str, Any] | None = None) -> list[MemoryPoint]:
    key = accelerator_set(hardware, engine)
    return [MemoryPoint(key, normalise_engine(engine), part, predicted, measured, source, version, model, run_id,
                        dict(settings or {}))
            for part, (predicted, measured) in components(engine, report, fit).items()]


@dataclass(frozen=True)
class Correction:
    """The median measured/predicted ratio of one component on one accelerator set."""

    component: str
    ratio: float
    points: int
    newest: float

    def to_json(self) -> dict[str, Any]:
        return {"component": self.component, "ratio": round(self.ratio, 4), "points": self.points}


def corrections(store: Store, hardware: HardwareSnapshot, engine: str) -> dict[str, Correction]:
    """This accelerator set's corrections for `engine`, from its newest points."""
    key = accelerator_set(hardware, engine)
    rows = store.memory_points(key, normalise_engine(engine), limit=CORRECTION_WINDOW * 8)
    out: dict[str, Correction] = {}
    for part in (*PARTS, "total", "kv_tokens"):
        chosen = [r for r in rows if r.component == part and r.predicted_bytes > 0][:CORRECTION_WINDOW]
        if chosen:
            ratio = statistics.median(r.measured_bytes / r.predicted_bytes for r in chosen)
            out[part] = Correction(part, ratio, len(chosen), max(r.created_at for r in chosen))
    return out


def apply(result: FitResult, found: dict[str, Correction], accelerators: str) -> FitResult:
    """`result` with each component scaled by its measured ratio (those beyond MARGIN); the verdict turns "no"
    when the corrected total no longer fits. The uncorrected numbers stay in `breakdown` (`predicted.*`)."""
    scale = {part: c.ratio for part, c in found.items() if part in PARTS and abs(c.ratio - 1) >= MARGIN}
    if not scale:
        return result
    base = exact_bytes(result)
    delta = sum(base.get(part, 0.0) * (ratio - 1) for part, ratio in scale.items())
    weights = result.weights_gib + base.get("weights", 0.0) * (scale.get("weights", 1.0) - 1) / GIB
    kv = result.kv_cache_gib + base.get("kv_cache", 0.0) * (scale.get("kv_cache", 1.0) - 1) / GIB
    overhead = result.overhead_gib + base.get("compute", 0.0) * (scale.get("compute", 1.0) - 1) / GIB
    total = round(result.total_gib + delta / GIB, 3)
    headroom = round(result.available_gib - total, 3)
    fits = result.fits if headroom >= 0 or result.fits == "no" else "no"
    n = max(c.points for c in found.values())
    parts = ", ".join(f"{part} x{ratio:.2f}" for part, ratio in scale.items())
    note = (f"corrected by {n} measured launch{'es' if n > 1 else ''} on {accelerators} "
            f"(`switchyard calibrate`): {parts}")
    breakdown = {**result.breakdown, **{f"predicted.{k}": v for k, v in base.items()},
                 **{f"bytes.{k}": base[k] * ratio for k, ratio in scale.items() if k in base},
                 "calibration_delta_gib": round(delta / GIB, 4)}
    cpu_ram = round(result.cpu_ram_gib + delta / GIB, 3) if result.device == "CPU" else result.cpu_ram_gib
    return replace(result, weights_gib=round(weights, 3), kv_cache_gib=round(kv, 3), overhead_gib=round(overhead, 3),
                   total_gib=total, headroom_gib=headroom, fits=fits, cpu_ram_gib=cpu_ram, breakdown=breakdown,
                   notes=[*result.notes, note])


def corrected(result: FitResult, hardware: HardwareSnapshot, store: Store | None = None) -> FitResult:
    """The fit corrected by this accelerator set's stored points (opens history unless a store is given)."""
    if store is None:
        with Store() as own:
            return corrected(result, hardware, own)
    return apply(result, corrections(store, hardware, result.engine), accelerator_set(hardware, result.engine))


@dataclass(frozen=True)
class SecondOpinion:
    """llama-server's own `--fit` projection for the plan next to ours, and why they differ when they do."""

    engine_bytes: int
    ours_bytes: int
    explanation: str | None

    @property
    def relative(self) -> float:
        return (self.ours_bytes - self.engine_bytes) / self.engine_bytes if self.engine_bytes else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"engine_mib": round(self.engine_bytes / 2**20, 1), "ours_mib": round(self.ours_bytes / 2**20, 1),
                "relative": round(self.relative, 4), "explanation": self.explanation}


def second_opinion(report: MemoryReport, fit: FitResult) -> SecondOpinion | None:
    """Compare llama-server's `projected to use N MiB` (its --fit dry run, host or device) with our total.

    Known reasons for a gap are named: its projection counts whole MiB per device and leaves out the host
    output buffer when a GPU holds the layers; it leaves out the repacked (AMX/CPU_REPACK) copy of the weights
    (common/fit.cpp:78-98), so ours is compared without it; and it sees the real free memory of each device where
    ours may be told another machine."""
    projected = report.engine_fit_bytes.get("device") or report.engine_fit_bytes.get("host")
    if not projected:
        return None
    ours = int(sum(exact_bytes(fit).get(k, 0.0) for k in PARTS if k != "repacked"))
    opinion = SecondOpinion(projected, ours, None)
    if abs(opinion.relative) <= ENGINE_FIT_MARGIN:
        return opinion
    reasons = []
    if ours > projected:
        reasons.append("ours is the larger: it sizes every slot's full context and compute for the worst case")
    else:
        reasons.append("the engine's is the larger: it measures buffers our formulas do not model for this "
                       "backend; `switchyard calibrate` stores the measured difference for the next fit")
    return replace(opinion, explanation="; ".join(reasons))
