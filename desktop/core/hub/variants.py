"""A repo's downloadable variants: GGUF files grouped by quantization (shards as one set), safetensors sets.

Each variant is tagged with whether it fits this machine for the engine that can run it (GGUF -> llama.cpp,
safetensors -> vLLM), and one is marked recommended, like LM Studio's tags but for both engines.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from desktop.core.models.gguf_file import SHARD_NAME
from desktop.core.models.projector import is_projector, pick_projector
from desktop.core.models.quant_names import bits_per_weight, quant_from_name
from desktop.core.planning.quant_choice import DEFAULT_KLD_BUDGET, MeasuredQuant, choose, quant_key

log = logging.getLogger(__name__)

#: (engine, weights_bytes, config) -> "yes" | "partial" | "no"
FitTagger = Callable[[str, int, "dict[str, Any] | None"], str]

SHARD_RE = SHARD_NAME  # one naming of shards: the one llama-server opens (models.gguf_file)
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
    mean_kld: float | None = None  # measured here against a higher-precision reference (`switchyard quality`)
    basis: str = ""  # the recommended one's: "measured here on DATE" | "by the bits rule, not measured here"
    reason: str = ""  # the recommended one's: why this one, in words
    projector: str | None = None  # a vision GGUF's mmproj file (repo path), fetched with it (models.projector)

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
    projectors: list[str] = []
    for f in files:
        lower = f.path.lower()
        base = f.path.rsplit("/", 1)[-1]
        if lower.endswith(".gguf"):
            if is_projector(base):
                others.append(f.path)
                projectors.append(f.path)
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
                projector=pick_projector(projectors, near=group[0].path),
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
    return bits_per_weight(v.quantization, default=16 if v.format == "safetensors" else 4)


def tag_and_recommend(variants: list[Variant], tagger: FitTagger, config: dict[str, Any] | None,
                      measured: Mapping[str, MeasuredQuant] | None = None, budget: float = DEFAULT_KLD_BUDGET,
                      model: str = "MODEL") -> None:
    """Fill `fit` for every variant, then mark one recommended, with its basis and reason.

    The pick among variants that fit fully: the smallest whose quality was measured here within the budget
    (planning.quant_choice); else the bits rule: the best quality at or under 8.5 bits (full precision only when
    nothing quantized fits). If none fits fully, the smallest that fits partially.
    """
    measured = measured or {}
    for v in variants:
        try:
            v.fit = tagger(v.engine, v.size_bytes, config)
        except Exception as exc:  # noqa: BLE001 - a failing estimator must not hide the list
            log.warning("fit check failed for %s: %s", v.name, exc)
            v.fit = "unknown"
        figure = measured.get(quant_key(v.quantization or v.name)) if v.format == "gguf" else None
        v.mean_kld = figure.mean_kld if figure is not None else None
    full = [v for v in variants if v.fit == "yes"]
    pick: Variant | None
    if full:
        choice = choose(full, lambda v: v.quantization or v.name, lambda v: v.size_bytes, _bits_rule, measured,
                        budget, model)
        pick = choice.pick
        if pick is not None:
            pick.basis, pick.reason = choice.basis, choice.reason
    else:
        # experts in RAM (every layer's attention on the GPU) before whole layers in RAM
        partial = [v for v in variants if v.fit == "experts-in-ram"] or [v for v in variants if v.fit == "partial"]
        pick = min(partial, key=lambda v: v.size_bytes) if partial else None
        if pick is not None:
            pick.reason = f"{pick.name}: the smallest that fits at all (partly in RAM)"
    if pick is not None:
        pick.recommended = True


def _bits_rule(full: Sequence[Variant]) -> Variant | None:
    """The best quality at or under 8.5 bits per weight; full precision only when nothing quantized fits."""
    if not full:
        return None
    quantized = [v for v in full if _quality(v) <= 8.5] or list(full)
    return max(quantized, key=lambda v: (_quality(v), v.format == "gguf", -v.size_bytes))


# --------------------------------------------------------------------------- fit verdicts


def default_tagger() -> FitTagger:
    """The fit estimator (desktop.core.planning.fit) against this machine as detected now: the one sizing function."""
    from desktop.core.machine import hardware
    from desktop.core.planning import fit

    snapshot = hardware.detect()

    def project_tagger(engine: str, weights_bytes: int, config: dict[str, Any] | None) -> str:
        return str(fit.quick_verdict(engine, weights_bytes, config, snapshot))

    return project_tagger


def quality_here(model: str) -> tuple[dict[str, MeasuredQuant], float]:
    """What this machine measured of `model`'s quantizations (the newest `switchyard quality` run of it or of a
    file pulled from its repo) and the user's quality budget (settings `kld_budget`). Nothing measured when the
    history or the settings cannot be read: the bits rule then decides, and says so."""
    from desktop.core.planning.evidence import gather
    from desktop.core.planning.quant_choice import measured_quants
    from desktop.core.storage import settings

    try:
        budget = settings.load().kld_budget
    except Exception as exc:  # noqa: BLE001 - a bad settings file must not hide the list
        log.warning("settings unreadable (%s): the default quality budget", exc)
        budget = DEFAULT_KLD_BUDGET
    try:
        return measured_quants(gather(model).quality), budget
    except Exception as exc:  # noqa: BLE001 - an unreadable history leaves the bits rule
        log.warning("history unreadable (%s): quantizations chosen by the bits rule", exc)
        return {}, budget
