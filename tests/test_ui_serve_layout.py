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
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from test_ui_pages import no_leaks, window  # noqa: F401 - shared fixtures

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
    from PySide6.QtGui import QGuiApplication, QTextCursor

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
    assert cursor.charFormat().fontFixedPitch() or code[0].blockFormat().nonBreakableLines()
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
    head.push([sample("generation_tokens_per_s", 41.26, 1.0), sample("ttft_s", 0.100, 1.0),
               sample("ttft_s", 0.300, 2.0), sample("ttft_s", 0.200, 3.0), sample("ttft_s", 9.0, 3.5, "vllm@2"),
               sample("requests_running", 3, 3.0), sample("requests_waiting", 2, 3.0)], "llama.cpp@1")
    # by hand: median of 100, 300, 200 ms (the starting vLLM's 9 s left out) = 200 ms; in flight 3 + 2
    assert head.labels["tokens"].text() == "41.3"
    assert head.labels["ttft"].text() == "200 ms"
    assert head.labels["inflight"].text() == "5"
