"""The Machine page leads with one sentence and a first model (issue 52, item 2); the probes' errors wait behind
Details. The sentence and the suggestion on the page are the ones planning.first_model gives for the snapshot
the page detected (tests/test_first_model.py checks those by hand on recorded machines)."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from test_ui_pages import no_leaks, window  # noqa: F401 - shared fixtures

pytestmark = [pytest.mark.gui, pytest.mark.qt_log_ignore("propagateSizeHints")]


def test_the_first_page_reads_as_a_working_app(window, qtbot, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811, E501
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # Download & serve must not reach the real Hub here
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("SWITCHYARD_NO_KEYRING", "1")
    page = window.show_page("Machine")
    qtbot.waitUntil(lambda: bool(page.sentence.text()), timeout=30_000)
    ram_gib = page.snapshot.ram_total_bytes / 1024**3
    expected_device = f"CPU only, {ram_gib:.1f} GiB RAM" if not page.snapshot.gpus else page.snapshot.gpus[0].name
    assert page.sentence.text().startswith(expected_device), page.sentence.text()
    # the sentence is the first thing on the page, above the detected details
    assert page.sentence.isVisible() and page.sentence.y() < page.notice.y()
    # probe errors (NVML missing, no amdgpu device, ...) only behind Details
    if page.snapshot.notes:
        assert not page.notes_label.isVisible()
        page.details_button.click()
        assert page.notes_label.isVisible() and page.snapshot.notes[0] in page.notes_label.text()
    if page.suggested is not None:
        assert page.suggested.spec in page.suggestion_label.text()
        with qtbot.waitSignal(page.download_requested, timeout=5_000) as asked:
            page.download_button.click()
        assert asked.args == [page.suggested.spec] and asked.args[0].endswith(":Q4_K_M")
        qtbot.waitUntil(lambda: window.stack.currentWidget() is window.pages.get("Models"), timeout=5_000)
        models = window.pages["Models"]
        models.cancel()  # nothing answers on that port: stop whatever is left of the download
        qtbot.waitUntil(lambda: not models.downloading, timeout=60_000)
