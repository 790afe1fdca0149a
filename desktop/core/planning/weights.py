"""Which bytes each engine loads for a quantization: llama.cpp's GGUF types (bits per weight over the file, or the
file's real tensor bytes) and vLLM's checkpoint formats and --quantization choices. The fit's memory accounting
(`planning.fit`) and the recommendation's ladders read these; the 4-bit float formats come from
`models.quants`, the table the facts and the export sizing share."""

from __future__ import annotations

from dataclasses import replace

from desktop.core.common.errors import SwitchyardError
from desktop.core.models.facts import ModelFacts, estimate_params, hf_weight_bytes, param_parts
from desktop.core.models.quant_names import BITS_PER_WEIGHT
from desktop.core.models.quants import FORMATS

# The quantizations the fit sizes by bits per weight (one table: models.quant_names); MXFP4 per expert weight:
# llama-quantize's MXFP4_MOE keeps the rest at Q8_0.
GGUF_BPW: dict[str, float] = {name: BITS_PER_WEIGHT[name] for name in (
    "F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_0", "IQ4_NL", "IQ4_XS",
    "Q3_K_L", "Q3_K_M", "Q3_K_S", "IQ3_M", "IQ3_XS", "Q2_K", "IQ2_M", "IQ2_XS", "MXFP4")}
GGUF_ALIASES = {"MXFP4_MOE": "MXFP4"}  # the file type's name (LlamaFileType.MOSTLY_MXFP4_MOE) for the same thing
GGUF_LADDER = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "IQ4_XS", "Q3_K_M")
MOE_GGUF_LADDER = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "MXFP4", "IQ4_XS", "Q3_K_M")  # experts at 4.25 bits

# vLLM quantization choices for config-only models: name -> (weight bits, vLLM --quantization value or None).
VLLM_QUANTS: dict[str, tuple[float | None, str | None]] = {
    "bf16": (None, None), "fp16": (None, None), "auto": (None, None), "fp8": (8.0, "fp8"),
    "int8": (8.0, None), "awq": (4.0, "awq"), "gptq": (4.0, "gptq"), "int4": (4.0, None), "w4a16": (4.0, None),
    "mxfp4": (FORMATS["mxfp4"].bits, "mxfp4"), "nvfp4": (FORMATS["nvfp4"].bits, "modelopt_fp4"),
}

# Only a checkpoint quantized that way is served that way (vLLM reads the format from its config).
CHECKPOINT_QUANTS = frozenset({"awq", "gptq", "mxfp4", "modelopt_fp4"})

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def gguf_quant_label(label: str | None) -> str | None:
    if not label:
        return None
    upper = GGUF_ALIASES.get(label.upper(), label.upper())
    return upper if upper in GGUF_BPW else None


def gguf_ladder(facts: ModelFacts) -> tuple[str, ...]:
    """The GGUF quantizations to try, best first: an MXFP4 checkpoint (gpt-oss) is served from its MXFP4 GGUF
    (nothing above it adds precision); other MoE models may also take MXFP4 experts; dense models never (MXFP4_MOE
    would leave them at Q8_0)."""
    if (facts.quantization or "").lower() == "mxfp4":
        return MOE_GGUF_LADDER[MOE_GGUF_LADDER.index("MXFP4"):]
    return MOE_GGUF_LADDER if facts.is_moe else GGUF_LADDER


def _gguf_bytes(facts: ModelFacts, params: int, label: str) -> int:
    """params x bits per weight; MXFP4 as llama-quantize's MXFP4_MOE writes it: experts at 4.25 bits, the rest
    at Q8_0."""
    if label != "MXFP4":
        return int(params * GGUF_BPW[label] / 8)
    experts = param_parts(facts)["experts"] if facts.is_moe else 0
    return int(experts * GGUF_BPW["MXFP4"] / 8 + (params - experts) * GGUF_BPW["Q8_0"] / 8)


def llama_weight_bytes(facts: ModelFacts, quant: str | None) -> tuple[int, str]:
    """Weights as llama.cpp will load them: the GGUF's real tensor bytes, or params x bits-per-weight."""
    wanted = gguf_quant_label(quant)
    if quant and not wanted:
        raise SwitchyardError(f"unknown GGUF quantization '{quant}'", f"use one of: {', '.join(GGUF_BPW)}")
    current = gguf_quant_label(facts.gguf_type)
    if facts.is_gguf and facts.weights_bytes and (wanted is None or wanted == current):
        return facts.weights_bytes, current or (facts.gguf_type or "gguf")
    params = facts.params or 0
    if not params:
        raise SwitchyardError(f"cannot size {facts.name}: parameter count unknown")
    if wanted:
        label = wanted
    elif (facts.quantization or "").lower() == "mxfp4":
        label = "MXFP4"
    elif facts.quant_bits:
        label = "Q4_K_M" if facts.quant_bits <= 4.5 else "Q8_0"
    else:
        label = "BF16" if facts.dtype == "bfloat16" else "F16"
    return _gguf_bytes(facts, params, label), label


def llama_expert_bytes(facts: ModelFacts, weights: int, label: str) -> list[int]:
    """Per layer, the MoE expert bytes among `weights` (llama.cpp's load at `label`): the GGUF's own tensor bytes
    when the file is what loads, else the experts' share of the parameters at the label's bits (MXFP4: 4.25).
    Empty for a dense model. What `--n-cpu-moe K` keeps in RAM is the sum of the first K."""
    if not facts.is_moe:
        return []
    if facts.is_gguf and facts.expert_layer_bytes and weights == facts.weights_bytes:
        return list(facts.expert_layer_bytes)
    experts = param_parts(facts)["experts"]
    if label in GGUF_BPW:
        total = experts * GGUF_BPW[label] / 8
    else:  # a file of unknown type (a Hub listing's size): the experts' share of its bytes
        total = weights * experts / max(facts.params or estimate_params(facts), 1)
    return [int(total / facts.n_layers)] * facts.n_layers


def vllm_weight_bytes(facts: ModelFacts, quant: str | None, dtype: str = "auto") -> tuple[int, str]:
    """Bytes vLLM loads: the checkpoint's own size, or params at the requested quantization or --dtype."""
    if quant is None and dtype in DTYPE_BYTES and not facts.quant_bits:
        # an explicit --dtype casts an unquantized checkpoint: float32 is twice bf16
        label = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16"}.get(dtype, "fp16")
        return int((facts.params or estimate_params(facts)) * DTYPE_BYTES[dtype]), label
    if quant is None:
        if facts.is_gguf:
            # vLLM would load the HF checkpoint of this architecture in BF16 (its GGUF path is experimental).
            bf16 = replace(facts, quant_bits=None, quantization=None, dtype="bfloat16")
            return hf_weight_bytes(bf16, facts.params), "bf16"
        label = facts.quantization or (facts.dtype or "bf16").replace("bfloat16", "bf16").replace("float16", "fp16")
        return facts.weights_bytes or hf_weight_bytes(facts), label
    key = quant.lower()
    if key not in VLLM_QUANTS:
        raise SwitchyardError(f"unknown vLLM quantization '{quant}'", f"use one of: {', '.join(VLLM_QUANTS)}")
    bits, _flag = VLLM_QUANTS[key]
    if facts.quantization and not facts.is_gguf and facts.weights_bytes:
        if bits == facts.quant_bits or (bits is None and facts.quant_bits is None):
            return facts.weights_bytes, key
    variant = replace(facts, quant_bits=bits, quantization=key if bits else None,
                      dtype="bfloat16" if bits is None else facts.dtype)
    return hf_weight_bytes(variant, facts.params), key
