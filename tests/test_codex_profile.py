"""Issue 53: Codex's profile file and its undo in the cases the agent test does not reach (no file before, a file
edited after launch, a legacy profile inside config.toml), and `launch --env`'s export lines read back by bash
exactly, whatever the key holds. Expected values are written out here or read back by bash and tomllib."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest

from desktop.core.agents import codex_home
from desktop.core.agents.clients import Connection, generic_env, shell_exports
from desktop.core.common.errors import SwitchyardError

CONNECTION = Connection(url="http://127.0.0.1:8800", model="switchyard", context=65_536, api_key=None)


def test_a_profile_launch_wrote_where_there_was_none_is_removed_again(tmp_path: Path) -> None:
    files = codex_home.write(CONNECTION, tmp_path)
    assert files.backup is None
    profile = tomllib.loads(files.profile.read_text())
    assert profile["model_provider"] == "switchyard" and profile["model"] == "switchyard"
    assert profile["model_providers"]["switchyard"]["base_url"] == "http://127.0.0.1:8800/v1/"
    codex_home.write(CONNECTION, tmp_path)  # a second launch: still one thing to undo
    said = codex_home.restore(tmp_path)
    assert "removed" in said and sorted(tmp_path.iterdir()) == []
    assert "nothing to restore" in codex_home.restore(tmp_path)


def test_a_profile_edited_after_launch_stays_and_the_users_older_one_is_kept(tmp_path: Path) -> None:
    (tmp_path / "switchyard.config.toml").write_text('model = "mine"\n')
    codex_home.write(CONNECTION, tmp_path)
    (tmp_path / "switchyard.config.toml").write_text('model = "edited after launch"\n')
    said = codex_home.restore(tmp_path)
    assert "edited after launch wrote it" in said
    assert (tmp_path / "switchyard.config.toml").read_text() == 'model = "edited after launch"\n'
    assert (tmp_path / "switchyard.config.toml.switchyard-backup").read_text() == 'model = "mine"\n'
    assert not (tmp_path / "switchyard-models.json").exists()


@pytest.mark.parametrize("legacy", ['profile = "switchyard"\n', '[profiles.switchyard]\nmodel = "x"\n'])
def test_a_switchyard_profile_inside_config_toml_is_refused_and_nothing_written(tmp_path: Path, legacy: str) -> None:
    (tmp_path / "config.toml").write_text(legacy)
    with pytest.raises(SwitchyardError, match="has a `switchyard` profile of its own"):
        codex_home.write(CONNECTION, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]
    assert (tmp_path / "config.toml").read_text() == legacy


def test_export_lines_read_back_exactly_in_bash() -> None:
    key = "k'ey with \"quotes\", $dollars and `ticks`"
    env = generic_env(Connection(url="http://127.0.0.1:8800", model="my model", context=4096, api_key=key))
    script = shell_exports(env) + 'printf "%s\\n" "$OPENAI_API_KEY" "$ANTHROPIC_API_KEY" "$OPENAI_BASE_URL" "$SWITCHYARD_MODEL"'
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)  # noqa: S607
    assert done.stdout.splitlines() == [key, key, "http://127.0.0.1:8800/v1", "my model"]
