"""The estimator against published, MEASURED startup logs (tests/data/fit_points.json holds the figures and the
model facts). Sources, one per point:

vLLM "Available KV cache memory" (kv_cache_size) and whether it started:
- https://github.com/vllm-project/vllm/issues/10517  Llama-3.1-8B, RTX 3090, max_model_len 20000 (3.81 GiB, started)
- https://github.com/vllm-project/vllm/issues/10517  same, max_model_len 29000 (2.89 GiB, refused: 23648 < 29000)
- https://github.com/vllm-project/vllm/issues/13061  DeepSeek-R1-Distill-Qwen-14B, 2x RTX 4090 TP 2 (8.69 GiB, refused)
- https://github.com/vllm-project/vllm/issues/13882  Qwen2.5-7B AWQ, RTX 4060 8 GB, util 0.7 (-1.05 GiB, refused)
vLLM "GPU KV cache size: N tokens" for a logged KV memory:
- https://github.com/vllm-project/vllm/issues/10517  3.81 GiB -> 1952 blocks (31,232 tokens); 2.89 GiB -> 23,648
- https://github.com/LMCache/LMCache/issues/1739       Qwen3-14B 6.51 GiB -> 42,656 tokens
- https://github.com/vllm-project/vllm/issues/21348  Qwen3-235B-A22B TP 4, 8.11 GiB -> 178,880 tokens
- https://github.com/vllm-project/vllm/issues/25350  Qwen3-30B-A3B FP8, fp8 KV: 10.55 GiB -> 230,528 tokens;
  5.59 GiB -> estimated maximum model length 122,080
llama.cpp model / KV / compute buffer sizes:
- https://github.com/mozilla-ai/llamafile/pull/552   TriLM 3.9B, n_ctx 512: KV 180 MiB, compute 105 MiB
- https://github.com/ggml-org/llama.cpp/pull/8035    Llama-3-70B, n_ctx 8192: KV 2560 MiB, compute 1108.5 MiB
- https://github.com/ggml-org/llama.cpp/pull/6122    Command-R 35B, n_ctx 4096: KV 5120 MiB, compute 672 MiB

Targets: median relative error <= 10% on vLLM KV-cache memory and on llama.cpp total memory, and no wrong
start/no-start verdict where the true margin exceeds 10%.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from desktop.core.machine.hardware import GIB, MIB, CpuInfo, HardwareSnapshot, hypothetical
from desktop.core.models.facts import ModelFacts, facts_from_config
from desktop.core.planning import fit

POINTS: dict[str, Any] = json.loads((Path(__file__).parent / "data" / "fit_points.json").read_text())
BASE = HardwareSnapshot(gpus=[], cpu=CpuInfo("test", "x86_64", 16, 32), ram_total_bytes=256 * GIB,
                        ram_available_bytes=250 * GIB, disk_free_bytes=None, os="Linux")


def model(name: str) -> ModelFacts:
    return facts_from_config(POINTS["models"][name], name=name)


def vllm_case(point: dict[str, Any]) -> tuple[float, fit.FitResult]:
    facts = replace(model(point["model"]), weights_bytes=int(point["weights_gib_per_gpu"] * point["tp"] * GIB))
    hw = hypothetical(BASE, gpu_name=point["gpu"], gpu_count=point["tp"])
    result = fit.estimate(facts, hw, fit.sizing_plan(
        "vllm", ctx_per_request=point["max_model_len"], slots=256, gpu_memory_utilization=point["util"],
        tensor_parallel=point["tp"], max_num_batched_tokens=point["max_num_batched_tokens"]),
        cuda_graphs_in_budget=point["cuda_graphs_in_budget"])
    b = result.breakdown
    kv = b["budget"] - b["weights"] - b["activation_peak"] - b["non_torch"]  # before clamping at zero, like the log
    return kv, result


def llama_case(point: dict[str, Any]) -> tuple[float, float, float, float]:
    facts = replace(model(point["model"]), source="gguf", quantization="gguf:Q4_K_M",
                    weights_bytes=int(point["weights_mib"] * MIB))
    hw = hypothetical(BASE, gpu_mem_gib=256)
    result = fit.estimate(facts, hw, fit.sizing_plan("llama.cpp", ctx_per_request=point["ctx"], slots=1,
                                                     ubatch=point["ubatch"], flash_attn=point["flash_attn"]))
    kv_mib = result.breakdown["kv_cache"] * 1024
    compute_mib = result.breakdown["compute_buffers"] * 1024
    predicted = point["weights_mib"] + kv_mib + compute_mib
    measured = point["weights_mib"] + point["measured_kv_mib"] + point["measured_compute_mib"]
    return kv_mib, compute_mib, predicted, measured


def rel(pred: float, true: float) -> float:
    return abs(pred - true) / abs(true)


def test_at_least_twelve_cited_points() -> None:
    groups = ("vllm_available_kv", "vllm_kv_tokens", "llamacpp")
    points = [p for g in groups for p in POINTS[g]]
    assert len(points) >= 12
    assert all(p["source"].startswith("https://github.com/") for p in points)


def test_vllm_kv_cache_memory_median_error_within_10_percent() -> None:
    memory = [rel(vllm_case(p)[0], p["measured_kv_gib"]) for p in POINTS["vllm_available_kv"]]
    errors = memory + [rel(fit.vllm_kv_tokens(model(p["model"]), p["kv_gib"] * GIB, p["tp"], p["kv_cache_dtype"]),
                   p["measured_tokens"]) for p in POINTS["vllm_kv_tokens"]]
    median = statistics.median(errors)
    print(f"vLLM KV-cache median relative error: {median:.3%} over {len(errors)} points (max {max(errors):.1%}); "
          f"available-KV-memory points alone: {statistics.median(memory):.2%}")
    assert median <= 0.10 and statistics.median(memory) <= 0.10


@pytest.mark.parametrize("point", POINTS["vllm_available_kv"], ids=lambda p: p["id"])
def test_vllm_start_verdicts_match_the_logs(point: dict[str, Any]) -> None:
    kv, result = vllm_case(point)
    facts = model(point["model"])
    need = fit.vllm_kv_bytes_per_token(facts, point["tp"], "auto", point["max_model_len"]) * point["max_model_len"]
    true_margin = (point["measured_kv_gib"] * GIB - need) / need
    if abs(true_margin) > 0.10:
        assert (result.fits == "yes") == point["measured_starts"], result.notes


def test_llama_cpp_total_memory_median_error_within_10_percent() -> None:
    totals, kvs, computes = [], [], []
    for p in POINTS["llamacpp"]:
        kv, compute, predicted, measured = llama_case(p)
        totals.append(rel(predicted, measured))
        kvs.append(rel(kv, p["measured_kv_mib"]))
        computes.append(rel(compute, p["measured_compute_mib"]))
    print(f"llama.cpp total median error {statistics.median(totals):.3%}; KV {statistics.median(kvs):.3%}; "
          f"compute buffers {statistics.median(computes):.3%}")
    assert statistics.median(totals) <= 0.10
    assert statistics.median(kvs) <= 0.02  # the KV formula is exact
    assert statistics.median(computes) <= 0.10
