"""Every page renders against real core services and the demo model; the real flow recommend → serve
llama.cpp → live charts → switch to vLLM → stop; quitting leaves no engine, thread or timer behind."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import psutil
import pytest
from PySide6.QtCore import QThreadPool, QTimer
from shiboken6 import isValid

pytestmark = [pytest.mark.gui, pytest.mark.qt_log_ignore("propagateSizeHints")]


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline() or [])
    except psutil.Error:  # exited meanwhile
        return ""


def _engine_children() -> list[psutil.Process]:
    """Engines and benchmark child processes (`gui --run-job`) started by this test process."""
    return [p for p in psutil.Process().children(recursive=True)
            if any(mark in _cmdline(p) for mark in ("llama-server", "vllm", "--run-job"))]


@pytest.fixture(autouse=True)
def no_leaks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Own state per test; at teardown the thread pool is idle and no engine process is left."""
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    before = {p.pid for p in _engine_children()}  # the session's shared servers (conftest) may already run
    yield
    assert QThreadPool.globalInstance().waitForDone(60_000), "a worker is still running"
    assert QThreadPool.globalInstance().activeThreadCount() == 0
    leaked = [p for p in _engine_children() if p.pid not in before]
    assert not leaked, f"an engine process outlived the test: {leaked}"


def _installed(engine: str):  # type: ignore[no-untyped-def]
    """An already provisioned engine (configured, on PATH or cached); the GUI installs on demand, tests do not."""
    from desktop.core.engines import get_adapter

    install = get_adapter(engine).find_install()
    if install is None:
        pytest.skip(f"{engine} is not provisioned (run `switchyard engines install {engine}`)")
    return install


@pytest.fixture
def llama_ready():  # type: ignore[no-untyped-def]
    return _installed("llama.cpp")


@pytest.fixture
def vllm_ready():  # type: ignore[no-untyped-def]
    return _installed("vllm")


@pytest.fixture
def window(qtbot):  # type: ignore[no-untyped-def]
    from desktop.ui.main_window import MainWindow

    win = MainWindow()
    win.session.endpoint_port = 0  # a free port: tests never fight over the configured one
    win.confirm_quit = lambda: True  # a failed test must not leave a modal "quit anyway?" dialog nobody answers
    qtbot.addWidget(win)
    win.show()
    yield win
    win.close()
    # pytest-qt closes and deletes registered widgets first; a window still stopping engines may be gone by now.
    qtbot.waitUntil(lambda: not isValid(win) or not win.isVisible(), timeout=120_000)
    if not isValid(win):
        return
    active = [t for t in win.findChildren(QTimer) if t.isActive()]
    assert not active, f"timers still running after close: {active}"


def test_window_starts_on_machine_page_with_keyboard_navigation(window, qtbot) -> None:  # type: ignore[no-untyped-def]
    from PySide6.QtCore import Qt

    assert window.stack.currentWidget() is window.pages["Machine"]
    qtbot.keyClick(window, Qt.Key.Key_4, Qt.KeyboardModifier.ControlModifier)
    assert window.stack.currentWidget() is window.pages["Serve"]
    assert set(window.pages) == {"Machine", "Serve"}  # pages are built on first visit only


def test_machine_page_shows_detected_hardware_and_live_memory(window, qtbot) -> None:  # type: ignore[no-untyped-def]
    page = window.show_page("Machine")
    qtbot.waitUntil(lambda: page.snapshot is not None, timeout=20_000)
    ram = page.bars["RAM"]
    assert ram.maximum() > 0 and 0 < ram.value() <= ram.maximum()
    assert "GiB free" in ram.format()
    assert page.snapshot.cpu.logical_cores >= 1
    assert page.summary.rowCount() >= 3


def test_models_page_lists_the_demo_model_pair(window, qtbot) -> None:  # type: ignore[no-untyped-def]
    page = window.show_page("Models")
    qtbot.waitUntil(lambda: bool(page.library), timeout=60_000)
    names = [page.library_table.item(row, 0).text() for row in range(page.library_table.rowCount())]
    assert "demo (llama.cpp)" in names and "demo (vLLM)" in names
    page.search()  # empty query: a readable hint, no request
    assert "Type what to look for" in page.notice.text()


def test_models_page_searches_lists_variants_and_downloads(window, qtbot, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from fakehub import FakeHub, write_tiny_gguf

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("SWITCHYARD_NO_KEYRING", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        gguf = write_tiny_gguf(tmp_path / "src" / "tiny-Q4_K_M.gguf", n_bytes=300_000)
        hub.add_repo("switchyard/tiny-GGUF", {"tiny-Q4_K_M.gguf": gguf.read_bytes(), "README.md": b"# tiny\n"},
                     tags=["gguf"])
        page = window.show_page("Models")
        page.query.setText("tiny")
        page.search()
        qtbot.waitUntil(lambda: page.hits_table.rowCount() > 0 or page.notice.level == "error", timeout=30_000)
        assert page.hits_table.item(0, 0).text() == "switchyard/tiny-GGUF", page.notice.text()
        page.hits_table.selectRow(0)
        qtbot.waitUntil(lambda: page.variants_table.rowCount() >= 1 or page.notice.level == "error", timeout=30_000)
        assert page.variants_table.item(0, 1).text() == "llama.cpp", page.notice.text()
        assert page.variants_table.item(0, 4).text() in {"fits", "partial (CPU offload)", "won't fit", "unknown"}
        page.variants_table.selectRow(0)
        assert page.download_button.isEnabled()
        page.download_button.click()
        qtbot.waitUntil(lambda: not page.downloading, timeout=60_000)
        assert page.progress_label.text().startswith("Downloaded to"), page.progress_label.text()
        qtbot.waitUntil(lambda: any("tiny" in row["name"] for row in page.library), timeout=30_000)


def test_recommend_page_explains_its_pick_for_the_demo_model(window, qtbot) -> None:  # type: ignore[no-untyped-def]
    page = window.show_page("Recommend")
    page.compute()
    qtbot.waitUntil(lambda: page.recommendation is not None, timeout=60_000)
    text = page.result_label.text()
    assert page.recommendation.engine in text and "Why:" in text and "Runner-up" in text
    from dataclasses import replace

    plan = page.launch_request()  # a LaunchPlan: the recommended one, its checked fields kept as asks
    assert plan is not None and plan.engine == page.recommendation.engine and plan.ctx_per_request >= 256
    assert plan.model == "demo"  # kept as typed, so a switch to the other engine finds its format
    assert replace(plan, model="", pinned=()) == page.recommendation.plan  # the fit's plan, launched as is
    assert "ctx_per_request" in plan.pinned or plan.ctx_per_request == 2048


def test_recommend_page_shows_bad_model_as_a_readable_error(window, qtbot) -> None:  # type: ignore[no-untyped-def]
    page = window.show_page("Recommend")
    page.model_edit.setText("/nonexistent/model.gguf")
    page.compute()
    qtbot.waitUntil(lambda: page.notice.level == "error", timeout=30_000)
    assert "Traceback" not in page.notice.text() and page.notice.text()
    assert page.recommend_button.isEnabled() and not page.launch_button.isEnabled()


def test_compare_checks_its_inputs_before_starting_anything(window, qtbot) -> None:  # type: ignore[no-untyped-def]
    compare = window.show_page("Compare")
    compare.endpoint_radio.setChecked(True)
    assert not compare.start()  # nothing served yet
    assert "start an engine" in compare.notice.text() and not compare.running
    compare.ab_radio.setChecked(True)
    compare.levels_edit.setText("1, lots")
    assert not compare.start()
    assert "whole numbers" in compare.notice.text()
    compare.levels_edit.setText("1")
    compare.engine_b.setCurrentIndex(compare.engine_a.currentIndex())
    assert not compare.start()
    assert "two different engines" in compare.notice.text()
    assert compare.job is None and compare.run_button.isEnabled()


def test_compare_ab_with_a_bad_model_reports_the_childs_error(window, qtbot) -> None:  # type: ignore[no-untyped-def]
    """The A/B runs in a real child process; its SwitchyardError arrives as one readable line, and the page is
    ready for the next run (the autouse fixture checks the child is gone)."""
    compare = window.show_page("Compare")
    compare.model_edit.setText("/nonexistent/model.gguf")
    compare.levels_edit.setText("1")
    assert compare.start()
    assert compare.running and not compare.run_button.isEnabled() and compare.stop_button.isEnabled()
    qtbot.waitUntil(lambda: not compare.running, timeout=60_000)
    assert compare.notice.level == "error"
    assert "model path does not exist" in compare.notice.text() and "Traceback" not in compare.notice.text()
    assert compare.run_button.isEnabled() and not compare.export_button.isEnabled() and compare.result is None


def test_compare_shows_an_ab_result_side_by_side_and_exports_it(window, qtbot, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The table and verdict from a real ABResult (built by core's analysis from recorded runs), and the
    report written by desktop.core.measure.reports is exported and opened."""
    from desktop.core.measure.ab import ABConfig, EngineResult, Repetition, analyse
    from desktop.core.measure.loadgen import LoadConfig, SweepResult, Target
    from desktop.core.measure.loadgen.metrics import summarize
    from desktop.core.measure.loadgen.runner import LoadResult
    from desktop.core.measure.reports import write_ab_report

    def engine(name: str, cold: float, tokens_per_s: float) -> EngineResult:
        from desktop.core.measure.loadgen.metrics import RequestResult

        requests = [RequestResult(index=i, start=float(i), success=True, ttft=0.05 * cold, latency=32 / tokens_per_s,
                                  elapsed=32 / tokens_per_s, itl=[1 / tokens_per_s] * 31, output_tokens=32,
                                  prompt_tokens=64) for i in range(4)]
        level = LoadResult(LoadConfig(concurrency=1, num_requests=4), Target("http://127.0.0.1:1"), {}, None,
                           summarize(requests, duration=4 * 32 / tokens_per_s), requests, [], 0.0)
        rep = Repetition({"t1_health_s": cold, "t2_first_token_s": cold + 0.5, "t3_first_request_s": cold + 1.0},
                         SweepResult([level]), {"load": 100.0 * cold}, [])
        return EngineResult(name, name, "1", "/m", {}, [rep])

    config = ABConfig(concurrency=(1,))
    result = analyse(config, [engine("llama.cpp", 1.0, 40.0), engine("vllm", 60.0, 80.0)], 0.0, 1.0)
    report = write_ab_report(result, tmp_path / "report")
    compare = window.show_page("Compare")
    compare.show_result({"result": result.to_json(), "report": report.to_json(), "run_id": None})
    table = compare.results_table
    cells = {table.item(r, 0).text(): [table.item(r, c).text() for c in (1, 2, 3)] for r in range(table.rowCount())}
    assert cells["Cold start T1: health OK (s)"] == ["1.00", "60.00", "60.00"]
    assert cells["concurrency 1: output tok/s"][2] == "2.00"
    assert {"concurrency 1: TTFT p50 (ms)", "concurrency 1: TTFT p95 (ms)", "Cold start T3: first request done (s)",
            "Peak memory (MiB, process tree)"} <= set(cells)
    from desktop.core.engines import get_adapter

    # the adapters' display names (one source for engine names)
    assert table.horizontalHeaderItem(3).text() == \
        f"{get_adapter('vllm').display_name} / {get_adapter('llama.cpp').display_name}"
    assert "pays back after" in compare.verdict_label.text()
    # the answer first (issue 52): the winner per concurrency over the table, by hand: 4 x 32 tokens in
    # 4 x 32 / 80 s = 80 tok/s for vLLM, 40 for llama.cpp; each row says which way is better
    vllm_name = get_adapter("vllm").display_name
    assert f"c=1: {vllm_name}, 80.0 vs 40.0 tok/s" in compare.verdict_label.text()
    assert compare.verdict_label.geometry().bottom() <= table.geometry().top()  # same box: the verdict on top
    better = {table.item(r, 0).text(): table.item(r, 4).text() for r in range(table.rowCount())}
    assert better["Cold start T1: health OK (s)"].startswith(get_adapter("llama.cpp").display_name)
    assert better["concurrency 1: output tok/s"] == f"{vllm_name} (higher is better)"
    qtbot.waitUntil(lambda: table.viewport().height() >= 8 * table.rowHeight(0), timeout=5_000)  # not 3.5 rows
    written = compare.export_to(tmp_path / "exported")
    assert sorted(p.name for p in written) == ["ab.csv", "ab.html", "ab.json"]
    assert "<svg" in (tmp_path / "exported" / "ab.html").read_text()
    opened = _capture_opened_urls(qtbot)
    assert compare.open_report()
    assert opened == [str(tmp_path / "exported" / "ab.html")]


def _capture_opened_urls(qtbot) -> list[str]:  # type: ignore[no-untyped-def]
    """QDesktopServices.openUrl for file: URLs lands here instead of a browser (until the test ends)."""
    from PySide6.QtCore import QObject, QUrl, Slot
    from PySide6.QtGui import QDesktopServices

    class Catcher(QObject):
        def __init__(self) -> None:
            super().__init__()
            self.urls: list[str] = []

        @Slot(QUrl)
        def handle(self, url: QUrl) -> None:
            self.urls.append(url.toLocalFile())

    catcher = Catcher()
    QDesktopServices.setUrlHandler("file", catcher, "handle")  # type: ignore[arg-type]
    _catchers.append(catcher)
    return catcher.urls


_catchers: list[object] = []


@pytest.fixture(autouse=True)
def _release_url_handler() -> Iterator[None]:
    yield
    if _catchers:
        from PySide6.QtGui import QDesktopServices

        QDesktopServices.unsetUrlHandler("file")
        _catchers.clear()


def test_history_lists_runs_from_the_real_store_and_reopens_reports(window, qtbot, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from desktop.core.storage.history import RunRecord, Store

    report = tmp_path / "r" / "ab.html"
    report.parent.mkdir()
    report.write_text("<html></html>")
    with Store() as store:  # under SWITCHYARD_HOME, set per test
        store.add_run(RunRecord(kind="bench", engine="llama.cpp", model="/models/demo.gguf", created_at=1000.0,
                                summary={"levels": [{"label": "concurrency 4", "output_throughput": 55.5,
                                                     "failed": 1}]}))
        store.add_run(RunRecord(kind="ab", engine="llama.cpp,vllm", model="demo", label="A/B llama.cpp vs vllm",
                                created_at=2000.0, report_path=str(report),
                                summary={"amortization": {"verdict": "vllm pays back after 3 min"}, "errors": []}))
    page = window.show_page("History")
    qtbot.waitUntil(lambda: page.table.rowCount() == 2, timeout=10_000)
    first = [page.table.item(0, c).text() for c in range(page.table.columnCount())]
    second = [page.table.item(1, c).text() for c in range(page.table.columnCount())]
    assert first[1:] == ["ab", "A/B llama.cpp vs vllm", "demo", "vllm pays back after 3 min", "HTML"]
    assert second[1:4] == ["bench", "llama.cpp", "demo.gguf"]
    assert "55.5 output tok/s at concurrency 4; 1 failed" in second[4] and second[5] == "—"
    page.table.selectRow(1)
    assert not page.open_button.isEnabled()  # no report for that run
    page.table.selectRow(0)
    assert page.open_button.isEnabled()
    opened = _capture_opened_urls(qtbot)
    assert page.open_report()
    assert opened == [str(report)]
    report.unlink()
    assert not page.open_report(0)
    assert "gone" in page.notice.text()


def test_history_starts_empty_with_a_hint(window, qtbot) -> None:  # type: ignore[no-untyped-def]
    page = window.show_page("History")
    qtbot.waitUntil(lambda: not page.loading, timeout=10_000)
    assert page.table.rowCount() == 0 and "No runs yet" in page.notice.text()


@pytest.mark.parametrize(("fmt", "expected"), [("shell", "llama-server"), ("docker", "docker run"),
                                               ("compose", "services:"), ("k8s", "kind: Deployment")])
def test_recommend_export_dialog_renders_copies_and_saves(window, qtbot, tmp_path, fmt, expected) -> None:  # type: ignore[no-untyped-def]
    from PySide6.QtGui import QGuiApplication

    page = window.show_page("Recommend")
    assert not page.export_button.isEnabled()
    page.compute()
    qtbot.waitUntil(lambda: page.recommendation is not None, timeout=60_000)
    assert page.export_button.isEnabled()
    dialog = page.open_export(modal=False)
    qtbot.addWidget(dialog)
    dialog.set_format(fmt)
    text = dialog.text.toPlainText()
    assert expected in text and str(page.recommendation.launch_plan().model_path) in text
    dialog.copy()
    assert QGuiApplication.clipboard().text() == text
    saved = dialog.save(tmp_path / f"plan.{fmt}")
    assert saved.read_text() == text
    dialog.close()


def test_export_dialog_explains_formats_the_engine_lacks(window, qtbot) -> None:  # type: ignore[no-untyped-def]
    from desktop.core.engines.base import LaunchPlan
    from desktop.ui.export_dialog import ExportDialog

    dialog = ExportDialog(LaunchPlan(engine="llama.cpp", model_path=Path("/models/demo.gguf")), parent=window)
    qtbot.addWidget(dialog)
    dialog.set_format("helm")
    assert dialog.text.toPlainText() == "" and "for vLLM" in dialog.notice.text()
    assert not dialog.copy_button.isEnabled() and not dialog.save_button.isEnabled()
    dialog.model_edit.setText("Qwen/Qwen3-0.6B-GGUF")
    dialog.set_format("docker")
    dialog.show_export()
    assert "Qwen/Qwen3-0.6B-GGUF" in dialog.text.toPlainText() and dialog.copy_button.isEnabled()
    dialog.close()


def test_serve_export_uses_the_form_when_nothing_runs(window, qtbot) -> None:  # type: ignore[no-untyped-def]
    serve = window.show_page("Serve")
    serve.engine_box.setCurrentIndex(serve.engine_box.findData("vllm"))
    serve.ctx_spin.setValue(4096)
    serve.open_export(modal=False)
    qtbot.waitUntil(lambda: serve.export_dialog is not None, timeout=30_000)
    dialog = serve.export_dialog
    qtbot.addWidget(dialog)
    dialog.set_format("shell")
    text = dialog.text.toPlainText()
    assert "vllm serve" in text and "--max-model-len 4096" in text
    dialog.close()


def test_serve_engine_flags_reach_the_exported_plan_and_owned_ones_are_refused(window, qtbot) -> None:  # type: ignore[no-untyped-def]
    serve = window.show_page("Serve")
    serve.engine_box.setCurrentIndex(serve.engine_box.findData("vllm"))
    serve.flags_edit.setText("--max-model-len 9")
    serve.start_clicked()
    assert "--max-model-len is set by the plan" in serve.notice.text() and "--ctx" in serve.notice.text()
    assert serve.session.process is None  # nothing started
    serve.flags_edit.setText("--seed 7 --disable-log-stats")
    serve.open_export(modal=False)
    qtbot.waitUntil(lambda: serve.export_dialog is not None, timeout=30_000)
    dialog = serve.export_dialog
    qtbot.addWidget(dialog)
    dialog.set_format("shell")
    assert "--seed 7 --disable-log-stats" in dialog.text.toPlainText()
    dialog.close()
    serve.flags_edit.setText("")


def test_settings_dialog_refuses_bad_values_and_saves_good_ones(window, qtbot) -> None:  # type: ignore[no-untyped-def]
    from desktop.core.storage import settings as core_settings
    from desktop.ui.settings_dialog import SettingsDialog

    dialog = SettingsDialog(window)
    qtbot.addWidget(dialog)
    dialog.models_dir.setText("relative/path")
    assert not dialog.save()
    assert "absolute" in dialog.notice.text()
    dialog.models_dir.setText("/srv/models")
    dialog.port.setValue(9123)
    assert dialog.save()
    assert core_settings.load().endpoint_port == 9123
