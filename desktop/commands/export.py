"""`switchyard export` (a launch plan as shell, docker, compose, k8s, ray or helm) and
`switchyard endpoints add|list|remove|check` (attach OpenAI-compatible servers running elsewhere)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from desktop.commands import _numbers as N
from desktop.commands._common import LazyChoices, cell, emit_json
from desktop.core.common.errors import SwitchyardError

if TYPE_CHECKING:  # the endpoint client (httpx) loads when an endpoints command runs
    from desktop.core.engines.external import EndpointReport
    from desktop.core.planning.export import ExportPlan


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    _register_export(subparsers)
    _register_endpoints(subparsers)


# --- export ---------------------------------------------------------------------------------------------
def _register_export(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "export", help="write a launch plan for bigger hardware (shell, docker, compose, k8s, ray, helm)",
        description="Export a launch plan. PLAN is a JSON plan file (see `--save-plan`); flags override its "
                    "fields or, without PLAN, describe the plan. With --gpu and --gpus the tensor-parallel "
                    "size is chosen from the model's size unless --tp is given.")
    p.add_argument("plan", nargs="?", type=Path, help="a plan JSON file (ExportPlan.to_json)")
    p.add_argument("--format", "-f", choices=LazyChoices("desktop.core.planning.export.formats", "FORMATS"), default="shell", metavar="FORMAT",
                   help="%(choices)s (default: %(default)s)")
    p.add_argument("--out", "-o", type=Path, help="write to this file instead of stdout")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--save-plan", type=Path, help="also write the resolved plan as JSON here")
    p.add_argument("--json", action="store_true", help="print the plan, the reason and the text as JSON")
    target = p.add_argument_group("plan fields")
    target.add_argument("--engine", help="vllm or llama.cpp")
    target.add_argument("--model", help="Hugging Face repo id (llama.cpp: repo[:quant]) or a path on the target")
    target.add_argument("--served-name", dest="served_model_name")
    target.add_argument("--port", type=N.port)
    target.add_argument("--image")
    target.add_argument("--gpu", dest="gpu_name", help="target GPU, e.g. H100, A100-80GB, L40S")
    target.add_argument("--gpus", dest="gpu_count", type=N.count, help="GPUs per node on the target")
    target.add_argument("--nodes", type=N.count, default=None, help="nodes for the multi-node (ray/helm) forms")
    target.add_argument("--tp", dest="tensor_parallel_size", type=N.count, help="tensor-parallel size (skips sizing)")
    target.add_argument("--pp", dest="pipeline_parallel_size", type=N.count, help="pipeline-parallel size (nodes)")
    target.add_argument("--max-model-len", type=N.count)
    target.add_argument("--max-num-seqs", type=N.count)
    target.add_argument("--gpu-memory-utilization", type=N.fraction)
    target.add_argument("--dtype")
    target.add_argument("--quantization")
    target.add_argument("--prefix-cache", dest="prefix_cache", action="store_true", default=None)
    target.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false")
    target.add_argument("--gpu-layers", type=N.non_negative, help="llama.cpp --n-gpu-layers")
    target.add_argument("--api-key-required", action="store_true", default=None,
                        help="the server requires an API key (read from its env var or a Secret)")
    target.add_argument("--extra-arg", dest="extra_args", action="append",
                        help="one more engine argument (repeatable)")
    target.add_argument("--name", help="container / Kubernetes resource name")
    target.add_argument("--cache", dest="cache_volume", choices=("pvc", "hostPath"))
    target.add_argument("--cache-size")
    target.add_argument("--publish-host", help="address the port is published on (default 127.0.0.1)")
    sizing = p.add_argument_group("sizing (when --tp is not given)")
    sizing.add_argument("--model-config", type=Path, help="the model's config.json (else read from --model)")
    sizing.add_argument("--params-b", type=N.positive, help="parameters in billions, when no config.json is at hand")
    sizing.add_argument("--concurrency", type=N.count, default=8,
                        help="requests the KV cache must hold at --max-model-len (default 8; as `recommend`)")
    p.set_defaults(func=cmd_export)


_FIELD_FLAGS = ("engine", "model", "served_model_name", "port", "image", "gpu_name", "gpu_count",
                "tensor_parallel_size", "pipeline_parallel_size", "max_model_len", "max_num_seqs",
                "gpu_memory_utilization", "dtype", "quantization", "prefix_cache", "gpu_layers",
                "api_key_required", "name", "cache_volume", "cache_size", "publish_host")


def resolve_plan(args: argparse.Namespace) -> ExportPlan:
    """The plan file (if any) with the flags laid over it, and the tensor-parallel size chosen when needed."""
    from desktop.core.planning.export import ExportPlan, choose_for_target, load_model_config

    fields: dict[str, Any] = ExportPlan.load(args.plan).to_json() if args.plan else {}
    fields.pop("schema", None)
    for key in _FIELD_FLAGS:
        value = getattr(args, key, None)
        if value is not None:
            fields[key] = value
    if args.extra_args:
        fields["extra_args"] = tuple(fields.get("extra_args") or ()) + tuple(args.extra_args)
    if not fields.get("engine") or not fields.get("model"):
        raise SwitchyardError("a plan needs an engine and a model", "give PLAN.json, or --engine and --model")
    nodes = args.nodes or fields.get("pipeline_parallel_size") or 1
    if args.gpu_name and args.tensor_parallel_size is None:
        gpus = int(fields.get("gpu_count") or 0)
        if gpus < 1:
            raise SwitchyardError("--gpu needs --gpus N (GPUs per node) to size the plan", "e.g. --gpu H100 --gpus 8")
        config = load_model_config(args.model_config) if args.model_config else load_model_config(fields["model"])
        if args.model_config and config is None:
            raise SwitchyardError(f"no config.json at {args.model_config}", "give the model's config.json")
        choice = choose_for_target(
            gpu=args.gpu_name, gpus=gpus, model_config=config,
            parameters=args.params_b * 1e9 if args.params_b else None, dtype=fields.get("dtype"),
            quantization=fields.get("quantization"), max_model_len=fields.get("max_model_len"),
            gpu_memory_utilization=fields.get("gpu_memory_utilization"), nodes=nodes,
            concurrency=args.concurrency)
        fields.update(tensor_parallel_size=choice.tensor_parallel_size,
                      pipeline_parallel_size=choice.pipeline_parallel_size, tp_reason=choice.reason)
        from desktop.core.machine.gpu_catalog import require_gpu

        fields["gpu_name"] = require_gpu(args.gpu_name).name
    elif args.tensor_parallel_size is not None:
        fields["tp_reason"] = f"tensor parallel {args.tensor_parallel_size}: set by the user"
        if args.nodes and args.pipeline_parallel_size is None:
            fields["pipeline_parallel_size"] = args.nodes
    elif args.gpu_count and not args.plan:
        raise SwitchyardError("--gpus alone cannot size the plan",
                              "add --gpu NAME to choose the tensor-parallel size, or give --tp N")
    return ExportPlan.from_json(fields)


def cmd_export(args: argparse.Namespace) -> int:
    from desktop.core.planning.export import export_plan

    plan = resolve_plan(args)
    text = export_plan(plan, args.format)
    if args.out:
        _write(args.out, text, args.force, executable=args.format == "ray")
    if args.save_plan:
        _write(args.save_plan, plan.dumps(), args.force)
    if args.json:
        emit_json({"format": args.format, "plan": plan.to_json(), "reason": plan.tp_reason,
                   "out": str(args.out) if args.out else None, "text": None if args.out else text})
        return 0
    if plan.tp_reason:
        print(f"switchyard: {plan.tp_reason}", file=sys.stderr)
    if args.out:
        print(f"wrote {args.format} plan to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _write(path: Path, text: str, force: bool, executable: bool = False) -> None:
    if path.exists() and not force:
        raise SwitchyardError(f"{path} already exists", "pass --force to overwrite it, or pick another --out")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        if executable:
            path.chmod(0o755)
    except OSError as exc:
        raise SwitchyardError(f"cannot write {path}: {exc.strerror}", "pick a writable path") from None


# --- endpoints ------------------------------------------------------------------------------------------
def _register_endpoints(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("endpoints", help="attach OpenAI-compatible servers running elsewhere")
    sub = p.add_subparsers(dest="endpoints_command", metavar="ACTION", required=True)

    add = sub.add_parser("add", help="attach a server by base URL (checked before it is saved)")
    add.add_argument("name")
    add.add_argument("url", help="e.g. http://gpu-box:8000 (a trailing /v1 is fine)")
    key = add.add_mutually_exclusive_group()
    key.add_argument("--api-key-stdin", action="store_true", help="read the API key from standard input")
    key.add_argument("--api-key-env", metavar="VAR", help="read the API key from this environment variable")
    add.add_argument("--insecure", action="store_true", help="do not verify TLS (a self-signed host of yours)")
    add.add_argument("--replace", action="store_true", help="overwrite an endpoint of the same name")
    add.add_argument("--no-check", action="store_true", help="save without contacting the server")
    add.add_argument("--json", action="store_true")
    add.set_defaults(func=cmd_endpoints_add)

    lst = sub.add_parser("list", help="attached endpoints")
    lst.add_argument("--json", action="store_true")
    lst.set_defaults(func=cmd_endpoints_list)

    rm = sub.add_parser("remove", help="detach an endpoint and forget its key")
    rm.add_argument("name")
    rm.set_defaults(func=cmd_endpoints_remove)

    check = sub.add_parser("check", help="list an endpoint's models and read its metrics")
    check.add_argument("endpoint", help="a name from `endpoints list`, or a URL")
    check.add_argument("--json", action="store_true")
    check.set_defaults(func=cmd_endpoints_check)


def _read_key(args: argparse.Namespace) -> str | None:
    if args.api_key_stdin:
        text = sys.stdin.readline().strip()
        if not text:
            raise SwitchyardError("no API key on standard input", "pipe the key in, e.g. `pass show x | ...`")
        return text
    if args.api_key_env:
        value = os.environ.get(args.api_key_env, "").strip()
        if not value:
            raise SwitchyardError(f"${args.api_key_env} is empty or not set", "export it, or use --api-key-stdin")
        return value
    return None


def cmd_endpoints_add(args: argparse.Namespace) -> int:
    from desktop.core.engines.external import (
        EndpointStore,
        ExternalEndpoint,
        normalize_base_url,
        probe_endpoint,
    )

    store = EndpointStore()
    key = _read_key(args)
    report = None
    if not args.no_check:
        candidate = ExternalEndpoint(args.name, normalize_base_url(args.url), key, not args.insecure)
        report = probe_endpoint(candidate)  # fails clearly before anything is saved
    endpoint = store.add(args.name, args.url, key, verify_tls=not args.insecure, replace=args.replace)
    if args.json:
        emit_json({"endpoint": endpoint.to_json(), "check": report.to_json() if report else None})
        return 0
    print(f"attached {endpoint.name}: {endpoint.base_url}" + (" (TLS not verified)" if args.insecure else ""))
    if report:
        _print_report(report)
    return 0


def cmd_endpoints_list(args: argparse.Namespace) -> int:
    from desktop.core.engines.external import EndpointStore

    endpoints = EndpointStore().list()
    if args.json:
        emit_json([e.to_json() for e in endpoints])
        return 0
    if not endpoints:
        print("no endpoints attached (add one with `switchyard endpoints add NAME URL`)")
    for e in endpoints:
        flags = ", ".join(f for f, on in (("api key", e.api_key is not None), ("TLS not verified", not e.verify_tls))
                          if on)
        print(f"{cell(e.name):20} {cell(e.base_url)}" + (f"  ({flags})" if flags else ""))
    return 0


def cmd_endpoints_remove(args: argparse.Namespace) -> int:
    from desktop.core.engines.external import EndpointStore

    EndpointStore().remove(args.name)
    print(f"removed {args.name}")
    return 0


def cmd_endpoints_check(args: argparse.Namespace) -> int:
    from desktop.core.engines.external import probe_endpoint, resolve_endpoint

    report = probe_endpoint(resolve_endpoint(args.endpoint))
    if args.json:
        emit_json(report)
    else:
        _print_report(report)
    return 0


def _print_report(report: EndpointReport) -> None:
    print(f"{report.name}: {len(report.models)} model(s), answered in {report.latency_ms:.0f} ms")
    for model in report.models:
        extra = f" (max_model_len {model.max_model_len})" if model.max_model_len else ""
        print(f"  {cell(model.id)}{extra}")
    if not report.metrics_exposed:
        print("  no /metrics exposed")
    else:
        print(f"  engine: {report.engine or 'unknown (metrics not from vLLM or llama.cpp)'}")
        for key, value in sorted(report.metrics.items()):
            print(f"  {key} = {value:g}")

