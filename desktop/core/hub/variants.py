"""A repo's downloadable variants: GGUF files grouped by quantization (shards as one set), safetensors sets.

Each variant is tagged with whether it fits this machine for the engine that can run it (GGUF -> llama.cpp,
safetensors -> vLLM), and one is marked recommended, like LM Studio's tags but for both engines.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from desktop.core.models.gguf_file import SHARD_NAME

log = logging.getLogger(__name__)

#: (engine, weights_bytes, config) -> "yes" | "partial" | "no"
FitTagger = Callable[[str, int, "dict[str, Any] | None"], str]

SHARD_RE = SHARD_NAME  # one naming of shards: the one llama-server opens (models.gguf_file)
# Longest alternatives first so Q4_K_M wins over Q4_K and IQ2_XXS over IQ2_XS.
QUANT_RE = re.compile(
    r"(?<![A-Za-z0-9])("
    r"IQ[1-4]_(?:XXS|XS|S|M|NL)|IQ1_[SM]|TQ[12]_0|MXFP4(?:_MOE)?|"
    r"Q[2-8]_K_(?:XL|L|M|S)|Q[2-8]_K|Q[4-8]_[01](?:_[48]_[48])?|Q4_0_4_[48]|Q[2-8]_K_XXL|"
    r"BF16|F16|FP16|F32|FP32|FP8|UD-[A-Z0-9_]+"
    r")(?![A-Za-z0-9])",
    re.I,
)
# Rough bits per weight, for ordering quality (higher is better) when choosing the recommendation.
_BITS = {
    "F32": 32, "FP32": 32, "BF16": 16, "F16": 16, "FP16": 16, "Q8_0": 8.5, "FP8": 8, "Q6_K": 6.6,
    "Q5_K_M": 5.7, "Q5_K_S": 5.5, "Q5_0": 5.5, "Q5_1": 6, "Q4_K_M": 4.8, "Q4_K_S": 4.6, "Q4_0": 4.5,
    "Q4_1": 5, "IQ4_NL": 4.5, "IQ4_XS": 4.3, "MXFP4": 4.25, "Q3_K_L": 4.3, "Q3_K_M": 3.9, "Q3_K_S": 3.5,
    "IQ3_M": 3.7, "IQ3_S": 3.4, "IQ3_XS": 3.3, "IQ3_XXS": 3.1, "Q2_K": 3.4, "IQ2_M": 2.7, "IQ2_S": 2.5,
    "IQ2_XS": 2.3, "IQ2_XXS": 2.1, "IQ1_M": 1.8, "IQ1_S": 1.6, "TQ1_0": 1.7, "TQ2_0": 2.1,
}


@dataclass(frozen=True)
class RemoteFile:
    """One file of a repo at a commit, with what is needed to verify it."""

    path: str
    size: int
    blob_id: str  # git blob sha1
    sha256: str | None  # LFS files only

    @property
    def etag(self) -> str:
        """The name huggingface_hub gives the blob in the cache (X-Linked-Etag for LFS, else the git oid)."""
        return self.sha256 or self.blob_id


@dataclass
class Variant:
    """A unit a user downloads: one GGUF quant (all its shards) or one safetensors set."""

    name: str  # what follows REPO: in `switchyard pull REPO:NAME`
    format: str  # "gguf" | "safetensors"
    engine: str  # "llama.cpp" | "vllm"
    quantization: str | None  # Q4_K_M, AWQ, GPTQ, FP8 ...
    dtype: str | None
    size_bytes: int
    files: list[RemoteFile] = field(default_factory=list)
    shards: int = 1
    fit: str = "unknown"  # "yes" | "partial" | "experts-in-ram" (partial by --n-cpu-moe) | "no" | "unknown"
    recommended: bool = False

    @property
    def primary_file(self) -> str:
        """The file to hand the engine: the first shard of a GGUF set, the folder of a safetensors set."""
        if self.format == "gguf":
            return sorted(f.path for f in self.files)[0]
        folder = self.files[0].path.rpartition("/")[0]
        return folder

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["files"] = [f.path for f in self.files]
        out["primary_file"] = self.primary_file
        return out


@dataclass
class VariantList:
    repo_id: str
    commit: str | None
    gated: bool
    variants: list[Variant]
    extra_files: list[str]  # config, tokenizer, mmproj ... fetched with safetensors sets

    def to_json(self) -> dict[str, Any]:
        return {
            "repo_id": self.repo_id,
            "commit": self.commit,
            "gated": self.gated,
            "variants": [v.to_json() for v in self.variants],
            "extra_files": self.extra_files,
        }

    def find(self, selector: str) -> Variant | None:
        """A variant by name or quant (case-insensitive), or the one containing a file path."""
        wanted = selector.strip().lower()
        for v in self.variants:
            if v.name.lower() == wanted or (v.quantization or "").lower() == wanted:
                return v
        for v in self.variants:
            if any(f.path.lower() == wanted for f in v.files):
                return v
        return None


def quant_from_name(filename: str) -> str | None:
    base = filename.rsplit("/", 1)[-1]
    matches = QUANT_RE.findall(base) or QUANT_RE.findall(filename)
    return matches[-1].upper() if matches else None


def _folder_quant(folder: str) -> str | None:
    m = re.search(r"(?<![A-Za-z0-9])(awq|gptq|fp8|int4|int8|w4a16|w8a8)(?![A-Za-z0-9])", folder, re.I)
    return m[1].upper() if m else quant_from_name(folder)


def _safetensors_quant(config: dict[str, Any] | None, tags: Iterable[str]) -> str | None:
    qc = (config or {}).get("quantization_config") or {}
    method = str(qc.get("quant_method") or "").lower()
    if method in ("awq", "gptq", "fp8", "bitsandbytes", "compressed-tensors", "marlin", "exl2"):
        return method.upper()
    lowered = {t.lower() for t in tags}
    for tag in ("awq", "gptq", "fp8"):
        if tag in lowered:
            return tag.upper()
    return None


def group_variants(
    files: Iterable[RemoteFile],
    *,
    config: dict[str, Any] | None = None,
    tags: Iterable[str] = (),
    safetensors_params: dict[str, int] | None = None,
) -> tuple[list[Variant], list[str]]:
    """Group a file list into variants; return (variants, other files)."""
    files = list(files)
    tags = list(tags)
    gguf_groups: dict[str, list[RemoteFile]] = {}
    st_groups: dict[str, list[RemoteFile]] = {}
    others: list[str] = []
    for f in files:
        lower = f.path.lower()
        base = f.path.rsplit("/", 1)[-1]
        if lower.endswith(".gguf"):
            if base.lower().startswith("mmproj"):
                others.append(f.path)
                continue
            m = SHARD_RE.match(f.path)
            key = m["stem"] if m else f.path[: -len(".gguf")]
            gguf_groups.setdefault(key, []).append(f)
        elif lower.endswith(".safetensors"):
            folder = f.path.rpartition("/")[0]
            st_groups.setdefault(folder, []).append(f)
        else:
            others.append(f.path)

    variants: list[Variant] = []
    quant_counts: dict[str, int] = {}
    for key in gguf_groups:
        quant = quant_from_name(key)
        if quant:
            quant_counts[quant] = quant_counts.get(quant, 0) + 1
    for key, group in sorted(gguf_groups.items()):
        group.sort(key=lambda f: f.path)
        quant = quant_from_name(key)
        # Name by quant when unambiguous (pull REPO:Q4_K_M), else by the file stem.
        name = quant if quant and quant_counts.get(quant) == 1 else key.rsplit("/", 1)[-1]
        variants.append(
            Variant(
                name=name,
                format="gguf",
                engine="llama.cpp",
                quantization=quant,
                dtype=None,
                size_bytes=sum(f.size for f in group),
                files=group,
                shards=len(group),
            )
        )
    st_quant = _safetensors_quant(config, tags)
    dtype = None
    if safetensors_params:
        dtype = max(safetensors_params.items(), key=lambda kv: kv[1])[0]
    elif config and config.get("torch_dtype"):
        dtype = str(config["torch_dtype"])
    for folder, group in sorted(st_groups.items()):
        group.sort(key=lambda f: f.path)
        variants.append(
            Variant(
                name=folder or "safetensors",
                format="safetensors",
                engine="vllm",
                quantization=st_quant if not folder else (_folder_quant(folder) or st_quant),
                dtype=dtype,
                size_bytes=sum(f.size for f in group),
                files=group,
                shards=len(group),
            )
        )
    return variants, sorted(others)


def _quality(v: Variant) -> float:
    return float(_BITS.get((v.quantization or "").upper(), 16 if v.format == "safetensors" else 4))


def tag_and_recommend(variants: list[Variant], tagger: FitTagger, config: dict[str, Any] | None) -> None:
    """Fill `fit` for every variant, then mark one recommended.

    The pick: among variants that fit fully, the best quality at or under 8 bits (full precision only when
    nothing quantized fits); if none fits fully, the smallest that fits partially.
    """
    for v in variants:
        try:
            v.fit = tagger(v.engine, v.size_bytes, config)
        except Exception as exc:  # noqa: BLE001 - a failing estimator must not hide the list
            log.warning("fit check failed for %s: %s", v.name, exc)
            v.fit = "unknown"
    full = [v for v in variants if v.fit == "yes"]
    pick: Variant | None
    if full:
        quantized = [v for v in full if _quality(v) <= 8.5] or full
        pick = max(quantized, key=lambda v: (_quality(v), v.format == "gguf", -v.size_bytes))
    else:
        # experts in RAM (every layer's attention on the GPU) before whole layers in RAM
        partial = [v for v in variants if v.fit == "experts-in-ram"] or [v for v in variants if v.fit == "partial"]
        pick = min(partial, key=lambda v: v.size_bytes) if partial else None
    if pick is not None:
        pick.recommended = True


# --------------------------------------------------------------------------- fit verdicts


def default_tagger() -> FitTagger:
    """The fit estimator (desktop.core.planning.fit) against this machine as detected now: the one sizing function."""
    from desktop.core.machine import hardware
    from desktop.core.planning import fit

    snapshot = hardware.detect()

    def project_tagger(engine: str, weights_bytes: int, config: dict[str, Any] | None) -> str:
        return str(fit.quick_verdict(engine, weights_bytes, config, snapshot))

    return project_tagger
