"""The crossover picture: where one engine's measured throughput overtakes the other's as concurrency grows, where
the workload operates, and after how long the slower starter's cold start pays back there.

Pure functions over curves. A curve is an engine's output throughput and TTFT p95 per concurrency level, tagged
"as measured on this machine on DATE" (an A/B or bench run from history) or "default" (the recommender's default
figures, relative to llama.cpp = 1.0, where nothing was measured); the verdict is worded by `planning.basis`,
which says "measures" only over measured curves. Between measured levels throughput is
interpolated on log2(concurrency), as `planning.evidence` does; outside them it is held at the nearest level.

Break-even service time at the operating point c (engine a starts faster, engine b serves faster there):
    ta (L - ca) = tb (L - cb)  =>  L* = (tb cb - ta ca) / (tb - ta)
the same rule as the A/B's amortization verdict (`measure.ab.amortization_verdict`), now at the workload's c.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from desktop.core.planning.basis import (
    DEFAULT_TAG,
    faster_everywhere,
    measured_tag,
    qualified,
    workload_basis,
)
from desktop.core.planning.evidence import model_key
from desktop.core.planning.fit import normalise_engine
from desktop.core.planning.recommend import (
    DEFAULT_COLD_START_S,
    DEFAULT_CPU_COLD_START_S,
    default_gain,
)
from desktop.core.storage.history import RunRecord, machine_name

DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class CurvePoint:
    concurrency: int
    output_tok_s: float
    ttft_p95_ms: float | None = None


@dataclass(frozen=True)
class EngineCurve:
    """One engine's throughput/TTFT over concurrency, with where the numbers came from."""

    engine: str
    points: tuple[CurvePoint, ...]
    tag: str = DEFAULT_TAG
    cold_start_s: float | None = None
    cold_start_tag: str = DEFAULT_TAG
    run_id: int | None = None
    relative: bool = False  # default curves: throughput relative to llama.cpp's (1.0), not tokens/s
    cpu: bool = False  # which defaults a default curve holds (vLLM's CPU build or a GPU)

    @property
    def measured(self) -> bool:
        return self.tag != DEFAULT_TAG

    @classmethod
    def measured_points(cls, engine: str, points: Iterable[tuple[int, float, float | None]], created_at: float,
                        cold_start_s: float | None = None, run_id: int | None = None,
                        cold_created_at: float | None = None) -> EngineCurve:
        clean = tuple(sorted((CurvePoint(int(c), float(t), None if p is None else float(p))
                              for c, t, p in points if t is not None and t > 0), key=lambda p: p.concurrency))
        return cls(engine, clean, measured_tag(created_at), cold_start_s,
                   measured_tag(cold_created_at or created_at) if cold_start_s is not None else DEFAULT_TAG, run_id)

    @classmethod
    def default(cls, engine: str, cpu: bool) -> EngineCurve:
        """The recommender's default figures: llama.cpp 1.0 at every level, vLLM its default gain over it."""
        name = normalise_engine(engine)
        colds = DEFAULT_CPU_COLD_START_S if cpu else DEFAULT_COLD_START_S
        return cls(name, tuple(CurvePoint(c, _relative(name, c, cpu)) for c in DEFAULT_LEVELS), DEFAULT_TAG, colds.get(name),
                   DEFAULT_TAG, relative=True, cpu=cpu)

    def at(self, concurrency: float) -> float | None:
        """Throughput at `concurrency`, log2-interpolated between levels, held at the nearest outside them."""
        points = self.points
        if not points:
            return None
        if concurrency <= points[0].concurrency:
            return points[0].output_tok_s
        if concurrency >= points[-1].concurrency:
            return points[-1].output_tok_s
        for p0, p1 in zip(points, points[1:], strict=False):
            if p0.concurrency <= concurrency <= p1.concurrency:
                share = (math.log2(concurrency) - math.log2(p0.concurrency)) / \
                    (math.log2(p1.concurrency) - math.log2(p0.concurrency))
                return p0.output_tok_s + (p1.output_tok_s - p0.output_tok_s) * share
        return None  # pragma: no cover

    def to_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "tag": self.tag, "measured": self.measured, "relative": self.relative,
                "run_id": self.run_id, "cold_start_s": self.cold_start_s, "cold_start_tag": self.cold_start_tag,
                "points": [{"concurrency": p.concurrency, "output_tok_s": p.output_tok_s,
                            "ttft_p95_ms": p.ttft_p95_ms} for p in self.points]}


@dataclass
class Crossover:
    """The picture: both curves, the crossover, the operating point and the break-even there."""

    curves: list[EngineCurve]
    base: str  # the engine that starts faster (llama.cpp)
    other: str
    crossover_concurrency: float | None  # where `other` overtakes `base`; None: it never does where measured
    other_faster_everywhere: bool
    operating_concurrency: float | None
    faster_at_operating: str | None
    break_even_s: float | None  # service time after which `other`'s heavier cold start has paid back
    verdict: str
    notes: list[str] = field(default_factory=list)

    def curve(self, engine: str) -> EngineCurve | None:
        return next((c for c in self.curves if c.engine == engine), None)

    def to_json(self) -> dict[str, Any]:
        return {"curves": [c.to_json() for c in self.curves], "base": self.base, "other": self.other,
                "crossover_concurrency": self.crossover_concurrency,
                "other_faster_everywhere": self.other_faster_everywhere,
                "operating_concurrency": self.operating_concurrency, "faster_at_operating": self.faster_at_operating,
                "break_even_s": self.break_even_s, "verdict": self.verdict, "notes": list(self.notes)}


def _levels(curves: Sequence[EngineCurve]) -> list[int]:
    return sorted({p.concurrency for c in curves for p in c.points})


def crossover(curves: Sequence[EngineCurve], operating_concurrency: float | None = None,
              operating_source: str | None = None) -> Crossover:
    """The crossover of two curves. The base is the faster starter (llama.cpp when both cold starts are unknown
    or equal): the question is always whether the heavier engine's throughput is worth its start.
    `operating_source`: where the operating point came from ("traffic", "typed"), said in the verdict."""
    if len(curves) != 2:
        raise ValueError("a crossover needs exactly two curves")
    a, b = curves
    if (b.cold_start_s or 0.0) < (a.cold_start_s or 0.0) or (b.engine == "llama.cpp" and a.engine != "llama.cpp"):
        a, b = b, a
    notes = []
    if a.relative != b.relative:
        notes.append("one curve is measured, the other default: the default one is the measured one times the "
                     "default ratio between the engines")
        a, b = _absolute(a, b), _absolute(b, a)
    levels = _levels((a, b))
    diffs = [(c, (b.at(c) or 0.0) - (a.at(c) or 0.0)) for c in levels]
    cross: float | None = None
    everywhere = bool(diffs) and all(d > 0 for _, d in diffs)
    if everywhere:
        cross = float(levels[0])
    else:
        for (c0, d0), (c1, d1) in zip(diffs, diffs[1:], strict=False):
            if d0 <= 0 < d1:
                share = -d0 / (d1 - d0)  # linear in the difference, on log2 c between the two levels
                cross = round(2 ** (math.log2(c0) + (math.log2(c1) - math.log2(c0)) * share), 2)
                break
    op = operating_concurrency
    faster = None
    break_even = None
    if op is not None:
        ta, tb = a.at(op), b.at(op)
        if ta is not None and tb is not None:
            faster = b.engine if tb > ta else a.engine
            ca, cb = a.cold_start_s, b.cold_start_s
            if tb > ta and ca is not None and cb is not None:
                break_even = max(0.0, (tb * cb - ta * ca) / (tb - ta))
    verdict = _verdict(a, b, cross, everywhere, op, faster, break_even, workload_basis(operating_source))
    return Crossover([a, b], a.engine, b.engine, cross, everywhere, op, faster, break_even, verdict, notes)


def _relative(engine: str, concurrency: float, cpu: bool) -> float:
    """The default throughput of `engine` relative to llama.cpp's (1.0)."""
    return default_gain(max(1, round(concurrency)), cpu) if engine == "vllm" else 1.0


def _absolute(curve: EngineCurve, reference: EngineCurve) -> EngineCurve:
    """A default (relative) curve in tokens/s: the measured reference times the default ratio of the engines."""
    if not curve.relative or reference.relative or not reference.points:
        return curve
    points = tuple(CurvePoint(p.concurrency, p.output_tok_s * _relative(curve.engine, p.concurrency, curve.cpu)
                              / _relative(reference.engine, p.concurrency, curve.cpu)) for p in reference.points)
    return EngineCurve(curve.engine, points, curve.tag, curve.cold_start_s, curve.cold_start_tag, curve.run_id,
                       relative=False, cpu=curve.cpu)


def _verdict(a: EngineCurve, b: EngineCurve, cross: float | None, everywhere: bool, op: float | None,
             faster: str | None, break_even: float | None, workload: str = "") -> str:
    """In words (planning.basis): "measures" only over measured curves; default figures say so, and how to
    measure them; the operating point says where it came from."""
    tags = [(a.engine, a.tag), (b.engine, b.tag)]
    where = (f"at concurrency {op:g}" + (f" ({workload})" if workload else "")) if op is not None else ""
    if cross is None:
        return faster_everywhere(a.engine, b.engine, _levels((a, b)), tags,
                                 f"{b.engine}'s heavier start never pays back here")
    head = (f"{b.engine} is faster at every concurrency" if everywhere
            else f"{b.engine} overtakes {a.engine} at concurrency {cross:g}")
    if op is None or faster is None:
        return qualified(head, tags)
    if faster == a.engine:
        return qualified(f"{head}; the workload runs {where}, below it: {a.engine} serves it faster", tags)
    payback = f"; its cold start pays back after {_duration(break_even)} of service" if break_even is not None else ""
    return qualified(f"{head}; the workload runs {where}: {b.engine} serves it faster{payback}", tags)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


# --- from history ---------------------------------------------------------------------------------------------
def _mean(cell: Any) -> float | None:
    value = cell.get("mean") if isinstance(cell, dict) else cell
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _run_curves(run: RunRecord) -> dict[str, EngineCurve]:
    out: dict[str, EngineCurve] = {}
    if run.kind == "ab":
        for engine in (e for e in (run.engine or "").split(",") if e and not e.startswith("endpoint:")):
            points = [(int(row["concurrency"]), _mean((row.get("output_throughput") or {}).get(engine)),
                       _mean((row.get("p95_ttft_ms") or {}).get(engine)))
                      for row in run.summary.get("comparison") or []]
            cold = _mean(((run.summary.get("cold_start") or {}).get("t3_first_request_s") or {}).get(engine))
            usable = [(c, t, p) for c, t, p in points if t]
            if usable:
                name = normalise_engine(engine)
                out[name] = EngineCurve.measured_points(name, usable, run.created_at, cold, run.id)
    elif run.kind == "bench" and run.engine:
        points = [(int(level["max_concurrency"]), level.get("output_throughput"), level.get("p95_ttft_ms"))
                  for level in run.summary.get("levels") or [] if level.get("max_concurrency")
                  and level.get("completed")]
        cold = (run.summary.get("cold_start") or {}).get("t3_first_request_s")
        usable = [(c, float(t), p) for c, t, p in points if isinstance(t, (int, float)) and t > 0]
        if usable:
            name = normalise_engine(run.engine)
            out[name] = EngineCurve.measured_points(name, usable, run.created_at,
                                                    float(cold) if isinstance(cold, (int, float)) else None, run.id)
    return out


def curves_from_history(runs: Iterable[RunRecord], model: str, *, cpu: bool,
                        engines: tuple[str, str] = ("llama.cpp", "vllm"), machine: str | None = None
                        ) -> list[EngineCurve]:
    """Per engine the newest A/B or bench curve of `model` on this machine (runs newest first), its newest
    measured cold start (launches count too), else the default curve."""
    machine = machine or machine_name()
    key = model_key(model)
    curves: dict[str, EngineCurve] = {}
    colds: dict[str, tuple[float, float]] = {}
    for run in runs:
        if run.machine != machine or model_key(run.model) != key:
            continue
        if run.kind == "launch" and run.engine:
            value = (run.summary.get("cold_start") or {}).get("t3_first_request_s")
            if isinstance(value, (int, float)):
                colds.setdefault(normalise_engine(run.engine), (float(value), run.created_at))
            continue
        for engine, curve in _run_curves(run).items():
            curves.setdefault(engine, curve)
            if curve.cold_start_s is not None:
                colds.setdefault(engine, (curve.cold_start_s, run.created_at))
    out = []
    for engine in engines:
        curve = curves.get(engine) or EngineCurve.default(engine, cpu)
        if engine in colds:
            seconds, when = colds[engine]
            curve = EngineCurve(curve.engine, curve.points, curve.tag, seconds, measured_tag(when), curve.run_id,
                                curve.relative, curve.cpu)
        out.append(curve)
    return out


__all__ = ["DEFAULT_TAG", "Crossover", "CurvePoint", "EngineCurve", "crossover", "curves_from_history",
           "measured_tag"]
