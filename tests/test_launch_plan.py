"""One launch plan end to end: per-request context and slots stated once, dtype auto, what the fit resolves
(-ngl, KV type, utilization, TP) reaching argv and export, the dry runs, the shared vLLM sizing of recommend and
export, and bad input as one clear line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from desktop.core.engines import get_adapter
from desktop.core.engines.base import EngineInstall, LaunchPlan, llama_ctx_size
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.models.facts import facts_for
from desktop.core.planning.export import ExportPlan, engine_args
from desktop.core.planning.fit import estimate, launch_dtype
from desktop.core.planning.recommend import Workload, recommend

HERE = Path(__file__).parent
SNAP = HERE / "snapshots"
MODELS = HERE / "fixtures" / "models"
GGUF = MODELS / "llama8b-q4_k_m.gguf"
HF_70B = MODELS / "llama70b-bf16"
INSTALL = EngineInstall("llama.cpp", "t", "cache", Path("/opt/llama-server"))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "desktop", *args], capture_output=True, text=True, timeout=300,
                          check=False)


def cli_json(*args: str) -> Any:
    out = run_cli(*args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_context_is_per_request_and_multiplied_once() -> None:
    plan = LaunchPlan("llama.cpp", GGUF, ctx_per_request=2048, slots=8)
    argv = get_adapter("llama.cpp").build_command(plan, INSTALL).argv
    assert argv[argv.index("--ctx-size") + 1] == "16384" == str(llama_ctx_size(2048, 8))
    exported = ExportPlan.from_launch_plan(plan, model="org/model-GGUF")
    assert exported.max_model_len == 2048 and exported.max_num_seqs == 8
    args = engine_args(exported, bind_host="0.0.0.0")
    assert args[args.index("--ctx-size") + 1] == "16384"


def test_dtype_is_auto_except_the_demo_on_vllms_cpu_backend() -> None:
    assert LaunchPlan("vllm", Path("m")).dtype == "auto"
    assert launch_dtype("vllm", demo=True, cuda=False) == "float32"
    assert launch_dtype("vllm", demo=True, cuda=True) == "auto"
    assert launch_dtype("llama.cpp", demo=True, cuda=False) == "auto"
    assert launch_dtype("vllm", demo=False, cuda=False) == "auto"
    # the planner's plan: the checkpoint's own dtype for a real model on vLLM's CPU backend too
    from dataclasses import replace

    from desktop.core.planning.planner import plan_launch

    cpu = HardwareSnapshot.load(SNAP / "cpu_laptop.json")
    cpu = replace(cpu, ram_total_bytes=128 * 2**30, ram_available_bytes=100 * 2**30)
    assert plan_launch("vllm", str(MODELS / "llama8b-bf16"), cpu, {"ctx_per_request": 512, "slots": 1}
                       ).plan.dtype in ("auto", "bfloat16")


def test_the_fit_returns_the_plan_it_checked_and_argv_carries_it() -> None:
    hw = HardwareSnapshot.load(SNAP / "h100_80gb.json")
    facts = facts_for(str(MODELS / "llama8b-bf16"))
    result = estimate(facts, hw, LaunchPlan("vllm", MODELS / "llama8b-bf16", ctx_per_request=8192, slots=64,
                                            kv_cache_type="fp8"), quant="fp8")
    plan = result.plan
    assert plan is not None and plan.quantization == "fp8" and plan.gpu_memory_utilization == 0.9
    assert plan.max_num_batched_tokens == result.settings["max_num_batched_tokens"] and plan.backend == "cuda"
    argv = get_adapter("vllm").build_command(plan, EngineInstall("vllm", "t", "cache", Path("/py"))).argv
    for flag, value in (("--quantization", "fp8"), ("--kv-cache-dtype", "fp8"), ("--max-model-len", "8192"),
                        ("--max-num-seqs", "64"), ("--gpu-memory-utilization", "0.9"), ("--dtype", "auto")):
        assert argv[argv.index(flag) + 1] == value, flag
    exported = ExportPlan.from_launch_plan(plan, model="meta-llama/Llama-3.1-8B-Instruct")
    assert exported.quantization == "fp8" and "--kv-cache-dtype" in exported.extra_args


def test_the_recommend_page_plan_is_what_the_serve_dry_run_launches() -> None:
    """recommend --json and serve --dry-run on the same snapshot: the same -ngl, KV type and context."""
    rec = cli_json("recommend", str(GGUF), "--concurrency", "4", "--hardware", str(SNAP / "rtx4060_8gb.json"),
                   "--json")
    plan = rec["plan"]
    assert rec["engine"] == "llama.cpp" and plan["gpu_layers"] == rec["fit"]["gpu_layers"]
    assert {"argv", "env", "fit"} <= set(rec) and rec["env"]["LD_LIBRARY_PATH"]
    dry = cli_json("serve", "--engine", "llama.cpp", "--model", str(GGUF), "--ctx", str(plan["ctx_per_request"]),
                   "--parallel", str(plan["slots"]), "--hardware", str(SNAP / "rtx4060_8gb.json"), "--dry-run",
                   "--json")
    assert dry["plan"]["gpu_layers"] == plan["gpu_layers"] and dry["plan"]["kv_cache_type"] == plan["kv_cache_type"]
    assert dry["argv"][1:] == rec["argv"][1:]
    assert {"weights_gib", "kv_cache_gib", "total_gib", "available_gib", "breakdown"} <= set(dry["fit"])


def test_serve_dry_run_text_output() -> None:
    out = run_cli("serve", "--engine", "llama.cpp", "--model", str(GGUF), "--hardware", str(SNAP / "rtx4090.json"),
                  "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "--n-gpu-layers 33" in out.stdout and "fits: yes" in out.stdout


def test_70b_on_8_h100s_is_sized_by_tensor_parallelism_the_same_in_recommend_and_export() -> None:
    rec = cli_json("recommend", str(HF_70B), "--gpu", "H100", "--gpus", "8", "--concurrency", "32", "--json",
                   "--hardware", str(SNAP / "cpu_laptop.json"))
    plan = rec["plan"]
    assert rec["engine"] == "vllm" and rec["quant"] in ("bf16", "fp8")
    assert plan["tensor_parallel"] >= 2 and rec["fit"]["max_concurrency"] >= 32
    assert rec["argv"][rec["argv"].index("--tensor-parallel-size") + 1] == str(plan["tensor_parallel"])
    exported = cli_json("export", "--engine", "vllm", "--model", "meta-llama/Llama-3.3-70B-Instruct", "--gpu", "H100",
                        "--gpus", "8", "--model-config", str(HF_70B / "config.json"), "--max-model-len",
                        str(plan["ctx_per_request"]), "--concurrency", "32", "--json")
    assert exported["plan"]["tensor_parallel_size"] == plan["tensor_parallel"]


def test_recommend_and_export_share_the_sizing_function_in_process() -> None:
    base = HardwareSnapshot.load(SNAP / "cpu_laptop.json")
    from desktop.core.machine.gpu_catalog import require_gpu
    from desktop.core.machine.hardware import hypothetical
    from desktop.core.planning.export import choose_for_target

    config = json.loads((HF_70B / "config.json").read_text())
    for concurrency in (8, 32, 96):
        rec = recommend(facts_for(str(HF_70B)), hypothetical(base, gpu_name="H100", gpu_count=8),
                        Workload(concurrency=concurrency))
        choice = choose_for_target(gpu=require_gpu("H100").name, gpus=8, model_config=config,
                                   max_model_len=rec.plan.ctx_per_request, concurrency=concurrency)
        assert rec.quant == "bf16" and choice.tensor_parallel_size == rec.plan.tensor_parallel
        assert rec.fit is not None and (rec.fit.max_concurrency or 0) >= concurrency


@pytest.mark.parametrize("args, message", [
    (("--engine", "llama.cpp", "--model", "GGUF", "--ctx", "0"), "argument --ctx: must be at least 1"),
    (("--engine", "llama.cpp", "--model", "GGUF", "--ctx", "1000000000"), "context length 1000000000 is out of range"),
    (("--engine", "llama.cpp", "--model", "GGUF", "--parallel", "0"), "argument --parallel: must be at least 1"),
    (("--engine", "llama.cpp", "--model", "GGUF", "--kv-type", "q9_9"), "unknown KV cache type"),
    (("--engine", "vllm", "--model", "HF70B", "--util", "1.5"), "argument --util: must be at most 1"),
    (("--engine", "vllm", "--model", "HF70B", "--dtype", "float128"), "unknown dtype"),
    (("--engine", "tgi", "--model", "GGUF"), "unknown engine"),
    (("--engine", "llama.cpp", "--model", "/nonexistent.gguf"), "does not exist"),
    (("--engine", "vllm", "--model", "GGUF"), "needs a Hugging Face model folder"),
    (("--engine", "vllm", "--model", "HF70B", "--tp", "2"), "needs 2 GPUs"),
    (("--engine", "vllm", "--model", "HF70B"), "does not fit"),  # 131 GiB of bf16 on one 24 GB card
    (("--engine", "llama.cpp", "--model", "GGUF", "--ctx", "131072", "--parallel", "16", "--gpu-layers", "33"),
     "does not fit"),
])
def test_serve_dry_run_bad_input_is_one_clear_line(args: tuple[str, ...], message: str) -> None:
    argv = [str(GGUF) if a == "GGUF" else str(HF_70B) if a == "HF70B" else a for a in args]
    out = run_cli("serve", *argv, "--hardware", str(SNAP / "rtx4090.json"), "--dry-run", "--json")
    assert out.returncode != 0 and out.stdout == ""
    assert "Traceback" not in out.stderr and message in out.stderr.splitlines()[0], out.stderr


def test_serve_refuses_a_snapshot_that_is_not_one(tmp_path: Path) -> None:
    bad = tmp_path / "snap.json"
    bad.write_text("{}")
    out = run_cli("serve", "--engine", "llama.cpp", "--model", str(GGUF), "--hardware", str(bad), "--dry-run")
    assert out.returncode != 0 and "not a hardware snapshot" in out.stderr and "Traceback" not in out.stderr
