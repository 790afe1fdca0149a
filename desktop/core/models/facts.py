"""Model facts the memory estimator needs, from a GGUF file or split set (read by `gguf_file`'s bounded reader), a
Hugging Face config.json (file, folder or Hub repo id) or the embedded demo model.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gguf.constants import GGMLQuantizationType, LlamaFileType

from desktop.core.common.errors import ModelError, SwitchyardError
from desktop.core.models.gguf_file import GGUF_MAGIC, gguf_in_folder, read_gguf_model, set_stem, tensor_bytes
from desktop.core.models.gguf_file import _BoundedReader as _BoundedReader  # the reader's API, here too
from desktop.core.models.gguf_file import read_gguf_header as read_gguf_header
from desktop.core.models.matmuls import Edges, Weight, edges_of, grouped, weights_of
from desktop.core.models.projector import VisionTower, tower_of
from desktop.core.models.quants import FORMATS, weight_format

# llama.cpp's LLM_FFN_EXPS_REGEX (common.h: `\.ffn_(up|down|gate|gate_up)_(ch|)exps`), the tensors --n-cpu-moe and
# --cpu-moe keep in RAM, with the layer number in front.
EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(?:up|down|gate|gate_up)_(?:ch|)exps")

# Models that are neither causal LMs nor text encoders: nothing here serves them.
UNSUPPORTED_MODEL_TYPES = frozenset({
    "t5", "mt5", "bart", "clip", "siglip", "whisper", "wav2vec2", "vit", "resnet", "detr", "sam",
})
# Bidirectional text encoders (BERT and its kin): served as embedders or, with a sequence-classification head, as
# rerankers (models.yaml `kind`, engines/pooling.py); they hold no KV cache. `new` is Alibaba's GTE.
ENCODER_MODEL_TYPES = frozenset({
    "bert", "roberta", "xlm-roberta", "distilbert", "electra", "deberta", "deberta-v2", "mpnet", "nomic_bert",
    "modernbert", "new", "gte", "neobert", "jina_bert",
})
# llama.cpp's encoder architectures (llama-arch.cpp), which it builds without a KV cache (llama-model.cpp
# create_memory); a GGUF may also say `<arch>.attention.causal = false`.
GGUF_ENCODER_ARCHS = frozenset({
    "bert", "nomic-bert", "nomic-bert-moe", "neo-bert", "jina-bert-v2", "jina-bert-v3", "modern-bert", "t5encoder",
})


@dataclass(frozen=True)
class ModelFacts:
    """Architecture and size facts for one model. Unknown values are None, never guessed silently."""

    name: str
    source: str  # gguf | hf-config | hf-folder | hub | demo
    architecture: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    intermediate_size: int | None = None
    params: int | None = None
    sliding_window: int | None = None
    swa_layers: int = 0  # how many layers use the sliding window (Gemma 2/3, Mistral-style all-SWA)
    n_experts: int | None = None
    n_experts_active: int | None = None
    moe_intermediate_size: int | None = None
    kv_lora_rank: int | None = None  # MLA (DeepSeek V2/V3): compressed KV instead of per-head K/V
    qk_rope_head_dim: int | None = None
    tie_word_embeddings: bool = False
    dtype: str | None = None  # bfloat16 | float16 | float32 (HF); the file type label for GGUF
    quantization: str | None = None  # awq | gptq | fp8 | bitsandbytes | gguf:<file type> | None
    quant_bits: float | None = None  # weight bits of the quantized layers
    quant_kept: tuple[str, ...] = ()  # parts the quantization config keeps at 16 bits (attention, router, ...)
    weights_bytes: int | None = None  # exact (GGUF tensors, safetensors) when known
    nonrepeating_bytes: int | None = None  # token embedding + output head (stay whole on one device)
    embedding_bytes: int | None = None  # GGUF token_embd: llama.cpp keeps it in host memory
    # GGUF: bytes of the MoE expert tensors of each layer (llama.cpp's LLM_FFN_EXPS_REGEX): what --n-cpu-moe K
    # keeps in RAM for the first K layers. Empty for dense models and config-only facts.
    expert_layer_bytes: tuple[int, ...] = ()
    # GGUF: every tensor's (name, bytes) in file order: what llama-server searches -ot patterns in (planning/moe.py)
    tensor_sizes: tuple[tuple[str, int], ...] = ()
    has_output_tensor: bool = True  # False when the head is tied to the embedding (llama.cpp then copies it)
    tensor_types: dict[str, int] = field(default_factory=dict)  # GGUF: type -> tensor count
    tensor_type_bytes: dict[str, int] = field(default_factory=dict)  # GGUF: type -> bytes
    # GGUF: the mat-mul weights, (weight, count) per distinct shape: what llama-server may repack on the CPU
    matmuls: tuple[tuple[Weight, int], ...] = ()
    mapped_edges: tuple[Edges, ...] = ()  # GGUF: per file, the mat-mul weights at its edges (matmuls.Edges)
    path: str | None = None  # GGUF file (a split set's first shard) or HF folder on disk
    shards: int = 1  # files of a split GGUF set
    hf_dir: str | None = None  # a local HF folder vLLM can load, when there is one
    repo_id: str | None = None
    # a bidirectional encoder (BERT-like): it embeds or scores a whole input at once and holds no KV cache
    encoder: bool = False
    scores: bool = False  # a sequence-classification head (*ForSequenceClassification): a reranker's, not an LM's
    vision: VisionTower | None = None  # a Hugging Face checkpoint's image encoder (`vision_config`): vLLM sees images
    notes: list[str] = field(default_factory=list)

    @property
    def is_gguf(self) -> bool:
        return self.source == "gguf" or (self.quantization or "").startswith("gguf:")

    @property
    def gguf_type(self) -> str | None:
        q = self.quantization or ""
        return q.split(":", 1)[1] if q.startswith("gguf:") else None

    @property
    def is_moe(self) -> bool:
        return bool(self.n_experts and self.n_experts > 1)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --- GGUF ---------------------------------------------------------------------------------------------

def _file_type_label(value: Any) -> str | None:
    try:
        name = LlamaFileType(int(value)).name
    except (ValueError, TypeError):
        return None
    return name.replace("MOSTLY_", "").replace("ALL_", "")


def facts_from_gguf(path: str | Path) -> ModelFacts:
    """Facts of a GGUF file, or of the whole split set `path` is a shard of (sized over every shard)."""
    model = read_gguf_model(path)
    meta = model.metadata
    arch = str(meta.get("general.architecture", ""))
    if not arch:
        raise ModelError(f"{Path(path).name}: GGUF has no general.architecture", "re-convert the model")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    def as_int(value: Any) -> int | None:
        if isinstance(value, list):  # per-layer arrays (e.g. head_count_kv on hybrid models): take the largest
            value = max((v for v in value if isinstance(v, (int, float))), default=None)
        return int(value) if isinstance(value, (int, float)) else None

    n_layers = as_int(get("block_count"))
    hidden = as_int(get("embedding_length"))
    if not n_layers or not hidden:
        raise ModelError(f"unsupported architecture '{arch}': its GGUF lacks block_count/embedding_length",
                         "Switchyard estimates decoder-only language models")
    n_heads = as_int(get("attention.head_count")) or 1
    n_kv = as_int(get("attention.head_count_kv")) or n_heads
    head_dim = as_int(get("attention.key_length")) or max(1, hidden // max(n_heads, 1))
    type_counts: dict[str, int] = {}
    type_bytes: dict[str, int] = {}
    total = 0
    nonrepeating = 0
    embedding = 0
    has_output = False
    params = 0
    vocab = as_int(get("vocab_size"))
    experts = [0] * n_layers
    named: list[tuple[str, tuple[int, ...], str]] = []
    sizes: list[tuple[str, int]] = []
    for name, shape, ggml_type in model.tensors:
        nbytes = tensor_bytes(shape, ggml_type)
        sizes.append((name, nbytes))
        if (expert := EXPERT_TENSOR.search(name)) is not None and int(expert.group(1)) < n_layers:
            experts[int(expert.group(1))] += nbytes
        label = GGMLQuantizationType(ggml_type).name
        named.append((name, tuple(int(d) for d in shape), label))
        type_counts[label] = type_counts.get(label, 0) + 1
        type_bytes[label] = type_bytes.get(label, 0) + nbytes
        total += nbytes
        params += math.prod(shape) if shape else 1
        if not name.startswith("blk."):
            nonrepeating += nbytes
        if name == "token_embd.weight":
            embedding = nbytes
        if name == "output.weight":
            has_output = True
        if name == "token_embd.weight" and len(shape) == 2 and not vocab:
            vocab = int(shape[1])
    tokens = meta.get("tokenizer.ggml.tokens")
    if not vocab and isinstance(tokens, int):
        vocab = tokens
    file_type = _file_type_label(meta.get("general.file_type"))
    if file_type is None and type_bytes:
        file_type = max(type_bytes, key=lambda k: type_bytes[k])
    window = as_int(get("attention.sliding_window"))
    pattern = get("attention.sliding_window_pattern")
    swa_layers = 0
    if window:
        if isinstance(pattern, list):
            swa_layers = sum(1 for v in pattern if v)
        elif arch.startswith("gemma3"):
            swa_layers = n_layers - n_layers // 6  # 5 local : 1 global
        elif arch.startswith("gemma2"):
            swa_layers = n_layers // 2
    return ModelFacts(
        name=str(meta.get("general.name") or set_stem(model.path)), source="gguf", architecture=arch,
        n_layers=n_layers, hidden_size=hidden, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        vocab_size=vocab or 32000, context_length=as_int(get("context_length")) or 4096,
        intermediate_size=as_int(get("feed_forward_length")), params=params or None,
        sliding_window=window, swa_layers=swa_layers,
        n_experts=as_int(get("expert_count")), n_experts_active=as_int(get("expert_used_count")),
        moe_intermediate_size=as_int(get("expert_feed_forward_length")),
        kv_lora_rank=as_int(get("attention.kv_lora_rank")), qk_rope_head_dim=as_int(get("rope.dimension_count")),
        dtype=file_type, quantization=f"gguf:{file_type}" if file_type else "gguf",
        weights_bytes=total, nonrepeating_bytes=nonrepeating, embedding_bytes=embedding or None,
        has_output_tensor=has_output or not model.tensors, tie_word_embeddings=not has_output,
        tensor_types=type_counts, tensor_type_bytes=type_bytes, matmuls=grouped(weights_of(named)),
        mapped_edges=tuple(edges_of([(n, tuple(int(d) for d in shape), GGMLQuantizationType(kind).name)
                                     for n, shape, kind in file]) for file in model.files()), path=os.path.abspath(model.path),
        expert_layer_bytes=tuple(experts) if any(experts) else (), tensor_sizes=tuple(sizes),
        shards=len(model.shards), encoder=arch in GGUF_ENCODER_ARCHS or get("attention.causal") is False,
        scores=any(name.startswith("cls.") for name, _ in sizes),
        notes=[f"a split GGUF: {len(model.shards)} shards, sized together; llama-server "
                                         f"is given the first, {model.path.name}"] if len(model.shards) > 1 else [],
    )


# --- Hugging Face config ------------------------------------------------------------------------------

def _first(cfg: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        value = cfg.get(key)
        if value is not None:
            return value
    return None


def _bits_for(quant: dict[str, Any]) -> tuple[str, float | None]:
    method = str(quant.get("quant_method") or quant.get("quantization") or "unknown").lower()
    bits = quant.get("bits") or quant.get("w_bit") or quant.get("weight_bits")
    algo = str(quant.get("quant_algo") or "").lower()
    if method in ("mxfp4", "gpt_oss_mxfp4"):
        return "mxfp4", FORMATS["mxfp4"].bits
    if method == "modelopt_fp4" or (method == "modelopt" and "nvfp4" in algo) or method == "nvfp4":
        return "nvfp4", FORMATS["nvfp4"].bits
    if method in ("fp8", "fbgemm_fp8", "modelopt") or "fp8" in method:
        return "fp8", 8.0
    if method == "bitsandbytes":
        return method, 4.0 if quant.get("load_in_4bit") else 8.0
    if method == "compressed-tensors":
        groups = quant.get("config_groups") or {}
        for group in groups.values() if isinstance(groups, dict) else []:
            weights = (group or {}).get("weights") or {}
            if weights.get("num_bits") == 4 and weights.get("type") == "float":  # nvfp4-pack-quantized
                return "nvfp4", FORMATS["nvfp4"].bits
            if weights.get("num_bits"):
                kind = "fp8" if weights.get("type") == "float" and weights.get("num_bits") == 8 else "int"
                return ("fp8" if kind == "fp8" else f"int{weights['num_bits']}"), float(weights["num_bits"])
    return method, float(bits) if isinstance(bits, (int, float)) else (4.0 if method in ("awq", "gptq") else None)


# The parts of a decoder a quantization config can keep at 16 bits (`modules_to_not_convert`, `ignore`,
# `exclude_modules`), and the module-name fragments that say so.
KEPT_PARTS: dict[str, tuple[str, ...]] = {
    "attention": ("self_attn", "attn", "attention", "q_proj", "k_proj", "v_proj", "o_proj"),
    "router": ("router", "mlp.gate", "block_sparse_moe.gate", "gate.weight"),
    "embedding": ("embed_tokens", "wte", "tok_embeddings", "embedding"),
    "head": ("lm_head", "output"),
}


def param_parts(facts: ModelFacts) -> dict[str, int]:
    """Parameter counts by part (embedding, head, attention, mlp or experts + router, norms), from the
    architecture: what a format that quantizes only some parts (MXFP4: the experts) needs to size a checkpoint."""
    h, layers = facts.hidden_size, facts.n_layers
    q = facts.n_heads * facts.head_dim
    kv = facts.n_kv_heads * facts.head_dim
    attn = h * q + 2 * h * kv + q * h
    if facts.kv_lora_rank:
        attn = h * q + h * (facts.kv_lora_rank + (facts.qk_rope_head_dim or 64)) + facts.kv_lora_rank * 2 * q + q * h
    inter = facts.intermediate_size or 4 * h
    parts = {"embedding": facts.vocab_size * h, "head": 0 if facts.tie_word_embeddings else facts.vocab_size * h,
             "attention": layers * attn, "mlp": 0, "experts": 0, "router": 0, "norms": layers * 2 * h + h}
    if facts.is_moe:
        experts = facts.n_experts or 1
        parts["experts"] = layers * experts * 3 * h * (facts.moe_intermediate_size or inter)
        parts["router"] = layers * h * experts
    else:
        parts["mlp"] = layers * 3 * h * inter
    return parts


def estimate_params(facts: ModelFacts) -> int:
    """Parameter count from the architecture (embeddings, attention, MLP or experts, norms)."""
    return int(sum(param_parts(facts).values()))


def encoder_params(facts: ModelFacts, config: dict[str, Any]) -> int:
    """A BERT-like encoder's parameters, biases included (they are a visible share of a small encoder): token,
    position and token-type embeddings with their LayerNorm; per layer Q, K, V and output projections, the two MLP
    projections and two LayerNorms; the pooler; a classifier of one row per label (*ForSequenceClassification).
    Rotary encoders (NomicBERT, ModernBERT, GTE) have no position table and read `max_position_embeddings` as 0."""
    h, layers = facts.hidden_size, facts.n_layers
    inter = facts.intermediate_size or 4 * h
    positions = config.get("max_position_embeddings") if config.get("position_embedding_type",
                                                                     "absolute") == "absolute" else 0
    positions = positions if isinstance(positions, int) and "rope_theta" not in config \
        and "rotary_emb_base" not in config else 0
    types = config.get("type_vocab_size", 2 if config.get("model_type") == "bert" else 0)
    types = types if isinstance(types, int) else 0
    embedding = (facts.vocab_size + positions + types) * h + 2 * h
    layer = 4 * (h * h + h) + (h * inter + inter) + (inter * h + h) + 2 * 2 * h
    labels = len(config["id2label"]) if isinstance(config.get("id2label"), dict) else 2
    head = (h * h + h) + ((h + 1) * labels if facts.scores else 0)
    return embedding + layers * layer + head


def kept_parts(quant: dict[str, Any]) -> tuple[str, ...]:
    """The parts a quantization config names as not converted (they stay at the checkpoint's 16 bits)."""
    names: list[str] = []
    for key in ("modules_to_not_convert", "ignore", "exclude_modules", "ignored_layers"):
        value = quant.get(key)
        if isinstance(value, list):
            names.extend(str(v) for v in value)
    return tuple(part for part, fragments in KEPT_PARTS.items()
                 if any(fragment in name for name in names for fragment in fragments))


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "fp8": 1}


def facts_from_config(cfg: dict[str, Any], name: str | None = None, source: str = "hf-config") -> ModelFacts:
    """Facts from a Hugging Face config dict (multimodal configs use their text_config)."""
    if not isinstance(cfg, dict):
        raise ModelError("config.json must hold a JSON object", "pass a Hugging Face model config")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else None
    merged = {**cfg, **text} if text else dict(cfg)
    model_type = str(merged.get("model_type") or cfg.get("model_type") or "").lower()
    architectures = cfg.get("architectures") or []
    arch = str(architectures[0]) if architectures else (model_type or "unknown")
    if model_type in UNSUPPORTED_MODEL_TYPES:
        raise ModelError(f"unsupported architecture '{arch}' ({model_type}): neither a language model nor a text "
                         "encoder", "Switchyard serves decoder-only language models, embedders and rerankers")
    encoder = model_type in ENCODER_MODEL_TYPES
    scores = any(str(a).endswith("ForSequenceClassification") for a in architectures)
    n_layers = _first(merged, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    hidden = _first(merged, "hidden_size", "n_embd", "d_model", "dim")
    n_heads = _first(merged, "num_attention_heads", "n_head", "n_heads")
    if not isinstance(n_layers, int) or not isinstance(hidden, int) or not isinstance(n_heads, int) \
            or n_layers <= 0 or hidden <= 0 or n_heads <= 0:
        raise ModelError(f"unsupported architecture '{arch}': config lacks layer/hidden/head counts",
                         "Switchyard estimates decoder-only language models with a standard config.json")
    n_kv = _first(merged, "num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
    if merged.get("multi_query") is True:
        n_kv = 1
    head_dim = _first(merged, "head_dim", "kv_channels")
    if not isinstance(head_dim, int) or head_dim <= 0:
        head_dim = hidden // n_heads
    window = merged.get("sliding_window") if merged.get("use_sliding_window", True) is not False else None
    window = window if isinstance(window, int) and window > 0 else None
    layer_types = merged.get("layer_types")
    swa_layers = 0
    if window:
        if isinstance(layer_types, list):
            swa_layers = sum(1 for t in layer_types if "sliding" in str(t))
        elif "gemma3" in model_type:
            swa_layers = n_layers - n_layers // 6
        elif "gemma2" in model_type:
            swa_layers = n_layers // 2
        elif model_type in ("mistral", "mixtral"):
            swa_layers = n_layers
        max_window_layers = merged.get("max_window_layers")
        if model_type.startswith("qwen") and isinstance(max_window_layers, int):
            swa_layers = max(0, n_layers - max_window_layers)
    quant_cfg = cfg.get("quantization_config") or merged.get("quantization_config")
    quantization, bits = _bits_for(quant_cfg) if isinstance(quant_cfg, dict) else (None, None)
    kept = kept_parts(quant_cfg) if isinstance(quant_cfg, dict) else ()
    dtype = str(_first(merged, "torch_dtype", "dtype") or cfg.get("torch_dtype") or "bfloat16")
    n_experts = _first(merged, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    context = _first(merged, "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length") or 4096
    facts = ModelFacts(
        name=name or str(cfg.get("_name_or_path") or arch), source=source, architecture=arch,
        n_layers=int(n_layers), hidden_size=int(hidden), n_heads=int(n_heads),
        n_kv_heads=int(n_kv) if isinstance(n_kv, int) and n_kv > 0 else int(n_heads), head_dim=int(head_dim),
        vocab_size=int(merged.get("vocab_size") or 32000), context_length=int(context),
        intermediate_size=_first(merged, "intermediate_size", "n_inner", "ffn_hidden_size",
                                 *(("hidden_dim",) if encoder else ())),
        sliding_window=window, swa_layers=swa_layers,
        n_experts=int(n_experts) if isinstance(n_experts, int) else None,
        n_experts_active=_first(merged, "num_experts_per_tok", "moe_topk", "num_experts_per_token", "experts_per_token"),
        moe_intermediate_size=_first(merged, "moe_intermediate_size", "expert_intermediate_size"),
        kv_lora_rank=merged.get("kv_lora_rank") if isinstance(merged.get("kv_lora_rank"), int) else None,
        qk_rope_head_dim=merged.get("qk_rope_head_dim") if isinstance(merged.get("qk_rope_head_dim"), int) else None,
        tie_word_embeddings=bool(merged.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        dtype=dtype, quantization=quantization, quant_bits=bits, quant_kept=kept, encoder=encoder, scores=scores,
        vision=tower_of(cfg),
    )
    params = encoder_params(facts, merged) if encoder else estimate_params(facts)
    return _with(facts, params=params, weights_bytes=hf_weight_bytes(facts, params))


def hf_weight_bytes(facts: ModelFacts, params: int | None = None) -> int:
    """Bytes of the checkpoint as vLLM loads it: quantized layers at their bits, the rest at 16 bits: embeddings
    and head always, the parts the config keeps (`quant_kept`), and all but the experts for an experts-only format
    (MXFP4)."""
    params = params or facts.params or estimate_params(facts)
    if facts.quant_bits:
        parts = param_parts(facts)
        fmt = weight_format(facts.quantization)
        if fmt is not None and fmt.experts_only:
            quantized = parts["experts"]
        else:
            kept = {"embedding", "head", *facts.quant_kept}
            quantized = max(0, params - sum(count for part, count in parts.items() if part in kept))
        overhead = 1.0 if facts.quantization == "fp8" or fmt is not None else 1.03  # AWQ/GPTQ scales and zeros
        return int(quantized * facts.quant_bits / 8 * overhead + (params - quantized) * 2)
    return int(params * _DTYPE_BYTES.get(str(facts.dtype).replace("torch.", ""), 2))


def _with(facts: ModelFacts, **changes: Any) -> ModelFacts:
    from dataclasses import replace

    return replace(facts, **changes)


def _load_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc.strerror}", "check the path and permissions") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path.name} is not valid JSON ({exc})", "pass a Hugging Face config.json") from exc
    if not isinstance(data, dict):
        raise ModelError(f"{path.name} does not hold a JSON object", "pass a Hugging Face config.json")
    return data


def _safetensors_bytes(folder: Path) -> int | None:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            total = json.loads(index.read_text(encoding="utf-8")).get("metadata", {}).get("total_size")
            if isinstance(total, int) and total > 0:
                return total
        except (OSError, json.JSONDecodeError):
            pass
    files = list(folder.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) or None if files else None


def facts_from_hf_folder(folder: Path) -> ModelFacts:
    config = folder / "config.json"
    if not config.is_file():
        gguf = gguf_in_folder(folder)
        if gguf is not None:
            return facts_from_gguf(gguf)
        raise ModelError(f"{folder} has no config.json or .gguf file",
                         "pass a Hugging Face model folder, a config.json or a .gguf file")
    facts = facts_from_config(_load_json(config), name=folder.name, source="hf-folder")
    measured = _safetensors_bytes(folder)
    changes: dict[str, Any] = {"path": os.path.abspath(folder), "hf_dir": os.path.abspath(folder)}
    if measured:
        changes["weights_bytes"] = measured
    return _with(facts, **changes)


def facts_from_path(path: str | Path) -> ModelFacts:
    """Facts from a .gguf file, a config.json file or a local Hugging Face folder."""
    target = Path(path).expanduser()
    if not target.exists():
        raise ModelError(f"no such file or folder: {target}", "check the path, or pass a Hub repo id like org/name")
    if target.is_dir():
        return facts_from_hf_folder(target)
    with target.open("rb") as handle:
        magic = handle.read(4)
    if magic == GGUF_MAGIC or target.suffix.lower() == ".gguf":
        return facts_from_gguf(target)
    if target.suffix == ".json":
        facts = facts_from_config(_load_json(target), name=target.parent.name or target.stem)
        return _with(facts, path=os.path.abspath(target))
    raise ModelError(f"{target.name} is neither a GGUF file nor a config.json",
                     "pass a .gguf file, a config.json, a Hugging Face folder or a Hub repo id")


REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")


def facts_from_hub(repo_id: str, revision: str | None = None) -> ModelFacts:
    """Download only config.json (and the safetensors index for exact sizes) from the Hub; never weights."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
    )

    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now, not at huggingface_hub import time
    try:
        config_path = hf_hub_download(repo_id, "config.json", revision=revision, endpoint=endpoint)
    except GatedRepoError as exc:
        raise ModelError(f"{repo_id} is gated", "accept its license on the Hub and log in (HF_TOKEN)") from exc
    except RepositoryNotFoundError as exc:
        raise ModelError(f"no such Hub repo: {repo_id}", "check the spelling, or log in for private repos") from exc
    except EntryNotFoundError as exc:
        raise ModelError(f"{repo_id} has no config.json (a GGUF-only repo?)",
                         "download the .gguf file and pass its path") from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelError(f"cannot fetch {repo_id}'s config from the Hub: {exc}",
                         "check the network or HF_ENDPOINT, or pass a local path") from exc
    facts = facts_from_config(_load_json(Path(config_path)), name=repo_id, source="hub")
    changes: dict[str, Any] = {"repo_id": repo_id}
    try:
        index_path = hf_hub_download(repo_id, "model.safetensors.index.json", revision=revision, endpoint=endpoint)
        total = json.loads(Path(index_path).read_text(encoding="utf-8")).get("metadata", {}).get("total_size")
        if isinstance(total, int) and total > 0:
            changes["weights_bytes"] = total
    except Exception:  # a single-file checkpoint has no index; the estimate from the config stands
        pass
    return _with(facts, **changes)


def demo_facts() -> ModelFacts:
    """Facts of the embedded demo model (generated on first use by desktop.core.models.demo)."""
    try:
        from desktop.core.models import demo
    except ImportError as exc:
        raise SwitchyardError("the demo model is not available in this build", "pass a model path instead") from exc
    ensure = getattr(demo, "ensure_demo_model", None)
    if ensure is None:
        raise SwitchyardError("the demo model is not available in this build", "pass a model path instead")
    model = ensure()
    gguf_path = getattr(model, "gguf_path", None)
    hf_dir = getattr(model, "hf_dir", None)
    if gguf_path is None and hf_dir is None:
        raise SwitchyardError("the demo model has no files", "run `switchyard engines doctor`")
    facts = facts_from_gguf(gguf_path) if gguf_path else facts_from_hf_folder(Path(str(hf_dir)))
    return _with(facts, source="demo", name="demo", hf_dir=str(hf_dir) if hf_dir else None)


def facts_for(model: str) -> ModelFacts:
    """Facts for anything a user may type: a path (GGUF, config.json, HF folder), a Hub repo id, or "demo"."""
    spec = model.strip()
    if not spec:
        raise ModelError("no model given", "pass a .gguf path, a config.json, a folder, a repo id or 'demo'")
    if spec == "demo":
        return demo_facts()
    candidate = Path(spec).expanduser()
    if candidate.exists():
        return facts_from_path(candidate)
    looks_like_path = spec.startswith((".", "/", "~")) or spec.endswith((".gguf", ".json")) or os.sep + os.sep in spec
    if not looks_like_path and REPO_ID.match(spec):
        return facts_from_hub(spec)
    raise ModelError(f"no such file or folder: {spec}", "check the path, or pass a Hub repo id like org/name")
