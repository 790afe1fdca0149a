"""The Models page's screenshot against a stand-in Hub on loopback (the test suite's `tests/fakehub.py`): the
screenshot run has no network, and the Models page should show what a person sees: search results, a repo's
variants with their fit chips, and a download in progress.

The listed repos are named as on the real Hub, with their files' sizes about as the real Hub lists them (rounded,
approximate); only the small repo being downloaded has real bytes (a tiny generated GGUF, sent
slowly so the shot catches it part-way). Used only by `switchyard gui --screenshots` from a checkout."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

GB = 1000**3
LISTED = {  # repo -> {file: size in bytes}: sizes only, never downloaded in the shot
    "Qwen/Qwen2.5-7B-Instruct-GGUF": {"qwen2.5-7b-instruct-q4_k_m.gguf": int(4.68 * GB),
                                      "qwen2.5-7b-instruct-q5_k_m.gguf": int(5.44 * GB),
                                      "qwen2.5-7b-instruct-q8_0.gguf": int(8.10 * GB),
                                      "qwen2.5-7b-instruct-fp16.gguf": int(15.2 * GB)},
    "Qwen/Qwen2.5-14B-Instruct-GGUF": {"qwen2.5-14b-instruct-q4_k_m.gguf": int(8.99 * GB),
                                       "qwen2.5-14b-instruct-q6_k.gguf": int(12.1 * GB),
                                       "qwen2.5-14b-instruct-q8_0.gguf": int(15.7 * GB),
                                       "qwen2.5-14b-instruct-fp16.gguf": int(29.5 * GB)},
    "Qwen/Qwen2.5-32B-Instruct-GGUF": {"qwen2.5-32b-instruct-q4_k_m.gguf": int(19.9 * GB),
                                       "qwen2.5-32b-instruct-q8_0.gguf": int(34.8 * GB)},
    "bartowski/Llama-3.2-3B-Instruct-GGUF": {"Llama-3.2-3B-Instruct-Q4_K_M.gguf": int(2.02 * GB),
                                             "Llama-3.2-3B-Instruct-Q8_0.gguf": int(3.42 * GB)},
}
DOWNLOADED = "switchyard/tiny-chat-GGUF"


def _fakehub() -> Any:
    """tests/fakehub.py from this checkout (the screenshot run is a developer's tool, run from the source tree)."""
    tests = Path(__file__).resolve().parents[2] / "tests"
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    import fakehub

    return fakehub


@contextlib.contextmanager
def stand_in_hub(scratch: Path) -> Iterator[Any]:
    """A stand-in Hub holding LISTED and one small downloadable repo; HF_ENDPOINT and HF_HUB_CACHE point at it
    and at `scratch` while the context lasts (the person's own cache is never touched)."""
    fakehub = _fakehub()
    saved = {name: os.environ.get(name) for name in ("HF_ENDPOINT", "HF_HUB_CACHE")}
    with fakehub.FakeHub() as hub:
        for index, (repo, files) in enumerate(LISTED.items()):
            added = hub.add_repo(repo, {name: b"GGUF" for name in files}, tags=["gguf"],
                                 downloads=(4 - index) * 120_000)
            for name, size in files.items():  # the listing's sizes; these files are never fetched
                added.files[name].size = size
        tiny = fakehub.write_tiny_gguf(scratch / "src" / "tiny-chat-Q4_K_M.gguf", n_bytes=4_000_000)
        hub.add_repo(DOWNLOADED, {"tiny-chat-Q4_K_M.gguf": tiny}, tags=["gguf"], downloads=900)
        hub.faults.throttle("tiny-chat-Q4_K_M.gguf", 0.2)  # slow enough for the shot to catch it part-way
        os.environ["HF_ENDPOINT"] = hub.endpoint
        os.environ["HF_HUB_CACHE"] = str(scratch / "hf-cache")
        try:
            yield hub
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def save_models(window: Any, out: Path, scratch: Path, wait_until: Callable[..., bool],
                grab: Callable[[Any, Path], Path]) -> Path | None:
    """2-models.png: results for "gguf", the 14B repo's variants with fit chips, and the tiny repo's
    download part-way (cancelled after the shot)."""
    models = window.show_page("Models")
    with stand_in_hub(scratch):
        models.query.setText("gguf")
        models.search()
        if not wait_until(lambda: models.hits_table.rowCount() >= 3 or models.notice.level == "error", 30):
            print(f"the stand-in Hub's search did not answer: {models.notice.text()}", file=sys.stderr)
            return None
        tiny = next((r for r in range(models.hits_table.rowCount())
                     if models.hits_table.item(r, 0).text() == DOWNLOADED), None)
        if tiny is not None:
            models.hits_table.selectRow(tiny)
            wait_until(lambda: models.variants_table.rowCount() >= 1, 30)
            models.variants_table.selectRow(0)
            models.download()
            wait_until(lambda: models.progress.value() > 30, 60)
        shown = next(r for r in range(models.hits_table.rowCount())
                     if models.hits_table.item(r, 0).text().startswith("Qwen/Qwen2.5-14B"))
        models.hits_table.selectRow(shown)
        wait_until(lambda: models.variants_table.rowCount() >= 4, 30)
        models.variants_table.clearSelection()  # the fit chips in their colours
        wait_until(lambda: False, 0.4)
        path = grab(window, out / "2-models.png")
        models.cancel()
        wait_until(lambda: not models.downloading, 60)
    return path
