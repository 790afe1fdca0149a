"""The serialized launch plan for hardware other than this workstation: one engine, one model, and the target
fields (image, GPUs, parallelism) that a LaunchPlan for the local machine does not carry.

JSON schema (version 1), written by `ExportPlan.to_json()` and read by `ExportPlan.from_json()`:

    {"schema": "switchyard.export-plan/1", "engine": "vllm" | "llama.cpp", "model": str,
     "served_model_name": str, "port": int, "image": str, "tensor_parallel_size": int,
     "pipeline_parallel_size": int, "gpu_count": int, "gpu_name": str | null, "max_model_len": int | null,
     "max_num_seqs": int | null, "gpu_memory_utilization": float | null, "dtype": str | null,
     "quantization": str | null, "prefix_cache": bool | null, "gpu_layers": int | null,
     "api_key_required": bool, "extra_args": [str], "tp_reason": str, "name": str,
     "cache_volume": "pvc" | "hostPath", "cache_size": str, "publish_host": str}

Only `engine` and `model` are required. Secrets never live in a plan: `api_key_required` makes the exports read
the key from the engine's own environment variable (VLLM_API_KEY, LLAMA_API_KEY) or a Kubernetes Secret.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines import get_adapter
from desktop.core.engines.base import LaunchPlan
from desktop.core.engines.vllm import VLLM_CUDA_VERSION

SCHEMA = "switchyard.export-plan/1"
VLLM_IMAGE = f"vllm/vllm-openai:v{VLLM_CUDA_VERSION}"
LLAMACPP_IMAGE = "ghcr.io/ggml-org/llama.cpp:server"
LLAMACPP_CUDA_IMAGE = "ghcr.io/ggml-org/llama.cpp:server-cuda"
DEFAULT_PORTS = {"vllm": 8000, "llama.cpp": 8080}
API_KEY_ENV = {"vllm": "VLLM_API_KEY", "llama.cpp": "LLAMA_API_KEY"}
_DNS_LABEL = re.compile(r"[^a-z0-9-]+")


@dataclass(frozen=True)
class ExportPlan:
    """A launch plan aimed at a target machine or cluster."""

    engine: str
    model: str  # Hugging Face repo id (llama.cpp: `repo[:quant]`), or a path that exists on the target
    served_model_name: str = "switchyard"
    port: int = 0  # 0: the engine's usual port (vLLM 8000, llama-server 8080)
    image: str = ""  # "": the engine's official image
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # > 1 only for the multi-node (Ray) forms: one stage per node
    gpu_count: int = 0  # GPUs per node; 0: as many as the tensor-parallel size
    gpu_name: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    dtype: str | None = None
    quantization: str | None = None
    prefix_cache: bool | None = None  # None: the engine's default
    gpu_layers: int | None = None  # llama.cpp only
    api_key_required: bool = False
    extra_args: tuple[str, ...] = ()
    tp_reason: str = ""
    name: str = ""  # resource / container name; "": derived from served_model_name
    cache_volume: Literal["pvc", "hostPath"] = "pvc"
    cache_size: str = "200Gi"
    publish_host: str = "127.0.0.1"  # docker/compose publish the port on this host address only
    schema: str = field(default=SCHEMA, repr=False)

    def __post_init__(self) -> None:
        engine = get_adapter(self.engine).name
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        if not self.port:
            object.__setattr__(self, "port", DEFAULT_PORTS[engine])
        if not self.image:
            object.__setattr__(self, "image", default_image(engine, self.tensor_parallel_size))
        if not self.gpu_count:
            object.__setattr__(self, "gpu_count", self.tensor_parallel_size)
        if not self.name:
            object.__setattr__(self, "name", dns_label(self.served_model_name or self.model))
        self._check()

    def _check(self) -> None:
        if not self.model.strip():
            raise SwitchyardError("the plan has no model", "give --model REPO_OR_PATH")
        if not 1 <= self.port <= 65535:
            raise SwitchyardError(f"port {self.port} is out of range", "use a port between 1 and 65535")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise SwitchyardError("tensor and pipeline parallel sizes must be at least 1", "use --tp 1 or more")
        if self.gpu_count < self.tensor_parallel_size:
            raise SwitchyardError(
                f"tensor parallel {self.tensor_parallel_size} needs {self.tensor_parallel_size} GPUs per node, "
                f"the target has {self.gpu_count}", "raise --gpus or lower --tp")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise SwitchyardError("gpu_memory_utilization must be in (0, 1]", "for example 0.9")
        if self.cache_volume not in ("pvc", "hostPath"):
            raise SwitchyardError(f"unknown cache volume '{self.cache_volume}'", "use pvc or hostPath")
        if self.schema != SCHEMA:
            raise SwitchyardError(f"unsupported plan schema '{self.schema}'", f"this version reads {SCHEMA}")

    @property
    def api_key_env(self) -> str:
        return API_KEY_ENV[self.engine]

    @property
    def is_local_path(self) -> bool:
        return self.model.startswith("/")

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["extra_args"] = list(self.extra_args)
        return {"schema": data.pop("schema"), **data}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExportPlan:
        """Build from a dict as written by to_json(); unknown keys are an error, not silently dropped."""
        if not isinstance(data, dict):
            raise SwitchyardError("a plan must be a JSON object", f"see the {SCHEMA} schema")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SwitchyardError(f"unknown plan field(s): {', '.join(unknown)}",
                                  f"known fields: {', '.join(sorted(known))}")
        missing = [name for name in ("engine", "model") if not data.get(name)]
        if missing:
            raise SwitchyardError(f"the plan lacks {', '.join(missing)}", "add them to the plan file")
        values = dict(data)
        if "extra_args" in values:
            values["extra_args"] = tuple(str(a) for a in values["extra_args"] or ())
        try:
            return cls(**values)
        except TypeError as exc:
            raise SwitchyardError(f"invalid plan: {exc}", f"see the {SCHEMA} schema") from None

    @classmethod
    def load(cls, path: Path) -> ExportPlan:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise SwitchyardError(f"plan file not found: {path}", "give the path of a plan JSON file") from None
        except (OSError, ValueError) as exc:
            raise SwitchyardError(f"cannot read plan {path}: {exc}", "the file must be a JSON plan") from None
        return cls.from_json(data)

    @classmethod
    def from_launch_plan(cls, plan: LaunchPlan, *, model: str | None = None, **target: Any) -> ExportPlan:
        """The target-side twin of a local LaunchPlan: the same fields, unchanged (the context stays per request;
        llama.cpp's shared -c is formed from it by the one `llama_ctx_size`), plus target fields.
        `model` replaces the local path (e.g. with the Hugging Face repo id the weights came from)."""
        vllm = plan.engine == "vllm"
        extra: list[str] = []
        if plan.kv_cache_type and plan.kv_cache_type not in ("f16", "auto"):
            extra += (["--kv-cache-dtype", plan.kv_cache_type] if vllm else
                      ["--cache-type-k", plan.kv_cache_type, "--cache-type-v", plan.kv_cache_type])
        if not vllm and plan.flash_attn is not None:
            extra += ["--flash-attn", "on" if plan.flash_attn else "off"]
        if not vllm and plan.n_cpu_moe:
            extra += ["--n-cpu-moe", str(plan.n_cpu_moe)]
        if not vllm and plan.override_tensors:
            extra += ["-ot", ",".join(plan.override_tensors)]  # as typed, as launched here (engines.llamacpp)
        if vllm and plan.max_num_batched_tokens is not None:
            extra += ["--max-num-batched-tokens", str(plan.max_num_batched_tokens)]
        if not vllm and plan.ubatch is not None:  # an embedder's batch holds its longest input (engines.pooling)
            extra += ["--ubatch-size", str(plan.ubatch)]
        if not vllm and plan.mmproj is not None and model is None:  # from a repo, -hf fetches the projector itself
            extra += ["--mmproj", str(plan.mmproj)]
        if not vllm and plan.mmproj is not None and plan.image_max_tokens is not None:
            extra += ["--image-max-tokens", str(plan.image_max_tokens)]
        if vllm and plan.images_per_prompt is not None:
            extra += ["--limit-mm-per-prompt", json.dumps({"image": plan.images_per_prompt})]
        extra += get_adapter(plan.engine).chat_args(plan)  # tools and reasoning work there as they do here
        fields: dict[str, Any] = {"tensor_parallel_size": plan.tensor_parallel} if vllm else {}
        fields.update(target)
        return cls(
            engine=plan.engine,
            model=model or str(plan.model_path),
            served_model_name=plan.served_model_name,
            max_model_len=plan.ctx_per_request,
            max_num_seqs=plan.slots,
            gpu_memory_utilization=plan.gpu_memory_utilization if vllm else None,
            dtype=plan.dtype if vllm else None,
            quantization=plan.quantization if vllm else None,
            prefix_cache=plan.prefix_cache,
            gpu_layers=None if vllm else plan.gpu_layers,
            api_key_required=bool(plan.api_key),
            extra_args=(*extra, *plan.extra_args),
            **fields,
        )


def default_image(engine: str, gpus: int) -> str:
    if engine == "vllm":
        return VLLM_IMAGE
    return LLAMACPP_CUDA_IMAGE if gpus > 0 else LLAMACPP_IMAGE


def dns_label(text: str) -> str:
    """A Kubernetes-safe name (RFC 1123 label) from a model or served name."""
    label = _DNS_LABEL.sub("-", text.lower().rsplit("/", 1)[-1]).strip("-")[:63].strip("-")
    return label or "switchyard"
