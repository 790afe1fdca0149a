"""Engine flags a person passes through (`switchyard serve ... -- ARGS`, models.yaml `args:`): the escape hatch of
GPUStack, Lemonade and Docker Model Runner, without letting it undo the checked plan.

Three kinds of flag, per engine:
- the plan owns it (context, slots, layers, ports, the model, parsers ...): refused, naming the flag or the
  models.yaml key that sets it, because a second value in the argv would silently win over what the fit checked;
- the fit counts it: it becomes a plan field (llama.cpp `--n-cpu-moe N`, `--cpu-moe`, `-ot <exps>=CPU`,
  `-ctk/-ctv`, `-fa`, `-ub`; vLLM `--cpu-offload-gb N`, `--kv-cache-dtype`, `--enforce-eager`), so the memory
  check and the argv agree;
- anything else passes through untouched in `extra_args`, and the fit says it did not account for it.

Hand-written rather than argparse because it must see every flag in order, keep unknown ones verbatim (with their
values) and tell "owned" from "unknown", which `parse_known_args` cannot.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from desktop.core.common.errors import SwitchyardError

ALL_LAYERS = 1 << 16  # --cpu-moe: the experts of every layer (the fit resolves it to the model's layer count)

# flag spellings -> what sets it instead (a `serve` flag, or the models.yaml key)
_LLAMA_OWNED = {
    ("-c", "--ctx-size"): "--ctx (models.yaml `ctx:`), per request",
    ("-np", "--parallel"): "--parallel (models.yaml `parallel:`)",
    ("-ngl", "--gpu-layers", "--n-gpu-layers"): "--gpu-layers",
    ("-m", "--model", "-hf", "--hf-repo", "-mu", "--model-url"): "--model (models.yaml `model:`)",
    ("--host", "--port"): "the endpoint (Switchyard puts the engine on its private socket)",
    ("-a", "--alias"): "the endpoint's model name (models.yaml `name:`)",
    ("--api-key", "--api-key-file"): "the endpoint's key (--api-key-env)",
    ("--reasoning-format",): "--reasoning-parser (models.yaml `reasoning_parser:`)",
}
_VLLM_OWNED = {
    ("--max-model-len",): "--ctx (models.yaml `ctx:`)",
    ("--max-num-seqs",): "--parallel (models.yaml `parallel:`)",
    ("--model",): "--model (models.yaml `model:`)",
    ("--host", "--port", "--uds"): "the endpoint (Switchyard puts the engine on its private socket)",
    ("--served-model-name",): "the endpoint's model name (models.yaml `name:`)",
    ("--api-key",): "the endpoint's key (--api-key-env)",
    ("--gpu-memory-utilization",): "--util",
    ("-tp", "--tensor-parallel-size"): "--tp",
    ("--dtype",): "--dtype",
    ("--tool-call-parser", "--enable-auto-tool-choice"): "--tool-parser (models.yaml `tool_parser:`)",
    ("--reasoning-parser",): "--reasoning-parser (models.yaml `reasoning_parser:`)",
    ("--quantization", "-q"): "the plan's quantization (`fit --quant` to compare)",
}
_OWNED = {"llama.cpp": _LLAMA_OWNED, "vllm": _VLLM_OWNED}
_NO_VALUE = {"--cpu-moe", "-cmoe", "--enable-auto-tool-choice", "--enforce-eager"}
_EXPERTS_TO_CPU = re.compile(r"exps.*=\s*CPU$", re.I)


def _owner(engine: str, flag: str) -> str | None:
    for spellings, instead in _OWNED[engine].items():
        if flag in spellings:
            return instead
    return None


def _split(token: str) -> tuple[str, str | None]:
    flag, sep, value = token.partition("=")
    return (flag, value) if sep and flag.startswith("--") else (token, None)


def plan_fields_from_args(engine: str, args: Sequence[str]) -> dict[str, Any]:
    """The plan fields `args` set for `engine` (its adapter name): counted flags as fields, the rest in
    `extra_args`. Raises SwitchyardError, naming the flag and what to use, for a flag the plan owns."""
    if engine not in _OWNED:
        raise SwitchyardError(f"engine flags are not supported for {engine}")
    tokens = [str(a) for a in args]
    if tokens and not tokens[0].startswith("-"):
        raise SwitchyardError(f"engine flags start with a dash, not {tokens[0]!r}",
                              "put the engine's own flags after `--`, e.g. `-- --n-cpu-moe 4`")
    fields: dict[str, Any] = {}
    extra: list[str] = []
    kv: dict[str, str] = {}
    index = 0
    while index < len(tokens):
        flag, inline = _split(tokens[index])
        takes_value = flag.startswith("-") and flag not in _NO_VALUE and inline is None \
            and index + 1 < len(tokens) and not (tokens[index + 1].startswith("-")
                                                 and not _number(tokens[index + 1]))
        value = inline if inline is not None else (tokens[index + 1] if takes_value else None)
        step = 2 if takes_value else 1
        instead = _owner(engine, flag)
        if instead is not None:
            raise SwitchyardError(f"{flag} is set by the plan the fit checked, not by engine flags",
                                  f"use {instead}")
        if engine == "llama.cpp" and flag in ("--n-cpu-moe", "-ncmoe"):
            fields["n_cpu_moe"] = _count(flag, value)
        elif engine == "llama.cpp" and flag in ("--cpu-moe", "-cmoe"):
            fields["n_cpu_moe"] = ALL_LAYERS
        elif engine == "llama.cpp" and flag in ("-ot", "--override-tensor") and value \
                and _EXPERTS_TO_CPU.search(value):
            fields["n_cpu_moe"] = ALL_LAYERS  # every expert tensor to the CPU: what --cpu-moe does
        elif engine == "llama.cpp" and flag in ("-ctk", "--cache-type-k", "-ctv", "--cache-type-v"):
            kv[flag] = _text(flag, value)
        elif engine == "llama.cpp" and flag in ("-fa", "--flash-attn"):
            fields["flash_attn"] = _switch(flag, value)
        elif engine == "llama.cpp" and flag in ("-ub", "--ubatch-size"):
            fields["ubatch"] = _count(flag, value)
        elif engine == "vllm" and flag == "--enforce-eager":
            fields["eager"] = True
        elif engine == "vllm" and flag == "--kv-cache-dtype":
            fields["kv_cache_type"] = _text(flag, value)
        elif engine == "vllm" and flag == "--cpu-offload-gb":
            fields["cpu_offload_gb"] = _gib(flag, value)
        else:
            extra.extend(tokens[index:index + step])
        index += step
    if kv:
        if len(set(kv.values())) > 1:
            raise SwitchyardError(f"K and V cache types differ ({', '.join(f'{k} {v}' for k, v in kv.items())}): "
                                  "the plan has one KV cache type", "use --kv-type for both")
        fields["kv_cache_type"] = next(iter(kv.values()))
    if extra:
        fields["extra_args"] = tuple(extra)
    return fields


def _number(text: str) -> bool:
    return bool(re.fullmatch(r"-?\d+(\.\d+)?", text))


def _text(flag: str, value: str | None) -> str:
    if not value:
        raise SwitchyardError(f"{flag} needs a value")
    return value


def _switch(flag: str, value: str | None) -> bool | None:
    """llama-server's on|off|auto (auto: the plan's None, the engine decides)."""
    states = {"on": True, "off": False, "auto": None}
    if value not in states:
        raise SwitchyardError(f"{flag} takes on, off or auto, not {value!r}")
    return states[value]


def _count(flag: str, value: str | None) -> int:
    if value is None or not value.isdigit():
        raise SwitchyardError(f"{flag} takes a whole number of layers, not {value!r}")
    return int(value)


def _gib(flag: str, value: str | None) -> float:
    try:
        gib = float(value or "")
    except ValueError:
        gib = -1.0
    if not 0 <= gib <= 1 << 20:
        raise SwitchyardError(f"{flag} takes a number of GiB, not {value!r}")
    return gib
