"""One snapshot, one answer (issue 49, item 4): on a busy RTX A5000 (18.05 of 23.54 GiB free, driver 550, no CUDA
toolkit recorded) `fit`, `serve --dry-run`, `recommend`, the Hub listing's tag and `engines install --dry-run` plan
the same vLLM utilization and the same llama.cpp build.

Expected values are worked out by hand from the snapshot: vLLM starts only when free memory >= utilization x total
(less the ~0.45 GiB the driver keeps, which torch does not count as total), and llama.cpp publishes no Linux CUDA
build, so without nvcc a Linux NVIDIA machine gets the prebuilt Vulkan build."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import run_cli

from desktop.core.machine.hardware import GIB, HardwareSnapshot

SNAPSHOT = Path(__file__).parent / "snapshots" / "a5000_busy.json"
GPT_OSS = Path(__file__).parent / "fixtures" / "models" / "gpt-oss-20b"
DRIVER_RESERVED_GIB = 0.45


def cli_json(*args: str) -> Any:
    done = run_cli(*args, "--hardware", str(SNAPSHOT))
    assert done.returncode in (0, 1), done.stderr
    return json.loads(done.stdout)


def test_the_snapshot_is_the_machine_of_the_issue() -> None:
    hardware = HardwareSnapshot.load(SNAPSHOT)
    gpu = hardware.gpus[0]
    assert round(gpu.memory_total_bytes / GIB, 2) == 23.54 and round(gpu.memory_free_bytes / GIB, 2) == 18.05
    assert gpu.driver_version.startswith("550") and not hardware.toolchain


def test_fit_serve_recommend_and_the_listing_plan_one_vllm_utilization() -> None:
    fit = cli_json("fit", str(GPT_OSS), "--engine", "vllm", "--json", "--no-history")
    same_asks = cli_json("fit", str(GPT_OSS), "--engine", "vllm", "--json", "--no-history", "--ctx", "2048",
                         "--parallel", "4")
    dry = cli_json("serve", "--model", str(GPT_OSS), "--engine", "vllm", "--dry-run", "--json", "--no-install")
    recommended = cli_json("recommend", str(GPT_OSS), "--json")
    vllm = recommended if recommended["engine"] == "vllm" else recommended["runner_up"]
    utils = {fit["plan"]["gpu_memory_utilization"], same_asks["plan"]["gpu_memory_utilization"],
             dry["plan"]["gpu_memory_utilization"], vllm["plan"]["gpu_memory_utilization"]}
    assert len(utils) == 1, utils
    util = utils.pop()
    total, free = 23.54 - DRIVER_RESERVED_GIB, 18.05 - DRIVER_RESERVED_GIB
    assert util * total <= free < (util + 0.02) * total  # vLLM starts, and little of what is free is left out
    assert dry["plan"]["ctx_per_request"] == same_asks["plan"]["ctx_per_request"] == 2048
    assert fit["fits"] == same_asks["fits"] == dry["fit"]["fits"] == "yes", (fit["notes"], same_asks["notes"])

    from desktop.core.planning.fit import quick_verdict

    config = json.loads((GPT_OSS / "config.json").read_text())
    weights = int(fit["breakdown"]["bytes.weights"]) if "bytes.weights" in fit["breakdown"] else \
        int(fit["weights_gib"] * GIB)
    hardware = HardwareSnapshot.load(SNAPSHOT)
    assert quick_verdict("vllm", weights, config, hardware) == "yes"
    assert quick_verdict("vllm", weights, None, hardware) == "yes"  # the listing without a config


def test_fit_recommend_and_engines_install_name_one_llama_cpp_build() -> None:
    fit = cli_json("fit", str(GPT_OSS), "--engine", "llama.cpp", "--json", "--no-history")
    recommended = cli_json("recommend", str(GPT_OSS), "--json")
    llama = recommended if recommended["engine"] == "llama.cpp" else recommended["runner_up"]
    install = cli_json("engines", "install", "llama.cpp", "--dry-run", "--json")
    assert fit["plan"]["backend"] == llama["plan"]["backend"] == install[0]["variant"] == "vulkan"
    assert install[0]["source"] == "release"
