"""Render an ExportPlan as something a person pastes on bigger hardware: a shell command, `docker run`, a Compose
file, Kubernetes manifests, a multi-node Ray script, or values for the vLLM production-stack Helm chart.

Every form carries the same engine arguments (built once, in `engine_args`) and the same metadata (the GPU, the
GPUs per node and the reason for the tensor-parallel size, as labels or annotations), so `parse` can read any of
them back into the plan that produced it. Secrets are never written: API keys and the Hugging Face token come
from the environment or a Kubernetes Secret.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import Any

import yaml

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.base import llama_ctx_size
from desktop.core.planning.export.plan import ExportPlan

FORMATS = ("shell", "docker", "compose", "k8s", "ray", "helm")
ANNOTATION_PREFIX = "switchyard.dev/"
HF_CACHE = "/root/.cache/huggingface"
LLAMA_CACHE = "/root/.cache/llama.cpp"
HOST_HOME = "$HOME"
RAY_PORT = 6379


# --- the engine's own arguments -----------------------------------------------------------------------
def engine_args(plan: ExportPlan, *, bind_host: str) -> list[str]:
    """The server's arguments after the executable (vLLM: after `vllm serve`), model first."""
    return _vllm_args(plan, bind_host) if plan.engine == "vllm" else _llamacpp_args(plan, bind_host)


def _vllm_args(plan: ExportPlan, bind_host: str) -> list[str]:
    args = ["--model", plan.model, "--host", bind_host, "--port", str(plan.port),
            "--served-model-name", plan.served_model_name,
            "--tensor-parallel-size", str(plan.tensor_parallel_size)]
    if plan.pipeline_parallel_size > 1:
        args += ["--pipeline-parallel-size", str(plan.pipeline_parallel_size),
                 "--distributed-executor-backend", "ray"]
    optional: list[tuple[str, object]] = [
        ("--max-model-len", plan.max_model_len), ("--max-num-seqs", plan.max_num_seqs),
        ("--gpu-memory-utilization", plan.gpu_memory_utilization), ("--dtype", plan.dtype),
        ("--quantization", plan.quantization),
    ]
    args += [item for flag, value in optional if value is not None for item in (flag, str(value))]
    if plan.prefix_cache is not None:
        args.append("--enable-prefix-caching" if plan.prefix_cache else "--no-enable-prefix-caching")
    return args + list(plan.extra_args)


def _llamacpp_args(plan: ExportPlan, bind_host: str) -> list[str]:
    source = ["--model", plan.model] if plan.is_local_path else ["--hf-repo", plan.model]
    args = [*source, "--host", bind_host, "--port", str(plan.port), "--alias", plan.served_model_name]
    if plan.max_model_len is not None:
        # llama-server shares --ctx-size among its slots: give each slot the full per-request length.
        args += ["--ctx-size", str(llama_ctx_size(plan.max_model_len, plan.max_num_seqs or 1))]
    if plan.max_num_seqs is not None:
        args += ["--parallel", str(plan.max_num_seqs)]
    if plan.gpu_layers is not None:
        args += ["--n-gpu-layers", str(plan.gpu_layers)]
    if plan.prefix_cache is False:
        # and no host-RAM prompt cache (its saved prompts would never be reused); on, the target's llama-server
        # sizes that cache itself (--cache-ram, default 8192 MiB): this machine's spare RAM says nothing there
        args += ["--no-cache-prompt", "--cache-ram", "0"]
    args.append("--metrics")
    return args + list(plan.extra_args)


def uses_gpu(plan: ExportPlan) -> bool:
    return plan.engine == "vllm" or any(tag in plan.image for tag in ("cuda", "rocm", "vulkan", "musa"))


def metadata(plan: ExportPlan) -> dict[str, str]:
    """Labels/annotations every form carries, so the plan reads back whole and the reason stays visible."""
    data = {"engine": plan.engine, "tensor-parallel-size": str(plan.tensor_parallel_size),
            "gpus-per-node": str(plan.gpu_count)}
    if plan.gpu_name:
        data["gpu"] = plan.gpu_name
    if plan.tp_reason:
        data["tensor-parallel-reason"] = plan.tp_reason
    if plan.api_key_required:
        data["api-key-env"] = plan.api_key_env
    return {ANNOTATION_PREFIX + key: value for key, value in data.items()}


def _header(plan: ExportPlan, what: str) -> list[str]:
    lines = [f"# Switchyard launch plan: {what}"]
    lines += [f"# {key}: {value}" for key, value in metadata(plan).items()]
    if plan.api_key_required:
        lines.append(f"# clients must send the API key; the server reads it from ${plan.api_key_env}")
    return lines


def _quote(arg: str) -> str:
    """shlex.quote, except that a leading $HOME stays expandable."""
    if arg.startswith(HOST_HOME + "/"):
        return f'"{HOST_HOME}"' + shlex.quote(arg[len(HOST_HOME):])
    return shlex.quote(arg)


def _join(argv: list[str]) -> str:
    return " ".join(_quote(a) for a in argv)


# --- shell ----------------------------------------------------------------------------------------------
def shell_argv(plan: ExportPlan) -> list[str]:
    args = engine_args(plan, bind_host=plan.publish_host)
    if plan.engine == "vllm":
        return ["vllm", "serve", args[1], *args[2:]]  # `vllm serve MODEL ...`
    return ["llama-server", *args]


def render_shell(plan: ExportPlan) -> str:
    lines = _header(plan, f"{plan.engine} on the target host")
    if plan.api_key_required:
        lines.append(f"# export {plan.api_key_env}=... before running")
    return "\n".join([*lines, _join(shell_argv(plan))]) + "\n"


# --- docker run -----------------------------------------------------------------------------------------
def _cache_mount(plan: ExportPlan) -> tuple[str, str]:
    if plan.engine == "vllm":
        return f"{HOST_HOME}/.cache/huggingface", HF_CACHE
    return f"{HOST_HOME}/.cache/llama.cpp", LLAMA_CACHE


def local_files(plan: ExportPlan) -> list[str]:
    """What the server reads from the target's disk: a model given by path, and a vision model's projector."""
    args = list(plan.extra_args)
    projector = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--mmproj", "-mm") and args[i + 1][:1] == "/"]
    return ([plan.model] if plan.is_local_path else []) + projector


def _model_mounts(plan: ExportPlan) -> list[str]:
    """Files already on the target are mounted read-only at the same path, so the arguments are unchanged."""
    return [f"{path}:{path}:ro" for path in local_files(plan)]


def _env_names(plan: ExportPlan) -> list[str]:
    names = ["HF_TOKEN"]
    if plan.api_key_required:
        names.append(plan.api_key_env)
    return names


def docker_run_argv(plan: ExportPlan) -> list[str]:
    argv = ["docker", "run", "--rm", "--name", plan.name]
    if uses_gpu(plan):
        argv += ["--gpus", str(plan.tensor_parallel_size)]
    if plan.engine == "vllm":
        argv.append("--ipc=host")  # NCCL and PyTorch share tensors through /dev/shm
    argv += ["-p", f"{plan.publish_host}:{plan.port}:{plan.port}"]
    host_cache, container_cache = _cache_mount(plan)
    argv += ["-v", f"{host_cache}:{container_cache}"]
    for mount in _model_mounts(plan):
        argv += ["-v", mount]
    for name in _env_names(plan):
        argv += ["-e", name]  # passed through from the caller's environment, never written here
    for key, value in metadata(plan).items():
        argv += ["--label", f"{key}={value}"]
    return [*argv, plan.image, *engine_args(plan, bind_host="0.0.0.0")]  # noqa: S104 - inside the container


def render_docker(plan: ExportPlan) -> str:
    return "\n".join([*_header(plan, f"{plan.engine} in Docker"), _join(docker_run_argv(plan))]) + "\n"


# --- compose --------------------------------------------------------------------------------------------
def compose_document(plan: ExportPlan) -> dict[str, Any]:
    host_cache, container_cache = _cache_mount(plan)
    volumes = [f"${{HOME}}{host_cache[len(HOST_HOME):]}:{container_cache}"]
    volumes += _model_mounts(plan)
    health = (["CMD", "python3", "-c",
               f"import urllib.request; urllib.request.urlopen('http://localhost:{plan.port}/health')"]
              if plan.engine == "vllm" else ["CMD", "curl", "-f", f"http://localhost:{plan.port}/health"])
    service: dict[str, Any] = {
        "image": plan.image,
        "container_name": plan.name,
        "command": engine_args(plan, bind_host="0.0.0.0"),  # noqa: S104 - inside the container
        "ports": [f"{plan.publish_host}:{plan.port}:{plan.port}"],
        "volumes": volumes,
        "environment": _env_names(plan),
        "labels": metadata(plan),
        "restart": "unless-stopped",
        "healthcheck": {"test": health, "interval": "30s", "timeout": "5s", "retries": 3, "start_period": "20m"},
    }
    if plan.engine == "vllm":
        service["ipc"] = "host"
    if uses_gpu(plan):
        service["deploy"] = {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "count": plan.tensor_parallel_size, "capabilities": ["gpu"]}]}}}
    return {"services": {plan.name: service}}


def render_compose(plan: ExportPlan) -> str:
    return "\n".join(_header(plan, f"{plan.engine} with Docker Compose")) + "\n" + _yaml([compose_document(plan)])


# --- Kubernetes -----------------------------------------------------------------------------------------
def k8s_documents(plan: ExportPlan) -> list[dict[str, Any]]:
    """PersistentVolumeClaim (model cache, unless hostPath), Deployment and Service for one server."""
    if plan.pipeline_parallel_size > 1:
        raise SwitchyardError("a plain Deployment runs on one node; this plan spans "
                              f"{plan.pipeline_parallel_size} nodes", "use --format ray or --format helm")
    labels = {"app.kubernetes.io/name": plan.name, "app.kubernetes.io/component": "inference",
              "app.kubernetes.io/managed-by": "switchyard"}
    selector = {"app.kubernetes.io/name": plan.name}
    annotations = metadata(plan)
    cache_path = HF_CACHE if plan.engine == "vllm" else LLAMA_CACHE
    cache_volume: dict[str, Any] = (
        {"name": "model-cache", "persistentVolumeClaim": {"claimName": f"{plan.name}-model-cache"}}
        if plan.cache_volume == "pvc" else
        {"name": "model-cache", "hostPath": {"path": "/var/cache/switchyard/models", "type": "DirectoryOrCreate"}})
    shm_size = "16Gi" if plan.tensor_parallel_size > 1 else "2Gi"
    volumes: list[dict[str, Any]] = [cache_volume, {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}}]
    mounts: list[dict[str, Any]] = [{"name": "model-cache", "mountPath": cache_path}, {"name": "shm", "mountPath": "/dev/shm"}]
    for index, path in enumerate(local_files(plan)):  # the model (by path) and a projector, each from the node
        name = "model" if index == 0 and plan.is_local_path else f"model-file-{index}"
        volumes.append({"name": name, "hostPath": {"path": path}})
        mounts.append({"name": name, "mountPath": path, "readOnly": True})
    env: list[dict[str, Any]] = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "hf-token", "key": "token", "optional": True}}}]
    if plan.api_key_required:
        env.append({"name": plan.api_key_env, "valueFrom": {"secretKeyRef": {
            "name": f"{plan.name}-api-key", "key": "api-key"}}})
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 5}
    gpus = {"nvidia.com/gpu": str(plan.tensor_parallel_size)} if uses_gpu(plan) else {}
    container: dict[str, Any] = {
        "name": "vllm" if plan.engine == "vllm" else "llama-server",
        "image": plan.image,
        "command": ["vllm", "serve"] if plan.engine == "vllm" else ["/app/llama-server"],
        "args": engine_args(plan, bind_host="0.0.0.0"),  # noqa: S104 - inside the pod
        "ports": [{"name": "http", "containerPort": plan.port, "protocol": "TCP"}],
        "env": env,
        "resources": {"limits": dict(gpus), "requests": dict(gpus)} if gpus else {},
        "volumeMounts": mounts,
        # Loading 100+ GiB of weights takes minutes: the startup probe allows 30, then readiness takes over.
        "startupProbe": {**probe, "failureThreshold": 180},
        "readinessProbe": {**probe, "failureThreshold": 3},
        "livenessProbe": {**probe, "failureThreshold": 6},
    }
    documents: list[dict[str, Any]] = []
    if plan.cache_volume == "pvc":
        documents.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                          "metadata": {"name": f"{plan.name}-model-cache", "labels": labels},
                          "spec": {"accessModes": ["ReadWriteOnce"],
                                   "resources": {"requests": {"storage": plan.cache_size}}}})
    documents.append({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": plan.name, "labels": labels, "annotations": annotations},
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},  # the GPUs and a ReadWriteOnce cache cannot be shared by two pods
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": labels, "annotations": annotations},
                "spec": {"containers": [container], "volumes": volumes},
            },
        },
    })
    documents.append({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": plan.name, "labels": labels},
        "spec": {"type": "ClusterIP", "selector": selector,
                 "ports": [{"name": "http", "port": plan.port, "targetPort": "http", "protocol": "TCP"}]},
    })
    return documents


def render_k8s(plan: ExportPlan) -> str:
    return "\n".join(_header(plan, f"{plan.engine} on Kubernetes")) + "\n" + _yaml(k8s_documents(plan))


# --- multi-node: Ray -------------------------------------------------------------------------------------
def _require_vllm(plan: ExportPlan, what: str) -> None:
    if plan.engine != "vllm":
        raise SwitchyardError(f"{what} is for vLLM; this plan is for {plan.engine}",
                              "use --format shell, docker, compose or k8s for llama.cpp")


def render_ray(plan: ExportPlan) -> str:
    """A script run on every node: `head` starts Ray and, once all nodes joined, vLLM; `worker` joins."""
    _require_vllm(plan, "the Ray multi-node form")
    nodes = plan.pipeline_parallel_size
    serve = _join(shell_argv(plan if nodes > 1 else _with_ray_backend(plan)))
    return "\n".join([
        "#!/usr/bin/env bash",
        *_header(plan, f"vLLM on Ray across {nodes} node(s) x {plan.tensor_parallel_size} GPU(s)"),
        "# Run `$0 head HEAD_IP` on the head node and `$0 worker HEAD_IP` on every other node.",
        "# All nodes need the same vLLM and Ray versions and the model reachable at the same path or repo id.",
        "set -euo pipefail",
        'ROLE="${1:?usage: $0 head|worker HEAD_IP}"',
        'HEAD_IP="${2:?usage: $0 head|worker HEAD_IP}"',
        f"NODES={nodes}",
        'case "$ROLE" in',
        "  head)",
        f'    ray start --head --node-ip-address="$HEAD_IP" --port={RAY_PORT}',
        "    until [ \"$(python3 -c 'import ray; ray.init(address=\"auto\", logging_level=\"ERROR\"); "
        "print(sum(1 for n in ray.nodes() if n[\"Alive\"]))')\" -ge \"$NODES\" ]; do",
        '      echo "waiting for $NODES Ray nodes..."; sleep 5',
        "    done",
        f"    exec {serve}",
        "    ;;",
        "  worker)",
        f'    exec ray start --address="$HEAD_IP:{RAY_PORT}" --block',
        "    ;;",
        '  *) echo "unknown role $ROLE: use head or worker" >&2; exit 2 ;;',
        "esac",
    ]) + "\n"


def _with_ray_backend(plan: ExportPlan) -> ExportPlan:
    if "--distributed-executor-backend" in plan.extra_args:
        return plan
    from dataclasses import replace

    return replace(plan, extra_args=(*plan.extra_args, "--distributed-executor-backend", "ray"))


# --- vLLM production-stack Helm values --------------------------------------------------------------------
def helm_values(plan: ExportPlan) -> dict[str, Any]:
    """Values for the vllm-project/production-stack chart (servingEngineSpec.modelSpec, one model)."""
    _require_vllm(plan, "the production-stack Helm chart")
    repository, _, tag = plan.image.rpartition(":")
    config: dict[str, Any] = {"tensorParallelSize": plan.tensor_parallel_size}
    for key, value in (("maxModelLen", plan.max_model_len), ("maxNumSeqs", plan.max_num_seqs),
                       ("gpuMemoryUtilization", plan.gpu_memory_utilization), ("dtype", plan.dtype),
                       ("enablePrefixCaching", plan.prefix_cache)):
        if value is not None:
            config[key] = value
    extra = ["--served-model-name", plan.served_model_name]
    if plan.quantization:
        extra += ["--quantization", plan.quantization]
    if plan.pipeline_parallel_size > 1:
        extra += ["--pipeline-parallel-size", str(plan.pipeline_parallel_size)]
    config["extraArgs"] = extra + list(plan.extra_args)
    model: dict[str, Any] = {
        "name": plan.name,
        "repository": repository or plan.image,
        "tag": tag or "latest",
        "modelURL": plan.model,
        "replicaCount": 1,
        "requestCPU": 8 * plan.tensor_parallel_size,
        "requestMemory": f"{32 * plan.tensor_parallel_size}Gi",
        "requestGPU": plan.tensor_parallel_size,
        "pvcStorage": plan.cache_size,
        "shmSize": "16Gi" if plan.tensor_parallel_size > 1 else "2Gi",
        "annotations": metadata(plan),
        "hf_token": {"secretName": "hf-token", "secretKey": "token"},
        "vllmConfig": config,
    }
    if plan.pipeline_parallel_size > 1:
        # One Ray head plus pipeline_parallel_size - 1 workers, each with tensor_parallel_size GPUs.
        model["replicaCount"] = plan.pipeline_parallel_size - 1
        model["raySpec"] = {"enabled": True, "headNode": {
            "requestCPU": 8 * plan.tensor_parallel_size, "requestMemory": f"{32 * plan.tensor_parallel_size}Gi",
            "requestGPU": plan.tensor_parallel_size}}
    spec: dict[str, Any] = {"runtimeClassName": "nvidia", "modelSpec": [model]}
    if plan.api_key_required:
        spec["vllmApiKey"] = {"secretName": f"{plan.name}-api-key", "secretKey": "api-key"}
    return {"servingEngineSpec": spec}  # the chart's router defaults route by served model name


def render_helm(plan: ExportPlan) -> str:
    header = _header(plan, "vLLM production-stack Helm values "
                           "(helm install vllm vllm/vllm-stack -f values.yaml)")
    return "\n".join(header) + "\n" + _yaml([helm_values(plan)])


# --- entry point ----------------------------------------------------------------------------------------
class _PlainDumper(yaml.SafeDumper):
    """Writes repeated dicts out in full: anchors and aliases confuse people and some tools."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _yaml(documents: list[dict[str, Any]]) -> str:
    return yaml.dump_all(documents, Dumper=_PlainDumper, sort_keys=False, default_flow_style=False, width=1000)


RENDERERS: dict[str, Callable[[ExportPlan], str]] = {
    "shell": render_shell, "docker": render_docker, "compose": render_compose,
    "k8s": render_k8s, "ray": render_ray, "helm": render_helm,
}


def export_plan(plan: ExportPlan, fmt: str) -> str:
    """The plan as text in one of FORMATS: what the CLI prints and the GUI's Export action saves."""
    try:
        renderer = RENDERERS[fmt.lower()]
    except KeyError:
        raise SwitchyardError(f"unknown export format '{fmt}'", f"choose one of: {', '.join(FORMATS)}") from None
    return renderer(plan)
