"""Tiny random-weight checkpoints of real architectures, for measuring the fit against the real engines.

The demo model (desktop.core.models.demo) is one Llama. Memory accounting differs per architecture feature
(grouped-query attention, q/k norms, sliding-window layers, a 262k vocabulary, fused QKV, experts, tied
embeddings), so `benchmarks/fit_vs_engine.py` and the real-engine fit tests need one small checkpoint of each,
with the real model's *shape ratios and features* but a few layers and a small hidden size. Each is written as
a Hugging Face folder (config.json + float16 safetensors, for vLLM) and as GGUF files at F16, Q8_0, a Q4_K_M
mix and, on request, MXFP4, Q4_0 or Q4_1 (for llama-server), with the tensor names and metadata keys llama.cpp's converter writes for that
architecture (gguf's TensorNameMap does the naming).

The weights are random and meaningless: only shapes and types matter here. Q8_0 is quantized by the gguf
package; Q4_K/Q5_K/Q6_K (which gguf cannot quantize) are written as valid blocks of random quants with small
finite scales, in llama-quantize's Q4_K_M mix (Q6_K output and every third attn_v/ffn_down, Q5_K fused QKV).
MXFP4 is llama-quantize's MXFP4_MOE: expert tensors in MXFP4 (quantized by the gguf package), the rest at Q8_0.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import filelock
import gguf
import numpy as np
import numpy.typing as npt
from safetensors.numpy import save_file

from desktop.core.common import paths
from desktop.core.models import demo
from desktop.core.models.matmuls import use_more_bits

ARCHS_VERSION = "2"
GGUF_TYPES = ("F16", "Q8_0", "Q4_K_M")
SEED = 20261201
Array = npt.NDArray[Any]


@dataclass(frozen=True)
class ArchSpec:
    """One architecture at small scale: the HF config fields that matter, and its llama.cpp arch name."""

    key: str  # short name used in file names and results
    label: str  # what real model it stands for
    hf_arch: str  # config "architectures"[0]
    model_type: str
    gguf_arch: gguf.MODEL_ARCH
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    context: int = 8192
    tied: bool = False
    sliding_window: int | None = None
    qk_norm: bool = False
    fused: bool = False  # Phi-3: qkv_proj and gate_up_proj
    experts: int = 0
    experts_used: int = 0
    moe_intermediate: int = 0
    rope_theta: float = 10000.0
    features: tuple[str, ...] = ()
    extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def gguf_arch_name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.gguf_arch]


ARCHS: dict[str, ArchSpec] = {spec.key: spec for spec in (
    ArchSpec("llama3", "Llama 3 8B shape (GQA 4:1, 128k vocab)", "LlamaForCausalLM", "llama", gguf.MODEL_ARCH.LLAMA,
             hidden=512, layers=4, heads=8, kv_heads=2, head_dim=64, intermediate=1792, vocab=128256,
             rope_theta=500000.0, features=("gqa", "large-vocab")),
    ArchSpec("llama32-tied", "Llama 3.2 1B shape (tied embeddings)", "LlamaForCausalLM", "llama",
             gguf.MODEL_ARCH.LLAMA, hidden=512, layers=4, heads=8, kv_heads=2, head_dim=64, intermediate=2048,
             vocab=128256, tied=True, rope_theta=500000.0, features=("gqa", "tied-embeddings", "large-vocab")),
    ArchSpec("qwen3", "Qwen3 0.6B shape (q/k norm, head_dim 128 > hidden/heads, tied)", "Qwen3ForCausalLM",
             "qwen3", gguf.MODEL_ARCH.QWEN3, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=128,
             intermediate=768, vocab=151936, tied=True, qk_norm=True, rope_theta=1000000.0,
             features=("gqa", "qk-norm", "tied-embeddings", "large-vocab")),
    ArchSpec("gemma3", "Gemma 3 1B shape (5 sliding : 1 global, window 512, 262k vocab)", "Gemma3ForCausalLM",
             "gemma3_text", gguf.MODEL_ARCH.GEMMA3, hidden=256, layers=12, heads=4, kv_heads=1, head_dim=256,
             intermediate=1024, vocab=262144, tied=True, sliding_window=512, qk_norm=True, rope_theta=1000000.0,
             features=("swa-interleaved", "mqa", "qk-norm", "tied-embeddings", "vocab-262k")),
    ArchSpec("mistral", "Mistral 7B v0.1 shape (sliding window on every layer)", "MistralForCausalLM", "mistral",
             gguf.MODEL_ARCH.LLAMA, hidden=512, layers=4, heads=8, kv_heads=2, head_dim=64, intermediate=1792,
             vocab=32000, sliding_window=1024, features=("gqa", "swa-all-layers")),
    ArchSpec("phi3", "Phi-3 mini shape (MHA, fused QKV and gate/up)", "Phi3ForCausalLM", "phi3",
             gguf.MODEL_ARCH.PHI3, hidden=512, layers=4, heads=8, kv_heads=8, head_dim=64, intermediate=1536,
             vocab=32064, context=4096, fused=True, features=("mha", "fused-qkv")),
    ArchSpec("qwen3moe", "Qwen3-30B-A3B shape (16 experts, 4 active, q/k norm)", "Qwen3MoeForCausalLM",
             "qwen3_moe", gguf.MODEL_ARCH.QWEN3MOE, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64,
             intermediate=768, vocab=151936, qk_norm=True, experts=16, experts_used=4, moe_intermediate=256,
             rope_theta=1000000.0, features=("moe", "qk-norm", "large-vocab")),
    ArchSpec("mixtral", "Mixtral 8x7B shape (8 experts, 2 active)", "MixtralForCausalLM", "mixtral",
             gguf.MODEL_ARCH.LLAMA, hidden=512, layers=4, heads=8, kv_heads=2, head_dim=64, intermediate=768,
             vocab=32000, experts=8, experts_used=2, moe_intermediate=768, rope_theta=1000000.0,
             features=("moe", "gqa")),
)}


@dataclass(frozen=True)
class ArchModel:
    """The files of one generated architecture."""

    spec: ArchSpec
    root: Path
    hf_dir: Path
    gguf_paths: dict[str, Path]
    parameters: int


def default_root() -> Path:
    return paths.cache_dir() / "archs" / ARCHS_VERSION


def ensure_arch(key: str, root: Path | None = None, gguf_types: tuple[str, ...] = GGUF_TYPES) -> ArchModel:
    """The cached checkpoint of architecture `key`, generated first when missing (a few seconds each)."""
    spec = ARCHS[key]
    base = (root or default_root()).expanduser().absolute()
    target = base / key
    base.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(base / f".{key}.lock"), timeout=600):
        manifest = _manifest(target)
        if manifest is None or not set(gguf_types) <= set(manifest["gguf"]):
            wanted = tuple(sorted(set(gguf_types) | set((manifest or {}).get("gguf", {}))))
            staging = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=base))
            try:
                write_arch(spec, staging, wanted)
                if target.exists():
                    shutil.rmtree(target)
                os.replace(staging, target)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            manifest = _manifest(target)
            assert manifest is not None
    return ArchModel(spec, target, target / "hf", {t: target / f"{key}-{t}.gguf" for t in manifest["gguf"]},
                     int(manifest["parameters"]))


def _manifest(target: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads((target / "arch.json").read_text(encoding="utf-8"))
        if data.get("version") != ARCHS_VERSION:
            return None
        for relative, size in data["files"].items():
            if (target / relative).stat().st_size != size:
                return None
        return data
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- weights (HF names, HF layout [out, in]) -----------------------------------------------------------------

def hf_tensors(spec: ArchSpec) -> Iterator[tuple[str, Array]]:
    rng = np.random.default_rng(SEED + sum(map(ord, spec.key)))

    def w(*shape: int) -> Array:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)).astype(np.float16)

    def norm(n: int) -> Array:
        return np.ones(n, dtype=np.float16)

    h, q, kv = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    yield "model.embed_tokens.weight", w(spec.vocab, h)
    for i in range(spec.layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", norm(h)
        if spec.fused:
            yield f"{p}.self_attn.qkv_proj.weight", w(q + 2 * kv, h)
        else:
            yield f"{p}.self_attn.q_proj.weight", w(q, h)
            yield f"{p}.self_attn.k_proj.weight", w(kv, h)
            yield f"{p}.self_attn.v_proj.weight", w(kv, h)
        yield f"{p}.self_attn.o_proj.weight", w(h, q)
        if spec.qk_norm:
            yield f"{p}.self_attn.q_norm.weight", norm(spec.head_dim)
            yield f"{p}.self_attn.k_norm.weight", norm(spec.head_dim)
        yield f"{p}.post_attention_layernorm.weight", norm(h)
        if spec.model_type == "gemma3_text":
            yield f"{p}.pre_feedforward_layernorm.weight", norm(h)
            yield f"{p}.post_feedforward_layernorm.weight", norm(h)
        if spec.experts and spec.model_type == "mixtral":
            yield f"{p}.block_sparse_moe.gate.weight", w(spec.experts, h)
            for e in range(spec.experts):
                yield f"{p}.block_sparse_moe.experts.{e}.w1.weight", w(spec.moe_intermediate, h)
                yield f"{p}.block_sparse_moe.experts.{e}.w2.weight", w(h, spec.moe_intermediate)
                yield f"{p}.block_sparse_moe.experts.{e}.w3.weight", w(spec.moe_intermediate, h)
        elif spec.experts:
            yield f"{p}.mlp.gate.weight", w(spec.experts, h)
            for e in range(spec.experts):
                yield f"{p}.mlp.experts.{e}.gate_proj.weight", w(spec.moe_intermediate, h)
                yield f"{p}.mlp.experts.{e}.up_proj.weight", w(spec.moe_intermediate, h)
                yield f"{p}.mlp.experts.{e}.down_proj.weight", w(h, spec.moe_intermediate)
        elif spec.fused:
            yield f"{p}.mlp.gate_up_proj.weight", w(2 * spec.intermediate, h)
            yield f"{p}.mlp.down_proj.weight", w(h, spec.intermediate)
        else:
            yield f"{p}.mlp.gate_proj.weight", w(spec.intermediate, h)
            yield f"{p}.mlp.up_proj.weight", w(spec.intermediate, h)
            yield f"{p}.mlp.down_proj.weight", w(h, spec.intermediate)
    yield "model.norm.weight", norm(h)
    if not spec.tied:
        yield "lm_head.weight", w(spec.vocab, h)


def hf_config(spec: ArchSpec, vocab_tokens: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [spec.hf_arch], "model_type": spec.model_type, "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate, "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim,
        "hidden_act": "gelu_pytorch_tanh" if spec.model_type == "gemma3_text" else "silu",
        "max_position_embeddings": spec.context, "rms_norm_eps": 1e-6, "rope_theta": spec.rope_theta,
        "vocab_size": spec.vocab, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": spec.tied,
        "torch_dtype": "float16", "use_cache": True, "attention_bias": False,
    }
    if spec.sliding_window:
        config["sliding_window"] = spec.sliding_window
    if spec.model_type == "gemma3_text":
        config.update({"sliding_window_pattern": 6, "query_pre_attn_scalar": spec.head_dim,
                       "rope_local_base_freq": 10000.0, "final_logit_softcapping": None,
                       "attn_logit_softcapping": None, "pad_token_id": 0,
                       "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                       for i in range(spec.layers)]})
    if spec.model_type == "mistral":
        config["sliding_window"] = spec.sliding_window
    if spec.experts:
        if spec.model_type == "mixtral":
            config.update({"num_local_experts": spec.experts, "num_experts_per_tok": spec.experts_used})
        else:
            config.update({"num_experts": spec.experts, "num_experts_per_tok": spec.experts_used,
                           "moe_intermediate_size": spec.moe_intermediate, "decoder_sparse_step": 1,
                           "mlp_only_layers": [], "norm_topk_prob": True})
    if spec.model_type == "phi3":
        config.update({"sliding_window": None, "original_max_position_embeddings": spec.context,
                       "rope_scaling": None, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0,
                       "pad_token_id": 0})
    config.update(spec.extra_config)
    return config


# --- GGUF ------------------------------------------------------------------------------------------------

_K_BLOCKS = {  # type -> (bytes per 256-element block, byte offsets of f16 scale fields)
    gguf.GGMLQuantizationType.Q4_K: (144, (0, 2)),
    gguf.GGMLQuantizationType.Q5_K: (176, (0, 2)),
    gguf.GGMLQuantizationType.Q6_K: (210, (208,)),
}


def _random_k_quant(rng: np.random.Generator, shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> Array:
    """Valid K-quant blocks holding random quants and a small finite scale (gguf cannot quantize K types)."""
    size, scale_offsets = _K_BLOCKS[qtype]
    rows = int(np.prod(shape[:-1]))
    blocks = shape[-1] // 256
    data = rng.integers(0, 256, size=(rows * blocks, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)
    for offset in scale_offsets:
        data[:, offset:offset + 2] = scale
    return data.reshape(*shape[:-1], blocks * size)


def q4_k_m_type(name: str, layers: int) -> gguf.GGMLQuantizationType:
    """The tensor type llama-quantize's Q4_K_M picks (non-8-expert models; src/llama-quant.cpp)."""
    q = gguf.GGMLQuantizationType
    if name == "output.weight":
        return q.Q6_K
    layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
    if ".attn_v." in name or ".ffn_down" in name:
        return q.Q6_K if use_more_bits(layer, layers) else q.Q4_K
    if ".attn_qkv." in name:
        return q.Q5_K
    return q.Q4_K


def _gguf_tensors(spec: ArchSpec, tensors: dict[str, Array]) -> Iterator[tuple[str, Array]]:
    """HF tensors under llama.cpp's names; experts stacked into one [n_expert, out, in] tensor per kind."""
    names = gguf.get_tensor_name_map(spec.gguf_arch, spec.layers)
    expert_kinds = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                    "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
    for i in range(spec.layers) if spec.experts else ():
        for kind, target in expert_kinds.items():
            group = "block_sparse_moe" if spec.model_type == "mixtral" else "mlp"
            parts = [tensors.pop(f"model.layers.{i}.{group}.experts.{e}.{kind}.weight", None)
                     for e in range(spec.experts)]
            if parts[0] is not None:
                yield f"blk.{i}.{target}.weight", np.stack([p for p in parts if p is not None])
        router = tensors.pop(f"model.layers.{i}.block_sparse_moe.gate.weight", None)
        if router is not None:
            yield f"blk.{i}.ffn_gate_inp.weight", router
    for hf_name, array in tensors.items():
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name} in {spec.gguf_arch_name}")
        yield name, array


def write_gguf(spec: ArchSpec, path: Path, tensors: dict[str, Array], vocab: list[str], file_type: str) -> None:
    writer = gguf.GGUFWriter(str(path), arch=spec.gguf_arch_name)
    a = spec.gguf_arch_name
    ftypes = {"F16": gguf.LlamaFileType.MOSTLY_F16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
              "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
              "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M, "MXFP4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE}
    simple = {"Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q4_0": gguf.GGMLQuantizationType.Q4_0,
              "Q4_1": gguf.GGMLQuantizationType.Q4_1, "MXFP4": gguf.GGMLQuantizationType.Q8_0}
    writer.add_name(f"switchyard-{spec.key}")
    writer.add_file_type(ftypes[file_type])
    writer.add_context_length(spec.context)
    writer.add_embedding_length(spec.hidden)
    writer.add_block_count(spec.layers)
    writer.add_feed_forward_length(spec.intermediate)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_vocab_size(spec.vocab)
    if spec.sliding_window and spec.gguf_arch == gguf.MODEL_ARCH.GEMMA3:
        writer.add_sliding_window(spec.sliding_window)
        writer.add_float32(f"{a}.rope.freq_base_swa", 10000.0)
    if spec.experts:
        writer.add_expert_count(spec.experts)
        writer.add_expert_used_count(spec.experts_used)
        if spec.gguf_arch != gguf.MODEL_ARCH.LLAMA:
            writer.add_expert_feed_forward_length(spec.moe_intermediate)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab)
    writer.add_token_types([gguf.TokenType.CONTROL if i < 2 else gguf.TokenType.NORMAL if i < demo_vocab_size()
                            else gguf.TokenType.UNUSED for i in range(len(vocab))])
    writer.add_token_merges(_merges())
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.add_chat_template(demo.CHAT_TEMPLATE)
    rng = np.random.default_rng(SEED)
    for name, array in _gguf_tensors(spec, dict(tensors)):
        if array.ndim == 1 or file_type == "F16" or name == "blk.0.ffn_gate_inp.weight" \
                or name.endswith("ffn_gate_inp.weight"):
            writer.add_tensor(name, array.astype(np.float32) if array.ndim == 1 else array)
        elif file_type == "MXFP4" and "_exps." in name:  # llama-quantize's MXFP4_MOE: experts in MXFP4 ...
            mx = gguf.quants.quantize(array.astype(np.float32), gguf.GGMLQuantizationType.MXFP4)
            writer.add_tensor(name, mx, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        elif file_type in simple:  # ... and everything else at Q8_0 (Q4_0/Q4_1: every matrix at that type)
            qtype = simple[file_type]
            writer.add_tensor(name, gguf.quants.quantize(array.astype(np.float32), qtype), raw_dtype=qtype)
        else:
            qtype = q4_k_m_type(name, spec.layers)
            writer.add_tensor(name, _random_k_quant(rng, array.shape, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_TOKENIZER: Any = None


def _tokenizer() -> Any:
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = demo.build_tokenizer()
    return _TOKENIZER


def demo_vocab_size() -> int:
    return int(_tokenizer().get_vocab_size())


def _merges() -> list[str]:
    return demo.tokenizer_merges(_tokenizer())


def padded_vocab(size: int) -> list[str]:
    """The demo's byte-level BPE tokens, padded with unused placeholders to the architecture's vocab size."""
    base = demo.tokenizer_vocab(_tokenizer())
    named = [t for t in ("<unk>", "<|endoftext|>", "<|end|>") if t not in base]  # llama.cpp looks some up (phi3)
    return base + named + [f"<unused{i}>" for i in range(size - len(base) - len(named))]


def write_arch(spec: ArchSpec, directory: Path, gguf_types: tuple[str, ...] = GGUF_TYPES) -> int:
    """Write the HF folder and the GGUF files of `spec` into directory; returns the parameter count."""
    tensors = dict(hf_tensors(spec))
    parameters = sum(int(t.size) for t in tensors.values())
    hf = directory / "hf"
    hf.mkdir(parents=True)
    tokenizer = _tokenizer()
    (hf / "config.json").write_text(json.dumps(hf_config(spec, demo_vocab_size()), indent=2), encoding="utf-8")
    tokenizer.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": demo.BOS_TOKEN, "eos_token": demo.EOS_TOKEN,
        "model_max_length": spec.context, "chat_template": demo.CHAT_TEMPLATE}), encoding="utf-8")
    (hf / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}), encoding="utf-8")
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(hf / "model.safetensors"),
              metadata={"format": "pt"})
    vocab = padded_vocab(spec.vocab)
    for file_type in gguf_types:
        write_gguf(spec, directory / f"{spec.key}-{file_type}.gguf", tensors, vocab, file_type)
    files = {p.relative_to(directory).as_posix(): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()}
    (directory / "arch.json").write_text(json.dumps({"version": ARCHS_VERSION, "key": spec.key,
                                                     "parameters": parameters, "gguf": list(gguf_types),
                                                     "files": files}, indent=2), encoding="utf-8")
    return parameters
