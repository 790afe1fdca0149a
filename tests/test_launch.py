"""Issue 53: `switchyard launch claude|codex` runs the real agents (npm, pinned as in test_coding_agents) wired to
the endpoint, starting the endpoint first when none runs; `--restore` leaves Codex's config byte for byte as it
was; `launch --env`, sourced in bash, lets the official openai and anthropic SDKs reach a keyed endpoint; and with
the demo's 4,096-token plan `launch claude` says the context is too small before the agent starts.

The engine behind the endpoint is the stand-in (tests/standin_engine.py) as llama-server, through the CLI's
SWITCHYARD_LLAMA_SERVER setting, which `launch` passes on to the endpoint it starts. The model is the demo GGUF
written again with a 131,072-token window (gguf_tools.with_context_length): the agents' needs are checked
against the model's real metadata, no download."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import run_cli, serve_until_ready
from gguf_tools import with_context_length
from test_coding_agents import (
    ANSWER,
    CLAUDE_CODE,
    CODEX,
    STANDIN,
    STANDIN_BINARY,
    _agent_env,
    _installed,
    stop,
)

from desktop.core.common import paths
from desktop.core.runtime.ports import find_free_port

LAUNCH_TIMEOUT_S = 300  # the endpoint's start (stand-in: seconds) and one agent run
WINDOW = 131_072


@pytest.fixture(scope="module")
def claude_code() -> Path:
    return _installed(*CLAUDE_CODE)


@pytest.fixture(scope="module")
def codex() -> Path:
    return _installed(*CODEX)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory, demo_model: Any) -> Path:
    """The demo's weights with a 131,072-token window."""
    folder = tmp_path_factory.mktemp("long-model")
    return with_context_length(demo_model.path_for("gguf"), folder / "long-demo.gguf", WINDOW)


@pytest.fixture
def standin(tmp_path: Path) -> tuple[Path, Path]:
    """(script, bodies): a stand-in `llama-server` recording every request it gets."""
    bodies = tmp_path / "bodies.jsonl"
    script = tmp_path / "llama-server-standin"
    script.write_text(f"#!{sys.executable}\n" + STANDIN_BINARY.format(standin=str(STANDIN),
                                                                       options=["--bodies", str(bodies)]))
    script.chmod(0o755)
    return script, bodies


def _seen(bodies: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in bodies.read_text().splitlines()] if bodies.exists() else []


def _launch_env(home: Path, script: Path, *bins: Path, **extra: str) -> dict[str, str]:
    """The agents' sealed environment (temp HOME, loopback only) plus what switchyard itself reads: its state
    folder (the session's), the shared engines and demo cache (found from the real HOME), the stand-in engine."""
    env = _agent_env(home, **extra)
    env["PATH"] = os.pathsep.join([*(str(b.parent) for b in bins), os.path.dirname(sys.executable), env["PATH"]])
    env.update(SWITCHYARD_HOME=os.environ["SWITCHYARD_HOME"], SWITCHYARD_ENGINES_DIR=str(paths.engines_dir()),
               SWITCHYARD_CACHE_DIR=str(paths.cache_dir()), SWITCHYARD_LLAMA_SERVER=str(script),
               DISABLE_TELEMETRY="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", PYTHONPATH=str(Path.cwd()))
    return env


def _launch(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "desktop", "launch", *args], capture_output=True, text=True,  # noqa: S603
                          env=env, cwd=cwd, timeout=LAUNCH_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)


@pytest.fixture
def stops_endpoints() -> Iterator[list[int]]:
    """Ports of endpoints a test's `launch` started: stopped afterwards, however the test ends."""
    ports: list[int] = []
    yield ports
    for port in ports:
        run_cli("stop", "--port", str(port))


def _requests(port: int) -> list[dict[str, Any]]:
    done = run_cli("requests", "--json", "--port", str(port))
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout)["requests"])


def test_launch_claude_starts_the_endpoint_then_claude_answers_through_it(
        claude_code: Path, long_model: Path, standin: tuple[Path, Path], tmp_path: Path,
        stops_endpoints: list[int]) -> None:
    script, bodies = standin
    port = find_free_port()
    stops_endpoints.append(port)
    home = tmp_path / "home"
    home.mkdir()
    assert not run_cli("status", "--port", str(port)).returncode == 0  # nothing serves there yet
    done = _launch(["claude", "--model", str(long_model), "--engine", "llama.cpp", "--port", str(port),
                    "--", "-p", "Say hi."], _launch_env(home, script, claude_code), home)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ANSWER in done.stdout, done.stdout + done.stderr
    assert "starting the endpoint" in done.stderr and f"`switchyard stop --port {port}` stops it" in done.stderr
    # the endpoint launch started serves on after Claude Code exited, with room beyond Claude Code's ~25k need
    status = json.loads(run_cli("status", "--json", "--port", str(port)).stdout)
    assert status["state"] == "serving" and status["active"]["plan"]["ctx_per_request"] == 32_768, status
    # the request log shows Claude Code's requests, with every tier on the served model
    logged = [r for r in _requests(port) if r["path"].startswith("/v1/messages")]
    assert logged and all(r["status"] == 200 for r in logged), logged
    assert {r["model"] for r in logged} == {"switchyard"}, logged
    asked = [r for r in _seen(bodies) if r["path"].startswith("/v1/messages")]
    assert asked[0]["headers"]["user-agent"].startswith(f"claude-cli/{CLAUDE_CODE[1]} "), asked[0]["headers"]
    assert {r["body"]["model"] for r in asked} == {"switchyard"}, asked
    assert "x-anthropic-billing-header" not in json.dumps(asked[0]["body"].get("system"))


def test_launch_codex_writes_its_profile_and_restore_puts_the_users_config_back(
        codex: Path, long_model: Path, standin: tuple[Path, Path], tmp_path: Path,
        stops_endpoints: list[int]) -> None:
    script, bodies = standin
    port = find_free_port()
    stops_endpoints.append(port)
    home, codex_home = tmp_path / "home", tmp_path / "home" / ".codex"
    codex_home.mkdir(parents=True)
    mine = '# my own settings\nmodel = "gpt-5"\napproval_policy = "never"\n\n[profiles.work]\nmodel = "o3"\n'
    my_profile = '# an older switchyard profile of my own\nmodel = "mine"\n'
    (codex_home / "config.toml").write_text(mine)
    (codex_home / "switchyard.config.toml").write_text(my_profile)
    env = _launch_env(home, script, codex)
    done = _launch(["codex", "--model", str(long_model), "--engine", "llama.cpp", "--port", str(port), "--",
                    "exec", "--skip-git-repo-check", "Say hi."], env, home)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ANSWER in done.stdout + done.stderr, done.stdout + done.stderr
    asked = [r for r in _seen(bodies) if r["path"] == "/v1/responses"]
    assert asked and asked[0]["body"]["model"] == "switchyard", asked
    assert asked[0]["headers"]["user-agent"].startswith(f"codex_exec/{CODEX[1]} "), asked[0]["headers"]
    assert any(r["path"] == "/v1/responses" and r["status"] == 200 for r in _requests(port))
    # what launch wrote: a profile file on the Responses API at the endpoint; the user's config.toml untouched
    assert (codex_home / "config.toml").read_text() == mine
    written = tomllib.loads((codex_home / "switchyard.config.toml").read_text())
    provider = written["model_providers"]["switchyard"]
    assert provider["base_url"] == f"http://127.0.0.1:{port}/v1/" and provider["wire_api"] == "responses"
    catalog = json.loads(Path(written["model_catalog_json"]).read_text())
    assert catalog["models"][0]["slug"] == "switchyard" and catalog["models"][0]["context_window"] == 65_536
    restored = _launch(["codex", "--restore"], env, home)
    assert restored.returncode == 0, restored.stderr
    # byte for byte as they were, and nothing of launch's left
    assert (codex_home / "config.toml").read_text() == mine
    assert (codex_home / "switchyard.config.toml").read_text() == my_profile
    left = {"switchyard-models.json", "switchyard-launch.json", "switchyard.config.toml.switchyard-backup"}
    assert not left & {p.name for p in codex_home.iterdir()}, sorted(p.name for p in codex_home.iterdir())


def test_launch_env_sourced_in_bash_lets_the_official_sdks_reach_a_keyed_endpoint(
        standin: tuple[Path, Path], tmp_path: Path) -> None:
    script, _bodies = standin
    port = find_free_port()
    key = "launch-env-test-key-7f3a"
    proc, ready = serve_until_ready("--engine", "llama.cpp", "--model", "demo", "--proxy-port", str(port),
                                    "--api-key-env", "TEST_ENDPOINT_KEY",
                                    env={**os.environ, "SWITCHYARD_LLAMA_SERVER": str(script),
                                         "TEST_ENDPOINT_KEY": key})
    try:
        assert ready.startswith(f"ready: http://127.0.0.1:{port}/v1"), ready
        exports = run_cli("launch", "--env")
        assert exports.returncode == 0, exports.stderr
        assert f"export OPENAI_BASE_URL=http://127.0.0.1:{port}/v1\n" in exports.stdout
        clients = (
            "import anthropic, openai\n"
            "o = openai.OpenAI(max_retries=0)\n"  # OPENAI_BASE_URL, OPENAI_API_KEY from the environment
            "a = anthropic.Anthropic(max_retries=0)\n"  # ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY likewise
            "print('openai:', o.chat.completions.create(model='switchyard', max_tokens=8,"
            " messages=[{'role': 'user', 'content': 'hi'}]).choices[0].message.content)\n"
            "print('anthropic:', a.messages.create(model='switchyard', max_tokens=8,"
            " messages=[{'role': 'user', 'content': 'hi'}]).content[0].text)\n")
        bare = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_"))}
        bare.update(NO_PROXY="127.0.0.1", no_proxy="127.0.0.1", EXPORTS=exports.stdout, CLIENTS=clients,
                    PY=sys.executable)
        done = subprocess.run(["bash", "-c", 'eval "$EXPORTS" && "$PY" -c "$CLIENTS"'], capture_output=True,  # noqa: S607
                              text=True, env=bare, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        # what the stand-in answers: a whole chat completion ("hi from <name>"), an Anthropic message (its chunks)
        assert "openai: hi from standin" in done.stdout and f"anthropic: {ANSWER}" in done.stdout, done.stdout
        # the same SDK without the key is refused: the key in the exports is what let it in
        bare.update(EXPORTS=exports.stdout.replace(key, "wrong-key"))
        refused = subprocess.run(["bash", "-c", 'eval "$EXPORTS" && "$PY" -c "$CLIENTS"'], capture_output=True,  # noqa: S607
                                 text=True, env=bare, timeout=120, check=False)
        assert refused.returncode != 0 and "401" in refused.stderr, refused.stderr[-2000:]
    finally:
        stop(proc)


def _serve_standin(script: Path, port: int, *args: str) -> subprocess.Popen[str]:
    """`switchyard serve --engine llama.cpp ARGS --proxy-port PORT` on the stand-in, once it serves."""
    proc, ready = serve_until_ready("--engine", "llama.cpp", *args, "--proxy-port", str(port),
                                    env={**os.environ, "SWITCHYARD_LLAMA_SERVER": str(script)})
    if not ready.startswith(f"ready: http://127.0.0.1:{port}/v1"):
        stop(proc)
        pytest.fail(f"the endpoint did not get ready: {ready}", pytrace=False)
    return proc


def _fake_agent(folder: Path, name: str) -> tuple[Path, Path]:
    """An executable called NAME that only leaves a mark when run: whether launch ever started the agent."""
    marker = folder / f"{name}-ran"
    folder.mkdir(parents=True, exist_ok=True)
    binary = folder / name
    binary.write_text(f"#!/bin/sh\ntouch {marker}\n")
    binary.chmod(0o755)
    return binary, marker


def test_with_the_demos_4096_token_plan_launch_claude_refuses_before_the_agent_starts(
        standin: tuple[Path, Path], tmp_path: Path) -> None:
    script, bodies = standin
    port = find_free_port()
    proc = _serve_standin(script, port, "--model", "demo", "--ctx", "4096", "--parallel", "1")
    try:
        binary, marker = _fake_agent(tmp_path / "bin", "claude")
        env = {**os.environ, "PATH": f"{binary.parent}{os.pathsep}{os.environ['PATH']}"}
        done = subprocess.run([sys.executable, "-m", "desktop", "launch", "claude", "--", "-p", "hi"],  # noqa: S603
                              capture_output=True, text=True, env=env, timeout=120, check=False)
        assert done.returncode != 0, done.stderr
        said = done.stderr
        assert "the context is too small for Claude Code" in said, said
        assert "served with a context of 4,096 tokens" in said and "needs about 25,000" in said, said
        assert "The model's own window is 4,096 tokens" in said, said  # the demo's trained window (demo.py)
        assert not marker.exists(), "the agent was started"
        assert not [r for r in _seen(bodies) if r["path"].startswith("/v1/messages")]
    finally:
        stop(proc)


def test_a_missing_agent_is_one_line_with_its_install_command_and_nothing_starts(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + "/usr/bin:/bin",
           "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "desktop", "launch", "codex", "--model", "demo"],  # noqa: S603
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert lines == ["switchyard: error: Codex CLI is not installed (no `codex` on PATH): "
                     "npm install -g @openai/codex"], lines
    assert not list(paths.run_dir().glob("endpoint-*.json"))  # no endpoint was started for it


def _recording_agent(folder: Path, name: str) -> tuple[Path, Path]:
    """An executable called NAME that writes its arguments and environment as JSON, then exits 0."""
    record = folder / f"{name}.json"
    folder.mkdir(parents=True, exist_ok=True)
    binary = folder / name
    binary.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                      f"open({str(record)!r}, 'w').write(json.dumps({{'argv': sys.argv[1:], 'env': dict(os.environ)}}))\n")
    binary.chmod(0o755)
    return binary, record


def test_launch_opencode_serves_the_asked_ctx_and_hands_opencode_its_limits(
        long_model: Path, standin: tuple[Path, Path], tmp_path: Path, stops_endpoints: list[int]) -> None:
    """`--ctx` sets what a started endpoint serves; OpenCode gets its provider inline with that context as
    limit.context (without it OpenCode takes 0 and never compacts) and the user's arguments after it."""
    script, _bodies = standin
    port = find_free_port()
    stops_endpoints.append(port)
    binary, record = _recording_agent(tmp_path / "bin", "opencode")
    home = tmp_path / "home"
    home.mkdir()
    done = _launch(["opencode", "--model", str(long_model), "--engine", "llama.cpp", "--port", str(port),
                    "--ctx", "70000", "--", "run", "hello there"], _launch_env(home, script, binary), home)
    assert done.returncode == 0, done.stdout + done.stderr
    ran = json.loads(record.read_text())
    assert ran["argv"] == ["run", "hello there"]
    config = json.loads(ran["env"]["OPENCODE_CONFIG_CONTENT"])
    provider = config["provider"]["switchyard"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"]["baseURL"] == f"http://127.0.0.1:{port}/v1"
    assert provider["models"]["switchyard"]["limit"]["context"] == 70_000
    assert config["model"] == "switchyard/switchyard"
    status = json.loads(run_cli("status", "--json", "--port", str(port)).stdout)
    assert status["active"]["plan"]["ctx_per_request"] == 70_000 and status["active"]["plan"]["slots"] == 1


def test_launch_claude_sets_what_ollama_launch_sets_and_uses_the_running_endpoint(
        long_model: Path, standin: tuple[Path, Path], tmp_path: Path) -> None:
    """An endpoint already serving is used as it is (nothing else starts); Claude Code's variables are the ones
    `ollama launch claude` sets (ollama cmd/launch/claude.go, ../shared/reference/agents.md), with the served
    model for every tier and compaction at the served context."""
    script, _bodies = standin
    port = find_free_port()
    proc = _serve_standin(script, port, "--model", str(long_model), "--ctx", "30000", "--model-name", "my-coder")
    try:
        binary, record = _recording_agent(tmp_path / "bin", "claude")
        env = {**os.environ, "PATH": f"{binary.parent}{os.pathsep}{os.environ['PATH']}"}
        done = subprocess.run([sys.executable, "-m", "desktop", "launch", "claude", "--", "-p", "hi"],  # noqa: S603
                              capture_output=True, text=True, env=env, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        assert "starting the endpoint" not in done.stderr
        ran = json.loads(record.read_text())
        assert ran["argv"] == ["--model", "my-coder", "-p", "hi"]
        got = ran["env"]
        expected = {"ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}", "ANTHROPIC_API_KEY": "",
                    "ANTHROPIC_DEFAULT_OPUS_MODEL": "my-coder", "ANTHROPIC_DEFAULT_SONNET_MODEL": "my-coder",
                    "ANTHROPIC_DEFAULT_HAIKU_MODEL": "my-coder", "CLAUDE_CODE_SUBAGENT_MODEL": "my-coder",
                    "CLAUDE_CODE_ATTRIBUTION_HEADER": "0", "CLAUDE_CODE_AUTO_COMPACT_WINDOW": "30000",
                    "DISABLE_ERROR_REPORTING": "1"}
        assert {k: got.get(k) for k in expected} == expected
        assert got["ANTHROPIC_AUTH_TOKEN"]  # Claude Code sends no request without one
        assert len([p for p in paths.run_dir().glob("endpoint-*.json")]) == 1  # the one the test started
    finally:
        stop(proc)


def test_a_context_the_fit_can_widen_is_offered_with_the_command_that_serves_it(
        long_model: Path, standin: tuple[Path, Path], tmp_path: Path) -> None:
    script, _bodies = standin
    port = find_free_port()
    proc = _serve_standin(script, port, "--model", str(long_model), "--ctx", "4096")
    try:
        binary, marker = _fake_agent(tmp_path / "bin", "codex")
        env = {**os.environ, "PATH": f"{binary.parent}{os.pathsep}{os.environ['PATH']}"}
        done = subprocess.run([sys.executable, "-m", "desktop", "launch", "codex"],  # noqa: S603
                              capture_output=True, text=True, env=env, timeout=300, check=False)
        assert done.returncode != 0 and not marker.exists(), done.stderr
        said = done.stderr
        assert "served with a context of 4,096 tokens" in said and "needs about 64,000" in said, said
        fits = re.search(r"This machine fits up to ([\d,]+) tokens per request", said)
        assert fits and int(fits.group(1).replace(",", "")) >= 64_000, said
        assert f"`switchyard stop --port {port}`, then `switchyard launch codex --model {long_model} --ctx 65536`" \
            in said, said
    finally:
        stop(proc)


def test_an_endpoint_that_fails_to_start_is_reported_with_its_log_and_nothing_is_left(
        long_model: Path, tmp_path: Path) -> None:
    """The engine dies loading (the stand-in's out-of-memory line): launch says so with the end of the
    endpoint's log, the agent never runs, and no endpoint or engine process is left."""
    import psutil

    script = tmp_path / "llama-server-oom"
    script.write_text(f"#!{sys.executable}\n" + STANDIN_BINARY.format(standin=str(STANDIN),
                                                                       options=["--fail-ctx-above", "1000"]))
    script.chmod(0o755)
    binary, marker = _fake_agent(tmp_path / "bin", "claude")
    home = tmp_path / "home"
    home.mkdir()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    done = _launch(["claude", "--model", str(long_model), "--engine", "llama.cpp", "--port", str(find_free_port())],
                   _launch_env(home, script, binary), home)
    assert done.returncode != 0 and not marker.exists(), done.stderr
    assert "the endpoint did not start" in done.stderr and "its log ends" in done.stderr, done.stderr
    assert not list(paths.run_dir().glob("endpoint-*.json"))
    def ours(proc: psutil.Process) -> bool:  # this test's engine (it inherits the env), not another worker's
        try:
            return proc.environ().get("SWITCHYARD_LLAMA_SERVER") == str(script)
        except psutil.Error:
            return False

    left = [p for p in psutil.process_iter(["cmdline"]) if str(STANDIN) in " ".join(p.info["cmdline"] or [])
            and p.pid not in before and ours(p)]
    assert not left, left
