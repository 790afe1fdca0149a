"""Issue 40, first part: which weights llama-server copies into a repacked CPU buffer and how large that copy is
(planning/repack.py, the rule of llama.cpp b11434 read from its source). The rule on CPUs not at hand (AMX,
AVX2-only, NEON) is checked on its own; on this machine it is checked against what the real llama-server reports
for generated checkpoints of three architectures (a dense model, a tied head, MoE experts)."""

from __future__ import annotations

import re
import subprocess
from typing import Any

import gguf
import pytest

from desktop.core.models import archs
from desktop.core.models.gguf_file import read_gguf_model
from desktop.core.planning.repack import (
    AMX,
    CPU_REPACK,
    MUL_MAT,
    MUL_MAT_ID,
    CpuFeatures,
    Weight,
    buffer_bytes,
    extra_buffer,
    repacked_bytes,
    weights_of,
)
from desktop.core.runtime.ports import find_free_port

AVX2 = CpuFeatures(avx2=True)
AVX512 = CpuFeatures(avx2=True, avx512=True)  # this machine: AMD EPYC, AVX-512, no AMX
AMX_CPU = CpuFeatures(avx2=True, avx512=True, amx=True)
NEON = CpuFeatures(neon=True)


def _weights(model: Any) -> list[Weight]:
    return weights_of((name, tuple(int(d) for d in shape), gguf.GGMLQuantizationType(kind).name)
                      for name, shape, kind in read_gguf_model(model).tensors)


def test_x86_repacks_four_bit_types_by_rows_of_eight_and_keeps_the_rest() -> None:
    assert extra_buffer(Weight("Q4_0", 4096, 4096, MUL_MAT), AVX2) == CPU_REPACK
    assert extra_buffer(Weight("Q4_0", 4096, 4092, MUL_MAT), AVX2) is None  # ne1 % 8
    assert extra_buffer(Weight("Q4_K", 4096, 1024, MUL_MAT_ID, 8), AVX2) == CPU_REPACK  # MoE experts too
    for kind in ("Q8_0", "Q5_K", "Q6_K", "F16"):
        assert extra_buffer(Weight(kind, 4096, 4096, MUL_MAT), AVX512) is None
    assert extra_buffer(Weight("Q2_K", 4096, 4096, MUL_MAT), AVX2) is None
    assert extra_buffer(Weight("Q2_K", 4096, 4096, MUL_MAT), AVX512) == CPU_REPACK  # needs AVX512F
    assert extra_buffer(Weight("Q4_0", 4096, 4096, MUL_MAT), CpuFeatures()) is None  # no AVX2: nothing


def test_amx_takes_mat_mul_weights_first_f16_included_never_experts() -> None:
    f16 = Weight("F16", 896, 4864, MUL_MAT)
    assert extra_buffer(f16, AMX_CPU) == AMX and buffer_bytes(f16, AMX) == 896 * 4864 * 2
    assert extra_buffer(Weight("F16", 896, 4860, MUL_MAT), AMX_CPU) is None  # ne1 % 32, and F16 never repacks
    assert extra_buffer(Weight("Q4_K", 2048, 768, MUL_MAT_ID, 8), AMX_CPU) == CPU_REPACK
    q8 = Weight("Q8_0", 4096, 4096, MUL_MAT)
    assert extra_buffer(q8, AMX_CPU) == AMX
    assert buffer_bytes(q8, AMX) == 4096 * (4096 // 32) * 38  # 4 bytes more per block than the file's 34
    assert buffer_bytes(q8, CPU_REPACK) == 4096 * (4096 // 32) * 34


def test_neon_repacks_q4_0_and_q8_0_by_rows_of_four_and_k_quants_by_eight() -> None:
    assert extra_buffer(Weight("Q4_0", 2048, 2052, MUL_MAT), NEON) == CPU_REPACK
    assert extra_buffer(Weight("Q8_0", 2048, 2052, MUL_MAT), NEON) == CPU_REPACK
    assert extra_buffer(Weight("Q6_K", 2048, 2052, MUL_MAT), NEON) is None
    assert extra_buffer(Weight("Q6_K", 2048, 2056, MUL_MAT), NEON) == CPU_REPACK
    assert extra_buffer(Weight("F16", 2048, 2048, MUL_MAT), NEON) is None


def test_only_mat_mul_weights_count_and_a_tied_head_counts_once_more() -> None:
    tensors = [("token_embd.weight", (2048, 32000), "Q4_0"), ("blk.0.attn_norm.weight", (2048,), "F32"),
               ("blk.0.attn_q.weight", (2048, 2048), "Q4_0"), ("blk.0.ffn_up_exps.weight", (2048, 512, 8), "Q4_K")]
    weights = weights_of(tensors)
    assert [(w.op, w.matrices) for w in weights] == [(MUL_MAT, 1), (MUL_MAT_ID, 8), (MUL_MAT, 1)]  # head last
    bytes_ = repacked_bytes(weights, AVX2)
    q4_0 = 18 * (2048 // 32)
    assert bytes_ == {CPU_REPACK: 2048 * q4_0 + 8 * 512 * 8 * 144 + 32000 * q4_0}
    with_head = weights_of([*tensors, ("output.weight", (2048, 32000), "Q6_K")])
    assert repacked_bytes(with_head, AVX2) == {CPU_REPACK: 2048 * q4_0 + 8 * 512 * 8 * 144}  # Q6_K: not on x86
    assert repacked_bytes(weights, AVX2, repack=False) == {}


# Recorded here on 2026-12-05 with llama-server b11434 (`-v`, `load_tensors: CPU_REPACK model buffer size`), AMD EPYC
# with AVX-512 and no AMX, the generated Q4_K_M checkpoints of desktop.core.models.archs (F16 and Q8_0: none).
RECORDED_MIB = {"llama3": 6.26, "llama32-tied": 42.19, "qwen3moe": 6.01}


@pytest.mark.parametrize("key", sorted(RECORDED_MIB))
def test_the_rule_matches_the_breakdowns_recorded_here(key: str) -> None:
    paths = archs.ensure_arch(key).gguf_paths
    assert repacked_bytes(_weights(paths["Q4_K_M"]), AVX512)[CPU_REPACK] / 2**20 == \
        pytest.approx(RECORDED_MIB[key], abs=0.006)
    for kind in ("F16", "Q8_0"):
        assert repacked_bytes(_weights(paths[kind]), AVX512) == {}


@pytest.mark.engine
@pytest.mark.llamacpp
def test_the_rule_matches_the_real_llama_server_here(llama_install: Any) -> None:
    """What this machine's llama-server reports for the tied-head Q4_K_M checkpoint, now (skipped off x86 AVX2)."""
    from desktop.core.machine.hardware import detect

    cpu = detect().cpu
    features = CpuFeatures(avx2=cpu.avx2, avx512=cpu.avx512, amx=cpu.amx, neon=cpu.neon)
    if not features.avx2 or features.amx:
        pytest.skip("recorded on an x86 CPU with AVX2 and without AMX")
    from desktop.core.engines import kernels
    from desktop.core.runtime import kernelprobe

    kernelprobe.probe(llama_install)  # once per build here, as `engines install` does
    if kernels.avoidance(llama_install) is not None:
        pytest.skip("this build's repacked CPU kernels fault on this machine (its kernel record): nothing repacks")
    model = archs.ensure_arch("llama32-tied").gguf_paths["Q4_K_M"]
    server = subprocess.Popen([str(llama_install.executable), "-m", str(model), "-c", "256", "-np", "1", "-v",
                               "--host", "127.0.0.1", "--port", str(find_free_port())],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sizes: list[float] = []
    try:
        assert server.stdout is not None
        for line in server.stdout:  # the load's own lines, up to the listening socket (or the end of the log)
            found = re.search(r"CPU_REPACK model buffer size =\s+([\d.]+) MiB", line)
            if found:
                sizes.append(float(found.group(1)))
            if "listening on" in line:
                break
    finally:
        server.kill()
        server.wait(30)
    predicted = repacked_bytes(_weights(model), features)[CPU_REPACK] / 2**20
    assert sizes and max(sizes) == pytest.approx(predicted, abs=0.006)
