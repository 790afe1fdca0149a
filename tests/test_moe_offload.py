"""A MoE that does not fit the GPU whole keeps every layer there and only the experts of the fewest first layers in
RAM (llama-server --n-cpu-moe K), instead of splitting whole layers (-ngl N of M)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from conftest import _running

from desktop.core.engines import get_adapter, kernels
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.models.facts import facts_from_config, facts_from_gguf, read_gguf_header, tensor_bytes
from desktop.core.planning.fit import estimate, sizing_plan
from desktop.core.planning.recommend import Workload, recommend
from desktop.core.runtime import kernelprobe

HERE = Path(__file__).parent
SNAPDIR = HERE / "snapshots"
GPT_OSS_20B = json.loads((HERE / "fixtures" / "models" / "gpt-oss-20b" / "config.json").read_text())
# openai/gpt-oss-120b's config differs from 20b's in depth and experts only (36 layers, 128 experts)
GPT_OSS_120B = {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 18}


@pytest.fixture(scope="module")
def moe_gguf() -> Path:
    from desktop.core.models.archs import ensure_arch

    return ensure_arch("qwen3moe").gguf_paths["Q8_0"]


def gpu_with_free(base: str, free: int) -> HardwareSnapshot:
    hardware = HardwareSnapshot.load(SNAPDIR / f"{base}.json")
    return replace(hardware, gpus=[replace(hardware.gpus[0], memory_free_bytes=free)])


def test_expert_bytes_per_layer_are_the_exps_tensors_of_the_gguf(moe_gguf: Path) -> None:
    facts = facts_from_gguf(moe_gguf)
    per_layer = [0] * facts.n_layers
    for name, shape, kind in read_gguf_header(moe_gguf).tensors:
        if name.startswith("blk.") and name.split(".")[2] in ("ffn_up_exps", "ffn_down_exps", "ffn_gate_exps"):
            per_layer[int(name.split(".")[1])] += tensor_bytes(shape, kind)
    assert facts.expert_layer_bytes == tuple(per_layer) and all(per_layer)


def test_a_gpu_that_holds_all_but_the_experts_gets_every_layer_and_the_fewest_expert_layers_in_ram(
        moe_gguf: Path, tmp_path: Path) -> None:
    facts = facts_from_gguf(moe_gguf)
    plan = sizing_plan("llama.cpp", ctx_per_request=2048, slots=1)
    whole = estimate(facts, HardwareSnapshot.load(SNAPDIR / "rtx3090.json"), plan)
    need = int(whole.breakdown["gpu_used"] * 2**30)  # every layer with its experts (rounded to MiB/1000 by _gib)
    expert = facts.expert_layer_bytes[0]
    # free: all but 2.5 layers' experts -> by hand, K = 3 (2 layers' experts would leave half a layer's too many)
    hardware = gpu_with_free("rtx3090", need - int(2.5 * expert))
    result = estimate(facts, hardware, plan)
    assert result.fits == "partial"
    assert result.gpu_layers == facts.n_layers + 1  # every layer (and the output) on the GPU
    assert result.plan is not None and result.plan.n_cpu_moe == 3
    assert result.notes[0].startswith("partial: experts of 3 layers in RAM (--n-cpu-moe 3")
    assert result.breakdown["experts_in_ram"] == pytest.approx(3 * expert / 2**30, abs=0.001)
    before = estimate(facts, hardware, replace(plan, n_cpu_moe=None, gpu_layers=None))
    assert before.plan is not None and before.plan.n_cpu_moe == 3  # the fit chooses it, unasked
    two = estimate(facts, hardware, replace(plan, n_cpu_moe=2))  # asked for fewer: it does not fit
    assert two.fits == "no"
    snapshot = tmp_path / "gpu.json"
    snapshot.write_text(hardware.dumps())
    dry = subprocess.run([sys.executable, "-m", "desktop", "serve", "--engine", "llama.cpp", "--model",  # noqa: S603
                          str(moe_gguf), "--ctx", "2048", "--parallel", "1", "--hardware", str(snapshot),
                          "--dry-run", "--json"], capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    argv = json.loads(dry.stdout)["argv"]
    assert argv[argv.index("--n-gpu-layers") + 1] == str(facts.n_layers + 1)
    assert argv[argv.index("--n-cpu-moe") + 1] == "3"


def test_a_dense_model_never_gets_expert_offload() -> None:
    llama = json.loads((HERE / "fixtures" / "models" / "llama8b-bf16" / "config.json").read_text())
    facts = facts_from_config(llama)
    result = estimate(facts, gpu_with_free("rtx4060_8gb", 6 * 2**30), sizing_plan("llama.cpp", ctx_per_request=4096),
                      quant="Q8_0")
    assert result.fits == "partial" and result.plan is not None and result.plan.n_cpu_moe is None
    assert (result.gpu_layers or 0) < facts.n_layers  # whole layers split, as before


def test_gpt_oss_120b_shaped_moe_on_a_24_gb_gpu_golden_argv() -> None:
    """K by hand. Each layer's experts: 128 x 3 x 2880 x 2880 MXFP4 weights at 17 bytes per 32 = E =
    1,692,057,600 bytes. The GPU would need G = all weights (36 E of experts + 2,127,263,040 other parameters at
    Q8_0's 8.5 bits) less the token embedding llama.cpp keeps in host memory, plus KV, compute and the CUDA
    context; it has F free. K is the smallest whole number with G - K E <= F."""
    facts = facts_from_config(GPT_OSS_120B)
    hardware = HardwareSnapshot.load(SNAPDIR / "rtx4090.json")  # 24 GB, 51 GiB of RAM available
    result = estimate(facts, hardware, sizing_plan("llama.cpp", ctx_per_request=8192, slots=1), quant="MXFP4")
    expert = 128 * 3 * 2880 * 2880 * 17 // 32
    assert expert == 1_692_057_600
    others = 36 * (2880 * 4096 * 2 + 2 * 2880 * 512) + 36 * 2880 * 128 + 36 * 2 * 2880 + 2880 + 2 * 201088 * 2880
    assert others == 2_127_263_040  # attention, router, norms, embedding and head
    weights = 36 * expert + others * 8.5 / 8
    assert result.breakdown["bytes.weights"] == pytest.approx(weights, abs=1)
    host_embedding = 201088 * 2880 * weights / facts.params  # at the file's average bits (the fit's rule)
    everything = (weights - host_embedding + result.breakdown["bytes.kv_cache"] + result.breakdown["bytes.compute"]
                  + 350 * 2**20)  # G
    free = hardware.gpus[0].memory_free_bytes  # F = 24,129,830,912
    k = next(k for k in range(37) if everything - k * expert <= free)
    assert k == 24  # (G - F) / E = 23.4
    assert result.plan is not None and result.plan.n_cpu_moe == k
    assert result.breakdown["experts_in_ram"] * 2**30 == pytest.approx(k * expert, rel=1e-3)
    assert result.fits == "partial" and result.gpu_layers == 37
    from desktop.core.engines import get_adapter
    from desktop.core.engines.base import EngineInstall

    argv = get_adapter("llama.cpp").build_command(result.plan, EngineInstall("llama.cpp", "x", "path",
                                                                           Path("/x/llama-server"))).argv
    start = argv.index("--ctx-size")
    assert argv[start:start + 8] == ["--ctx-size", "8192", "--parallel", "1", "--n-gpu-layers", "37",
                                     "--n-cpu-moe", "24"]
    vllm = estimate(facts, hardware, sizing_plan("vllm", ctx_per_request=8192, slots=8))
    assert vllm.fits == "no" and any("--cpu-offload-gb" in note for note in vllm.notes)  # stated beside it
    answer = recommend(facts, hardware, Workload(concurrency=1))
    assert answer.engine == "llama.cpp" and answer.plan.n_cpu_moe  # type: ignore[union-attr]
    assert "x2" not in json.dumps(answer.numbers["figures"])  # expert offload is not a whole-layer split
    assert any("experts of" in reason and "in RAM" in reason for reason in answer.reasons)


@pytest.mark.engine
@pytest.mark.llamacpp
def test_the_real_llama_server_serves_the_plan_with_experts_in_ram(moe_gguf: Path, llama_install: Any) -> None:
    facts = facts_from_gguf(moe_gguf)
    plan = sizing_plan("llama.cpp", ctx_per_request=2048, slots=1)
    need = int(estimate(facts, HardwareSnapshot.load(SNAPDIR / "rtx3090.json"), plan).breakdown["gpu_used"] * 2**30)
    result = estimate(facts, gpu_with_free("rtx3090", need - int(2.5 * facts.expert_layer_bytes[0])), plan)
    assert result.plan is not None and result.plan.n_cpu_moe == 3
    with contextlib.contextmanager(_running)("llama.cpp", moe_gguf, llama_install,
                                             ctx_per_request=2048, slots=1, gpu_layers=result.plan.gpu_layers,
                                             n_cpu_moe=result.plan.n_cpu_moe) as process:
        running = psutil.Process(process.pid).cmdline()  # type: ignore[attr-defined]
        assert running[running.index("--n-cpu-moe") + 1] == "3"  # the real process got the flag, and serves:
        answer = httpx.post(process.base_url + "/v1/completions",  # type: ignore[attr-defined]
                            json={"prompt": "Hello", "max_tokens": 4}, timeout=60, trust_env=False)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4


def test_a_hub_listing_tags_a_moe_that_fits_with_experts_in_ram() -> None:
    from desktop.core.planning.fit import quick_verdict

    mxfp4_gguf_bytes = int(63.4e9)  # a gpt-oss-120b MXFP4 GGUF's size on the Hub (about 63 GB)
    assert quick_verdict("llama.cpp", mxfp4_gguf_bytes, GPT_OSS_120B,
                         HardwareSnapshot.load(SNAPDIR / "rtx4090.json")) == "experts-in-ram"
    assert quick_verdict("llama.cpp", mxfp4_gguf_bytes, GPT_OSS_120B,
                         HardwareSnapshot.load(SNAPDIR / "h100_80gb.json")) == "yes"
    dense = json.loads((HERE / "fixtures" / "models" / "llama70b-bf16" / "config.json").read_text())
    assert quick_verdict("llama.cpp", int(42e9), dense, HardwareSnapshot.load(SNAPDIR / "rtx4090.json")) == "partial"


# --- -ot rules: read as llama-server reads them, counted per tensor, kept verbatim ---------------------------
def hand_expert_bytes(path: Path, layers: set[int], kinds: tuple[str, ...] = ("gate", "up", "down")) -> int:
    """The bytes of the named layers' expert tensors, straight from the GGUF with gguf-py (not through facts)."""
    import gguf

    wanted = {f"blk.{layer}.ffn_{kind}_exps.weight" for layer in layers for kind in kinds}
    found = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if t.name in wanted}
    assert len(found) == len(wanted)
    return sum(found.values())


def checked_with(moe_gguf: Path, snapshot: str, *flags: str) -> Any:
    from desktop.core.engines.engine_args import plan_fields_from_args
    from desktop.core.planning.planner import plan_launch

    return plan_launch("llama.cpp", str(moe_gguf), HardwareSnapshot.load(SNAPDIR / f"{snapshot}.json"),
                       plan_fields_from_args("llama.cpp", list(flags)))


def argv_of(plan: Any) -> list[str]:
    from desktop.core.engines import get_adapter
    from desktop.core.engines.base import EngineInstall

    return get_adapter("llama.cpp").build_command(plan, EngineInstall("llama.cpp", "x", "p", Path("/x/s"))).argv


def test_a_per_layer_ot_rule_puts_exactly_those_layers_experts_in_ram_and_stays_in_the_argv(moe_gguf: Path) -> None:
    rule = r"blk\.(0|1)\.ffn_.*_exps\.weight=CPU"
    whole = checked_with(moe_gguf, "rtx4090")
    assert whole.fit.fits == "yes" and "experts_in_ram" not in whole.fit.breakdown  # it fits whole unasked
    checked = checked_with(moe_gguf, "rtx4090", "-ot", rule)
    fit = checked.fit
    assert fit.settings["experts_in_ram_layers"] == [0, 1]
    assert fit.breakdown["bytes.experts_in_ram"] == hand_expert_bytes(moe_gguf, {0, 1}) == 6 * 1_114_112
    assert fit.fits == "partial" and fit.gpu_layers == 5  # every layer on the GPU, those experts in RAM
    assert fit.notes[0].startswith(f"partial: experts of layers 0-1 in RAM (-ot {rule},")
    assert checked.plan.n_cpu_moe is None  # no hidden translation: the rule is the one source
    argv = argv_of(checked.plan)
    assert argv[argv.index("-ot") + 1] == rule and "--n-cpu-moe" not in argv
    assert not any(note.startswith("not accounted") for note in fit.notes)


def test_every_expert_is_counted_and_token_embd_named_not_accounted(moe_gguf: Path) -> None:
    checked = checked_with(moe_gguf, "rtx4090", "-ot", "exps=CPU,token_embd=CPU")
    fit = checked.fit
    assert fit.breakdown["bytes.experts_in_ram"] == hand_expert_bytes(moe_gguf, {0, 1, 2, 3})
    assert fit.settings["experts_in_ram_layers"] == [0, 1, 2, 3]
    assert any(note.startswith("not accounted by the fit: -ot token_embd=CPU") for note in fit.notes)
    argv = argv_of(checked.plan)
    assert argv[argv.index("-ot") + 1] == "exps=CPU,token_embd=CPU"


def test_layers_that_are_no_prefix_single_tensors_and_n_cpu_moe_add_up(moe_gguf: Path) -> None:
    facts = facts_from_gguf(moe_gguf)
    plan = sizing_plan("llama.cpp", ctx_per_request=2048, slots=1)
    hardware = HardwareSnapshot.load(SNAPDIR / "rtx4090.json")
    skipping = estimate(facts, hardware, replace(plan, override_tensors=(r"blk\.(1|3)\.ffn_.*_exps=CPU",)))
    assert skipping.settings["experts_in_ram_layers"] == [1, 3]
    assert skipping.breakdown["bytes.experts_in_ram"] == hand_expert_bytes(moe_gguf, {1, 3})
    # --n-cpu-moe 1 (layer 0) and the down projection of layer 2 by a rule: llama-server applies both
    both = estimate(facts, hardware, replace(plan, n_cpu_moe=1, override_tensors=(r"blk\.2\.ffn_down_exps=CPU",)))
    assert both.breakdown["bytes.experts_in_ram"] == \
        hand_expert_bytes(moe_gguf, {0}) + hand_expert_bytes(moe_gguf, {2}, ("down",))
    assert both.notes[0].startswith("partial: experts of layer 0 and some experts of layer 2 in RAM "
                                    r"(--n-cpu-moe 1, -ot blk\.2\.ffn_down_exps=CPU")
    # -ngl 2 puts layers 2 and 3 on the GPU: of layers 1 and 3's experts only layer 3's leave it
    split = estimate(facts, hardware, replace(plan, gpu_layers=2, override_tensors=(r"blk\.(1|3)\.ffn_.*_exps=CPU",)))
    assert split.breakdown["bytes.experts_in_ram"] == hand_expert_bytes(moe_gguf, {3})
    # a what-if quantization: the same layers' experts, at that size (what --n-cpu-moe 2 keeps there too)
    rule = replace(plan, override_tensors=(r"blk\.(0|1)\.ffn_.*_exps=CPU",))
    what_if = estimate(facts, hardware, rule, quant="Q4_K_M").breakdown["bytes.experts_in_ram"]
    assert what_if == estimate(facts, hardware, replace(plan, n_cpu_moe=2), quant="Q4_K_M").breakdown[
        "bytes.experts_in_ram"] != hand_expert_bytes(moe_gguf, {0, 1})


def test_rules_the_fit_does_not_count_are_named(moe_gguf: Path) -> None:
    facts = facts_from_gguf(moe_gguf)
    plan = sizing_plan("llama.cpp", ctx_per_request=2048, slots=1,
                       override_tensors=(r"blk\.1\.=CPU,blk\.2\.ffn_down_exps=CUDA0,nothing=CPU",))
    result = estimate(facts, HardwareSnapshot.load(SNAPDIR / "rtx4090.json"), plan)
    assert result.breakdown["bytes.experts_in_ram"] == hand_expert_bytes(moe_gguf, {1})  # layer 1's experts only
    assert "-ot nothing=CPU matches no tensor of this model that an earlier rule has not taken" in result.notes
    unaccounted = next(note for note in result.notes if note.startswith("not accounted by the fit: "))
    assert r"-ot blk\.1\.=CPU (it also sends blk.1.attn_norm.weight" in unaccounted
    assert r"-ot blk\.2\.ffn_down_exps=CUDA0 (tensors to CUDA0" in unaccounted


def test_n_cpu_moe_and_rules_on_a_cpu_plan_are_said_to_do_nothing(moe_gguf: Path) -> None:
    checked = checked_with(moe_gguf, "cpu_laptop", "--n-cpu-moe", "2", "-ot", "exps=CPU")
    notes = checked.fit.notes
    assert "--n-cpu-moe has no effect here: the plan runs on the CPU, where every expert is already" in notes
    assert "-ot exps=CPU has no effect here: the plan runs on the CPU" in notes
    assert checked.plan.n_cpu_moe is None and "--n-cpu-moe" not in argv_of(checked.plan)


def test_a_rule_on_config_only_facts_counts_those_layers_at_the_what_if_size() -> None:
    """gpt-oss-120b at MXFP4 from its config (no file): each layer's experts are E = 1,692,057,600 bytes (the
    golden test above); a rule for layers 0, 1 and 35 keeps 3 E in RAM."""
    facts = facts_from_config(GPT_OSS_120B)
    plan = sizing_plan("llama.cpp", ctx_per_request=8192, slots=1,
                       override_tensors=(r"blk\.(0|1|35)\.ffn_(up|down|gate)_exps=CPU",))
    result = estimate(facts, HardwareSnapshot.load(SNAPDIR / "h100_80gb.json"), plan, quant="MXFP4")
    assert result.settings["experts_in_ram_layers"] == [0, 1, 35]
    assert result.breakdown["bytes.experts_in_ram"] == pytest.approx(3 * 1_692_057_600, abs=3)


def test_the_first_rule_that_matches_a_tensor_wins_as_in_llama_server(moe_gguf: Path) -> None:
    """llama-model-loader.cpp stops at the first override whose pattern regex_search finds: layer 0's experts
    stay on CUDA0 by the first part, the other layers' go to the CPU by the second."""
    facts = facts_from_gguf(moe_gguf)
    plan = sizing_plan("llama.cpp", ctx_per_request=2048, slots=1,
                       override_tensors=(r"blk\.0\.ffn_.*_exps=CUDA0,exps=CPU",))
    result = estimate(facts, HardwareSnapshot.load(SNAPDIR / "rtx4090.json"), plan)
    assert result.settings["experts_in_ram_layers"] == [1, 2, 3]
    assert result.breakdown["bytes.experts_in_ram"] == hand_expert_bytes(moe_gguf, {1, 2, 3})
    # --n-cpu-moe's own rules come first in the argv: with it, layer 0's experts are in RAM after all
    first = estimate(facts, HardwareSnapshot.load(SNAPDIR / "rtx4090.json"), replace(plan, n_cpu_moe=1))
    assert first.breakdown["bytes.experts_in_ram"] == hand_expert_bytes(moe_gguf, {0, 1, 2, 3})


_OVERRIDDEN = re.compile(r"tensor (\S+) \(.*\) buffer type overridden to CPU")


@pytest.mark.engine
@pytest.mark.llamacpp
def test_the_real_llama_server_overrides_the_tensors_the_fit_counts(moe_gguf: Path, llama_install: Any) -> None:
    """The plan's argv (--n-cpu-moe 1, two -ot values joined into one) given to the real llama-server at -v: the
    tensors its loader says it sent to the CPU are, by their bytes per layer, what the fit counts in RAM, and the
    one that is no expert is the one the fit names as not accounted."""
    rules = (r"blk\.(0|1)\.ffn_.*_exps\.weight=CPU,token_embd=CPU", r"blk\.3\.ffn_(up|down)_exps=CPU")
    plan = sizing_plan("llama.cpp", model_path=moe_gguf, ctx_per_request=256, slots=1, n_cpu_moe=1,
                       override_tensors=rules)
    fit = estimate(facts_from_gguf(moe_gguf), HardwareSnapshot.load(SNAPDIR / "rtx4090.json"), plan)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = get_adapter("llama.cpp").build_command(replace(plan, port=port), llama_install)
    argv = command.argv
    assert argv[argv.index("-ot") + 1] == ",".join(rules) and argv.count("-ot") == 1
    # as the app starts this build here: with what its CPU kernels need on this machine (the probe, run once as
    # `engines install` does, finds a repacked kernel that faults: an AMX guest)
    kernelprobe.probe(llama_install)
    argv = list(kernels.with_avoidance(argv, kernels.avoidance(llama_install)))
    server = subprocess.Popen([*argv, "-v"], env={**os.environ, **command.env}, stdout=subprocess.PIPE,  # noqa: S603
                              stderr=subprocess.STDOUT, text=True)
    overridden: set[str] = set()
    try:
        assert server.stdout is not None
        for line in server.stdout:
            if (found := _OVERRIDDEN.search(line)) is not None:
                overridden.add(found.group(1))
            assert "error" not in line.lower() or "DEPRECATED" in line, line
            if "listening on" in line:
                break
    finally:
        server.terminate()
        server.wait(timeout=30)
    experts = {name for name in overridden if "_exps." in name}
    assert overridden - experts == {"token_embd.weight"}
    assert experts == {f"blk.{layer}.ffn_{kind}_exps.weight" for layer in (0, 1) for kind in ("gate", "up", "down")} \
        | {"blk.3.ffn_up_exps.weight", "blk.3.ffn_down_exps.weight"}
    assert fit.breakdown["bytes.experts_in_ram"] == \
        hand_expert_bytes(moe_gguf, {0, 1}) + hand_expert_bytes(moe_gguf, {3}, ("up", "down"))
    assert any(note.startswith("not accounted by the fit: -ot token_embd=CPU") for note in fit.notes)
