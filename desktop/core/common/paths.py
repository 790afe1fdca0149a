"""Where Switchyard keeps things, per user (platformdirs), overridable by environment for tests and CI.

Engines and the demo model are expensive to build, so they live outside any clone and are shared by every
checkout of the project on the machine; state (settings, history, logs) can be pointed elsewhere per test.
Every state folder is created 0700 and an existing one is tightened to it (desktop.core.common.private): history,
logs, pidfiles and engine sockets are this user's alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

from desktop.core.common.private import private_dir

_APP = "switchyard"


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else None


def data_dir() -> Path:
    """Settings, history database and pidfiles (SWITCHYARD_HOME overrides)."""
    return private_dir(_env_path("SWITCHYARD_HOME") or Path(platformdirs.user_data_dir(_APP)))


def engines_dir() -> Path:
    """Provisioned engines, shared across clones (SWITCHYARD_ENGINES_DIR overrides)."""
    path = _env_path("SWITCHYARD_ENGINES_DIR") or Path(platformdirs.user_data_dir(_APP)) / "engines"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)  # created private; an existing (shared) one is left as is
    return path


def cache_dir() -> Path:
    """Generated artefacts such as the demo model (SWITCHYARD_CACHE_DIR overrides)."""
    return private_dir(_env_path("SWITCHYARD_CACHE_DIR") or Path(platformdirs.user_cache_dir(_APP)))


def logs_dir() -> Path:
    return private_dir(data_dir() / "logs")


def run_dir() -> Path:
    """Pidfiles of engine processes we started, so a crashed app's leftovers can be reaped."""
    return private_dir(data_dir() / "run")


def config_dir() -> Path:
    return private_dir(_env_path("SWITCHYARD_HOME") or Path(platformdirs.user_config_dir(_APP)))
