"""Reading llama-server's log: its load-phase markers, the rules that name a failure from its last lines, and the
crash it is known for (an illegal instruction or a signal in the CPU weight repack, retried with --no-repack).

Kept apart from `llamacpp`, which provisions llama-server and builds its command line: this module only reads
what the process printed and how it ended. `LlamaCppAdapter` delegates to it.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence

from desktop.core.engines.base import CrashRetry, FailureReason, LaunchPlan, failure_rule, log_marker

# llama-server's CPU backend repacks quantized weights at load into interleaved layouts for its AVX-512/AMX
# kernels. On a CPU (or VM) that advertises instructions it cannot run, b11434 dies with SIGILL (or SIGSEGV) at
# the first multiply of a repacked Q4_0/Q4_1/Q8_0/Q4_K/MXFP4 weight, the load's warm-up run
# (shared/reference/review/amx-host.md); `--no-repack` keeps the file's own layout and every type loads.
NO_REPACK = "--no-repack"
# How an illegal instruction ends a process: killed by SIGILL (POSIX; Popen says -4), STATUS_ILLEGAL_INSTRUCTION
# (Windows), or a shell wrapper's 128 + 4 with the shell's "Illegal instruction" line.
_SIGILL_EXITS = frozenset({-int(signal.SIGILL), 0xC000001D})
_SIGILL_LINE = re.compile(r"illegal instruction|\bSIGILL\b", re.I)
_REPACK_LINE = re.compile(r"repack|CPU_REPACK|\bAMX\b", re.I)
# The first matrix multiplies of a start: the load's warm-up run, or the first request's prompt (--no-warmup).
_FIRST_MULTIPLY_LINE = re.compile(r"warming up the model|launch_slot_|update_slots|prompt (?:processing|eval)", re.I)
# A fault at a repacked kernel's first multiply shows as either (SIGSEGV seen on an AMX guest).
_FAULT_SIGNALS = frozenset(-int(s) for s in (signal.SIGSEGV, getattr(signal, "SIGBUS", signal.SIGSEGV)))
# Signals a fault in the engine's own code ends it with (not a person's or the OOM killer's SIGKILL/SIGTERM).
_CRASH_SIGNALS = frozenset(-int(s) for s in (signal.SIGSEGV, signal.SIGABRT, signal.SIGFPE, signal.SIGILL,
                                             getattr(signal, "SIGBUS", signal.SIGSEGV)))

LOG_MARKERS = (
    # Phases, from llama-server's own lines (b11434; the buffer sizes only with -v): the model file opens,
    # weights are mapped, the context (KV cache, compute buffers) is made, slots warm up, it listens.
    log_marker("loading_model", r"llama_model_loader: loaded meta data|loading model", ends="process"),
    log_marker("model_buffer", r"model buffer size\s*=\s*(?P<mib>[\d.]+) MiB", ends="weights"),
    log_marker("threadpool", r"llama threadpool init", ends="weights"),
    log_marker("kv_buffer", r"KV buffer size\s*=\s*(?P<mib>[\d.]+) MiB", ends="memory"),
    log_marker("compute_buffer", r"compute buffer size\s*=\s*(?P<mib>[\d.]+) MiB", ends="memory"),
    log_marker("slots", r"initializing, n_slots", ends="memory"),
    log_marker("warming_up", r"warming up the model"),
    log_marker("model_loaded", r"model loaded", ends="graphs"),
    log_marker("listening", r"listening on (?:http|unix)"),
)

FAILURE_RULES = (
    failure_rule(r'error while handling argument "(--[\w-]+)": (stoi|stol|stoul|stof|stod)',
                 "llama-server could not read the number given to {0} (out of its range; llama.cpp reads the "
                 "context per slot times the slots into a 32-bit number)",
                 "lower --ctx (and --parallel) to what the model and this machine can hold"),
    failure_rule(r'error while handling argument "(--[\w-]+)": (.*)',
                 "llama-server rejected its {0} argument: {1}",
                 "fix that setting (llama-server --help lists what it accepts)"),
    failure_rule(r"invalid magic|failed to read magic|gguf_init_from_file.*failed|not a GGUF",
                 "the model file is not a valid GGUF file (corrupt or incomplete download?)",
                 "re-download the file or pick another GGUF"),
    failure_rule(r"unknown model architecture: '?([\w-]+)",
                 "this llama.cpp build does not know the model's architecture",
                 "update llama.cpp or choose a model with a supported architecture"),
    failure_rule(r"failed to allocate|unable to allocate|ggml_backend.*alloc.*failed|cannot allocate memory",
                 "llama.cpp could not allocate memory for the model or its KV cache",
                 "lower the context (-c), offload fewer GPU layers, or pick a smaller quantization", memory=True),
    failure_rule(r"failed to load model|error loading model",
                 "llama.cpp could not load the model",
                 "check that the file is a complete GGUF for a supported architecture"),
    failure_rule(r"couldn't bind HTTP server socket|bind.*failed",
                 "llama-server could not bind its port: another process is using it",
                 "pick another port or stop the process holding it"),
)


def explain_crash(exit_code: int | None, log_tail: Sequence[str]) -> FailureReason | None:
    """An illegal instruction (SIGILL) named as such, with the repack as its known cause here, or a signal in the
    repack; None for any other end (the failure rules then explain it)."""
    if died_of_illegal_instruction(exit_code, log_tail):
        return FailureReason(
            "llama-server died with an illegal instruction (SIGILL) while loading the model: its repacked CPU "
            "kernels (AVX-512/AMX) use an instruction this CPU does not run",
            f"Switchyard starts it again with {NO_REPACK} and adds it to every later start of this build here; if "
            f"it dies with {NO_REPACK} too, this build does not suit this CPU: reinstall it "
            "(switchyard engines install llama.cpp --force)",
            "SIGILL")
    site = _fault_site(exit_code, log_tail)
    if site is not None:
        return FailureReason(f"llama-server was killed by signal {-(exit_code or 0)} {site}",
                             f"Switchyard starts it again with {NO_REPACK} (and every later start of this build "
                             "here)", "repack")
    return None


def _fault_site(exit_code: int | None, log_tail: Sequence[str]) -> str | None:
    """Where a crash signal other than SIGILL hit the repacked CPU kernels, in words, or None: any crash signal
    while it repacks the weights, or a segfault (bus error) at the first multiply, which a bad file never reaches."""
    if exit_code in _CRASH_SIGNALS and crashed_in_repack(log_tail):
        return "while repacking the model's weights for its CPU kernels"
    if exit_code in _FAULT_SIGNALS and crashed_at_first_multiply(log_tail):
        return "at its first matrix multiply (the load's warm-up): its repacked CPU kernels fault on this CPU"
    return None


def crash_retry(exit_code: int | None, log_tail: Sequence[str], plan: LaunchPlan) -> CrashRetry | None:
    """A load that died of SIGILL, or of a signal in the weight repack, is retried with --no-repack (once: a
    plan that has it already gets None). Slower matmuls on some quantized types, and a start that works."""
    if NO_REPACK in plan.extra_args:
        return None
    if died_of_illegal_instruction(exit_code, log_tail):
        return CrashRetry((NO_REPACK,), f"llama-server died with SIGILL in its CPU weight repack: started with "
                                        f"{NO_REPACK}")
    site = _fault_site(exit_code, log_tail)
    if site is not None:
        return CrashRetry((NO_REPACK,), f"llama-server was killed by signal {-(exit_code or 0)} {site}: started "
                                        f"with {NO_REPACK}")
    return None


def error_line(log_tail: Sequence[str]) -> str | None:
    """llama-server names the cause first and then prints usage text: the first error line is the one."""
    return next((line for line in log_tail if re.search(r"\berror\b|\bfailed\b", line, re.I)), None)


def died_of_illegal_instruction(exit_code: int | None, log_tail: Sequence[str]) -> bool:
    """Whether the process ended on an illegal instruction: its exit says so, or (behind a shell wrapper) the
    shell's "Illegal instruction" line does."""
    if exit_code in _SIGILL_EXITS:
        return True
    return exit_code is not None and exit_code != 0 and any(_SIGILL_LINE.search(line) for line in log_tail[-5:])


def crashed_at_first_multiply(log_tail: Sequence[str]) -> bool:
    """Whether the last lines before a crash are the first multiplies of a start: the load's warm-up run, or the
    first prompt (a segfault in a repacked kernel ends it there; a bad file fails earlier, while reading)."""
    last = [line for line in log_tail if line.strip()][-3:]
    return any(_FIRST_MULTIPLY_LINE.search(line) for line in last)


def crashed_in_repack(log_tail: Sequence[str]) -> bool:
    """Whether the last lines before a crash are the CPU backend's weight repacking (at -v it logs each tensor it
    repacks; its buffer is named CPU_REPACK or AMX in the load lines)."""
    last = [line for line in log_tail if line.strip()][-3:]
    return any(_REPACK_LINE.search(line) for line in last)
