"""Will this model run, and how: per-engine memory accounting checked against the memory that is FREE now.

llama.cpp: weights from the GGUF's real tensor bytes (or a bits-per-weight table when only a config is known),
KV cache for the whole context shared by all slots at the chosen KV type, compute buffers (the logits and
attention-score scratch, which depend on n_ubatch and, without flash attention, on the context), the CUDA
context, and the repacked copy llama-server makes of the weights it runs on the CPU (planning/repack.py); when it
does not fit, the number of layers that do (`-ngl`) and the RAM the rest needs; and the host RAM its prompt
cache may fill (`--cache-ram`, planning/promptcache.py).

vLLM: its own budget, total x gpu_memory_utilization, minus weights, the activation peak it profiles with
max_num_batched_tokens tokens, non-torch memory and CUDA graphs; what is left is the KV cache, in 16-token
blocks. It refuses to start when free memory is below the budget, or when the KV cache cannot hold one
max_model_len request.

The input is a LaunchPlan (context per request x slots, KV type, -ngl, utilization, TP, dtype), and the result
carries that plan back with everything the accounting assumed written into it, so the argv says what was checked.

The constants below were fitted to published startup logs (see tests/test_fit_accuracy.py, which cites them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from desktop.core.common.defaults import DEFAULT_VLLM_CPU_KV_GIB, DEFAULT_VLLM_UTILIZATION
from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.base import LaunchPlan
from desktop.core.machine.hardware import GIB, MIB, GpuInfo, HardwareSnapshot
from desktop.core.models.facts import (
    ModelFacts,
    facts_from_config,
)
from desktop.core.models.quants import vllm_capability_note, vllm_capability_refusal
from desktop.core.planning import moe as experts_in_ram
from desktop.core.planning import promptcache, vision
from desktop.core.planning import repack as repacking
from desktop.core.planning.devices import pin_devices
from desktop.core.planning.fit_result import FitResult as FitResult  # re-exported: the result of every fit
from desktop.core.planning.fit_result import Verdict
from desktop.core.planning.llama_offload import offload_verdict, split_layers
from desktop.core.planning.weights import (
    CHECKPOINT_QUANTS,
    DTYPE_BYTES,
    VLLM_QUANTS,
    llama_weight_bytes,
    vllm_weight_bytes,
)

MAX_CTX = 16 * 1024 * 1024

# llama.cpp KV cache element sizes (bytes per element; quantized types include their block scales).
KV_TYPE_BYTES: dict[str, float] = {
    "f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
    "q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32,
}

LLAMA_CUDA_CONTEXT_BYTES = 350 * MIB  # CUDA context + cuBLAS handles per GPU; not in llama.cpp's logs
LLAMA_ROCM_CONTEXT_BYTES = 450 * MIB
VLLM_DRIVER_RESERVED_BYTES = int(0.45 * GIB)  # NVML total minus what torch/cudaMemGetInfo reports as total
VLLM_NON_TORCH_BYTES = int(0.30 * GIB)  # CUDA context/cuBLAS beyond torch's allocator (0.03-0.35 GiB in logs)
VLLM_NON_TORCH_TP_EXTRA_BYTES = int(0.10 * GIB)  # NCCL and custom all-reduce buffers per rank
VLLM_BLOCK_SIZE = 16
VLLM_BIG_GPU_BYTES = 70 * GIB  # from here vLLM's serve default max_num_batched_tokens is 8192 instead of 2048


VLLM_DEFAULT_UTILIZATION = DEFAULT_VLLM_UTILIZATION
VLLM_CPU_DEFAULT_KV_GIB = DEFAULT_VLLM_CPU_KV_GIB  # VLLM_CPU_KVCACHE_SPACE assumed (and then set) when none is given
LLAMA_DEFAULT_UBATCH = 512  # llama-server's default --ubatch-size


def backend_for(engine: str, hardware: HardwareSnapshot) -> str:
    """Which engine build a plan needs on this hardware: cuda | rocm | vulkan | metal | cpu. For llama.cpp the
    provisioning room decides (`runtimes.preferred_variant`, the build `engines install` makes with this machine's
    compilers); vLLM runs on CUDA, or its CPU build."""
    from desktop.core.engines import runtimes

    if sizing_of(engine) == "vllm":
        return "cuda" if any(g.vendor == "nvidia" for g in hardware.cuda_gpus) else \
            "rocm" if hardware.cuda_gpus else "cpu"
    return runtimes.preferred_variant(hardware, runtimes.Toolchain.of(hardware))[0]


@dataclass(frozen=True)
class FitSettings:
    """The fit's reading of a LaunchPlan: the plan's fields under the names the engines' own accounting uses.
    Never built by callers; `FitSettings.of(plan)` is the only constructor used, so the fit checks the plan."""

    ctx: int  # llama.cpp total context (all slots, `-c`); vLLM max_model_len
    parallel: int = 1  # llama.cpp slots (-np); vLLM max_num_seqs
    kv_type: str = "f16"  # llama.cpp --cache-type-k/v
    gpu_layers: int | None = None  # llama.cpp -ngl; None = as many as fit
    n_cpu_moe: int | None = None  # llama.cpp --n-cpu-moe; None = as few as fit (MoE models that do not fit whole)
    override_tensors: tuple[str, ...] = ()  # llama.cpp -ot rules as typed (planning/moe.py reads them)
    ubatch: int = LLAMA_DEFAULT_UBATCH
    flash_attn: bool | None = None  # None = llama-server's auto, which turns it on (CPU, CUDA, Metal, Vulkan)
    quant: str | None = None  # "what if" quantization: a GGUF type (Q4_K_M) or a vLLM one (fp8, awq)
    dtype: str = "auto"
    gpu_memory_utilization: float = VLLM_DEFAULT_UTILIZATION
    max_num_batched_tokens: int | None = None
    cpu_offload_gb: float = 0.0  # vLLM --cpu-offload-gb: per GPU, weights kept in RAM
    tensor_parallel: int = 1
    enforce_eager: bool = False
    kv_cache_dtype: str = "auto"  # vLLM: auto | fp8
    cuda_graphs_in_budget: bool = True  # newer vLLM subtracts its CUDA-graph estimate from the KV budget
    cpu_kv_cache_gib: float = VLLM_CPU_DEFAULT_KV_GIB  # vLLM CPU backend's VLLM_CPU_KVCACHE_SPACE
    repack: bool = True  # llama.cpp: CPU weight repacking on (its default; --no-repack turns it off)
    no_host: bool = False  # llama.cpp --no-host: CPU-side weights skip the GPU's host buffer (and so repack)
    images_per_prompt: int = 0  # vLLM --limit-mm-per-prompt: images whose encoder pass the fit counts

    @classmethod
    def of(cls, plan: LaunchPlan, quant: str | None = None, cuda_graphs_in_budget: bool = True) -> FitSettings:
        llama = sizing_of(plan.engine) == "llama.cpp"
        if not llama and quant is None and plan.quantization:
            quant = plan.quantization
        repacks, no_host = repacking.launch_flags(plan.extra_args, dict(plan.env)) if llama else (True, False)
        return cls(
            ctx=plan.llama_ctx_size if llama else plan.ctx_per_request, parallel=plan.slots,
            kv_type=(plan.kv_cache_type or "f16") if llama else "f16", gpu_layers=plan.gpu_layers,
            n_cpu_moe=plan.n_cpu_moe if llama else None, override_tensors=plan.override_tensors if llama else (),
            ubatch=plan.ubatch or LLAMA_DEFAULT_UBATCH, flash_attn=plan.flash_attn, quant=quant, dtype=plan.dtype,
            gpu_memory_utilization=plan.gpu_memory_utilization or VLLM_DEFAULT_UTILIZATION,
            max_num_batched_tokens=plan.max_num_batched_tokens, tensor_parallel=plan.tensor_parallel,
            cpu_offload_gb=(plan.cpu_offload_gb or 0.0) if not llama else 0.0,
            enforce_eager=plan.eager, kv_cache_dtype="auto" if llama else (plan.kv_cache_type or "auto"),
            cuda_graphs_in_budget=cuda_graphs_in_budget,
            # whole GiB, as the engine's VLLM_CPU_KVCACHE_SPACE takes it
            cpu_kv_cache_gib=max(1, round(plan.kv_cache_gib)) if plan.kv_cache_gib is not None
            else VLLM_CPU_DEFAULT_KV_GIB, repack=repacks, no_host=no_host,
            images_per_prompt=(plan.images_per_prompt or 0) if not llama else 0)

    def validate(self) -> None:
        if not (0 < self.ctx <= MAX_CTX):
            raise SwitchyardError(f"context length {self.ctx} is out of range",
                                  f"pass a ctx between 1 and {MAX_CTX:,} tokens")
        if not (1 <= self.parallel <= 65536):
            raise SwitchyardError(f"parallel slots must be between 1 and 65536, not {self.parallel}")
        if self.kv_type.lower() not in KV_TYPE_BYTES:
            raise SwitchyardError(f"unknown KV cache type '{self.kv_type}'", f"use one of: {', '.join(KV_TYPE_BYTES)}")
        if self.gpu_layers is not None and self.gpu_layers < 0:
            raise SwitchyardError("GPU layers cannot be negative", "use 0 for CPU only, or leave it unset for auto")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise SwitchyardError(f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization}")
        if not (1 <= self.tensor_parallel <= 64):
            raise SwitchyardError(f"tensor parallel size must be between 1 and 64, not {self.tensor_parallel}")
        if not (1 <= self.ubatch <= 65536):
            raise SwitchyardError("ubatch must be positive")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise SwitchyardError("max_num_batched_tokens must be positive")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"):
            raise SwitchyardError(f"unknown vLLM kv_cache_dtype '{self.kv_cache_dtype}'", "use auto or fp8")
        if self.cpu_kv_cache_gib <= 0:
            raise SwitchyardError("the CPU KV cache size must be positive")
        if self.dtype != "auto" and self.dtype not in DTYPE_BYTES:
            raise SwitchyardError(f"unknown dtype '{self.dtype}'", f"use auto or one of: {', '.join(DTYPE_BYTES)}")


def validate_plan(plan: LaunchPlan) -> None:
    """Reject impossible plan values before anything slow happens (per-request ctx and slots checked here)."""
    if not (0 < plan.ctx_per_request <= MAX_CTX):
        raise SwitchyardError(f"context length {plan.ctx_per_request} is out of range",
                              f"pass a ctx between 1 and {MAX_CTX:,} tokens per request")
    if not (1 <= plan.slots <= 65536):
        raise SwitchyardError(f"parallel slots must be between 1 and 65536, not {plan.slots}",
                              "pass --parallel N with N >= 1")
    FitSettings.of(plan).validate()


def sizing_plan(engine: str, **fields: Any) -> LaunchPlan:
    """A plan for sizing only (`switchyard fit`, export's target sizing): no model file needed."""
    return LaunchPlan(engine=normalise_engine(engine), model_path=Path(str(fields.pop("model_path", "model"))),
                      **fields)


def launch_dtype(engine: str, *, demo: bool, cuda: bool) -> str:
    """`auto` (the checkpoint's own dtype) everywhere, except the demo's float32 weights on vLLM's CPU backend,
    where "auto" would cast them to a 16-bit type the CPU may only emulate. The one place float32 is chosen."""
    return "float32" if sizing_of(engine) == "vllm" and demo and not cuda else "auto"


def default_ctx(facts: ModelFacts, engine: str) -> int:
    """The per-request context when none is given: vLLM takes the model's; for llama.cpp 4096 at most."""
    return facts.context_length if sizing_of(engine) == "vllm" else min(facts.context_length, 4096)


def exact_bytes(result: FitResult) -> dict[str, float]:
    """The fit's components in bytes, unrounded (the GiB fields are rounded to 1 MiB, too coarse to compare a
    small model with the engine's own report): weights, kv_cache, compute (llama.cpp compute + output buffers,
    vLLM activation peak)."""
    return {k.removeprefix("bytes."): v for k, v in result.breakdown.items() if k.startswith("bytes.")}


def normalise_engine(engine: str) -> str:
    """The registered engine's name for any accepted spelling (the adapter registry is the one list)."""
    from desktop.core.engines import get_adapter

    return get_adapter(engine).name


def sizing_of(engine: str) -> str:
    """Which memory accounting sizes `engine`: "llama.cpp" or "vllm" (the adapter's `sizing`, default its name)."""
    from desktop.core.engines import get_adapter

    adapter = get_adapter(engine)
    return adapter.sizing or adapter.name


def _gib(value: float) -> float:
    return round(value / GIB, 3)


# --- shared model arithmetic --------------------------------------------------------------------------

def _kv_width(facts: ModelFacts) -> int:
    """K plus V elements per token per layer."""
    if facts.kv_lora_rank:
        return facts.kv_lora_rank + (facts.qk_rope_head_dim or 64)
    return 2 * facts.n_kv_heads * facts.head_dim


# --- llama.cpp ------------------------------------------------------------------------------------------

def _llama_cells(facts: ModelFacts, ctx: int, parallel: int, ubatch: int) -> tuple[int, int]:
    """KV cells per sequence stream: (full-attention layers, sliding-window layers). llama-server keeps one
    stream per slot (kv_unified off unless -np is auto): each holds ctx/np cells padded to 256, and a
    sliding-window layer only window + ubatch of them (llama-kv-cache-iswa.cpp, measured: gemma3 rows of
    benchmarks/results/fit)."""
    cells = -(-max(ctx // max(parallel, 1), 1) // 256) * 256
    window = facts.sliding_window or 0
    swa_cells = -(-min(cells, window + ubatch) // 256) * 256 if window and facts.swa_layers else 0
    return cells, swa_cells


def _llama_kv_bytes(facts: ModelFacts, ctx: int, parallel: int, ubatch: int, kv_type: str) -> int:
    if facts.encoder:  # llama.cpp builds an encoder without memory (llama-model.cpp create_memory)
        return 0
    cells, swa_cells = _llama_cells(facts, ctx, parallel, ubatch)
    per_cell_layer = _kv_width(facts) * KV_TYPE_BYTES[kv_type]
    swa = min(facts.swa_layers, facts.n_layers) if swa_cells else 0
    full_layers = facts.n_layers - swa
    return int(per_cell_layer * parallel * (full_layers * cells + swa * swa_cells))


def _llama_compute_bytes(facts: ModelFacts, ctx: int, ubatch: int, flash_attn: bool, parallel: int = 1) -> int:
    """The scheduler's compute buffer for one worst-case ubatch plus the host output (logits) buffer.

    With flash attention (llama-server's auto turns it on): f32 activations of ~5 hidden-sized and 3
    FFN-sized rows per token (gate, up and their product; for MoE the active experts' FFN), one f16 KQ mask per
    cache kind (cells per stream x ubatch), and logits for one output per slot (slots x vocab, f32). Only the
    last token of each sequence is decoded to logits: a vocabulary-sized buffer per slot, not per ubatch row.
    Measured against llama-server 11434's `-v` buffer lines (benchmarks/fit_vs_engine.py, tuning split).
    Without flash attention the KQ scores (ubatch x ctx x heads, f32) are materialised; that branch keeps the
    older formula fitted to published logs (tests/test_fit_accuracy.py)."""
    ub = min(ubatch, max(ctx, 1))
    h = facts.hidden_size
    if flash_attn:
        if facts.is_moe:
            ff = (facts.n_experts_active or 2) * (facts.moe_intermediate_size or facts.intermediate_size or 4 * h)
        else:
            ff = facts.intermediate_size or 4 * h
        cells, swa_cells = _llama_cells(facts, ctx, parallel, ubatch)
        full = facts.n_layers - (min(facts.swa_layers, facts.n_layers) if swa_cells else 0)
        masks = 2 * ub * ((cells if full > 0 else 0) + swa_cells)
        output = 4 * parallel * facts.vocab_size
        return int(4 * ub * (5 * h + 3 * ff) + masks + output)
    logits = 4 * ub * (h + facts.vocab_size)
    scores = 4 * ub * (1 + 4 * h + ctx * (1 + facts.n_heads))
    return int(max(logits, scores))


def _context_bytes(gpu: GpuInfo) -> int:
    if gpu.unified_memory or gpu.backend == "metal":
        return 0
    return LLAMA_ROCM_CONTEXT_BYTES if gpu.backend == "rocm" else LLAMA_CUDA_CONTEXT_BYTES


def _device_label(gpus: list[GpuInfo]) -> str:
    if not gpus:
        return "CPU"
    names = sorted({g.name for g in gpus})
    return f"{len(gpus)}x {' + '.join(names)}"


def llama_gpus(hw: HardwareSnapshot) -> list[GpuInfo]:
    """The GPUs llama.cpp splits layers over: all of them, except that a CUDA process enumerates only one MIG
    instance, so a machine with MIG instances is sized on its single roomiest device."""
    gpus = [g for g in hw.gpus if g.memory_total_bytes > 0]
    if any(g.mig for g in gpus) and len(gpus) > 1:
        return [max(gpus, key=lambda g: g.memory_free_bytes)]
    return gpus


def _llama_on_cpu(hw: HardwareSnapshot, s: FitSettings, weights: int, kv: int, compute: int, rep: repacking.Repacked,
                  quant: str, has_gpu: bool, per_request: int, n_layers: int, breakdown: dict[str, float],
                  settings: dict[str, Any], notes: list[str]) -> FitResult:
    """llama.cpp with no layer on a GPU: everything in RAM; `weights` is what stays mapped of the file (its
    repacked edges are released)."""
    ram = hw.ram_available_bytes
    need = weights + kv + compute + rep.total
    breakdown.update({"weights": _gib(weights), "bytes.weights": float(weights), "repacked": _gib(rep.total),
                      "bytes.repacked": float(rep.total)})
    if rep.total:
        notes.append(repacking.note(rep.total, rep))
    verdict: Verdict = "yes" if need <= ram else "no"
    if not has_gpu:
        notes.append("no GPU: runs on the CPU (memory-bandwidth bound; smaller quantizations are faster)")
    notes += experts_in_ram.cpu_plan_notes(s.n_cpu_moe, s.override_tensors)
    if verdict == "no":
        notes.append("not enough free RAM: pick a smaller quantization or a shorter context")
    return FitResult("llama.cpp", verdict, _gib(weights), _gib(kv), _gib(compute), _gib(need), _gib(ram),
                     _gib(ram - need), "CPU", per_request, gpu_layers=0, total_layers=n_layers + 1,
                     cpu_ram_gib=_gib(need), quant=quant, breakdown=breakdown, settings=settings, notes=notes)


def _estimate_llama(facts: ModelFacts, hw: HardwareSnapshot, s: FitSettings) -> FitResult:
    notes: list[str] = []
    ctx = s.ctx  # the total -c, shared by the slots
    per_request = ctx // s.parallel  # at most the trained window (`estimate` caps it, as llama-server does)
    kv_type = s.kv_type.lower()
    gpus = llama_gpus(hw)
    if len(gpus) < len([g for g in hw.gpus if g.memory_total_bytes > 0]):
        notes.append(f"a CUDA process sees one MIG instance: sized on {gpus[0].name} alone")
    use_gpu = bool(gpus) and s.gpu_layers != 0
    flash = s.flash_attn if s.flash_attn is not None else True  # -fa auto: on wherever the backend has it
    if kv_type != "f16" and kv_type not in ("f32", "bf16") and not flash:
        notes.append("a quantized V cache needs flash attention (-fa on)")
    weights, quant = llama_weight_bytes(facts, s.quant)
    if quant == "MXFP4" and not facts.is_moe and not facts.is_gguf:
        notes.append("MXFP4 quantizes MoE experts only: llama-quantize's MXFP4_MOE leaves a dense model at Q8_0")
    kv = _llama_kv_bytes(facts, ctx, s.parallel, s.ubatch, kv_type)
    compute = _llama_compute_bytes(facts, ctx, s.ubatch, flash, s.parallel)
    n_layers = facts.n_layers
    embed = facts.embedding_bytes or int(facts.vocab_size * facts.hidden_size * weights / max(facts.params or 1, 1))
    tied = facts.tie_word_embeddings or not facts.has_output_tensor
    nonrep = facts.nonrepeating_bytes or (embed if tied else 2 * embed)
    output = embed if tied else max(nonrep - embed, 0)  # the head on the GPU: a copy of the embedding when tied
    per_layer_w = max(weights - nonrep, 0) / n_layers
    per_layer_kv = kv / n_layers
    settings = {"ctx": ctx, "parallel": s.parallel, "kv_type": kv_type, "flash_attn": flash, "ubatch": s.ubatch,
                "ctx_per_slot": per_request, "repack": s.repack}
    rep = repacking.model_copy(facts, hw.cpu, [g.backend for g in gpus], s.repack, s.no_host, weights, quant)
    if s.parallel > 1:
        notes.append(f"{s.parallel} slots of {per_request:,} tokens share one {ctx:,}-token context (-c)")
    breakdown = {"weights": _gib(weights), "kv_cache": _gib(kv), "compute_buffers": _gib(compute),
                 "bytes.weights": float(weights), "bytes.kv_cache": float(kv), "bytes.compute": float(compute)}

    if not use_gpu:
        return _llama_on_cpu(hw, s, weights - rep.unmapped, kv, compute, rep, quant, bool(gpus), per_request,
                             n_layers, breakdown, settings, notes)

    context = sum(_context_bytes(g) for g in gpus)
    fixed = compute * len(gpus) + context  # with -sm layer every GPU allocates its own compute buffer
    gpu_free = sum(g.memory_free_bytes for g in gpus)
    if len(gpus) > 1:
        notes.append(f"layers are split across {len(gpus)} GPUs (llama.cpp --split-mode layer)")
    others = sum(g.other_processes_bytes for g in gpus)
    if others > GIB // 2:
        notes.append(f"{_gib(others):.1f} GiB of GPU memory is already used by other processes")
    full_gpu = (weights - nonrep) + output + kv + fixed
    breakdown.update({"gpu_context": _gib(context), "host_embeddings": _gib(embed)})

    def layers_that_fit() -> int:
        room = gpu_free - fixed
        return max(0, min(n_layers, math.floor(room / (per_layer_w + per_layer_kv)))) if room > 0 else 0

    # a MoE keeps the experts of some layers in RAM, every layer on the GPU (planning/moe.py)
    moe = experts_in_ram.place(facts, hw, weights, quant, n_cpu_moe=s.n_cpu_moe, rules=s.override_tensors,
                               gpu_layers=s.gpu_layers, full_gpu=full_gpu, gpu_free=gpu_free,
                               layers_that_fit=layers_that_fit, notes=notes)
    split = split_layers(moe, rep, n_layers=n_layers, per_layer=per_layer_w + per_layer_kv, fixed=fixed,
                         output=output, embed=embed)
    layers, gpu_used, cpu_part, moved, copy = split.layers, split.gpu_used, split.cpu_part, split.moved, split.copy
    breakdown.update({"gpu_used": _gib(gpu_used), "cpu_ram": _gib(cpu_part), "repacked": _gib(copy),
                      "bytes.repacked": float(copy)})
    if copy:
        notes.append(repacking.note(copy, rep))
    if moe.n_cpu_moe:
        settings["n_cpu_moe"] = moe.n_cpu_moe
    if moe.rules:
        settings["experts_in_ram_layers"] = moe.layers_in_ram()
    if moe.any_in_ram:
        breakdown.update({"experts_in_ram": _gib(moved), "bytes.experts_in_ram": float(moved)})
    verdict = offload_verdict(split, moe, hw, n_layers=n_layers, gpu_free=gpu_free, layers_that_fit=layers_that_fit,
                              notes=notes)
    return FitResult("llama.cpp", verdict, _gib(weights), _gib(kv), _gib(fixed), _gib(weights + kv + fixed),
                     _gib(gpu_free), _gib(gpu_free - gpu_used), _device_label(gpus), per_request, gpu_layers=layers,
                     total_layers=n_layers + 1, cpu_ram_gib=_gib(cpu_part), quant=quant, breakdown=breakdown,
                     settings=settings, notes=notes)


# --- vLLM -----------------------------------------------------------------------------------------------

def vllm_kv_bytes_per_token(facts: ModelFacts, tp: int, kv_cache_dtype: str, max_model_len: int,
                            dtype: str = "auto") -> float:
    """KV bytes per token per GPU as vLLM pages it (heads split across ranks, replicated below one head).
    With kv_cache_dtype auto the cache has the model's dtype: 2 bytes, 4 under --dtype float32. An encoder's
    attention keeps no cache (vLLM's EncoderOnlyAttention has no KV cache spec): 0."""
    if facts.encoder:
        return 0.0
    elem = 1.0 if kv_cache_dtype.startswith("fp8") else 4.0 if DTYPE_BYTES.get(dtype) == 4 else 2.0
    if facts.kv_lora_rank:
        per_layer = (facts.kv_lora_rank + (facts.qk_rope_head_dim or 64)) * elem
    else:
        heads = max(1, facts.n_kv_heads // tp)
        per_layer = 2 * heads * facts.head_dim * elem
    swa = min(facts.swa_layers, facts.n_layers) if facts.sliding_window else 0
    share = min(1.0, (facts.sliding_window or 0) / max(max_model_len, 1)) if swa else 0.0
    return per_layer * ((facts.n_layers - swa) + swa * share)


VLLM_CPU_BLOCK_SIZE = 128  # the CPU attention backend's default block (vllm/platforms/cpu.py)
VLLM_CPU_BATCHED_TOKENS = 2048  # the CPU API server's default max_num_batched_tokens (engine/arg_utils.py)


def _vllm_cpu_kv_tokens(facts: ModelFacts, kv_space: int, max_len: int, kv_cache_dtype: str, dtype: str,
                        batched: int) -> int:
    """The "KV cache size: N tokens" vLLM's CPU build logs: max concurrency x max_model_len, where a request
    needs whole 128-token blocks in every KV cache group. With sliding-window layers (the hybrid allocator)
    layers are grouped by type into groups of the smaller count; one block id holds a page in every group,
    and a sliding-window group holds min(window - 1 + in-flight tokens, max_model_len) tokens plus one block
    (kv_cache_interface.SlidingWindowSpec), not the whole request. Measured: benchmarks/results/fit."""
    elem = 1.0 if kv_cache_dtype.startswith("fp8") else 4.0 if DTYPE_BYTES.get(dtype) == 4 else 2.0
    if facts.kv_lora_rank:
        per_layer = (facts.kv_lora_rank + (facts.qk_rope_head_dim or 64)) * elem
    else:
        per_layer = 2 * facts.n_kv_heads * facts.head_dim * elem
    block = VLLM_CPU_BLOCK_SIZE
    swa = min(facts.swa_layers, facts.n_layers) if facts.sliding_window else 0
    full = facts.n_layers - swa
    group = min(full, swa) if full and swa else facts.n_layers
    pages = int(kv_space // (group * block * per_layer))  # block ids in the shared pool
    window_tokens = min((facts.sliding_window or 0) - 1 + batched, max_len)
    per_request = (-(-full // group)) * -(-max_len // block) if full else 0
    per_request += (-(-swa // group)) * (-(-window_tokens // block) + 1) if swa else 0
    return int(pages / max(per_request, 1) * max_len)


def _vllm_activation_bytes(facts: ModelFacts, batched: int, max_num_seqs: int, tp: int) -> int:
    """The profiled peak: ~3 bf16 copies of the (hidden + MLP) activations per batched token, plus the
    sampler's f32 logits for max_num_seqs sequences. Fitted to vLLM's "activation peak" log lines."""
    if facts.is_moe:
        inter = (facts.moe_intermediate_size or facts.intermediate_size or 4 * facts.hidden_size) * \
            (facts.n_experts_active or 2)
    else:
        inter = facts.intermediate_size or 4 * facts.hidden_size
    per_token = 3 * 2 * (facts.hidden_size + inter / tp)
    sampler = min(max_num_seqs, batched) * facts.vocab_size * 4
    return int(batched * per_token + sampler)


def _vllm_cuda_graph_bytes(facts: ModelFacts) -> int:
    return int((0.3 + 0.006 * facts.n_layers) * GIB)


def _capability(gpu: GpuInfo) -> float:
    try:
        return float(gpu.compute_capability or 0)
    except ValueError:
        return 0.0


def vllm_group(hw: HardwareSnapshot, tp: int) -> list[GpuInfo]:
    """The GPUs a vLLM with tensor parallel `tp` is sized on (and the endpoint's budget charges)."""
    gpus = hw.cuda_gpus
    return sorted(gpus, key=lambda g: g.memory_free_bytes)[:tp] if tp < len(gpus) else list(gpus)


def _vllm_images(facts: ModelFacts, s: FitSettings, settings: dict[str, Any], notes: list[str]) -> int:
    """The image encoder's pass over one request's images (models.projector.VisionTower; vLLM profiles it at
    start): counted with the activations."""
    images = facts.vision.encoder_bytes() * s.images_per_prompt if facts.vision else 0
    if images:
        settings["images_per_prompt"] = s.images_per_prompt
        notes.append(f"up to {s.images_per_prompt} image(s) per request: their encoder pass, {_gib(images):.2f} GiB, "
                     "is counted with the activations")
    return images


def _estimate_vllm(facts: ModelFacts, hw: HardwareSnapshot, s: FitSettings) -> FitResult:
    notes: list[str] = []
    max_len = s.ctx
    weights, quant = vllm_weight_bytes(facts, s.quant, s.dtype)
    if facts.is_gguf and s.quant is None:
        notes.append("sized for the model's Hugging Face BF16 checkpoint: vLLM serves safetensors "
                     "(its GGUF support is experimental)")
    tp = s.tensor_parallel
    gpus = hw.cuda_gpus
    settings: dict[str, Any] = {"max_model_len": max_len, "gpu_memory_utilization": s.gpu_memory_utilization,
                                "tensor_parallel": tp, "max_num_seqs": s.parallel,
                                "kv_cache_dtype": s.kv_cache_dtype, "enforce_eager": s.enforce_eager}
    per_token = vllm_kv_bytes_per_token(facts, tp, s.kv_cache_dtype, max_len, s.dtype)
    images = _vllm_images(facts, s, settings, notes)

    if not gpus:
        # vLLM's CPU backend: weights in RAM plus a fixed KV space (VLLM_CPU_KVCACHE_SPACE).
        kv_space = 0 if facts.encoder else int(s.cpu_kv_cache_gib * GIB)
        tokens = max_len * s.parallel if facts.encoder else _vllm_cpu_kv_tokens(
            facts, kv_space, max_len, s.kv_cache_dtype, s.dtype, s.max_num_batched_tokens or VLLM_CPU_BATCHED_TOKENS)
        need = weights + kv_space + int(1.0 * GIB) + images
        ram = hw.ram_available_bytes
        verdict: Verdict = "yes" if need <= ram and tokens >= max_len else "no"
        notes.append("no CUDA/ROCm GPU: vLLM would use its CPU build (whether it beats llama.cpp here is for an "
                     "A/B on this machine to say: `switchyard ab`)")
        if hw.has_unified_memory or any(g.backend == "metal" for g in hw.gpus):
            verdict = "no"
            notes.append("vLLM has no Metal backend: use llama.cpp on Apple Silicon")
        if tokens < max_len:
            notes.append(f"the CPU KV space holds {tokens:,} tokens, less than one {max_len:,}-token request")
        settings["kv_cache_gib"] = s.cpu_kv_cache_gib
        return FitResult("vllm", verdict, _gib(weights), _gib(kv_space), _gib(GIB), _gib(need), _gib(ram),
                         _gib(ram - need), "CPU", max_len, kv_cache_tokens=tokens,
                         max_concurrency=round(tokens / max_len, 2), cpu_ram_gib=_gib(need), quant=quant,
                         breakdown={"weights": _gib(weights), "kv_cache": _gib(kv_space),
                                    "bytes.weights": float(weights), "bytes.kv_cache": float(kv_space),
                                    "bytes.compute": float(GIB)},
                         settings=settings, notes=notes)

    if tp > len(gpus):
        raise SwitchyardError(f"tensor parallel {tp} needs {tp} GPUs; this machine has {len(gpus)}",
                              "lower --tp, or answer for other hardware with --gpu NAME --gpus N")
    group = vllm_group(hw, tp)
    if tp > 1 and any(g.mig for g in group):
        raise SwitchyardError("MIG instances cannot be joined for tensor parallel (a CUDA process sees one)",
                              "use --tp 1 on one MIG instance, or whole GPUs")
    gpu = min(group, key=lambda g: g.memory_free_bytes)  # vLLM sizes every rank like the tightest one
    total = gpu.memory_total_bytes - min(VLLM_DRIVER_RESERVED_BYTES, gpu.memory_total_bytes // 20)
    free = max(0, gpu.memory_free_bytes - min(VLLM_DRIVER_RESERVED_BYTES, gpu.memory_total_bytes // 20))
    budget = int(total * s.gpu_memory_utilization)
    batched = s.max_num_batched_tokens or (8192 if gpu.memory_total_bytes >= VLLM_BIG_GPU_BYTES else 2048)
    batched = max(batched, min(s.parallel, 8192))
    settings["max_num_batched_tokens"] = batched
    per_gpu_weights = weights // tp
    offloaded = min(per_gpu_weights, int(s.cpu_offload_gb * GIB))
    if offloaded:
        per_gpu_weights -= offloaded
        settings["cpu_offload_gb"] = s.cpu_offload_gb
        notes.append(f"--cpu-offload-gb {s.cpu_offload_gb:g}: {_gib(offloaded):.2f} GiB of weights per GPU stay in "
                     "RAM and cross PCIe at every step (throughput drops many times over)")
    activation = _vllm_activation_bytes(facts, batched, s.parallel, tp) + images
    non_torch = VLLM_NON_TORCH_BYTES + (VLLM_NON_TORCH_TP_EXTRA_BYTES if tp > 1 else 0)
    graphs = 0 if s.enforce_eager else _vllm_cuda_graph_bytes(facts)
    in_budget_graphs = graphs if s.cuda_graphs_in_budget else 0
    if facts.encoder:  # no KV cache: a share of the GPU would hold nothing; ask for what it uses, with a margin
        settings["gpu_memory_utilization"] = min(s.gpu_memory_utilization, math.ceil(
            (per_gpu_weights + activation + non_torch + in_budget_graphs + GIB // 4) * 1.1 / total * 100) / 100)
        budget = int(total * settings["gpu_memory_utilization"])
    kv = 0 if facts.encoder else budget - per_gpu_weights - activation - non_torch - in_budget_graphs
    tokens = max_len * s.parallel if facts.encoder else \
        max(0, int(kv // (per_token * VLLM_BLOCK_SIZE)) * VLLM_BLOCK_SIZE) if kv > 0 else 0
    overhead = activation + non_torch + graphs
    used = budget + (graphs - in_budget_graphs)
    breakdown = {"budget": _gib(budget), "weights": _gib(per_gpu_weights), "activation_peak": _gib(activation),
                 "non_torch": _gib(non_torch), "cuda_graphs": _gib(graphs), "kv_cache": _gib(max(kv, 0)),
                 "kv_bytes_per_token": round(per_token, 1), "bytes.weights": float(per_gpu_weights),
                 "bytes.kv_cache": float(max(kv, 0)), "bytes.compute": float(activation)}
    verdict = "yes"
    if per_gpu_weights + activation + non_torch >= budget:
        verdict = "no"
        notes.append(f"the weights alone ({_gib(per_gpu_weights):.2f} GiB per GPU) leave no room in the "
                     f"{_gib(budget):.2f} GiB budget: use a smaller quantization (fp8, AWQ) or more GPUs (--tp)")
        if facts.is_moe:
            notes.append("vLLM computes no experts in RAM: its --cpu-offload-gb streams offloaded weights over PCIe "
                         "at every step (many times slower); llama.cpp keeps experts in RAM and computes them there "
                         "(--n-cpu-moe)")
    elif tokens < max_len:
        verdict = "no"
        notes.append(f"vLLM would refuse to start: the KV cache holds {tokens:,} tokens, less than one "
                     f"{max_len:,}-token request; lower max_model_len to {max(tokens - tokens % 256, 0):,} or "
                     "raise gpu_memory_utilization")
    if free < budget:
        verdict = "no"
        fraction = math.floor((free / total - 0.01) * 100) / 100 if total else 0
        notes.append(f"only {_gib(free):.2f} GiB of {_gib(total):.2f} GiB is free now (other processes hold "
                     f"{_gib(gpu.other_processes_bytes):.2f} GiB); vLLM refuses to start below its budget of "
                     f"{_gib(budget):.2f} GiB" + (f": lower gpu_memory_utilization to {fraction:.2f}"
                                                   if fraction > 0.05 else ""))
    capability = min((_capability(g) for g in group if g.vendor == "nvidia"), default=0.0)
    refusal = vllm_capability_refusal(quant, gpu.name, capability)
    if refusal is not None:
        verdict = "no"
        notes.insert(0, refusal)
    elif (how := vllm_capability_note(quant, capability)) is not None:
        notes.append(how)
    if s.kv_cache_dtype.startswith("fp8"):
        notes.append("fp8 KV cache halves KV memory; accuracy loss is usually small")
    concurrency = round(tokens / max_len, 2) if max_len else None
    if verdict == "yes" and concurrency is not None and concurrency < 2:
        notes.append(f"only {concurrency:.2f} full-length requests fit at once: lower max_model_len for more "
                     "concurrency")
    if offloaded and offloaded * tp > hw.ram_available_bytes:
        verdict = "no"
        notes.append(f"the {_gib(offloaded * tp):.2f} GiB of offloaded weights do not fit in free RAM")
    return FitResult("vllm", verdict, _gib(per_gpu_weights), _gib(max(kv, 0)), _gib(overhead), _gib(used),
                     _gib(free), _gib(free - used), _device_label(group), max_len, kv_cache_tokens=tokens,
                     max_concurrency=concurrency, cpu_ram_gib=_gib(offloaded * tp), quant=quant, breakdown=breakdown,
                     settings=settings, notes=notes)


def estimate(facts: ModelFacts, hardware: HardwareSnapshot, plan: LaunchPlan, *, quant: str | None = None,
             cuda_graphs_in_budget: bool = True) -> FitResult:
    """Memory breakdown and verdict for launching `plan` (a model like `facts`) on `hardware` now.

    The result carries the plan it checked with every memory-relevant field resolved (-ngl, KV type, flash
    attention, gpu_memory_utilization, max_num_batched_tokens, the CPU KV space, dtype, backend): launching that
    plan is launching what was checked. `quant` asks "what if" for another quantization (a GGUF type or a vLLM one).
    """
    validate_plan(plan)
    key = normalise_engine(plan.engine)
    plan = replace(plan, engine=key)
    if plan.dtype == "auto":
        plan = replace(plan, dtype=launch_dtype(key, demo=facts.source == "demo", cuda=bool(hardware.cuda_gpus)))
    llama = sizing_of(key) == "llama.cpp"
    capped = plan.ctx_per_request if llama and plan.ctx_per_request > facts.context_length else 0
    if capped:  # llama-server serves a slot no more than the trained window (server-context.cpp "- capping")
        plan = replace(plan, ctx_per_request=facts.context_length)
    if not llama and plan.gpu_memory_utilization is None and hardware.cuda_gpus:  # what a launch would ask
        plan = replace(plan, gpu_memory_utilization=vllm_utilization(hardware))
    settings = FitSettings.of(plan, quant, cuda_graphs_in_budget)
    settings.validate()
    if llama:
        # the prompt cache's host RAM (--cache-ram) counted beside the engine's own (planning/promptcache.py)
        # the projector beside the layers (planning/vision.py), then the prompt cache's host RAM (--cache-ram)
        # counted beside the engine's own (planning/promptcache.py)
        result = vision.count(replace(_estimate_llama(facts, hardware, settings), engine=key), plan, hardware)
        result = promptcache.count(result, plan, hardware)
        if capped:
            result.notes.insert(0, f"ctx {capped:,} per request asked, {facts.context_length:,} served: the model's "
                                "trained window, where llama-server caps each slot; KV sized for that")
        kv_type = str(result.settings["kv_type"])
        quantized_v = kv_type not in ("f16", "f32", "bf16")
        # -fa stays auto (on, as the fit assumes) unless set, or a quantized V cache needs it on for certain
        resolved = replace(plan, gpu_layers=result.gpu_layers, kv_cache_type=kv_type,
                           n_cpu_moe=int(result.settings.get("n_cpu_moe", 0)) or None,
                           cache_ram_mib=int(result.settings["cache_ram_mib"]),
                           mmproj_offload=bool(result.settings.get("mmproj_offload", plan.mmproj_offload)),
                           image_max_tokens=result.settings.get("image_max_tokens", plan.image_max_tokens),
                           flash_attn=plan.flash_attn if plan.flash_attn is not None else (True if quantized_v else None),
                           backend="cpu" if result.device == "CPU" else backend_for(key, hardware))  # type: ignore[arg-type]
    else:
        result = replace(_estimate_vllm(facts, hardware, settings), engine=key)
        vquant = (result.quant or "").lower()
        flag = VLLM_QUANTS.get(vquant, (None, None))[1] if not (facts.quantization and not facts.is_gguf) else None
        if flag in CHECKPOINT_QUANTS:
            # vLLM cannot quantize to AWQ/GPTQ while loading ("Cannot find the config file for awq"): a what-if
            # for a checkpoint of that kind, never a flag on these weights
            flag = None
            why = f"vLLM cannot quantize to {vquant.upper()} while loading; " if vquant in ("awq", "gptq") else ""
            result = replace(result, settings={**result.settings, "needs_checkpoint": vquant},
                             notes=[*result.notes, f"what if only: {why}these numbers are for a {vquant.upper()} "
                                    "checkpoint of this model (download one from the Hub), not for these weights"])
        if quant in ("bf16", "fp16") and plan.dtype == "auto":
            if vllm_weight_bytes(facts, None)[1] != vquant:  # a cast (bf16 checkpoint served as fp16): say so
                plan = replace(plan, dtype="bfloat16" if vquant == "bf16" else "float16")
        if result.device == "CPU":
            resolved = replace(plan, quantization=flag or plan.quantization,
                               kv_cache_gib=float(result.settings["kv_cache_gib"]), gpu_memory_utilization=None,
                               backend="cpu")
        else:
            resolved = replace(plan, quantization=flag or plan.quantization,
                               gpu_memory_utilization=float(result.settings["gpu_memory_utilization"]),
                               max_num_batched_tokens=int(result.settings["max_num_batched_tokens"]),
                               backend=backend_for(key, hardware))  # type: ignore[arg-type]
    return replace(result, plan=pin_devices(resolved, sized_gpus(key, hardware, resolved), hardware))


def sized_gpus(engine: str, hardware: HardwareSnapshot, plan: LaunchPlan) -> list[GpuInfo]:
    """The GPUs the fit sized this plan on: llama.cpp all of them (layers split by free memory), vLLM the
    tensor-parallel group of the tightest-free GPUs; none for a CPU plan."""
    if plan.backend == "cpu":
        return []
    if normalise_engine(engine) == "llama.cpp":
        return llama_gpus(hardware)
    gpus = hardware.cuda_gpus
    tp = plan.tensor_parallel
    return sorted(gpus, key=lambda g: g.memory_free_bytes)[:tp] if tp < len(gpus) else list(gpus)


EXPERTS_IN_RAM = "experts-in-ram"  # a listing's tag for "partial" by --n-cpu-moe rather than by whole layers


def quick_verdict(engine: str, weights_bytes: int, config: dict[str, Any] | None, hardware: HardwareSnapshot) -> str:
    """A fast fits/partial/no tag for a Hub listing: exact accounting when a config is known, else weights x 1.2;
    a MoE that fits with its experts in RAM is tagged `experts-in-ram`."""
    key = normalise_engine(engine)
    if weights_bytes <= 0:
        raise SwitchyardError("weights size must be positive")
    if config:
        facts = replace(facts_from_config(config), weights_bytes=weights_bytes)
        if key == "llama.cpp":
            facts = replace(facts, source="gguf", quantization="gguf:custom", embedding_bytes=None,
                            nonrepeating_bytes=None)
        try:
            result = estimate(facts, hardware, sizing_plan(key, ctx_per_request=min(facts.context_length, 4096),
                                                           slots=1))
        except SwitchyardError:
            return "no"
        return EXPERTS_IN_RAM if result.fits == "partial" and result.settings.get("n_cpu_moe") else result.fits
    need = weights_bytes * 1.2 + GIB // 2
    gpus = hardware.cuda_gpus if key == "vllm" else hardware.gpus
    gpu_free = sum(g.memory_free_bytes for g in gpus)
    if key == "vllm":
        budget = sum(g.memory_total_bytes for g in gpus) * vllm_utilization(hardware)
        return "yes" if gpus and need <= min(budget, gpu_free) else "no"
    if gpus and need <= gpu_free:
        return "yes"
    if not gpus:  # a machine without a GPU runs every layer in RAM: that is the whole fit, not a partial one
        return "yes" if need <= hardware.ram_available_bytes else "no"
    return "partial" if need <= gpu_free + hardware.ram_available_bytes else "no"


def vllm_kv_tokens(facts: ModelFacts, kv_bytes: float, tensor_parallel: int = 1, kv_cache_dtype: str = "auto",
                   max_model_len: int | None = None) -> int:
    """Tokens a vLLM KV cache of `kv_bytes` per GPU holds (whole 16-token blocks), as its log reports them."""
    per_token = vllm_kv_bytes_per_token(facts, tensor_parallel, kv_cache_dtype, max_model_len or facts.context_length)
    if not per_token:  # an encoder: no cache to hold tokens in
        return 0
    return max(0, int(kv_bytes // (per_token * VLLM_BLOCK_SIZE)) * VLLM_BLOCK_SIZE)


def vllm_utilization(hardware: HardwareSnapshot, wanted: float = VLLM_DEFAULT_UTILIZATION) -> float:
    """`wanted`, or less when other processes hold GPU memory: vLLM refuses to start when free memory is below
    total x gpu_memory_utilization, so a plan for a desktop with a browser open asks for what is free."""
    gpus = hardware.cuda_gpus
    if not gpus:
        return wanted
    gpu = min(gpus, key=lambda g: g.memory_free_bytes)
    reserved = min(VLLM_DRIVER_RESERVED_BYTES, gpu.memory_total_bytes // 20)
    total = gpu.memory_total_bytes - reserved
    fraction = math.floor(((gpu.memory_free_bytes - reserved) / total - 0.01) * 100) / 100 if total > 0 else 0.0
    return wanted if fraction >= wanted or fraction < 0.5 else fraction


def tensor_parallel_sizes(facts: ModelFacts, gpus: int) -> list[int]:
    """vLLM tensor-parallel sizes worth trying: powers of two that divide the attention heads, at most `gpus`."""
    heads = facts.n_heads or 1
    return [tp for tp in (1, 2, 4, 8, 16, 32, 64) if tp <= max(gpus, 1) and heads % tp == 0]


def size_vllm(facts: ModelFacts, hardware: HardwareSnapshot, base: LaunchPlan, *, concurrency: float,
              quants: tuple[str | None, ...] = (None,)) -> FitResult | None:
    """THE vLLM sizing rule, shared by recommend and export: for each quantization in order (e.g. bf16, fp8,
    4-bit), the smallest tensor-parallel size whose KV cache holds `concurrency` requests of the plan's
    max_model_len. Precision is kept before GPUs are saved: bf16 on 4 GPUs beats fp8 on 2. When no combination
    holds the concurrency, the most precise quantization that starts, at the size that holds the most, is
    returned (the excess requests queue); None when nothing starts."""
    fallback: FitResult | None = None
    sizes = tensor_parallel_sizes(facts, len(hardware.cuda_gpus))
    for quant in quants:
        for tp in sizes:
            try:
                result = estimate(facts, hardware, replace(base, tensor_parallel=tp), quant=quant)
            except SwitchyardError:
                continue
            if result.fits != "yes" or (result.max_concurrency or 0) < 1:
                continue
            if (result.max_concurrency or 0) >= concurrency:
                return result
            if fallback is None or (fallback.quant == result.quant
                                    and (result.max_concurrency or 0) > (fallback.max_concurrency or 0)):
                fallback = result
    return fallback
