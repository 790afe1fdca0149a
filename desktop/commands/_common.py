"""Small helpers shared by the CLI subcommands."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any


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


def emit_json(value: Any) -> None:
    json.dump(to_jsonable(value), sys.stdout, indent=2)
    sys.stdout.write("\n")
    sys.stdout.flush()


def stderr_progress(event: Any) -> None:
    """Progress sink printing to stderr (stdout stays clean for --json)."""
    fraction = getattr(event, "fraction", None)
    prefix = f"[{fraction * 100:5.1f}%] " if isinstance(fraction, float) else ""
    print(f"{prefix}{event.message}", file=sys.stderr, flush=True)
