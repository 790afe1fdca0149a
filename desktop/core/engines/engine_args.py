"""Engine flags a person passes through (`switchyard serve ... -- ARGS`, models.yaml `args:`): the escape hatch of
GPUStack, Lemonade and Docker Model Runner, without letting it undo the checked plan.

Three kinds of flag, from each engine's adapter (`owned_flags`, `counted_flags`, `valueless_flags`):
- the plan owns it (context, slots, layers, ports, the model, parsers ...): refused, naming the flag or the
  models.yaml key that sets it, because a second value in the argv would silently win over what the fit checked;
- the fit counts it: it becomes a plan field (llama.cpp `--n-cpu-moe N`, `--cpu-moe`, `-ot RULES` (kept as typed:
  the fit counts the expert tensors a rule sends to the CPU and names the rest, planning/moe.py), `-ctk/-ctv`,
  `-fa`, `-ub`, `--cache-ram N`; vLLM `--cpu-offload-gb N`, `--kv-cache-dtype`, `--enforce-eager`), so the memory
  check and the argv agree;
- anything else passes through untouched in `extra_args`, and the fit says it did not account for it.

A flag is looked up under the name the engine's own parser reads (the adapter's `flag_syntax`), so another
spelling of an owned flag cannot slip past: llama-server (common/arg.cpp) reads `_` in a `--` name as `-`; vLLM's
FlexibleArgumentParser does the same up to the first `.`, splits `-x=value` as well as `--x=value`, reads `-qfp8` as
`-q fp8`, and (argparse's allow_abbrev) takes a `--` prefix of one option for that option: `--max_model 9` is
`--max-model-len 9`. No vLLM 0.32 option is itself a strict prefix of one in the tables, so a prefix of a table's
flag is that flag or an error in vLLM too.

Hand-written rather than argparse because it must see every flag in order, keep unknown ones verbatim (with their
values) and tell "owned" from "unknown", which `parse_known_args` cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines import get_adapter
from desktop.core.engines.base import EngineAdapter
from desktop.core.engines.flag_spelling import flag_name, is_number

ALL_LAYERS = 1 << 16  # --cpu-moe: the experts of every layer (the fit resolves it to the model's layer count)


def _as_read(adapter: EngineAdapter, typed: str, flag: str) -> str:
    """`typed` in a message, with the flag its engine reads it as when that is another spelling."""
    if typed == flag:
        return flag
    dashed = typed.replace("_", "-")
    if dashed != flag and dashed.startswith("--") and flag.startswith(dashed):
        return f"{typed} ({adapter.display_name}'s abbreviation of {flag})"
    return f"{typed} (read as {flag})"


def plan_fields_from_args(engine: str, args: Sequence[str]) -> dict[str, Any]:
    """The plan fields `args` set for `engine`: flags its adapter counts become fields, the rest `extra_args`.
    Raises SwitchyardError, naming the flag and what to use, for a flag the plan owns (the adapter's tables)."""
    adapter = get_adapter(engine)
    tokens = [str(a) for a in args]
    if tokens and not tokens[0].startswith("-"):
        raise SwitchyardError(f"engine flags start with a dash, not {tokens[0]!r}",
                              "put the engine's own flags after `--`, e.g. `-- --n-cpu-moe 4`")
    fields: dict[str, Any] = {}
    extra: list[str] = []
    kv: dict[str, str] = {}
    index = 0
    while index < len(tokens):
        flag, inline = flag_name(adapter, tokens[index])
        takes_value = flag not in adapter.valueless_flags and inline is None and index + 1 < len(tokens) \
            and not (tokens[index + 1].startswith("-") and not is_number(tokens[index + 1]))
        value = inline if inline is not None else (tokens[index + 1] if takes_value else None)
        step = 2 if takes_value else 1
        instead = adapter.owned_flags.get(flag)
        if instead is not None:
            typed = tokens[index].partition("=")[0] if inline is not None else tokens[index]
            raise SwitchyardError(f"{_as_read(adapter, typed, flag)} is set by the plan the fit checked, not by "
                                  "engine flags",
                                  f"use {instead}")
        name, kind = adapter.counted_flags.get(flag, ("", ""))
        if kind == "kv":
            kv[flag] = _text(flag, value)
        elif kind == "rules":
            fields[name] = (*fields.get(name, ()), _rules(flag, value))
        elif kind:
            fields[name] = _READ[kind](flag, value)
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


def _text(flag: str, value: str | None) -> str:
    if not value:
        raise SwitchyardError(f"{flag} needs a value")
    return value


def _rules(flag: str, value: str | None) -> str:
    """An -ot value as typed, once llama-server would take it: every comma-separated part `PATTERN=BUFFER`."""
    text = _text(flag, value)
    bad = [part for part in text.split(",") if "=" not in part]
    if bad:
        raise SwitchyardError(f"{flag} {text}: {bad[0]!r} is not PATTERN=BUFFER (llama-server refuses it)",
                              r"e.g. -ot 'blk\.(0|1)\.ffn_.*_exps\.weight=CPU'")
    return text


def _switch(flag: str, value: str | None) -> bool | None:
    """llama-server's on|off|auto (auto: the plan's None, the engine decides)."""
    states = {"on": True, "off": False, "auto": None}
    if value not in states:
        raise SwitchyardError(f"{flag} takes on, off or auto, not {value!r}")
    return states[value]


def _count(flag: str, value: str | None) -> int:
    if value is None:
        raise SwitchyardError(f"{flag} needs a value (a whole number of layers)")
    if not value.isdigit():
        raise SwitchyardError(f"{flag} takes a whole number of layers, not {value!r}")
    return int(value)


def _mib(flag: str, value: str | None) -> int:
    """llama-server's --cache-ram in MiB; its -1 (no limit) is refused: the fit cannot count an unbounded cache."""
    if value is None or not value.isdigit():
        raise SwitchyardError(f"{flag} takes a whole number of MiB (0 = no prompt cache in RAM), not {value!r}",
                              "leave it out: the plan sets what this machine's RAM can spare")
    return int(value)


def _tokens(flag: str, value: str | None) -> int:
    if value is None or not value.isdigit() or int(value) < 1:
        raise SwitchyardError(f"{flag} takes a whole number of tokens, not {value!r}",
                              "e.g. --image-max-tokens 1024: how many tokens one image may become")
    return int(value)


def _images(flag: str, value: str | None) -> int:
    """vLLM's --limit-mm-per-prompt: the images a request may carry, from its JSON (`{"image": 2}`)."""
    import json

    try:
        data = json.loads(_text(flag, value))
    except ValueError:
        data = None
    count = data.get("image") if isinstance(data, dict) and set(data) <= {"image"} else None
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise SwitchyardError(f"{flag} {value}: the plan counts images only, as JSON like '{{\"image\": 2}}'",
                              "give the number of images one request may carry; other modalities are not served")
    return count


def _gib(flag: str, value: str | None) -> float:
    try:
        gib = float(value or "")
    except ValueError:
        gib = -1.0
    if not 0 <= gib <= 1 << 20:
        raise SwitchyardError(f"{flag} takes a number of GiB, not {value!r}")
    return gib


_READ: dict[str, Callable[[str, str | None], Any]] = {
    "count": lambda flag, value: _count(flag, value),
    "all_layers": lambda _flag, _value: ALL_LAYERS,
    "switch": lambda flag, value: _switch(flag, value),
    "true": lambda _flag, _value: True,
    "false": lambda _flag, _value: False,
    "text": lambda flag, value: _text(flag, value),
    "gib": lambda flag, value: _gib(flag, value),
    "mib": lambda flag, value: _mib(flag, value),
    "path": lambda flag, value: Path(_text(flag, value)).expanduser().absolute(),  # a stored plan: no cwd
    "tokens": lambda flag, value: _tokens(flag, value),
    "images": lambda flag, value: _images(flag, value),
}
