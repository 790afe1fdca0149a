"""Launch-plan export: every form checked by a real validator and read back into the plan it came from."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from desktop.cli import main
from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.base import LaunchPlan
from desktop.core.planning.export import (
    FORMATS,
    ExportPlan,
    ModelShape,
    choose_for_target,
    docker_run_argv,
    export_plan,
    helm_values,
    k8s_documents,
    plan_from_export,
    shell_argv,
)

K8S_VERSION = "1.31.0"  # pinned: kubernetes-validate ships this version's schemas
COMPOSE_SCHEMA = json.loads((Path(__file__).parent / "data" / "compose-spec.json").read_text())

LLAMA3_70B = {  # meta-llama/Meta-Llama-3-70B config.json (the fields sizing reads)
    "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
LLAMA31_405B = {
    "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
}

VLLM_PLAN = ExportPlan(
    engine="vllm", model="meta-llama/Meta-Llama-3-70B-Instruct", served_model_name="llama3-70b",
    tensor_parallel_size=4, gpu_count=8, gpu_name="NVIDIA H100 80GB HBM3", max_model_len=8192, max_num_seqs=64,
    gpu_memory_utilization=0.92, dtype="bfloat16", prefix_cache=False, api_key_required=True,
    extra_args=("--kv-cache-dtype", "fp8", "--enforce-eager"), tp_reason="tensor parallel 4: because 'quoted'",
)
LLAMA_PLAN = ExportPlan(
    engine="llama.cpp", model="bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M", served_model_name="llama3b",
    tensor_parallel_size=2, max_model_len=4096, max_num_seqs=4, gpu_layers=99, prefix_cache=False,
    extra_args=("--flash-attn", "on"),
)
LOCAL_PLAN = ExportPlan(engine="vllm", model="/srv/models/Qwen2.5-7B Instruct", served_model_name="qwen",
                        cache_volume="hostPath", publish_host="0.0.0.0")  # noqa: S104 - a field value only
PLANS = {"vllm": VLLM_PLAN, "llama.cpp": LLAMA_PLAN, "local-path": LOCAL_PLAN}


def _k8s_validate(text: str) -> list[dict]:
    documents = [d for d in yaml.safe_load_all(text) if d]
    for document in documents:
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)
    return documents


# --- sizing -----------------------------------------------------------------------------------------
def test_llama3_70b_parameter_count_matches_the_published_size() -> None:
    assert ModelShape.from_config(LLAMA3_70B).parameters == pytest.approx(70.55e9, rel=0.01)


def test_70b_bf16_on_80gb_gpus_needs_tensor_parallel_4_with_the_arithmetic_stated() -> None:
    """The fit estimator's vLLM accounting decides: TP 2 would start but hold only ~2.6 concurrent 8192-token
    requests; TP 4 is the smallest size that holds at least 8, and the reason says so."""
    choice = choose_for_target(gpu="H100", gpus=8, model_config=LLAMA3_70B, dtype="bfloat16")
    assert (choice.tensor_parallel_size, choice.pipeline_parallel_size) == (4, 1)
    assert choice.weights_gib == pytest.approx(131.4, abs=0.5)
    assert 143.4 < choice.needed_gib <= choice.available_gib
    assert "32.9 GiB weights per GPU" in choice.reason and "8192-token" in choice.reason
    assert "concurrent" in choice.reason


def test_fp8_halves_the_weights_and_fits_on_two_gpus() -> None:
    choice = choose_for_target(gpu="H100", gpus=8, model_config=LLAMA3_70B, quantization="fp8")
    assert choice.tensor_parallel_size == 2


def test_405b_spills_to_a_second_node_as_pipeline_parallel() -> None:
    choice = choose_for_target(gpu="H100", gpus=8, model_config=LLAMA31_405B, nodes=2)
    assert (choice.tensor_parallel_size, choice.pipeline_parallel_size) == (8, 2)


def test_a_model_that_does_not_fit_the_target_is_a_clear_error() -> None:
    with pytest.raises(SwitchyardError, match=r"does not fit on 8 x NVIDIA L4") as info:
        choose_for_target(gpu="L4", gpus=8, model_config=LLAMA31_405B)
    assert "--nodes" in (info.value.hint or "")


def test_unknown_gpu_is_a_clear_error() -> None:
    with pytest.raises(SwitchyardError, match="unknown GPU"):
        choose_for_target(gpu="Voodoo5", gpus=2, model_config=LLAMA3_70B)


# --- the plan JSON ------------------------------------------------------------------------------------
@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_plan_json_round_trips(plan: ExportPlan) -> None:
    assert ExportPlan.from_json(json.loads(plan.dumps())) == plan


def test_plan_json_rejects_unknown_fields_and_missing_model() -> None:
    with pytest.raises(SwitchyardError, match="unknown plan field"):
        ExportPlan.from_json({"engine": "vllm", "model": "x/y", "tensor_parallel": 2})
    with pytest.raises(SwitchyardError, match="lacks model"):
        ExportPlan.from_json({"engine": "vllm"})
    with pytest.raises(SwitchyardError, match="needs 4 GPUs per node"):
        ExportPlan(engine="vllm", model="x/y", tensor_parallel_size=4, gpu_count=2)


def test_from_launch_plan_keeps_the_serving_settings() -> None:
    local = LaunchPlan(engine="vllm", model_path=Path("/tmp/m"), ctx_per_request=4096, slots=16, dtype="bfloat16",
                       served_model_name="m", api_key="secret-not-exported", extra_args=("--enforce-eager",))
    plan = ExportPlan.from_launch_plan(local, model="org/model", tensor_parallel_size=2, tp_reason="r")
    assert (plan.model, plan.max_model_len, plan.max_num_seqs, plan.dtype) == ("org/model", 4096, 16, "bfloat16")
    assert plan.api_key_required and "secret-not-exported" not in plan.dumps()
    assert "secret-not-exported" not in "".join(export_plan(plan, fmt) for fmt in FORMATS)


def test_a_launch_plans_ot_rules_are_exported_as_typed_and_read_back_from_every_form() -> None:
    rule = r"blk\.(0|1)\.ffn_.*_exps\.weight=CPU,token_embd=CPU"
    local = LaunchPlan(engine="llama.cpp", model_path=Path("/tmp/m.gguf"), n_cpu_moe=2,
                       override_tensors=(rule, r"blk\.3\.=CPU"), extra_args=("--no-mmap",))
    assert LaunchPlan.from_json(json.loads(json.dumps(local.to_json()))) == local
    plan = ExportPlan.from_launch_plan(local, model="org/model")
    # one -ot, as launched here (llama-server warns about a repeated flag): the values joined as it splits them
    assert plan.extra_args[-5:] == ("--n-cpu-moe", "2", "-ot", rule + r",blk\.3\.=CPU", "--no-mmap")
    for fmt in ("shell", "docker", "compose", "k8s"):
        back = plan_from_export(export_plan(plan, fmt), fmt)
        assert back.extra_args == plan.extra_args, fmt


# --- every form reads back ------------------------------------------------------------------------------
ROUND_TRIPS = [(name, fmt) for name in PLANS for fmt in ("shell", "docker", "compose", "k8s", "ray")
               if not (fmt == "ray" and PLANS[name].engine != "vllm")]


@pytest.mark.parametrize(("name", "fmt"), ROUND_TRIPS)
def test_export_reads_back_into_the_same_plan(name: str, fmt: str) -> None:
    plan = PLANS[name]
    text = export_plan(plan, fmt)
    back = plan_from_export(text, fmt)
    if fmt in ("shell", "ray"):  # no image, name or cache volume in a plain command
        back = replace(back, image=plan.image, name=plan.name, cache_volume=plan.cache_volume)
    if fmt in ("docker", "compose"):
        back = replace(back, cache_volume=plan.cache_volume)
    if fmt == "k8s":  # a ClusterIP Service publishes on no host address
        back = replace(back, publish_host=plan.publish_host)
    assert back == plan


def test_shell_command_is_one_quoted_line_that_shlex_splits_back() -> None:
    text = export_plan(LOCAL_PLAN, "shell")
    command = [line for line in text.splitlines() if not line.startswith("#")]
    assert len(command) == 1
    assert shlex.split(command[0]) == shell_argv(LOCAL_PLAN)
    assert "'/srv/models/Qwen2.5-7B Instruct'" in command[0]


def test_docker_run_args_round_trip_and_keep_home_expandable() -> None:
    text = export_plan(VLLM_PLAN, "docker")
    line = text.splitlines()[-1]
    assert shlex.split(line.replace('"$HOME"', "$HOME")) == docker_run_argv(VLLM_PLAN)
    assert '"$HOME"/.cache/huggingface:/root/.cache/huggingface' in line
    argv = docker_run_argv(VLLM_PLAN)
    assert argv[argv.index("--gpus") + 1] == "4"
    assert argv[argv.index("-p") + 1] == "127.0.0.1:8000:8000"
    assert "VLLM_API_KEY" in argv and not any("VLLM_API_KEY=" in a for a in argv)


def test_llamacpp_uses_the_official_server_image_and_llama_server_flags() -> None:
    argv = docker_run_argv(LLAMA_PLAN)
    image_at = argv.index("ghcr.io/ggml-org/llama.cpp:server-cuda")
    args = argv[image_at + 1:]
    assert args[:2] == ["--hf-repo", LLAMA_PLAN.model]
    assert args[args.index("--ctx-size") + 1] == str(4096 * 4)  # per-slot context x slots
    assert "--metrics" in args and "--no-cache-prompt" in args
    cpu = replace(LLAMA_PLAN, image="ghcr.io/ggml-org/llama.cpp:server")
    assert "--gpus" not in docker_run_argv(cpu)


# --- real validators ------------------------------------------------------------------------------------
@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_compose_file_is_valid_against_the_compose_spec(plan: ExportPlan) -> None:
    document = yaml.safe_load(export_plan(plan, "compose"))
    # The spec's $schema names draft 2019-09 (with a non-canonical URL jsonschema does not recognise).
    jsonschema.Draft201909Validator.check_schema(COMPOSE_SCHEMA)
    errors = sorted(jsonschema.Draft201909Validator(COMPOSE_SCHEMA).iter_errors(document), key=str)
    assert not errors, [e.message for e in errors]


def test_the_compose_validator_is_not_vacuous() -> None:
    document = yaml.safe_load(export_plan(VLLM_PLAN, "compose"))
    document["services"]["llama3-70b"]["gpu_count"] = 4  # not a Compose key
    assert list(jsonschema.Draft201909Validator(COMPOSE_SCHEMA).iter_errors(document))


@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_kubernetes_manifests_validate_against_the_pinned_schemas(plan: ExportPlan) -> None:
    kinds = [d["kind"] for d in _k8s_validate(export_plan(plan, "k8s"))]
    expected = ["Deployment", "Service"] if plan.cache_volume == "hostPath" else \
        ["PersistentVolumeClaim", "Deployment", "Service"]
    assert kinds == expected


def test_kubernetes_validation_catches_a_broken_manifest() -> None:
    deployment = k8s_documents(VLLM_PLAN)[1]
    deployment["spec"]["template"]["spec"]["containers"][0]["gpus"] = 4
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_70b_k8s_manifest_requests_the_estimated_tp_and_states_why() -> None:
    choice = choose_for_target(gpu="H100", gpus=8, model_config=LLAMA3_70B, dtype="bfloat16")
    plan = ExportPlan(engine="vllm", model="meta-llama/Meta-Llama-3-70B-Instruct", gpu_count=8,
                      tensor_parallel_size=choice.tensor_parallel_size, tp_reason=choice.reason, dtype="bfloat16",
                      max_model_len=8192, gpu_name="NVIDIA H100 80GB HBM3")
    documents = _k8s_validate(export_plan(plan, "k8s"))
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "4"
    args = container["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert deployment["metadata"]["annotations"]["switchyard.dev/tensor-parallel-reason"] == choice.reason
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"].endswith("-model-cache")
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/dev/shm", "/root/.cache/huggingface"} <= mounts


def test_multi_node_plan_refuses_a_single_deployment_but_exports_ray_and_helm() -> None:
    plan = replace(VLLM_PLAN, tensor_parallel_size=8, pipeline_parallel_size=2, gpu_count=8)
    with pytest.raises(SwitchyardError, match="--format ray"):
        export_plan(plan, "k8s")
    script = export_plan(plan, "ray")
    bash = shutil.which("bash")
    assert bash
    subprocess.run([bash, "-n"], input=script, text=True, check=True)  # noqa: S603 - fixed argv
    serve = shlex.split(next(line for line in script.splitlines() if "exec vllm serve" in line).strip())
    assert serve[serve.index("--pipeline-parallel-size") + 1] == "2"
    assert serve[serve.index("--distributed-executor-backend") + 1] == "ray"
    assert "ray start --head" in script and 'ray start --address="$HEAD_IP:6379" --block' in script
    assert plan_from_export(script, "ray").pipeline_parallel_size == 2
    model = helm_values(plan)["servingEngineSpec"]["modelSpec"][0]
    assert model["raySpec"]["enabled"] is True and model["replicaCount"] == 1
    assert "--pipeline-parallel-size" in model["vllmConfig"]["extraArgs"]


def test_helm_values_for_the_production_stack() -> None:
    values = yaml.safe_load(export_plan(VLLM_PLAN, "helm"))
    spec = values["servingEngineSpec"]
    model = spec["modelSpec"][0]
    assert (model["repository"], model["tag"]) == ("vllm/vllm-openai", VLLM_PLAN.image.split(":")[1])
    assert model["modelURL"] == VLLM_PLAN.model and model["requestGPU"] == 4
    assert model["vllmConfig"]["tensorParallelSize"] == 4 and model["vllmConfig"]["maxModelLen"] == 8192
    assert model["vllmConfig"]["enablePrefixCaching"] is False
    assert spec["vllmApiKey"] == {"secretName": "llama3-70b-api-key", "secretKey": "api-key"}


@pytest.mark.parametrize("fmt", ["ray", "helm"])
def test_vllm_only_forms_refuse_llamacpp(fmt: str) -> None:
    with pytest.raises(SwitchyardError, match="for vLLM"):
        export_plan(LLAMA_PLAN, fmt)


# --- CLI --------------------------------------------------------------------------------------------------
def test_cli_sizes_the_70b_plan_and_prints_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA3_70B))
    plan_file = tmp_path / "plan.json"
    code = main(["export", "--engine", "vllm", "--model", "meta-llama/Meta-Llama-3-70B-Instruct",
                 "--model-config", str(config), "--gpu", "H100", "--gpus", "8", "--dtype", "bfloat16",
                 "--format", "k8s", "--save-plan", str(plan_file)])
    out, err = capsys.readouterr()
    assert code == 0
    assert "switchyard: tensor parallel 4:" in err
    deployment = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    saved = ExportPlan.load(plan_file)
    assert (saved.tensor_parallel_size, saved.gpu_count, saved.gpu_name) == (4, 8, "NVIDIA H100 80GB HBM3")

    out_file = tmp_path / "compose.yaml"
    assert main(["export", str(plan_file), "--format", "compose", "--out", str(out_file)]) == 0
    assert plan_from_export(out_file.read_text(), "compose") == saved
    assert main(["export", str(plan_file), "--format", "compose", "--out", str(out_file)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_cli_errors_are_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "--engine", "vllm", "--model", "x/y", "--gpus", "4"]) == 2
    assert "--gpus alone cannot size the plan" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "missing.json")]) == 2
    assert "plan file not found" in capsys.readouterr().err
    assert main(["export", "--engine", "vllm", "--model", "x/y", "--gpu", "H100", "--gpus", "2"]) == 2
    err = capsys.readouterr().err
    assert "cannot size the model" in err and "Traceback" not in err
