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

Where it applies in a plan (src/llama-model.cpp:1079-1140, make_cpu_buft_list): the CPU-side weights try, in order,
the first GPU's *host* buffer type (unless `--no-host`), the extra buffers (unless `--no-repack`), then plain CPU.
CUDA/ROCm and Vulkan offer a host buffer (ggml-cuda.cu:5799, ggml-vulkan.cpp:16106) whose device takes the weight
(ggml-cuda.cu:5252-5263), and with the default mmap load a host-buffer pick becomes plain CPU
(llama-model-loader.cpp:1266-1274): so on those GPUs the layers left on the CPU are *not* repacked unless
`--no-host`. Metal offers none (ggml-metal.cpp:828): there, and on a CPU-only machine, they are.

Pure: weights, CPU features and launch flags in, bytes out; planning/fit.py adds the copy to a plan's CPU part.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Protocol

from desktop.core.models.facts import ModelFacts, param_parts
from desktop.core.models.matmuls import MUL_MAT, MUL_MAT_ID, Edges, Weight, op_of, use_more_bits, weights_of

AMX = "AMX"
CPU_REPACK = "CPU_REPACK"
ALIGNMENT = 32

# type -> (values per block, bytes per block) of the GGUF types the rule names
BLOCKS = {"F16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q2_K": (256, 84),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136),
          "MXFP4": (32, 17)}
AMX_NE0 = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "IQ4_XS": 256, "F16": 16}
AMX_EXTRA_PER_BLOCK = {"Q8_0": 4, "Q4_K": 4, "Q5_K": 4, "IQ4_XS": 2}  # bytes per block AMX adds to a row
X86_REPACK = {"Q4_0", "Q4_K", "IQ4_NL", "MXFP4"}  # with AVX2; Q2_K needs AVX512F
ARM_REPACK_NE1 = {"Q4_0": 4, "IQ4_NL": 4, "MXFP4": 4, "Q8_0": 4, "Q4_K": 8, "Q5_K": 8, "Q6_K": 8}


class Features(Protocol):
    """What the repack rule asks of the CPU: machine.hardware's CpuInfo, or CpuFeatures."""

    @property
    def avx2(self) -> bool: ...
    @property
    def avx512(self) -> bool: ...
    @property
    def amx(self) -> bool: ...
    @property
    def neon(self) -> bool: ...


@dataclass(frozen=True)
class CpuFeatures:
    """The rule's CPU flags alone (a recorded snapshot's CpuInfo carries the same ones)."""

    avx2: bool = False
    avx512: bool = False
    amx: bool = False
    neon: bool = False


def extra_buffer(weight: Weight, cpu: Features) -> str | None:
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


def repacked_bytes(weights: Iterable[Weight], cpu: Features, repack: bool = True) -> dict[str, int]:
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


FALSE_WORDS = ("0", "false", "off", "disabled", "no")  # common/arg.cpp's falsey environment values
FLAGS = ("-nr", "--no-repack", "--repack", "--no-host")  # the pass-through flags the fit reads (launch_flags)


def launch_flags(args: Iterable[str], env: dict[str, str] | None = None) -> tuple[bool, bool]:
    """(repack, no_host) as llama-server reads them from its argv (the last of --repack/--no-repack wins) and its
    environment (LLAMA_ARG_REPACK, LLAMA_ARG_NO_HOST; an argument beats the environment)."""
    env = env or {}
    repack = str(env.get("LLAMA_ARG_REPACK", "1")).strip().lower() not in FALSE_WORDS
    no_host = "LLAMA_ARG_NO_HOST" in env and str(env["LLAMA_ARG_NO_HOST"]).strip().lower() not in FALSE_WORDS
    for arg in args:
        if arg in ("-nr", "--no-repack"):
            repack = False
        elif arg == "--repack":
            repack = True
        elif arg == "--no-host":
            no_host = True
    return repack, no_host


def cpu_side_repacks(gpu_backends: list[str], no_host: bool) -> bool:
    """Whether llama-server puts the weights it keeps on the CPU into the extra buffers: on a CPU-only launch, with
    `--no-host`, or when the first GPU offers no host buffer (Metal); not behind a CUDA/ROCm/Vulkan host buffer."""
    return no_host or not gpu_backends or gpu_backends[0] == "metal"


@dataclass(frozen=True)
class Repacked:
    """The repacked copy of a whole model's weights on this CPU, by where the weights sit in a plan: the repeating
    layers' dense weights, the MoE expert stacks, the output head. `exact`: from the file's own tensors (False: a
    what-if quantization, estimated from its main tensor type)."""

    layers: int = 0
    experts: int = 0
    head: int = 0
    buffers: tuple[tuple[str, int], ...] = ()  # AMX / CPU_REPACK -> bytes
    exact: bool = True
    unmapped: int = 0  # file bytes no longer mapped: repacked weights at a file's edges (CPU launches)

    @property
    def total(self) -> int:
        return self.layers + self.experts + self.head

    def on_cpu(self, layer_share: float, expert_share: float, head: bool) -> int:
        """The part of the copy a plan keeps on the CPU: shares of the layers and experts left there, the head."""
        return int(self.layers * layer_share + self.experts * expert_share) + (self.head if head else 0)


def of_weights(groups: Iterable[tuple[Weight, int]], cpu: Features) -> Repacked:
    """The copy of a model whose mat-mul weights are known (ModelFacts.matmuls: (weight, count) groups)."""
    parts = {"layers": 0, "experts": 0, "head": 0}
    buffers: dict[str, int] = {}
    for weight, count in groups:
        buffer = extra_buffer(weight, cpu)
        if buffer is None:
            continue
        size = buffer_bytes(weight, buffer) * count
        buffers[buffer] = buffers.get(buffer, 0) + size
        parts["head" if weight.head else "experts" if weight.op == MUL_MAT_ID else "layers"] += size
    return Repacked(parts["layers"], parts["experts"], parts["head"], tuple(sorted(buffers.items())))


def unmapped_bytes(files: Iterable[Edges], cpu: Features) -> int:
    """File bytes llama-server unmaps after a CPU load: per file, the repacked weights before the first and after
    the last weight it still reads from the mapping (models.matmuls.Edges); the whole file when all of it is
    repacked. Each tensor's bytes padded to the file's 32-byte alignment (GGUF's default)."""

    def prefix(run: Iterable[Weight]) -> tuple[int, bool]:
        size = 0
        for weight in run:
            if extra_buffer(weight, cpu) is None:
                return size, False
            size += buffer_bytes(weight, CPU_REPACK)  # the file's own bytes (AMX's larger rows are the copy's)
        return size, True

    total = 0
    for edges in files:
        lead, all_repacked = prefix(edges.lead)
        if edges.whole:
            total += lead if all_repacked else lead + prefix(reversed(edges.lead))[0]
        else:
            total += lead + prefix(edges.tail)[0]
    return total


def main_type(label: str) -> tuple[str, str]:
    """(dense weights' type, experts' type) of a llama-quantize file type: Q4_K_M -> Q4_K, MXFP4 (MXFP4_MOE: the
    experts in MXFP4, the rest Q8_0), BF16/F32 (never repacked here) as themselves."""
    if label.upper().startswith("MXFP4"):
        return "Q8_0", "MXFP4"
    base = label.upper()
    for suffix in ("_XL", "_M", "_S", "_L"):
        if base.endswith(suffix) and base[:-len(suffix)] in BLOCKS:
            base = base[:-len(suffix)]
    return base, base


def _bits(kind: str) -> float:
    values, size = BLOCKS[kind]
    return 8 * size / values


def estimated(label: str, facts: ModelFacts, cpu: Features) -> Repacked:
    """The copy of a model sized by bits per weight (a what-if quantization, a config without tensors), from its
    parameters by part (models.facts.param_parts) at the types llama-quantize gives them: the layers' dense weights
    at the label's main type, except that a *_K_M mix keeps attn_v and ffn_down of the layers `use_more_bits`
    names at Q6_K (src/llama-quant.cpp); the experts at the experts' type; an untied output head at Q6_K, a tied
    one (the embedding loaded again) at the main type. Each part counts when this CPU repacks its type at the usual
    aligned shapes."""
    dense_type, expert_type = main_type(label)
    sample = 4096  # rows and columns a multiple of every block and row step the rule asks for

    def size(params: float, kind: str, op: str = MUL_MAT) -> int:
        if kind not in BLOCKS or extra_buffer(Weight(kind, sample, sample, op), cpu) is None:
            return 0
        return int(params * _bits(kind) / 8)

    parts = param_parts(facts)
    dense = parts["attention"] + parts["mlp"]
    six = six_experts = 0.0  # parameters a *_K_M mix keeps at Q6_K: attn_v and ffn_down (ffn_down_exps) of some layers
    if label.upper().endswith("_K_M"):
        layers = max(facts.n_layers, 1)
        share = sum(use_more_bits(i, layers) for i in range(layers)) / layers
        six = share * (layers * facts.hidden_size * facts.n_kv_heads * facts.head_dim + parts["mlp"] / 3)
        six_experts = share * parts["experts"] / 3
    head = size(parts["embedding"], dense_type) if facts.tie_word_embeddings else \
        size(parts["head"], dense_type if dense_type in ("Q8_0", "F16", "BF16") else "Q6_K")
    return Repacked(layers=size(dense - six, dense_type) + size(six, "Q6_K"),
                    experts=size(parts["experts"] - six_experts, expert_type, MUL_MAT_ID)
                    + size(six_experts, "Q6_K", MUL_MAT_ID), head=head, exact=False)


def model_copy(facts: ModelFacts, cpu: Features | None, gpu_backends: list[str], repack: bool, no_host: bool,
               weights: int, quant: str) -> Repacked:
    """The copy llama-server makes of a whole model for a launch (the fit takes the plan's CPU part of it): from the
    file's own tensors when the file is what loads (`weights` is its bytes), else estimated from `quant`; nothing
    with --no-repack or when the CPU-side weights sit behind a GPU's host buffer."""
    if not repack or cpu is None or not cpu_side_repacks(gpu_backends, no_host):
        return Repacked()
    if facts.matmuls and facts.is_gguf and weights == facts.weights_bytes:
        copy = of_weights(facts.matmuls, cpu)
        return replace(copy, unmapped=unmapped_bytes(facts.mapped_edges, cpu)) if copy.total else copy
    return estimated(quant, facts, cpu)


def note(copy: int, rep: Repacked) -> str:
    """The fit's note on the copy it counted."""
    where = "/".join(name for name, _ in rep.buffers) or "estimated from the quantization"
    return (f"llama-server keeps a repacked copy of {copy / 2**20:,.0f} MiB of the weights on the CPU ({where}) "
            "beside the mapped file, for this CPU's faster kernels: counted; --no-repack saves it (slower matmuls)")


__all__ = ["AMX", "CPU_REPACK", "FLAGS", "CpuFeatures", "Repacked", "Weight", "buffer_bytes", "cpu_side_repacks",
           "estimated", "extra_buffer", "launch_flags", "model_copy", "note", "of_weights", "op_of", "repacked_bytes",
           "unmapped_bytes", "weights_of"]
