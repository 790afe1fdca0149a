"""Engine flags passed through (`serve ... -- ARGS`, models.yaml `args:`): flags the fit counts become plan fields,
flags the plan owns are refused naming what sets them, the rest reach the argv with a note that the fit did not
count them; a switch never carries them to the other engine."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import run_cli

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.engine_args import ALL_LAYERS, plan_fields_from_args
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.planning.planner import plan_launch, replan
from desktop.core.serving.fleet import parse_models_config

SNAPDIR = Path(__file__).parent / "snapshots"


def test_counted_flags_become_plan_fields_and_the_rest_pass_through() -> None:
    assert plan_fields_from_args("llama.cpp", ["--n-cpu-moe", "4"]) == {"n_cpu_moe": 4}
    assert plan_fields_from_args("llama.cpp", ["--cpu-moe"]) == {"n_cpu_moe": ALL_LAYERS}
    # -ot rules are kept as typed, each one; the fit reads them against the model's tensors (test_moe_offload)
    assert plan_fields_from_args("llama.cpp", ["-ot", r"\.ffn_.*_exps\.=CPU", "--override-tensor", "a=CPU,b=CUDA0"]) \
        == {"override_tensors": (r"\.ffn_.*_exps\.=CPU", "a=CPU,b=CUDA0")}
    assert plan_fields_from_args("llama.cpp", ["-ctk", "q8_0", "-ctv", "q8_0"]) == {"kv_cache_type": "q8_0"}
    assert plan_fields_from_args("llama.cpp", ["--seed", "7", "--no-mmap", "-ot", "blk.1=CUDA0"]) == {
        "extra_args": ("--seed", "7", "--no-mmap"), "override_tensors": ("blk.1=CUDA0",)}
    # a vision projector is the plan's (the fit counts it, issue 58): `-mm, --mmproj FILE` and its switches
    assert plan_fields_from_args("llama.cpp", ["-mm", "m.gguf", "--no-mmproj-offload", "--image-max-tokens",
                                               "512"]) == {"mmproj": Path("m.gguf").absolute(), "mmproj_offload": False,
                                                           "image_max_tokens": 512}
    assert plan_fields_from_args("llama.cpp", ["-fa", "off", "-ub", "256"]) == {"flash_attn": False, "ubatch": 256}
    assert plan_fields_from_args("vllm", ["--cpu-offload-gb", "8", "--enforce-eager", "--seed=3"]) == {
        "cpu_offload_gb": 8.0, "eager": True, "extra_args": ("--seed=3",)}
    assert plan_fields_from_args("vllm", ["--speculative-config", '{"method": "ngram"}']) == {
        "extra_args": ("--speculative-config", '{"method": "ngram"}')}


@pytest.mark.parametrize(("engine", "args", "instead"), [
    ("llama.cpp", ["--ctx-size", "9"], "--ctx"),
    ("llama.cpp", ["-c", "9"], "--ctx"),
    ("llama.cpp", ["-ngl", "99"], "--gpu-layers"),
    ("llama.cpp", ["--port=8080"], "the endpoint"),
    ("vllm", ["--max-model-len", "9"], "--ctx"),
    ("vllm", ["--tool-call-parser", "hermes"], "--tool-parser"),
    # the spellings each engine's parser reads as the same flag: llama-server `_` for `-` in a `--` name
    # (common/arg.cpp); vLLM's FlexibleArgumentParser the same, `-x=V` and `-xV`, and argparse's abbreviations
    ("llama.cpp", ["--ctx_size", "9"], "--ctx"),
    ("llama.cpp", ["--n_gpu_layers=5"], "--gpu-layers"),
    ("vllm", ["--max_model_len", "9"], "--ctx"),
    ("vllm", ["--gpu_memory_utilization=0.99"], "--util"),
    ("vllm", ["--max-model", "9"], "--ctx"),
    ("vllm", ["--served_model_name", "x"], "the endpoint's model name"),
    ("vllm", ["-tp=2"], "--tp"),
    ("vllm", ["-qfp8"], "the plan's quantization"),
    ("vllm", ["--no-enable-auto-tool-choice"], "--tool-parser"),
])
def test_flags_the_plan_owns_are_refused_naming_what_sets_them(engine: str, args: list[str], instead: str) -> None:
    with pytest.raises(SwitchyardError) as refused:
        plan_fields_from_args(engine, args)
    assert "is set by the plan the fit checked" in refused.value.message
    assert (refused.value.hint or "").startswith(f"use {instead}")


def test_a_refusal_names_the_spelling_typed_and_the_flag_it_is() -> None:
    with pytest.raises(SwitchyardError) as refused:
        plan_fields_from_args("vllm", ["--gpu_memory_utilization=0.99"])
    assert refused.value.message.startswith("--gpu_memory_utilization (read as --gpu-memory-utilization) is set by")
    with pytest.raises(SwitchyardError) as abbreviated:
        plan_fields_from_args("vllm", ["--max_model", "9"])
    assert abbreviated.value.message.startswith("--max_model (vLLM's abbreviation of --max-model-len) is set by")
    with pytest.raises(SwitchyardError, match="abbreviation vLLM would read as any of"):
        plan_fields_from_args("vllm", ["--enable", "x"])


def test_counted_flags_are_counted_under_every_spelling_the_engine_reads() -> None:
    assert plan_fields_from_args("vllm", ["--cpu_offload_gb", "8"]) == {"cpu_offload_gb": 8.0}
    assert plan_fields_from_args("vllm", ["--cpu_offload_gb=8", "--kv_cache_dtype", "fp8", "--enforce_eager"]) == {
        "cpu_offload_gb": 8.0, "kv_cache_type": "fp8", "eager": True}
    assert plan_fields_from_args("vllm", ["--no-enforce-eager"]) == {"eager": False}
    assert plan_fields_from_args("llama.cpp", ["--n_cpu_moe", "2", "--override_tensor", "exps=CPU", "--cpu_moe"]) \
        == {"n_cpu_moe": ALL_LAYERS, "override_tensors": ("exps=CPU",)}
    # what is passed through stays as typed (the engine reads its own spelling); vLLM's dotted keys keep theirs
    assert plan_fields_from_args("vllm", ["--compilation_config.mode", "3", "--seed=3"]) == {
        "extra_args": ("--compilation_config.mode", "3", "--seed=3")}
    assert plan_fields_from_args("llama.cpp", ["--no_mmap"]) == {"extra_args": ("--no_mmap",)}


def test_vllm_cpu_offload_under_its_underscore_name_reaches_the_fit_and_the_argv() -> None:
    model = str(Path(__file__).parent / "fixtures" / "models" / "llama8b-bf16")
    result = run_cli("serve", "--engine", "vllm", "--model", model, "--hardware", str(SNAPDIR / "h100_80gb.json"),
                     "--dry-run", "--json", "--", "--cpu_offload_gb", "8")
    assert result.returncode == 0, result.stderr
    described = json.loads(result.stdout)
    argv = described["argv"]
    assert argv[argv.index("--cpu-offload-gb") + 1] == "8" and "--cpu_offload_gb" not in argv
    assert any(note.startswith("--cpu-offload-gb 8: 8.00 GiB of weights per GPU stay in RAM")
               for note in described["fit"]["notes"])
    assert "not accounted" not in json.dumps(described["fit"]["notes"])


def test_differing_k_and_v_types_and_bad_values_are_refused() -> None:
    for args in (["-ctk", "q8_0", "-ctv", "q4_0"], ["--n-cpu-moe", "many"], ["--n-cpu-moe"], ["model.gguf"],
                 ["-fa", "maybe"], ["-ot", "exps"], ["-ot", "exps=CPU,token_embd"], ["-ot"]):
        with pytest.raises(SwitchyardError):
            plan_fields_from_args("llama.cpp", args)
    with pytest.raises(SwitchyardError, match="--cpu-offload-gb takes a number of GiB"):
        plan_fields_from_args("vllm", ["--cpu-offload-gb", "lots"])


def dry_run(*extra: str) -> dict[str, object]:
    result = run_cli("serve", "--engine", "llama.cpp", "--model", "demo", "--hardware",
                     str(SNAPDIR / "rtx4090.json"), "--dry-run", "--json", *extra)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_serve_passes_n_cpu_moe_to_the_argv_and_the_fit() -> None:
    described = dry_run("--", "--n-cpu-moe", "4", "--no-mmap")
    argv = described["argv"]
    assert isinstance(argv, list)
    assert "--no-mmap" in argv
    # the demo is dense: the fit says the flag does nothing and the plan drops it; the pass-through is noted
    fit = json.dumps(described)
    assert "--n-cpu-moe has no effect here" in fit and "not accounted by the fit: --no-mmap" in fit
    assert "--n-cpu-moe" not in argv
    ruled = dry_run("--", "-ot", "exps=CPU")  # no expert tensor in a dense model: said, and kept as typed
    assert ruled["argv"][ruled["argv"].index("-ot") + 1] == "exps=CPU"  # type: ignore[union-attr,index]
    assert "-ot exps=CPU matches no tensor of this model" in json.dumps(ruled)


def test_serve_refuses_an_owned_flag_naming_the_option() -> None:
    result = run_cli("serve", "--engine", "llama.cpp", "--model", "demo", "--hardware", str(SNAPDIR / "rtx4090.json"),
                     "--dry-run", "--", "--ctx-size", "9")
    assert result.returncode != 0
    assert "--ctx-size is set by the plan the fit checked" in result.stderr and "use --ctx" in result.stderr


def test_a_moe_gets_the_asked_experts_in_ram(tmp_path: Path) -> None:
    from desktop.core.models.archs import ensure_arch

    model = ensure_arch("qwen3moe").gguf_paths["Q8_0"]
    hardware = HardwareSnapshot.load(SNAPDIR / "rtx4090.json")
    checked = plan_launch("llama.cpp", str(model), hardware,
                          plan_fields_from_args("llama.cpp", ["--n-cpu-moe", "2", "--no-mmap"]))
    assert checked.plan.n_cpu_moe == 2 and checked.fit.breakdown["experts_in_ram"] > 0
    assert "--no-mmap" in checked.plan.extra_args
    everything = plan_launch("llama.cpp", str(model), hardware, plan_fields_from_args("llama.cpp", ["--cpu-moe"]))
    assert everything.plan.n_cpu_moe == 4  # --cpu-moe: every one of the model's 4 layers
    other = replan(checked.plan, hardware, engine="vllm", model="demo")
    assert other.plan.n_cpu_moe is None and "--no-mmap" not in other.plan.extra_args  # no flags carried over
    ruled = plan_launch("llama.cpp", str(model), hardware, plan_fields_from_args("llama.cpp", ["-ot", "exps=CPU"]))
    assert replan(ruled.plan, hardware).plan.override_tensors == ("exps=CPU",)  # a reload keeps the rule
    assert replan(ruled.plan, hardware, model="demo").plan.override_tensors == ()  # another model's tensors differ


def test_models_yaml_args_are_read_and_owned_flags_refused() -> None:
    config = parse_models_config({"models": [{"name": "a", "engine": "llama.cpp", "model": "demo",
                                              "args": ["--n-cpu-moe", 3, "--no-mmap"]}]})
    assert config.models[0].asks()["n_cpu_moe"] == 3
    assert config.models[0].asks()["extra_args"] == ("--no-mmap",)
    with pytest.raises(SwitchyardError) as refused:
        parse_models_config({"models": [{"name": "a", "engine": "llama.cpp", "model": "demo",
                                         "args": ["--ctx-size", "9"]}]})
    assert "models[0] ('a'): args: --ctx-size is set by the plan" in refused.value.message
    assert "`ctx:`" in (refused.value.hint or "")


def test_serve_dash_dash_n_cpu_moe_reaches_the_argv_of_a_moe_and_its_fit() -> None:
    from desktop.core.models.archs import ensure_arch

    model = ensure_arch("qwen3moe").gguf_paths["Q8_0"]
    result = run_cli("serve", "--engine", "llama.cpp", "--model", str(model), "--hardware",
                     str(SNAPDIR / "rtx4090.json"), "--dry-run", "--json", "--", "--n-cpu-moe", "2")
    assert result.returncode == 0, result.stderr
    described = json.loads(result.stdout)
    argv = described["argv"]
    assert argv[argv.index("--n-cpu-moe") + 1] == "2"
    assert "experts_in_ram" in json.dumps(described)  # the fit counted it


def test_serve_config_args_reach_the_argv_and_an_owned_flag_is_refused(tmp_path: Path) -> None:
    from desktop.core.models.archs import ensure_arch

    model = ensure_arch("qwen3moe").gguf_paths["Q8_0"]
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(f"models:\n  - {{name: moe, engine: llama.cpp, model: '{model}', args: [--n-cpu-moe, 2]}}\n")
    bad.write_text(f"models:\n  - {{name: moe, engine: llama.cpp, model: '{model}', args: [--ctx-size, 9]}}\n")
    snapshot = str(SNAPDIR / "rtx4090.json")
    result = run_cli("serve", "--config", str(good), "--hardware", snapshot, "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    argv = json.loads(result.stdout)["models"]["moe"]["argv"]
    assert argv[argv.index("--n-cpu-moe") + 1] == "2"
    refused = run_cli("serve", "--config", str(bad), "--hardware", snapshot, "--dry-run")
    assert refused.returncode != 0
    assert "args: --ctx-size is set by the plan" in refused.stderr and "`ctx:`" in refused.stderr


# vLLM's own `serve` parser, built as `vllm serve` builds it, reporting its option names and what each argv parses to
_VLLM_PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
def parsed(argv):
    try:
        return {k: repr(v) for k, v in vars(parser.parse_args(argv)).items()}
    except SystemExit:
        return None
cases = json.loads(sys.argv[1])
print(json.dumps({"options": [s for a in parser._actions for s in a.option_strings],
                  "parsed": [[parsed(typed), parsed(read)] for typed, read in cases]}))
"""


@pytest.mark.engine
@pytest.mark.vllm
def test_vllm_reads_each_spelling_as_the_flag_the_tables_read_it_as(vllm_install: Any) -> None:
    """The pinned vLLM's FlexibleArgumentParser parses every other spelling exactly as the flag engine_args reads it
    as; each flag of the tables is one of its options, and none of its options is a strict prefix of one (so a
    prefix of a table's flag is that flag, or vLLM's "ambiguous option")."""
    from desktop.core.engines import get_adapter
    from desktop.core.engines.flag_spelling import flag_name

    adapter = get_adapter("vllm")
    spellings = [["--max_model_len", "9"], ["--gpu_memory_utilization=0.99"], ["--cpu_offload_gb", "8"],
                 ["--max-model", "9"], ["--max_model", "9"], ["-qfp8"], ["-tp=2"], ["--kv_cache_dtype", "fp8"],
                 ["--enforce_eager"], ["--served_model_name", "x"], ["--no_enforce_eager"]]
    cases = []
    for typed in spellings:
        flag, inline = flag_name(adapter, typed[0])
        cases.append((typed, [flag, *([inline] if inline is not None else typed[1:])]))
    run = subprocess.run([str(vllm_install.executable), "-c", _VLLM_PARSE, json.dumps(cases)],  # noqa: S603
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    answer = json.loads(run.stdout.strip().splitlines()[-1])
    for (typed, read), (as_typed, as_read) in zip(cases, answer["parsed"], strict=True):
        assert as_read is not None and as_typed == as_read, (typed, read)
    options = set(answer["options"])
    tables = {*adapter.owned_flags, *adapter.counted_flags, *adapter.valueless_flags}
    assert tables <= options
    assert not [(o, f) for o in options for f in tables if f != o and f.startswith(o) and o.startswith("--")]
