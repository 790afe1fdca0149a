"""Which engine, which quantization and which launch settings, from hardware + model + workload.

The amortization rule: an engine's cold start C (seconds before it serves) is paid at every restart, and only
its throughput gain over the service's run can repay it. Each engine's useful output over one run is
throughput x (run - C); vLLM must beat llama.cpp by a clear margin (10%) to be worth its heavier start.
Defaults, replaced by this machine's history when `evidence` (desktop.core.planning.evidence) is given:
  cold start: llama.cpp ~20 s, vLLM ~120 s on a GPU (weights load, torch.compile, CUDA graphs), ~60 s on a CPU;
  throughput: on a GPU vLLM ~1x llama.cpp with one request in flight, rising to ~3x at 8 or more (continuous
  batching, paged KV, CUDA graphs); on a CPU ~0.6x rising to ~0.9x (benchmarks/results/ab/: the demo model
  with each engine's default threads on a quiet 2-core machine, vLLM/llama.cpp 0.58 / 0.91 / 0.86 at c=1/8/32;
  with one thread each, 0.68 / 1.43 / 1.51 — the CPU figure depends on threads, so measure it here);
  interpolated on log2(concurrency). Every figure is tagged measured (run id and date) or default.
The 10% margin vLLM must win by covers the uncertainty of default figures; measured figures decide as measured.
vLLM is a candidate for Hugging Face checkpoints on CUDA/ROCm GPUs and on CPUs (its CPU build); llama.cpp runs
everywhere, from a GGUF ladder Q8_0 -> Q6_K -> Q5_K_M -> Q4_K_M -> IQ4_XS -> Q3_K_M (first that fits fully wins;
MoE models also try MXFP4 experts after Q4_K_M, and an MXFP4 checkpoint such as gpt-oss starts at its MXFP4 GGUF).
vLLM is not a candidate for a checkpoint format the GPU's compute capability cannot run (MXFP4 below 8.0).
vLLM is sized by `fit.size_vllm`, the rule export uses too: bf16 at the smallest tensor-parallel size whose KV
cache holds the workload's concurrency, then fp8 (quantized while loading, so it runs on the checkpoint as is).
A 4-bit rung is only ever offered (download an AWQ checkpoint), never launched on bf16 weights: vLLM cannot
quantize to AWQ while loading. The answer is the fit's checked LaunchPlan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.base import LaunchPlan
from desktop.core.engines.runtimes import engine_supported
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.models.facts import ModelFacts
from desktop.core.models.quant_names import bits_per_weight
from desktop.core.models.quants import vllm_capability_refusal
from desktop.core.planning.basis import history_basis
from desktop.core.planning.evidence import Evidence, Figure, corrected_fit, default, memory_checks
from desktop.core.planning.fit import FitResult, estimate, size_vllm, vllm_utilization
from desktop.core.planning.quant_choice import BITS_RULE, choose, measured_quants, quant_key
from desktop.core.planning.weights import gguf_ladder

DEFAULT_COLD_START_S = {"llama.cpp": 20.0, "vllm": 120.0}
DEFAULT_CPU_COLD_START_S = {"llama.cpp": 20.0, "vllm": 60.0}
VLLM_MAX_GAIN = 3.0  # at concurrency >= 8
VLLM_CPU_GAIN = (0.6, 0.9)  # CPU build: at 1 request in flight, at 8 or more (benchmarks/results/ab/)
CLOSE_SCORES = 1.5  # scores within this factor: a short A/B on this machine could change the answer
VLLM_WIN_MARGIN = 1.10
VLLM_LADDER = ("bf16", "fp8", "awq")
MAX_SLOTS = 32
SAFETY_GIB = 0.5  # free GPU memory a llama.cpp pick should leave (desktop apps, fragmentation)


@dataclass(frozen=True)
class Workload:
    concurrency: int = 1  # requests in flight at busy times
    prompt_len: int = 512
    output_len: int = 256
    lifetime_hours: float = 8.0  # how long one server process is expected to live
    restarts_per_day: float = 0.0  # model/setting switches, reboots; 0 = only the lifetime ends a run

    def validate(self) -> None:
        if not (1 <= self.concurrency <= 4096):
            raise SwitchyardError(f"concurrency must be between 1 and 4096, not {self.concurrency}")
        if self.prompt_len < 1 or self.output_len < 1 or self.prompt_len + self.output_len > 16 * 1024 * 1024:
            raise SwitchyardError("prompt and output lengths must be positive and at most 16M tokens together")
        if not (0 < self.lifetime_hours <= 24 * 365):
            raise SwitchyardError(f"lifetime must be between 0 and a year of hours, not {self.lifetime_hours}")
        if not (0 <= self.restarts_per_day <= 24 * 60):
            raise SwitchyardError(f"restarts per day must be between 0 and 1440, not {self.restarts_per_day}")

    @property
    def run_seconds(self) -> float:
        """How long one server process lives: the lifetime, cut short by restarts."""
        run = self.lifetime_hours * 3600.0
        if self.restarts_per_day > 0:
            run = min(run, 86400.0 / self.restarts_per_day)
        return run


@dataclass(frozen=True)
class EngineMeasurement:
    """Measured history for one engine on this machine and model (from the A/B runner or past launches)."""

    engine: str
    cold_start_s: float | None = None
    output_tok_s: float | None = None  # aggregate output throughput
    concurrency: int | None = None  # at which it was measured


@dataclass(frozen=True)
class Recommendation:
    engine: str
    quant: str
    plan: LaunchPlan  # the plan the fit checked: launch, export and print exactly this
    reasons: list[str]
    numbers: dict[str, Any]
    runner_up: dict[str, Any] | None
    fit: FitResult | None = None
    key_settings: dict[str, Any] = field(default_factory=dict)  # ctx, slots/max_num_seqs, -ngl, util, KV type

    @property
    def settings(self) -> dict[str, Any]:
        """The plan as JSON (a view, for readers of the older `settings` dict)."""
        return self.plan.to_json()

    def launch_plan(self) -> LaunchPlan:
        return self.plan

    def to_json(self) -> dict[str, Any]:
        data = asdict(replace(self, fit=None))
        data["plan"] = self.plan.to_json()
        data["fit"] = self.fit.to_json() if self.fit else None
        return data


def _measurements(raw: Any) -> dict[str, EngineMeasurement]:
    if raw is None:
        return {}
    items: Sequence[Any]
    if isinstance(raw, Mapping):
        items = [v if isinstance(v, EngineMeasurement) else EngineMeasurement(engine=str(k), **dict(v))
                 for k, v in raw.items()]
    else:
        items = list(raw)
    out: dict[str, EngineMeasurement] = {}
    for item in items:
        if not isinstance(item, EngineMeasurement):
            raise SwitchyardError("measurements must be EngineMeasurement objects or a {engine: {...}} mapping")
        key = "llama.cpp" if item.engine.lower() in ("llama.cpp", "llamacpp", "llama-server") else item.engine.lower()
        out[key] = item
    return out


def default_gain(concurrency: int, cpu: bool = False) -> float:
    """vLLM's throughput over llama.cpp's: on a GPU ~1x at 1 request in flight, ~3x at 8 or more; on a CPU
    (vLLM's CPU build) ~0.6x rising to ~0.9x (benchmarks/results/ab/, each engine's default threads)."""
    low, high = VLLM_CPU_GAIN if cpu else (1.0, VLLM_MAX_GAIN)
    if concurrency <= 1:
        return low
    return low + (high - low) * min(1.0, math.log2(concurrency) / 3.0)


def _round_ctx(tokens: int, cap: int) -> int:
    ctx = 1024
    while ctx < tokens:
        ctx *= 2
    return max(256, min(ctx, cap))


def _vllm_blocker(facts: ModelFacts, hw: HardwareSnapshot) -> str | None:
    support = engine_supported("vllm", hw)  # the engines room's fact: no vLLM on AMD, Windows or macOS
    if not support.ok:
        return f"{support.reason}; {support.fix}"
    if not hw.cuda_gpus:
        if hw.has_unified_memory:
            return "vLLM has no Metal backend for Apple Silicon"
        return None  # vLLM's CPU build: whether it wins here is for measurements (or the stated default) to say
    if facts.is_gguf and not facts.hf_dir and facts.source != "demo":
        return "the model is a GGUF file; vLLM serves Hugging Face safetensors checkpoints (its GGUF support is experimental)"
    for gpu in hw.cuda_gpus:
        refusal = vllm_capability_refusal(facts.quantization, gpu.name, _cc(gpu.compute_capability or "0"))
        if refusal is not None:
            return refusal
    return None


def _cc(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def _llama_candidates(facts: ModelFacts) -> list[str | None]:
    if facts.is_gguf:
        return [None]  # the file's own quantization
    return list(gguf_ladder(facts))


def _best_llama(facts: ModelFacts, hw: HardwareSnapshot, base: LaunchPlan, notes: list[str]) -> FitResult | None:
    partial: FitResult | None = None
    cpu_only = not hw.gpus
    candidates = _llama_candidates(facts)
    if cpu_only and len(candidates) > 1:
        # On a CPU, generation speed is memory bandwidth / model bytes: start at Q4_K_M, the usual sweet spot.
        candidates = [q for q in candidates if q in ("Q4_K_M", "MXFP4", "IQ4_XS", "Q3_K_M")]
        notes.append("CPU only: Q4_K_M is the usual balance of quality and speed (speed ~ bandwidth / model size)")
    tight: FitResult | None = None
    for kv_type in ("f16", "q8_0"):
        for quant in candidates:
            result = estimate(facts, hw, replace(base, kv_cache_type=kv_type), quant=quant)
            if result.fits == "yes":
                if result.headroom_gib < SAFETY_GIB and hw.gpus:
                    tight = tight or result  # fits, but a browser tab could tip it over: look further first
                    continue
                if kv_type != "f16":
                    notes.append("KV cache quantized to q8_0 to keep every layer on the GPU")
                return result
            if result.fits == "partial" and (partial is None or (result.gpu_layers or 0) > (partial.gpu_layers or 0)):
                partial = result
    return tight or partial


def _vllm_ladder(facts: ModelFacts, hw: HardwareSnapshot) -> tuple[str | None, ...]:
    """Precision first, then fewer bytes: bf16 (fp16 before Ampere), fp8 on the fly, then a 4-bit checkpoint."""
    if facts.quantization and not facts.is_gguf:
        return (None,)  # already quantized checkpoint: serve as is (vLLM reads its quantization_config)
    cc = min((_cc(g.compute_capability or "0") for g in hw.cuda_gpus), default=0.0)
    # Only rungs vLLM can run on these weights as they are: fp8 is quantized while loading; AWQ/GPTQ need a
    # checkpoint of that kind (offered by `_awq_offer`, never launched on these weights).
    return ("bf16" if cc >= 8.0 else "fp16", *(("fp8",) if cc >= 8.0 else ()))


def _awq_offer(facts: ModelFacts, hw: HardwareSnapshot, base: LaunchPlan, concurrency: int) -> str | None:
    """When only a 4-bit checkpoint would start: say so and where to get one (vLLM cannot quantize to AWQ)."""
    what_if = size_vllm(facts, hw, base, concurrency=concurrency, quants=("awq",))
    if what_if is None:
        return None
    name = facts.repo_id or facts.name
    return (f"an AWQ checkpoint of this model would fit ({what_if.weights_gib:.1f} GiB weights per GPU, "
            f"{what_if.max_concurrency or 0:.1f} full requests at once): download one "
            f"(`switchyard hub search {name} --awq`) and plan for it; vLLM cannot quantize these weights to "
            "AWQ while loading")


def _model_ref(facts: ModelFacts, engine: str) -> str:
    if engine == "vllm":
        return facts.hf_dir or facts.repo_id or facts.path or facts.name
    return facts.path if facts.is_gguf and facts.path else (facts.repo_id or facts.path or facts.name)


def _key_settings(result: FitResult) -> dict[str, Any]:
    """The few settings a person reads first, taken from the plan (never recomputed)."""
    plan = result.plan
    assert plan is not None
    if plan.engine == "llama.cpp":
        return {"ctx_per_request": plan.ctx_per_request, "slots": plan.slots, "ctx_size": plan.llama_ctx_size,
                "gpu_layers": plan.gpu_layers, "kv_type": plan.kv_cache_type, "backend": plan.backend}
    return {"max_model_len": plan.ctx_per_request, "max_num_seqs": plan.slots,
            "tensor_parallel": plan.tensor_parallel, "gpu_memory_utilization": plan.gpu_memory_utilization,
            "quantization": plan.quantization, "kv_cache_tokens": result.kv_cache_tokens,
            "max_concurrency": result.max_concurrency, "backend": plan.backend}


def recommend(facts: ModelFacts, hardware: HardwareSnapshot, workload: Workload | None = None,
              measurements: Any = None, evidence: Evidence | None = None,
              kld_budget: float | None = None) -> Recommendation:
    """The engine, quantization and launch settings for this model, machine and workload, with reasons.

    `evidence`: this machine's history for the model (`evidence.gather`); None answers from defaults alone.
    `kld_budget`: the quality budget for quantizations measured here (default: the saved setting)."""
    work = workload or Workload()
    work.validate()
    measured = _measurements(measurements)
    need = work.prompt_len + work.output_len
    if need > facts.context_length * 4:
        raise SwitchyardError(f"prompt + output ({need:,} tokens) is far beyond the model's "
                              f"{facts.context_length:,}-token context", "shorten the prompt or pick another model")
    llama_notes: list[str] = []
    llama = _best_llama(facts, hardware, _llama_base(facts, work, need), llama_notes)
    llama = _within_budget(facts, hardware, _llama_base(facts, work, need), llama, evidence, kld_budget,
                           llama_notes)
    vllm, vllm_notes, blocker = _vllm_choice(facts, hardware, work, need)
    scores = _scores(hardware, work, measured, evidence, llama, vllm)
    numbers = _numbers(scores, work, need, llama, vllm)
    if evidence is not None and evidence.quality is not None:
        numbers["quality"] = evidence.quality  # the quantizations measured here (`switchyard quality`)
    if llama is None and vllm is None:
        raise SwitchyardError(f"{facts.name} does not fit on this machine with either engine",
                              "pick a smaller model or a shorter context, or free GPU memory/RAM")
    vllm_wins = vllm is not None and scores.score_vllm > scores.score_llama * scores.margin
    chosen: FitResult
    loser: FitResult | None
    if vllm is not None and (vllm_wins or llama is None):
        chosen, loser = vllm, llama
        reasons = _vllm_reasons(facts, work, scores, vllm, llama, vllm_notes)
    else:
        assert llama is not None
        chosen, loser = llama, vllm
        reasons = _llama_reasons(facts, hardware, work, scores, llama, llama_notes, blocker)
    if any(s == "measured" for s in scores.sources.values()) or scores.gain_source == "measured" or \
            (evidence is not None and evidence.consulted):
        reasons.append(history_basis(_named_figures(scores.figures)))
    chosen = _learned(facts, hardware, chosen, evidence, numbers)
    assert chosen.plan is not None
    numbers["fit"] = {"weights_gib": chosen.weights_gib, "kv_cache_gib": chosen.kv_cache_gib,
                      "total_gib": chosen.total_gib, "available_gib": chosen.available_gib,
                      "headroom_gib": chosen.headroom_gib}
    return Recommendation(engine=chosen.engine, quant=chosen.quant or "", plan=chosen.plan, reasons=reasons,
                          numbers=numbers, runner_up=_runner_up(chosen, loser, blocker, work, scores), fit=chosen,
                          key_settings=_key_settings(chosen))


def _within_budget(facts: ModelFacts, hw: HardwareSnapshot, base: LaunchPlan, llama: FitResult | None,
                   evidence: Evidence | None, budget: float | None, notes: list[str]) -> FitResult | None:
    """The llama.cpp quantization by the quality measured here (planning.quant_choice), with a note saying so:
    a GGUF file's own quantization within or over the budget; for a checkpoint, the smallest rung of the ladder
    measured within it that fits fully. Nothing changes, and nothing is said, where nothing was measured."""
    measured = measured_quants(evidence.quality if evidence is not None else None)
    if not measured:
        return llama
    if budget is None:
        from desktop.core.storage.settings import load

        budget = load().kld_budget
    if facts.is_gguf:
        own = measured.get(quant_key(facts.quantization or ""))
        if own is not None:
            within = sorted((m for m in measured.values() if m.mean_kld <= budget), key=lambda m: bits_per_weight(m.quant))
            verdict = "within" if own.mean_kld <= budget else "over"
            note = (f"{own.quant}: mean KLD {own.mean_kld:.4f} against {own.reference}, {verdict} the {budget:g} "
                    f"quality budget ({own.basis}, run #{own.run_id})")
            if verdict == "over" and within:
                note += f"; {within[0].quant} (mean KLD {within[0].mean_kld:.4f}) is within it: serve that file"
            notes.append(note)
        return llama
    fitting = [r for q in _llama_candidates(facts) if q is not None
               for r in [estimate(facts, hw, base, quant=q)] if r.fits == "yes"]
    if not fitting:
        return llama
    choice = choose(fitting, lambda r: r.quant, lambda r: r.weights_gib,
                    lambda rs: next((r for r in rs if llama is not None and r.quant == llama.quant), rs[0]),
                    measured, budget, facts.name)
    if choice.basis == BITS_RULE or choice.pick is None:
        notes.append(choice.reason)
        return llama
    notes[:] = [n for n in notes if not n.startswith("CPU only:")]  # measured, not the usual balance
    notes.append(choice.reason)
    return choice.pick


def _llama_base(facts: ModelFacts, work: Workload, need: int) -> LaunchPlan:
    """The llama.cpp plan the quantization ladder is tried on: one slot per concurrent request (at most 32)."""
    per_request = _round_ctx(need, facts.context_length)
    slots = max(1, min(work.concurrency, MAX_SLOTS))
    return LaunchPlan(engine="llama.cpp", model_path=Path(_model_ref(facts, "llama.cpp")),
                      ctx_per_request=per_request, slots=slots)


def _vllm_choice(facts: ModelFacts, hardware: HardwareSnapshot, work: Workload, need: int
                 ) -> tuple[FitResult | None, list[str], str | None]:
    """vLLM's sized plan (None when it cannot run or fit here), notes on it, and what blocks it."""
    blocker = _vllm_blocker(facts, hardware)
    vllm: FitResult | None = None
    vllm_notes: list[str] = []
    seqs = max(8, min(256, 2 ** math.ceil(math.log2(max(work.concurrency, 1))) * 2))
    if blocker is None:
        max_len = _round_ctx(max(need, 4096), facts.context_length)
        vllm_base = LaunchPlan(engine="vllm", model_path=Path(_model_ref(facts, "vllm")), ctx_per_request=max_len,
                               slots=seqs, prefix_cache=True, gpu_memory_utilization=vllm_utilization(hardware))
        vllm = size_vllm(facts, hardware, vllm_base, concurrency=work.concurrency,
                         quants=_vllm_ladder(facts, hardware))
        if vllm is None:
            offer = _awq_offer(facts, hardware, vllm_base, work.concurrency) if not facts.quantization else None
            blocker = (f"vLLM does not fit these weights (bf16 or fp8); {offer}" if offer else
                       "vLLM does not fit: even a 4-bit checkpoint leaves no room for one full-length request's "
                       "KV cache")
        elif (vllm.max_concurrency or 0) < work.concurrency:
            vllm_notes.append(f"vLLM's KV cache holds only {vllm.max_concurrency:.1f} of the {work.concurrency} "
                              f"concurrent {max_len:,}-token requests asked for on this hardware")
    return vllm, vllm_notes, blocker


def _experts_in_ram(llama: FitResult | None) -> bool:
    return llama is not None and bool(llama.settings.get("n_cpu_moe"))


@dataclass(frozen=True)
class _Scores:
    """What the verdict weighs: each engine's cold start and vLLM's throughput gain (measured or default), and
    each engine's useful output over one run."""

    figures: dict[str, Any]
    cold: dict[str, float]
    sources: dict[str, str]
    gain: float
    gain_source: str
    run_s: float
    score_llama: float
    score_vllm: float
    payback_s: float | None
    margin: float  # what vLLM must win by: 10% on a default gain, nothing on a measured one

    @property
    def gain_tag(self) -> str:
        return str(self.figures["vllm_throughput_gain"].tag())

    @property
    def cold_tag(self) -> dict[str, str]:
        return {e: f"{_secs(self.cold[e])} ({self.figures['cold_start_s'][e].tag()})" for e in self.cold}


def _scores(hardware: HardwareSnapshot, work: Workload, measured: dict[str, EngineMeasurement],
            evidence: Evidence | None, llama: FitResult | None, vllm: FitResult | None) -> _Scores:
    """The amortization rule's numbers: throughput x (run - cold start) for each engine, vLLM's relative."""
    cpu_vllm = not hardware.cuda_gpus
    figures = _figures(work.concurrency, cpu_vllm, measured, evidence, (work.prompt_len, work.output_len))
    cold = {e: figures["cold_start_s"][e].value for e in DEFAULT_COLD_START_S}
    sources = {e: figures["cold_start_s"][e].source for e in cold}
    gain = figures["vllm_throughput_gain"].value
    gain_source = figures["vllm_throughput_gain"].source
    if llama is not None and llama.fits == "partial" and not _experts_in_ram(llama) and vllm is not None \
            and gain_source == "default":
        gain *= 2.0  # llama.cpp with layers on the CPU is several times slower than fully on the GPU
        figures["vllm_throughput_gain"] = default(gain, "x2: llama.cpp with layers in RAM")
    run_s = work.run_seconds
    useful_llama = max(0.0, run_s - cold["llama.cpp"]) / run_s
    useful_vllm = max(0.0, run_s - cold["vllm"]) / run_s
    payback_s = (cold["vllm"] - cold["llama.cpp"]) / (gain - 1.0) if gain > 1.0 else None
    margin = VLLM_WIN_MARGIN if gain_source == "default" else 1.0
    return _Scores(figures, cold, sources, gain, gain_source, run_s, useful_llama, gain * useful_vllm, payback_s,
                   margin)


def _numbers(scores: _Scores, work: Workload, need: int, llama: FitResult | None,
             vllm: FitResult | None) -> dict[str, Any]:
    """The recommendation's numbers: the figures, the scores, and whether the call is close or rests on defaults."""
    score_llama, score_vllm, payback_s = scores.score_llama, scores.score_vllm, scores.payback_s
    numbers: dict[str, Any] = {
        "cold_start_s": scores.cold, "cold_start_source": scores.sources, "vllm_throughput_gain": round(scores.gain, 2),
        "throughput_gain_source": scores.gain_source, "run_seconds": round(scores.run_s), "payback_seconds":
        round(payback_s, 1) if payback_s is not None else None, "score_llama_cpp": round(score_llama, 3),
        "score_vllm": round(score_vllm, 3) if vllm else None, "concurrency": work.concurrency,
        "request_tokens": need,
        "figures": {k: ({e: f.to_json() for e, f in v.items()} if isinstance(v, dict) else v.to_json())
                    for k, v in scores.figures.items()},
    }
    numbers["close_call"] = bool(vllm is not None and llama is not None
                                 and max(score_vllm, score_llama) <= CLOSE_SCORES * max(min(score_vllm, score_llama),
                                                                                       1e-9))
    numbers["rests_on_defaults"] = scores.gain_source == "default" or "default" in scores.sources.values()
    return numbers


def _vllm_reasons(facts: ModelFacts, work: Workload, scores: _Scores, vllm: FitResult, llama: FitResult | None,
                  vllm_notes: list[str]) -> list[str]:
    """Why vLLM: its gain, when its cold start is repaid, its KV cache, tensor parallel and fp8."""
    gain, cold_tag, payback_s = scores.gain, scores.cold_tag, scores.payback_s
    reasons = [f"{work.concurrency} concurrent requests: vLLM gives ~{gain:.2f}x llama.cpp's throughput "
               f"({scores.gain_tag})"]
    reasons.append(f"its cold start of {cold_tag['vllm']} is repaid after {payback_s or 0:.0f} s of a "
                   f"{scores.run_s / 3600:.1f} h run" if payback_s is not None else
                   f"its cold start: {cold_tag['vllm']}; llama.cpp's: {cold_tag['llama.cpp']}")
    if vllm.kv_cache_tokens is not None and vllm.max_concurrency is not None:
        reasons.append(f"{vllm.quant} weights leave {vllm.kv_cache_gib:.1f} GiB of KV cache: "
                       f"{vllm.kv_cache_tokens:,} tokens, {vllm.max_concurrency:.1f} full {vllm.ctx:,}-token "
                       f"requests at once")
    tp = vllm.plan.tensor_parallel if vllm.plan else 1
    if tp > 1:
        reasons.append(f"tensor parallel {tp} over {vllm.device.split('x ', 1)[-1]} keeps {vllm.quant} weights "
                       f"({vllm.weights_gib:.1f} GiB per GPU) instead of quantizing further")
    reasons.extend(vllm_notes)
    if vllm.plan is not None and vllm.plan.quantization == "fp8" and not facts.quantization:
        reasons.append("fp8: vLLM quantizes these weights while loading, so the plan runs on this checkpoint "
                       "as it is (no download)")
    if llama is None:
        reasons.append("llama.cpp does not fit this model here")
    return reasons


def _llama_reasons(facts: ModelFacts, hardware: HardwareSnapshot, work: Workload, scores: _Scores,
                   llama: FitResult, llama_notes: list[str], blocker: str | None) -> list[str]:
    """Why llama.cpp: what keeps vLLM out or slower, then where and how llama.cpp's pick runs."""
    reasons = [_why_not_vllm(work, scores, blocker)]
    if llama.device == "CPU":
        reasons.append(f"runs on the CPU ({hardware.cpu.model}, {hardware.cpu.physical_cores} cores"
                       f"{', AVX-512' if hardware.cpu.avx512 else ', AVX2' if hardware.cpu.avx2 else ''}) "
                       f"in {llama.total_gib:.1f} GiB of RAM")
    elif llama.fits == "partial" and _experts_in_ram(llama):
        reasons.append(f"{llama.quant} does not fit whole: every layer on the GPU with the experts of "
                       f"{llama.settings['n_cpu_moe']} layers in RAM ({llama.breakdown.get('experts_in_ram', 0):.1f}"
                       " GiB, --n-cpu-moe); only their sparse expert matmuls run on the CPU")
    elif llama.fits == "partial":
        reasons.append(f"{llama.quant} does not fit fully: {llama.gpu_layers}/{(llama.total_layers or 1) - 1} "
                       f"layers on the GPU, the rest in RAM ({llama.cpu_ram_gib:.1f} GiB); expect slower generation")
    else:
        reasons.append(f"{llama.quant} fits fully on the GPU with {llama.headroom_gib:.1f} GiB to spare")
        if llama.headroom_gib < SAFETY_GIB:
            reasons.append("that is tight: close other GPU apps, or lower ctx if loading fails")
    kv_type = (llama.plan.kv_cache_type if llama.plan else None) or "f16"
    if kv_type != "f16" and not any("q8_0" in n for n in llama_notes):
        reasons.append(f"KV cache quantized to {kv_type} (with flash attention) to keep every layer on the GPU")
    reasons.extend(llama_notes)
    if not facts.is_gguf:
        reasons.append(f"download a {llama.quant} GGUF of this model for llama.cpp (the Hub search lists them)")
    return reasons


def _why_not_vllm(work: Workload, scores: _Scores, blocker: str | None) -> str:
    """The first reason for llama.cpp: what blocks vLLM, or why its gain does not repay its cold start."""
    gain, gain_tag, cold_tag = scores.gain, scores.gain_tag, scores.cold_tag
    if blocker:
        return f"llama.cpp: {blocker}"
    if gain < 1.0:
        return (f"with {work.concurrency} request(s) in flight llama.cpp serves ~{1 / gain:.2f}x vLLM's "
                f"throughput ({gain_tag}); cold start llama.cpp {cold_tag['llama.cpp']}, vLLM "
                f"{cold_tag['vllm']}")
    if gain <= scores.margin:
        return (f"with {work.concurrency} request(s) in flight vLLM is not clearly faster (~{gain:.2f}x, "
                f"{gain_tag}), so its cold start of {cold_tag['vllm']} buys nothing over llama.cpp's "
                f"{cold_tag['llama.cpp']}")
    return (f"restarting every {scores.run_s / 60:.0f} min, vLLM's cold start of {cold_tag['vllm']} eats its "
            f"~{gain:.2f}x throughput gain ({gain_tag}; score {scores.score_vllm:.2f} vs {scores.score_llama:.2f})")


def _runner_up(chosen: FitResult, loser: FitResult | None, blocker: str | None, work: Workload,
               scores: _Scores) -> dict[str, Any]:
    """The engine not chosen: its plan and why it lost, or why it was never a candidate."""
    gain, gain_tag, cold_tag, run_s = scores.gain, scores.gain_tag, scores.cold_tag, scores.run_s
    if loser is not None:
        if loser.engine == "vllm":
            why = (f"~{gain:.2f}x llama.cpp's throughput at concurrency {work.concurrency} ({gain_tag}) does not "
                   f"repay a cold start of {cold_tag['vllm']} over {run_s / 60:.0f} min runs (score "
                   f"{scores.score_vllm:.2f} vs {scores.score_llama:.2f})")
        else:
            why = (f"~{gain:.2f}x less throughput at concurrency {work.concurrency} ({gain_tag}); its faster start "
                   f"({cold_tag['llama.cpp']}) matters little over {run_s / 3600:.1f} h runs")
        return {"engine": loser.engine, "quant": loser.quant, "plan": loser.plan.to_json() if loser.plan else None,
                "key_settings": _key_settings(loser), "fits": loser.fits, "why_lost": why}
    other = "vllm" if chosen.engine == "llama.cpp" else "llama.cpp"
    return {"engine": other, "quant": None, "plan": None, "fits": "no",
            "why_lost": blocker or "it does not fit this model here"}


def _secs(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.0f} s"


ENGINE_NAMES = {"llama.cpp": "llama.cpp", "vllm": "vLLM"}


def _named_figures(figures: dict[str, Any]) -> list[tuple[str, bool, str | None]]:
    """The figures the verdict rests on, named for `basis.history_basis`: both cold starts and vLLM's gain."""
    named: list[tuple[str, bool, str | None]] = []
    for engine, fig in figures["cold_start_s"].items():
        named.append((f"{ENGINE_NAMES.get(engine, engine)}'s cold start", fig.measured, fig.run_date))
    gain: Figure = figures["vllm_throughput_gain"]
    nearest = " (of the nearest model run here)" if "nearest measured model" in (gain.note or "") else ""
    named.append((f"the vLLM / llama.cpp throughput ratio{nearest}", gain.measured, gain.run_date))
    return named


def _figures(concurrency: int, cpu_vllm: bool, measured: dict[str, EngineMeasurement],
             evidence: Evidence | None, lengths: tuple[int, int]) -> dict[str, Any]:
    """Cold starts, throughputs and vLLM's gain, each measured (history, or `measurements`) or default."""
    base_cold = DEFAULT_CPU_COLD_START_S if cpu_vllm else DEFAULT_COLD_START_S
    where = "CPU" if cpu_vllm else "GPU"
    cold: dict[str, Figure] = {e: default(v, f"typical on a {where}") for e, v in base_cold.items()}
    tput: dict[str, Figure] = {}
    ttft: dict[str, Figure] = {}
    gain = default(default_gain(concurrency, cpu_vllm), f"typical on a {where} at concurrency {concurrency}")
    if evidence is not None:
        for engine in cold:
            found = evidence.cold_start(engine)
            if found is not None and found.value >= 0:
                cold[engine] = found
        for engine in cold:
            found_engine = evidence.get(engine)
            ttft_figure = found_engine.ttft_at(concurrency) if found_engine else None
            if ttft_figure is not None:
                ttft[engine] = ttft_figure
        measured_gain = evidence.gain(concurrency, lengths=lengths)
        if measured_gain is not None:
            tput = dict(measured_gain.figures)
            runs = sorted({f.run_id for f in tput.values() if f.run_id is not None})
            dates = sorted({f.run_date for f in tput.values() if f.run_date})
            notes = [n for n in {f.note for f in tput.values()} if n]
            gain = Figure(round(measured_gain.value, 3), "measured", runs[0] if len(runs) == 1 else runs[-1],
                          dates[-1] if dates else None, "; ".join([*sorted(notes), *(
                              [measured_gain.note] if measured_gain.note and measured_gain.note not in notes else [])])
                          or None)
    for engine, m in measured.items():  # explicit measurements (API callers) win over history
        if engine in cold and m.cold_start_s is not None and m.cold_start_s >= 0:
            cold[engine] = Figure(m.cold_start_s, "measured", note="given by the caller")
    ml, mv = measured.get("llama.cpp"), measured.get("vllm")
    if ml and mv and ml.output_tok_s and mv.output_tok_s and ml.output_tok_s > 0:
        gain = Figure(mv.output_tok_s / ml.output_tok_s, "measured", note="given by the caller")
        tput = {"llama.cpp": Figure(ml.output_tok_s, "measured", note="given by the caller"),
                "vllm": Figure(mv.output_tok_s, "measured", note="given by the caller")}
    return {"cold_start_s": cold, "throughput_tok_s": tput, "ttft_p50_ms": ttft, "vllm_throughput_gain": gain}


def _learned(facts: ModelFacts, hardware: HardwareSnapshot, chosen: FitResult, evidence: Evidence | None,
             numbers: dict[str, Any]) -> FitResult:
    """The chosen fit corrected by the newest launch of this model and engine here (predicted vs measured)."""
    found = evidence.get(chosen.engine) if evidence is not None else None
    if found is None or found.load_memory is None:
        return chosen
    try:
        checks = memory_checks(facts, hardware, found.load_memory)
    except SwitchyardError:
        return chosen
    numbers["memory_checks"] = [c.to_json() for c in checks]
    return corrected_fit(chosen, checks)
