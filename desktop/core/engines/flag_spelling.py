"""The name an engine's own parser reads a flag under, whatever its spelling (engine_args has the why): apart
from engine_args so that an adapter can read its person's flags without importing every adapter."""

from __future__ import annotations

import re

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.base import EngineAdapter


def _split(token: str) -> tuple[str, str | None]:
    flag, sep, value = token.partition("=")
    return (flag, value) if sep and flag.startswith("--") else (token, None)


def flag_name(adapter: EngineAdapter, token: str) -> tuple[str, str | None]:
    """The flag `token` is to its engine's parser, and the value written into the token (`--flag=value`, `-qfp8`),
    so that the tables are looked up under the name the engine will act on, whatever the spelling."""
    if adapter.flag_syntax != "argparse":  # llama-server: `_` is `-` in a `--` name (common/arg.cpp)
        flag, value = _split(token)
        return (flag.replace("_", "-") if flag.startswith("--") else flag), value
    known = {*adapter.owned_flags, *adapter.counted_flags, *adapter.valueless_flags}
    if token.startswith("--") and token != "--":
        flag, value = _split(token)
        name, dot, rest = flag.partition(".")
        flag = name.replace("_", "-") + dot + rest  # vLLM: up to the first `.` (its dotted config keys keep theirs)
        if flag in known or dot:
            return flag, value
        prefixed = sorted({f for f in known if f.startswith(flag) and f.startswith("--")})
        if len(prefixed) > 1:
            raise SwitchyardError(f"{token} is an abbreviation {adapter.display_name} would read as any of "
                                  f"{', '.join(prefixed)}", "write the flag out in full")
        return (prefixed[0] if prefixed else flag), value
    if token.startswith("-") and len(token) > 2 and not is_number(token):
        flag, sep, value = token.partition("=")
        if sep:
            return flag, value
        if token not in known and token[:2] in known:  # a one-letter option with its value attached: -qfp8
            return token[:2], token[2:]
    return token, None


def is_number(text: str) -> bool:
    return bool(re.fullmatch(r"-?\d+(\.\d+)?", text))
