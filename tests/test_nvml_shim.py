"""The real NVML path on a machine without an NVIDIA GPU: a stand-in libnvidia-ml.so.1 (tests/fixtures/nvml,
compiled here with cc) answers pynvml for an RTX 4090 with 20 of 24 GiB free, so `detect --json` ->
`recommend` -> `serve --dry-run` runs end to end through hardware.py's pynvml calls, in subprocesses that find the
shim through LD_LIBRARY_PATH (pynvml dlopens "libnvidia-ml.so.1")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from desktop.core.machine.hardware import GIB

HERE = Path(__file__).parent
SHIM = HERE / "fixtures" / "nvml" / "nvml_shim.c"
GGUF = HERE / "fixtures" / "models" / "llama8b-q4_k_m.gguf"
HF_8B = HERE / "fixtures" / "models" / "llama8b-bf16"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the shim is an ELF shared library")


@pytest.fixture(scope="module")
def shim_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the NVML stand-in")
    out = tmp_path_factory.mktemp("nvml")
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(out / "libnvidia-ml.so.1"), str(SHIM)],
                   check=True, capture_output=True, timeout=120)
    return out


def cli(shim: Path, *args: str, knobs: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # its own SWITCHYARD_HOME: runs other tests recorded (a CPU A/B) must not steer this GPU's recommendation
    env = {**os.environ, "LD_LIBRARY_PATH": str(shim), "PYTHONPATH": str(HERE.parent),
           "SWITCHYARD_HOME": str(shim / "home"), **(knobs or {})}
    return subprocess.run([sys.executable, "-m", "desktop", *args], capture_output=True, text=True, timeout=300,
                          env=env, check=False)


def cli_json(shim: Path, *args: str, knobs: dict[str, str] | None = None) -> Any:
    out = cli(shim, *args, knobs=knobs)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_detect_reads_the_gpu_through_pynvml(shim_dir: Path) -> None:
    snapshot = cli_json(shim_dir, "detect", "--json")
    [gpu] = [g for g in snapshot["gpus"] if g["vendor"] == "nvidia"]
    assert gpu["name"] == "NVIDIA GeForce RTX 4090" and gpu["backend"] == "cuda"
    assert gpu["memory_total_bytes"] == 24 * GIB and gpu["memory_free_bytes"] == 20 * GIB
    assert gpu["other_processes_bytes"] == 3.5 * GIB and gpu["compute_capability"] == "8.9"
    assert gpu["cuda_version"] == "12.4" and gpu["driver_version"] == "550.127.05"
    assert gpu["uuid"].startswith("GPU-") and "mig" not in gpu  # a whole card


# --- the shim's knobs: driver level, MIG, several GPUs (issue 22) ---------------------------------------------------

def test_several_gpus_each_with_its_uuid_in_nvml_order(shim_dir: Path) -> None:
    snapshot = cli_json(shim_dir, "detect", "--json", knobs={"NVML_SHIM_GPUS": "3060,4090"})
    gpus = [g for g in snapshot["gpus"] if g["vendor"] == "nvidia"]
    assert [g["name"] for g in gpus] == ["NVIDIA GeForce RTX 3060", "NVIDIA GeForce RTX 4090"]
    assert [g["compute_capability"] for g in gpus] == ["8.6", "8.9"]
    assert len({g["uuid"] for g in gpus}) == 2
    assert any("CUDA_VISIBLE_DEVICES" in note and "UUID" in note for note in snapshot["notes"])


def test_a_gpu_whose_calls_fail_is_skipped_and_the_others_kept(shim_dir: Path) -> None:
    snapshot = cli_json(shim_dir, "detect", "--json", knobs={"NVML_SHIM_GPUS": "3060,4090", "NVML_SHIM_BROKEN": "0"})
    assert [g["name"] for g in snapshot["gpus"] if g["vendor"] == "nvidia"] == ["NVIDIA GeForce RTX 4090"]
    assert any("GPU 0 skipped" in note for note in snapshot["notes"])


@pytest.mark.parametrize("root", [True, False])
def test_mig_instances_are_devices_with_their_own_memory(shim_dir: Path, root: bool) -> None:
    """Without root NVML refuses the parent's memory in MIG mode; with root it would give the whole card."""
    knobs = {"NVML_SHIM_GPUS": "a100,4090", "NVML_SHIM_MIG": "2", **({} if root else {"NVML_SHIM_NOROOT": "1"})}
    snapshot = cli_json(shim_dir, "detect", "--json", knobs=knobs)
    gpus = [g for g in snapshot["gpus"] if g["vendor"] == "nvidia"]
    migs = [g for g in gpus if g.get("mig")]
    assert len(migs) == 2 and all(g["memory_total_bytes"] < 10 * GIB for g in migs)
    assert all(g["uuid"].startswith("MIG-") and "MIG 1g.10gb" in g["name"] for g in migs)
    assert gpus[-1]["name"] == "NVIDIA GeForce RTX 4090"  # the GPU after the MIG card is still there
    rec = cli_json(shim_dir, "recommend", str(HF_8B), "--concurrency", "1", "--json", knobs=knobs)
    pinned = rec["plan"]["env"].get("CUDA_VISIBLE_DEVICES")
    assert pinned is None or pinned in {g["uuid"] for g in gpus}  # one device: CUDA enumerates one MIG instance


@pytest.mark.parametrize(("driver", "cuda", "build"), [("550.127.05", "12040", "cu129"), ("580.95.05", "13000", "cu130")])
def test_the_vllm_build_follows_the_live_driver(shim_dir: Path, driver: str, cuda: str, build: str) -> None:
    knobs = {"NVML_SHIM_DRIVER": driver, "NVML_SHIM_CUDA": cuda}
    [choice] = cli_json(shim_dir, "engines", "install", "vllm", "--dry-run", "--json", knobs=knobs)
    assert choice["cuda_build"] == build and driver in choice["reason"]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_recommend_then_dry_run_launch_what_the_fit_checked(shim_dir: Path, tmp_path: Path) -> None:
    """detect -> recommend -> serve --dry-run: -ngl is the fit's layer count, on the CUDA build."""
    snapshot = tmp_path / "machine.json"
    snapshot.write_text(cli(shim_dir, "detect", "--json").stdout)
    for hardware in ((), ("--hardware", str(snapshot))):  # the live pynvml path, and its recorded snapshot
        rec = cli_json(shim_dir, "recommend", str(GGUF), "--concurrency", "4", "--json", *hardware)
        assert rec["engine"] == "llama.cpp"
        plan = rec["plan"]
        # a GPU build: CUDA where nvcc can compile it, else llama.cpp's prebuilt Vulkan build
        assert plan["backend"] in ("cuda", "vulkan") and plan["gpu_layers"] == rec["fit"]["gpu_layers"] == 33
        assert _flag(rec["argv"], "--n-gpu-layers") == "33"
        dry = cli_json(shim_dir, "serve", "--engine", "llama.cpp", "--model", str(GGUF), "--ctx",
                       str(plan["ctx_per_request"]), "--parallel", str(plan["slots"]), "--dry-run", "--json", *hardware)
        assert dry["plan"]["gpu_layers"] == dry["fit"]["gpu_layers"] == plan["gpu_layers"]
        assert _flag(dry["argv"], "--n-gpu-layers") == str(plan["gpu_layers"])
        assert _flag(dry["argv"], "--ctx-size") == str(plan["ctx_per_request"] * plan["slots"])
        assert dry["plan"]["backend"] == plan["backend"] and dry["fit"]["device"] == "1x NVIDIA GeForce RTX 4090"


@pytest.mark.parametrize("model", [str(HF_8B), "demo"])
def test_vllm_plans_on_the_gpu_take_the_checkpoints_dtype(shim_dir: Path, model: str) -> None:
    """vLLM's plan asks for the GPU memory that is free (3.5 GiB are held by another process: 0.82, not 0.9)."""
    rec = cli_json(shim_dir, "recommend", model, "--concurrency", "8", "--lifetime-hours", "48", "--json")
    assert rec["engine"] == "vllm" and rec["fit"]["fits"] == "yes"
    assert "float32" not in rec["argv"] and _flag(rec["argv"], "--dtype") == "auto"
    util = rec["plan"]["gpu_memory_utilization"]
    assert util == 0.82 and _flag(rec["argv"], "--gpu-memory-utilization") == str(util)
    # without --util the planner asks vLLM for what is free (vLLM V1 refuses to start below total x util free)
    planned = cli_json(shim_dir, "serve", "--engine", "vllm", "--model", model, "--dry-run", "--json")
    assert _flag(planned["argv"], "--gpu-memory-utilization") == str(util)
    refused = cli(shim_dir, "serve", "--engine", "vllm", "--model", model, "--util", "0.9", "--dry-run", "--json")
    assert refused.returncode != 0 and "switchyard: hint: pass --util 0.82" in refused.stderr
    dry = cli_json(shim_dir, "serve", "--engine", "vllm", "--model", model, "--ctx", "4096", "--parallel", "8",
                   "--util", str(util), "--dry-run", "--json")
    argv = dry["argv"]
    assert _flag(argv, "--dtype") == "auto" and "float32" not in argv
    assert _flag(argv, "--gpu-memory-utilization") == str(util) and _flag(argv, "--max-model-len") == "4096"
    assert dry["plan"]["backend"] == "cuda" and dry["fit"]["fits"] == "yes"


def test_a_plan_that_does_not_fit_is_one_clear_line(shim_dir: Path) -> None:
    out = cli(shim_dir, "serve", "--engine", "llama.cpp", "--model", str(GGUF), "--ctx", "131072", "--parallel", "8",
              "--gpu-layers", "33", "--dry-run", "--json")
    assert out.returncode != 0 and out.stdout == ""
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("switchyard: error:") and "does not fit" in lines[0] and "Traceback" not in out.stderr
    assert lines[1].startswith("switchyard: hint:")


def test_gpu_telemetry_reads_through_pynvml(shim_dir: Path) -> None:
    code = ("import json; from desktop.core.runtime.telemetry import GpuSampler; s = GpuSampler(); "
            "print(json.dumps({'unavailable': s.unavailable, "
            "'samples': {x.series: x.value for x in s.sample_once(0.0)}}))")
    env = {**os.environ, "LD_LIBRARY_PATH": str(shim_dir), "PYTHONPATH": str(HERE.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         check=False)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["unavailable"] is None
    assert data["samples"] == {"gpu_util": 7.0, "gpu_mem_used_bytes": 4.0 * GIB, "gpu_power_w": 61.0,
                               "gpu_temp_c": 44.0}
