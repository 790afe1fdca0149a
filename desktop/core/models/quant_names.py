"""How files name their quantization (`...-Q4_K_M.gguf`, `-IQ2_XXS`, `-BF16`) and roughly how many bits per
weight each one spends: one table that the Hub variants, the names pages show and the quality budget all read.

The bits are llama.cpp's block sizes (ggml-common.h) rounded, for ordering only: the fit reads the real sizes from
the files.
"""

from __future__ import annotations

import re

from desktop.core.models.quants import FORMATS

# Longest alternatives first so Q4_K_M wins over Q4_K and IQ2_XXS over IQ2_XS.
QUANT_RE = re.compile(
    r"(?<![A-Za-z0-9])("
    r"IQ[1-4]_(?:XXS|XS|S|M|NL)|IQ1_[SM]|TQ[12]_0|MXFP4(?:_MOE)?|"
    r"Q[2-8]_K_(?:XL|L|M|S)|Q[2-8]_K|Q[4-8]_[01](?:_[48]_[48])?|Q4_0_4_[48]|Q[2-8]_K_XXL|"
    r"BF16|F16|FP16|F32|FP32|FP8|UD-[A-Z0-9_]+"
    r")(?![A-Za-z0-9])",
    re.I,
)
# Bits per weight over a whole file (embeddings included) of a Llama-like model, from llama.cpp's block sizes: the
# fit's sizes of GGUFs it has not read (planning.weights) and the order of quality among a repo's variants.
BITS_PER_WEIGHT: dict[str, float] = {
    "F32": 32.0, "FP32": 32.0, "F16": 16.0, "FP16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "FP8": 8.0, "Q6_K": 6.56,
    "Q5_1": 6.0, "Q5_K_M": 5.69, "Q5_K_S": 5.54, "Q5_0": 5.5, "Q4_1": 5.0, "Q4_K_M": 4.89, "Q4_K_S": 4.58,
    "Q4_0": 4.55, "IQ4_NL": 4.5, "IQ4_XS": 4.25, "MXFP4": FORMATS["mxfp4"].bits, "Q3_K_L": 4.27, "Q3_K_M": 3.91,
    "IQ3_M": 3.66, "Q3_K_S": 3.5, "IQ3_S": 3.44, "Q2_K": 3.35, "IQ3_XS": 3.3, "IQ3_XXS": 3.06, "IQ2_M": 2.7,
    "IQ2_S": 2.5, "IQ2_XS": 2.31, "IQ2_XXS": 2.06, "TQ2_0": 2.06, "IQ1_M": 1.75, "TQ1_0": 1.69, "IQ1_S": 1.56,
}


def quant_from_name(filename: str) -> str | None:
    base = filename.rsplit("/", 1)[-1]
    matches = QUANT_RE.findall(base) or QUANT_RE.findall(filename)
    return matches[-1].upper() if matches else None


def bits_per_weight(quant: str | None, default: float = 4.0) -> float:
    """Rough bits per weight of a quantization name (Q4_K_M -> 4.8), `default` when it is not one we know."""
    return float(BITS_PER_WEIGHT.get((quant or "").upper(), default))
