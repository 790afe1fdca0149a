"""Which engine, which quantization and which launch settings, from hardware + model + workload.

The amortization rule: an engine's cold start C (seconds before it serves) is paid at every restart, and only
its throughput gain over the service's run can repay it. Each engine's useful output over one run is
throughput x (run - C); vLLM must beat llama.cpp by a clear margin (10%) to be worth its heavier start.
Defaults, replaced by measured history when `measurements` are given:
  cold start: llama.cpp ~20 s, vLLM ~120 s on a GPU (weights load, torch.compile, CUDA graphs);
  throughput: vLLM ~1x llama.cpp with one request in flight, rising to ~3x at 8 or more (continuous batching,
  paged KV, CUDA graphs), interpolated on log2(concurrency).
vLLM is only a candidate on CUDA/ROCm GPUs and for Hugging Face checkpoints; llama.cpp runs everywhere, from a
GGUF ladder Q8_0 -> Q6_K -> Q5_K_M -> Q4_K_M -> IQ4_XS -> Q3_K_M (first that fits fully wins).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.base import LaunchPlan
from desktop.core.engines.runtimes import engine_supported
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.models.facts import ModelFacts
from desktop.core.planning.fit import GGUF_LADDER, FitResult, FitSettings, estimate

DEFAULT_COLD_START_S = {"llama.cpp": 20.0, "vllm": 120.0}
VLLM_MAX_GAIN = 3.0  # at concurrency >= 8
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
    settings: dict[str, Any]  # LaunchPlan fields: LaunchPlan(**settings) works
    reasons: list[str]
    numbers: dict[str, Any]
    runner_up: dict[str, Any] | None
    fit: FitResult | None = None
    key_settings: dict[str, Any] = field(default_factory=dict)  # ctx, slots/max_num_seqs, -ngl, util, KV type

    def launch_plan(self) -> LaunchPlan:
        data = dict(self.settings)
        data["model_path"] = Path(str(data["model_path"]))
        if data.get("tokenizer_path"):
            data["tokenizer_path"] = Path(str(data["tokenizer_path"]))
        data["extra_args"] = tuple(data.get("extra_args", ()))
        return LaunchPlan(**data)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
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


def default_gain(concurrency: int) -> float:
    """vLLM's throughput over llama.cpp's: ~1x at 1 request in flight, ~3x at 8 or more."""
    if concurrency <= 1:
        return 1.0
    return 1.0 + (VLLM_MAX_GAIN - 1.0) * min(1.0, math.log2(concurrency) / 3.0)


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
        return "vLLM needs an NVIDIA or AMD GPU here (its CPU backend is far slower than llama.cpp)"
    old = [g for g in hw.cuda_gpus if g.vendor == "nvidia" and g.compute_capability
           and _cc(g.compute_capability) < 7.0]
    if old:
        return f"vLLM needs compute capability 7.0 or newer ({old[0].name} is {old[0].compute_capability})"
    if facts.is_gguf and not facts.hf_dir and facts.source != "demo":
        return "the model is a GGUF file; vLLM serves Hugging Face safetensors checkpoints (its GGUF support is experimental)"
    return None


def _cc(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def _llama_candidates(facts: ModelFacts) -> list[str | None]:
    if facts.is_gguf:
        return [None]  # the file's own quantization
    return list(GGUF_LADDER)


def _best_llama(facts: ModelFacts, hw: HardwareSnapshot, ctx: int, slots: int, notes: list[str]) -> FitResult | None:
    partial: FitResult | None = None
    cpu_only = not hw.gpus
    candidates = _llama_candidates(facts)
    if cpu_only and len(candidates) > 1:
        # On a CPU, generation speed is memory bandwidth / model bytes: start at Q4_K_M, the usual sweet spot.
        candidates = [q for q in candidates if q in ("Q4_K_M", "IQ4_XS", "Q3_K_M")]
        notes.append("CPU only: Q4_K_M is the usual balance of quality and speed (speed ~ bandwidth / model size)")
    tight: FitResult | None = None
    for kv_type in ("f16", "q8_0"):
        for quant in candidates:
            result = estimate(facts, "llama.cpp", hw, FitSettings(ctx=ctx, parallel=slots, kv_type=kv_type, quant=quant))
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


def _best_vllm(facts: ModelFacts, hw: HardwareSnapshot, max_len: int, seqs: int, tp: int) -> FitResult | None:
    ladder: list[str | None]
    if facts.quantization and not facts.is_gguf:
        ladder = [None]  # already quantized checkpoint: serve as is
    else:
        cc = min((_cc(g.compute_capability or "0") for g in hw.cuda_gpus), default=0.0)
        ladder = ["bf16" if cc >= 8.0 else "fp16", *(["fp8"] if cc >= 8.0 else []), "awq"]
    for quant in ladder:
        try:
            result = estimate(facts, "vllm", hw, FitSettings(ctx=max_len, max_num_seqs=seqs, tensor_parallel=tp,
                                                             quant=quant))
        except SwitchyardError:
            continue
        if result.fits == "yes" and (result.max_concurrency or 0) >= 1:
            return result
    return None


def _model_ref(facts: ModelFacts, engine: str) -> str:
    if engine == "vllm":
        return facts.hf_dir or facts.repo_id or facts.path or facts.name
    return facts.path if facts.is_gguf and facts.path else (facts.repo_id or facts.path or facts.name)


def _settings(facts: ModelFacts, result: FitResult, slots: int) -> tuple[dict[str, Any], dict[str, Any]]:
    if result.engine == "llama.cpp":
        kv_type = str(result.settings.get("kv_type", "f16"))
        extra: list[str] = []
        if kv_type != "f16":
            extra += ["--cache-type-k", kv_type, "--cache-type-v", kv_type, "-fa", "on"]
        settings = {"engine": "llama.cpp", "model_path": _model_ref(facts, "llama.cpp"), "ctx": result.ctx,
                    "parallel": slots, "gpu_layers": result.gpu_layers, "dtype": "auto",
                    "extra_args": extra}
        key: dict[str, Any] = {"ctx": result.ctx, "slots": slots, "ctx_per_slot": result.ctx // slots,
               "gpu_layers": result.gpu_layers, "kv_type": kv_type}
        return settings, key
    quant = result.quant or "bf16"
    extra = ["--quantization", "fp8"] if quant == "fp8" and not facts.quantization else []
    seqs = int(result.settings.get("max_num_seqs", slots))
    settings = {"engine": "vllm", "model_path": _model_ref(facts, "vllm"), "ctx": result.ctx, "parallel": seqs,
                "gpu_memory_utilization": float(result.settings.get("gpu_memory_utilization", 0.9)),
                "dtype": "auto", "prefix_cache": True, "extra_args": extra}
    tp = int(result.settings.get("tensor_parallel", 1))
    if tp > 1:
        settings["extra_args"] = [*extra, "--tensor-parallel-size", str(tp)]
    if result.device == "CPU":
        settings["kv_cache_gib"] = result.settings.get("kv_cache_gib", 4.0)
        settings["dtype"] = "bfloat16"
    key = {"max_model_len": result.ctx, "max_num_seqs": seqs, "tensor_parallel": tp,
           "gpu_memory_utilization": settings["gpu_memory_utilization"], "kv_cache_tokens": result.kv_cache_tokens,
           "max_concurrency": result.max_concurrency}
    return settings, key


def recommend(facts: ModelFacts, hardware: HardwareSnapshot, workload: Workload | None = None,
              measurements: Any = None) -> Recommendation:
    """The engine, quantization and launch settings for this model, machine and workload, with reasons."""
    work = workload or Workload()
    work.validate()
    measured = _measurements(measurements)
    need = work.prompt_len + work.output_len
    if need > facts.context_length * 4:
        raise SwitchyardError(f"prompt + output ({need:,} tokens) is far beyond the model's "
                              f"{facts.context_length:,}-token context", "shorten the prompt or pick another model")
    per_request = _round_ctx(need, facts.context_length)
    slots = max(1, min(work.concurrency, MAX_SLOTS))
    llama_notes: list[str] = []
    llama = _best_llama(facts, hardware, per_request * slots, slots, llama_notes)

    blocker = _vllm_blocker(facts, hardware)
    vllm: FitResult | None = None
    seqs = max(8, min(256, 2 ** math.ceil(math.log2(max(work.concurrency, 1))) * 2))
    if blocker is None:
        max_len = _round_ctx(max(need, 4096), facts.context_length)
        gpus = len(hardware.cuda_gpus)
        for tp in sorted({1, *(n for n in (2, 4, 8) if n <= gpus)}):
            vllm = _best_vllm(facts, hardware, max_len, seqs, tp)
            if vllm is not None:
                break
        if vllm is None:
            blocker = "vLLM does not fit: even AWQ 4-bit leaves no room for one full-length request's KV cache"

    cold = {e: DEFAULT_COLD_START_S[e] for e in DEFAULT_COLD_START_S}
    sources = {e: "default" for e in cold}
    for engine, m in measured.items():
        if engine in cold and m.cold_start_s is not None and m.cold_start_s >= 0:
            cold[engine] = m.cold_start_s
            sources[engine] = "measured"
    gain = default_gain(work.concurrency)
    gain_source = "default"
    ml, mv = measured.get("llama.cpp"), measured.get("vllm")
    if ml and mv and ml.output_tok_s and mv.output_tok_s and ml.output_tok_s > 0:
        gain = mv.output_tok_s / ml.output_tok_s
        gain_source = "measured"
    if llama is not None and llama.fits == "partial" and vllm is not None:
        gain *= 2.0  # llama.cpp with layers on the CPU is several times slower than fully on the GPU
    run_s = work.run_seconds
    useful_llama = max(0.0, run_s - cold["llama.cpp"]) / run_s
    useful_vllm = max(0.0, run_s - cold["vllm"]) / run_s
    score_llama = useful_llama
    score_vllm = gain * useful_vllm
    payback_s = (cold["vllm"] - cold["llama.cpp"]) / (gain - 1.0) if gain > 1.0 else None
    numbers: dict[str, Any] = {
        "cold_start_s": cold, "cold_start_source": sources, "vllm_throughput_gain": round(gain, 2),
        "throughput_gain_source": gain_source, "run_seconds": round(run_s), "payback_seconds":
        round(payback_s, 1) if payback_s is not None else None, "score_llama_cpp": round(score_llama, 3),
        "score_vllm": round(score_vllm, 3) if vllm else None, "concurrency": work.concurrency,
        "request_tokens": need,
    }

    reasons: list[str] = []
    vllm_wins = vllm is not None and score_vllm > score_llama * VLLM_WIN_MARGIN
    if llama is None and vllm is None:
        raise SwitchyardError(f"{facts.name} does not fit on this machine with either engine",
                              "pick a smaller model or a shorter context, or free GPU memory/RAM")
    if vllm is not None and (vllm_wins or llama is None):
        chosen, loser = vllm, llama
        reasons.append(f"{work.concurrency} concurrent requests: vLLM's continuous batching gives ~{gain:.1f}x "
                       f"llama.cpp's throughput ({gain_source})")
        reasons.append(f"its {cold['vllm']:.0f} s cold start ({sources['vllm']}) is repaid after "
                       f"{payback_s or 0:.0f} s of a {run_s / 3600:.1f} h run")
        reasons.append(f"{vllm.quant} weights leave {vllm.kv_cache_gib:.1f} GiB of KV cache: {vllm.kv_cache_tokens:,} "
                       f"tokens, {vllm.max_concurrency:.1f} full {vllm.ctx:,}-token requests at once")
        if llama is None:
            reasons.append("llama.cpp does not fit this model here")
    else:
        assert llama is not None
        chosen, loser = llama, vllm
        if blocker:
            reasons.append(f"llama.cpp: {blocker}")
        elif gain <= 1.05:
            reasons.append(f"with {work.concurrency} request(s) in flight vLLM is no faster (~{gain:.1f}x), so its "
                           f"{cold['vllm']:.0f} s cold start ({sources['vllm']}) buys nothing over llama.cpp's "
                           f"{cold['llama.cpp']:.0f} s ({sources['llama.cpp']})")
        else:
            reasons.append(f"restarting every {run_s / 60:.0f} min, vLLM's {cold['vllm']:.0f} s cold start eats its "
                           f"~{gain:.1f}x throughput gain (score {score_vllm:.2f} vs {score_llama:.2f})")
        if llama.device == "CPU":
            reasons.append(f"runs on the CPU ({hardware.cpu.model}, {hardware.cpu.physical_cores} cores"
                           f"{', AVX-512' if hardware.cpu.avx512 else ', AVX2' if hardware.cpu.avx2 else ''}) "
                           f"in {llama.total_gib:.1f} GiB of RAM")
        elif llama.fits == "partial":
            reasons.append(f"{llama.quant} does not fit fully: {llama.gpu_layers}/{(llama.total_layers or 1) - 1} "
                           f"layers on the GPU, the rest in RAM ({llama.cpu_ram_gib:.1f} GiB); expect slower generation")
        else:
            reasons.append(f"{llama.quant} fits fully on the GPU with {llama.headroom_gib:.1f} GiB to spare")
            if llama.headroom_gib < SAFETY_GIB:
                reasons.append("that is tight: close other GPU apps, or lower ctx if loading fails")
        kv_type = str(llama.settings.get("kv_type", "f16"))
        if kv_type != "f16" and not any("q8_0" in n for n in llama_notes):
            reasons.append(f"KV cache quantized to {kv_type} (with flash attention) to keep every layer on the GPU")
        reasons.extend(llama_notes)
        if not facts.is_gguf:
            reasons.append(f"download a {llama.quant} GGUF of this model for llama.cpp (the Hub search lists them)")
    if any(s == "measured" for s in sources.values()) or gain_source == "measured":
        reasons.append("measured history from this machine replaced the default cold-start/throughput figures")
    settings, key = _settings(facts, chosen, slots if chosen.engine == "llama.cpp" else seqs)
    numbers["fit"] = {"weights_gib": chosen.weights_gib, "kv_cache_gib": chosen.kv_cache_gib,
                      "total_gib": chosen.total_gib, "available_gib": chosen.available_gib,
                      "headroom_gib": chosen.headroom_gib}
    runner_up: dict[str, Any] | None
    if loser is not None:
        loser_settings, loser_key = _settings(facts, loser, slots if loser.engine == "llama.cpp" else seqs)
        if loser.engine == "vllm":
            why = (f"~{gain:.1f}x throughput at concurrency {work.concurrency} does not repay a "
                   f"{cold['vllm']:.0f} s cold start over {run_s / 60:.0f} min runs (score {score_vllm:.2f} vs "
                   f"{score_llama:.2f})")
        else:
            why = (f"~{gain:.1f}x less throughput at concurrency {work.concurrency}; its faster start "
                   f"({cold['llama.cpp']:.0f} s) matters little over {run_s / 3600:.1f} h runs")
        runner_up = {"engine": loser.engine, "quant": loser.quant, "settings": loser_settings,
                     "key_settings": loser_key, "fits": loser.fits, "why_lost": why}
    else:
        other = "vllm" if chosen.engine == "llama.cpp" else "llama.cpp"
        runner_up = {"engine": other, "quant": None, "settings": None, "fits": "no",
                     "why_lost": blocker or "it does not fit this model here"}
    return Recommendation(engine=chosen.engine, quant=chosen.quant or "", settings=settings, reasons=reasons,
                          numbers=numbers, runner_up=runner_up, fit=chosen, key_settings=key)

