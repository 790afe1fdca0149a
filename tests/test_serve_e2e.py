"""`switchyard serve --prompt` with each real engine: a streamed completion, phase times in order, and no engine
process left afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from urllib.parse import urlparse

import psutil
import pytest


def engine_processes_on(port: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "--port" in cmdline and cmdline[cmdline.index("--port") + 1: cmdline.index("--port") + 2] == [str(port)]:
            found.append(proc)
    return found


@pytest.mark.engine
@pytest.mark.parametrize(
    "engine",
    [pytest.param("llama.cpp", marks=pytest.mark.llamacpp), pytest.param("vllm", marks=pytest.mark.vllm)],
)
def test_serve_prompt_json(engine: str, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue("llama_install" if engine == "llama.cpp" else "vllm_install")
    request.getfixturevalue("demo_model")
    result = subprocess.run(  # noqa: S603 - our own CLI
        [sys.executable, "-m", "desktop", "serve", "--engine", engine, "--model", "demo", "--prompt", "Hello",
         "--max-tokens", "16", "--json", "--no-install"],
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
    port = urlparse(report["base_url"]).port
    assert port is not None
    assert engine_processes_on(port) == []
