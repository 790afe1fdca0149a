"""Launch plans for hardware bigger than this workstation: the serialized plan, the GPU count it needs, and the
forms a person deploys it with (shell, docker run, Compose, Kubernetes, Ray multi-node, production-stack Helm)."""

from __future__ import annotations

from desktop.core.planning.export.formats import (
    FORMATS,
    compose_document,
    docker_run_argv,
    engine_args,
    export_plan,
    helm_values,
    k8s_documents,
    shell_argv,
)
from desktop.core.planning.export.parse import parse_engine_args, plan_from_export
from desktop.core.planning.export.plan import SCHEMA, ExportPlan, default_image
from desktop.core.planning.export.sizing import (
    ModelShape,
    ParallelChoice,
    choose_for_target,
    choose_parallelism,
    load_model_config,
)

__all__ = [
    "FORMATS", "SCHEMA", "ExportPlan", "ModelShape", "ParallelChoice", "choose_for_target", "choose_parallelism",
    "compose_document", "default_image", "docker_run_argv", "engine_args", "export_plan", "helm_values",
    "k8s_documents", "load_model_config", "parse_engine_args", "plan_from_export", "shell_argv",
]
