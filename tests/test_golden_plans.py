"""Golden launch plans: for every recorded machine x five models (8B GGUF Q4_K_M, 8B HF bf16, 32B AWQ, 70B bf16,
demo), what `recommend` plans and the exact argv/env it launches with, compared with committed files; and the
contract that the memory the argv implies (ctx x slots KV, layers on the GPU, dtype bytes, utilization,
max_model_len, tensor parallel) equals what the fit computed.

An intentional change regenerates the files (then review the diff):
    SWITCHYARD_UPDATE_GOLDEN=1 python -m pytest -q tests/test_golden_plans.py
The model fixtures carry real models' facts without weights: tests/fixtures/models/make_models.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines import get_adapter, runtimes
from desktop.core.engines.base import CommandLine, EngineInstall, LaunchPlan
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.models.facts import ModelFacts, facts_for
from desktop.core.planning.fit import FitResult, estimate, normalise_engine
from desktop.core.planning.recommend import Recommendation, Workload, recommend

HERE = Path(__file__).parent
SNAPSHOTS = sorted((HERE / "snapshots").glob("*.json"))
FIXTURES = HERE / "fixtures" / "models"
GOLDEN = HERE / "golden" / "plans"
MODELS = {
    "llama8b-q4_k_m": str(FIXTURES / "llama8b-q4_k_m.gguf"),
    "llama8b-bf16": str(FIXTURES / "llama8b-bf16"),
    "qwen32b-awq": str(FIXTURES / "qwen32b-awq"),
    "llama70b-bf16": str(FIXTURES / "llama70b-bf16"),
    "demo": "demo",
}
WORKLOAD = Workload(concurrency=4, prompt_len=1024, output_len=512)
INSTALLS = {"llama.cpp": EngineInstall("llama.cpp", "golden", "cache", Path("/opt/switchyard/llama.cpp/bin/llama-server")),
            "vllm": EngineInstall("vllm", "golden", "cache", Path("/opt/switchyard/vllm/venv/bin/python"))}
UPDATE = bool(os.environ.get("SWITCHYARD_UPDATE_GOLDEN"))
CASES = [(snap, model) for snap in SNAPSHOTS for model in MODELS]


def _facts(model: str) -> ModelFacts:
    return facts_for(MODELS[model])


def _command(plan: LaunchPlan) -> CommandLine:
    return get_adapter(plan.engine).build_command(plan, INSTALLS[plan.engine])


def _recommend(snapshot: Path, model: str) -> Recommendation:
    return recommend(_facts(model), HardwareSnapshot.load(snapshot), WORKLOAD)


def _normalised(value: Any, model_path: str) -> Any:
    """Machine-independent text: the model's path becomes <model>."""
    text = json.dumps(value, sort_keys=True, default=str)
    return json.loads(text.replace(model_path, "<model>"))


def vllm_build(snapshot: Path) -> dict[str, Any]:
    """Which vLLM build `engines install vllm` makes on this machine, or the refusal (issue 22: by the driver)."""
    from desktop.core.engines.vllm import VLLM_CPU_VERSION, VLLM_CUDA_VERSION

    try:
        choice = runtimes.choose_vllm_build(HardwareSnapshot.load(snapshot), cuda_version=VLLM_CUDA_VERSION,
                                            cpu_version=VLLM_CPU_VERSION)
    except SwitchyardError as exc:
        return {"refused": exc.message, "fix": exc.hint}
    return {"variant": choice.variant, "packages": list(choice.packages),
            "cuda_build": choice.extra.get("cuda_build"), "reason": choice.reason}


# vLLM's compile cache folder is named by a hash of the model's absolute path (engines.vllm.compile_cache_key):
# that differs per checkout and user, so the goldens record that it is set, not where.
COMPILE_CACHE_ENV = ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR")


def _portable_env(env: dict[str, str]) -> dict[str, str]:
    return {k: "<the plan's compile cache>" if k in COMPILE_CACHE_ENV else v for k, v in env.items()}


def golden_case(snapshot: Path, model: str) -> dict[str, Any]:
    try:
        rec = _recommend(snapshot, model)
    except SwitchyardError as exc:
        return {"snapshot": snapshot.stem, "model": model, "error": exc.message, "vllm_build": vllm_build(snapshot)}
    assert rec.fit is not None
    command = _command(rec.plan)
    fit = rec.fit
    data = {
        "snapshot": snapshot.stem, "model": model, "engine": rec.engine, "quant": rec.quant,
        "plan": rec.plan.to_json(), "argv": command.argv, "env": _portable_env(command.env),
        "fit": {"fits": fit.fits, "device": fit.device, "weights_gib": fit.weights_gib,
                "kv_cache_gib": fit.kv_cache_gib, "total_gib": fit.total_gib, "available_gib": fit.available_gib,
                "gpu_layers": fit.gpu_layers, "kv_cache_tokens": fit.kv_cache_tokens,
                "max_concurrency": fit.max_concurrency},
        "vllm_build": vllm_build(snapshot),
    }
    return dict(_normalised(data, str(rec.plan.model_path)))


@pytest.fixture(autouse=True)
def _machine_independent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)  # llama.cpp's env would otherwise carry this machine's
    # the fit is a pure function of (facts, snapshot, plan): the compilers come from the snapshot (recorded ones have
    # none), never from probing this machine's PATH (issue 20)
    def probe(cls: type) -> None:
        raise AssertionError("the fit probed this machine's toolchain")

    monkeypatch.setattr(runtimes.Toolchain, "detect", classmethod(probe))


def test_enough_golden_cases() -> None:
    assert len(SNAPSHOTS) >= 13 and len(MODELS) == 5
    assert {"rtx4090_20free", "rtx4090_rtx3060"} <= {s.stem for s in SNAPSHOTS}


@pytest.mark.parametrize("snapshot, model", CASES, ids=[f"{s.stem}-{m}" for s, m in CASES])
def test_golden_plan(snapshot: Path, model: str) -> None:
    path = GOLDEN / f"{snapshot.stem}__{model}.json"
    data = golden_case(snapshot, model)
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden file {path.name}: run with SWITCHYARD_UPDATE_GOLDEN=1"
    assert json.loads(path.read_text()) == data, f"{path.name} changed: review, then regenerate if intended"


# --- the argv says what the fit checked --------------------------------------------------------------------
def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


# llama-server's own defaults, read from its source (common/common.h): `n_gpu_layers = -1` ("auto": offload what
# fits, `fit_params = true`, keeping a margin free on every device) and `n_ctx = 0` (the model's trained context).
LLAMA_AUTO_FIT_MARGIN_BYTES = 1024**3


def plan_from_argv(engine: str, argv: list[str], env: dict[str, str], facts: ModelFacts) -> LaunchPlan:
    """Read a command line back into the plan it launches, independently of the adapters' builders. What the
    argv leaves out is what the engine then does by default: llama-server without -ngl offloads what fits (auto),
    without -c it takes the model's trained context."""
    engine = normalise_engine(engine)
    model = Path(str(_flag(argv, "--model")))
    if engine == "llama.cpp":
        slots = int(_flag(argv, "--parallel") or 1)
        ctx_size = int(_flag(argv, "--ctx-size") or facts.context_length)
        kv_k, kv_v = _flag(argv, "--cache-type-k"), _flag(argv, "--cache-type-v")
        assert kv_k == kv_v, "K and V cache types differ"
        fa = _flag(argv, "--flash-attn")
        ub = _flag(argv, "--ubatch-size")
        ngl = _flag(argv, "--n-gpu-layers")
        cram = _flag(argv, "--cache-ram")  # without it llama-server's own 8192 MiB (common/common.h:638)
        return LaunchPlan(engine=engine, model_path=model, ctx_per_request=max(1, ctx_size // slots), slots=slots,
                          gpu_layers=int(ngl) if ngl is not None else None, kv_cache_type=kv_k or "f16",
                          flash_attn=None if fa is None else fa == "on", ubatch=int(ub) if ub else None,
                          prefix_cache="--no-cache-prompt" not in argv, cache_ram_mib=int(cram) if cram else 8192)
    util = _flag(argv, "--gpu-memory-utilization")
    batched = _flag(argv, "--max-num-batched-tokens")
    return LaunchPlan(engine=engine, model_path=model, ctx_per_request=int(_flag(argv, "--max-model-len") or 0),
                      slots=int(_flag(argv, "--max-num-seqs") or 256), dtype=_flag(argv, "--dtype") or "auto",
                      quantization=_flag(argv, "--quantization"), gpu_memory_utilization=float(util) if util else None,
                      tensor_parallel=int(_flag(argv, "--tensor-parallel-size") or 1),
                      kv_cache_type=_flag(argv, "--kv-cache-dtype"), eager="--enforce-eager" in argv,
                      max_num_batched_tokens=int(batched) if batched else None,
                      prefix_cache="--no-enable-prefix-caching" not in argv,
                      kv_cache_gib=float(env.get("VLLM_CPU_KVCACHE_SPACE", 0)) or None)


def engine_view(plan: LaunchPlan, hardware: HardwareSnapshot) -> HardwareSnapshot:
    """The memory the engine itself plans with: llama-server's auto-fit (no -ngl) keeps a margin free on every
    GPU, so "auto" is not the count the fit would choose on the whole free memory."""
    if plan.engine != "llama.cpp" or plan.gpu_layers is not None:
        return hardware
    return replace(hardware, gpus=[replace(g, memory_free_bytes=max(0, g.memory_free_bytes - LLAMA_AUTO_FIT_MARGIN_BYTES))
                                   for g in hardware.gpus])


MEMORY_FIELDS = ("fits", "weights_gib", "kv_cache_gib", "overhead_gib", "total_gib", "gpu_layers", "cpu_ram_gib",
                 "kv_cache_tokens", "max_concurrency", "ctx", "quant")


def memory_disagreements(checked: FitResult, facts: ModelFacts, hardware: HardwareSnapshot, command: CommandLine,
                         what_if: str | None) -> list[str]:
    """Where the memory the argv implies differs from the fit's: an empty list when they agree."""
    read = plan_from_argv(checked.engine, command.argv, command.env, facts)
    implied = estimate(facts, engine_view(read, hardware), read, quant=what_if)
    return [f"{name}: fit {getattr(checked, name)!r}, argv implies {getattr(implied, name)!r}"
            for name in MEMORY_FIELDS if getattr(checked, name) != getattr(implied, name)]


def _what_if(rec: Recommendation, facts: ModelFacts) -> str | None:
    """The GGUF a llama.cpp plan for a safetensors model asks to download (its argv cannot name it yet)."""
    return rec.quant if rec.engine == "llama.cpp" and not facts.is_gguf else None


@pytest.mark.parametrize("snapshot, model", CASES, ids=[f"{s.stem}-{m}" for s, m in CASES])
def test_argv_implies_the_memory_the_fit_computed(snapshot: Path, model: str) -> None:
    try:
        rec = _recommend(snapshot, model)
    except SwitchyardError:
        pytest.skip("no plan fits here (the golden file records why)")
    assert rec.fit is not None
    facts = _facts(model)
    problems = memory_disagreements(rec.fit, facts, HardwareSnapshot.load(snapshot), _command(rec.plan),
                                    _what_if(rec, facts))
    assert problems == []
    runner = rec.runner_up or {}
    if runner.get("plan"):  # the runner-up's plan keeps the same contract
        plan = LaunchPlan.from_json(runner["plan"])
        other = estimate(facts, HardwareSnapshot.load(snapshot), plan, quant=runner["quant"]
                         if plan.engine == "llama.cpp" and not facts.is_gguf else None)
        assert memory_disagreements(other, facts, HardwareSnapshot.load(snapshot), _command(plan),
                                    runner["quant"] if plan.engine == "llama.cpp" and not facts.is_gguf else None) == []


def _break(argv: list[str], flag: str, value: str | None) -> list[str]:
    out = list(argv)
    if value is None:
        i = out.index(flag)
        del out[i:i + 2]
    else:
        out[out.index(flag) + 1] = value
    return out


def test_the_check_catches_an_argv_that_disagrees_with_the_fit() -> None:
    """The bugs of issue 14: ctx multiplied by the slots twice, float32 weights, -ngl or TP never reaching argv;
    and of issue 20: an argv without -c or -ngl is not "no context, no GPU" but the model's trained context and
    llama-server's own auto-fit, which is not the layer count the fit checked."""
    hw = HardwareSnapshot.load(HERE / "snapshots" / "rtx4090.json")
    facts = _facts("llama8b-q4_k_m")
    rec = recommend(facts, hw, WORKLOAD)
    assert rec.engine == "llama.cpp" and rec.fit is not None
    command = _command(rec.plan)
    assert memory_disagreements(rec.fit, facts, hw, command, None) == []
    twice = str(rec.plan.llama_ctx_size * rec.plan.slots)
    broken = [_break(command.argv, "--ctx-size", twice), _break(command.argv, "--ctx-size", None),
              _break(command.argv, "--cache-ram", "0")]  # issue 48: the prompt cache's RAM is in the fit's sum
    for argv in broken:
        assert memory_disagreements(rec.fit, facts, hw, replace(command, argv=argv), None), argv
    # all 33 layers fit with room to spare: here llama-server's auto places them all too, as the fit did
    assert memory_disagreements(rec.fit, facts, hw, replace(command, argv=_break(command.argv, "--n-gpu-layers",
                                                                                   None)), None) == []
    # partly offloaded on a desktop with 4 GiB taken: without -ngl the engine's auto-fit places other layers
    desktop = HardwareSnapshot.load(HERE / "snapshots" / "rtx4090_20free.json")
    big = _facts("llama70b-bf16")
    partial = recommend(big, desktop, WORKLOAD)
    assert partial.engine == "llama.cpp" and partial.fit is not None and partial.fit.fits == "partial"
    command = _command(partial.plan)
    what_if = _what_if(partial, big)
    assert memory_disagreements(partial.fit, big, desktop, command, what_if) == []
    no_ngl = replace(command, argv=_break(command.argv, "--n-gpu-layers", None))
    assert memory_disagreements(partial.fit, big, desktop, no_ngl, what_if), no_ngl.argv

    h100x8 = HardwareSnapshot.load(HERE / "snapshots" / "h100_80gb.json")
    h100x8 = replace(h100x8, gpus=[replace(h100x8.gpus[0], index=i) for i in range(8)])
    big = _facts("llama70b-bf16")
    rec = recommend(big, h100x8, Workload(concurrency=32))
    assert rec.engine == "vllm" and rec.fit is not None and rec.plan.tensor_parallel >= 2
    command = _command(rec.plan)
    assert memory_disagreements(rec.fit, big, h100x8, command, None) == []
    for argv in (_break(command.argv, "--tensor-parallel-size", None), _break(command.argv, "--dtype", "float32"),
                 _break(command.argv, "--gpu-memory-utilization", "0.5"),
                 _break(command.argv, "--max-model-len", str(rec.plan.ctx_per_request * rec.plan.slots))):
        assert memory_disagreements(rec.fit, big, h100x8, replace(command, argv=argv), None), argv


# --- the goldens reviewed as plans the engines accept (issue 22) ---------------------------------------------------
GOLDEN_FILES = sorted(GOLDEN.glob("*.json"))


def _checkpoint_quantization(model: str) -> str | None:
    return _facts(model).quantization


def test_no_golden_plan_launches_a_quantization_its_checkpoint_lacks() -> None:
    """vLLM quantizes to fp8 while loading, never to AWQ/GPTQ ("Cannot find the config file for awq"): a
    --quantization in argv is fp8, or the checkpoint's own method (and then vLLM reads it, so none is forced)."""
    seen = 0
    for path in GOLDEN_FILES:
        data = json.loads(path.read_text())
        if data.get("engine") != "vllm":
            continue
        seen += 1
        flag = _flag(data["argv"], "--quantization")
        own = _checkpoint_quantization(data["model"])
        assert flag in (None, "fp8"), f"{path.name}: --quantization {flag} on a {own or 'bf16'} checkpoint"
        if own:
            assert flag is None, f"{path.name}: a forced --quantization on a {own} checkpoint picks the slow kernel"
    assert seen >= 8


def test_driver_550_snapshots_get_a_cuda12_vllm_build_or_a_refusal_naming_the_driver() -> None:
    for path in GOLDEN_FILES:
        data = json.loads(path.read_text())
        hardware = HardwareSnapshot.load(HERE / "snapshots" / f"{data['snapshot']}.json")
        nvidia = [g for g in hardware.gpus if g.vendor == "nvidia"]
        if not nvidia or hardware.os.lower().startswith(("win", "darwin")):
            continue
        build = data["vllm_build"]
        level = float(nvidia[0].cuda_version or "0")
        if level < 13.0:
            assert build.get("cuda_build") == "cu129" or nvidia[0].driver_version in build.get("refused", ""), path.name
            if build.get("cuda_build"):
                assert build["packages"] == [f"vllm=={build['packages'][0].split('==')[1]}"]
                assert build["packages"][0].endswith("+cu129")
        else:
            assert build.get("cuda_build") == "cu130" and "+" not in build["packages"][0], path.name


def test_apple_unified_memory_70b_on_32gb_is_no() -> None:
    data = json.loads((GOLDEN / "m2max_32gb__llama70b-bf16.json").read_text())
    assert "error" in data and "does not fit" in data["error"]
    fit = estimate(_facts("llama70b-bf16"), HardwareSnapshot.load(HERE / "snapshots" / "m2max_32gb.json"),
                   LaunchPlan(engine="llama.cpp", model_path=Path("m"), ctx_per_request=2048, slots=4), quant="Q4_K_M")
    assert fit.fits == "no" and any("unified memory" in note for note in fit.notes)


def test_no_cpu_only_vllm_variable_in_a_gpu_launch() -> None:
    for path in GOLDEN_FILES:
        data = json.loads(path.read_text())
        if data.get("engine") != "vllm":
            continue
        names = set(data["env"]) | set(data["plan"]["env"])
        cpu_vars = {n for n in names if n.startswith("VLLM_CPU_")}
        if data["plan"]["backend"] == "cpu":
            assert "VLLM_CPU_KVCACHE_SPACE" in cpu_vars, path.name
        else:
            assert not cpu_vars and not any(a.startswith("VLLM_CPU_") for a in data["argv"]), path.name


def test_gpu_plans_pin_the_gpus_they_sized_by_uuid() -> None:
    """CUDA by UUID, ROCm by place among the AMD GPUs (HIP_VISIBLE_DEVICES); a Vulkan plan is never pinned by a
    number (the loader's order is not detection's: see devices.pin_devices)."""
    kinds = set()
    for path in GOLDEN_FILES:
        data = json.loads(path.read_text())
        plan = data.get("plan")
        if not plan or plan["backend"] not in ("cuda", "rocm", "vulkan"):
            continue
        kinds.add(plan["backend"])
        hardware = HardwareSnapshot.load(HERE / "snapshots" / f"{data['snapshot']}.json")
        if plan["backend"] == "cuda":
            uuids = {g.uuid for g in hardware.gpus}
            pinned = data["env"]["CUDA_VISIBLE_DEVICES"].split(",")
            assert pinned and set(pinned) <= uuids, path.name
        elif plan["backend"] == "rocm":
            amd = [g for g in hardware.gpus if g.vendor == "amd"]
            places = data["env"]["HIP_VISIBLE_DEVICES"].split(",")
            assert places and all(0 <= int(i) < len(amd) for i in places), path.name
            if data["engine"] == "llama.cpp":
                assert data["argv"][data["argv"].index("--device") + 1] == \
                    ",".join(f"ROCm{i}" for i in range(len(places))), path.name
        else:
            assert "GGML_VK_VISIBLE_DEVICES" not in data["env"] and "--device" not in data["argv"], path.name
    assert kinds == {"cuda", "rocm", "vulkan"}


def test_llama_argv_states_layers_and_context() -> None:
    """What a missing -ngl / -c would mean to llama-server 11434 (auto offload, the trained context) is not what
    the fit checked, so every llama.cpp plan spells both out."""
    for path in GOLDEN_FILES:
        data = json.loads(path.read_text())
        if data.get("engine") == "llama.cpp":
            argv = data["argv"]
            assert "--n-gpu-layers" in argv and "--ctx-size" in argv and "--parallel" in argv, path.name
