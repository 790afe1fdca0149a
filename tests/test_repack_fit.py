"""Issue 40: the fit counts the copy llama-server repacks for the CPU's kernels wherever the pinned build makes one
(planning/repack.py's rule, read from llama.cpp b11434's source): on CPU launches, Metal, and `--no-host` GPU
launches; never with `--no-repack` (argv or LLAMA_ARG_REPACK) or behind a CUDA/Vulkan host buffer. Checked on
recorded snapshots of CPUs not at hand (AVX2-only laptop, AMX server, Apple NEON) with generated checkpoints; the
real llama-server's own breakdown is tests/test_fit_engines.py's business."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import run_cli

from desktop.core.engines.base import LaunchPlan
from desktop.core.engines.memory_report import parse_llama
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.models import archs
from desktop.core.models.facts import ModelFacts, facts_from_gguf, facts_from_hf_folder
from desktop.core.models.matmuls import MUL_MAT, MUL_MAT_ID, Edges, Weight, edges_of
from desktop.core.planning import calibration
from desktop.core.planning.fit import FitResult, estimate
from desktop.core.planning.repack import (
    AMX,
    CPU_REPACK,
    CpuFeatures,
    buffer_bytes,
    cpu_side_repacks,
    launch_flags,
    repacked_bytes,
    unmapped_bytes,
    weights_of,
)

SNAPSHOTS = Path(__file__).parent / "snapshots"
LAPTOP = HardwareSnapshot.load(SNAPSHOTS / "cpu_laptop.json")  # Core i5-1235U: AVX2, no AVX-512, no AMX
AMX_SERVER = replace(LAPTOP, cpu=replace(LAPTOP.cpu, model="Xeon w5-3435X", avx512=True, amx=True))
MAC = HardwareSnapshot.load(SNAPSHOTS / "m2max_32gb.json")
RTX = HardwareSnapshot.load(SNAPSHOTS / "rtx4090.json")
AVX2 = CpuFeatures(avx2=True)
MIB = 2**20


def _facts(arch: str, kind: str) -> tuple[Path, ModelFacts]:
    path = archs.ensure_arch(arch).gguf_paths[kind]
    return path, facts_from_gguf(path)


def _fit(path: Path, facts: ModelFacts, hw: HardwareSnapshot, **plan: object) -> FitResult:
    return estimate(facts, hw, LaunchPlan("llama.cpp", path, ctx_per_request=1024, **plan))  # type: ignore[arg-type]


def _bytes(result: FitResult, part: str) -> float:
    return result.breakdown[f"bytes.{part}"]


def test_launch_flags_read_the_argv_and_the_environment_as_llama_server_does() -> None:
    assert launch_flags(()) == (True, False)
    assert launch_flags(("--no-repack",)) == (False, False) == launch_flags(("-nr",))
    assert launch_flags(("--no-repack", "--repack")) == (True, False)  # the last one wins
    assert launch_flags((), {"LLAMA_ARG_REPACK": "0"}) == (False, False)
    assert launch_flags((), {"LLAMA_ARG_REPACK": "false"}) == (False, False)
    assert launch_flags(("--repack",), {"LLAMA_ARG_REPACK": "off"}) == (True, False)  # an argument beats the env
    assert launch_flags(("--no-host",)) == (True, True) == launch_flags((), {"LLAMA_ARG_NO_HOST": "1"})


def test_cpu_side_weights_repack_without_a_gpu_host_buffer_only() -> None:
    assert cpu_side_repacks([], no_host=False)  # a CPU launch
    assert cpu_side_repacks(["metal"], no_host=False)  # Metal offers no host buffer type
    assert not cpu_side_repacks(["cuda"], no_host=False) and not cpu_side_repacks(["vulkan"], no_host=False)
    assert cpu_side_repacks(["cuda"], no_host=True)


def test_a_cpu_plan_counts_the_copy_and_no_repack_drops_it() -> None:
    path, facts = _facts("llama32-tied", "Q4_K_M")
    copy = repacked_bytes(weights_of((n, s, t) for n, s, t in _tensors(path)), AVX2)[CPU_REPACK]
    default = _fit(path, facts, LAPTOP)
    assert _bytes(default, "repacked") == copy > 40 * MIB  # the layers' Q4_K weights and the tied head's copy
    total = sum(_bytes(default, k) for k in ("weights", "repacked", "kv_cache", "compute"))
    cache = default.breakdown["prompt_cache"]  # llama-server's prompt cache in RAM (planning/promptcache.py)
    assert default.total_gib == pytest.approx(total / 2**30 + cache, abs=0.001)
    assert any("repacked copy of 42 MiB" in note and "CPU_REPACK" in note for note in default.notes)
    for plan in ({"extra_args": ("--no-repack",)}, {"env": {"LLAMA_ARG_REPACK": "0"}}):
        off = _fit(path, facts, LAPTOP, **plan)
        assert _bytes(off, "repacked") == 0 and _bytes(off, "weights") == facts.weights_bytes
        engine_only = off.total_gib - off.breakdown["prompt_cache"]  # the cache takes half of what is left
        assert engine_only == pytest.approx(default.total_gib - cache - copy / 2**30, abs=0.002)
        assert off.plan is not None and off.settings["repack"] is False


def test_f16_repacks_on_an_amx_cpu_and_not_on_avx2() -> None:
    path, facts = _facts("llama3", "F16")
    assert _bytes(_fit(path, facts, LAPTOP), "repacked") == 0
    amx = _fit(path, facts, AMX_SERVER)
    expected = sum(buffer_bytes(w, AMX) * n for w, n in facts.matmuls if w.ne1 % 32 == 0 and w.ne0 % 16 == 0)
    assert _bytes(amx, "repacked") == expected > 0
    assert any("(AMX)" in note for note in amx.notes)


def test_gpu_plans_keep_the_cpu_layers_in_the_host_buffer_unless_no_host() -> None:
    path, facts = _facts("llama3", "Q4_K_M")
    layers = facts.n_layers
    plain = _fit(path, facts, RTX, gpu_layers=layers // 2)
    assert _bytes(plain, "repacked") == 0
    no_host = _fit(path, facts, RTX, gpu_layers=layers // 2, extra_args=("--no-host",))
    whole = _bytes(_fit(path, facts, LAPTOP), "repacked")
    head = sum(buffer_bytes(w, CPU_REPACK) * n for w, n in facts.matmuls if w.head and w.type == "Q4_K")
    assert _bytes(no_host, "repacked") == pytest.approx((whole - head) / 2, rel=0.01)  # half the layers' copy
    assert no_host.cpu_ram_gib == pytest.approx(plain.cpu_ram_gib + _bytes(no_host, "repacked") / 2**30, abs=0.002)
    assert _bytes(_fit(path, facts, RTX, extra_args=("--no-host",)), "repacked") == 0  # nothing left on the CPU


def test_metal_plans_repack_what_stays_on_the_cpu_with_neon_rules() -> None:
    path, facts = _facts("llama3", "Q4_K_M")
    partial = _fit(path, facts, MAC, gpu_layers=facts.n_layers // 2)
    assert _bytes(partial, "repacked") > 0  # NEON takes Q4_K and Q6_K: Metal has no host buffer in front


def test_repacked_weights_at_a_files_edges_leave_the_mapping() -> None:
    q4, q6 = Weight("Q4_0", 4096, 4096, MUL_MAT), Weight("Q6_K", 4096, 4096, MUL_MAT)
    size = buffer_bytes(q4, CPU_REPACK)
    assert unmapped_bytes([Edges((q4, q4, q6, q4), (q4,))], AVX2) == 3 * size  # up to the first one kept mapped
    assert unmapped_bytes([Edges((q4, q4), (), whole=True)], AVX2) == 2 * size  # a file all repacked: all of it
    assert unmapped_bytes([Edges((q4, q6, q4), (), whole=True)], AVX2) == 2 * size  # both ends of it
    assert unmapped_bytes([Edges((q6, q4), (q4,)), Edges((q4,), ())], AVX2) == 2 * size  # per shard
    assert unmapped_bytes([Edges((q4,), (q4,))], CpuFeatures()) == 0  # no repack, nothing leaves
    tensors = [("blk.0.ffn_up_exps.weight", (64, 32, 4), "MXFP4"), ("token_embd.weight", (64, 100), "F16"),
               ("blk.0.attn_q.weight", (64, 64), "Q4_0"), ("output_norm.weight", (64,), "F32")]
    assert edges_of(tensors) == Edges((Weight("MXFP4", 64, 32, MUL_MAT_ID, 4),), ())


def test_the_moe_file_whose_experts_lead_it_keeps_only_the_rest_mapped() -> None:
    path, facts = _facts("qwen3moe", "Q4_K_M")
    result = _fit(path, facts, LAPTOP)
    released = (facts.weights_bytes or 0) - _bytes(result, "weights")
    assert 0 < released < _bytes(result, "repacked")  # the leading experts, up to the first Q6_K one


@pytest.mark.parametrize("arch", ["llama3", "gemma3", "llama32-tied", "qwen3", "qwen3moe", "mixtral", "phi3"])
def test_a_what_if_quantization_estimates_the_copy_the_file_would_get(arch: str) -> None:
    """From the HF config alone (before any download), Q4_K_M's copy on an AVX2 CPU: the generated files follow
    llama-quantize's Q4_K_M mix, so the estimate must meet them (Phi-3's fused QKV is Q5_K there: an upper bound)."""
    model = archs.ensure_arch(arch)
    path, facts = _facts(arch, "Q4_K_M")
    exact = _bytes(_fit(path, facts, LAPTOP), "repacked")
    what_if = _bytes(estimate(facts_from_hf_folder(model.hf_dir), LAPTOP,
                              LaunchPlan("llama.cpp", model.hf_dir, ctx_per_request=1024), quant="Q4_K_M"),
                     "repacked")
    if arch == "phi3":
        assert exact <= what_if <= 1.5 * exact
    else:
        assert what_if == pytest.approx(exact, rel=0.01)


def test_the_memory_report_reads_extra_cpu_buffers_as_the_repacked_copy() -> None:
    report = parse_llama([
        "load_tensors:   CPU_Mapped model buffer size =    94.41 MiB",
        "load_tensors:   CPU_REPACK model buffer size =     6.26 MiB",
        "load_tensors:          AMX model buffer size =     1.00 MiB",
        "llama_kv_cache:        CPU KV buffer size =     8.00 MiB",
        "sched_reserve:        CPU compute buffer size =    17.52 MiB",
    ])
    assert report.components["weights"] == round(94.41 * MIB)
    assert report.components["repacked"] == round(6.26 * MIB) + MIB
    assert report.total_bytes == sum(report.components.values())


def test_a_copy_the_fit_counted_and_the_engine_did_not_make_is_compared_as_zero() -> None:
    path, facts = _facts("llama3", "Q4_K_M")
    fit = _fit(path, facts, LAPTOP)
    report = parse_llama(["load_tensors:   CPU_Mapped model buffer size =    94.41 MiB",
                          "sched_reserve:        CPU compute buffer size =    17.52 MiB"])
    pairs = calibration.components("llama.cpp", report, fit)
    assert pairs["repacked"] == (_bytes(fit, "repacked"), 0.0)


def test_serve_passes_no_repack_through_and_the_fit_counts_it() -> None:
    """`serve -- --no-repack` (or models.yaml `args:`): the argv carries it and the checked plan has no copy, and the
    fit does not call the flag unaccounted."""
    path = archs.ensure_arch("llama3").gguf_paths["Q4_K_M"]

    def dry_run(*extra: str) -> dict[str, object]:
        done = run_cli("serve", "--engine", "llama.cpp", "--model", str(path), "--hardware",
                       str(SNAPSHOTS / "cpu_laptop.json"), "--dry-run", "--json", *extra)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    default, off = dry_run(), dry_run("--", "--no-repack")
    assert "--no-repack" in off["argv"] and "--no-repack" not in default["argv"]  # type: ignore[operator]
    assert "repacked copy" in json.dumps(default) and "repacked copy" not in json.dumps(off)
    assert "not accounted" not in json.dumps(off)


def _tensors(path: Path) -> list[tuple[str, tuple[int, ...], str]]:
    import gguf

    from desktop.core.models.gguf_file import read_gguf_model

    return [(n, tuple(int(d) for d in s), gguf.GGMLQuantizationType(t).name) for n, s, t in read_gguf_model(path).tensors]
