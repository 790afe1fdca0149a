"""`switchyard serve --prompt` with each real engine: a streamed completion, phase times in order, and no engine
process left afterwards."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from desktop.core.common import unixhttp


def engine_processes_on(address: str) -> list[psutil.Process]:
    """Processes started with this port (after --port) or socket path (after --host/--uds)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(flag in cmdline and cmdline[cmdline.index(flag) + 1: cmdline.index(flag) + 2] == [address]
               for flag in ("--port", "--host", "--uds")):
            found.append(proc)
    return found


@pytest.mark.engine
@pytest.mark.parametrize(
    "engine",
    [pytest.param("llama.cpp", marks=pytest.mark.llamacpp), pytest.param("vllm", marks=pytest.mark.vllm)],
)
def test_serve_prompt_json(engine: str, request: pytest.FixtureRequest, isolated_state: Path) -> None:
    request.getfixturevalue("llama_install" if engine == "llama.cpp" else "vllm_install")
    request.getfixturevalue("demo_model")
    logs_before = set((isolated_state / "logs").glob("vllm-*.log"))
    result = subprocess.run(  # noqa: S603 - our own CLI
        [sys.executable, "-m", "desktop", "serve", "--engine", engine, "--model", "demo", "--prompt", "Hello",
         "--max-tokens", "16", "--json", "--no-install", *(["--vllm-eager"] if engine == "vllm" else [])],
        capture_output=True, text=True, timeout=900, env={**os.environ},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    report = json.loads(result.stdout)
    assert report["engine"] == engine
    assert report["completion"], "the engine streamed no text"
    assert report["usage"]["completion_tokens"] == 16
    phases = report["phases_s"]
    assert 0 < phases["ready"] <= phases["request_sent"] <= phases["first_token"] <= phases["done"]
    socket_path = unixhttp.socket_of(report["base_url"])  # --prompt talks to a private socket, not a TCP port
    assert socket_path is not None, report["base_url"]
    assert engine_processes_on(socket_path) == []
    assert not os.path.exists(socket_path)
    if engine == "vllm":
        (log,) = set((isolated_state / "logs").glob("vllm-*.log")) - logs_before
        assert_vllm_layout(log.read_text(errors="replace"), psutil.cpu_count(logical=True) or 1)


def assert_vllm_layout(log: str, logical_cores: int) -> None:
    """vLLM's own log of the start: on a machine where it computes on one core (vLLM reserves one of two for its
    engine loop) the model ran in the EngineCore, with no worker process; on more cores, in vLLM's own worker
    (issue 71: one Python import of vLLM and torch less per start on a 2-core machine)."""
    workers = re.findall(r"^\((?:VllmWorker|Worker)[\w-]* pid=\d+\)", log, re.MULTILINE)
    if logical_cores <= 2:
        assert "'distributed_executor_backend': 'uni'" in log, "vLLM was not told to run the model in EngineCore"
        assert workers == [], workers[:3]
        assert re.search(r"^\(EngineCore[\w-]* pid=\d+\).*Loading weights took", log, re.MULTILINE), log[-2000:]
    else:
        assert "distributed_executor_backend" not in log.split("non-default args", 1)[-1].split("\n", 1)[0]
        assert workers, "vLLM's own layout has a worker process on more than two cores"
