"""Which weights llama-server copies into a repacked CPU buffer (AMX, CPU_REPACK) at load, and how many bytes that
copy takes: the rule of the pinned llama.cpp (build b11434), read from its source (paths below are relative to the
llama.cpp tree of that build; issue 40).

Why it matters: with the default mmap load, a repacked tensor is copied *out of* the mapping into anonymous memory
while its file pages stay mapped and populated (only the file's head and tail outside the mapped tensors' span are
unmapped: src/llama-model-loader.cpp:1776-1787; MAP_POPULATE: src/llama-mmap.cpp:493, 513-515). So on a CPU that
repacks, the weights on the CPU are held about twice over; `--no-repack` (common/arg.cpp:2424-2431, env
LLAMA_ARG_REPACK) turns it off. The breakdown llama-server prints shows the copy in its own rows (`AMX`,
`CPU_REPACK`: common/fit.cpp:1035-1064) beside Host.

The rule (ggml/src/ggml-cpu/ggml-cpu.cpp:42-74 orders the extra buffer types AMX, then CPU_REPACK; the loader gives
each weight the first type whose `supports_op` takes it: src/llama-model-loader.cpp:1067-1078):
- AMX (x86 with AMX-INT8 and AVX512-VNNI, granted by the OS: ggml/src/ggml-cpu/amx/amx.cpp:214-226) takes only
  MUL_MAT weights (never MoE experts, MUL_MAT_ID: amx.cpp:146-148) with ne1 % 32 == 0 (amx.cpp:161): Q4_0, Q4_1,
  Q8_0 (ne0 % 32); Q4_K, Q5_K, Q6_K, IQ4_XS (ne0 % 256); F16 (ne0 % 16) (amx.cpp:165-185). Its rows can be larger
  than the file's (amx/mmq.cpp:246-260, 2267-2287): +4 bytes per block for Q8_0, +4 per 256 values for Q4_K and
  Q5_K, +2 per 256 for IQ4_XS; the rest, F16 included, keep their size.
- CPU_REPACK (ggml/src/ggml-cpu/repack.cpp:4925-5140, 5191-5223) takes 2-D MUL_MAT and 3-D MUL_MAT_ID weights at
  their own size (repack.cpp:5246, 5153): on x86 with AVX2 Q4_0, Q4_K, IQ4_NL, MXFP4 (ne1 % 8), with AVX512F also
  Q2_K; on ARM with NEON (dotprod or i8mm assumed: our snapshot records NEON only) Q4_0, IQ4_NL, MXFP4, Q8_0
  (ne1 % 4) and Q4_K, Q5_K, Q6_K (ne1 % 8).
- The op of a weight comes from its name (src/llama-arch.cpp:749+): token_embd is GET_ROWS (never repacked),
  `*_exps` MUL_MAT_ID, norms and biases not a mat-mul, the other 2-D weights and `output` MUL_MAT; a tied head
  (no output.weight) is token_embd loaded a second time as the output, a MUL_MAT (llama-model-loader.cpp:1163-1168).
- Each tensor in a buffer is padded to 32 bytes (ggml/src/ggml-backend.cpp:70-72).

Pure: weights and CPU features in, bytes out. Not yet used by the fit (issue 40 continues there).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

AMX = "AMX"
CPU_REPACK = "CPU_REPACK"
MUL_MAT = "MUL_MAT"
MUL_MAT_ID = "MUL_MAT_ID"
ALIGNMENT = 32

# type -> (values per block, bytes per block) of the GGUF types the rule names
BLOCKS = {"F16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q2_K": (256, 84),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136),
          "MXFP4": (32, 17)}
AMX_NE0 = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "IQ4_XS": 256, "F16": 16}
AMX_EXTRA_PER_BLOCK = {"Q8_0": 4, "Q4_K": 4, "Q5_K": 4, "IQ4_XS": 2}  # bytes per block AMX adds to a row
X86_REPACK = {"Q4_0", "Q4_K", "IQ4_NL", "MXFP4"}  # with AVX2; Q2_K needs AVX512F
ARM_REPACK_NE1 = {"Q4_0": 4, "IQ4_NL": 4, "MXFP4": 4, "Q8_0": 4, "Q4_K": 8, "Q5_K": 8, "Q6_K": 8}


@dataclass(frozen=True)
class CpuFeatures:
    """What the repack rule asks of the CPU (machine.hardware records these)."""

    avx2: bool = False
    avx512: bool = False
    amx: bool = False
    neon: bool = False


@dataclass(frozen=True)
class Weight:
    """One weight tensor: its GGUF type name, its first two dims (ne0: values per row, ne1: rows), how many
    matrices of that shape it holds (experts), and the op llama.cpp uses it in."""

    type: str
    ne0: int
    ne1: int
    op: str
    matrices: int = 1


def op_of(name: str, dims: int) -> str | None:
    """The op llama.cpp uses a weight in, from its GGUF name (src/llama-arch.cpp:749+): MUL_MAT, MUL_MAT_ID, or None
    (token_embd's GET_ROWS, norms, biases, anything not a mat-mul weight)."""
    if not name.endswith(".weight") or "norm" in name or name.startswith("token_embd"):
        return None
    if "_exps." in name:
        return MUL_MAT_ID if dims == 3 else None
    return MUL_MAT if dims == 2 else None


def weights_of(tensors: Iterable[tuple[str, tuple[int, ...], str]]) -> list[Weight]:
    """The mat-mul weights of a GGUF's tensors ((name, shape as ne0.., type name)); a head tied to the embedding
    (no output.weight) adds token_embd once more as the output."""
    out: list[Weight] = []
    embedding: Weight | None = None
    has_output = False
    for name, shape, kind in tensors:
        if len(shape) < 2:
            continue
        if name == "token_embd.weight":
            embedding = Weight(kind, shape[0], shape[1], MUL_MAT)
        has_output = has_output or name == "output.weight"
        op = op_of(name, len(shape))
        if op is not None:
            out.append(Weight(kind, shape[0], shape[1], op, shape[2] if len(shape) > 2 else 1))
    if not has_output and embedding is not None:
        out.append(embedding)
    return out


def extra_buffer(weight: Weight, cpu: CpuFeatures) -> str | None:
    """The extra CPU buffer llama-server puts `weight` in (AMX first, then CPU_REPACK), or None: it stays in the
    mapped file."""
    kind, ne0, ne1 = weight.type, weight.ne0, weight.ne1
    if weight.op == MUL_MAT and cpu.amx and cpu.avx512 and ne1 % 32 == 0 and kind in AMX_NE0 and \
            ne0 % AMX_NE0[kind] == 0:
        return AMX
    if weight.op not in (MUL_MAT, MUL_MAT_ID):
        return None
    if cpu.neon:
        step = ARM_REPACK_NE1.get(kind)
        return CPU_REPACK if step is not None and ne1 % step == 0 else None
    if ne1 % 8 == 0 and ((cpu.avx2 and kind in X86_REPACK) or (cpu.avx512 and kind == "Q2_K")):
        return CPU_REPACK
    return None


def buffer_bytes(weight: Weight, buffer: str) -> int:
    """Bytes `weight` takes in `buffer` (AMX rows may be larger), padded to the buffer's alignment."""
    per_block_values, per_block_bytes = BLOCKS[weight.type]
    blocks = weight.ne0 // per_block_values
    extra = AMX_EXTRA_PER_BLOCK.get(weight.type, 0) if buffer == AMX else 0
    size = weight.ne1 * blocks * (per_block_bytes + extra)
    return -(-size // ALIGNMENT) * ALIGNMENT * weight.matrices


def repacked_bytes(weights: Iterable[Weight], cpu: CpuFeatures, repack: bool = True) -> dict[str, int]:
    """Bytes of the repacked copy per extra buffer (what llama-server's AMX / CPU_REPACK rows show); nothing with
    `--no-repack`."""
    out: dict[str, int] = {}
    if not repack:
        return out
    for weight in weights:
        buffer = extra_buffer(weight, cpu)
        if buffer is not None:
            out[buffer] = out.get(buffer, 0) + buffer_bytes(weight, buffer)
    return out


__all__ = ["AMX", "CPU_REPACK", "CpuFeatures", "Weight", "buffer_bytes", "extra_buffer", "op_of", "repacked_bytes",
           "weights_of"]
