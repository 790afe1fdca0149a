"""User settings as a typed, versioned schema stored as JSON under `paths.config_dir()`.

Why versioned: settings outlive app versions. Every file carries `version`; `load()` runs the migrations from
the file's version up to SCHEMA_VERSION, so an old file keeps the user's choices instead of being reset. A file
that cannot be read is set aside (renamed `.bad`) and defaults are used, with a note saying so: nothing is lost.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from desktop.core.common import paths
from desktop.core.common.errors import SwitchyardError
from desktop.core.common.origins import parse_allowed_origins

log = logging.getLogger("switchyard.settings")

SCHEMA_VERSION = 5
SETTINGS_FILE = "settings.json"
WORKLOADS = ("chat", "long-context", "many-users", "batch")
ENGINES = ("auto", "llama.cpp", "vllm")


@dataclass(frozen=True)
class Settings:
    """What the user can set. Empty directory strings mean "use the default location"."""

    engines_dir: str = ""
    models_dir: str = ""
    endpoint_port: int = 8765
    default_workload: str = "chat"
    preferred_engine: str = "auto"
    # Web pages (origins) allowed to call the endpoint besides local ones; "*" allows any. Empty: local only.
    allowed_origins: tuple[str, ...] = ()
    # Electricity price per kWh in the user's currency, for the energy cost where NVML reports power; 0: not set.
    price_per_kwh: float = 0.0
    # The quality budget: the largest mean KL divergence from a higher-precision reference (`switchyard quality`)
    # a recommended quantization may have (docs/quality.md says why 0.05).
    kld_budget: float = 0.05
    version: int = SCHEMA_VERSION
    notes: tuple[str, ...] = field(default=(), compare=False)  # what load() had to fix; never saved

    def validated(self) -> Settings:
        """Self, or a SwitchyardError naming the bad field and the allowed values."""
        if not (1024 <= self.endpoint_port <= 65535):
            raise SwitchyardError(f"endpoint port must be between 1024 and 65535, not {self.endpoint_port}",
                                  "pick an unprivileged port such as 8765")
        if self.default_workload not in WORKLOADS:
            raise SwitchyardError(f"unknown workload '{self.default_workload}'", f"choose one of: {', '.join(WORKLOADS)}")
        if self.preferred_engine not in ENGINES:
            raise SwitchyardError(f"unknown engine '{self.preferred_engine}'", f"choose one of: {', '.join(ENGINES)}")
        for name in ("engines_dir", "models_dir"):
            value = getattr(self, name)
            if value and not Path(value).expanduser().is_absolute():
                raise SwitchyardError(f"{name.replace('_', ' ')} must be an absolute path, not '{value}'")
        if not (0.0 <= self.price_per_kwh <= 1000.0) or self.price_per_kwh != self.price_per_kwh:
            raise SwitchyardError(f"price per kWh must be between 0 and 1000, not {self.price_per_kwh}",
                                  "e.g. 0.30; 0 leaves the energy cost out")
        if not (0.0 < self.kld_budget <= 10.0):  # also refuses NaN
            raise SwitchyardError(f"the quality budget (a mean KL divergence) must be above 0 and at most 10, not "
                                  f"{self.kld_budget}", "e.g. 0.05 (see docs/quality.md)")
        if parse_allowed_origins(self.allowed_origins) != self.allowed_origins:
            raise SwitchyardError(f"allowed origins must be distinct, lower-case scheme://host[:port] entries or *, "
                                  f"not {list(self.allowed_origins)}", "e.g. http://192.168.1.5:3000")
        return self

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("notes")
        return data


# --- migrations: each takes the raw dict of version N and returns version N + 1 -------------------------------
def _v0_to_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v0 (unversioned, early builds) called the port `port` and the workload `workload`."""
    out = dict(data)
    if "port" in out:
        out["endpoint_port"] = out.pop("port")
    if "workload" in out:
        out["default_workload"] = out.pop("workload")
    return out


def _v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    """v2 added `preferred_engine`; v1 files get the default ("auto")."""
    return {**data, "preferred_engine": data.get("preferred_engine", "auto")}


def _v2_to_v3(data: dict[str, Any]) -> dict[str, Any]:
    """v3 added `allowed_origins`; v2 files allow local pages only, as before."""
    return {**data, "allowed_origins": data.get("allowed_origins", [])}


def _v3_to_v4(data: dict[str, Any]) -> dict[str, Any]:
    """v4 added `price_per_kwh` (energy cost from measured power); v3 files have none set (0)."""
    return {**data, "price_per_kwh": data.get("price_per_kwh", 0.0)}


def _v4_to_v5(data: dict[str, Any]) -> dict[str, Any]:
    """v5 added `kld_budget` (the quality budget of the quantization choice); v4 files get the default."""
    return {**data, "kld_budget": data.get("kld_budget", 0.05)}


MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {0: _v0_to_v1, 1: _v1_to_v2, 2: _v2_to_v3,
                                                                      3: _v3_to_v4, 4: _v4_to_v5}


def migrate(data: dict[str, Any]) -> dict[str, Any]:
    """Bring a raw settings dict from any known version up to SCHEMA_VERSION."""
    version = int(data.get("version", 0))
    if version > SCHEMA_VERSION:
        raise SwitchyardError(f"settings file is from a newer Switchyard (version {version})",
                              "update Switchyard, or delete the settings file to start over")
    while version < SCHEMA_VERSION:
        data = MIGRATIONS[version](data)
        version += 1
        data["version"] = version
    return data


def settings_path() -> Path:
    return paths.config_dir() / SETTINGS_FILE


def from_dict(data: dict[str, Any]) -> Settings:
    """Typed settings from a migrated dict; unknown keys are ignored, wrong types are a SwitchyardError."""
    known = {f.name: f for f in fields(Settings) if f.name != "notes"}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            continue
        default = getattr(Settings(), key)
        if isinstance(default, tuple) and isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = tuple(value)  # JSON has lists
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # JSON writes 1.0 as 1 when a person edits the file
        if isinstance(default, bool) or not isinstance(value, type(default)):
            raise SwitchyardError(f"setting '{key}' should be {type(default).__name__}, not {value!r}")
        values[key] = value
    return Settings(**values).validated()


def load(path: Path | None = None) -> Settings:
    """The saved settings, migrated; defaults when there is no file; a set-aside copy when it is unreadable."""
    path = path or settings_path()
    if not path.exists():
        return Settings()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise SwitchyardError("settings file does not hold a JSON object")
        original_version = int(raw.get("version", 0))
        loaded = from_dict(migrate(raw))
        if original_version != SCHEMA_VERSION:
            save(loaded, path)
        return loaded
    except (ValueError, SwitchyardError) as exc:
        bad = path.with_suffix(".json.bad")
        os.replace(path, bad)
        message = exc.message if isinstance(exc, SwitchyardError) else f"not valid JSON ({exc})"
        log.warning("settings file %s unusable: %s; moved to %s", path, message, bad)
        return replace(Settings(), notes=(f"settings file was unusable ({message}); kept a copy at {bad} "
                                          "and started from defaults",))


def save(settings: Settings, path: Path | None = None) -> Path:
    """Validate and write atomically (temp file + rename), so a crash never leaves half a file."""
    settings.validated()
    path = path or settings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=".settings-", suffix=".json", dir=path.parent)
    with os.fdopen(handle, "w", encoding="utf-8") as out:
        json.dump({**settings.to_json(), "version": SCHEMA_VERSION}, out, indent=2)
        out.write("\n")
    os.replace(temp, path)
    return path
