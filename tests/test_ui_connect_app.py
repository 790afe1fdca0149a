"""The Serve page's "Connect an app" tab (issue 53, item 3): what to paste per agent and per SDK, the endpoint's
key hidden until asked for and copied for real, the context warning per agent, nothing while nothing serves.

The expected lines are written here by hand from the clients' own documentation (Claude Code reads
ANTHROPIC_BASE_URL without /v1, ...), not taken from the code under test. The copied OpenAI and Anthropic text is
run as it is in bash: the real `openai` and `anthropic` SDKs read the variables it exports (and its Python lines)
and ask a loopback stand-in that records the key each request showed, then the real endpoint of a served demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from test_ui_pages import llama_ready, no_leaks, window  # noqa: F401 - shared fixtures

pytestmark = [pytest.mark.gui, pytest.mark.qt_log_ignore("propagateSizeHints")]

KEY = "sk-connect-Q7x2"
PORT = 8123
URL = f"http://127.0.0.1:{PORT}"
# the SDKs read OPENAI_* / ANTHROPIC_* from the environment, then print the model ids they listed
READ_ENV = """
import os, openai, anthropic
print("base", os.environ["OPENAI_BASE_URL"], os.environ["ANTHROPIC_BASE_URL"])
print("models", [m.id for m in openai.OpenAI(max_retries=0).models.list()])
print("anthropic", anthropic.Anthropic(max_retries=0).messages.create(
    model=os.environ["SWITCHYARD_MODEL"], max_tokens=8, messages=[{"role": "user", "content": "hi"}]).content[0].text)
"""


class _Recorder(BaseHTTPRequestHandler):
    """Answers /v1/models, /v1/chat/completions and /v1/messages; records (path, Authorization, x-api-key): the
    Anthropic SDK has sent its key in either (the endpoint takes both)."""

    seen: list[tuple[str, str | None, str | None]] = []

    def log_message(self, *_: Any) -> None:
        pass

    def _answer(self, body: dict[str, Any]) -> None:
        _Recorder.seen.append((self.path, self.headers.get("Authorization"), self.headers.get("x-api-key")))
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer({"object": "list", "data": [{"id": "switchyard", "object": "model", "created": 0,
                                                  "owned_by": "switchyard"}]})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path.startswith("/v1/messages"):
            self._answer({"id": "msg_1", "type": "message", "role": "assistant", "model": "switchyard",
                          "content": [{"type": "text", "text": "hello from messages"}], "stop_reason": "end_turn",
                          "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 3}})
            return
        self._answer({"id": "c1", "object": "chat.completion", "created": 0, "model": "switchyard",
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello from chat"},
                                   "finish_reason": "stop"}],
                      "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}})


@pytest.fixture
def recorder() -> Iterator[str]:
    _Recorder.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def card(qtbot):  # type: ignore[no-untyped-def]
    from desktop.ui.pages.serve_clients import ConnectApp

    widget = ConnectApp()
    qtbot.addWidget(widget)
    widget.show()
    return widget


def connection(url: str = URL, context: int = 65_536, api_key: str | None = None) -> Any:
    from desktop.core.agents.clients import Connection

    return Connection(url=url, model="switchyard", context=context, api_key=api_key)


def run_pasted(text: str, check: str = READ_ENV) -> subprocess.CompletedProcess[str]:
    """`text` pasted into bash as it is (its exports, its Python heredoc), then `check` in the same shell, with
    this venv's python3 first on PATH and no HTTP proxy between the SDKs and loopback."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith(("OPENAI_", "ANTHROPIC_"))}
    env.update(CLIP=text, CHECK=check, PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    return subprocess.run(["bash", "-c", 'set -e; eval "$CLIP"; python3 -c "$CHECK"'], env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_nothing_shows_while_nothing_serves(card, qtbot) -> None:  # type: ignore[no-untyped-def]
    from PySide6.QtGui import QGuiApplication

    QGuiApplication.clipboard().setText("before")
    assert card.empty.isVisible() and "appears once an engine serves" in card.empty.text()
    assert not card.body.isVisible() and card.shown_text() == ""
    card.copy()
    assert QGuiApplication.clipboard().text() == "before"
    card.show_connection(connection())
    assert card.body.isVisible() and not card.empty.isVisible()
    card.show_connection(None)  # the engine stopped
    assert card.empty.isVisible() and not card.body.isVisible() and card.shown_text() == ""


def test_claude_code_and_codex_get_their_settings_and_a_context_warning_below_their_need(card) -> None:  # type: ignore[no-untyped-def]
    card.choose("claude")
    card.show_connection(connection(context=4096))
    text = card.shown_text()
    assert "switchyard launch claude --port 8123\n" in text  # the card's endpoint, even where another one runs
    assert f"export ANTHROPIC_BASE_URL={URL}\n" in text  # Claude Code appends /v1/messages itself
    assert "export ANTHROPIC_DEFAULT_HAIKU_MODEL=switchyard\n" in text
    assert "export CLAUDE_CODE_ATTRIBUTION_HEADER=0\n" in text
    assert "export ANTHROPIC_AUTH_TOKEN=switchyard\n" in text  # no key asked: the placeholder, shown as is
    assert card.warning.isVisible()
    assert "4,096 tokens per request" in card.warning.text() and "Claude Code needs about 25,000" in card.warning.text()
    card.show_connection(connection(context=65_536))
    assert not card.warning.isVisible()

    card.choose("codex")
    text = card.shown_text()
    assert "switchyard launch codex --port 8123\n" in text and "codex --profile switchyard" in text
    home = Path(os.environ.get("CODEX_HOME") or Path.home() / ".codex")  # where Codex reads its profiles
    assert f"{home}/switchyard.config.toml" in text and "[model_providers.switchyard]" in text
    # an absolute path: TOML strings are not shell words, nothing expands a ~ in them
    assert f'model_catalog_json = "{home}/switchyard-models.json"' in text and '"context_window": 65536' in text
    assert f'base_url = "{URL}/v1/"' in text and 'wire_api = "responses"' in text
    assert "model_context_window = 65536" in text and "export SWITCHYARD_API_KEY=switchyard" in text
    assert not card.warning.isVisible()
    card.show_connection(connection(context=32_768))
    assert card.warning.isVisible() and "Codex CLI needs about 64,000" in card.warning.text()

    card.choose("opencode")
    assert "switchyard launch opencode --port 8123\n" in card.shown_text()
    assert f'"baseURL":"{URL}/v1"' in card.shown_text() and '"context":32768' in card.shown_text()
    assert card.warning.isVisible() and "OpenCode needs about 64,000" in card.warning.text()
    card.choose("openai")  # an SDK asks for no particular context
    assert not card.warning.isVisible()


def test_the_key_is_hidden_until_asked_for_and_copy_copies_the_real_one(card, recorder) -> None:  # type: ignore[no-untyped-def]
    from PySide6.QtGui import QGuiApplication

    card.choose("openai")
    card.show_connection(connection(url=recorder, api_key=KEY))
    assert KEY not in card.shown_text() and "<key hidden>" in card.shown_text()
    assert card.show_key.isEnabled() and not card.show_key.isChecked()
    card.show_key.click()
    assert KEY in card.shown_text() and "<key hidden>" not in card.shown_text()
    assert f"export OPENAI_API_KEY={KEY}\n" in card.shown_text()
    card.show_key.click()
    assert KEY not in card.shown_text()
    for target in ("claude", "codex", "opencode", "anthropic", "ollama"):  # hidden on every target
        card.choose(target)
        assert KEY not in card.shown_text() and "<key hidden>" in card.shown_text(), target

    card.choose("openai")
    card.copy_button.click()
    copied = QGuiApplication.clipboard().text()
    assert f"export OPENAI_BASE_URL={recorder}/v1\n" in copied and f"export OPENAI_API_KEY={KEY}\n" in copied
    assert "<key hidden>" not in copied
    run = run_pasted(copied)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "hello from chat" in run.stdout  # the pasted Python lines asked the endpoint
    assert f"base {recorder}/v1 {recorder}\n" in run.stdout and "models ['switchyard']" in run.stdout
    assert "anthropic hello from messages" in run.stdout
    paths = {path: (auth, api_key) for path, auth, api_key in _Recorder.seen}
    assert paths["/v1/chat/completions"][0] == f"Bearer {KEY}" and paths["/v1/models"][0] == f"Bearer {KEY}"
    assert KEY in (paths["/v1/messages"][1], (paths["/v1/messages"][0] or "").removeprefix("Bearer "))  # either way

    _Recorder.seen = []
    card.choose("anthropic")
    card.copy_button.click()
    run = run_pasted(QGuiApplication.clipboard().text(), check="")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "hello from messages" in run.stdout and _Recorder.seen[0][0] == "/v1/messages"
    assert KEY in (_Recorder.seen[0][2], (_Recorder.seen[0][1] or "").removeprefix("Bearer "))


def test_an_endpoint_without_a_key_shows_the_placeholder_and_no_show_key(card) -> None:  # type: ignore[no-untyped-def]
    card.choose("openai")
    card.show_connection(connection())
    assert not card.show_key.isEnabled() and "asks for no key" in card.show_key.toolTip()
    assert "export OPENAI_API_KEY=switchyard\n" in card.shown_text() and "<key hidden>" not in card.shown_text()
    assert f'base_url="{URL}/v1", api_key="switchyard"' in card.shown_text()
    assert 'model="switchyard"' in card.shown_text()


def test_ollama_clients_are_pointed_at_the_endpoint_in_place_of_ollama(card) -> None:  # type: ignore[no-untyped-def]
    card.choose("ollama")
    card.show_connection(connection())
    text = card.shown_text()
    # the official ollama client reads OLLAMA_HOST (no /v1: the endpoint answers Ollama's /api/ routes itself)
    assert f"export OLLAMA_HOST={URL}\n" in text and "11434" in text
    assert "OLLAMA_API_KEY" not in text  # the endpoint asks for no key
    assert not card.warning.isVisible()


def test_the_serve_page_card_follows_a_served_demo(window, qtbot, llama_ready, demo_model) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    from PySide6.QtGui import QGuiApplication

    serve = window.show_page("Serve")
    card = serve.connect_app
    serve.bottom_tabs.setCurrentWidget(card)
    assert serve.bottom_tabs.tabText(serve.bottom_tabs.indexOf(card)) == "Connect an &app"
    assert card.empty.isVisible() and not card.body.isVisible()
    qtbot.waitUntil(lambda: not serve.launch_form.model_edit.loading, timeout=60_000)
    serve.choose_model("demo", "llama.cpp")
    serve.ctx_spin.setValue(4096)
    with qtbot.waitSignal(serve.engine_ready, timeout=300_000):
        serve.start_button.click()
    port = window.session.proxy.port  # the app's endpoint, where it really listens
    qtbot.waitUntil(lambda: card.body.isVisible(), timeout=10_000)
    card.choose("claude")
    assert f"export ANTHROPIC_BASE_URL=http://127.0.0.1:{port}\n" in card.shown_text()
    assert "4,096 tokens per request" in card.warning.text() and card.warning.isVisible()
    assert not card.show_key.isEnabled()  # the app's endpoint asks for no key

    card.choose("openai")
    card.copy_button.click()
    check = ("import openai; client = openai.OpenAI(max_retries=0)\n"
             "print('models', [m.id for m in client.models.list()])\n")
    run = run_pasted(QGuiApplication.clipboard().text(), check=check)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "models ['switchyard']" in run.stdout
    with qtbot.waitSignal(window.session.stopped, timeout=120_000):
        serve.stop_clicked()
    qtbot.waitUntil(lambda: card.empty.isVisible(), timeout=10_000)
    assert card.shown_text() == ""
