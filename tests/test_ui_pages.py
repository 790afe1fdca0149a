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

pytestmark = [pytest.mark.gui, pytest.mark.qt_log_ignore("propagateSizeHints")]


def _engine_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "llama-server" in " ".join(p.cmdline() or []) or "vllm" in " ".join(p.cmdline() or [])]


@pytest.fixture(autouse=True)
def no_leaks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Own state per test; at teardown the thread pool is idle and no engine process is left."""
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    yield
    assert QThreadPool.globalInstance().waitForDone(60_000), "a worker is still running"
    assert QThreadPool.globalInstance().activeThreadCount() == 0
    assert not _engine_children(), "an engine process outlived the test"


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
    qtbot.addWidget(win)
    win.show()
    yield win
    win.close()
    qtbot.waitUntil(lambda: not win.isVisible(), timeout=120_000)
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
    request = page.launch_request()
    assert request is not None and request.engine == page.recommendation.engine and request.ctx >= 256


def test_recommend_page_shows_bad_model_as_a_readable_error(window, qtbot) -> None:  # type: ignore[no-untyped-def]
    page = window.show_page("Recommend")
    page.model_edit.setText("/nonexistent/model.gguf")
    page.compute()
    qtbot.waitUntil(lambda: page.notice.level == "error", timeout=30_000)
    assert "Traceback" not in page.notice.text() and page.notice.text()
    assert page.recommend_button.isEnabled() and not page.launch_button.isEnabled()


def test_compare_and_history_render_and_explain_what_is_missing(window, qtbot) -> None:  # type: ignore[no-untyped-def]
    compare = window.show_page("Compare")
    compare.start()  # nothing served yet
    assert "start an engine" in compare.notice.text()
    history = window.show_page("History")
    assert history.isVisible()


def test_settings_dialog_refuses_bad_values_and_saves_good_ones(window, qtbot) -> None:  # type: ignore[no-untyped-def]
    from desktop.core import settings as core_settings
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


@pytest.mark.engine
@pytest.mark.llamacpp
def test_recommend_serve_llamacpp_charts_and_quit_stops_it(window, qtbot, llama_ready, demo_model) -> None:  # type: ignore[no-untyped-def]
    """The real flow on llama.cpp: recommendation → launch → ready behind the stable endpoint → live samples →
    log and phases → quitting stops the engine (checked by the autouse fixture)."""
    import httpx

    recommend = window.show_page("Recommend")
    recommend.compute()
    qtbot.waitUntil(lambda: recommend.recommendation is not None, timeout=60_000)
    assert recommend.recommendation.engine == "llama.cpp"  # CPU-only machine: vLLM needs a GPU here
    serve = window.pages.get("Serve") or window.page("Serve")
    with qtbot.waitSignal(serve.engine_ready, timeout=300_000):
        recommend.launch_button.click()
    assert window.stack.currentWidget() is serve
    url = serve.endpoint_edit.text()
    assert url == window.session.endpoint_url and url.endswith("/v1")
    answer = httpx.post(url + "/completions", json={"prompt": "Hello", "max_tokens": 8}, timeout=60, trust_env=False)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
    qtbot.waitUntil(lambda: serve.charts["Engine process"].curves["cpu_percent"].buffer.count >= 2, timeout=30_000)
    qtbot.waitUntil(lambda: serve.charts["Latency"].curves["proxy_ttft_ms"].buffer.count >= 1, timeout=30_000)
    assert {"T1_health", "T2_first_token"} <= set(serve.timeline.phases)
    assert serve.state_label.text() == "ready"
    qtbot.waitUntil(lambda: "listening" in serve.log_pane.view.toPlainText(), timeout=10_000)
    serve.log_pane.search.setText("listening")
    assert serve.log_pane.status.text() == ""  # found
    process = window.session.process
    window.close()
    qtbot.waitUntil(lambda: not window.isVisible(), timeout=120_000)
    assert not process.is_running()


@pytest.mark.engine
@pytest.mark.llamacpp
@pytest.mark.vllm
def test_flow_recommend_serve_llamacpp_switch_to_vllm_stop(window, qtbot, llama_ready, vllm_ready, demo_model) -> None:  # type: ignore[no-untyped-def]
    """recommend → serve llama.cpp → charts receive samples → switch to vLLM behind the same URL → stop."""
    import httpx

    recommend = window.show_page("Recommend")
    recommend.compute()
    qtbot.waitUntil(lambda: recommend.recommendation is not None, timeout=60_000)
    serve = window.page("Serve")
    with qtbot.waitSignal(serve.engine_ready, timeout=300_000):
        recommend.launch_button.click()
    url = serve.endpoint_edit.text()
    qtbot.waitUntil(lambda: serve.samples_received > 0, timeout=30_000)
    with qtbot.waitSignal(window.session.switched, timeout=1_500_000) as switched:
        serve.switch_button.click()
    result = switched.args[0]
    assert (result.from_engine, result.to_engine) == ("llama.cpp", "vllm")
    assert result.failed_requests == 0
    assert "Switched llama.cpp → vllm" in serve.switch_label.text()
    assert serve.endpoint_edit.text() == url  # the same URL before and after
    answer = httpx.post(url + "/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=120, trust_env=False)
    assert answer.status_code == 200
    assert window.session.process.adapter.name == "vllm"
    with qtbot.waitSignal(window.session.stopped, timeout=120_000):
        serve.stop_button.click()
    assert not window.session.is_running()
