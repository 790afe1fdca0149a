"""Small helpers shared by the CLI subcommands."""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

from desktop.core.common.text import escape_controls


def to_jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if hasattr(value, "to_json"):
            return to_jsonable(value.to_json())
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def cell(value: Any) -> str:
    """A value as one table cell, safe to print: control characters become visible escapes (`\\x1b`), so a
    request's `model`, a remote repo name or an error text can never drive the operator's terminal. Every table
    the CLI prints goes through this."""
    return escape_controls("-" if value is None else str(value))


def emit_json(value: Any) -> None:
    json.dump(to_jsonable(value), sys.stdout, indent=2)
    sys.stdout.write("\n")
    sys.stdout.flush()


def stderr_progress(event: Any) -> None:
    """Progress sink printing to stderr (stdout stays clean for --json)."""
    fraction = getattr(event, "fraction", None)
    prefix = f"[{fraction * 100:5.1f}%] " if isinstance(fraction, float) else ""
    print(f"{prefix}{event.message}", file=sys.stderr, flush=True)


class LazyChoices(Sequence[str]):
    """argparse `choices` read from a core module only when a parser checks or prints them, so registering every
    command for `switchyard --help` loads no engine code. Give the argument a `metavar` too: argparse iterates
    the choices to build a default metavar when the argument is added."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def _names(self) -> tuple[str, ...]:
        return tuple(getattr(importlib.import_module(self.module), self.name))

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...
    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, value: object) -> bool:
        return value in self._names()


def print_described(described: dict[str, Any], name: str | None = None) -> None:
    """A dry run's plan as a person reads it: the argv, its environment, the fit's verdict (serve, bench, ab)."""
    import shlex

    if name:
        print(f"{name}:")
    print(shlex.join(described["argv"]))
    for key, value in described["env"].items():
        print(f"  env {key}={value}")
    fit = described["fit"]
    print(f"fits: {fit['fits']} on {fit['device']}: {fit['total_gib']:.2f} GiB of "
          f"{fit['available_gib']:.2f} GiB (weights {fit['weights_gib']:.2f}, KV {fit['kv_cache_gib']:.2f})")
    for note in fit.get("notes") or ():
        print(f"  note: {note}")


def capability_lines(rows: list[dict[str, Any]], roles: dict[str, str]) -> list[str]:
    """The capability table (serving.capabilities.table) as lines: what the traffic used and what each plan was
    launched to support (`roles`: the row key -> the column's title)."""
    if not rows:
        return []
    out = ["  capabilities   traffic (last used)  " + "".join(f"{title:>10}" for title in roles.values())]
    for row in rows:
        ago = row.get("traffic_s_ago")
        used = "-" if ago is None else f"{ago:.0f} s ago"
        out.append(f"  {cell(row['capability']):14} {used:>19}  "
                   + "".join(f"{cell(row.get(key) or '-'):>10}" for key in roles))
    return out
