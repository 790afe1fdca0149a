"""End to end: `switchyard pull` a GGUF from the fake Hub, then `switchyard serve` the printed path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fakehub import FakeHub

pytestmark = [pytest.mark.engine, pytest.mark.llamacpp]

SWITCHYARD = [sys.executable, "-m", "desktop"]


def test_pull_then_serve(tmp_path: Path, llama_install, demo_model) -> None:  # type: ignore[no-untyped-def]
    """No skip guards: `serve`, the demo model and llama-server are all part of the product now, so a regression in
    any of them fails here (the conftest fixtures provision the engine and generate the demo model)."""
    demo_gguf = Path(demo_model.gguf_path)
    with FakeHub() as hub:
        hub.add_repo("demo/switchyard-demo-GGUF", {"demo-Q8_0.gguf": demo_gguf}, tags=["gguf"])
        env = dict(os.environ, HF_ENDPOINT=hub.endpoint, HF_HUB_CACHE=str(tmp_path / "hf-cache"),
                   SWITCHYARD_HOME=str(tmp_path / "home"), SWITCHYARD_NO_KEYRING="1",
                   HF_HUB_DISABLE_IMPLICIT_TOKEN="1")
        pulled = subprocess.run([*SWITCHYARD, "pull", "demo/switchyard-demo-GGUF:Q8_0"], env=env,
                                capture_output=True, text=True, timeout=120)
        assert pulled.returncode == 0, pulled.stderr
    model = Path(pulled.stdout.strip())
    assert model.read_bytes() == demo_gguf.read_bytes()
    served = subprocess.run(
        [*SWITCHYARD, "serve", "--engine", "llama.cpp", "--model", str(model), "--prompt", "Hi", "--json",
         "--no-install", "--max-tokens", "8", "--ready-timeout", "300"],
        env=env, capture_output=True, text=True, timeout=400,
    )
    assert served.returncode == 0, served.stderr[-2000:]
    result = json.loads(served.stdout)
    assert Path(result["model"]).resolve() == model.resolve()
    assert result["usage"] and result["usage"]["completion_tokens"] > 0
