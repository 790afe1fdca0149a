"""Codex's config for `switchyard launch codex`: a profile file of its own, CODEX_HOME/switchyard.config.toml
(CODEX_HOME defaults to ~/.codex; `codex --profile switchyard` reads it), and a model catalog beside it; the
user's config.toml is never written. `--restore` puts things back as they were.

The first launch keeps what was there (a switchyard.config.toml of the user's own, as
`switchyard.config.toml.switchyard-backup`) and records what it wrote; `--restore` puts the kept bytes back (or
removes the file where there was none) when the file is still what launch wrote, and leaves a file edited since
alone, saying so. A file that would not parse as TOML is never written (tomllib, the standard library's reader,
checks it)."""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from desktop.core.agents.clients import CODEX_PROFILE, Connection, codex_catalog, codex_profile_toml
from desktop.core.common.errors import SwitchyardError

PROFILE = f"{CODEX_PROFILE}.config.toml"
CATALOG = "switchyard-models.json"
BACKUP_SUFFIX = ".switchyard-backup"
STATE = "switchyard-launch.json"  # what the first launch found and what the last one wrote


def codex_home(env: dict[str, str] | None = None) -> Path:
    environ = os.environ if env is None else env
    home = environ.get("CODEX_HOME")
    return Path(home) if home else Path(environ.get("HOME") or Path.home()) / ".codex"


@dataclass(frozen=True)
class CodexFiles:
    profile: Path
    catalog: Path
    backup: Path | None  # the user's own profile file of that name, kept; None where there was none


def _legacy_profile(config: Path) -> bool:
    """Whether config.toml selects or defines a `switchyard` profile itself (Codex then refuses the profile file)."""
    if not config.exists():
        return False
    try:
        parsed = tomllib.loads(config.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise SwitchyardError(f"{config} is not valid TOML ({exc}): Codex would not start either",
                              "fix the file (or move it away) and launch again") from exc
    profiles = parsed.get("profiles")
    return parsed.get("profile") == CODEX_PROFILE or (isinstance(profiles, dict) and CODEX_PROFILE in profiles)


def write(connection: Connection, home: Path) -> CodexFiles:
    """Write the profile and the catalog; keep a profile file of the user's own the first time."""
    home.mkdir(parents=True, exist_ok=True)
    profile, catalog, state_file = home / PROFILE, home / CATALOG, home / STATE
    if _legacy_profile(home / "config.toml"):
        raise SwitchyardError(f"{home / 'config.toml'} has a `{CODEX_PROFILE}` profile of its own, which Codex "
                              f"refuses beside {profile}", f"take `profile = \"{CODEX_PROFILE}\"` and "
                              f"[profiles.{CODEX_PROFILE}] out of config.toml, then launch again")
    state = json.loads(state_file.read_text()) if state_file.exists() else None
    if state is None:  # the first launch: keep what the user had
        backup = profile.with_name(profile.name + BACKUP_SUFFIX)
        existed = profile.exists()
        if existed:
            backup.write_bytes(profile.read_bytes())
        state = {"backup": str(backup) if existed else None}
    text = codex_profile_toml(connection, str(catalog))
    tomllib.loads(text)  # never write what Codex could not read
    catalog.write_text(json.dumps(codex_catalog(connection), indent=2) + "\n")
    profile.write_text(text)
    state["written"] = text
    state_file.write_text(json.dumps(state))
    return CodexFiles(profile, catalog, Path(state["backup"]) if state["backup"] else None)


def restore(home: Path) -> str:
    """Undo what launch wrote; returns what was done, in a sentence."""
    profile, catalog, state_file = home / PROFILE, home / CATALOG, home / STATE
    if not state_file.exists():
        return f"nothing to restore: `switchyard launch codex` has written nothing in {home}"
    state = json.loads(state_file.read_text())
    backup = Path(state["backup"]) if state.get("backup") else None
    current = profile.read_text() if profile.exists() else None
    if current is not None and current != state.get("written"):
        said = f"{profile} was edited after launch wrote it, so it stays as it is (delete it to undo)"
        if backup is not None and backup.exists():
            said += f"; the one you had before is {backup}"
            backup = None  # kept for the user
    elif backup is not None and backup.exists():
        profile.write_bytes(backup.read_bytes())
        said = f"{profile} is back as it was"
    else:
        profile.unlink(missing_ok=True)
        said = f"{profile} removed (there was none before launch)"
    catalog.unlink(missing_ok=True)
    if backup is not None:
        backup.unlink(missing_ok=True)
    state_file.unlink()
    return said
