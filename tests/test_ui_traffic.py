"""Offscreen: the Recommend page's traffic panel reads the profile from a real history file, fills the questions
from it (the recommendation then says so; an edit overrides it), and draws the crossover chart with tagged curves,
the operating point and the crossover."""

from __future__ import annotations

import os
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

from desktop.core.storage.history import RunRecord, Store

pytestmark = [pytest.mark.gui, pytest.mark.qt_log_ignore("propagateSizeHints")]


def _traffic(store: Store, now: float) -> None:
    """60 requests one at a time, then 80 four at a time (prompts 100, outputs 20); one launch an hour ago."""
    rows = []
    t = now - 600.0
    for _ in range(60):
        rows.append({"t": t, "path": "/v1/completions", "model": "switchyard", "engine": "llama.cpp",
                     "status": 200, "prompt_tokens": 100, "output_tokens": 20, "ttft_s": 0.1, "e2e_s": 0.9})
        t += 1.0
    for step in range(20):
        for lane in range(4):
            rows.append({"t": t + step * 1.0 + lane * 0.01, "path": "/v1/completions", "model": "switchyard",
                         "engine": "llama.cpp", "status": 200, "prompt_tokens": 100, "output_tokens": 20,
                         "ttft_s": 0.2, "e2e_s": 0.95})
    store.add_requests(rows)
    store.add_run(RunRecord(kind="launch", engine="llama.cpp", model="demo", created_at=now - 3600.0,
                            summary={"cold_start": {"t3_first_request_s": 2.0}}))
    comparison = [{"concurrency": c, "output_throughput": {"llama.cpp": {"mean": a}, "vllm": {"mean": b}},
                   "p95_ttft_ms": {"llama.cpp": {"mean": 10.0}, "vllm": {"mean": 20.0}}}
                  for c, a, b in ((1, 40.0, 30.0), (8, 80.0, 160.0))]
    store.add_run(RunRecord(kind="ab", engine="llama.cpp,vllm", model="demo", created_at=now - 60.0, summary={
        "comparison": comparison, "cold_start": {"t3_first_request_s": {"llama.cpp": {"mean": 2.0},
                                                                        "vllm": {"mean": 50.0}}}}))


def test_traffic_panel_fills_the_questions_and_draws_the_crossover(qtbot, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    with Store() as store:
        _traffic(store, time.time())
    from desktop.ui.pages.recommend import RecommendPage

    page = RecommendPage()
    qtbot.addWidget(page)
    panel = page.traffic
    qtbot.waitUntil(lambda: panel.picture is not None, timeout=30_000)
    assert panel.summary.text().startswith("From your traffic: from 140 requests over")
    assert "p95 concurrency 4" in panel.summary.text()
    # enough traffic: the questions hold the profile's numbers
    assert (page.concurrency.value(), page.prompt_len.value(), page.output_len.value()) == (4, 100, 20)
    assert panel.use_button.isEnabled()
    # the chart: both engines' measured curves, tagged, the operating point at p95 4 and the crossover between 1, 8
    assert set(panel.series) == {"llama.cpp", "vllm"} and panel.series["vllm"] == [(1.0, 30.0), (8.0, 160.0)]
    assert panel.marks["operating"] == 4.0 and 1.0 < panel.marks["crossover"] < 8.0
    assert panel.legend.text().count("as measured on this machine on") == 2
    assert "overtakes llama.cpp at concurrency" in panel.verdict.text()
    assert page._traffic_line() and "from 140 requests" in page._traffic_line()[0]
    page.concurrency.setValue(9)  # a typed number overrides: the recommendation no longer claims the traffic
    assert page._traffic_line() == []
    page.concurrency.setValue(1)
    panel.use()  # the button puts the traffic's numbers back
    assert page.concurrency.value() == 4 and page._traffic_line()


def test_traffic_panel_without_traffic_keeps_typed_numbers_and_default_curves(  # type: ignore[no-untyped-def]
        qtbot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "empty"))
    from desktop.ui.pages.recommend import RecommendPage

    page = RecommendPage()
    qtbot.addWidget(page)
    before = page.concurrency.value()
    qtbot.waitUntil(lambda: page.traffic.picture is not None, timeout=30_000)
    assert "No traffic through the endpoint yet" in page.traffic.summary.text()
    assert page.concurrency.value() == before and not page.traffic.use_button.isEnabled()
    assert "default" in page.traffic.legend.text() and "operating" not in page.traffic.marks
