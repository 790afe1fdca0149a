"""What this machine's history says about an engine and a model, so the advice rests on measurements.

Read from the SQLite history (desktop.core.storage.history): A/B runs and bench runs give output throughput and
TTFT per concurrency level; A/B, bench and plain launches give cold starts (T3: spawn to the first request
done); launches give the memory the engine used at load. Per engine this yields figures at the workload's
concurrency (log2-interpolated between measured levels, held at the nearest level outside them) and says where
each figure came from: `measured` with the run's id and date, or `default` where nothing was measured.

When the exact model was never run here, the throughput *ratio* between the engines is taken from the newest A/B
of another model (the nearest evidence there is, and the report says so); absolute cold starts and memory are
only taken from the same model, because they scale with its size.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

from desktop.core.common.defaults import (
    DEFAULT_CTX_PER_REQUEST,
    DEFAULT_VLLM_CPU_KV_GIB,
    DEFAULT_VLLM_UTILIZATION,
)
from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.base import LaunchPlan
from desktop.core.engines.model_path import cache_repo
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.models.facts import ModelFacts
from desktop.core.planning.basis import figure_basis
from desktop.core.planning.fit import FitResult, estimate, normalise_engine, sizing_plan
from desktop.core.storage.history import RunRecord, Store, machine_name

MEASURED = "measured"
DEFAULT = "default"
HISTORY_LIMIT = 500  # newest runs read; older ones rarely describe the machine as it is now
KIND_NAMES = {"ab": "A/B", "bench": "bench run", "launch": "launch"}


@dataclass(frozen=True)
class Figure:
    """One number the advice uses, and where it came from."""

    value: float
    source: str = DEFAULT  # "measured" | "default"
    run_id: int | None = None
    run_date: str | None = None  # ISO date of the run
    note: str | None = None  # interpolation, nearest model, ...

    @property
    def measured(self) -> bool:
        return self.source == MEASURED

    def tag(self) -> str:
        """Where the figure came from, worded by planning.basis: "measured here on 2026-12-01, run #12" or
        "default figure, not measured here", with its note."""
        return figure_basis(self.measured, self.run_date, self.run_id, self.note)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def default(value: float, note: str | None = None) -> Figure:
    return Figure(float(value), DEFAULT, note=note)


@dataclass(frozen=True)
class LevelPoint:
    concurrency: int
    output_tok_s: float
    ttft_ms: float | None = None


@dataclass(frozen=True)
class Curve:
    """Throughput and TTFT of one engine over concurrency levels, from one run."""

    engine: str
    model: str
    run_id: int
    created_at: float
    kind: str  # "ab" | "bench"
    points: tuple[LevelPoint, ...]
    workload: dict[str, Any] = field(default_factory=dict)  # prompt/output lengths it was measured with

    def at(self, concurrency: int, key: str = "output_tok_s") -> tuple[float, str | None] | None:
        """The value at `concurrency` and a note when it was interpolated or held at the nearest level."""
        points = sorted((p.concurrency, getattr(p, key)) for p in self.points if getattr(p, key) is not None)
        if not points:
            return None
        for level, value in points:
            if level == concurrency:
                return float(value), None
        if concurrency < points[0][0]:
            return float(points[0][1]), f"held at c={points[0][0]}, the lowest level measured"
        if concurrency > points[-1][0]:
            return float(points[-1][1]), f"held at c={points[-1][0]}, the highest level measured"
        for (c0, v0), (c1, v1) in zip(points, points[1:], strict=False):
            if c0 < concurrency < c1:
                share = (math.log2(concurrency) - math.log2(c0)) / (math.log2(c1) - math.log2(c0))
                return float(v0 + (v1 - v0) * share), f"interpolated between c={c0} and c={c1}"
        return None  # pragma: no cover - the loop covers every gap


@dataclass(frozen=True)
class LoadMemory:
    """The memory one launch used at load, with the settings it was launched with."""

    engine: str
    run_id: int
    created_at: float
    settings: dict[str, Any]
    measured: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class EngineEvidence:
    engine: str
    cold_start: Figure | None = None
    curve: Curve | None = None
    load_memory: LoadMemory | None = None

    def throughput_at(self, concurrency: int) -> Figure | None:
        return _figure(self.curve, concurrency, "output_tok_s")

    def ttft_at(self, concurrency: int) -> Figure | None:
        return _figure(self.curve, concurrency, "ttft_ms")


@dataclass(frozen=True)
class Gain:
    """vLLM's output throughput over llama.cpp's at one concurrency, measured."""

    value: float
    figures: dict[str, Figure]  # engine -> its throughput there
    note: str | None = None


@dataclass
class Evidence:
    """Everything history says for one model on this machine. Empty when history was not consulted."""

    model: str
    machine: str
    engines: dict[str, EngineEvidence] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    consulted: bool = True
    nearest_ab: Curve | None = None  # set when the model itself has no A/B: the newest A/B of another model
    # the newest `switchyard quality` run of this model here: its summary (measure.quality.QualityReport), run id
    # and date; None when its quantizations were never measured here
    quality: dict[str, Any] | None = None
    _nearest_pair: dict[str, Curve] = field(default_factory=dict, repr=False)

    @classmethod
    def none(cls, model: str = "", why: str = "history not consulted (--no-history)") -> Evidence:
        return cls(model, machine_name(), {}, [why], consulted=False)

    def get(self, engine: str) -> EngineEvidence | None:
        return self.engines.get(normalise_engine(engine))

    def cold_start(self, engine: str) -> Figure | None:
        found = self.get(engine)
        return found.cold_start if found else None

    def gain(self, concurrency: int, base: str = "llama.cpp", other: str = "vllm",
             lengths: tuple[int, int] | None = None) -> Gain | None:
        """other/base throughput at `concurrency`: this model's curves, else the newest A/B of another model.
        `lengths` (prompt, output tokens of the workload) adds a note when the runs used very different ones."""
        b, o = self.get(base), self.get(other)
        fb = b.throughput_at(concurrency) if b else None
        fo = o.throughput_at(concurrency) if o else None
        if b and o and b.curve and o.curve and fb and fo and fb.value > 0:
            note = None
            if b.curve.run_id != o.curve.run_id:
                note = f"from separate runs (#{b.curve.run_id} and #{o.curve.run_id})"
            note = _join(note, _length_note(o.curve, lengths))
            return Gain(fo.value / fb.value, {base: fb, other: fo}, note)
        if base in self._nearest_pair and other in self._nearest_pair:
            cb, co = self._nearest_pair[base], self._nearest_pair[other]
            nb, no = _figure(cb, concurrency, "output_tok_s"), _figure(co, concurrency, "output_tok_s")
            if nb and no and nb.value > 0:
                why = _join(f"nearest measured model: {cb.model} ({self.model} was never run here)",
                            _length_note(co, lengths)) or ""
                return Gain(no.value / nb.value, {base: replace(nb, note=_join(nb.note, why)),
                                                  other: replace(no, note=_join(no.note, why))}, why)
        return None

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "machine": self.machine, "consulted": self.consulted, "notes": self.notes,
                "engines": {name: {"cold_start": e.cold_start.to_json() if e.cold_start else None,
                                   "curve_run_id": e.curve.run_id if e.curve else None,
                                   "load_memory": e.load_memory.to_json() if e.load_memory else None}
                            for name, e in self.engines.items()}}


def _length_note(curve: Curve, lengths: tuple[int, int] | None) -> str | None:
    """Say so when a curve was measured with prompts/outputs far from the workload's (nearest settings)."""
    if lengths is None:
        return None
    prompt, output = curve.workload.get("input_len"), curve.workload.get("output_len")
    if not (isinstance(prompt, int) and isinstance(output, int) and prompt > 0 and output > 0):
        return None
    far = any(max(m, w) / max(min(m, w), 1) > 2 for m, w in ((prompt, lengths[0]), (output, lengths[1])))
    return (f"nearest settings: measured with {prompt}/{output}-token prompts/outputs, the workload asks "
            f"{lengths[0]}/{lengths[1]}") if far else None


def _join(*parts: str | None) -> str | None:
    text = "; ".join(p for p in parts if p)
    return text or None


def run_date(created_at: float) -> str:
    return time.strftime("%Y-%m-%d", time.localtime(created_at))


def _figure(curve: Curve | None, concurrency: int, key: str) -> Figure | None:
    if curve is None:
        return None
    found = curve.at(concurrency, key)
    if found is None:
        return None
    value, note = found
    return Figure(value, MEASURED, curve.run_id, run_date(curve.created_at), note)


# --- matching runs to a model --------------------------------------------------------------------------------
def model_key(text: str | None) -> str:
    """A name that is the same for `demo` / its files, a folder and its Hub repo id, a GGUF path and its stem."""
    if not text:
        return ""
    spec = str(text).strip()
    if spec == "demo" or _is_demo_path(spec):
        return "demo"
    name = spec.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
    if name == "config.json":
        name = spec.rstrip("/\\").replace("\\", "/").rsplit("/", 2)[-2]
    return name.removesuffix(".gguf").lower()


def _is_demo_path(spec: str) -> bool:
    from desktop.core.models.demo import default_root

    try:
        root = default_root().resolve()
        return Path(spec).expanduser().resolve().is_relative_to(root)
    except (OSError, ValueError):
        return False


def _quality_keys(run: RunRecord) -> set[str]:
    """The names a quality run answers to: its model as typed (`org/name:Q8_0` as `org/name` too) and the Hub
    repo its reference lies in (a file pulled into the Hub cache is that repo's variant: `org/name-GGUF`)."""
    keys = {model_key(run.model), model_key((run.model or "").rpartition(":")[0] or run.model)}
    for spec in (run.model, (run.summary or {}).get("reference"), (run.settings or {}).get("reference")):
        repo = cache_repo(str(spec or ""))
        if repo:
            keys.add(model_key(repo))
    return keys - {""}


def model_keys(facts: ModelFacts | str) -> set[str]:
    if isinstance(facts, str):
        return {model_key(facts)} - {""}
    if facts.source == "demo":
        return {"demo"}
    keys = {model_key(v) for v in (facts.name, facts.path, facts.hf_dir, facts.repo_id)}
    repo = cache_repo(str(facts.path or ""))  # a file pulled into the Hub cache answers to its repo too
    return (keys | {model_key(repo)}) - {""}


# --- reading runs --------------------------------------------------------------------------------------------
def _mean(cell: Any) -> float | None:
    value = cell.get("mean") if isinstance(cell, dict) else cell
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _ab_engines(run: RunRecord) -> list[str]:
    names = (run.engine or "").split(",")
    return [n for n in names if n and not n.startswith("endpoint:")]


def _ab_curves(run: RunRecord) -> dict[str, Curve]:
    out: dict[str, Curve] = {}
    config = run.settings or {}
    workload = {"input_len": config.get("input_len"), "output_len": config.get("output_len")}
    for engine in _ab_engines(run):
        points = []
        for row in run.summary.get("comparison") or []:
            tput = _mean((row.get("output_throughput") or {}).get(engine))
            if tput is None or tput <= 0:
                continue
            ttft = _mean((row.get("median_ttft_ms") or {}).get(engine))
            points.append(LevelPoint(int(row["concurrency"]), tput, ttft))
        if points:
            out[normalise_engine(engine)] = Curve(normalise_engine(engine), run.model or "", int(run.id or 0),
                                                  run.created_at, "ab", tuple(points), workload)
    return out


def _bench_curve(run: RunRecord) -> Curve | None:
    if not run.engine:
        return None  # an attached endpoint: no idea which engine served it
    points = []
    workload: dict[str, Any] = {}
    for level in run.summary.get("levels") or []:
        conc = level.get("max_concurrency")
        tput = level.get("output_throughput")
        if not conc or not isinstance(tput, (int, float)) or tput <= 0 or not level.get("completed"):
            continue
        points.append(LevelPoint(int(conc), float(tput), _mean(level.get("median_ttft_ms"))))
        workload = level.get("workload") or workload
    if not points:
        return None
    return Curve(normalise_engine(run.engine), run.model or "", int(run.id or 0), run.created_at, "bench",
                 tuple(points), workload)


def _cold_starts(run: RunRecord) -> dict[str, float]:
    """Engine -> seconds from spawn to the first request done (T3; T1 health when no request was made)."""
    out: dict[str, float] = {}
    if run.kind == "ab":
        phases = run.summary.get("cold_start") or {}
        for engine in _ab_engines(run):
            value = _mean((phases.get("t3_first_request_s") or {}).get(engine))
            if value is None:
                value = _mean((phases.get("t1_health_s") or {}).get(engine))
            if value is not None:
                out[normalise_engine(engine)] = value
        return out
    cold = run.summary.get("cold_start") or {}
    value = cold.get("t3_first_request_s") if cold.get("t3_first_request_s") is not None else cold.get("t1_health_s")
    if run.engine and isinstance(value, (int, float)):
        out[normalise_engine(run.engine)] = float(value)
    return out


def _warm_compile(run: RunRecord) -> bool:
    """A launch whose engine found its compile cache prepared (`ColdStart.compile_cache` "hit", or "stale": vLLM
    0.32 CPU finds its artefact but recompiles, from a warm Inductor cache)."""
    return run.kind == "launch" and (run.summary.get("cold_start") or {}).get("compile_cache") in ("hit", "stale", "warm")


def _safe_engine(name: str | None) -> str | None:
    try:
        return normalise_engine(name or "")
    except SwitchyardError:
        return None


def from_runs(runs: Iterable[RunRecord], facts: ModelFacts | str, machine: str | None = None) -> Evidence:
    """Evidence for `facts` from `runs` (newest first), only those from `machine` (default: this one)."""
    machine = machine or machine_name()
    keys = model_keys(facts)
    label = facts if isinstance(facts, str) else facts.name
    evidence = Evidence(label, machine)
    cold: dict[str, Figure] = {}
    warm: dict[str, Figure] = {}  # the newest start that loaded its compiled graphs from the cache
    curves: dict[str, Curve] = {}
    memory: dict[str, LoadMemory] = {}
    nearest: dict[str, Curve] = {}
    for run in runs:
        if run.kind == "quality" and run.machine == machine and evidence.quality is None \
                and _quality_keys(run) & keys:
            evidence.quality = {**run.summary, "run_id": run.id, "run_date": run_date(run.created_at)}
        if run.machine != machine or run.kind not in ("ab", "bench", "launch"):
            continue
        exact = model_key(run.model) in keys
        if run.kind == "ab" and not exact and not nearest:
            pair = _ab_curves(run)
            if {"llama.cpp", "vllm"} <= set(pair):
                nearest = pair
        if not exact:
            continue
        for engine, seconds in _cold_starts(run).items():
            cold.setdefault(engine, Figure(round(seconds, 3), MEASURED, run.id, run_date(run.created_at),
                                           f"T3 cold start, {KIND_NAMES.get(run.kind, run.kind)}"))
            if _warm_compile(run) and engine not in warm:  # its compile cache was prepared: starts are this short
                warm[engine] = Figure(round(seconds, 3), MEASURED, run.id, run_date(run.created_at),
                                      f"T3 cold start with a warm compile cache, {KIND_NAMES.get(run.kind, run.kind)}")
        if run.kind == "ab":
            for engine, curve in _ab_curves(run).items():
                curves.setdefault(engine, curve)
        elif run.kind == "bench":
            bench = _bench_curve(run)
            if bench is not None:
                curves.setdefault(bench.engine, bench)
        elif run.kind == "launch":
            launched = _safe_engine(run.engine)
            measured = run.summary.get("load_memory") or {}
            if launched and measured and launched not in memory:
                memory[launched] = LoadMemory(launched, int(run.id or 0), run.created_at, dict(run.settings),
                                              measured)
    cold.update(warm)  # a prepared (warm) start is what the next start will be like, not a first compile
    for engine in sorted(set(cold) | set(curves) | set(memory)):
        evidence.engines[engine] = EngineEvidence(engine, cold.get(engine), curves.get(engine), memory.get(engine))
    if nearest and not ({"llama.cpp", "vllm"} <= set(curves)):
        evidence._nearest_pair = nearest
        evidence.nearest_ab = next(iter(nearest.values()))
    if not evidence.engines and not nearest and evidence.quality is None:
        evidence.notes.append(f"no runs of {label} on this machine in history: default figures throughout")
    return evidence


def gather(facts: ModelFacts | str, store: Store | None = None, limit: int = HISTORY_LIMIT) -> Evidence:
    """This machine's evidence for a model, read from the history database (opened here unless given)."""
    if store is not None:
        return from_runs(store.runs(limit=limit), facts)
    with Store() as own:
        return from_runs(own.runs(limit=limit), facts)


# --- the fit, corrected by a real launch ---------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryCheck:
    """Predicted vs measured memory of the newest launch of this model and engine (GiB)."""

    run_id: int
    run_date: str
    what: str  # what was compared: "resident memory (RSS)", "KV cache", ...
    predicted_gib: float
    measured_gib: float

    @property
    def error_gib(self) -> float:
        return self.measured_gib - self.predicted_gib

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["error_gib"] = round(self.error_gib, 3)
        return data


_PLAN_FIELDS = frozenset(f.name for f in dataclass_fields(LaunchPlan))


def _launch_plan(memory: LoadMemory) -> LaunchPlan:
    """The plan that launch ran (history keeps LaunchPlan.to_json(); rows from before the one-plan change used
    `ctx`/`parallel`), for the fit to predict it again."""
    s = memory.settings
    if s.get("model_path") and s.get("engine"):
        try:  # the exact launched plan: tensor parallel, quantization, KV dtype, batched tokens and all
            plan = LaunchPlan.from_json({k: v for k, v in s.items() if k in _PLAN_FIELDS})
            return replace(plan, engine=memory.engine)
        except (SwitchyardError, TypeError, ValueError):
            pass
    ctx = int(s.get("ctx_per_request") or s.get("ctx") or DEFAULT_CTX_PER_REQUEST)
    slots = max(1, int(s.get("slots") or s.get("parallel") or 1))
    if memory.engine == "llama.cpp":
        return sizing_plan("llama.cpp", ctx_per_request=ctx, slots=slots, gpu_layers=s.get("gpu_layers"),
                           kv_cache_type=s.get("kv_cache_type"))
    return sizing_plan("vllm", ctx_per_request=ctx, slots=slots,
                       gpu_memory_utilization=float(s.get("gpu_memory_utilization") or DEFAULT_VLLM_UTILIZATION),
                       kv_cache_gib=float(s.get("kv_cache_gib") or DEFAULT_VLLM_CPU_KV_GIB), eager=bool(s.get("eager")),
                       dtype=str(s.get("dtype") or "auto"))


def memory_checks(facts: ModelFacts, hardware: HardwareSnapshot, memory: LoadMemory) -> list[MemoryCheck]:
    """What the fit predicted for that launch's settings next to what the launch measured."""
    predicted = estimate(facts, hardware, _launch_plan(memory))
    date = run_date(memory.created_at)
    checks = []
    measured = memory.measured
    parts = (("weights_gib", "weights", predicted.weights_gib), ("kv_cache_gib", "KV cache", predicted.kv_cache_gib))
    for key, what, value in parts:
        if isinstance(measured.get(key), (int, float)):
            checks.append(MemoryCheck(memory.run_id, date, what, round(value, 3), float(measured[key])))
    if predicted.device == "CPU" and isinstance(measured.get("rss_gib"), (int, float)):
        # without llama-server's prompt cache: it fills later, as prompts come and go, never by the load measured
        at_load = predicted.total_gib - float(predicted.breakdown.get("prompt_cache", 0.0))
        checks.append(MemoryCheck(memory.run_id, date, "total (process RSS)", round(at_load, 3),
                                  float(measured["rss_gib"])))
    return checks


def corrected_fit(result: FitResult, checks: list[MemoryCheck]) -> FitResult:
    """`result` with the error the last launch showed added back: the next fit learns from the real launch.

    The measured-minus-predicted difference of the total (CPU: process RSS) or of the parts the engine logged
    (weights, KV cache) moves the overhead; the verdict flips to "no" when the headroom goes negative.
    """
    total_checks = [c for c in checks if c.what.startswith("total")]
    delta = total_checks[0].error_gib if total_checks else 0.0
    if not total_checks:
        delta = sum(c.error_gib for c in checks if c.what == "weights")
    if not checks or abs(delta) < 0.005:
        return result
    source = checks[0]
    total = round(result.total_gib + delta, 3)
    headroom = round(result.available_gib - total, 3)
    fits = result.fits if headroom >= 0 or result.fits == "no" else "no"
    note = (f"corrected by launch #{source.run_id} ({source.run_date}): it measured {delta:+.2f} GiB against "
            f"the estimate")
    return replace(result, overhead_gib=round(result.overhead_gib + delta, 3), total_gib=total,
                   headroom_gib=headroom, fits=fits, cpu_ram_gib=round(result.cpu_ram_gib + delta, 3)
                   if result.device == "CPU" else result.cpu_ram_gib,
                   breakdown={**result.breakdown, "measured_correction": round(delta, 3)},
                   notes=[*result.notes, note])


# --- "measure it here" ---------------------------------------------------------------------------------------
MEASURE_REQUESTS = 16
MEASURE_LEVEL_S = 20.0  # a level of 16 short requests on one engine, roughly, on a small machine


def measure_job(model: str, concurrency: int, cold_start_s: dict[str, float]) -> tuple[dict[str, Any], float]:
    """A short A/B (the Compare page's job) that replaces the default figures for this model and workload,
    and its estimated duration in seconds: both cold starts plus a few short levels per engine."""
    levels = sorted({1, max(1, min(concurrency, 32))})
    job = {"kind": "ab", "config": {"model": model, "engines": ["llama.cpp", "vllm"], "concurrency": levels,
                                    "repetitions": 1, "requests_per_level": MEASURE_REQUESTS, "output_len": 32}}
    seconds = sum(cold_start_s.values()) + 2 * len(levels) * MEASURE_LEVEL_S
    return job, seconds


__all__ = ["DEFAULT", "MEASURED", "Curve", "EngineEvidence", "Evidence", "Figure", "Gain", "LevelPoint",
           "LoadMemory", "MemoryCheck", "corrected_fit", "default", "from_runs", "gather", "measure_job", "memory_checks",
           "model_key", "model_keys", "run_date"]
