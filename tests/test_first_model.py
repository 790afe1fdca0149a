"""The Machine page's first sentence and suggestion (issue 52, item 2), on recorded machines: the verdicts are
the fit's own, the expected answers worked out by hand from the snapshots' memory and the catalogue's sizes
(need = size x 1.2 + 0.5 GiB, the Hub listing's rule, against free VRAM, or free RAM without a GPU)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.planning.first_model import STARTERS, first_run

SNAPDIR = Path(__file__).parent / "snapshots"
GIB = 1024**3


def _need(size: int) -> float:
    return size * 1.2 + GIB / 2


def test_a_cpu_only_machine_is_told_in_one_line_and_offered_a_small_model() -> None:
    laptop = HardwareSnapshot.load(SNAPDIR / "cpu_laptop.json")
    answer = first_run(laptop)
    fits = [s for s in STARTERS if _need(s.size_bytes) <= laptop.ram_available_bytes]
    assert fits, "the laptop snapshot should fit at least the smallest starter"
    assert answer.sentence.startswith(f"CPU only, {laptop.ram_total_bytes / GIB:.1f} GiB RAM: models up to ~")
    assert f"~{fits[-1].params_b:.0f} B" in answer.sentence or f"~{fits[-1].params_b:.1f} B" in answer.sentence
    assert answer.suggestion is not None and answer.suggestion.params_b <= 3.0  # a CPU answers slowly beyond
    assert answer.suggestion.spec.endswith(":Q4_K_M")


def test_a_24_gib_gpu_fits_the_14b_and_suggests_it() -> None:
    rtx = HardwareSnapshot.load(SNAPDIR / "rtx4090.json")
    free = sum(g.memory_free_bytes for g in rtx.gpus)
    # by hand: 14B Q4_K_M 8.99 GB -> 10.55 GiB needed; 32B 19.85 GB -> 22.68 GiB needed
    fits = [s.params_b for s in STARTERS if _need(s.size_bytes) <= free]
    answer = first_run(rtx)
    assert answer.suggestion is not None and answer.suggestion.params_b == fits[-1]
    assert "RTX 4090" in answer.sentence and "in VRAM" in answer.sentence


def test_a_machine_too_small_for_any_starter_says_so() -> None:
    laptop = HardwareSnapshot.load(SNAPDIR / "cpu_laptop.json")
    tiny = replace(laptop, ram_available_bytes=int(0.6 * GIB))  # below 491 MB x 1.2 + 0.5 GiB = 1.05 GiB
    answer = first_run(tiny)
    assert answer.suggestion is None and "demo model runs" in answer.sentence
