"""Engine A/B: the same model at the same precision on two engines with matched settings, cold start in phases
over N repetitions, then a load sweep on each engine in turn, peak memory sampled from the engine's process
tree. From that: ratios with their spread, the amortization verdict (after how long a slower-starting but
faster engine pays back), cost per million output tokens, and the scenario table.

The runner never branches on an engine's name: adapters and the launch plan carry every difference. One side
may be an attached endpoint (`endpoint:NAME` or `endpoint:URL`, see `desktop.core.engines.external`): it is already
running somewhere else, so it has no cold start and no process whose memory could be sampled; the report says so.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from desktop.core.common.defaults import DEFAULT_READY_TIMEOUT
from desktop.core.common.errors import SwitchyardError
from desktop.core.common.progress import ProgressCallback, ProgressEvent, no_progress
from desktop.core.engines import get_adapter, require_install
from desktop.core.engines.base import LaunchPlan
from desktop.core.machine.hardware import HardwareSnapshot, detect
from desktop.core.measure.energy import PowerSampler, energy_cost
from desktop.core.measure.loadgen import (
    LoadConfig,
    RandomWorkload,
    SweepResult,
    Target,
    check_target,
    run_sweep_sync,
    sweep_levels,
)
from desktop.core.measure.loadgen.metrics import LiveBucket
from desktop.core.measure.loadgen.workload import tokenizer_counter
from desktop.core.planning.planner import Checked, asks, engine_fields, plan_launch
from desktop.core.runtime.proctree import tree_rss
from desktop.core.runtime.supervisor import EngineProcess
from desktop.core.storage.history import machine_name

MIB = 1024 * 1024
ENDPOINT_PREFIX = "endpoint:"
NO_COLD_START = "attached endpoint, already running: no cold start measured"


def is_attached(engine: str) -> bool:
    """True for `endpoint:NAME_OR_URL`, the A/B's spelling of an attached endpoint."""
    return engine.startswith(ENDPOINT_PREFIX)


# The one reasoning setting (serving.normalize rule 6) is the same on both engines because neither applies one:
# the sweep sends raw /v1/completions, which render no chat template, so a thinking model's template never opens
# its think block. Said in the config's JSON and the report.
REASONING = ("none on both: the A/B sends raw /v1/completions, which render no chat template, so neither engine "
             "thinks")


@dataclass(frozen=True)
class ABConfig:
    """What to compare and how. Defaults fit a 2-core CPU machine (a few minutes per engine)."""

    model: str = "demo"
    engines: tuple[str, str] = ("llama.cpp", "vllm")
    concurrency: tuple[int, ...] = (1, 8, 32)
    repetitions: int = 1
    requests_per_level: int = 32
    input_len: int = 64
    output_len: int = 32
    ctx: int = 512  # per request, both engines
    parallel: int | None = None  # slots = max_num_seqs; default: the highest concurrency
    prefix_cache: bool = False  # off on both: a fair A/B
    kv_cache_gib: float | None = 1.0
    threads: int | None = None
    dtype: str = "auto"  # the checkpoint's; the demo on vLLM's CPU backend gets float32 (planning.fit.launch_dtype)
    eager: bool = False  # vLLM: --enforce-eager (skips torch.compile: starts sooner, may serve slower)
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT
    request_timeout_s: float = 300.0
    expected_concurrency: int | None = None  # for the verdict; default: the middle level
    price_per_hour: float | None = None  # per GPU-/machine-hour, in the user's currency
    power_watts: float | None = None  # or: power draw x electricity price
    price_per_kwh: float | None = None
    service_lifetime_h: float = 8.0
    seed: int = 0
    replay: Any = None  # a loadgen.replay.ReplaySchedule: the recorded traffic, sent open loop after the sweep
    replay_speed: float = 1.0

    def __post_init__(self) -> None:
        if len(self.engines) != 2 or self.engines[0] == self.engines[1]:
            raise SwitchyardError("an A/B needs two different engines", "e.g. --engines llama.cpp,vllm")
        for engine in self.engines:
            if is_attached(engine) and not engine[len(ENDPOINT_PREFIX):].strip():
                raise SwitchyardError(f"{engine!r} names no endpoint", "e.g. --engines llama.cpp,endpoint:team-vllm")
        if self.repetitions < 1:
            raise SwitchyardError("repetitions must be at least 1")
        if not self.concurrency or min(self.concurrency) < 1:
            raise SwitchyardError("concurrency levels must be positive integers", "e.g. --concurrency 1,8,32")

    @property
    def slots(self) -> int:
        return self.parallel or max(self.concurrency)

    def hourly_price(self) -> tuple[float, str]:
        """Price of one hour of the machine, and its unit (machine-hours when nothing was set)."""
        if self.price_per_hour is not None:
            return self.price_per_hour, "currency"
        if self.power_watts is not None and self.price_per_kwh is not None:
            return self.power_watts / 1000.0 * self.price_per_kwh, "currency (power x electricity)"
        return 1.0, "machine-hours"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["engines"] = list(self.engines)
        data["concurrency"] = list(self.concurrency)
        data["replay"] = self.replay.to_json() if self.replay is not None else None  # its summary, not every item
        data["reasoning"] = REASONING
        return data


class MemorySampler:
    """Samples the RSS of an engine's whole process tree (vLLM forks an engine core) in a thread."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        self.pid = pid
        self.interval = interval
        self.phase = "cold_start"
        self.series: list[tuple[float, float, str]] = []  # (seconds since start, MiB, phase)
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)

    def start(self) -> MemorySampler:
        self._thread.start()
        return self

    def rss_mib(self) -> float | None:
        total = tree_rss(self.pid)
        return None if total is None else total / MIB

    def _run(self) -> None:
        while not self._stop.is_set():
            value = self.rss_mib()
            if value is not None:
                phase = self.phase
                self.series.append((round(time.monotonic() - self._t0, 2), round(value, 1), phase))
                self.peaks[phase] = max(self.peaks.get(phase, 0.0), value)
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@dataclass
class Repetition:
    cold_start: dict[str, Any]
    sweep: SweepResult | None
    peak_rss_mib: dict[str, float]
    memory: list[tuple[float, float, str]]
    error: str | None = None
    replay: Any = None  # a loadgen.replay.ReplayResult when the A/B replays recorded traffic
    power: list[tuple[float, float]] = field(default_factory=list)  # (wall time, GPU watts) where NVML reports it

    def to_json(self, include_requests: bool = False) -> dict[str, Any]:
        return {"cold_start": self.cold_start, "sweep": self.sweep.to_json(include_requests) if self.sweep else None,
                "peak_rss_mib": self.peak_rss_mib, "memory": [list(row) for row in self.memory],
                "error": self.error, "replay": self.replay.to_json(include_requests) if self.replay else None,
                "power_samples": len(self.power)}


@dataclass
class EngineResult:
    engine: str
    display_name: str
    version: str
    model_path: str
    plan: dict[str, Any]
    repetitions: list[Repetition] = field(default_factory=list)
    error: str | None = None
    kind: str = "local"  # "local": started here; "external": an attached endpoint
    note: str | None = None

    @property
    def attached(self) -> bool:
        return self.kind == "external"

    def cold_start_for_cost(self) -> float | None:
        """T3 cold start to amortize: none for an attached endpoint (already running), so 0 there."""
        if self.attached:
            return 0.0
        return _mean(self.cold_phase("t3_first_request_s"))

    def cold_phase(self, name: str) -> list[float]:
        return [float(r.cold_start[name]) for r in self.repetitions if r.cold_start.get(name) is not None]

    def level_values(self, concurrency: int, key: str) -> list[float]:
        values = []
        for rep in self.repetitions:
            for level in rep.sweep.levels if rep.sweep else []:
                if level.config.concurrency == concurrency and level.summary.completed:
                    values.append(float(level.summary.to_json()[key]))
        return values

    def level_energy(self, concurrency: int, price_per_kwh: float | None) -> dict[str, Any] | None:
        """Measured GPU energy of this level (mean over repetitions that have power samples), per 1M tokens."""
        costs = []
        for rep in self.repetitions:
            for level in rep.sweep.levels if rep.sweep and rep.power else []:
                if level.config.concurrency == concurrency and level.summary.completed:
                    cost = energy_cost(rep.power, level.started_at, level.started_at + level.summary.duration,
                                       level.summary.total_output_tokens, price_per_kwh)
                    if cost is not None:
                        costs.append(cost)
        if not costs:
            return None
        prices = [c.cost_per_million_output_tokens for c in costs if c.cost_per_million_output_tokens is not None]
        return {"mean_power_w": _mean([c.mean_power_w for c in costs]),
                "wh_per_million_tokens": _mean([c.wh_per_million_tokens for c in costs]),
                "energy_cost_per_million": _mean(prices) if prices else None,
                "samples": sum(c.samples for c in costs)}

    def peak_rss(self) -> float | None:
        peaks = [max(r.peak_rss_mib.values()) for r in self.repetitions if r.peak_rss_mib]
        return max(peaks) if peaks else None

    def to_json(self, include_requests: bool = False) -> dict[str, Any]:
        return {"engine": self.engine, "display_name": self.display_name, "version": self.version,
                "kind": self.kind, "note": self.note,
                "model_path": self.model_path, "plan": self.plan, "error": self.error,
                "peak_rss_mib": self.peak_rss(),
                "repetitions": [r.to_json(include_requests) for r in self.repetitions]}


@dataclass
class Spread:
    """A value over repetitions: mean, min, max, n."""

    mean: float | None
    low: float | None
    high: float | None
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        clean = [v for v in values if v is not None]
        if not clean:
            return cls(None, None, None, 0)
        return cls(statistics.fmean(clean), min(clean), max(clean), len(clean))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _ratios(a: list[float], b: list[float]) -> list[float]:
    """B/A per repetition pair (the spread shows run-to-run noise)."""
    return [y / x for x, y in zip(a, b, strict=False) if x]


@dataclass
class ABResult:
    config: ABConfig
    machine: str
    started_at: float
    finished_at: float
    engines: list[EngineResult]
    comparison: list[dict[str, Any]]  # one row per concurrency level
    cold_start: dict[str, Any]
    amortization: dict[str, Any]
    costs: list[dict[str, Any]]
    scenarios: list[dict[str, Any]]
    replay: dict[str, Any] | None = None  # both engines on the recorded traffic (issue 25), when replayed
    crossover: dict[str, Any] | None = None  # planning.crossover's picture of this A/B
    quality: dict[str, Any] | None = None  # each side's weights and measured quality (measure.quality_gap)

    @property
    def errors(self) -> list[str]:
        return [f"{e.engine}: {e.error}" for e in self.engines if e.error]

    def to_json(self, include_requests: bool = False) -> dict[str, Any]:
        return {"kind": "ab", "config": self.config.to_json(), "machine": self.machine,
                "started_at": self.started_at, "finished_at": self.finished_at,
                "engines": [e.to_json(include_requests) for e in self.engines], "comparison": self.comparison,
                "cold_start": self.cold_start, "amortization": self.amortization, "costs": self.costs,
                "scenarios": self.scenarios, "errors": self.errors, "replay": self.replay,
                "crossover": self.crossover, "quality": self.quality}


# --- running ----------------------------------------------------------------------------------------------
def engine_asks(name: str, config: ABConfig, hardware: HardwareSnapshot) -> dict[str, Any]:
    """The A/B's matched settings as one engine's asks: the shared ones on both, each engine only its own."""
    adapter = get_adapter(name)
    wanted = asks(ctx_per_request=config.ctx, slots=config.slots, prefix_cache=config.prefix_cache,
                  threads=config.threads, dtype=config.dtype, eager=config.eager,
                  kv_cache_gib=None if hardware.cuda_gpus else config.kv_cache_gib)
    return {k: v for k, v in wanted.items() if k in engine_fields(adapter)}


def plan_ab(config: ABConfig, hardware: HardwareSnapshot, progress: ProgressCallback = no_progress
            ) -> dict[str, Checked]:
    """Each local engine's checked plan (what `ab --dry-run` prints); the first that does not fit raises."""
    return {get_adapter(name).name: plan_launch(name, config.model, hardware, engine_asks(name, config, hardware),
                                                progress=progress)
            for name in config.engines if not is_attached(name)}


def run_engine(
    name: str,
    config: ABConfig,
    *,
    progress: ProgressCallback = no_progress,
    on_bucket: Callable[[LiveBucket], None] | None = None,
    allow_install: bool = False,
    plan: LaunchPlan | None = None,
    hardware: HardwareSnapshot | None = None,
) -> EngineResult:
    """Cold starts and sweeps on one engine with its checked plan (planned here when not given). Failures are
    recorded in the result, never raised (the other engine's numbers are still worth having)."""
    if is_attached(name):
        return run_attached(name, config, progress=progress, on_bucket=on_bucket)
    adapter = get_adapter(name)
    if plan is None:
        hardware = hardware or detect()
        plan = plan_launch(name, config.model, hardware, engine_asks(name, config, hardware), progress=progress).plan
    model_path = plan.model_path
    install = require_install(adapter, install_missing=allow_install, progress=progress)
    result = EngineResult(adapter.name, adapter.display_name, install.version, str(model_path), plan.to_json())
    counter = _token_counter(config.model, model_path)
    workload = RandomWorkload(input_len=config.input_len, output_len=config.output_len, seed=config.seed)
    base = LoadConfig(num_requests=config.requests_per_level, request_timeout_s=config.request_timeout_s,
                      seed=config.seed)
    levels = sweep_levels(base, concurrency=list(config.concurrency))
    for rep in range(config.repetitions):
        prefix = f"{adapter.name} {rep + 1}/{config.repetitions}"
        progress(ProgressEvent(f"{prefix}: starting {adapter.display_name}"))
        engine = EngineProcess(adapter, plan, install)
        sampler: MemorySampler | None = None
        power: PowerSampler | None = None
        repetition = Repetition({}, None, {}, [])
        result.repetitions.append(repetition)
        try:
            engine.start()
            assert engine.pid is not None
            sampler = MemorySampler(engine.pid).start()
            power = PowerSampler().start()  # issue 25: energy cost where NVML reports power
            cold = engine.wait_ready(timeout=config.ready_timeout_s)
            repetition.cold_start = cold.to_json()
            progress(ProgressEvent(f"{prefix}: ready (health {cold.t1_health_s:.2f} s, first token "
                                   f"{cold.t2_first_token_s:.2f} s, first request {cold.t3_first_request_s:.2f} s)"))
            sampler.phase = "load"

            def engine_gone(process: EngineProcess = engine) -> str | None:
                if process.is_running():
                    return None
                return f"{adapter.display_name} died during the benchmark: {process.failure().message}"

            target = Target(engine.base_url, model=plan.served_model_name, api_key=engine.plan.api_key)
            repetition.sweep = run_sweep_sync(target, workload, levels, progress=_prefixed(progress, prefix),
                                              token_counter=counter, abort_check=engine_gone, on_bucket=on_bucket)
            if repetition.sweep.aborted:
                repetition.error = result.error = repetition.sweep.aborted
            _replay(config, target, repetition, counter, engine_gone, progress, prefix)  # issue 25: open loop
            if repetition.error:
                result.error = repetition.error
        except SwitchyardError as exc:
            repetition.error = result.error = str(exc)
            progress(ProgressEvent(f"{prefix}: failed: {exc}"))
        finally:
            if power is not None:
                repetition.power = power.stop()
            if sampler is not None:
                sampler.stop()
                repetition.peak_rss_mib = {k: round(v, 1) for k, v in sampler.peaks.items()}
                repetition.memory = sampler.series
            engine.stop()
        if result.error:
            break
    return result


def attached_target(name: str) -> Target:
    """The load target of `endpoint:NAME_OR_URL`, with the stored key and TLS choice (no model yet)."""
    from desktop.core.engines.external import resolve_endpoint

    return Target.attached(resolve_endpoint(name[len(ENDPOINT_PREFIX):].strip()))


def run_attached(
    name: str,
    config: ABConfig,
    *,
    progress: ProgressCallback = no_progress,
    on_bucket: Callable[[LiveBucket], None] | None = None,
) -> EngineResult:
    """Sweeps against an attached endpoint (one per repetition, for the spread); no cold start, no memory."""
    from desktop.core.engines.external import ExternalEndpoint, scrape_metrics

    target = attached_target(name)
    result = EngineResult(name, f"{target.name} (attached, {target.root})", "unknown", "", {
        "attached": True, "base_url": target.root, "verify_tls": target.verify_tls,
        "has_api_key": target.api_key is not None}, kind="external", note=NO_COLD_START)
    try:
        target = replace(target, model=check_target(target, timeout=config.request_timeout_s))
    except SwitchyardError as exc:
        result.error = str(exc)
        return result
    result.model_path = target.model or "(the server's default model)"
    with contextlib.suppress(SwitchyardError):
        scraped = scrape_metrics(ExternalEndpoint(target.name or name, target.root, target.api_key,
                                                  target.verify_tls))
        if scraped is not None and scraped[0]:
            result.version = f"{scraped[0]} (detected from /metrics)"
    workload = RandomWorkload(input_len=config.input_len, output_len=config.output_len, seed=config.seed)
    counter = _token_counter(config.model, Path(config.model))  # the same prompts the local side receives
    levels = sweep_levels(LoadConfig(num_requests=config.requests_per_level,
                                     request_timeout_s=config.request_timeout_s, seed=config.seed),
                          concurrency=list(config.concurrency))
    for rep in range(config.repetitions):
        prefix = f"{name} {rep + 1}/{config.repetitions}"
        progress(ProgressEvent(f"{prefix}: {NO_COLD_START}; benchmarking {target.root}"))
        sweep = run_sweep_sync(target, workload, levels, progress=_prefixed(progress, prefix),
                               token_counter=counter, on_bucket=on_bucket)
        repetition = Repetition({"attached": True, "note": NO_COLD_START}, sweep, {}, [])
        result.repetitions.append(repetition)
        if sweep.aborted:
            repetition.error = result.error = sweep.aborted
            break
        _replay(config, target, repetition, counter, None, progress, prefix)
        if repetition.error:
            result.error = repetition.error
            break
    return result


def _replay(config: ABConfig, target: Target, repetition: Repetition, counter: Callable[[str], int] | None,
            abort_check: Callable[[], str | None] | None, progress: ProgressCallback, prefix: str) -> None:
    """After the closed-loop sweep, the recorded traffic open loop (when the A/B replays a profile)."""
    if config.replay is None or repetition.error:
        return
    from desktop.core.measure.loadgen.replay import run_replay_sync

    progress(ProgressEvent(f"{prefix}: replaying {len(config.replay.items)} recorded requests open loop at "
                           f"{config.replay_speed:g}x"))
    repetition.replay = run_replay_sync(target, config.replay, speed=config.replay_speed, token_counter=counter,
                                        request_timeout_s=config.request_timeout_s, abort_check=abort_check,
                                        seed=config.seed)
    if repetition.replay.aborted:
        repetition.error = f"replay: {repetition.replay.aborted}"


def _prefixed(progress: ProgressCallback, prefix: str) -> ProgressCallback:
    return lambda event: progress(replace(event, message=f"{prefix}: {event.message}"))


def _token_counter(spec: str, model_path: Path) -> Callable[[str], int] | None:
    """Exact prompt lengths when the model's tokenizer.json is at hand (the demo, HF folders)."""
    candidates = [model_path / "tokenizer.json"] if model_path.is_dir() else []
    if spec == "demo":
        from desktop.core.models.demo import ensure_demo_model

        candidates.append(ensure_demo_model().hf_dir / "tokenizer.json")
    for candidate in candidates:
        if candidate.is_file():
            return tokenizer_counter(candidate)
    return None


def run_ab(
    config: ABConfig,
    *,
    progress: ProgressCallback = no_progress,
    on_bucket: Callable[[LiveBucket], None] | None = None,
    allow_install: bool = False,
    hardware: HardwareSnapshot | None = None,
) -> ABResult:
    """Run both engines in turn (never at the same time: they would share the cores) and analyse. Both plans are
    checked by the planner first: a bad model, a plan that does not fit or a missing engine fails before anything
    slow starts."""
    plans = plan_ab(config, hardware or detect())
    for name in config.engines:
        if is_attached(name):
            check_target(attached_target(name), timeout=config.request_timeout_s)
        elif not allow_install:
            require_install(get_adapter(name))
    started = time.time()
    engines = [run_engine(name, config, progress=progress, on_bucket=on_bucket, allow_install=allow_install,
                          plan=None if is_attached(name) else plans[get_adapter(name).name].plan)
               for name in config.engines]
    return analyse(config, engines, started, time.time())


# --- analysis ---------------------------------------------------------------------------------------------
def analyse(config: ABConfig, engines: list[EngineResult], started: float, finished: float) -> ABResult:
    a, b = engines
    comparison = []
    for level in config.concurrency:
        row: dict[str, Any] = {"concurrency": level}
        for key in ("output_throughput", "median_ttft_ms", "p95_ttft_ms", "median_tpot_ms", "request_throughput"):
            va, vb = a.level_values(level, key), b.level_values(level, key)
            row[key] = {a.engine: Spread.of(va).to_json(), b.engine: Spread.of(vb).to_json(),
                        "ratio": Spread.of(_ratios(va, vb)).to_json()}
        comparison.append(row)
    cold: dict[str, Any] = {}
    for phase in ("t1_health_s", "t2_first_token_s", "t3_first_request_s"):
        va, vb = a.cold_phase(phase), b.cold_phase(phase)
        cold[phase] = {a.engine: Spread.of(va).to_json(), b.engine: Spread.of(vb).to_json(),
                       "ratio": Spread.of(_ratios(va, vb)).to_json()}
    cold["peak_rss_mib"] = {a.engine: a.peak_rss(), b.engine: b.peak_rss()}
    cold["notes"] = {e.engine: e.note for e in engines if e.note}
    expected = config.expected_concurrency or sorted(config.concurrency)[len(config.concurrency) // 2]
    amortization = amortization_verdict(a, b, expected)
    costs = unit_costs(config, engines)
    scenarios = scenario_table(config, engines)
    return ABResult(config, machine_name(), started, finished, engines, comparison, cold, amortization, costs,
                    scenarios, replay_comparison(config, engines), ab_crossover(config, engines, started),
                    ab_quality(config, engines))


def ab_quality(config: ABConfig, engines: list[EngineResult]) -> dict[str, Any] | None:
    """Each local side's weights and their quality measured here: the gap an A/B across formats also measures."""
    from desktop.core.measure.quality_gap import gap_line, sides
    from desktop.core.planning.evidence import gather

    try:
        quality = gather(config.model).quality
    except Exception:  # noqa: BLE001 - an unreadable history must not lose the A/B: the sides say "not measured"
        quality = None
    found = sides([(e.engine, e.model_path, e.plan) for e in engines if not e.attached], quality)
    return {"sides": [side.to_json() for side in found], "line": gap_line(found, config.model)} if found else None


def replay_comparison(config: ABConfig, engines: list[EngineResult]) -> dict[str, Any] | None:
    """Per engine, the replayed traffic's numbers (mean over repetitions) and how close sends kept to schedule."""
    if config.replay is None:
        return None
    keys = ("completed", "failed", "output_throughput", "request_throughput", "median_ttft_ms", "p95_ttft_ms",
            "p95_e2el_ms", "median_itl_ms")
    out: dict[str, Any] = {"schedule": config.replay.to_json(), "speed": config.replay_speed, "engines": {}}
    for engine in engines:
        runs = [r.replay for r in engine.repetitions if r.replay is not None]
        if not runs:
            out["engines"][engine.engine] = None
            continue
        summaries = [run.summary.to_json() for run in runs]
        cell: dict[str, Any] = {key: _mean([float(s[key]) for s in summaries]) for key in keys}
        cell["send_lag_p95_ms"] = max((run.lag_stats()["p95_ms"] or 0.0) for run in runs)
        cell["warnings"] = sorted({w for run in runs for w in run.warnings})
        out["engines"][engine.engine] = cell
    return out


def ab_crossover(config: ABConfig, engines: list[EngineResult], started: float) -> dict[str, Any] | None:
    """The crossover picture from this A/B's own curves (planning.crossover), at the expected concurrency."""
    from desktop.core.planning.crossover import EngineCurve, crossover

    curves = []
    for engine in engines:
        points = []
        for level in config.concurrency:
            tput = _mean(engine.level_values(level, "output_throughput"))
            if tput is not None:
                points.append((level, tput, _mean(engine.level_values(level, "p95_ttft_ms"))))
        curves.append(EngineCurve.measured_points(engine.engine, points, started,
                                                  cold_start_s=engine.cold_start_for_cost()))
    expected = config.expected_concurrency or sorted(config.concurrency)[len(config.concurrency) // 2]
    return crossover(curves, operating_concurrency=float(expected),
                     operating_source="typed" if config.expected_concurrency else None).to_json()


def _nearest(levels: tuple[int, ...], wanted: int) -> int:
    return min(levels, key=lambda level: (abs(level - wanted), level))


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def amortization_verdict(a: EngineResult, b: EngineResult, concurrency: int) -> dict[str, Any]:
    """Break-even service lifetime L*: both engines have produced the same tokens L seconds after spawn,
    ta (L - ca) = tb (L - cb)  =>  L* = (tb cb - ta ca) / (tb - ta). Before L* the faster starter is ahead."""
    ca, cb = _mean(a.cold_phase("t3_first_request_s")), _mean(b.cold_phase("t3_first_request_s"))
    ta, tb = _mean(a.level_values(concurrency, "output_throughput")), _mean(b.level_values(concurrency,
                                                                                            "output_throughput"))
    out: dict[str, Any] = {"concurrency": concurrency, "cold_start_s": {a.engine: ca, b.engine: cb},
                           "output_throughput": {a.engine: ta, b.engine: tb}, "break_even_s": None}
    attached = [e.engine for e in (a, b) if e.attached]
    if attached:
        if ta is None or tb is None:
            out["verdict"] = (f"{' and '.join(attached)}: {NO_COLD_START}; not enough data to compare throughput "
                              f"at concurrency {concurrency}")
            return out
        fast, slow = (a, b) if ta >= tb else (b, a)
        out["verdict"] = (f"{' and '.join(attached)}: {NO_COLD_START}, so only steady-state speed is compared: "
                          f"{fast.engine} serves {max(ta, tb) / max(min(ta, tb), 1e-9):.2f}x the tokens/s of "
                          f"{slow.engine} at concurrency {concurrency}")
        return out
    if None in (ca, cb, ta, tb):
        out["verdict"] = "not enough data: one engine did not finish its cold start or its run at this load"
        return out
    assert ca is not None and cb is not None and ta is not None and tb is not None
    start_winner = a if ca <= cb else b
    fast = a if ta >= tb else b
    if start_winner is fast:
        out["verdict"] = (f"{fast.engine} starts faster ({min(ca, cb):.1f} s vs {max(ca, cb):.1f} s) and serves "
                          f"more tokens/s at concurrency {concurrency}: it wins at any service lifetime")
        return out
    lifetime = (tb * cb - ta * ca) / (tb - ta)
    out["break_even_s"] = lifetime
    out["verdict"] = (f"{fast.engine} starts {abs(cb - ca):.1f} s slower but serves "
                      f"{max(ta, tb) / max(min(ta, tb), 1e-9):.2f}x the tokens/s at concurrency {concurrency}: it pays "
                      f"back after {_duration(lifetime)} of saturated service; for shorter lives (frequent "
                      f"restarts) {start_winner.engine} is ahead")
    return out


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def cost_per_million(price_per_hour: float, tokens_per_s: float, cold_s: float, lifetime_s: float) -> float:
    """Cost of 1M output tokens when the machine is paid for the cold start plus `lifetime_s` of saturated
    service at `tokens_per_s` (the cold start amortized over the lifetime)."""
    paid_hours = (cold_s + lifetime_s) / 3600.0
    return price_per_hour * paid_hours / (tokens_per_s * lifetime_s) * 1e6


def unit_costs(config: ABConfig, engines: list[EngineResult]) -> list[dict[str, Any]]:
    price, unit = config.hourly_price()
    lifetime = config.service_lifetime_h * 3600.0
    rows = []
    for engine in engines:
        cold = engine.cold_start_for_cost() or 0.0
        for level in config.concurrency:
            tput = _mean(engine.level_values(level, "output_throughput"))
            rows.append({
                "engine": engine.engine, "concurrency": level, "output_throughput": tput,
                "cost_per_million_output_tokens": cost_per_million(price, tput, cold, lifetime) if tput else None,
                "steady_state_cost_per_million": price / 3600.0 / tput * 1e6 if tput else None,
                "unit": unit, "price_per_hour": price, "service_lifetime_h": config.service_lifetime_h,
                # measured energy (NVML power x time x price per kWh), beside the hourly price; None without power
                "energy": engine.level_energy(level, config.price_per_kwh),
            })
    return rows


SCENARIOS = (
    # name, what matters, concurrency (None = highest level), lifetime in seconds
    ("Local development, frequent restarts", "time to first answer after each restart", 1, 10 * 60.0),
    ("Edge / CPU box, few users", "memory and steady single-stream speed", 8, 24 * 3600.0),
    ("High-concurrency API", "throughput and tail TTFT under load", None, 7 * 24 * 3600.0),
    ("Offline batch job", "total throughput; start time barely matters", None, 2 * 3600.0),
)


def scenario_table(config: ABConfig, engines: list[EngineResult]) -> list[dict[str, Any]]:
    """The seed's scenarios filled in with this machine's numbers; the winner serves more tokens in the
    scenario's lifetime (cold start included), with the deciding numbers beside it."""
    price, unit = config.hourly_price()
    rows = []
    for name, concern, wanted, lifetime in SCENARIOS:
        level = _nearest(config.concurrency, wanted if wanted is not None else max(config.concurrency))
        cells: dict[str, Any] = {}
        best: tuple[float, str] | None = None
        for engine in engines:
            cold = engine.cold_start_for_cost()
            tput = _mean(engine.level_values(level, "output_throughput"))
            p95 = _mean(engine.level_values(level, "p95_ttft_ms"))
            served = tput * max(0.0, lifetime - cold) if tput is not None and cold is not None else None
            cells[engine.engine] = {
                "cold_start_s": None if engine.attached else cold, "output_throughput": tput, "p95_ttft_ms": p95,
                "peak_rss_mib": engine.peak_rss(), "tokens_in_lifetime": served,
                "cost_per_million_output_tokens": cost_per_million(price, tput, cold, lifetime)
                if tput and cold is not None else None,
                "attached": engine.attached,
            }
            score = served
            if name.startswith("Local development"):
                # A developer restarts and asks once: the first answer's wait decides, not saturated throughput.
                ttft = _mean(engine.level_values(level, "median_ttft_ms"))
                first_answer = None if cold is None else cold + (ttft or 0.0) / 1000.0
                cells[engine.engine]["first_answer_after_restart_s"] = first_answer
                score = None if first_answer is None else -first_answer
            if score is not None and (best is None or score > best[0]):
                best = (score, engine.engine)
        if name.startswith("Edge"):  # memory decides on a small box when speeds are close
            rss = {e.engine: e.peak_rss() for e in engines}
            leaner = min((e for e in rss if rss[e] is not None), key=lambda e: rss[e] or 0.0, default=None)
            cells["leaner"] = leaner
        rows.append({"scenario": name, "concern": concern, "concurrency": level, "lifetime_s": lifetime,
                     "engines": cells, "winner": best[1] if best else None, "unit": unit})
    return rows
