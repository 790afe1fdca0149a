"""Writing the models list (`models.yaml`) the CLI's `serve --config` reads, so the GUI's models editor and a
hand-edited file are the same thing. Reading and validating stay in `serving.fleet` (one parser): every write
is checked by parsing what would be written, so the editor can never save a file the CLI refuses."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from desktop.core.common import paths
from desktop.core.common.errors import SwitchyardError
from desktop.core.serving.fleet import ModelEntry, ModelsConfig, parse_models_config

MODELS_FILE = "models.yaml"


def default_models_path() -> Path:
    """Where the app keeps its models list unless the user picks another file."""
    return paths.config_dir() / MODELS_FILE


def entry_data(entry: ModelEntry) -> dict[str, Any]:
    """One entry as the YAML mapping, leaving defaults out so the file stays short."""
    data: dict[str, Any] = {"name": entry.name, "engine": entry.engine, "model": entry.model}
    if entry.ctx != 2048:
        data["ctx"] = entry.ctx
    if entry.parallel != 4:
        data["parallel"] = entry.parallel
    if entry.ttl is not None:
        data["ttl"] = int(entry.ttl) if float(entry.ttl).is_integer() else entry.ttl
    if entry.loading_status:
        data["loading_status"] = True
    if not entry.prefix_cache:
        data["prefix_cache"] = False
    if entry.extra_routes:
        data["extra_routes"] = list(entry.extra_routes)
    for key in ("tool_parser", "reasoning_parser"):
        if getattr(entry, key) is not None:
            data[key] = getattr(entry, key)
    if entry.reasoning_effort != "auto":
        data["reasoning_effort"] = entry.reasoning_effort
    if entry.args:
        data["args"] = list(entry.args)
    if entry.kind != "chat":
        data["kind"] = entry.kind
    return data


def dump_models_yaml(config: ModelsConfig) -> str:
    """The YAML text for `config`; raises SwitchyardError when it would not parse back to the same list."""
    text = "# Switchyard models list: `switchyard serve --config " + MODELS_FILE + "` (also edited on the Serve page)\n"
    text += yaml.safe_dump({"models": [entry_data(e) for e in config.models]}, sort_keys=False,
                           default_flow_style=False, allow_unicode=True)
    again = parse_models_config(yaml.safe_load(text), config.source)
    if again.models != config.models:
        raise SwitchyardError("the models list does not survive being written", "report this as a bug")
    return text


def validate_entries(entries: list[dict[str, Any]], source: str = "models list") -> ModelsConfig:
    """Validate entries as the CLI would (names unique, engines known, numbers in range)."""
    return parse_models_config({"models": entries}, source)


def write_models_config(config: ModelsConfig, path: str | Path) -> Path:
    """Write atomically (a temporary file renamed over the old one) with owner-only permissions."""
    target = Path(path).expanduser()
    text = dump_models_yaml(config)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temp = tempfile.mkstemp(prefix=".models-", suffix=".yaml", dir=target.parent)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                stream.write(text)
            os.chmod(temp, 0o600)
            os.replace(temp, target)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise SwitchyardError(f"cannot write {target}: {exc.strerror or exc}", "pick a writable file") from exc
    return target
