"""Hardware snapshots: detection degrades cleanly, recorded machines round-trip, hypothetical GPUs, the GPU table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from desktop.core.common.errors import SwitchyardError
from desktop.core.machine import hardware
from desktop.core.machine.gpu_catalog import GPU_TABLE, find_gpu, require_gpu
from desktop.core.machine.hardware import GIB, HardwareSnapshot, detect, hypothetical

SNAPSHOTS = sorted((Path(__file__).parent / "snapshots").glob("*.json"))


def load(name: str) -> HardwareSnapshot:
    return HardwareSnapshot.load(Path(__file__).parent / "snapshots" / f"{name}.json")


def test_all_seven_recorded_machines_are_present() -> None:
    names = {p.stem for p in SNAPSHOTS}
    assert {"h100_80gb", "a100_40gb", "rtx4090", "rtx3090", "rtx4060_8gb", "m2max_32gb", "cpu_laptop"} <= names


@pytest.mark.parametrize("path", SNAPSHOTS, ids=[p.stem for p in SNAPSHOTS])
def test_snapshots_round_trip_through_json(path: Path) -> None:
    raw = json.loads(path.read_text())
    snapshot = HardwareSnapshot.from_json(raw)
    assert snapshot.to_json() == raw
    assert HardwareSnapshot.from_json(snapshot.dumps()) == snapshot


def test_detect_on_this_machine_serializes_and_explains_missing_gpus() -> None:
    snapshot = detect()
    assert snapshot.ram_total_bytes > 0 and snapshot.cpu.logical_cores >= 1
    assert HardwareSnapshot.from_json(snapshot.dumps()) == snapshot
    if not snapshot.gpus:
        assert any("none found" in note or "no GPU" in note for note in snapshot.notes)


def test_missing_nvml_degrades_to_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    import pynvml

    def broken() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", broken)
    notes: list[str] = []
    assert hardware._probe_nvidia(notes) == []
    assert notes and notes[0].startswith("NVIDIA: none found")


def test_nvml_readings_including_other_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    import pynvml

    calls = {
        "nvmlInit": lambda: None, "nvmlShutdown": lambda: None, "nvmlSystemGetDriverVersion": lambda: "550.1",
        "nvmlSystemGetCudaDriverVersion": lambda: 12040, "nvmlDeviceGetCount": lambda: 1,
        "nvmlDeviceGetHandleByIndex": lambda i: i, "nvmlDeviceGetName": lambda h: b"NVIDIA GeForce RTX 4090",
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=24 * GIB, free=20 * GIB, used=4 * GIB),
        "nvmlDeviceGetCudaComputeCapability": lambda h: (8, 9),
        "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=37),
        "nvmlDeviceGetComputeRunningProcesses": lambda h: [SimpleNamespace(pid=1, usedGpuMemory=3 * GIB)],
    }
    for name, fn in calls.items():
        monkeypatch.setattr(pynvml, name, fn)
    [gpu] = hardware._probe_nvidia([])
    assert (gpu.name, gpu.compute_capability, gpu.cuda_version) == ("NVIDIA GeForce RTX 4090", "8.9", "12.4")
    assert gpu.memory_free_bytes == 20 * GIB and gpu.other_processes_bytes == 3 * GIB
    assert gpu.utilization_percent == 37.0


def test_impossible_memory_is_rejected() -> None:
    raw = json.loads((Path(__file__).parent / "snapshots" / "rtx4090.json").read_text())
    raw["gpus"][0]["memory_free_bytes"] = -1
    with pytest.raises(SwitchyardError, match="impossible"):
        HardwareSnapshot.from_json(raw)
    raw = json.loads((Path(__file__).parent / "snapshots" / "cpu_laptop.json").read_text())
    raw["ram_available_bytes"] = -5
    with pytest.raises(SwitchyardError, match="negative"):
        HardwareSnapshot.from_json(raw)
    with pytest.raises(SwitchyardError, match="not a hardware snapshot"):
        HardwareSnapshot.from_json({"gpus": []})


def test_hypothetical_gpus_from_the_table_or_a_size() -> None:
    base = load("cpu_laptop")
    two = hypothetical(base, gpu_name="H100", gpu_count=2)
    assert [g.name for g in two.gpus] == ["NVIDIA H100 80GB HBM3"] * 2
    assert all(g.memory_free_bytes == g.memory_total_bytes for g in two.gpus)
    assert two.ram_total_bytes == base.ram_total_bytes
    sized = hypothetical(base, gpu_mem_gib=48)
    assert sized.gpus[0].memory_total_bytes == 48 * GIB
    with pytest.raises(SwitchyardError):
        hypothetical(base, gpu_mem_gib=-3)
    with pytest.raises(SwitchyardError, match="unknown GPU"):
        hypothetical(base, gpu_name="Voodoo 2")


def test_gpu_table_lookup() -> None:
    assert find_gpu("NVIDIA GeForce RTX 4060 Ti 16GB") is not None
    assert require_gpu("rtx 4060 ti").memory_gib == 16
    assert require_gpu("4060").memory_gib == 8
    assert require_gpu("a100 40gb").memory_gib == 40 and require_gpu("A100").memory_gib == 80
    assert all(s.bf16_tflops > 0 and s.bandwidth_gbs > 0 for s in GPU_TABLE)


def test_cli_detect_json() -> None:
    out = subprocess.run([sys.executable, "-m", "desktop", "detect", "--json"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {"gpus", "cpu", "ram_total_bytes", "ram_available_bytes", "disk_free_bytes", "os", "notes"} <= set(data)
