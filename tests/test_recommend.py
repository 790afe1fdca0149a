"""Engine + quantization + settings recommendations for the seed's scenarios, with reasons and a runner-up."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.base import LaunchPlan
from desktop.core.machine.hardware import HardwareSnapshot, detect
from desktop.core.models.facts import facts_from_config
from desktop.core.planning.recommend import EngineMeasurement, Workload, default_gain, recommend

SNAPDIR = Path(__file__).parent / "snapshots"
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32,
            "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
            "vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
LLAMA2_13B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 40,
              "hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 40, "intermediate_size": 13824,
              "vocab_size": 32000, "max_position_embeddings": 4096, "torch_dtype": "float16"}


def snap(name: str) -> HardwareSnapshot:
    return HardwareSnapshot.load(SNAPDIR / f"{name}.json")


SCENARIOS = [
    # (name, snapshot, model, workload, engine, allowed quants)
    ("local dev, frequent restarts", "rtx4090", LLAMA_8B,
     Workload(concurrency=1, prompt_len=1500, output_len=500, lifetime_hours=1, restarts_per_day=30),
     "llama.cpp", {"Q8_0", "Q6_K"}),
    ("edge / CPU", "cpu_laptop", LLAMA_8B, Workload(concurrency=1, lifetime_hours=24), "llama.cpp", {"Q4_K_M"}),
    ("Apple laptop", "m2max_32gb", LLAMA_8B, Workload(concurrency=2, lifetime_hours=8), "llama.cpp",
     {"Q8_0", "Q6_K"}),
    ("high-concurrency API on a big GPU", "h100_80gb", LLAMA_8B,
     Workload(concurrency=32, prompt_len=1000, output_len=300, lifetime_hours=720), "vllm", {"bf16"}),
    ("offline batch", "a100_40gb", LLAMA_8B,
     Workload(concurrency=64, prompt_len=2000, output_len=500, lifetime_hours=6), "vllm", {"bf16"}),
    ("8 GB GPU with a 13B model", "rtx4060_8gb", LLAMA2_13B,
     Workload(concurrency=1, prompt_len=1000, output_len=500, lifetime_hours=4), "llama.cpp",
     {"Q4_K_M", "IQ4_XS", "Q3_K_M"}),
]


@pytest.mark.parametrize("name, machine, cfg, workload, engine, quants", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_seed_scenarios(name: str, machine: str, cfg: dict, workload: Workload, engine: str, quants: set[str]) -> None:
    rec = recommend(facts_from_config(cfg), snap(machine), workload)
    assert rec.engine == engine, rec.reasons
    assert rec.quant in quants, (rec.quant, rec.reasons)
    assert rec.reasons and all(isinstance(r, str) and r for r in rec.reasons)
    assert rec.runner_up is not None and rec.runner_up["engine"] != engine and rec.runner_up["why_lost"]
    assert rec.numbers["cold_start_source"] == {"llama.cpp": "default", "vllm": "default"}
    plan = rec.launch_plan()
    assert isinstance(plan, LaunchPlan) and plan.engine == engine and plan.ctx_per_request >= workload.prompt_len
    json.dumps(rec.to_json())


def test_high_concurrency_settings_are_sane() -> None:
    rec = recommend(facts_from_config(LLAMA_8B), snap("h100_80gb"), Workload(concurrency=32, lifetime_hours=720))
    assert rec.key_settings["max_num_seqs"] >= 32 and rec.key_settings["max_concurrency"] >= 32
    assert rec.plan.gpu_memory_utilization == 0.9 and rec.plan.slots == rec.key_settings["max_num_seqs"]
    assert rec.numbers["vllm_throughput_gain"] == pytest.approx(3.0)


def test_measurements_replace_the_defaults_and_reasons_say_so() -> None:
    facts = facts_from_config(LLAMA_8B)
    workload = Workload(concurrency=8, lifetime_hours=2, restarts_per_day=12)
    assert recommend(facts, snap("rtx4090"), workload).engine == "vllm"
    measured = [EngineMeasurement("vllm", cold_start_s=900, output_tok_s=400, concurrency=8),
                EngineMeasurement("llama.cpp", cold_start_s=8, output_tok_s=380, concurrency=8)]
    rec = recommend(facts, snap("rtx4090"), workload, measurements=measured)
    assert rec.engine == "llama.cpp"
    assert rec.numbers["cold_start_s"] == {"llama.cpp": 8, "vllm": 900}
    assert rec.numbers["throughput_gain_source"] == "measured"
    assert any("measured" in r for r in rec.reasons)
    as_mapping = recommend(facts, snap("rtx4090"), workload, measurements={"vllm": {"cold_start_s": 60.0}})
    assert as_mapping.numbers["cold_start_source"]["vllm"] == "measured"


def test_gain_curve() -> None:
    assert default_gain(1) == 1.0 and default_gain(8) == pytest.approx(3.0) and default_gain(64) == pytest.approx(3.0)
    assert 1.0 < default_gain(2) < default_gain(4) < 3.0
    assert default_gain(1, cpu=True) == pytest.approx(0.6) and default_gain(32, cpu=True) == pytest.approx(0.9)


def test_this_machine_recommends_llama_cpp_with_reasons() -> None:
    """On this machine as detected: without a CUDA GPU llama.cpp wins with CPU reasons; with one, the plan runs
    on that GPU and its fit was checked against the memory that is free there (never asserts nothing)."""
    hw = detect()
    if not hw.cuda_gpus:
        # what RAM is free moves with whatever else runs (a parallel test run on a 24 GiB CI box leaves too little
        # for the 8B bf16 checkpoint); this test is about the engine choice, so it states 64 GiB free
        hw = replace(hw, ram_total_bytes=max(hw.ram_total_bytes, 64 * 2**30), ram_available_bytes=64 * 2**30)
    rec = recommend(facts_from_config(LLAMA_8B), hw, Workload())
    assert rec.fit is not None and rec.fit.plan is not None
    if not hw.cuda_gpus:
        assert rec.engine == "llama.cpp"
        assert any("CPU" in r for r in rec.reasons)
        # vLLM's CPU build is a candidate: it loses on the stated default, not to a sentence
        assert rec.runner_up is not None and rec.runner_up["engine"] == "vllm" and rec.runner_up["fits"] == "yes"
        assert "default" in rec.runner_up["why_lost"]
        assert rec.fit.device == "CPU" and rec.fit.plan.backend == "cpu"
    else:
        assert rec.fit.device != "CPU" and rec.fit.plan.backend in ("cuda", "rocm", "vulkan")
        assert rec.fit.available_gib <= max(g.memory_free_bytes for g in hw.gpus) * len(hw.gpus) / 2**30 + 0.01
        assert rec.runner_up is not None and rec.runner_up["engine"] in ("llama.cpp", "vllm")


def test_gguf_models_keep_their_quantization() -> None:
    facts = replace(facts_from_config(LLAMA_8B), source="gguf", quantization="gguf:Q5_K_M", weights_bytes=5_700_000_000,
                    path="/models/llama-q5.gguf")
    rec = recommend(facts, snap("h100_80gb"), Workload(concurrency=32, lifetime_hours=720))
    assert rec.engine == "llama.cpp" and rec.quant == "Q5_K_M"  # vLLM needs the safetensors checkpoint
    assert str(rec.plan.model_path) == "/models/llama-q5.gguf"
    assert "GGUF" in rec.runner_up["why_lost"]


def test_bad_workloads_are_clear_errors() -> None:
    facts = facts_from_config(LLAMA_8B)
    for workload in (Workload(concurrency=0), Workload(lifetime_hours=-1), Workload(prompt_len=0),
                     Workload(restarts_per_day=-2), Workload(prompt_len=10**8)):
        with pytest.raises(SwitchyardError):
            recommend(facts, snap("rtx4090"), workload)


def test_cli_recommend_json(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_8B))
    out = subprocess.run([sys.executable, "-m", "desktop", "recommend", str(config), "--concurrency", "16",
                          "--lifetime-hours", "48", "--json", "--hardware", str(SNAPDIR / "rtx4090.json")],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {"engine", "quant", "plan", "reasons", "runner_up", "argv", "env"} <= set(data)
    plan = LaunchPlan.from_json(data["plan"])
    assert data["engine"] == "vllm" and plan.engine == "vllm"
    assert data["argv"][data["argv"].index("--max-num-seqs") + 1] == str(plan.slots)
