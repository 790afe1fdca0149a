"""The quality gap beside the speed gap (issue 56): an A/B whose two sides load different weights (a Q4_K_M GGUF
on llama.cpp against the bf16 checkpoint on vLLM) compares more than engines, and its report says so: each side's
weights, and how far they move the answers from the reference where `switchyard quality` measured it here.

Nothing is estimated: a side whose weights were not measured says "not measured here" and names the command.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from desktop.core.models.quant_names import quant_from_name
from desktop.core.planning.quant_choice import measured_quants, quant_key


@dataclass(frozen=True)
class SideQuality:
    engine: str
    weights: str  # Q4_K_M, F32, bfloat16 ... ("?" when neither the name nor the plan says)
    mean_kld: float | None
    same_top: float | None
    basis: str  # "measured here on DATE (run #N)" | "the reference" (its precision) | "not measured here"

    def to_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "weights": self.weights, "mean_kld": self.mean_kld,
                "same_top": self.same_top, "basis": self.basis}


def weights_of(model_path: str, plan: Mapping[str, Any]) -> str:
    """What the side loads: the GGUF's quantization (its name, else its header's file type), or the plan's
    quantization or dtype for a checkpoint."""
    path = Path(model_path)
    if path.suffix == ".gguf":
        named = quant_from_name(path.name)
        if named:
            return named
        try:
            from gguf import LlamaFileType

            from desktop.core.models.gguf_file import read_gguf_header

            file_type = read_gguf_header(path).metadata.get("general.file_type")
            if file_type is None:
                return "?"
            return LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except (OSError, ValueError, TypeError, ImportError):
            return "?"
    if plan.get("quantization"):
        return str(plan["quantization"]).upper()
    dtype = str(plan.get("dtype") or "auto")
    if dtype == "auto":  # the checkpoint's own
        try:
            import json

            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
            dtype = str(config.get("torch_dtype") or config.get("dtype") or "?")
        except (OSError, ValueError, AttributeError):
            return "?"
    return _DTYPES.get(dtype, dtype)


_DTYPES = {"float32": "F32", "float": "F32", "bfloat16": "BF16", "float16": "F16", "half": "F16"}


def sides(engines: Sequence[tuple[str, str, Mapping[str, Any]]], quality: Mapping[str, Any] | None
          ) -> list[SideQuality]:
    """(engine, model path, plan) per side, with the model's newest quality run here (planning.evidence)."""
    measured = measured_quants(quality)
    reference_path = str((quality or {}).get("reference") or "")
    reference = weights_of(reference_path, {}) if reference_path and Path(reference_path).exists() else None
    out = []
    for engine, model_path, plan in engines:
        weights = weights_of(model_path, plan)
        figure = measured.get(quant_key(weights))
        if weights == reference:
            out.append(SideQuality(engine, weights, 0.0, 1.0, "the reference"))
        elif figure is not None:
            out.append(SideQuality(engine, weights, figure.mean_kld, figure.same_top,
                                   f"{figure.basis} (run #{figure.run_id})"))
        else:
            out.append(SideQuality(engine, weights, None, None, "not measured here"))
    return out


def gap_line(found: Sequence[SideQuality], model: str) -> str:
    """One sentence for the report: the same weights on both sides, or each side's weights and quality."""
    if len({s.weights for s in found}) <= 1:
        return f"same weights on both sides ({found[0].weights}): the gap is the engines'" if found else ""
    parts = []
    for side in found:
        if side.mean_kld is None:
            parts.append(f"{side.engine} {side.weights} (quality not measured here)")
        elif side.basis == "the reference":
            parts.append(f"{side.engine} {side.weights} (the reference's precision)")
        else:
            top = f", same top token {side.same_top:.1%}" if side.same_top is not None else ""
            parts.append(f"{side.engine} {side.weights} (mean KLD {side.mean_kld:.4f}{top}, {side.basis})")
    line = "different weights: " + " vs ".join(parts) + "; the speed gap includes the precision gap"
    if any(s.mean_kld is None for s in found):
        line += f"; `switchyard quality {model} --variants ...` measures the quality gap"
    return line
