"""The Machine page's first sentence and suggestion (issue 52, item 2), on recorded machines.

The verdicts are the fit's own; the expected answers are worked out here by hand from the snapshots' free memory
and each entry's file size plus its KV cache at llama.cpp's 4,096-token default context:
KV bytes = layers x 2 (K and V) x KV heads x head width (hidden / heads) x 2 bytes (f16) x 4,096 tokens.
Weights + KV is a lower bound of what the engine needs (compute buffers, the CUDA context come on top), so a model
whose weights + KV exceed the free memory cannot fit, and one far below it must."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.planning.first_model import STARTERS, first_run, verdict

SNAPDIR = Path(__file__).parent / "snapshots"
GIB = 1024**3
BY_LABEL = {s.label: s for s in STARTERS}


def _weights_and_kv(label: str) -> float:
    """Bytes of the file plus its f16 KV cache for 4,096 tokens, by hand from the config's shape."""
    starter = BY_LABEL[label]
    cfg = starter.config
    head_width = cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_width * 2 * 4096
    return starter.size_bytes + kv


def test_the_hand_figures_are_what_the_catalogue_says() -> None:
    """Anchors for the hand arithmetic below: 7B = 4.68 GB + 28 x 2 x 4 x 128 x 2 x 4096 B = 4.58 GiB;
    14B = 8.99 GB + 0.75 GiB = 9.12 GiB; 32B = 19.9 GB + 1.00 GiB = 19.53 GiB."""
    assert _weights_and_kv("7B") / GIB == pytest.approx(4.58, abs=0.01)
    assert _weights_and_kv("14B") / GIB == pytest.approx(9.12, abs=0.01)
    assert _weights_and_kv("32B") / GIB == pytest.approx(19.53, abs=0.01)
    assert [s.params for s in STARTERS] == sorted(s.params for s in STARTERS)  # smallest first
    assert all(s.spec == f"{s.repo}:Q4_K_M" and s.file.endswith("Q4_K_M.gguf") for s in STARTERS)


def test_a_16_gib_laptop_without_a_gpu_is_told_7b_fits_and_offered_the_3b() -> None:
    laptop = HardwareSnapshot.load(SNAPDIR / "cpu_laptop.json")  # 16 GiB, 9.0 GiB available, no GPU
    assert laptop.ram_available_bytes == 9 * GIB and not laptop.gpus
    # by hand: 7B needs >= 4.58 GiB of 9.0 (fits with room); 14B needs >= 9.12 GiB > 9.0 (cannot)
    assert verdict(BY_LABEL["14B"], laptop) == "no"
    answer = first_run(laptop)
    assert answer.sentence == "CPU only, 16.0 GiB RAM: models up to ~7 B parameters at Q4_K_M fit in RAM"
    # the suggestion stops at 3B on a CPU: a 7B fits but answers slowly
    assert answer.suggestion == BY_LABEL["3B"] and answer.largest == BY_LABEL["7B"]
    assert answer.suggestion.spec == "bartowski/Qwen2.5-3B-Instruct-GGUF:Q4_K_M"


def test_an_8_gib_laptop_is_not_offered_the_7b() -> None:
    laptop = HardwareSnapshot.load(SNAPDIR / "cpu_laptop.json")
    small = replace(laptop, ram_total_bytes=8 * GIB, ram_available_bytes=4 * GIB)
    # by hand: 7B needs >= 4.58 GiB > 4.0 free; 3B: 1.93 GB + 36 x 2 x 2 x 128 x 2 x 4096 B = 1.94 GiB of 4.0
    assert _weights_and_kv("7B") > small.ram_available_bytes > 2 * _weights_and_kv("3B")
    answer = first_run(small)
    assert verdict(BY_LABEL["7B"], small) == "no"
    assert answer.sentence == "CPU only, 8.0 GiB RAM: models up to ~3 B parameters at Q4_K_M fit in RAM"
    assert answer.suggestion == BY_LABEL["3B"]


def test_a_24_gib_gpu_with_18_gib_free_is_offered_the_14b() -> None:
    a5000 = HardwareSnapshot.load(SNAPDIR / "a5000_busy.json")  # 23.5 GiB, 18.05 GiB free (another process)
    free = a5000.gpus[0].memory_free_bytes
    # by hand: 14B needs >= 9.12 GiB of 18.05 (with room to spare); 32B needs >= 19.53 GiB > 18.05
    assert 2 * _weights_and_kv("7B") < free and _weights_and_kv("14B") < 0.9 * free < free < _weights_and_kv("32B")
    assert verdict(BY_LABEL["7B"], a5000) == "yes"  # what an 8 GiB laptop is refused fits here
    answer = first_run(a5000)
    assert answer.sentence == ("NVIDIA RTX A5000, 24 GiB VRAM + 64.0 GiB RAM: models up to ~14 B parameters at "
                               "Q4_K_M fit in VRAM")
    assert answer.suggestion == BY_LABEL["14B"]
    assert answer.suggestion.spec == "bartowski/Qwen2.5-14B-Instruct-GGUF:Q4_K_M"


def test_a_model_that_only_just_fits_is_named_but_a_roomier_one_suggested() -> None:
    """An RTX 4090 with 20.0 GiB free: the 32B (>= 19.53 GiB) fits, so the sentence says 32 B, but with a tenth of
    the free memory taken by something else (18.0 GiB) it would not: the suggestion is the 14B."""
    rtx = HardwareSnapshot.load(SNAPDIR / "rtx4090_20free.json")
    free = rtx.gpus[0].memory_free_bytes
    assert 0.9 * free < _weights_and_kv("32B") < free
    answer = first_run(rtx)
    assert answer.sentence.endswith("models up to ~32 B parameters at Q4_K_M fit in VRAM")
    assert answer.sentence.startswith("NVIDIA GeForce RTX 4090, 24 GiB VRAM")
    assert answer.suggestion == BY_LABEL["14B"] and answer.largest == BY_LABEL["32B"]
    # with 22.5 GiB free (the plain rtx4090 snapshot) the 32B is comfortable: 0.9 x 22.47 = 20.2 GiB >= 20.09 needed
    assert first_run(HardwareSnapshot.load(SNAPDIR / "rtx4090.json")).suggestion == BY_LABEL["32B"]


def test_a_machine_too_small_for_any_starter_says_so_and_points_at_the_demo() -> None:
    laptop = HardwareSnapshot.load(SNAPDIR / "cpu_laptop.json")
    tiny = replace(laptop, ram_available_bytes=int(0.3 * GIB))  # below the 0.5B's 398 MB file alone (0.37 GiB)
    assert BY_LABEL["0.5B"].size_bytes > tiny.ram_available_bytes
    answer = first_run(tiny)
    assert answer.suggestion is None and answer.largest is None
    assert answer.sentence.startswith("CPU only, 16.0 GiB RAM: not even a 0.5B model at Q4_K_M (0.40 GB) fits")
    assert answer.sentence.endswith("the built-in demo model still runs")


def test_unified_memory_is_not_called_vram() -> None:
    mac = HardwareSnapshot.load(SNAPDIR / "m2max_32gb.json")
    answer = first_run(mac)
    assert answer.sentence.startswith("Apple M2 Max, 32.0 GiB RAM (21 GiB of it for the GPU): models up to ~")
    assert "VRAM" not in answer.sentence and answer.sentence.endswith("fit in GPU memory")
