"""Fit verdicts and breakdowns for both engines on recorded machines, free-memory awareness, bad input, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from desktop.core.common.errors import SwitchyardError
from desktop.core.machine.hardware import GIB, MIB, HardwareSnapshot
from desktop.core.models.facts import ModelFacts, facts_from_config
from desktop.core.planning.fit import FitResult, estimate, quick_verdict, sizing_plan

SNAPDIR = Path(__file__).parent / "snapshots"
SNAPSHOTS = sorted(SNAPDIR.glob("*.json"))
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32,
            "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
            "vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
LLAMA_70B = {**LLAMA_8B, "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
             "intermediate_size": 28672}
QWEN_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896,
            "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
            "max_position_embeddings": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}


def fit(facts: ModelFacts, engine: str, hw: HardwareSnapshot, quant: str | None = None, **plan: object) -> FitResult:
    """The fit of a sizing plan: per-request ctx, slots 1 for llama.cpp and vLLM's default 256 max_num_seqs."""
    fields: dict[str, object] = {"slots": 256 if engine == "vllm" else 1, **plan}
    if "ctx_per_request" not in fields:
        fields["ctx_per_request"] = facts.context_length
    return estimate(facts, hw, sizing_plan(engine, **fields), quant=quant)  # type: ignore[arg-type]


def snap(name: str) -> HardwareSnapshot:
    return HardwareSnapshot.load(SNAPDIR / f"{name}.json")


def gguf_like(cfg: dict, quant_bytes_per_param: float = 0.61) -> ModelFacts:
    facts = facts_from_config(cfg)
    return replace(facts, source="gguf", quantization="gguf:Q4_K_M",
                   weights_bytes=int((facts.params or 0) * quant_bytes_per_param))


def test_llama_kv_cache_matches_llama_cpp_for_each_kv_type() -> None:
    facts = gguf_like(LLAMA_8B)
    hw = snap("h100_80gb")
    sizes = {t: fit(facts, "llama.cpp", hw, ctx_per_request=8192, kv_cache_type=t).kv_cache_gib * 1024
             for t in ("f16", "q8_0", "q4_0")}
    assert sizes == pytest.approx({"f16": 1024.0, "q8_0": 544.0, "q4_0": 288.0}, abs=1.0)


def test_slots_share_the_context() -> None:
    facts = gguf_like(LLAMA_8B)
    one = fit(facts, "llama.cpp", snap("rtx4090"), ctx_per_request=8192, slots=1)
    four = fit(facts, "llama.cpp", snap("rtx4090"), ctx_per_request=2048, slots=4)
    assert one.kv_cache_gib == four.kv_cache_gib and four.settings["ctx_per_slot"] == 2048
    assert four.plan is not None and four.plan.llama_ctx_size == 8192 and four.ctx == 2048


@pytest.mark.parametrize("path", SNAPSHOTS, ids=[p.stem for p in SNAPSHOTS])
@pytest.mark.parametrize("engine", ["llama.cpp", "vllm"])
def test_every_snapshot_gives_a_verdict_for_both_engines(path: Path, engine: str) -> None:
    hw = HardwareSnapshot.load(path)
    result = fit(facts_from_config(LLAMA_8B), engine, hw, ctx_per_request=4096)
    assert result.fits in ("yes", "partial", "no")
    data = json.loads(json.dumps(result.to_json()))
    assert {"weights_gib", "kv_cache_gib", "overhead_gib", "total_gib", "fits"} <= set(data)
    if engine == "vllm" and hw.cuda_gpus:
        assert data["kv_cache_tokens"] is not None and data["max_concurrency"] is not None


def test_partial_offload_for_70b_q4_on_a_4090() -> None:
    result = fit(gguf_like(LLAMA_70B), "llama.cpp", snap("rtx4090"), ctx_per_request=4096)
    assert result.fits == "partial"
    assert result.gpu_layers is not None and 20 < result.gpu_layers < 80
    assert result.cpu_ram_gib > 10
    forced = fit(gguf_like(LLAMA_70B), "llama.cpp", snap("rtx4090"), ctx_per_request=4096, gpu_layers=81)
    assert forced.fits == "no" and any("at most" in n for n in forced.notes)


def test_free_memory_not_total_decides() -> None:
    hw = snap("rtx4090")
    busy = replace(hw, gpus=[replace(hw.gpus[0], memory_free_bytes=6 * GIB, other_processes_bytes=17 * GIB)])
    facts = facts_from_config(QWEN_05B)
    assert fit(facts, "vllm", hw, ctx_per_request=4096).fits == "yes"
    refused = fit(facts, "vllm", busy, ctx_per_request=4096)
    assert refused.fits == "no" and any("gpu_memory_utilization to" in n for n in refused.notes)
    assert fit(gguf_like(LLAMA_8B), "llama.cpp", busy, ctx_per_request=4096).fits == "yes"
    tighter = replace(hw, gpus=[replace(hw.gpus[0], memory_free_bytes=3 * GIB)])
    assert fit(gguf_like(LLAMA_8B), "llama.cpp", tighter, ctx_per_request=4096).fits == "partial"


def test_vllm_refuses_when_one_request_does_not_fit() -> None:
    result = fit(facts_from_config(LLAMA_8B), "vllm", snap("rtx3090"))
    assert result.ctx == 131072 and result.fits == "no"
    assert any("refuse" in n for n in result.notes)
    shorter = fit(facts_from_config(LLAMA_8B), "vllm", snap("rtx3090"), ctx_per_request=8192)
    assert shorter.fits == "yes" and (shorter.kv_cache_tokens or 0) > 8192
    assert shorter.max_concurrency == pytest.approx((shorter.kv_cache_tokens or 0) / 8192, abs=0.01)


def test_small_models_still_pay_gibs_of_activation_on_vllm() -> None:
    result = fit(facts_from_config(QWEN_05B), "vllm", snap("h100_80gb"), ctx_per_request=4096)
    assert result.breakdown["activation_peak"] > 0.3
    assert result.overhead_gib > 1.0


def test_tensor_parallel_and_fp8() -> None:
    hw = snap("h100_80gb")
    facts = facts_from_config(LLAMA_70B)
    assert fit(facts, "vllm", hw, ctx_per_request=8192).fits == "no"  # 131 GiB of BF16 on one 80 GB card
    tight = fit(facts, "vllm", hw, "fp8", ctx_per_request=8192)  # ~68 GiB of FP8: KV too small at 0.9
    assert tight.fits == "no" and 60 < tight.weights_gib < 70
    fp8 = fit(facts, "vllm", hw, "fp8", ctx_per_request=8192, gpu_memory_utilization=0.95)
    assert fp8.fits == "yes" and (fp8.kv_cache_tokens or 0) >= 8192
    with pytest.raises(SwitchyardError, match="needs 2 GPUs"):
        fit(facts, "vllm", hw, ctx_per_request=8192, tensor_parallel=2)


def test_cpu_and_apple_machines() -> None:
    facts = gguf_like(LLAMA_8B)
    cpu = fit(facts, "llama.cpp", snap("cpu_laptop"), ctx_per_request=4096)
    assert cpu.fits == "yes" and cpu.device == "CPU" and cpu.gpu_layers == 0
    mac = fit(facts, "llama.cpp", snap("m2max_32gb"), ctx_per_request=4096)
    assert mac.fits == "yes" and mac.breakdown["gpu_context"] == 0
    assert fit(facts, "vllm", snap("m2max_32gb"), ctx_per_request=4096).fits == "no"


@pytest.mark.parametrize("settings", [{"ctx_per_request": 10**9}, {"ctx_per_request": 0}, {"ctx_per_request": -5},
                                      {"gpu_memory_utilization": 1.5}, {"kv_cache_type": "q9_9"}, {"slots": 0},
                                      {"tensor_parallel": 0}, {"quant": "Q7_X"}, {"dtype": "float128"}])
def test_bad_settings_are_clear_errors(settings: dict[str, object]) -> None:
    fields = dict(settings)
    quant = fields.pop("quant", None)
    with pytest.raises(SwitchyardError):
        fit(gguf_like(LLAMA_8B), "llama.cpp", snap("rtx4090"), quant, **{"ctx_per_request": 4096, **fields})


def test_unknown_engine() -> None:
    with pytest.raises(SwitchyardError, match="unknown engine"):
        fit(gguf_like(LLAMA_8B), "tgi", snap("rtx4090"))


def test_quick_verdict_for_hub_tags() -> None:
    hw = snap("rtx4090")
    assert quick_verdict("llama.cpp", 5 * GIB, LLAMA_8B, hw) == "yes"
    assert quick_verdict("llama.cpp", 40 * GIB, LLAMA_70B, hw) == "partial"
    assert quick_verdict("vllm", 16 * GIB, None, hw) == "yes"
    assert quick_verdict("vllm", 140 * GIB, None, hw) == "no"
    assert quick_verdict("llama.cpp", 300 * GIB, None, snap("cpu_laptop")) == "no"
    # no GPU: all of it in RAM is the whole fit (500 MiB x 1.2 + 0.5 GiB needs 1.09 GiB of RAM), never "partial"
    laptop = snap("cpu_laptop")
    assert laptop.ram_available_bytes > 1.1 * GIB and not laptop.gpus
    assert quick_verdict("llama.cpp", 500 * MIB, None, laptop) == "yes"
    # a GPU too small for the weights: the rest in RAM
    assert quick_verdict("llama.cpp", 30 * GIB, None, hw) == "partial"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "desktop", *args], capture_output=True, text=True, timeout=120,
                          check=False)


def test_cli_fit_json_for_hardware_the_user_does_not_have(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_70B))
    out = run_cli("fit", str(config), "--engine", "vllm", "--gpu", "H100", "--gpus", "2", "--tp", "2",
                  "--ctx", "8192", "--json", "--hardware", str(SNAPDIR / "cpu_laptop.json"))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["fits"] == "yes" and data["kv_cache_tokens"] > 8192 and data["max_concurrency"] > 1
    assert {"weights_gib", "kv_cache_gib", "overhead_gib", "total_gib"} <= set(data)
    out = run_cli("fit", str(config), "--gpu-mem-gib", "24", "--quant", "Q4_K_M", "--ctx", "4096", "--json",
                  "--hardware", str(SNAPDIR / "rtx4090.json"))  # 64 GB of RAM takes the layers left over
    assert json.loads(out.stdout)["fits"] == "partial" and out.returncode == 0


@pytest.mark.parametrize("args, message", [
    (("fit", "/nonexistent/model.gguf"), "no such file"),
    (("fit", "CONFIG", "--ctx", "999999999999"), "must be at most"),
    (("fit", "CONFIG", "--ctx", "1000000000"), "out of range"),
    (("fit", "CONFIG", "--gpu-mem-gib", "-8"), "must be greater than 0"),
    (("fit", "CONFIG", "--engine", "tgi"), "unknown engine"),
    (("fit", "NOTGGUF"), "neither a GGUF"),
    (("recommend", "CONFIG", "--concurrency", "0"), "concurrency"),
])
def test_cli_bad_input_is_one_clear_line(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_8B))
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00\x01garbage")
    argv = [str(config) if a == "CONFIG" else str(junk) if a == "NOTGGUF" else a for a in args]
    out = run_cli(*argv, "--hardware", str(SNAPDIR / "rtx4090.json"))
    assert out.returncode != 0
    assert "Traceback" not in out.stderr and message in out.stderr
