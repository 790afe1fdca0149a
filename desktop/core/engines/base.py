"""The one interface every engine adapter implements.

An adapter is data plus a few functions: how to provision the engine, how to build its command line from a
launch plan, how to tell that it really serves, which log lines mark its cold-start phases, how its Prometheus
metrics map onto Switchyard's common series, and which failures it can explain. Nothing outside an adapter
branches on an engine's name.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from desktop.core.common.defaults import DEFAULT_CTX_PER_REQUEST, DEFAULT_SLOTS, SERVED_MODEL_NAME
from desktop.core.common.progress import ProgressCallback, no_progress

if TYPE_CHECKING:
    from desktop.core.engines.runtimes import BuildChoice
    from desktop.core.machine.hardware import GpuInfo, HardwareSnapshot

ModelFormat = Literal["gguf", "hf"]


@dataclass(frozen=True)
class EngineInstall:
    """A ready-to-run engine: what to execute and which version it is."""

    engine: str
    version: str
    source: str  # "cache", "path", "configured"
    executable: Path  # llama-server binary, or the venv's python for vLLM
    root: Path | None = None
    details: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["executable"] = str(self.executable)
        data["root"] = str(self.root) if self.root else None
        data["details"] = dict(self.details)
        return data


@dataclass(frozen=True)
class DoctorFinding:
    """One check of `engines doctor`: ok or not, what was found, and the exact fix when not ok."""

    engine: str
    check: str
    ok: bool
    detail: str
    fix: str | None = None


Backend = Literal["cuda", "rocm", "vulkan", "metal", "sycl", "cpu"]


def llama_ctx_size(ctx_per_request: int, slots: int) -> int:
    """llama-server's `-c`: one context shared by all slots, so every slot gets the full per-request context.
    The only place this product is formed (adapter, export and the fit all call it)."""
    return ctx_per_request * max(1, slots)


@dataclass(frozen=True)
class LaunchPlan:
    """The one launch plan: what the fit checks, what recommend returns, what the CLI/GUI/A-B launch and what
    export writes. Context is stated once, per request; `slots` requests run at once (llama.cpp -np, vLLM
    max_num_seqs). None means "the engine's own default"; a plan returned by the fit has every memory-relevant
    field resolved, so the argv says exactly what was checked."""

    engine: str
    model_path: Path
    host: str = "127.0.0.1"
    port: int = 0
    ctx_per_request: int = DEFAULT_CTX_PER_REQUEST  # tokens one request may use (vLLM --max-model-len)
    slots: int = DEFAULT_SLOTS  # requests served at once: llama.cpp --parallel, vLLM --max-num-seqs (matched for a fair A/B)
    served_model_name: str = SERVED_MODEL_NAME
    dtype: str = "auto"  # the checkpoint's own; "float32" only where needed (the demo on vLLM's CPU backend)
    quantization: str | None = None  # vLLM --quantization (fp8 on the fly); llama.cpp: the file's own
    gpu_layers: int | None = None  # llama.cpp --n-gpu-layers
    n_cpu_moe: int | None = None  # llama.cpp --n-cpu-moe: the MoE experts of the first N layers stay in RAM
    # llama.cpp -ot rules, each as typed (`PATTERN=BUFFER,...`): in the argv verbatim, read by the fit
    # (planning/moe.py counts the expert tensors a rule sends to the CPU, and names what it does not count)
    override_tensors: tuple[str, ...] = ()
    kv_cache_type: str | None = None  # llama.cpp --cache-type-k/v (f16, q8_0 ...); vLLM --kv-cache-dtype (auto, fp8)
    flash_attn: bool | None = None  # llama.cpp -fa on/off
    ubatch: int | None = None  # llama.cpp --ubatch-size
    gpu_memory_utilization: float | None = None  # vLLM
    tensor_parallel: int = 1  # vLLM --tensor-parallel-size
    max_num_batched_tokens: int | None = None  # vLLM
    cpu_offload_gb: float | None = None  # vLLM --cpu-offload-gb: GiB of weights kept in RAM, streamed each step
    kv_cache_gib: float | None = None  # vLLM CPU KV space (VLLM_CPU_KVCACHE_SPACE); llama.cpp sizes KV from ctx
    # Requests that repeat a prompt's start (a chat's history, a shared system prompt, an agent's tools) reuse its
    # KV: on by default wherever the app serves, as it is in both engines (llama-server --cache-prompt, vLLM's
    # prefix caching); off (False) only where asked: the A/B and `bench --engine`, so each request costs its
    # whole prompt, and models.yaml `prefix_cache: false` / `serve --no-prefix-cache`.
    prefix_cache: bool = True
    # llama.cpp --cache-ram: MiB of host RAM llama-server may fill with the KV of prompts it moves out of a slot
    # (its prompt cache; 8192 in b11434, 0 = none). None: the fit chooses (planning/promptcache.py) and counts it
    # in the host RAM it checks; vLLM's prefix cache lives in its KV pool and has no such setting.
    cache_ram_mib: int | None = None
    eager: bool = False  # vLLM: skip torch.compile/CUDA graphs (starts faster, may serve slower)
    threads: int | None = None
    backend: Backend = "cpu"  # which build the plan needs: cuda | rocm | vulkan | metal | sycl | cpu
    api_key: str | None = None
    tokenizer_path: Path | None = None
    # a vision model's projector (llama-server --mmproj; models.projector finds it beside the GGUF), whether it
    # runs on the GPU (--no-mmproj-offload when not) and the cap on one image's tokens (--image-max-tokens)
    mmproj: Path | None = None
    mmproj_offload: bool = True
    image_max_tokens: int | None = None
    images_per_prompt: int | None = None  # vLLM --limit-mm-per-prompt '{"image": N}' for a model that sees images
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment for the engine
    extra_args: tuple[str, ...] = ()
    # How the engine reads tool calls and reasoning out of the model's text (models.parsers picks them from the
    # model's architecture and chat template; "none" = explicitly off): vLLM --tool-call-parser (with
    # --enable-auto-tool-choice) and --reasoning-parser; llama-server --reasoning-format deepseek.
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    # What the plan was asked with, so a switch, a retry or a reload plans again from the same asks
    # (`planning.planner.replan`): the model as typed (`demo`, a file, a folder; `demo` resolves per engine) and
    # the names of the fields a person (or the --auto-fit retry) set. Every other field is the planner's choice.
    model: str = ""
    pinned: tuple[str, ...] = ()

    @property
    def llama_ctx_size(self) -> int:
        """llama-server's total `-c` for this plan."""
        return llama_ctx_size(self.ctx_per_request, self.slots)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["model_path"] = str(self.model_path)
        data["tokenizer_path"] = str(self.tokenizer_path) if self.tokenizer_path else None
        data["mmproj"] = str(self.mmproj) if self.mmproj else None
        data["extra_args"] = list(self.extra_args)
        data["override_tensors"] = list(self.override_tensors)
        data["pinned"] = list(self.pinned)
        data["env"] = dict(self.env)
        if self.api_key:
            data["api_key"] = "***"  # plans are printed and stored: never the secret itself
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LaunchPlan:
        """Rebuild from to_json(); unknown keys are an error, not silently dropped."""
        from dataclasses import fields as dataclass_fields

        from desktop.core.common.errors import SwitchyardError

        known = {f.name for f in dataclass_fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SwitchyardError(f"unknown launch plan field(s): {', '.join(unknown)}",
                                  f"known fields: {', '.join(sorted(known))}")
        values = dict(data)
        values["model_path"] = Path(str(values["model_path"]))
        if values.get("tokenizer_path"):
            values["tokenizer_path"] = Path(str(values["tokenizer_path"]))
        if values.get("mmproj"):
            values["mmproj"] = Path(str(values["mmproj"]))
        values["extra_args"] = tuple(str(a) for a in values.get("extra_args") or ())
        values["override_tensors"] = tuple(str(a) for a in values.get("override_tensors") or ())
        values["pinned"] = tuple(str(a) for a in values.get("pinned") or ())
        values["env"] = {str(k): str(v) for k, v in dict(values.get("env") or {}).items()}
        if values.get("api_key") == "***":
            values["api_key"] = None
        return cls(**values)


# Plan fields every engine reads the same way. Every other field belongs to one engine (its adapter's
# `plan_fields`) and never reaches another: a llama.cpp KV type is no vLLM --kv-cache-dtype, -ngl no vLLM flag.
COMMON_PLAN_FIELDS = frozenset({"host", "port", "ctx_per_request", "slots", "served_model_name", "threads",
                                "prefix_cache", "api_key", "tool_parser", "reasoning_parser"})
# What the planner resolves itself (never a user's ask): the model's path per engine, and the build it needs.
PLANNER_FIELDS = frozenset({"engine", "model_path", "model", "pinned", "backend"})


@dataclass(frozen=True)
class LogMarker:
    """A log line that marks a cold-start phase or carries a fact (e.g. KV cache size)."""

    name: str
    pattern: re.Pattern[str]
    ends: str = ""  # the cold-start phase this line ends (a key of supervisor.COLD_START_PHASES), if any

    def match(self, line: str) -> re.Match[str] | None:
        return self.pattern.search(line)


@dataclass(frozen=True)
class FailureReason:
    """A plain-language explanation of why an engine died, with what to try next."""

    reason: str
    suggestion: str
    pattern: str = ""
    memory: bool = False  # it ran out of memory: a smaller plan may load (the endpoint's --auto-fit retry)


@dataclass(frozen=True)
class CrashRetry:
    """Launch arguments that avoid a crash the adapter recognises in a failed start, and why in words: the start
    is retried once with them, and later starts of the same model on the same build begin with them
    (runtime.enginefix). E.g. llama-server's SIGILL in its CPU weight repack: `--no-repack`."""

    args: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class FailureRule:
    pattern: re.Pattern[str]
    reason: str
    suggestion: str
    memory: bool = False


def log_marker(name: str, pattern: str, ends: str = "") -> LogMarker:
    """A case-insensitive log marker; named groups in `pattern` become cold-start facts; `ends` names the
    cold-start phase the line closes (the timeline bar, `serve --json` and reports read phases from these)."""
    return LogMarker(name, re.compile(pattern, re.I), ends)


def failure_rule(pattern: str, reason: str, suggestion: str, *, memory: bool = False) -> FailureRule:
    return FailureRule(re.compile(pattern, re.I), reason, suggestion, memory)


@dataclass(frozen=True)
class CommandLine:
    argv: list[str]
    env: dict[str, str]


# Common telemetry series every adapter maps its /metrics onto.
COMMON_SERIES = (
    "requests_running",
    "requests_waiting",
    "prompt_tokens_total",
    "generation_tokens_total",
    "kv_cache_usage",
    "preemptions_total",
    "ttft_seconds_sum",
    "ttft_seconds_count",
    "itl_seconds_sum",
    "itl_seconds_count",
)


class EngineAdapter(ABC):
    """Base class of the engine adapters. Subclasses are registered in `desktop.core.engines`."""

    name: str
    display_name: str
    model_format: ModelFormat
    aliases: tuple[str, ...] = ()  # other spellings `--engine` accepts
    # The LaunchPlan fields only this engine reads (besides COMMON_PLAN_FIELDS): what a switch to another engine
    # drops, and what the planner refuses when a person sets it for another engine.
    plan_fields: frozenset[str] = frozenset()
    # Its own flags as a person may pass them through (engines.engine_args): those the plan sets, each with what
    # sets it instead (refused); those the fit counts, each with (plan field, how its value reads: count,
    # all_layers, rules, kv, switch, true, false, text, gib, mib); and the ones that take no value. Named as the
    # engine's own parser reads a name (`flag_syntax`): "llama.cpp" (common/arg.cpp: `_` in a `--` name is `-`) or
    # "argparse" (vLLM's FlexibleArgumentParser: the same before the first `.`, `-x=V`, `-xV`, and abbreviations).
    owned_flags: Mapping[str, str] = {}
    counted_flags: Mapping[str, tuple[str, str]] = {}
    valueless_flags: frozenset[str] = frozenset()
    flag_syntax: str = "llama.cpp"
    # Which memory accounting of the fit sizes it (planning.fit): "llama.cpp" or "vllm"; default its name.
    sizing: str = ""
    # The flag that lets it free its GPU memory and wake without a cold start (vLLM sleep mode, CUDA only).
    sleep_mode_flag: str | None = None
    dry_run_executable: str = "engine"  # what a dry run's argv names when the engine is not installed yet
    health_path: str = "/health"
    metrics_path: str = "/metrics"
    log_markers: Sequence[LogMarker] = ()
    failure_rules: Sequence[FailureRule] = ()
    failure_tail_lines: int = 80  # how many last log lines explain_failure reads
    # The server answers the Anthropic Messages API (`/v1/messages`, streaming and not): the endpoint forwards
    # such requests to it, and answers 501 for engines without it.
    anthropic_messages: bool = False
    # Routes the engine's own API key does not guard on TCP. An engine with any is never put on TCP by a plain
    # `serve`: it listens on its private socket and the keyed endpoint takes the port (only --no-key changes that).
    unguarded_routes: tuple[str, ...] = ()
    # The server closes a kept-alive connection right after a streamed (chunked) answer although it says
    # Keep-Alive: the endpoint then never pools such connections for it (one reused before its FIN arrives would
    # carry a request that cannot safely be retried).
    closes_after_stream: bool = False

    # --- provisioning -------------------------------------------------------------------------------
    @abstractmethod
    def find_install(self) -> EngineInstall | None:
        """A usable install (configured, on PATH, or cached), or None. Must be cheap: no builds, no network."""

    @abstractmethod
    def install_plan(self, hardware: HardwareSnapshot | None = None, variant: str | None = None,
                     source: str | None = None, allow_cpu: bool = False) -> BuildChoice:
        """The build `install` would make for `hardware` (this machine by default), or raise the blocker
        (e.g. vLLM on macOS, a CPU-only build on a GPU machine without `allow_cpu`). No side effects."""

    @abstractmethod
    def install(self, progress: ProgressCallback = no_progress, force: bool = False, *,
                hardware: HardwareSnapshot | None = None, variant: str | None = None, source: str | None = None,
                allow_cpu: bool = False) -> EngineInstall:
        """Provision the build for this machine (or `variant`/`source`) into the per-user engines dir.

        Idempotent; never leaves a half install ready; refuses a CPU-only build on a GPU machine unless `allow_cpu`.
        """

    @abstractmethod
    def doctor(self, hardware: HardwareSnapshot | None = None) -> list[DoctorFinding]:
        """What is present, what is missing or wrong for this machine, and the exact command that fixes it."""

    # --- launching ----------------------------------------------------------------------------------
    @abstractmethod
    def build_command(self, plan: LaunchPlan, install: EngineInstall) -> CommandLine:
        """The argument list (never a shell string) and environment that start the server for `plan`."""

    def chat_args(self, plan: LaunchPlan) -> list[str]:
        """The flags for the plan's tool-call and reasoning parsers in this engine's spelling (launch and export
        both take them from here)."""
        return []

    @abstractmethod
    def health_state(self, status_code: int | None, body: str) -> Literal["ready", "loading", "down"]:
        """Interpret one GET of the health path; None status means the connection failed."""

    # --- observing ----------------------------------------------------------------------------------
    @abstractmethod
    def map_metrics(self, families: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
        """Map parsed Prometheus samples ({metric name: {label string: value}}) to COMMON_SERIES keys."""

    def select_devices(self, plan: LaunchPlan, gpus: Sequence[GpuInfo]) -> LaunchPlan:
        """`plan` with the engine's own selection of `gpus` (the ones the fit sized) where the fit could not pin
        them from the snapshot alone; as is by default. Cheap: reads install markers, starts nothing."""
        return plan

    def cold_start_phases(self, plan: LaunchPlan) -> tuple[str, ...]:
        """The engine's own cold-start phases this plan goes through, in order (keys its markers `end`); the
        supervisor adds API up, first token and first request. An adapter drops what a plan skips (vLLM's
        compile with --enforce-eager), so the live "now: compile" guess stays right."""
        seen: list[str] = []
        for marker in self.log_markers:
            if marker.ends and marker.ends not in seen:
                seen.append(marker.ends)
        return tuple(seen)

    def compile_cache_dir(self, plan: LaunchPlan) -> Path | None:
        """Where the app keeps this plan's compiled graphs for the engine (vLLM's torch.compile cache), or None
        for engines that compile nothing."""
        return None

    def compile_cache_found(self, plan: LaunchPlan) -> bool | None:
        """Whether this plan's compile cache already holds compiled code before a start (None: nothing to
        compile). Read before spawning, so a start can say it began warm even when the engine logs nothing."""
        return None

    # Paths the app itself polls on an engine (health while it starts, telemetry's /metrics and /slots): their
    # access-log lines are the app talking to itself, kept in the log file but out of the engine log pane.
    polled_paths: tuple[str, ...] = ("/health", "/metrics", "/slots")

    def memory_retry(self, log_text: str, plan: LaunchPlan) -> tuple[dict[str, Any], str] | None:
        """After an out-of-memory start: the plan fields to change (and why, in words) when the engine's own log
        says what would start, e.g. vLLM's "estimated maximum model length is M"; None: the fit's next smaller
        plan decides (the default)."""
        return None

    def crash_retry(self, exit_code: int | None, log_tail: Sequence[str], plan: LaunchPlan) -> CrashRetry | None:
        """After a start that crashed while loading (not for lack of memory): the arguments that avoid this crash
        when the adapter knows them, else None (the failure is reported as it is: the default). Never the same
        arguments twice: a plan that already has them gets None."""
        return None

    def is_polling_line(self, line: str) -> bool:
        """Whether `line` is an engine's access-log line for one of the app's own polls (`polled_paths`)."""
        match = _ACCESS_LINE.search(line)
        return match is not None and match.group(1).split("?")[0] in self.polled_paths

    def explain_failure(self, exit_code: int | None, log_tail: Sequence[str]) -> FailureReason:
        """Turn an exit code and the last log lines into a reason a person can act on. A rule's reason may quote
        what its pattern caught ({0}, {1} ... for its groups); without a rule the engine's own error line is
        quoted (`error_line`), not whatever line the log happened to end with."""
        text = "\n".join(log_tail)
        for rule in list(self.failure_rules) + list(COMMON_FAILURE_RULES):
            match = rule.pattern.search(text)
            if match:
                groups = [(group or "").strip()[:200] for group in match.groups()]
                reason = rule.reason.format(*groups) if "{" in rule.reason else rule.reason
                return FailureReason(reason, rule.suggestion, match.group(0)[:200], rule.memory)
        if exit_code is not None and exit_code < 0:
            return FailureReason(
                f"{self.display_name} was killed by signal {-exit_code}",
                "if this was not you, check the system log for the out-of-memory killer (dmesg)",
            )
        last = self.error_line(log_tail) or next((line for line in reversed(log_tail) if line.strip()), "no output")
        return FailureReason(
            f"{self.display_name} exited with code {exit_code}: {last.strip()[:300]}",
            "see the engine log for details",
        )

    def error_line(self, log_tail: Sequence[str]) -> str | None:
        """The line of the log that says what went wrong, if the engine wrote one. The default takes the last
        line naming an error; adapters whose engines write the cause first (then usage text) override it."""
        for line in reversed(log_tail):
            if _ERROR_WORD.search(line) and not _NOT_A_CAUSE.search(line):
                return line
        return None


# uvicorn's `127.0.0.1:5432 - "GET /metrics HTTP/1.1" 200 OK`, llama-server's `request: GET /slots 127.0.0.1 200`
_ACCESS_LINE = re.compile(r'(?:"|\brequest: )GET (/\S*)(?: HTTP/[\d.]+"| \S+ \d{3}\b)')
_ERROR_WORD = re.compile(r"\berror\b|Error\b|\bfailed\b|Exception\b", re.I)
_NOT_A_CAUSE = re.compile(r"errors\.pydantic\.dev|For further information visit|^\s*(File \"|Traceback)")


COMMON_FAILURE_RULES: tuple[FailureRule, ...] = (
    FailureRule(
        re.compile(r"address already in use|bind.*failed|couldn't bind|Errno 98", re.I),
        "the engine could not bind its port: another process is using it",
        "pick another port or stop the process holding it",
    ),
    FailureRule(
        re.compile(r"CUDA out of memory|out of memory|OutOfMemoryError|failed to allocate|cudaMalloc failed", re.I),
        "the engine ran out of memory while loading",
        "lower the context length, pick a smaller quantization, offload fewer GPU layers "
        "or lower gpu_memory_utilization",
        memory=True,
    ),
    FailureRule(
        re.compile(r"error while loading shared libraries: (\S+)|ImportError: (lib\S+)", re.I),
        "a shared library the engine needs is missing",
        "reinstall the engine with `switchyard engines install --force`",
    ),
)
