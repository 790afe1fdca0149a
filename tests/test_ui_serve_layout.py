"""The Serve page leads with what a person needs (issue 52, item 3): the chat first with at least half the window,
its answers rendered as Markdown (a fenced block becomes a code block), Copy and Regenerate; the charts in their own
tab; three headline figures from the telemetry. The chat talks to a loopback stand-in that streams a fixed Markdown
answer in OpenAI's chunk format, so the rendering can be checked against text written by hand."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from test_ui_pages import llama_ready, no_leaks, window  # noqa: F401 - shared fixtures

pytestmark = [pytest.mark.gui, pytest.mark.qt_log_ignore("propagateSizeHints")]

ANSWER = "## Steps\n\n- one **bold** item\n\n```python\nprint('switch')\n```\n"
PIECES = ["## Steps\n\n- one ", "**bold** item\n\n```py", "thon\nprint('switch')\n", "```\n"]


class _StandIn(BaseHTTPRequestHandler):
    asked: list[list[dict[str, Any]]] = []

    def log_message(self, *_: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _StandIn.asked.append(body["messages"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for piece in PIECES:
            chunk = {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}}
        self.wfile.write(f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def stand_in() -> Iterator[str]:
    _StandIn.asked = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_chat_renders_markdown_copies_and_regenerates_with_room(window, qtbot, stand_in) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    from PySide6.QtGui import QGuiApplication, QTextCursor, QTextFormat

    serve = window.show_page("Serve")
    chat = serve.chat
    assert serve.bottom_tabs.currentWidget() is chat and serve.bottom_tabs.tabText(0) == "&Chat"
    assert serve.bottom_tabs.indexOf(serve.live) == 1  # the charts have their own tab
    window.resize(1280, 860)
    qtbot.waitUntil(lambda: chat.height() >= window.height() / 2, timeout=5_000)  # room: half the window at least

    chat.set_endpoint(stand_in, "switchyard")
    chat.input.setPlainText("How do I switch?")
    with qtbot.waitSignal(chat.answered, timeout=30_000):
        chat.send_button.click()
    document = chat.transcript.document()
    text = document.toPlainText()
    assert "Steps" in text and "## Steps" not in text and "**bold**" not in text  # rendered, not escaped
    # the fenced block is one code block in a fixed-pitch font, holding exactly the code written above
    blocks = [document.findBlockByNumber(n) for n in range(document.blockCount())]
    code = [b for b in blocks if b.text() == "print('switch')"]
    assert code, [b.text() for b in blocks]
    cursor = QTextCursor(code[0])
    cursor.setPosition(code[0].position() + 1)
    assert code[0].blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence)  # a code block, as Qt reads one
    assert code[0].blockFormat().property(QTextFormat.Property.BlockCodeLanguage) == "python"
    assert cursor.charFormat().fontFixedPitch()  # in a fixed-pitch font
    assert code[0].blockFormat().background().color().name() == "#f2f2f2"  # on a shaded background
    prose = next(b for b in blocks if "bold item" in b.text())
    assert not prose.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence)
    heading = next(b for b in blocks if b.text() == "Steps")
    assert heading.blockFormat().headingLevel() == 2  # "## Steps"
    bold = QTextCursor(next(b for b in blocks if "bold item" in b.text()))
    bold.setPosition(bold.block().position() + bold.block().text().index("bold") + 1)
    assert bold.charFormat().fontWeight() > 500

    chat.copy_button.click()
    assert QGuiApplication.clipboard().text() == ANSWER  # the raw Markdown, as the model wrote it

    with qtbot.waitSignal(chat.answered, timeout=30_000):
        assert chat.regenerate_button.isEnabled()
        chat.regenerate_button.click()
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]  # the new answer replaced the old one
    assert _StandIn.asked[-1][-1] == {"role": "user", "content": "How do I switch?"}
    assert len(_StandIn.asked[-1]) == len(_StandIn.asked[0])  # the same question, without the old answer
    assert chat.transcript.toPlainText().count("How do I switch?") == 1


def test_headline_figures_come_from_the_serving_engines_samples(window) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    serve = window.show_page("Serve")
    head = serve.headline
    sample = lambda series, value, t, source="llama.cpp@1": SimpleNamespace(  # noqa: E731
        series=series, value=value, t=t, source=source)
    head.push([sample("ttft_s", 7.0, -70.0), sample("generation_tokens_per_s", 41.26, 1.0),
               sample("ttft_s", 0.100, 1.0), sample("ttft_s", 0.500, 2.0), sample("ttft_s", 0.200, 3.0),
               sample("ttft_s", 9.0, 3.5, "vllm@2"),
               sample("requests_running", 3, 3.0), sample("requests_waiting", 2, 3.0)], "llama.cpp@1")
    # by hand: median of 100, 500, 200 ms = 200 ms (the mean would be 267 ms; the 7 s of 73 s before the newest
    # is past the minute, the starting vLLM's 9 s is not the serving engine's); in flight 3 running + 2 waiting
    assert head.labels["tokens"].text() == "41.3"
    assert head.labels["ttft"].text() == "200 ms"
    assert head.labels["inflight"].text() == "5"
    # llama-server reports no TTFT of its own: the endpoint's, one per request, is what clients wait, and wins
    # once there is any: median of 300, 40, 90 ms = 90 ms (the endpoint's samples carry no engine: "proxy")
    head.push([sample("proxy_ttft_s", 0.300, 4.0, "proxy"), sample("proxy_ttft_s", 0.040, 5.0, "proxy"),
               sample("proxy_ttft_s", 0.090, 6.0, "proxy")], "llama.cpp@1")
    assert head.labels["ttft"].text() == "90 ms"


DEMO_LABEL_BY_HAND = "demo (random weights: its answers are noise)"


def _cache_repo(cache_root: Path, repo: str, files: dict[str, bytes], commit: str) -> Path:
    """A repo as huggingface_hub leaves it in its cache: content in blobs/, snapshots/<commit>/ links to them,
    refs/main naming the commit. Returns the snapshot folder."""
    import hashlib

    storage = cache_root / f"models--{repo.replace('/', '--')}"
    (storage / "blobs").mkdir(parents=True)
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, content in files.items():
        blob = hashlib.sha256(content).hexdigest()
        (storage / "blobs" / blob).write_bytes(content)
        (snapshot / name).symlink_to(f"../../blobs/{blob}")
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    return snapshot


def _index_starting(picker, text: str) -> int:  # type: ignore[no-untyped-def]
    from PySide6.QtCore import Qt

    return int(picker.findText(text, Qt.MatchFlag.MatchStartsWith))


def test_picker_lists_the_library_with_size_and_fit_and_hands_on_the_path(window, qtbot, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: E501, F811
    from fakehub import write_tiny_gguf

    cache_root = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache_root))
    gguf = write_tiny_gguf(tmp_path / "src" / "alpha-Q4_K_M.gguf", n_bytes=3_000_000, seed=1).read_bytes()
    commit = "a1" * 20
    snapshot = _cache_repo(cache_root, "alpha-org/alpha-GGUF", {"alpha-Q4_K_M.gguf": gguf}, commit)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128, "torch_dtype": "float16"}
    tensors = _cache_repo(cache_root, "beta-org/beta", {"config.json": json.dumps(config).encode(),
                                                        "model.safetensors": b"\0" * 40_000}, "b2" * 20)

    serve = window.show_page("Serve")  # the page reads the library when it comes into view
    picker = serve.launch_form.model_edit
    assert serve.model_edit is picker
    qtbot.waitUntil(lambda: _index_starting(picker, "alpha-org/alpha-GGUF:Q4_K_M") >= 0, timeout=60_000)
    assert picker.itemText(0) == DEMO_LABEL_BY_HAND and picker.itemData(0) == "demo"
    index = _index_starting(picker, "alpha-org/alpha-GGUF:Q4_K_M")
    entry = picker.itemText(index)
    size = len(gguf) / 2**20  # by hand: the blob's bytes in MiB (a ~3 MB file)
    assert f"{size:.1f} MiB" in entry and entry.endswith("fits"), entry  # a 3 MB model fits in any RAM
    assert commit not in entry and "snapshots" not in entry

    # the safetensors folder is vLLM's: listed, not choosable while llama.cpp is the engine
    beta = _index_starting(picker, "beta-org/beta")
    assert beta >= 0 and not picker.model().item(beta).isEnabled()

    picker.setCurrentIndex(index)  # chosen, nothing typed
    assert serve.launch_form.model() == str(snapshot / "alpha-Q4_K_M.gguf")

    serve.engine_box.setCurrentIndex(serve.engine_box.findData("vllm"))  # the list is read again for vLLM
    qtbot.waitUntil(lambda: picker.model().item(_index_starting(picker, "beta-org/beta")).isEnabled(),
                    timeout=60_000)
    assert not picker.model().item(_index_starting(picker, "alpha-org/alpha-GGUF:Q4_K_M")).isEnabled()
    picker.setCurrentIndex(_index_starting(picker, "beta-org/beta"))
    assert serve.launch_form.model() == str(tensors)

    picker.setEditText("/models/typed-by-hand.gguf")  # a typed path still works
    assert serve.launch_form.model() == "/models/typed-by-hand.gguf"


def test_choose_model_selects_the_model_and_its_engine_without_starting(window, qtbot, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: E501, F811
    from fakehub import write_tiny_gguf

    cache_root = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache_root))
    serve = window.show_page("Serve")
    picker = serve.launch_form.model_edit
    serve.engine_box.setCurrentIndex(serve.engine_box.findData("vllm"))
    qtbot.waitUntil(lambda: picker.count() >= 1 and not picker.loading, timeout=60_000)

    # a download that finished after the list was read: chosen at once, named by its repo and quantization
    gguf = write_tiny_gguf(tmp_path / "src" / "gamma-Q8_0.gguf", n_bytes=200_000, seed=3).read_bytes()
    snapshot = _cache_repo(cache_root, "gamma-org/gamma-GGUF", {"gamma-Q8_0.gguf": gguf}, "c3" * 20)
    window.show_page("Models")
    window.serve_model(str(snapshot / "gamma-Q8_0.gguf"), "llama.cpp")  # what the Models page's Serve calls
    assert window.stack.currentWidget() is serve
    assert serve.engine_box.currentData() == "llama.cpp"
    assert serve.launch_form.model() == str(snapshot / "gamma-Q8_0.gguf")
    assert picker.currentText().startswith("gamma-org/gamma-GGUF:Q8_0"), picker.currentText()
    # once the library is read again the entry carries its size and fit, still chosen
    qtbot.waitUntil(lambda: " · " in picker.currentText(), timeout=60_000)
    assert picker.currentText().startswith("gamma-org/gamma-GGUF:Q8_0 · ")
    assert serve.launch_form.model() == str(snapshot / "gamma-Q8_0.gguf")
    assert not window.session.is_running() and serve.start_button.isEnabled()  # ready to Start, not started

    serve.choose_model("demo", "vllm")
    assert serve.engine_box.currentData() == "vllm"
    assert picker.currentText() == DEMO_LABEL_BY_HAND and serve.launch_form.model() == "demo"


@pytest.mark.engine
@pytest.mark.llamacpp
def test_the_demo_serving_says_its_answers_are_noise_and_the_card_names_the_model_id(window, qtbot, llama_ready, demo_model) -> None:  # type: ignore[no-untyped-def]  # noqa: E501, F811
    from PySide6.QtGui import QGuiApplication

    serve = window.show_page("Serve")
    picker = serve.launch_form.model_edit
    qtbot.waitUntil(lambda: not picker.loading, timeout=60_000)
    serve.choose_model("demo", "llama.cpp")
    assert not serve.client_model.copy_button.isEnabled()  # nothing serves yet: no id to copy
    with qtbot.waitSignal(serve.engine_ready, timeout=300_000):
        serve.start_button.click()
    note = serve.chat.note_label
    assert not note.isHidden() and "random weights: its answers are noise" in note.text()
    # the id clients send: the endpoint's served name, as README's curl example sends it
    assert serve.client_model.id_edit.text() == "switchyard"
    serve.client_model.copy_button.click()
    assert QGuiApplication.clipboard().text() == "switchyard"
    with qtbot.waitSignal(window.session.stopped, timeout=120_000):
        serve.stop_clicked()
    assert serve.client_model.id_edit.text() == "" and not serve.client_model.copy_button.isEnabled()
