"""MXFP4 and NVFP4 checkpoints sized as they load, and per GPU generation: gpt-oss-20b (its real config.json,
tests/fixtures/models/gpt-oss-20b) is ~13 GiB, not 39; vLLM runs MXFP4 from compute capability 8.0 and says why
not below it, and the recommendation then follows llama.cpp, which runs MXFP4 everywhere."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import installed_vllm_package, run_cli

from desktop.core.machine.hardware import GIB, HardwareSnapshot
from desktop.core.models.facts import facts_from_config, facts_from_path, hf_weight_bytes, param_parts
from desktop.core.models.quants import FORMATS
from desktop.core.planning.export.sizing import QUANT_BYTES
from desktop.core.planning.fit import estimate, sizing_plan
from desktop.core.planning.recommend import Workload, recommend
from desktop.core.planning.weights import GGUF_BPW, gguf_ladder

HERE = Path(__file__).parent
SNAPDIR = HERE / "snapshots"
GPT_OSS_20B = HERE / "fixtures" / "models" / "gpt-oss-20b" / "config.json"
# openai/gpt-oss-20b's safetensors on the Hub: about 13 GiB (12.8 GiB; its card advertises 16 GB GPUs)
GPT_OSS_20B_CHECKPOINT_GIB = 13.0
LLAMA_8B = json.loads((HERE / "fixtures" / "models" / "llama8b-bf16" / "config.json").read_text())


def snap(name: str) -> HardwareSnapshot:
    return HardwareSnapshot.load(SNAPDIR / f"{name}.json")


def gpu_like(base: str, name: str, capability: str, vram_gib: float | None = None) -> HardwareSnapshot:
    """A recorded machine with its GPU swapped for another generation (name, compute capability, memory)."""
    hardware = snap(base)
    gpu = hardware.gpus[0]
    total = int(vram_gib * GIB) if vram_gib else gpu.memory_total_bytes
    gpu = replace(gpu, name=name, compute_capability=capability, memory_total_bytes=total,
                  memory_free_bytes=min(gpu.memory_free_bytes, total - int(0.3 * GIB)))
    return replace(hardware, gpus=[gpu])


T4 = ("rtx3090", "Tesla T4", "7.5", 15.0)


def vllm_fit(hardware: HardwareSnapshot, ctx: int = 8192, quant: str | None = None):  # type: ignore[no-untyped-def]
    facts = facts_from_path(GPT_OSS_20B)
    return estimate(facts, hardware, sizing_plan("vllm", ctx_per_request=ctx, slots=16), quant=quant)


def test_gpt_oss_20b_is_sized_as_its_mxfp4_checkpoint_not_as_bf16() -> None:
    facts = facts_from_path(GPT_OSS_20B)
    assert (facts.quantization, facts.quant_bits) == ("mxfp4", 4.25)
    assert set(facts.quant_kept) == {"attention", "router", "embedding", "head"}  # modules_to_not_convert
    assert facts.n_experts == 32 and facts.n_experts_active == 4
    assert facts.weights_bytes is not None
    assert facts.weights_bytes / GIB == pytest.approx(GPT_OSS_20B_CHECKPOINT_GIB, rel=0.05)
    bf16 = hf_weight_bytes(replace(facts, quant_bits=None, quantization=None, dtype="bfloat16"))
    assert bf16 / GIB == pytest.approx(38.9, abs=0.2)  # what the fit said before: every weight at 16 bits
    parts = param_parts(facts)
    experts_bytes = parts["experts"] * 4.25 / 8
    assert facts.weights_bytes == pytest.approx(experts_bytes + (sum(parts.values()) - parts["experts"]) * 2, rel=1e-6)


def test_gpt_oss_20b_fits_a_24_gb_ampere_gpu_with_vllm() -> None:
    result = vllm_fit(snap("rtx3090"))
    assert result.fits == "yes", result.notes
    assert result.weights_gib == pytest.approx(GPT_OSS_20B_CHECKPOINT_GIB, rel=0.05)
    assert any("MXFP4 on compute capability 8.6: vLLM uses Marlin kernels" in note for note in result.notes)
    assert result.plan is not None and result.plan.quantization is None  # vLLM reads mxfp4 from the config


@pytest.mark.parametrize(("base", "gpu", "capability", "how"), [
    ("a100_40gb", "NVIDIA A100-SXM4-40GB", "8.0", "Marlin kernels"),
    ("rtx4090", "NVIDIA GeForce RTX 4090", "8.9", "Marlin kernels"),
    ("h100_80gb", "NVIDIA H100 80GB HBM3", "9.0", "native kernels"),
    ("h100_80gb", "NVIDIA B200", "10.0", "native kernels"),
    ("rtx4090", "NVIDIA GeForce RTX 5090", "12.0", "Marlin kernels"),
])
def test_mxfp4_runs_on_vllm_from_ampere_and_the_note_says_how(base: str, gpu: str, capability: str,
                                                              how: str) -> None:
    result = vllm_fit(gpu_like(base, gpu, capability))
    assert result.fits == "yes", result.notes
    assert any(f"MXFP4 on compute capability {float(capability):.1f}: vLLM uses {how}" in n for n in result.notes)


def test_on_a_t4_vllm_says_no_naming_mxfp4_and_the_capability() -> None:
    result = vllm_fit(gpu_like(*T4))
    assert result.fits == "no"
    assert result.notes[0] == ("vLLM needs compute capability 8.0 for MXFP4; this Tesla T4 is 7.5: llama.cpp "
                               "runs it")


def test_on_a_t4_the_recommendation_is_llama_cpp_with_the_mxfp4_gguf_and_says_why() -> None:
    facts = facts_from_path(GPT_OSS_20B)
    answer = recommend(facts, gpu_like(*T4), Workload(concurrency=8, lifetime_hours=24))
    assert answer.engine == "llama.cpp"
    assert answer.quant == "MXFP4"
    assert answer.fit.fits == "yes"
    assert any("vLLM needs compute capability 8.0 for MXFP4; this Tesla T4 is 7.5" in r for r in answer.reasons)
    assert answer.runner_up is not None and "compute capability 8.0" in answer.runner_up["why_lost"]
    on_ampere = recommend(facts, snap("rtx3090"), Workload(concurrency=8, lifetime_hours=24))
    assert on_ampere.engine == "vllm"  # the same workload on a GPU that runs MXFP4: vLLM is back in the race


def test_fit_quant_mxfp4_for_llama_cpp_sizes_the_experts_at_4_25_bits() -> None:
    result = run_cli("fit", str(GPT_OSS_20B), "--engine", "llama.cpp", "--quant", "MXFP4", "--json",
                     "--no-history", "--hardware", str(SNAPDIR / "rtx3090.json"))
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["quant"] == "MXFP4" and answer["fits"] == "yes"
    # llama-quantize's MXFP4_MOE: experts at 4.25 bits, the rest at Q8_0 (ggml-org/gpt-oss-20b-GGUF's file is
    # about 12.1 GB)
    assert answer["breakdown"]["bytes.weights"] / 1e9 == pytest.approx(12.1, rel=0.03)


def test_mxfp4_is_in_the_gguf_table_and_in_the_ladder_of_moe_models_only() -> None:
    assert GGUF_BPW["MXFP4"] == 4.25
    assert "MXFP4" in gguf_ladder(facts_from_path(GPT_OSS_20B))
    assert gguf_ladder(facts_from_path(GPT_OSS_20B))[0] == "MXFP4"  # its own format first: nothing above adds bits
    assert "MXFP4" not in gguf_ladder(facts_from_config(LLAMA_8B))
    dense = estimate(facts_from_config(LLAMA_8B), snap("rtx4090"), sizing_plan("llama.cpp", ctx_per_request=4096),
                     quant="MXFP4")
    q8 = estimate(facts_from_config(LLAMA_8B), snap("rtx4090"), sizing_plan("llama.cpp", ctx_per_request=4096),
                  quant="Q8_0")
    assert dense.weights_gib == q8.weights_gib
    assert any("MXFP4 quantizes MoE experts only" in note for note in dense.notes)


def test_nvfp4_checkpoints_are_read_in_both_config_shapes() -> None:
    modelopt = {**LLAMA_8B, "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                                    "exclude_modules": ["lm_head"]}}
    compressed = {**LLAMA_8B, "quantization_config": {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                                                                          "group_size": 16}}}}}
    for config in (modelopt, compressed):
        facts = facts_from_config(config)
        assert (facts.quantization, facts.quant_bits) == ("nvfp4", 4.5)
        # 6.98 B parameters at 4.5 bits (3.93 GB) beside the 1.05 B of embeddings and head at BF16 (2.10 GB)
        assert facts.weights_bytes / 1e9 == pytest.approx(6.03, rel=0.01)
    t4 = estimate(facts_from_config(modelopt), gpu_like(*T4), sizing_plan("vllm", ctx_per_request=4096, slots=8))
    assert t4.fits == "yes" and any("NVFP4 on compute capability 7.5: vLLM uses Marlin kernels" in n
                                       for n in t4.notes)
    b200 = estimate(facts_from_config(modelopt), gpu_like("h100_80gb", "NVIDIA B200", "10.0"),
                    sizing_plan("vllm", ctx_per_request=4096, slots=8))
    assert any("NVFP4 on compute capability 10.0: vLLM uses native kernels" in n for n in b200.notes)


def test_the_export_sizing_reads_the_same_table() -> None:
    for name, fmt in FORMATS.items():
        assert QUANT_BYTES[name] == fmt.bits / 8


def test_the_capabilities_are_the_installed_vllms() -> None:
    """Read from the pinned vLLM's quantization configs, not from memory: an upgrade that moves a floor fails here."""
    package = installed_vllm_package()
    if package is None:
        pytest.skip("vLLM is not installed here (`switchyard engines install vllm`)")
    quantization = package / "model_executor" / "layers" / "quantization"

    def floor(source: str, config_class: str) -> float:
        text = (quantization / source).read_text()
        body = text[text.index(f"class {config_class}("):]
        found = re.search(r"def get_min_capability\(cls\) -> int:\s+(?:#[^\n]*\n\s+)*return (\d+)", body)
        assert found is not None, config_class
        return int(found.group(1)) / 10

    assert floor("mxfp4.py", "Mxfp4Config") == FORMATS["mxfp4"].vllm_min_cc
    assert floor("modelopt.py", "ModelOptNvFp4Config") == FORMATS["nvfp4"].vllm_min_cc


@pytest.fixture(scope="module")
def mxfp4_gguf() -> Path:
    """The tiny Qwen3-MoE-shaped model as llama-quantize's MXFP4_MOE writes it (experts MXFP4, the rest Q8_0)."""
    from desktop.core.models.archs import ensure_arch

    return ensure_arch("qwen3moe", gguf_types=("MXFP4",)).gguf_paths["MXFP4"]


def test_an_mxfp4_gguf_is_read_as_mxfp4_and_sized_from_its_tensors(mxfp4_gguf: Path) -> None:
    from desktop.core.models.facts import facts_from_gguf, read_gguf_header

    facts = facts_from_gguf(mxfp4_gguf)
    assert facts.gguf_type == "MXFP4_MOE" and facts.tensor_types.get("MXFP4", 0) > 0
    experts = [(shape, kind) for name, shape, kind in read_gguf_header(mxfp4_gguf).tensors if "_exps." in name]
    assert experts and all(kind == 39 for _shape, kind in experts)  # GGML_TYPE_MXFP4
    assert facts.tensor_type_bytes["MXFP4"] == sum(math.prod(shape) * 17 // 32 for shape, _kind in experts)
    hardware = snap("rtx3090")
    plan = sizing_plan("llama.cpp", ctx_per_request=2048)
    own = estimate(facts, hardware, plan)
    assert own.quant == "MXFP4" and own.breakdown["bytes.weights"] == facts.weights_bytes
    asked = estimate(facts, hardware, plan, quant="MXFP4")  # the file's own type: its real bytes, not a table
    assert asked.breakdown["bytes.weights"] == facts.weights_bytes


@pytest.mark.engine
@pytest.mark.llamacpp
def test_the_real_llama_server_serves_the_mxfp4_gguf(mxfp4_gguf: Path, llama_install: object) -> None:
    result = run_cli("serve", "--engine", "llama.cpp", "--model", str(mxfp4_gguf), "--prompt", "Hello",
                     "--max-tokens", "4", "--json", "--no-install", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["usage"]["completion_tokens"] == 4
