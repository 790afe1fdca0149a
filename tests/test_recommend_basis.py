"""Issue 39: the Recommend page leads with its whole answer, and every verdict says whether its figures were
measured here, came from the user's traffic or typed numbers, or are default figures (planning.basis, one
wording for the crossover, the page and the hybrid endpoint's decisions). Each test failed on 8409923, which said
"llama.cpp measures faster at every concurrency" over the recommender's default curves and showed the answer in a
three-line box with an inner scrollbar."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from desktop.core.planning.autopilot import PolicyInputs, decide
from desktop.core.planning.basis import MEASURE_IT, NOT_MEASURED
from desktop.core.planning.crossover import crossover, curves_from_history
from desktop.core.storage.history import RunRecord, Store


def _date(when: float) -> str:
    return time.strftime("%Y-%m-%d", time.localtime(when))


def _ab_run(store: Store, when: float) -> None:
    """An A/B on this machine where llama.cpp is faster at every level (a CPU, typically)."""
    comparison = [{"concurrency": c, "output_throughput": {"llama.cpp": {"mean": a}, "vllm": {"mean": b}},
                   "p95_ttft_ms": {"llama.cpp": {"mean": 10.0}, "vllm": {"mean": 20.0}}}
                  for c, a, b in ((1, 40.0, 20.0), (4, 70.0, 40.0))]
    store.add_run(RunRecord(kind="ab", engine="llama.cpp,vllm", model="demo", created_at=when, summary={
        "comparison": comparison, "cold_start": {"t3_first_request_s": {"llama.cpp": {"mean": 2.0},
                                                                        "vllm": {"mean": 50.0}}}}))


def _decision(runs: list[RunRecord]) -> str:
    """The hybrid endpoint's decision text for `demo` on this (CPU) machine, from its history."""
    from desktop.core.machine.hardware import detect
    from desktop.core.serving.autopilot import machine_crossover

    x = machine_crossover(runs, "demo", detect())
    return decide(PolicyInputs(now=time.time(), crossover=x, inflight=[(time.time(), 4.0)],
                               expected_remaining_s=3600.0, both_fit=True)).reason


# --- the wording, in the core -------------------------------------------------------------------------------------
def test_default_curves_never_say_measures_and_end_with_the_action_that_measures_them() -> None:
    x = crossover(curves_from_history([], "demo", cpu=True), operating_concurrency=4, operating_source="typed")
    assert "measure" not in x.verdict.replace(MEASURE_IT, "").replace(NOT_MEASURED, "")
    assert NOT_MEASURED in x.verdict and x.verdict.endswith(MEASURE_IT)
    gpu = crossover(curves_from_history([], "demo", cpu=False), operating_concurrency=16, operating_source="typed")
    assert "measures" not in gpu.verdict and NOT_MEASURED in gpu.verdict
    assert "at concurrency 16 (from the numbers you typed)" in gpu.verdict


def test_an_ab_here_makes_the_verdict_measured_here_on_its_date(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    when = time.time() - 60
    with Store() as store:
        _ab_run(store, when)
        runs = store.runs(limit=50)
    x = crossover(curves_from_history(runs, "demo", cpu=True))
    assert x.verdict.startswith("llama.cpp measures faster at every concurrency (1, 4; measured here on "
                                f"{_date(when)})")
    assert MEASURE_IT not in x.verdict


def test_the_hybrid_endpoints_decision_says_measures_only_after_an_ab(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    unmeasured = _decision([])
    assert "measures" not in unmeasured and NOT_MEASURED in unmeasured and unmeasured.endswith(MEASURE_IT)
    when = time.time() - 60
    with Store() as store:
        _ab_run(store, when)
        runs = store.runs(limit=50)
    measured = _decision(runs)
    assert f"llama.cpp measures faster at every concurrency (1, 4; measured here on {_date(when)})" in measured


# --- the page --------------------------------------------------------------------------------------------------
def _visible_text(widget: Any) -> str:
    """Every label the user can see on `widget`, as plain text."""
    from PySide6.QtWidgets import QLabel

    texts = [label.text() for label in widget.findChildren(QLabel) if label.isVisibleTo(widget.window())]
    return re.sub(r"<[^>]+>", " ", " ".join(texts)).replace("&amp;", "&")


@pytest.mark.gui
@pytest.mark.qt_log_ignore("propagateSizeHints")  # the offscreen platform's note, as in the other GUI tests
@pytest.mark.parametrize("size", [None, (1280, 800)], ids=["default-size", "1280x800"])
def test_the_recommend_page_shows_the_whole_answer_and_words_its_basis(  # type: ignore[no-untyped-def]
        qtbot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: tuple[int, int] | None) -> None:
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    from desktop.ui.main_window import MainWindow

    window = MainWindow()
    window.confirm_quit = lambda: True
    qtbot.addWidget(window)
    if size is not None:
        window.resize(*size)
    window.show()
    page = window.show_page("Recommend")
    qtbot.waitUntil(lambda: page.traffic.picture is not None, timeout=30_000)
    page.compute()
    qtbot.waitUntil(lambda: page.recommendation is not None, timeout=60_000)
    qtbot.waitUntil(page.answer_visible_whole, timeout=5_000)  # laid out: the whole Why list, no scrolling
    rec = page.recommendation
    shown = _visible_text(page)
    assert all(re.sub(r"\s+", " ", reason) in re.sub(r"\s+", " ", shown) for reason in rec.reasons)
    assert "Runner-up:" in shown and page.traffic.isVisible()
    assert "measures" not in shown and NOT_MEASURED in page.traffic.verdict.text()

    when = time.time() - 60
    with Store() as store:
        _ab_run(store, when)
    page.traffic.refresh("demo")
    qtbot.waitUntil(lambda: not page.traffic.loading and f"measured here on {_date(when)}"
                    in page.traffic.verdict.text(), timeout=30_000)
    assert "llama.cpp measures faster at every concurrency" in _visible_text(page)
