"""Cold-start phases and "Prepare vLLM" with the real engines: `serve --json` prints the stacked phases the Serve
page's bar shows; `engines prepare vllm` fills the compile cache of exactly the plan the endpoint launches (in
the app's cache folder, per model and plan), and the next start of that plan finds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from desktop.core.runtime.supervisor import COLD_START_PHASES

pytestmark = [pytest.mark.engine]
ORDER = [phase.key for phase in COLD_START_PHASES]


def _cli(*args: str, env: dict[str, str], timeout: float = 1500) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "desktop", *args], capture_output=True, text=True,  # noqa: S603
                          timeout=timeout, env=env)


@pytest.mark.llamacpp
def test_serve_json_prints_the_stacked_phases(llama_install: Any, demo_model: Any, tmp_path: Path) -> None:
    env = {**os.environ, "SWITCHYARD_HOME": str(tmp_path / "home")}
    done = _cli("serve", "--engine", "llama.cpp", "--model", "demo", "--prompt", "Hello", "--max-tokens", "4",
                "--json", env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    cold = json.loads(done.stdout)["cold_start"]
    keys = [p["phase"] for p in cold["phases"]]
    assert keys[:2] == ["process", "weights"] and "api" in keys
    assert [ORDER.index(k) for k in keys] == sorted(ORDER.index(k) for k in keys)
    assert all(a["end_s"] == b["start_s"] for a, b in zip(cold["phases"], cold["phases"][1:], strict=False))
    assert cold["phases"][-1]["end_s"] == cold["t1_health_s"]  # --prompt: the CLI's own request times T2/T3


@pytest.mark.vllm
def test_prepare_vllm_fills_the_plans_compile_cache_and_the_next_start_finds_it(vllm_install: Any, demo_model: Any,
                                                                                tmp_path: Path) -> None:
    env = {**os.environ, "SWITCHYARD_HOME": str(tmp_path / "home"),
           "SWITCHYARD_VLLM_COMPILE_CACHE": str(tmp_path / "compile")}
    first = _cli("engines", "prepare", "vllm", "--model", "demo", "--ctx", "512", "--parallel", "1", "--json",
                 env=env)
    assert first.returncode == 0, first.stderr
    prepared = json.loads(first.stdout)
    assert not prepared["was_warm"] and prepared["compile_cache"] == "miss"
    cache = Path(prepared["cache_dir"])
    assert cache.parent == tmp_path / "compile"  # the app's folder, one per model and plan
    assert any((cache / "inductor").rglob("*.so"))  # vLLM CPU: Inductor's cache (AOT off, see engines.vllm)
    phases = [p["phase"] for p in prepared["cold_start"]["phases"]]
    assert phases[:3] == ["process", "weights", "compile"] and phases[-1] == "first_request"

    again = _cli("engines", "prepare", "vllm", "--model", "demo", "--ctx", "512", "--parallel", "1", "--json",
                 env=env)
    assert again.returncode == 0, again.stderr
    warm = json.loads(again.stdout)
    assert warm["was_warm"] and warm["cache_dir"] == prepared["cache_dir"]
    # CPU: compiled again from the filled Inductor cache ("warm"); CUDA: vLLM loads its AOT artefact ("hit")
    assert warm["compile_cache"] in ("hit", "warm")
    assert warm["cold_start"]["phases"][2]["phase"] == "compile"

