"""The "Measure quality" action (issue 56) on the Recommend and Models pages, and the one core job behind it and
`switchyard quality` (desktop.core.measure.quality_job.run_quality).

Real tools: llama.cpp's own llama-quantize and llama-perplexity score the demo's Q8_0 and Q4_K_M copies against its
float32 original. Expected values come from outside the code under test, as in tests/test_quality.py: 8 bits per
weight lose less than ~4.8 (KLD(Q8_0) < KLD(Q4_K_M)), any quantization loses something, and the figures are the
tool's own. A short corpus (the shipped one's first 3,000 characters, 128-token chunks: 819 positions here) keeps
each run to about 15 s on 2 cores."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from PySide6.QtCore import Qt
from test_ui_pages import llama_ready, no_leaks, window  # noqa: F401 - shared fixtures

from desktop.core.measure.quality import SHIPPED_CORPUS
from desktop.core.storage.history import Store

pytestmark = [pytest.mark.gui, pytest.mark.qt_log_ignore("propagateSizeHints")]
CTX = 128
RUN_MS = 300_000  # a cold run quantizes both copies first (cached afterwards): well under a minute here


@pytest.fixture
def short_corpus(tmp_path: Path) -> Path:
    short = tmp_path / "short.txt"
    short.write_text(SHIPPED_CORPUS.read_text()[:3000])
    return short


def _quality_runs() -> list[Any]:
    with Store() as store:
        return store.runs(kind="quality")


@pytest.mark.engine
@pytest.mark.llamacpp
def test_run_quality_measures_with_the_real_tools_and_records_exactly_one_run(llama_ready, demo_model,  # noqa: F811
                                                                              short_corpus: Path) -> None:
    from desktop.core.common.progress import ProgressEvent
    from desktop.core.measure.quality_job import run_quality

    seen: list[ProgressEvent] = []
    report, run_id = run_quality("demo", ["Q8_0", "Q4_K_M"], prompts=str(short_corpus), ctx=CTX,
                                 progress=seen.append)
    q8, q4 = report.variants
    assert (q8.variant, q4.variant) == ("Q8_0", "Q4_K_M")
    assert 0 < q8.mean_kld < q4.mean_kld and q8.same_top >= q4.same_top and q4.same_top < 1, report.variants
    assert q8.tokens == q4.tokens > 0 and report.reference.endswith("demo.gguf") and report.ctx == CTX
    assert any(e.message.startswith("reference: demo.gguf") for e in seen), seen
    (run,) = _quality_runs()  # exactly one run, the one returned
    assert run.id == run_id and run.kind == "quality" and run.engine == "llama.cpp" and run.model == "demo"
    assert run.summary == report.to_json()
    assert run.settings == {"reference": report.reference, "corpus": str(short_corpus), "ctx": CTX}


@pytest.mark.engine
@pytest.mark.llamacpp
def test_recommend_pages_button_measures_and_the_answer_then_shows_the_run(window, qtbot, llama_ready,  # noqa: F811
                                                                           demo_model, short_corpus) -> None:
    page = window.show_page("Recommend")
    page.compute()
    qtbot.waitUntil(lambda: page.recommendation is not None, timeout=60_000)
    assert "quality Q8_0 against" not in page.result_label.text()  # nothing measured in this history yet
    asked: list[str] = []
    page.quality.ask_variants = lambda model: asked.append(model) or "Q8_0, Q4_K_M"
    page.quality.prompts, page.quality.ctx = str(short_corpus), CTX
    measured: list[Any] = []
    page.quality.measured.connect(lambda *args: measured.append(args))
    qtbot.mouseClick(page.quality.button, Qt.MouseButton.LeftButton)
    assert page.quality.running and not page.quality.button.isEnabled()
    # ends either way: a failed run is reported at once, not waited on for the whole budget
    qtbot.waitUntil(lambda: not page.quality.running, timeout=RUN_MS)
    assert measured, page.notice.text()
    assert asked == ["demo"] and page.quality.button.isEnabled()
    report, run_id = page.quality.report, page.quality.run_id
    q8, q4 = report.variants
    assert q8.mean_kld < q4.mean_kld and q4.mean_kld > 0, report.variants
    status = page.quality.status.text()
    assert f"history run #{run_id}" in status and f"Q4_K_M: mean KLD {q4.mean_kld:.4f}" in status
    assert f"{q8.tokens} tokens" in status
    (run,) = _quality_runs()
    assert run.id == run_id and run.summary["variants"] == report.to_json()["variants"]
    shown = f"quality Q8_0 against demo.gguf: mean KLD {q8.mean_kld:.4f}, p99 {q8.kld_p99:.4f}"
    # the page answers again by itself: the figures then name the run just measured
    qtbot.waitUntil(lambda: shown in page.result_label.text(), timeout=60_000)
    assert f"run #{run_id}" in page.result_label.text() and page.notice.level != "error"


def test_a_failed_measurement_is_a_readable_message_and_records_nothing(window, qtbot, llama_ready) -> None:  # noqa: F811
    page = window.show_page("Recommend")
    page.model_edit.setText("/nonexistent/model.gguf")
    page.quality.ask_variants = lambda model: "Q8_0"
    page.quality.start()
    qtbot.waitUntil(lambda: page.notice.level == "error", timeout=30_000)
    text = page.notice.text()
    assert "Measuring quality failed: model path does not exist" in text and "Traceback" not in text, text
    assert page.quality.button.isEnabled() and not page.quality.running and not page.quality.status.isVisible()
    assert _quality_runs() == []


def test_models_page_offers_it_for_gguf_rows_only_and_reports_a_bad_variant(window, qtbot, llama_ready,  # noqa: F811
                                                                           demo_model) -> None:
    page = window.show_page("Models")
    qtbot.waitUntil(lambda: bool(page.library), timeout=60_000)
    panel = page.library_box
    names = [row["name"] for row in page.library]
    panel.table.selectRow(names.index("demo (vLLM)"))
    assert not panel.quality.button.isEnabled()  # a Hugging Face folder: llama-perplexity cannot score it
    panel.table.selectRow(names.index("demo (llama.cpp)"))
    assert panel.quality.button.isEnabled()
    cancelled: list[str] = []
    panel.quality.ask_variants = lambda model: cancelled.append(model)  # the dialog cancelled: nothing runs
    panel.quality.button.click()
    assert cancelled == ["demo"] and not panel.quality.running
    panel.quality.ask_variants = lambda model: "Q8.0"
    panel.quality.button.click()
    qtbot.waitUntil(lambda: page.notice.level == "error", timeout=30_000)
    assert "Q8.0 is neither a file nor a quantization type" in page.notice.text(), page.notice.text()
    assert panel.quality.button.isEnabled() and _quality_runs() == []
