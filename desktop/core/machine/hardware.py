"""What this machine can run models on: GPUs (NVIDIA via NVML, AMD via amdsmi/rocm-smi, Apple Silicon), CPU
features, RAM, free disk where models live, and the OS.

Every probe is optional: a missing library or driver becomes "none found" plus a note saying why, never an
exception. Snapshots serialize to JSON so tests (and bug reports) can replay any machine.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil

from desktop.core.common.errors import SwitchyardError

log = logging.getLogger("switchyard.hardware")

GIB = 1024**3
MIB = 1024**2
SNAPSHOT_VERSION = 1


@dataclass(frozen=True)
class GpuInfo:
    """One accelerator. Memory in bytes as the driver reports it; `free` is what a new process can get now."""

    index: int
    name: str
    vendor: str  # nvidia | amd | apple | intel
    backend: str  # cuda | rocm | metal | sycl | vulkan
    memory_total_bytes: int
    memory_free_bytes: int
    memory_used_bytes: int = 0
    other_processes_bytes: int = 0  # used by processes other than ours (other apps, a running engine)
    compute_capability: str | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    utilization_percent: float | None = None
    unified_memory: bool = False  # Apple Silicon: GPU memory is the system RAM
    uuid: str | None = None  # NVML's GPU-... / MIG-... id: what CUDA_VISIBLE_DEVICES pins (NVML order is not CUDA's)
    mig: bool = False  # a MIG instance: its own device with its own memory, not the whole card
    rocm_runtime: str | None = None  # AMD: the ROCm runtime version found ("7.2.1"), None when it is not installed
    vulkan: bool | None = None  # a Vulkan loader and ICD were found (None: not checked)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key, unset in _OPTIONAL_GPU_FIELDS.items():  # snapshots recorded before these fields stay as they were
            if data.get(key) == unset:
                del data[key]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GpuInfo:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


_OPTIONAL_GPU_FIELDS: dict[str, Any] = {"uuid": None, "mig": False, "rocm_runtime": None, "vulkan": None}


@dataclass(frozen=True)
class CpuInfo:
    model: str
    arch: str
    physical_cores: int
    logical_cores: int
    avx2: bool = False
    avx512: bool = False
    amx: bool = False
    neon: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class HardwareSnapshot:
    gpus: list[GpuInfo]
    cpu: CpuInfo
    ram_total_bytes: int
    ram_available_bytes: int
    disk_free_bytes: int | None
    os: str
    models_dir: str | None = None
    notes: list[str] = field(default_factory=list)
    label: str | None = None  # e.g. "RTX 4090 workstation" for recorded snapshots
    # Compilers a llama.cpp source build needs (cmake, cxx, nvcc, hipcc, glslc -> path or None), found by
    # `detect` so the fit stays a pure function of (facts, snapshot, plan); a recorded snapshot without them
    # assumes none (the prebuilt builds).
    toolchain: dict[str, str | None] = field(default_factory=dict)

    # --- derived views ------------------------------------------------------------------------------
    @property
    def cuda_gpus(self) -> list[GpuInfo]:
        """GPUs vLLM can use (CUDA or ROCm)."""
        return [g for g in self.gpus if g.backend in ("cuda", "rocm")]

    @property
    def has_unified_memory(self) -> bool:
        return any(g.unified_memory for g in self.gpus)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": SNAPSHOT_VERSION,
            "label": self.label,
            "gpus": [g.to_json() for g in self.gpus],
            "cpu": self.cpu.to_json(),
            "ram_total_bytes": self.ram_total_bytes,
            "ram_available_bytes": self.ram_available_bytes,
            "disk_free_bytes": self.disk_free_bytes,
            "models_dir": self.models_dir,
            "os": self.os,
            "notes": list(self.notes),
            **({"toolchain": dict(self.toolchain)} if self.toolchain else {}),  # recorded snapshots have none
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    @classmethod
    def from_json(cls, data: dict[str, Any] | str) -> HardwareSnapshot:
        """Rebuild a snapshot from `to_json()` output (a dict or its JSON text)."""
        try:
            raw: Any = json.loads(data) if isinstance(data, str) else data
            cpu_raw: dict[str, Any] = dict(raw.get("cpu") or {})
            cpu = CpuInfo(
                model=str(cpu_raw.get("model", "unknown")),
                arch=str(cpu_raw.get("arch", "unknown")),
                physical_cores=int(cpu_raw.get("physical_cores", 1)),
                logical_cores=int(cpu_raw.get("logical_cores", cpu_raw.get("physical_cores", 1))),
                avx2=bool(cpu_raw.get("avx2", False)),
                avx512=bool(cpu_raw.get("avx512", False)),
                amx=bool(cpu_raw.get("amx", False)),
                neon=bool(cpu_raw.get("neon", False)),
            )
            snapshot = cls(
                gpus=[GpuInfo.from_json(g) for g in raw.get("gpus", [])],
                cpu=cpu,
                ram_total_bytes=int(raw["ram_total_bytes"]),
                ram_available_bytes=int(raw["ram_available_bytes"]),
                disk_free_bytes=None if raw.get("disk_free_bytes") is None else int(raw["disk_free_bytes"]),
                os=str(raw.get("os", "unknown")),
                models_dir=raw.get("models_dir"),
                notes=[str(n) for n in raw.get("notes", [])],
                label=raw.get("label"),
                toolchain={str(k): (None if v is None else str(v)) for k, v in dict(raw.get("toolchain") or {}).items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SwitchyardError(f"not a hardware snapshot: {exc}", "pass the output of `switchyard detect --json`") from exc
        validate(snapshot)
        return snapshot

    @classmethod
    def load(cls, path: str | Path) -> HardwareSnapshot:
        try:
            return cls.from_json(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise SwitchyardError(f"cannot read hardware snapshot {path}: {exc.strerror}") from exc


def validate(snapshot: HardwareSnapshot) -> None:
    """Reject impossible numbers (negative memory, free above total) with a clear error."""
    if snapshot.ram_total_bytes < 0 or snapshot.ram_available_bytes < 0:
        raise SwitchyardError("memory sizes cannot be negative", "check the snapshot's ram_* fields")
    for gpu in snapshot.gpus:
        if gpu.memory_total_bytes <= 0 or gpu.memory_free_bytes < 0 or gpu.memory_used_bytes < 0:
            raise SwitchyardError(f"GPU {gpu.index} ({gpu.name}) reports impossible memory sizes",
                                  "GPU memory must be positive and free memory cannot be negative")
        if gpu.memory_free_bytes > gpu.memory_total_bytes:
            raise SwitchyardError(f"GPU {gpu.index} ({gpu.name}) has more free than total memory")


# --- probes ---------------------------------------------------------------------------------------------

def _probe_nvidia(notes: list[str]) -> list[GpuInfo]:
    """Every NVIDIA GPU NVML lists, in NVML's (PCI) order, each with its UUID; a GPU in MIG mode becomes one
    device per MIG instance with that instance's own memory (the parent's memory call returns the whole card as
    root and fails without root). A GPU whose calls fail is skipped with a note; the others are kept."""
    try:
        import pynvml
    except ImportError:
        notes.append("NVIDIA: none found (nvidia-ml-py is not installed)")
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        notes.append(f"NVIDIA: none found (NVML unavailable: {exc}; no NVIDIA driver?)")
        return []
    gpus: list[GpuInfo] = []
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        try:
            cuda_raw = int(pynvml.nvmlSystemGetCudaDriverVersion())
            cuda = f"{cuda_raw // 1000}.{(cuda_raw % 1000) // 10}"
        except pynvml.NVMLError:
            cuda = None
        count = int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError as exc:
        notes.append(f"NVIDIA: probing failed ({exc})")
        count, driver, cuda = 0, None, None
    own_pid = os.getpid()
    for index in range(count):
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpus += _nvml_devices(pynvml, handle, index, driver, cuda, own_pid, notes)
        except pynvml.NVMLError as exc:
            notes.append(f"NVIDIA: GPU {index} skipped ({exc})")
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        pass
    if not gpus and count == 0:
        notes.append("NVIDIA: driver present but NVML lists no GPUs")
    if len(gpus) > 1:
        notes.append("NVIDIA: GPUs listed in NVML (PCI) order; CUDA numbers them fastest first, so plans pin "
                     "the GPUs they sized by UUID (CUDA_VISIBLE_DEVICES)")
    return gpus


def _nvml_devices(pynvml: Any, handle: Any, index: int, driver: str | None, cuda: str | None, own_pid: int,
                  notes: list[str]) -> list[GpuInfo]:
    """One GPU, or its MIG instances when MIG mode is on."""
    name = _text(pynvml.nvmlDeviceGetName(handle))
    try:
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        capability: str | None = f"{major}.{minor}"
    except pynvml.NVMLError:
        capability = None
    uuid = _nvml_uuid(pynvml, handle)
    try:
        mig_on = int(pynvml.nvmlDeviceGetMigMode(handle)[0]) == 1
    except (pynvml.NVMLError, AttributeError):
        mig_on = False
    if mig_on:
        slices: list[GpuInfo] = []
        try:
            most = int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))
        except pynvml.NVMLError:
            most = 0
        for slot in range(most):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                memory = pynvml.nvmlDeviceGetMemoryInfo(mig)
                mig_name = _text(pynvml.nvmlDeviceGetName(mig))
            except pynvml.NVMLError:
                continue  # no instance in this slot
            slices.append(GpuInfo(
                index=index, name=mig_name if "MIG" in mig_name else f"{name} MIG", vendor="nvidia", backend="cuda",
                memory_total_bytes=int(memory.total), memory_free_bytes=int(memory.free),
                memory_used_bytes=int(memory.used), compute_capability=capability, driver_version=driver,
                cuda_version=cuda, uuid=_nvml_uuid(pynvml, mig), mig=True))
        if not slices:
            notes.append(f"NVIDIA: GPU {index} ({name}) is in MIG mode with no MIG instance visible to this user")
        return slices
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        utilization: float | None = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except pynvml.NVMLError:
        utilization = None
    others = 0
    try:
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid != own_pid and proc.usedGpuMemory:
                others += int(proc.usedGpuMemory)
    except pynvml.NVMLError:
        others = int(memory.used)
    return [GpuInfo(
        index=index, name=name, vendor="nvidia", backend="cuda",
        memory_total_bytes=int(memory.total), memory_free_bytes=int(memory.free),
        memory_used_bytes=int(memory.used), other_processes_bytes=others,
        compute_capability=capability, driver_version=driver, cuda_version=cuda,
        utilization_percent=utilization, uuid=uuid,
    )]


def _nvml_uuid(pynvml: Any, handle: Any) -> str | None:
    try:
        return _text(pynvml.nvmlDeviceGetUUID(handle))
    except (pynvml.NVMLError, AttributeError):
        return None


def _probe_amd(notes: list[str]) -> list[GpuInfo]:
    try:
        import amdsmi
    except ImportError:
        amdsmi = None
    if amdsmi is not None:
        try:
            amdsmi.amdsmi_init()
            gpus = []
            for index, handle in enumerate(amdsmi.amdsmi_get_processor_handles()):
                total = int(amdsmi.amdsmi_get_gpu_memory_total(handle, amdsmi.AmdSmiMemoryType.VRAM))
                used = int(amdsmi.amdsmi_get_gpu_memory_usage(handle, amdsmi.AmdSmiMemoryType.VRAM))
                info = amdsmi.amdsmi_get_gpu_asic_info(handle)
                gpus.append(GpuInfo(index=index, name=str(info.get("market_name", "AMD GPU")), vendor="amd",
                                    backend="rocm", memory_total_bytes=total, memory_free_bytes=max(0, total - used),
                                    memory_used_bytes=used, other_processes_bytes=used,
                                    compute_capability=str(info.get("target_graphics_version") or "") or None))
            amdsmi.amdsmi_shut_down()
            return gpus
        except Exception as exc:  # amdsmi raises its own exception types; any failure means "not usable"
            notes.append(f"AMD: amdsmi failed ({exc})")
            return []
    rocm_smi = shutil.which("rocm-smi")
    if not rocm_smi:
        return _probe_amd_sysfs(notes)
    try:
        out = subprocess.run([rocm_smi, "--showmeminfo", "vram", "--showproductname", "--json"],
                             capture_output=True, text=True, timeout=10, check=False).stdout
        data = json.loads(out or "{}")
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        notes.append(f"AMD: rocm-smi failed ({exc})")
        return []
    gpus = []
    for index, (key, card) in enumerate(sorted(data.items())):
        if not key.startswith("card") or not isinstance(card, dict):
            continue
        total = int(card.get("VRAM Total Memory (B)", 0) or 0)
        used = int(card.get("VRAM Total Used Memory (B)", 0) or 0)
        if total <= 0:
            continue
        gpus.append(GpuInfo(index=index, name=str(card.get("Card Series") or card.get("Card model") or "AMD GPU"),
                            vendor="amd", backend="rocm", memory_total_bytes=total,
                            memory_free_bytes=max(0, total - used), memory_used_bytes=used,
                            other_processes_bytes=used, compute_capability=card.get("GFX Version")))
    if not gpus:
        notes.append("AMD: rocm-smi found no GPUs")
    return gpus


AMD_VENDOR = "0x1002"
DRM_ROOT = Path("/sys/class/drm")
KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")
ROCM_ROOTS = (Path("/opt/rocm"),)
LIB_DIRS = (Path("/opt/rocm/lib"), Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib"))
VULKAN_ICD_DIRS = (Path("/usr/share/vulkan/icd.d"), Path("/etc/vulkan/icd.d"), Path("/usr/local/share/vulkan/icd.d"))


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _gfx_targets(kfd_nodes: Path) -> list[str]:
    """gfx targets of the GPU nodes in the KFD topology (gfx_target_version 110000 -> gfx1100), in node order."""
    targets = []
    for node in sorted(kfd_nodes.glob("*"), key=lambda p: int(p.name) if p.name.isdigit() else 0):
        props = _read(node / "properties") or ""
        for line in props.splitlines():
            key, _, value = line.partition(" ")
            if key == "gfx_target_version" and value.strip().isdigit() and int(value) > 0:
                number = int(value)
                major, minor, step = number // 10000, (number // 100) % 100, number % 100
                targets.append(f"gfx{major}{minor:x}{step:x}" if major < 10 else f"gfx{major}{minor}{step:x}")
    return targets


def _probe_amd_sysfs(notes: list[str], drm_root: Path = DRM_ROOT, kfd_nodes: Path = KFD_NODES) -> list[GpuInfo]:
    """AMD GPUs from the amdgpu kernel driver alone: /sys/class/drm/cardN/device with vendor 0x1002 and
    mem_info_vram_total/used. Works with only amdgpu + Mesa (no ROCm userspace), where the Vulkan build runs."""
    gpus: list[GpuInfo] = []
    targets = _gfx_targets(kfd_nodes)
    cards = sorted((c for c in drm_root.glob("card*") if c.name[4:].isdigit()), key=lambda c: int(c.name[4:]))
    for card in cards:
        device = card / "device"
        if (_read(device / "vendor") or "").lower() != AMD_VENDOR:
            continue
        total_text, used_text = _read(device / "mem_info_vram_total"), _read(device / "mem_info_vram_used")
        if not total_text or not total_text.isdigit():
            continue
        total = int(total_text)
        used = int(used_text) if used_text and used_text.isdigit() else 0
        if total <= 0:
            continue
        name = _read(device / "product_name") or f"AMD GPU (device {_read(device / 'device') or 'unknown'})"
        target = targets[len(gpus)] if len(gpus) < len(targets) else None
        gpus.append(GpuInfo(index=len(gpus), name=name, vendor="amd", backend="rocm", memory_total_bytes=total,
                            memory_free_bytes=max(0, total - used), memory_used_bytes=used,
                            other_processes_bytes=used, compute_capability=target))
    if not gpus:
        notes.append("AMD: none found (no amdgpu device in /sys/class/drm, no amdsmi or rocm-smi)")
    return gpus


def rocm_runtime_version(roots: tuple[Path, ...] = ROCM_ROOTS, lib_dirs: tuple[Path, ...] = LIB_DIRS) -> str | None:
    """The ROCm runtime installed here ("7.2.1"), "unknown" when its HIP library is there without a version file,
    None when there is none. llama.cpp's ROCm release build needs this runtime, or it loads no GPU backend."""
    for root in roots:
        version = _read(root / ".info" / "version")
        if version:
            return version.split("-")[0]
    for directory in lib_dirs:
        if any(directory.glob("libamdhip64.so*")):
            return "unknown"
    return None


def vulkan_available(lib_dirs: tuple[Path, ...] = LIB_DIRS, icd_dirs: tuple[Path, ...] = VULKAN_ICD_DIRS) -> bool:
    """A Vulkan loader (libvulkan.so.1) and at least one ICD manifest: what llama.cpp's Vulkan build needs."""
    loader = any(any(d.glob("libvulkan.so.1*")) for d in lib_dirs)
    icd = any(any(d.glob("*.json")) for d in icd_dirs)
    return loader and icd


def parse_windows_video_controllers(text: str) -> list[GpuInfo]:
    """AMD GPUs from Windows' adapter list (PowerShell: Get-CimInstance Win32_VideoController joined with the
    display class registry's HardwareInformation.qwMemorySize, as JSON). WMI's AdapterRAM is a 32-bit field
    (at most 4 GiB), so qwMemorySize, the 64-bit size DXGI reports as DedicatedVideoMemory, wins when present."""
    try:
        raw: Any = json.loads(text or "[]")
    except json.JSONDecodeError:
        return []
    items = raw if isinstance(raw, list) else [raw]
    gpus: list[GpuInfo] = []
    for item in items:
        if not isinstance(item, dict) or "VEN_1002" not in str(item.get("PNPDeviceID", "")).upper():
            continue
        size = item.get("qwMemorySize") or item.get("AdapterRAM") or 0
        try:
            total = int(size)
        except (TypeError, ValueError):
            continue
        if total <= 0:
            continue
        gpus.append(GpuInfo(index=len(gpus), name=str(item.get("Name") or "AMD GPU"), vendor="amd", backend="rocm",
                            memory_total_bytes=total, memory_free_bytes=total,
                            driver_version=str(item.get("DriverVersion") or "") or None))
    return gpus


WINDOWS_ADAPTERS_PS = (
    "$r = Get-ItemProperty 'HKLM:\\SYSTEM\\CurrentControlSet\\Control\\Class\\"
    "{4d36e968-e325-11ce-bfc1-08002be10318}\\0*' -ErrorAction SilentlyContinue; "
    "Get-CimInstance Win32_VideoController | ForEach-Object { $v = $_; "
    "$m = ($r | Where-Object { $_.MatchingDeviceId -and $v.PNPDeviceID -like ($_.MatchingDeviceId + '*') } | "
    "Select-Object -First 1).'HardwareInformation.qwMemorySize'; "
    "[pscustomobject]@{Name=$v.Name; PNPDeviceID=$v.PNPDeviceID; AdapterRAM=$v.AdapterRAM; "
    "DriverVersion=$v.DriverVersion; qwMemorySize=$m} } | ConvertTo-Json")


def _probe_amd_windows(notes: list[str]) -> list[GpuInfo]:
    """AMD GPUs on Windows through WMI (and the registry's 64-bit memory size). Free memory is not exposed there:
    it is reported as the total, with a note."""
    shell = shutil.which("powershell") or shutil.which("pwsh")
    if not shell:
        return []
    try:
        out = subprocess.run([shell, "-NoProfile", "-Command", WINDOWS_ADAPTERS_PS], capture_output=True, text=True,
                             timeout=20, check=False).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        notes.append(f"AMD: WMI query failed ({exc})")
        return []
    gpus = parse_windows_video_controllers(out)
    if gpus:
        notes.append("AMD on Windows: memory from WMI/DXGI; free memory is not reported there (taken as the total)")
    return gpus


def _probe_apple(notes: list[str], ram_total: int, ram_available: int) -> list[GpuInfo]:
    if sys.platform != "darwin" or platform.machine() != "arm64":
        return []
    chip = _sysctl("machdep.cpu.brand_string") or "Apple Silicon"
    # Metal lets the GPU wire about 2/3 of RAM up to 36 GB machines and about 3/4 above (recommendedMaxWorkingSetSize).
    share = 0.75 if ram_total > 36 * GIB else 0.67
    budget = int(ram_total * share)
    return [GpuInfo(index=0, name=chip, vendor="apple", backend="metal", memory_total_bytes=budget,
                    memory_free_bytes=min(budget, ram_available), memory_used_bytes=max(0, budget - ram_available),
                    unified_memory=True)]


def _probe_intel(notes: list[str]) -> list[GpuInfo]:
    """Intel dGPUs only when xpu-smi is around (cheap to ask); integrated graphics are left to llama.cpp's CPU path."""
    xpu = shutil.which("xpu-smi")
    if not xpu:
        return []
    try:
        data = json.loads(subprocess.run([xpu, "discovery", "-j"], capture_output=True, text=True, timeout=10,
                                         check=False).stdout or "{}")
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        notes.append(f"Intel: xpu-smi failed ({exc})")
        return []
    gpus = []
    for index, dev in enumerate(data.get("device_list", [])):
        total = int(dev.get("memory_physical_size_byte", 0) or 0)
        if total > 0:
            gpus.append(GpuInfo(index=index, name=str(dev.get("device_name", "Intel GPU")), vendor="intel",
                                backend="sycl", memory_total_bytes=total, memory_free_bytes=total))
    return gpus


@functools.cache
def this_cpu() -> CpuInfo:
    """This machine's CPU, read once a process (it does not change while it runs): what the engines' CPU kernels
    are keyed by (engines.kernels)."""
    return _cpu_info()


def _cpu_info() -> CpuInfo:
    model = platform.processor() or "unknown"
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("model name") and model in ("unknown", "", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")):
                    flags.update(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    if sys.platform == "darwin":
        model = _sysctl("machdep.cpu.brand_string") or model
        for key, flag in (("hw.optional.avx2_0", "avx2"), ("hw.optional.avx512f", "avx512f")):
            if _sysctl(key) == "1":
                flags.add(flag)
    arch = platform.machine() or "unknown"
    return CpuInfo(
        model=model, arch=arch,
        physical_cores=psutil.cpu_count(logical=False) or os.cpu_count() or 1,
        logical_cores=psutil.cpu_count(logical=True) or os.cpu_count() or 1,
        avx2="avx2" in flags, avx512="avx512f" in flags, amx="amx_tile" in flags,
        neon=arch in ("arm64", "aarch64"),
    )


def _sysctl(key: str) -> str | None:
    exe = shutil.which("sysctl")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "-n", key], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _disk_free(directory: Path) -> int | None:
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def default_models_dir() -> Path:
    """Where downloaded weights go: the Hugging Face cache unless HF_HOME / HF_HUB_CACHE point elsewhere."""
    hub_cache = os.environ.get("HF_HUB_CACHE")
    if hub_cache:
        return Path(hub_cache).expanduser()
    hf_home = os.environ.get("HF_HOME")
    return Path(hf_home).expanduser() / "hub" if hf_home else Path.home() / ".cache" / "huggingface" / "hub"


def _find_nvcc() -> str | None:
    """nvcc on PATH, or in CUDA_HOME / CUDA_PATH (where CMake's CUDAToolkit looks too)."""
    found = shutil.which("nvcc")
    if found:
        return found
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(variable)
        if home:
            candidate = Path(home) / "bin" / ("nvcc.exe" if os.name == "nt" else "nvcc")
            if candidate.is_file():
                return str(candidate)
    return None


def detect_toolchain() -> dict[str, str | None]:
    """The compilers a source build may need, found on this machine (recorded in the snapshot by `detect`)."""
    return {
        "cmake": shutil.which("cmake"),
        "cxx": shutil.which("c++") or shutil.which("cl") or shutil.which("clang++"),
        "nvcc": _find_nvcc(),
        "hipcc": shutil.which("hipcc") or shutil.which("hipconfig"),
        "glslc": shutil.which("glslc"),
    }


def detect(models_dir: str | Path | None = None) -> HardwareSnapshot:
    """Probe this machine. Never raises for missing drivers: the snapshot's notes say what was not found and why."""
    notes: list[str] = []
    memory = psutil.virtual_memory()
    gpus = _probe_nvidia(notes)
    if sys.platform.startswith("linux"):
        amd = _probe_amd(notes)
        if amd:
            runtime = rocm_runtime_version()
            amd = [replace(g, rocm_runtime=runtime) for g in amd]
            if runtime is None:
                notes.append("AMD: no ROCm runtime libraries found: llama.cpp's Vulkan build is the one that runs")
        gpus += amd
    elif sys.platform == "win32":
        gpus += _probe_amd_windows(notes)
    if gpus and sys.platform.startswith("linux") and not any(g.unified_memory for g in gpus):
        has_vulkan = vulkan_available()
        gpus = [replace(g, vulkan=has_vulkan) for g in gpus]
    gpus += _probe_apple(notes, int(memory.total), int(memory.available))
    gpus += _probe_intel(notes)
    if not gpus:
        notes.append("no GPU found: models run on the CPU (llama.cpp)")
    directory = Path(models_dir) if models_dir else default_models_dir()
    return HardwareSnapshot(
        gpus=[replace(g, index=i) for i, g in enumerate(gpus)],
        cpu=_cpu_info(),
        ram_total_bytes=int(memory.total),
        ram_available_bytes=int(memory.available),
        disk_free_bytes=_disk_free(directory),
        os=f"{platform.system()} {platform.release()}".strip(),
        models_dir=str(directory),
        notes=notes,
        toolchain=detect_toolchain(),
    )


def hypothetical(base: HardwareSnapshot, gpu_name: str | None = None, gpu_count: int = 1,
                 gpu_mem_gib: float | None = None) -> HardwareSnapshot:
    """`base` with its GPUs replaced by `gpu_count` idle GPUs from the table or of `gpu_mem_gib` each.

    Answers "would it fit on an H100?" for hardware the user does not have; CPU, RAM and disk stay as detected.
    """
    from desktop.core.machine.gpu_catalog import require_gpu

    if gpu_count < 1 or gpu_count > 64:
        raise SwitchyardError(f"--gpus must be between 1 and 64, not {gpu_count}")
    if gpu_mem_gib is not None and not (0 < gpu_mem_gib <= 4096):
        raise SwitchyardError(f"GPU memory must be a positive number of GiB, not {gpu_mem_gib}")
    if gpu_name:
        spec = require_gpu(gpu_name)
        total = int(gpu_mem_gib * GIB) if gpu_mem_gib else spec.memory_mib * MIB
        template = GpuInfo(index=0, name=spec.name, vendor=spec.vendor,
                           backend={"nvidia": "cuda", "amd": "rocm", "apple": "metal"}.get(spec.vendor, "vulkan"),
                           memory_total_bytes=total, memory_free_bytes=total,
                           compute_capability=spec.compute_capability, unified_memory=spec.vendor == "apple")
    elif gpu_mem_gib is not None:
        total = int(gpu_mem_gib * GIB)
        template = GpuInfo(index=0, name=f"hypothetical {gpu_mem_gib:g} GiB GPU", vendor="nvidia", backend="cuda",
                           memory_total_bytes=total, memory_free_bytes=total, compute_capability="8.9")
    else:
        return base
    gpus = [replace(template, index=i) for i in range(gpu_count)]
    label = f"{gpu_count}x {template.name}"
    return replace(base, gpus=gpus, label=label, notes=[*base.notes, f"hypothetical hardware: {label}"])
