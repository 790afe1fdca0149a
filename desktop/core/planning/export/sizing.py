"""How many GPUs a model needs on bigger hardware: the smallest tensor-parallel size (and, across nodes, the
pipeline-parallel size) whose memory holds the weights with headroom plus the KV cache of one full request.

The rule is the one GPUStack and Jan use for non-GGUF weights (weights x 1.2 for activations and runtime
overhead) plus vLLM's own start-up condition: the KV cache must hold at least one `max_model_len` request.
It is a planning estimate, stated with its arithmetic so a person can check it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from desktop.core.common.errors import SwitchyardError
from desktop.core.models.quants import FORMATS

GIB = 1024**3
WEIGHT_OVERHEAD = 1.2
DEFAULT_UTILIZATION = 0.9

DTYPE_BYTES = {
    "float32": 4.0, "fp32": 4.0, "float": 4.0,
    "bfloat16": 2.0, "bf16": 2.0, "float16": 2.0, "fp16": 2.0, "half": 2.0, "auto": 2.0,
    "fp8": 1.0, "float8": 1.0, "int8": 1.0,
}
# Bytes per weight for vLLM quantization methods (packed 4-bit formats carry scales: a little over 0.5).
QUANT_BYTES = {"awq": 0.56, "gptq": 0.56, "awq_marlin": 0.56, "gptq_marlin": 0.56, "bitsandbytes": 0.56,
               "fp8": 1.0, "compressed-tensors": 1.0,
               **{name: fmt.bits / 8 for name, fmt in FORMATS.items()}}  # mxfp4, nvfp4: the fit's table


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a transformer config the estimate needs."""

    parameters: float
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    max_position_embeddings: int | None = None
    torch_dtype: str | None = None

    @property
    def kv_bytes_per_token_per_byte(self) -> int:
        """K and V for every layer, per token, per byte of KV dtype."""
        return 2 * self.layers * self.kv_heads * self.head_dim

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """Read a Hugging Face config.json (text configs nested under `text_config` are followed)."""
        if "text_config" in config and "num_hidden_layers" not in config:
            config = {**config["text_config"], "torch_dtype": config.get("torch_dtype")}
        try:
            hidden = int(config["hidden_size"])
            layers = int(config["num_hidden_layers"])
            heads = int(config["num_attention_heads"])
            vocab = int(config["vocab_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SwitchyardError(f"the model config lacks {exc} needed to size the model",
                                  "pass --tp N, or --params-b with the model's size in billions") from None
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        intermediate = int(config.get("intermediate_size") or 4 * hidden)
        experts = int(config.get("num_local_experts") or config.get("num_experts") or 1)
        moe_intermediate = int(config.get("moe_intermediate_size") or intermediate)
        attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o, k, v
        mlp = 3 * hidden * (moe_intermediate * experts if experts > 1 else intermediate)  # gate, up, down
        embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
        parameters = layers * (attention + mlp + 2 * hidden) + embeddings + hidden
        return cls(float(parameters), layers, heads, kv_heads, head_dim,
                   int(config["max_position_embeddings"]) if config.get("max_position_embeddings") else None,
                   str(config["torch_dtype"]) if config.get("torch_dtype") else None)


@dataclass(frozen=True)
class ParallelChoice:
    """The chosen split and the arithmetic behind it."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    weights_gib: float
    needed_gib: float
    available_gib: float
    reason: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load_model_config(spec: str | Path) -> dict[str, Any] | None:
    """config.json from a file, a model folder, or the local Hugging Face cache (never the network)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise SwitchyardError(f"cannot read model config {path}: {exc}", "give a valid config.json") from None
        return data if isinstance(data, dict) else None
    if "/" in str(spec) and not str(spec).startswith(("/", ".", "~")):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(spec).split(":")[0], "config.json")
        if isinstance(cached, str):
            return load_model_config(cached)
    return None


def _bytes_per_weight(dtype: str | None, quantization: str | None, shape: ModelShape | None) -> float:
    if quantization:
        return QUANT_BYTES.get(quantization.lower(), 1.0)
    name = (dtype or "auto").lower()
    if name == "auto" and shape and shape.torch_dtype:
        name = shape.torch_dtype.lower()
    return DTYPE_BYTES.get(name, 2.0)


def choose_parallelism(
    *,
    gpu_name: str,
    gpu_memory_gib: float,
    gpus_per_node: int,
    shape: ModelShape | None = None,
    parameters: float | None = None,
    dtype: str | None = None,
    quantization: str | None = None,
    max_model_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    nodes: int = 1,
) -> ParallelChoice:
    """The smallest power-of-two TP (dividing the attention heads) whose GPUs hold weights x 1.2 plus the KV cache
    of one max_model_len request within utilization x memory; across nodes, TP = GPUs per node and the fewest
    pipeline stages that fit."""
    if shape is None and parameters is None:
        raise SwitchyardError("cannot size the model: no config.json and no parameter count",
                              "pass --tp N, --model-config config.json, or --params-b 70")
    if gpus_per_node < 1 or nodes < 1:
        raise SwitchyardError("the target needs at least one GPU on at least one node", "use --gpus N with N >= 1")
    params = shape.parameters if shape else float(parameters or 0)
    weights = params * _bytes_per_weight(dtype, quantization, shape)
    context = max_model_len or (shape.max_position_embeddings if shape else None) or 4096
    kv_dtype_bytes = 2.0 if _bytes_per_weight(dtype, None, shape) < 4 else 4.0
    kv = (shape.kv_bytes_per_token_per_byte * kv_dtype_bytes * context) if shape else 0.0
    needed = weights * WEIGHT_OVERHEAD + kv
    utilization = gpu_memory_utilization or DEFAULT_UTILIZATION
    per_gpu = gpu_memory_gib * GIB * utilization

    def fits(count: int) -> bool:
        return count * per_gpu >= needed

    candidates = [2**i for i in range(0, 11) if 2**i <= gpus_per_node]
    if shape:
        candidates = [tp for tp in candidates if shape.attention_heads % tp == 0]
    arithmetic = (f"weights {weights / GIB:.1f} GiB x {WEIGHT_OVERHEAD} + KV for one {context}-token request "
                  f"{kv / GIB:.1f} GiB = {needed / GIB:.1f} GiB; each {gpu_name} gives "
                  f"{gpu_memory_gib:.1f} x {utilization:g} = {per_gpu / GIB:.1f} GiB")
    too_small = [tp for tp in candidates if not fits(tp)]
    for tp in candidates:
        if fits(tp):
            skipped = (f"; {max(too_small)} GPU(s) would give only {max(too_small) * per_gpu / GIB:.1f} GiB"
                       if too_small else "")
            return ParallelChoice(tp, 1, round(weights / GIB, 2), round(needed / GIB, 2),
                                  round(tp * per_gpu / GIB, 2),
                                  f"tensor parallel {tp}: {arithmetic}; {tp} GPU(s) give {tp * per_gpu / GIB:.1f} GiB{skipped}")
    if not candidates:
        raise SwitchyardError(f"no tensor-parallel size up to {gpus_per_node} divides the model's "
                              f"{shape.attention_heads if shape else '?'} attention heads", "use more GPUs per node")
    tp = candidates[-1]
    for pp in range(2, nodes + 1):
        if fits(tp * pp):
            return ParallelChoice(tp, pp, round(weights / GIB, 2), round(needed / GIB, 2),
                                  round(tp * pp * per_gpu / GIB, 2),
                                  f"tensor parallel {tp} x pipeline parallel {pp} nodes: {arithmetic}; "
                                  f"{tp * pp} GPUs give {tp * pp * per_gpu / GIB:.1f} GiB")
    total = tp * nodes
    raise SwitchyardError(
        f"the model does not fit on {total} x {gpu_name}: it needs about {needed / GIB:.0f} GiB, "
        f"{total} GPU(s) give {total * per_gpu / GIB:.0f} GiB ({arithmetic})",
        "use more GPUs or nodes (--gpus, --nodes), a bigger GPU, a quantized model, or a shorter --max-model-len")


def choose_for_target(
    *,
    gpu: str,
    gpus: int,
    model_config: Mapping[str, Any] | None = None,
    parameters: float | None = None,
    dtype: str | None = None,
    quantization: str | None = None,
    max_model_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    nodes: int = 1,
    concurrency: float = 8.0,
) -> ParallelChoice:
    """Look the GPU up in the shared table and choose: the fit estimator's vLLM accounting when the model's config
    is known at its native precision, else the documented weights x 1.2 + KV arithmetic."""
    from desktop.core.machine.gpu_catalog import require_gpu

    spec = require_gpu(gpu)
    plain_precision = quantization is None and (dtype or "auto") in ("auto", "bfloat16", "bf16", "float16", "fp16")
    if model_config is not None and nodes == 1 and plain_precision:
        fitted = _from_fit_module(model_config, spec, gpus, max_model_len, concurrency)
        if fitted is not None:
            return fitted
    shape = ModelShape.from_config(model_config) if model_config is not None else None
    return choose_parallelism(gpu_name=spec.name, gpu_memory_gib=spec.memory_mib / 1024, gpus_per_node=gpus,
                              shape=shape, parameters=parameters, dtype=dtype, quantization=quantization,
                              max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                              nodes=nodes)


def _from_fit_module(model_config: Mapping[str, Any], spec: Any, gpus: int,
                     max_model_len: int | None, concurrency: float) -> ParallelChoice | None:
    """vLLM's own accounting from `desktop.core.planning.fit` (weights, activation peak, KV for a concurrency
    floor): `fit.size_vllm`, the same rule `recommend` sizes with."""
    try:
        choice = choose_tensor_parallel(dict(model_config), spec, gpus, max_model_len=max_model_len or 8192,
                                            min_concurrency=concurrency)
    except SwitchyardError:
        return None  # the arithmetic below explains what does not fit
    tp, result = choice.tensor_parallel_size, choice.fit
    if result is None:
        return None
    return ParallelChoice(tp, 1, round(result.weights_gib * tp, 2), round(result.total_gib * tp, 2),
                          round(result.available_gib * tp, 2), f"tensor parallel {tp}: {choice.reason}")


@dataclass(frozen=True)
class TensorParallelChoice:
    tensor_parallel_size: int
    reason: str
    fit: Any  # the FitResult that chose it


def target_hardware(gpu_name: str, gpus: int) -> Any:
    """An idle target machine with `gpus` of the table's `gpu_name` (for export and `--gpu` answers)."""
    from desktop.core.machine.hardware import GIB as BYTES_PER_GIB
    from desktop.core.machine.hardware import CpuInfo, HardwareSnapshot, hypothetical

    base = HardwareSnapshot(gpus=[], cpu=CpuInfo("target host", "x86_64", 64, 128), ram_total_bytes=1024 * BYTES_PER_GIB,
                            ram_available_bytes=1024 * BYTES_PER_GIB, disk_free_bytes=None, os="Linux", label="target")
    return hypothetical(base, gpu_name=gpu_name, gpu_count=gpus)


def choose_tensor_parallel(model_config: dict[str, Any], gpu_spec: Any, gpus: int, *, max_model_len: int = 8192,
                           min_concurrency: float = 8.0, max_num_seqs: int = 256) -> TensorParallelChoice:
    """Export's tensor-parallel size: `size_vllm` (the rule recommend uses) at the checkpoint's own precision.

    A server that merely starts, with room for two long requests, is no production launch plan: that is why the
    concurrency floor decides, and the reason says which rule chose.
    """
    from desktop.core.models.facts import facts_from_config
    from desktop.core.planning.fit import size_vllm, sizing_plan

    facts = facts_from_config(model_config)
    target = target_hardware(gpu_spec.name, gpus)
    base = sizing_plan("vllm", ctx_per_request=max_model_len, slots=max_num_seqs)
    result = size_vllm(facts, target, base, concurrency=min_concurrency)
    if result is None or result.plan is None:
        raise SwitchyardError(f"the model does not fit on {gpus}x {gpu_spec.name} with vLLM at max_model_len "
                              f"{max_model_len}", "use more or larger GPUs, a quantized variant, or a shorter max_model_len")
    tp = result.plan.tensor_parallel
    if (result.max_concurrency or 0) >= min_concurrency:
        return TensorParallelChoice(tp, (
            f"TP {tp} on {gpu_spec.name}: {result.weights_gib:.1f} GiB weights per GPU leave KV for "
            f"{result.max_concurrency:.1f} concurrent {max_model_len}-token requests (≥ {min_concurrency:g})"), result)
    return TensorParallelChoice(tp, (
        f"TP {tp} on {gpu_spec.name}: the size that holds the most; only {result.max_concurrency or 0:.1f} "
        f"concurrent {max_model_len}-token requests fit (no size up to {gpus} GPUs reaches {min_concurrency:g})"),
        result)


