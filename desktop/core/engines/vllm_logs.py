"""Reading vLLM's log: its load-phase markers, the rules that name a failure, the root cause an EngineCore or
Worker traceback holds, and the numbers vLLM V1's start-up memory errors print (what `--auto-fit` retries with).

Kept apart from `vllm`, which provisions vLLM's environment and builds its command line: this module only reads
what the process printed. `VllmAdapter` delegates to it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from desktop.core.engines.base import FailureReason, LaunchPlan, failure_rule, log_marker

GENERIC_DEATH = "vLLM's engine core process died"
# `(EngineCore_DP0 pid=7) ` / `(Worker pid=9) ` / `(Worker_TP1 pid=9) `: vLLM prefixes its child processes' lines
_CHILD_PREFIX = re.compile(r"^\((?:EngineCore|Worker|VllmWorker|CPUWorker)[\w-]*\s+pid=\d+\)\s?")
_API_PREFIX = re.compile(r"^(?:\(APIServer pid=\d+\)\s?)?")  # the API server's lines, or unprefixed ones
_LOG_HEAD = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d [\d:]+ \[[^\]]*\] ")
_EXCEPTION = re.compile(r"^((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure))(?::\s*(.*))?$")
_OOM = re.compile(r"out of memory|OutOfMemoryError|Cannot allocate memory|MemoryError|not enough memory|"
                  r"less than requested memory for kv", re.I)
_NOT_ROOT = re.compile(r"^(?:EngineDeadError|EngineGenerateError)$|Engine core initialization failed")


def root_cause(log_tail: Sequence[str]) -> str | None:
    """The first exception line (`Type: message`) an EngineCore or Worker process printed after a traceback; when
    none did (the API server failed before it started them: a missing config, an unknown architecture), the API
    server's first one, never its "Engine core initialization failed" echo. None when the log has none."""
    return _first_exception(log_tail, _CHILD_PREFIX) or _first_exception(log_tail, _API_PREFIX)


def _first_exception(log_tail: Sequence[str], prefix_pattern: re.Pattern[str]) -> str | None:
    in_traceback = False
    for raw in log_tail:
        prefix = prefix_pattern.match(raw)
        if prefix is None:
            continue
        line = _LOG_HEAD.sub("", raw[prefix.end():]).rstrip()
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
            continue
        if not in_traceback or line[:1] in (" ", "\t") or not line:
            continue
        match = _EXCEPTION.match(line)
        if match and not _NOT_ROOT.search(line):
            kind, message = match.group(1).rsplit(".", 1)[-1], (match.group(2) or "").strip()
            return f"{kind}: {message}"[:300] if message else kind
    return None


def _cause_hint(cause: str) -> str | None:
    """What to do about the commonest causes, by their exception text."""
    lowered = cause.lower()
    if "safetensor" in lowered or "deserializ" in lowered or "incomplete metadata" in lowered:
        return "a weights file is damaged or incomplete: download the model again"
    if "config.json" in lowered or "no such file" in lowered or "not a valid model" in lowered:
        return "point at a Hugging Face model folder with config.json, weights and tokenizer"
    if "architecture" in lowered or "not supported" in lowered:
        return "this vLLM does not support the model's architecture: run it with llama.cpp or upgrade vLLM"
    return None


LOG_MARKERS = (
    # Phases, from vLLM's own lines (0.32, CPU and CUDA): the model runner starts loading, weights are in,
    # torch.compile is done (loaded from its cache or compiled and saved), the memory profile sized the KV
    # cache, CUDA graphs are captured / the engine warmed up, the API server starts.
    log_marker("load_start", r"Starting to load model", ends="process"),
    log_marker("loading_weights", r"Loading weights took\s*(?P<seconds>[\d.]+)", ends="weights"),
    log_marker("model_loading", r"Model loading took\s*(?P<gib>[\d.]+)\s*GiB", ends="weights"),
    # torch.compile: loaded from the cache ("Directly load AOT compilation from path ...") or compiled and
    # saved ("saved AOT compiled function to ..."); CUDA also says "torch.compile took X s in total".
    log_marker("compile_cache_hit", r"Directly load (?:AOT compilation|the compiled graph)", ends="compile"),
    log_marker("compile_cache_miss", r"saved AOT compiled function to", ends="compile"),
    log_marker("compile_cache_stale", r"Compiling model again due to a load failure from \S+, reason: (?P<why>.*)"),
    log_marker("compiling_graph", r"Compiling a graph for (?:compile range|dynamic shape)"),
    log_marker("torch_compile", r"torch\.compile (?:takes|took)\s*(?P<seconds>[\d.]+)", ends="compile"),
    # CPU: the first forward passes compile ("Warming up model for the compilation..." ... "Warming up
    # done."; with AOT off nothing else is logged); CUDA: the profiling run sizes the KV cache
    log_marker("cpu_warmup_done", r"Warming up done", ends="compile"),
    log_marker("profile_run", r"Initial profiling/warmup run took", ends="memory"),
    log_marker("kv_memory", r"Available KV cache memory:\s*(?P<gib>[\d.]+)\s*GiB", ends="memory"),
    log_marker("kv_tokens", r"KV cache size:\s*(?P<tokens>[\d,]+)\s*tokens", ends="memory"),
    log_marker("max_concurrency", r"Maximum concurrency for\s*(?P<len>[\d,]+)\s*tokens per request:\s*(?P<x>[\d.]+)",
               ends="memory"),
    log_marker("activation_peak", r"(?:activation|torch) peak memory (?:takes|increase:?)\s*(?P<gib>[\d.]+)\s*GiB"),
    log_marker("graph_capture", r"Graph capturing finished in(?:\s*[\d.]+\s*secs?,\s*took\s*(?P<gib>[\d.]+)\s*GiB)?",
               ends="graphs"),
    log_marker("init_engine", r"init engine .* took\s*(?P<seconds>[\d.]+)", ends="graphs"),
    log_marker("listening", r"Application startup complete"),
)

FAILURE_RULES = (
    # vLLM V1's two start-up memory checks (v1/core/kv_cache_utils.py, v1/worker/utils.py): the --auto-fit
    # retry reads the numbers back with `memory_retry`.
    failure_rule(r"max seq len \((\d+)\).{0,40}\(([\d.]+) GiB KV cache is needed, which is larger than the "
                 r"available KV cache memory \(([\d.]+) GiB\)(?:.{0,80}?estimated maximum model length is (\d+))?",
                 "vLLM's KV cache ({2} GiB) cannot hold one {0}-token request ({1} GiB needed)",
                 "lower --ctx (max_model_len) to what vLLM printed, or raise --util; --auto-fit retries with it",
                 memory=True),
    failure_rule(r"Free memory on device[^\n]*?\(([\d.]+)/([\d.]+) GiB\) on startup is less than desired GPU "
                 r"memory utilization \(([\d.]+), ([\d.]+) GiB\)",
                 "only {0} of {1} GiB of GPU memory is free, less than gpu_memory_utilization {2} asks for "
                 "({3} GiB)",
                 "lower --util to what is free (or close what holds the GPU); --auto-fit retries with it",
                 memory=True),
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
                 GENERIC_DEATH,
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
    failure_rule(r"Model architectures \[([^\]]*)\] are not supported",
                 "this vLLM does not support the model's architecture {0}",
                 "serve a GGUF of it with llama.cpp, or use a vLLM version that lists it"),
    failure_rule(r"Invalid repository ID or local directory specified: '([^']*)'",
                 "vLLM found no model config in {0}: no config.json (or params.json) there",
                 "point at a Hugging Face model folder with config.json, weights and tokenizer"),
    failure_rule(r"Value error, ([^\n]*?)(?: \[type=value_error|\n|$)",
                 "vLLM refused its settings: {0}",
                 "change the setting it names"),
)


def refine_failure(reason: FailureReason, log_tail: Sequence[str], display_name: str) -> FailureReason:
    """The first exception raised in the EngineCore or a Worker (with its message) is the cause; the API
    server's "Engine core initialization failed. See root cause above." only repeats that it died. A rule
    that knows the case better (`reason`, the failure rules' answer) keeps its advice and quotes the cause."""
    cause = root_cause(log_tail)
    if cause is None:
        return reason
    generic = reason.reason in (GENERIC_DEATH, "vLLM could not load the model folder") \
        or reason.reason.startswith(f"{display_name} exited with code")
    memory = reason.memory or bool(_OOM.search(cause))
    if generic:
        suggestion = ("lower max_model_len or the KV cache size, or pick a smaller model" if memory
                      else _cause_hint(cause) or reason.suggestion)
        return FailureReason(f"{display_name} failed: {cause}", suggestion, reason.pattern, memory)
    if cause.startswith("ValidationError"):  # pydantic's count of errors: the rule quoted the message itself
        return reason
    return FailureReason(f"{reason.reason} ({cause})", reason.suggestion, reason.pattern, memory)


# --- vLLM V1's start-up memory errors: what to retry with (the endpoint's --auto-fit loop calls this) --------
_KV_TOO_SMALL = re.compile(r"max seq len \((\d+)\).*?estimated maximum model length is (\d+)", re.S)
_FREE_TOO_LOW = re.compile(r"Free memory on device[^\n]*?\(([\d.]+)/([\d.]+) GiB\) on startup is less than desired "
                           r"GPU memory utilization \(([\d.]+), ([\d.]+) GiB\)")
RETRY_UTIL_MARGIN = 0.02  # below free/total: vLLM's own CUDA context and other processes move a little


@dataclass(frozen=True)
class MemoryRetry:
    """A plan vLLM's own start-up message says will start, and why."""

    plan: LaunchPlan
    reason: str


def memory_retry(log_text: str, plan: LaunchPlan) -> MemoryRetry | None:
    """The plan to retry after one of vLLM V1's start-up memory errors, from the numbers vLLM printed (pure).

    "... KV cache is needed, which is larger than the available KV cache memory ... the estimated maximum model
    length is M": retry with max_model_len M. "Free memory on device (F/T GiB) on startup is less than desired GPU
    memory utilization (U, X GiB)": retry with utilization F/T minus a small margin. None when neither message is
    there, or the number would not change the plan (M >= the current length, or no room at all)."""
    kv = _KV_TOO_SMALL.search(log_text)
    if kv:
        longest = int(kv.group(2))
        if 0 < longest < plan.ctx_per_request:
            return MemoryRetry(replace(plan, ctx_per_request=longest),
                               f"max_model_len {plan.ctx_per_request} -> {longest} (vLLM's estimate of what its KV "
                               "cache holds)")
        return None
    free = _FREE_TOO_LOW.search(log_text)
    if free:
        free_gib, total_gib, wanted = float(free.group(1)), float(free.group(2)), float(free.group(3))
        fraction = math.floor((free_gib / total_gib - RETRY_UTIL_MARGIN) * 100) / 100 if total_gib > 0 else 0.0
        if 0.05 <= fraction < wanted:
            return MemoryRetry(replace(plan, gpu_memory_utilization=fraction),
                               f"gpu_memory_utilization {wanted:g} -> {fraction:.2f} ({free_gib:g} of "
                               f"{total_gib:g} GiB free at start-up)")
    return None


def memory_retry_changes(log_text: str, plan: LaunchPlan) -> tuple[dict[str, Any], str] | None:
    """`memory_retry` as the plan fields it changes (context, utilization) and why; None when it changes none."""
    retry = memory_retry(log_text, plan)
    if retry is None:
        return None
    changes = {name: getattr(retry.plan, name) for name in ("ctx_per_request", "gpu_memory_utilization")
               if getattr(retry.plan, name) != getattr(plan, name)}
    return (changes, retry.reason) if changes else None
