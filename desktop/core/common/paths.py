"""Where Switchyard keeps things, per user (platformdirs), overridable by environment for tests and CI.

Engines and the demo model are expensive to build, so they live outside any clone and are shared by every
checkout of the project on the machine; state (settings, history, logs) can be pointed elsewhere per test.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

_APP = "switchyard"


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else None


def data_dir() -> Path:
    """Settings, history database and pidfiles (SWITCHYARD_HOME overrides)."""
    path = _env_path("SWITCHYARD_HOME") or Path(platformdirs.user_data_dir(_APP))
    path.mkdir(parents=True, exist_ok=True)
    return path


def engines_dir() -> Path:
    """Provisioned engines, shared across clones (SWITCHYARD_ENGINES_DIR overrides)."""
    path = _env_path("SWITCHYARD_ENGINES_DIR") or Path(platformdirs.user_data_dir(_APP)) / "engines"
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir() -> Path:
    """Generated artefacts such as the demo model (SWITCHYARD_CACHE_DIR overrides)."""
    path = _env_path("SWITCHYARD_CACHE_DIR") or Path(platformdirs.user_cache_dir(_APP))
    path.mkdir(parents=True, exist_ok=True)
    return path


def logs_dir() -> Path:
    path = data_dir() / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_dir() -> Path:
    """Pidfiles of engine processes we started, so a crashed app's leftovers can be reaped."""
    path = data_dir() / "run"
    path.mkdir(parents=True, exist_ok=True)
    return path


def config_dir() -> Path:
    path = _env_path("SWITCHYARD_HOME") or Path(platformdirs.user_config_dir(_APP))
    path.mkdir(parents=True, exist_ok=True)
    return path
