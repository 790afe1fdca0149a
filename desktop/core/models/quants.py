"""The 4-bit float weight formats of 2026 checkpoints (MXFP4, NVFP4), in one table that the facts, the fit, the
recommendation and the export sizing all read: bits per weight, which part of the model a format quantizes, and
the NVIDIA compute capability vLLM needs to run it at all and to run it natively.

Read in the pinned vLLM 0.32.0's own source (the ground truth; `tests/test_quants.py` checks the installed copy):
- mxfp4 (gpt-oss): `Mxfp4Config.get_min_capability()` is 80 (`model_executor/layers/quantization/mxfp4.py`);
  its `get_quant_method` quantizes routed experts only and leaves linear layers unquantized ("MXFP4 linear layer is
  not implemented"), which is what gpt-oss's `modules_to_not_convert` (attention, router, embeddings, head)
  says too. Native kernels on 9.0 (Hopper) and 10.0 (Blackwell); Marlin on 8.x and 12.x.
- nvfp4 (ModelOpt `quant_algo: NVFP4`, vLLM's `modelopt_fp4`; compressed-tensors `nvfp4-pack-quantized`):
  `ModelOptNvFp4Config.get_min_capability()` is 75: Marlin W4A16 on 7.5 to 9.x, FP4 tensor cores from 10.0.
- Bits: OCP MX FP4 is E2M1 values with one E8M0 scale per 32 (4 + 8/32 = 4.25 bits, GGML's MXFP4 block of 32 in
  17 bytes); NVFP4 is E2M1 with one FP8 E4M3 scale per 16 (4 + 8/16 = 4.5 bits).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightFormat:
    name: str  # as the facts and the fit name it (lower case)
    label: str  # as people write it
    bits: float  # per quantized weight, scales included
    experts_only: bool  # only MoE expert weights are quantized; everything else stays 16-bit
    vllm_min_cc: float  # vLLM refuses the checkpoint on NVIDIA GPUs below this
    vllm_native_cc: float  # from here without an emulating (Marlin) kernel
    vllm_kernels: str  # in words, for notes
    marlin_on_12: bool = False  # consumer Blackwell (12.x) still takes the Marlin path


FORMATS: dict[str, WeightFormat] = {
    "mxfp4": WeightFormat("mxfp4", "MXFP4", 4.25, True, 8.0, 9.0,
                          "Marlin on compute capability 8.x and 12.x, native on 9.0 and 10.0", marlin_on_12=True),
    "nvfp4": WeightFormat("nvfp4", "NVFP4", 4.5, False, 7.5, 10.0,
                          "Marlin (4-bit weights, 16-bit math) below compute capability 10.0, native from 10.0"),
}


def weight_format(name: str | None) -> WeightFormat | None:
    return FORMATS.get((name or "").lower())


def vllm_capability_refusal(name: str | None, gpu: str, capability: float) -> str | None:
    """Why vLLM cannot run a checkpoint in format `name` on `gpu` of compute `capability`, or None when it can."""
    fmt = weight_format(name)
    if fmt is None or capability <= 0 or capability >= fmt.vllm_min_cc:
        return None
    return (f"vLLM needs compute capability {fmt.vllm_min_cc:.1f} for {fmt.label}; this {gpu} is "
            f"{capability:.1f}: llama.cpp runs it")


def vllm_capability_note(name: str | None, capability: float) -> str | None:
    """How vLLM runs format `name` at this compute capability (emulated or native), for the fit's notes."""
    fmt = weight_format(name)
    if fmt is None or capability < fmt.vllm_min_cc:
        return None
    native = capability >= fmt.vllm_native_cc and not (fmt.marlin_on_12 and int(capability) == 12)
    how = "native kernels" if native else "Marlin kernels"
    return f"{fmt.label} on compute capability {capability:.1f}: vLLM uses {how} ({fmt.vllm_kernels})"
