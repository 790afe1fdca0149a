"""The Machine page's first sentence and first model: what this machine can serve, in one line ("CPU only,
23.5 GiB RAM: models up to ~14 B parameters at Q4_K_M fit in RAM"), and a real model to start with that fits.

The catalogue is one family of well-known instruct models (Qwen2.5 Instruct, 0.5 B to 32 B) at Q4_K_M, from
bartowski's GGUF repos. Each entry carries what the fit needs to size it: the file's size and the model's shape
(layers, width, attention and KV heads, vocabulary, trained context). Shapes are the models' own config.json
values (huggingface.co/Qwen/Qwen2.5-<N>B-Instruct); parameter counts are the model cards' figures; file sizes are
the Hub's file listings (huggingface.co/bartowski/Qwen2.5-<N>B-Instruct-GGUF/tree/main), which show three
significant digits in decimal units (398 MB, 4.68 GB), so a size here may be off by up to half a unit in its last
digit: far below what decides a verdict.

Every verdict is the fit's own (`fit.quick_verdict` with the entry's config: the same exact accounting of weights,
KV cache at llama.cpp's default context and compute buffers that the Models page's fit chips use): one sizing
function, not a second formula. Without a GPU the suggestion stops at 3 B parameters: larger models fit in RAM but
answer well below reading speed on a CPU, a poor first experience (the sentence still says how large a model fits).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.planning.fit import quick_verdict

GIB = 1024**3
QUANT = "Q4_K_M"
ENGINE = "llama.cpp"  # a GGUF first model runs everywhere (CPU, CUDA, ROCm, Metal) and starts in seconds
CPU_SUGGESTION_MAX_PARAMS = 3_500_000_000  # the largest model suggested where there is no GPU (speed, not memory)
COMFORT_FRACTION = 0.9  # the suggestion must still fit with this share of the free memory


def _qwen2(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
           tied: bool) -> dict[str, Any]:
    """A Qwen2.5 Instruct config.json, reduced to the fields the fit reads (all share a 32,768-token window)."""
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": layers,
            "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "intermediate_size": intermediate, "vocab_size": vocab, "max_position_embeddings": 32768,
            "tie_word_embeddings": tied, "torch_dtype": "bfloat16"}


@dataclass(frozen=True)
class Starter:
    repo: str
    file: str
    label: str  # the size the model is known by ("7B"): what the sentence says
    params: int  # the model card's parameter count
    size_bytes: int  # the Q4_K_M file, as the Hub lists it
    config: dict[str, Any] = field(compare=False)

    @property
    def spec(self) -> str:
        """What `switchyard pull` and the Models page's download take: the repo and the quantization."""
        return f"{self.repo}:{QUANT}"

    @property
    def params_b(self) -> float:
        return self.params / 1e9


STARTERS: tuple[Starter, ...] = (  # smallest first
    Starter("bartowski/Qwen2.5-0.5B-Instruct-GGUF", "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf", "0.5B", 494_000_000,
            398_000_000, _qwen2(24, 896, 14, 2, 4864, 151936, tied=True)),
    Starter("bartowski/Qwen2.5-1.5B-Instruct-GGUF", "Qwen2.5-1.5B-Instruct-Q4_K_M.gguf", "1.5B", 1_540_000_000,
            986_000_000, _qwen2(28, 1536, 12, 2, 8960, 151936, tied=True)),
    Starter("bartowski/Qwen2.5-3B-Instruct-GGUF", "Qwen2.5-3B-Instruct-Q4_K_M.gguf", "3B", 3_090_000_000,
            1_930_000_000, _qwen2(36, 2048, 16, 2, 11008, 151936, tied=True)),
    Starter("bartowski/Qwen2.5-7B-Instruct-GGUF", "Qwen2.5-7B-Instruct-Q4_K_M.gguf", "7B", 7_610_000_000,
            4_680_000_000, _qwen2(28, 3584, 28, 4, 18944, 152064, tied=False)),
    Starter("bartowski/Qwen2.5-14B-Instruct-GGUF", "Qwen2.5-14B-Instruct-Q4_K_M.gguf", "14B", 14_700_000_000,
            8_990_000_000, _qwen2(48, 5120, 40, 8, 13824, 152064, tied=False)),
    Starter("bartowski/Qwen2.5-32B-Instruct-GGUF", "Qwen2.5-32B-Instruct-Q4_K_M.gguf", "32B", 32_500_000_000,
            19_900_000_000, _qwen2(64, 5120, 40, 8, 27648, 152064, tied=False)),
)


@dataclass(frozen=True)
class FirstRun:
    sentence: str
    suggestion: Starter | None  # None: nothing in the catalogue fits; the demo still runs
    largest: Starter | None = None  # the largest entry that fits (the sentence's N), beyond the suggestion on a CPU


def verdict(starter: Starter, hardware: HardwareSnapshot) -> str:
    """The fit's verdict for serving `starter` with llama.cpp on `hardware` now: yes / partial / no."""
    return quick_verdict(ENGINE, starter.size_bytes, starter.config, hardware)


def with_less_free(hardware: HardwareSnapshot, fraction: float = COMFORT_FRACTION) -> HardwareSnapshot:
    """`hardware` with only `fraction` of its free RAM and VRAM: a model that still fits there fits comfortably
    (a browser or a desktop taking some memory later does not push it out)."""
    gpus = [replace(g, memory_free_bytes=int(g.memory_free_bytes * fraction)) for g in hardware.gpus]
    return replace(hardware, gpus=gpus, ram_available_bytes=int(hardware.ram_available_bytes * fraction))


def describe_device(hardware: HardwareSnapshot) -> str:
    """'CPU only, 15.5 GiB RAM', 'NVIDIA GeForce RTX 4090, 24 GiB VRAM + 62.7 GiB RAM' or 'Apple M2 Max,
    32.0 GiB RAM (21 GiB of it for the GPU)'."""
    ram = f"{hardware.ram_total_bytes / GIB:.1f} GiB RAM"
    gpus = [g for g in hardware.gpus if g.memory_total_bytes > 0]
    if not gpus:
        return f"CPU only, {ram}"
    vram = sum(g.memory_total_bytes for g in gpus) / GIB
    names = sorted({g.name for g in gpus})
    name = names[0] if len(gpus) == 1 else f"{len(gpus)} GPUs ({' + '.join(names)})"
    if any(g.unified_memory for g in gpus):  # Apple Silicon: the GPU's share of the one memory
        return f"{name}, {ram} ({vram:.0f} GiB of it for the GPU)"
    return f"{name}, {vram:.0f} GiB VRAM + {ram}"


def _billions(starter: Starter) -> str:
    """The number the model is known by: "7" for a 7.61 B model, "0.5" for 0.49 B."""
    return starter.label.removesuffix("B")


def _quick_on_cpu(starters: list[Starter]) -> Starter:
    """The largest of `starters` (smallest first) a CPU answers at reading speed, else the smallest."""
    return ([s for s in starters if s.params <= CPU_SUGGESTION_MAX_PARAMS] or starters[:1])[-1]


def first_run(hardware: HardwareSnapshot, catalogue: tuple[Starter, ...] = STARTERS) -> FirstRun:
    """The sentence and the suggested first model for `hardware`. The sentence's N is the largest entry the fit
    says fits whole ("yes": in VRAM where there is a GPU, in RAM without one); the suggestion is the largest that
    still fits with a tenth less free memory, and on a CPU at most 3 B."""
    verdicts = [verdict(s, hardware) for s in catalogue]
    fitting = [s for s, v in zip(catalogue, verdicts, strict=True) if v == "yes"]
    device = describe_device(hardware)
    on_gpu = any(g.memory_total_bytes > 0 for g in hardware.gpus)
    if not fitting:
        spilling = [s for s, v in zip(catalogue, verdicts, strict=True) if v == "partial"]
        if spilling:  # a GPU too small for even the smallest: with some layers in RAM it still serves
            return FirstRun(f"{device}: models up to ~{_billions(spilling[-1])} B parameters at {QUANT} fit with "
                            "some layers in RAM (slower than all in VRAM)", _quick_on_cpu(spilling), spilling[-1])
        smallest = catalogue[0]
        return FirstRun(f"{device}: not even a {smallest.label} model at {QUANT} "
                        f"({smallest.size_bytes / 1e9:.2f} GB) fits in the memory free now; the built-in demo "
                        "model still runs", None)
    largest = fitting[-1]
    where = ("in GPU memory" if hardware.has_unified_memory else "in VRAM") if on_gpu else "in RAM"
    sentence = f"{device}: models up to ~{_billions(largest)} B parameters at {QUANT} fit {where}"
    tighter = with_less_free(hardware)
    comfortable = [s for s in fitting if verdict(s, tighter) == "yes"] or fitting[:1]
    return FirstRun(sentence, comfortable[-1] if on_gpu else _quick_on_cpu(comfortable), largest)
