"""The app's own loop in clicks (issue 52), from a fresh home: search the stand-in Hub, download a repo's GGUF and
its safetensors, choose the GGUF in the Serve page's model picker (nothing typed), serve it on the real
llama-server, chat and see the answer rendered, switch to vLLM (the same download's safetensors copy) behind the
same URL; at every state change the state label, the status bar and the Serve page's notices agree."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from fakehub import FakeHub
from test_ui_pages import llama_ready, no_leaks, vllm_ready, window  # noqa: F401 - shared fixtures

pytestmark = [pytest.mark.gui, pytest.mark.engine, pytest.mark.llamacpp, pytest.mark.vllm,
              pytest.mark.qt_log_ignore("propagateSizeHints")]

REPO = "switchyard/demo-chat"
STEP_WORDS = ("Starting", "Switching", "Stopping")  # a notice that says a step is underway


class Agreement:
    """Records, at every change of the session's status (after the page and the window have shown it), what the
    state label, the status bar and the notice say, and what was wrong."""

    def __init__(self, win: Any, serve: Any) -> None:
        self.window, self.serve = win, serve
        self.seen: list[tuple[str, str, str, str]] = []
        self.wrong: list[str] = []
        for signal in (win.session.status_changed, win.session.ready, win.session.switched,
                       win.session.failed, win.session.stopped):
            signal.connect(self.check)  # connected last: runs after the page's and the window's own slots

    def check(self, *_: Any) -> None:
        # what the texts must agree with: the account published to them (the live status() can be a phase ahead,
        # moved by the engine's thread, until the next publish: comparing with it was a race)
        status = self.window.session.shown_status
        label = self.serve.state_label.text()
        bar = self.window.statusBar().currentMessage()
        notice = self.serve.notice.text() if self.serve.notice.isVisible() else ""
        self.seen.append((status.word, label, bar, notice))
        if label != status.line:
            self.wrong.append(f"label {label!r} but the state is {status.line!r}")
        if label not in bar or status.word not in bar:
            self.wrong.append(f"status bar {bar!r} under label {label!r} ({status.word})")
        if notice.startswith(STEP_WORDS) and status.action is None:
            self.wrong.append(f"notice {notice!r} while no step is underway ({label!r})")
        serving = status.serving
        engine = str(self.serve.engine_box.currentText())
        if serving and status.word == "switching" and not engine.startswith(serving):
            self.wrong.append(f"the engine box says {engine!r} while {serving} serves")


def _publish_repo(hub: FakeHub, demo_model: Any) -> None:
    """One repo with the demo's GGUF beside its safetensors folder, as many repos on the Hub ship both."""
    files: dict[str, bytes | Path] = {"demo-chat-F32.gguf": Path(demo_model.gguf_path)}
    for path in Path(demo_model.hf_dir).iterdir():
        files[path.name] = path
    hub.add_repo(REPO, files, tags=["gguf", "safetensors"])


def _download_all_variants(win: Any, qtbot: Any) -> Any:
    models = win.show_page("Models")
    models.query.setText("demo-chat")
    models.search_button.click()
    qtbot.waitUntil(lambda: models.hits_table.rowCount() > 0 or models.notice.level == "error", timeout=30_000)
    assert models.hits_table.item(0, 0).text() == REPO, models.notice.text()
    models.hits_table.selectRow(0)
    qtbot.waitUntil(lambda: models.variants_table.rowCount() >= 2 or models.notice.level == "error", timeout=30_000)
    engines = [models.variants_table.item(row, 1).text() for row in range(models.variants_table.rowCount())]
    assert sorted(engines) == ["llama.cpp", "vLLM"] or sorted(engines) == ["llama.cpp", "vllm"], engines
    for row in range(models.variants_table.rowCount()):
        models.variants_table.selectRow(row)
        models.download_button.click()
        qtbot.waitUntil(lambda: not models.downloading, timeout=120_000)
        assert "Downloaded" in models.progress_label.text(), models.progress_label.text()
    return models


def test_search_download_pick_serve_chat_switch_with_one_story(window, qtbot, llama_ready, vllm_ready,  # noqa: F811
                                                                demo_model, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from PySide6.QtCore import Qt

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("SWITCHYARD_NO_KEYRING", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    window.session.vllm_eager = True  # skips torch.compile: the switch takes about a minute less on CPU
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        _publish_repo(hub, demo_model)
        _download_all_variants(window, qtbot)
    serve = window.show_page("Serve")
    agreement = Agreement(window, serve)

    # the picker lists the download by its repo and quantization; choose it (no typing)
    picker = serve.launch_form.model_edit
    wanted = f"{REPO}:F32"
    qtbot.waitUntil(lambda: picker.findText(wanted, Qt.MatchFlag.MatchStartsWith) >= 0, timeout=60_000)
    picker.setCurrentIndex(picker.findText(wanted, Qt.MatchFlag.MatchStartsWith))
    chosen = Path(serve.launch_form.model())
    snapshot = tmp_path / "hf-cache" / "models--switchyard--demo-chat" / "snapshots"
    assert chosen.parent.parent == snapshot and chosen.name == "demo-chat-F32.gguf", chosen
    serve.engine_box.setCurrentIndex(serve.engine_box.findData("llama.cpp"))
    with qtbot.waitSignal(serve.engine_ready, timeout=300_000):
        serve.start_button.click()
    assert serve.state_label.text() == "serving: llama.cpp"
    assert window.statusBar().currentMessage() == "Engine: serving: llama.cpp"
    assert wanted in serve.notice.text() and "snapshots" not in serve.notice.text(), serve.notice.text()

    # chat: the answer arrives through the endpoint and is rendered in the transcript
    chat = serve.chat
    serve.bottom_tabs.setCurrentWidget(chat)
    chat.max_tokens_spin.setValue(12)
    chat.input.setPlainText("Say hello.")
    with qtbot.waitSignal(chat.answered, timeout=120_000) as answered:
        qtbot.mouseClick(chat.send_button, Qt.MouseButton.LeftButton)
    answer = answered.args[0]
    assert answer.text.strip() and answer.output_tokens > 0
    assert answer.text.strip()[:12] in chat.transcript.toPlainText()

    # switch to vLLM: the same download's safetensors copy, behind the same URL
    url = serve.endpoint_edit.text()
    outcome: list[object] = []
    window.session.switched.connect(outcome.append)
    window.session.failed.connect(outcome.append)
    serve.switch_button.click()
    qtbot.waitUntil(lambda: bool(outcome), timeout=900_000)
    assert not isinstance(outcome[0], str), f"the switch failed: {outcome[0]}"
    assert serve.state_label.text() == "serving: vLLM" and serve.endpoint_edit.text() == url
    assert window.statusBar().currentMessage() == "Engine: serving: vLLM"
    assert window.session.process.plan.model_path == chosen.parent  # the snapshot folder: config + safetensors
    assert serve.engine_box.currentData() == "vllm"
    with qtbot.waitSignal(window.session.stopped, timeout=120_000):
        serve.stop_button.click()
    words = [seen[0] for seen in agreement.seen]
    assert {"starting", "serving", "switching", "stopping", "stopped"} <= set(words), words
    assert agreement.wrong == [], agreement.wrong[:5]
