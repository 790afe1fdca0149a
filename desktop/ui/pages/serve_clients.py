"""The Serve page's "Connect an app" tab: what to paste into Claude Code, Codex, OpenCode, an OpenAI or Anthropic
client, and why an Ollama-only app cannot connect. Every value is rendered from desktop.core.agents.clients, the
one source `switchyard launch` runs agents with, so the card and the command never disagree. The endpoint's key
stays hidden until asked for; Copy copies the real one, since that is what the user pastes."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from desktop.core.agents import clients
from desktop.core.agents.clients import AGENTS, CODEX_PROFILE, Connection
from desktop.core.agents.codex_home import CATALOG, PROFILE, codex_home

HIDDEN = "<key hidden>"  # shown where the endpoint's key goes until "Show key" is on
TARGETS: list[tuple[str, str]] = [
    *((name, agent.title) for name, agent in AGENTS.items()),
    ("openai", "OpenAI SDK / any OpenAI client"),
    ("anthropic", "Anthropic SDK"),
    ("ollama", "Ollama clients"),
]
EMPTY = "What to paste into Claude Code, Codex, OpenCode or an OpenAI or Anthropic client appears once an engine serves"
NO_KEY_TIP = (f"The endpoint asks for no key: clients send '{clients.NO_KEY}' only because the SDKs refuse to "
              "start without one")


def _agent_text(name: str, c: Connection) -> str:
    agent = AGENTS[name]
    port = c.url.rstrip("/").rsplit(":", 1)[-1]
    lines = [f"# One command: sets everything below and runs {agent.title}",
             f"switchyard launch {name} --port {port}", ""]
    if name == "codex":  # absolute paths: TOML does not expand ~ (CODEX_HOME honoured, as `launch` does)
        home = codex_home()
        lines += [f"# Or by hand: write this profile to {home / PROFILE},",
                  clients.codex_profile_toml(c, str(home / CATALOG)).rstrip("\n"), "",
                  f"# write this model catalog to {home / CATALOG},",
                  json.dumps(clients.codex_catalog(c), indent=2), "",
                  f"# and set the key in the shell you start `{agent.command} --profile {CODEX_PROFILE}` from"]
    else:
        lines.append(f"# Or by hand: set these in the shell you start `{agent.command}` from")
    return "\n".join(lines) + "\n" + clients.shell_exports(clients.agent_env(name, c))


def _sdk_text(target: str, c: Connection) -> str:
    """The variables any OpenAI or Anthropic client reads, then three lines of Python with the values spelled out,
    run by the same paste (a heredoc: the whole text is a shell script that asks the endpoint once)."""
    if target == "openai":
        snippet = ["from openai import OpenAI",
                   f"client = OpenAI(base_url={json.dumps(c.openai_base_url)}, api_key={json.dumps(c.key)})",
                   f"print(client.chat.completions.create(model={json.dumps(c.model)}, max_tokens=64, "
                   'messages=[{"role": "user", "content": "Say hello"}]).choices[0].message.content)']
    else:
        snippet = ["from anthropic import Anthropic",
                   f"client = Anthropic(base_url={json.dumps(c.url.rstrip('/'))}, api_key={json.dumps(c.key)})",
                   f"print(client.messages.create(model={json.dumps(c.model)}, max_tokens=64, "
                   'messages=[{"role": "user", "content": "Say hello"}]).content[0].text)']
    sdk = "openai" if target == "openai" else "anthropic"
    return ("# The variables OpenAI and Anthropic clients read (the official SDKs among them)\n"
            + clients.shell_exports(clients.generic_env(c))
            + f"\n# The same in Python (pip install {sdk}): asks the endpoint once\n"
            + "python3 - <<'EOF'\n" + "\n".join(snippet) + "\nEOF\n")


def _ollama_text(c: Connection) -> str:
    """Ollama's clients: the endpoint answers Ollama's own API (/api/chat, /api/generate, /api/tags ...), so they
    need only its address in place of Ollama's 127.0.0.1:11434."""
    return "\n".join([
        "# Ollama clients (the ollama CLI and libraries, apps that speak Ollama's API): point them here",
        "# instead of 127.0.0.1:11434; in an app's settings, the server URL is the host below",
    ]) + "\n" + clients.shell_exports(clients.ollama_env(c)) + f"# the model to ask for: {c.model}\n"


def paste_text(target: str, c: Connection) -> str:
    """What to paste for `target` (a name in TARGETS), every value taken from `c` through agents.clients."""
    if target in AGENTS:
        return _agent_text(target, c)
    if target == "ollama":
        return _ollama_text(c)
    return _sdk_text(target, c)


def context_warning(target: str, c: Connection) -> str | None:
    """One line when the served context is below what the agent needs (AGENTS), else None."""
    agent = AGENTS.get(target)
    if agent is None or c.context >= agent.context_needed:
        return None
    return (f"Served with {c.context:,} tokens per request; {agent.title} needs about {agent.context_needed:,} "
            f"tokens: {agent.why}. Start again with a larger Context.")


class ConnectApp(QWidget):
    """A chooser of apps, what to paste for the one chosen (the key masked until "Show key"), Copy, and the context
    warning; one line while nothing serves."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.connection: Connection | None = None
        self.chooser = QComboBox()
        for name, title in TARGETS:
            self.chooser.addItem(title, name)
        self.chooser.setAccessibleName("App to connect")
        self.chooser.currentIndexChanged.connect(lambda _index: self._render())
        chooser_label = QLabel("A&gent or client:")
        chooser_label.setBuddy(self.chooser)
        self.show_key = QPushButton("Show &key")
        self.show_key.setCheckable(True)
        self.show_key.toggled.connect(lambda _on: self._render())
        self.copy_button = QPushButton("Cop&y")
        self.copy_button.setToolTip("Copy this text, with the real key, to the clipboard")
        self.copy_button.clicked.connect(self.copy)
        self.text = QPlainTextEdit()
        self.text.setReadOnly(True)
        self.text.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.text.setAccessibleName("What to paste")
        self.warning = QLabel("")
        self.warning.setObjectName("contextWarning")
        self.warning.setWordWrap(True)
        self.warning.hide()
        self.empty = QLabel(EMPTY)
        self.empty.setWordWrap(True)
        row = QHBoxLayout()
        row.addWidget(chooser_label)
        row.addWidget(self.chooser)
        row.addStretch(1)
        row.addWidget(self.show_key)
        row.addWidget(self.copy_button)
        self.body = QWidget()
        body = QVBoxLayout(self.body)
        body.setContentsMargins(0, 0, 0, 0)
        body.addLayout(row)
        body.addWidget(self.text, 1)
        body.addWidget(self.warning)
        layout = QVBoxLayout(self)
        layout.addWidget(self.empty)
        layout.addWidget(self.body, 1)
        self.show_connection(None)

    def show_status(self, manager: Any, proxy: Any) -> None:
        """Follow the session's endpoint: its manager's status (None: no endpoint yet) and its proxy's key."""
        self.show_connection(clients.connection_from_status(manager.status() if manager is not None else None,
                                           getattr(proxy, "api_key", None)))

    def target(self) -> str:
        return str(self.chooser.currentData())

    def choose(self, target: str) -> None:
        self.chooser.setCurrentIndex(self.chooser.findData(target))

    def show_connection(self, connection: Connection | None) -> None:
        """The endpoint to describe, None while nothing serves. A new key is hidden again."""
        if connection != self.connection and self.show_key.isChecked():
            self.show_key.setChecked(False)
        self.connection = connection
        self.empty.setVisible(connection is None)
        self.body.setVisible(connection is not None)
        keyed = connection is not None and connection.api_key is not None
        self.show_key.setEnabled(keyed)
        self.show_key.setToolTip("Show the endpoint's key in the text" if keyed else NO_KEY_TIP)
        self._render()

    def shown_text(self) -> str:
        return self.text.toPlainText()

    def _render(self) -> None:
        c = self.connection
        if c is None:
            self.text.setPlainText("")
            self.warning.hide()
            return
        masked = c.api_key is not None and not self.show_key.isChecked()
        shown = dataclasses.replace(c, api_key=HIDDEN) if masked else c
        self.text.setPlainText(paste_text(self.target(), shown))
        warning = context_warning(self.target(), c)
        self.warning.setText(warning or "")
        self.warning.setVisible(warning is not None)

    def copy(self) -> None:
        """The text with the real key: what the user pastes has to work."""
        if self.connection is not None:
            QGuiApplication.clipboard().setText(paste_text(self.target(), self.connection))
