"""Read an exported launch back into the ExportPlan it came from: the proof that an export says what the plan
says, and a way to import a `vllm serve`/`llama-server`/`docker run` line someone already uses."""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from desktop.core.common.errors import SwitchyardError
from desktop.core.planning.export.formats import ANNOTATION_PREFIX, engine_args
from desktop.core.planning.export.plan import API_KEY_ENV, ExportPlan

_HEADER = re.compile(r"^#\s*(" + re.escape(ANNOTATION_PREFIX) + r"[\w.-]+):\s?(.*)$")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would exit the process
        raise SwitchyardError(f"cannot read the engine arguments: {message}", "check the command line")


def _vllm_parser() -> _Parser:
    parser = _Parser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--served-model-name")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parser.add_argument("--distributed-executor-backend")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--gpu-memory-utilization", type=float)
    parser.add_argument("--dtype")
    parser.add_argument("--quantization", "-q")
    parser.add_argument("--enable-prefix-caching", dest="prefix_cache", action="store_true", default=None)
    parser.add_argument("--no-enable-prefix-caching", dest="prefix_cache", action="store_false")
    return parser


def _llamacpp_parser() -> _Parser:
    parser = _Parser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model", "-m")
    parser.add_argument("--hf-repo", "-hf")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--alias", "-a")
    parser.add_argument("--ctx-size", "-c", type=int)
    parser.add_argument("--parallel", "-np", type=int)
    parser.add_argument("--n-gpu-layers", "-ngl", type=int)
    parser.add_argument("--no-cache-prompt", action="store_true")
    parser.add_argument("--cache-ram", "-cram")
    parser.add_argument("--metrics", action="store_true")
    return parser


def parse_engine_args(engine: str, args: Iterable[str]) -> dict[str, Any]:
    """ExportPlan fields from an engine's arguments; arguments Switchyard does not model stay in extra_args."""
    args = list(args)
    if engine == "vllm":
        positional_model = args.pop(0) if args and not args[0].startswith("-") else None
        known, extra = _vllm_parser().parse_known_args(args)
        model = known.model or positional_model
        fields: dict[str, Any] = {
            "served_model_name": known.served_model_name, "port": known.port,
            "tensor_parallel_size": known.tensor_parallel_size,
            "pipeline_parallel_size": known.pipeline_parallel_size,
            "max_model_len": known.max_model_len, "max_num_seqs": known.max_num_seqs,
            "gpu_memory_utilization": known.gpu_memory_utilization, "dtype": known.dtype,
            "quantization": known.quantization, "prefix_cache": known.prefix_cache,
        }
        if known.distributed_executor_backend and (known.pipeline_parallel_size == 1
                                                   or known.distributed_executor_backend != "ray"):
            extra += ["--distributed-executor-backend", known.distributed_executor_backend]
    else:
        known, extra = _llamacpp_parser().parse_known_args(args)
        model = known.model or known.hf_repo
        parallel = known.parallel
        fields = {
            "served_model_name": known.alias, "port": known.port, "max_num_seqs": parallel,
            "max_model_len": known.ctx_size // (parallel or 1) if known.ctx_size is not None else None,
            "gpu_layers": known.n_gpu_layers, "prefix_cache": False if known.no_cache_prompt else None,
        }
        if known.cache_ram is not None and not (known.no_cache_prompt and known.cache_ram == "0"):
            extra += ["--cache-ram", known.cache_ram]  # what `--no-cache-prompt` writes with it is read back whole
    if not model:
        raise SwitchyardError("the command names no model", "add --model (or -hf for llama-server)")
    fields.update(model=model, extra_args=tuple(extra), host=known.host)
    return fields


def _plan(engine: str, fields: dict[str, Any], meta: Mapping[str, str], **overrides: Any) -> ExportPlan:
    fields = {key: value for key, value in fields.items() if value is not None}
    fields.pop("host", None)
    tp_meta = meta.get(ANNOTATION_PREFIX + "tensor-parallel-size")
    if engine != "vllm" and tp_meta:
        fields["tensor_parallel_size"] = int(tp_meta)
    if gpus := meta.get(ANNOTATION_PREFIX + "gpus-per-node"):
        fields["gpu_count"] = int(gpus)
    fields["gpu_name"] = meta.get(ANNOTATION_PREFIX + "gpu")
    fields["tp_reason"] = meta.get(ANNOTATION_PREFIX + "tensor-parallel-reason", "")
    fields["api_key_required"] = ANNOTATION_PREFIX + "api-key-env" in meta
    fields.update({key: value for key, value in overrides.items() if value is not None})
    return ExportPlan(engine=engine, **fields)


def _header_meta(text: str) -> dict[str, str]:
    meta: dict[str, str] = {}
    for line in text.splitlines():
        if match := _HEADER.match(line.strip()):
            meta[match.group(1)] = match.group(2)
    return meta


def _engine_of(argv0: str, image: str = "", meta: Mapping[str, str] | None = None) -> str:
    if meta and (engine := meta.get(ANNOTATION_PREFIX + "engine")):
        return engine
    return "vllm" if "vllm" in (argv0 + image) else "llama.cpp"


def plan_from_shell(text: str) -> ExportPlan:
    """From `vllm serve MODEL ...` or `llama-server ...` (comment lines with switchyard.dev/ metadata allowed)."""
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        raise SwitchyardError("no command found", "give a `vllm serve ...` or `llama-server ...` line")
    argv = shlex.split(" ".join(lines))
    meta = _header_meta(text)
    if argv[:2] == ["vllm", "serve"]:
        engine, args = "vllm", argv[2:]
    elif argv and argv[0].endswith("llama-server"):
        engine, args = "llama.cpp", argv[1:]
    else:
        raise SwitchyardError(f"not a server command: {argv[0] if argv else ''}",
                              "expected `vllm serve` or `llama-server`")
    fields = parse_engine_args(engine, args)
    return _plan(engine, fields, meta, publish_host=fields.get("host"))


_DOCKER_VALUE_OPTIONS = {"--name", "--gpus", "-p", "--publish", "-v", "--volume", "-e", "--env", "--label", "-l",
                         "--shm-size", "--runtime", "--network", "--ipc", "--entrypoint", "-w", "--user", "-u"}


def plan_from_docker_run(text: str) -> ExportPlan:
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    argv = shlex.split(" ".join(lines))
    if argv[:2] != ["docker", "run"]:
        raise SwitchyardError("not a `docker run` command", "give the line that starts with docker run")
    options: dict[str, list[str]] = {}
    index = 2
    while index < len(argv) and argv[index].startswith("-"):
        token = argv[index]
        name, eq, value = token.partition("=")
        if eq:
            options.setdefault(name, []).append(value)
        elif token in _DOCKER_VALUE_OPTIONS:
            index += 1
            options.setdefault(token, []).append(argv[index])
        index += 1
    if index >= len(argv):
        raise SwitchyardError("the docker run command names no image", "add the image before the engine arguments")
    image, args = argv[index], argv[index + 1:]
    meta = dict(label.partition("=")[::2] for label in options.get("--label", []) + options.get("-l", []))
    engine = _engine_of("", image, meta)
    fields = parse_engine_args(engine, args)
    envs = options.get("-e", []) + options.get("--env", [])
    publish = (options.get("-p") or options.get("--publish") or [""])[0]
    return _plan(engine, fields, meta, image=image, name=next(iter(options.get("--name", [])), None),
                 publish_host=publish.split(":")[0] if publish.count(":") == 2 else None,
                 api_key_required=API_KEY_ENV[engine] in envs)


def plan_from_compose(text: str) -> ExportPlan:
    document = yaml.safe_load(text)
    services = (document or {}).get("services") or {}
    if len(services) != 1:
        raise SwitchyardError("expected a Compose file with one service", "export one plan per file")
    name, service = next(iter(services.items()))
    meta = {str(k): str(v) for k, v in (service.get("labels") or {}).items()}
    engine = _engine_of("", service.get("image", ""), meta)
    fields = parse_engine_args(engine, [str(a) for a in service.get("command") or []])
    ports = service.get("ports") or [""]
    return _plan(engine, fields, meta, image=service.get("image"), name=service.get("container_name", name),
                 publish_host=str(ports[0]).split(":")[0] if str(ports[0]).count(":") == 2 else None,
                 api_key_required=API_KEY_ENV[engine] in (service.get("environment") or []))


def plan_from_k8s(text: str) -> ExportPlan:
    documents = [d for d in yaml.safe_load_all(text) if d]
    deployment = next((d for d in documents if d.get("kind") == "Deployment"), None)
    if deployment is None:
        raise SwitchyardError("no Deployment in the manifests", "give the YAML that `export --format k8s` wrote")
    meta = {str(k): str(v) for k, v in (deployment["metadata"].get("annotations") or {}).items()}
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    engine = _engine_of(" ".join(container.get("command") or []), container.get("image", ""), meta)
    fields = parse_engine_args(engine, [str(a) for a in container.get("args") or []])
    claim = next((d for d in documents if d.get("kind") == "PersistentVolumeClaim"), None)
    env_names = {e.get("name") for e in container.get("env") or []}
    return _plan(engine, fields, meta, image=container.get("image"), name=deployment["metadata"]["name"],
                 cache_volume="pvc" if claim else "hostPath",
                 cache_size=claim["spec"]["resources"]["requests"]["storage"] if claim else None,
                 api_key_required=API_KEY_ENV[engine] in env_names)


def plan_from_ray(text: str) -> ExportPlan:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip().startswith("exec vllm serve")), None)
    if line is None:
        raise SwitchyardError("no `vllm serve` line in the script", "give the script `export --format ray` wrote")
    fields = parse_engine_args("vllm", shlex.split(line)[3:])
    extra = list(fields["extra_args"])
    if fields.get("pipeline_parallel_size", 1) == 1 and "--distributed-executor-backend" in extra:
        at = extra.index("--distributed-executor-backend")  # added by the Ray form itself
        del extra[at:at + 2]
        fields["extra_args"] = tuple(extra)
    return _plan("vllm", fields, _header_meta(text), publish_host=fields.get("host"))


def plan_from_export(text: str, fmt: str) -> ExportPlan:
    """Read back any form `export_plan` writes except Helm values (which drop the engine's host and port)."""
    readers = {"shell": plan_from_shell, "docker": plan_from_docker_run, "compose": plan_from_compose,
               "k8s": plan_from_k8s, "ray": plan_from_ray}
    try:
        return readers[fmt](text)
    except KeyError:
        raise SwitchyardError(f"cannot read back format '{fmt}'", f"readable: {', '.join(readers)}") from None


__all__ = ["engine_args", "parse_engine_args", "plan_from_compose", "plan_from_docker_run", "plan_from_export",
           "plan_from_k8s", "plan_from_ray", "plan_from_shell"]
