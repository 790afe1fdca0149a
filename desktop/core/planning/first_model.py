"""The Machine page's first sentence and first model: what this machine can serve, in one line ("CPU only,
23.5 GiB RAM: models up to ~14 B parameters at Q4_K_M fit"), and a real model to start with that fits.

The sizes come from a short catalogue of well-known instruct GGUFs at Q4_K_M (file sizes approximately as the
Hugging Face Hub lists them, rounded; the verdict is only as good as those figures) judged by the fit's Hub-listing
verdict (`fit.quick_verdict`, the tagger the Models page's fit chips use): one sizing function, not a second
formula. Without a GPU the suggestion stops at 3 B parameters: larger models fit in RAM but answer far below
reading speed on a CPU."""

from __future__ import annotations

from dataclasses import dataclass

from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.planning.fit import quick_verdict

GIB = 1024**3
CPU_SUGGESTION_MAX_B = 3.0  # the largest model suggested where there is no GPU (speed, not memory)


@dataclass(frozen=True)
class Starter:
    repo: str
    file: str
    params_b: float
    size_bytes: int

    @property
    def spec(self) -> str:
        """What `switchyard pull` and the Models page's download take: the repo and the variant."""
        return f"{self.repo}:Q4_K_M"


STARTERS: tuple[Starter, ...] = (
    Starter("Qwen/Qwen2.5-0.5B-Instruct-GGUF", "qwen2.5-0.5b-instruct-q4_k_m.gguf", 0.5, 491_000_000),
    Starter("Qwen/Qwen2.5-1.5B-Instruct-GGUF", "qwen2.5-1.5b-instruct-q4_k_m.gguf", 1.5, 1_120_000_000),
    Starter("Qwen/Qwen2.5-3B-Instruct-GGUF", "qwen2.5-3b-instruct-q4_k_m.gguf", 3.0, 2_100_000_000),
    Starter("bartowski/Qwen2.5-7B-Instruct-GGUF", "Qwen2.5-7B-Instruct-Q4_K_M.gguf", 7.6, 4_680_000_000),
    Starter("bartowski/Qwen2.5-14B-Instruct-GGUF", "Qwen2.5-14B-Instruct-Q4_K_M.gguf", 14.8, 8_990_000_000),
    Starter("bartowski/Qwen2.5-32B-Instruct-GGUF", "Qwen2.5-32B-Instruct-Q4_K_M.gguf", 32.8, 19_850_000_000),
)


@dataclass(frozen=True)
class FirstRun:
    sentence: str
    suggestion: Starter | None  # None: nothing in the catalogue fits; the demo still runs


def _device(hardware: HardwareSnapshot) -> str:
    ram = f"{hardware.ram_total_bytes / GIB:.1f} GiB RAM"
    if not hardware.gpus:
        return f"CPU only, {ram}"
    gpus = hardware.gpus
    vram = sum(g.memory_total_bytes for g in gpus) / GIB
    name = gpus[0].name if len(gpus) == 1 else f"{len(gpus)} GPUs ({gpus[0].name}, …)"
    return f"{name}, {vram:.0f} GiB VRAM + {ram}"


def first_run(hardware: HardwareSnapshot) -> FirstRun:
    """The sentence and the suggested first model for `hardware`."""
    fitting = [s for s in STARTERS if quick_verdict("llama.cpp", s.size_bytes, None, hardware) == "yes"]
    device = _device(hardware)
    if not fitting:
        return FirstRun(f"{device}: none of the usual starter models (from 0.5 B parameters at Q4_K_M) fits in "
                        "what is free now; the demo model runs", None)
    largest = fitting[-1]
    where = "in VRAM" if hardware.gpus else "in RAM"
    sentence = f"{device}: models up to ~{largest.params_b:.0f} B parameters at Q4_K_M fit {where}"
    if largest.params_b < 1:
        sentence = f"{device}: models up to ~{largest.params_b:.1f} B parameters at Q4_K_M fit {where}"
    usable = fitting if hardware.gpus else [s for s in fitting if s.params_b <= CPU_SUGGESTION_MAX_B]
    return FirstRun(sentence, (usable or fitting)[-1])
