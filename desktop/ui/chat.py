"""Try it: a chat with the model being served, through the stable endpoint's URL exactly as any client would ask
it (HTTP, streamed), so what the user sees is what their own client gets.

The request runs in a worker (`desktop.core.measure.chat.ChatStream`); each piece of text arrives as a progress
signal on the GUI thread; Stop closes the connection. The conversation is kept for follow-up questions; Clear
starts over. The transcript is Markdown rendered by Qt (QTextDocument.setMarkdown: headings, lists, code blocks),
drawn again as the answer streams in; Copy puts the last answer's raw Markdown on the clipboard and Regenerate asks
the last question again in place of its answer.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import (
    QColor,
    QFontDatabase,
    QGuiApplication,
    QKeySequence,
    QShortcut,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextFormat,
)
from PySide6.QtWidgets import (
    QDoubleSpinBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from desktop.ui.workers import submit

DEFAULT_SYSTEM = "You are a helpful assistant."


CODE_BACKGROUND = "#f2f2f2"


def shade_code_blocks(document: QTextDocument) -> None:
    """Qt's Markdown reader marks a fenced block's lines (BlockCodeFence) and names a "monospace" family that
    not every system has: give those lines the system's fixed-pitch font and a shaded background, so code reads
    as code in the transcript."""
    fixed = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
    chars = QTextCharFormat()
    chars.setFontFamilies([fixed.family(), "monospace"])
    chars.setFontFixedPitch(True)
    lines = QTextBlockFormat()
    lines.setBackground(QColor(CODE_BACKGROUND))
    block = document.begin()
    while block.isValid():
        if block.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence):
            cursor = QTextCursor(block)
            cursor.mergeBlockFormat(lines)
            cursor.movePosition(QTextCursor.MoveOperation.EndOfBlock, QTextCursor.MoveMode.KeepAnchor)
            cursor.mergeCharFormat(chars)
        block = block.next()


class ChatPane(QWidget):
    answered = Signal(object)  # a ChatAnswer, after each reply (also a stopped one)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.base_url: str | None = None
        self.model: str | None = None
        self.messages: list[dict[str, str]] = []
        self.stream: Any = None  # the ChatStream running now
        self.last_answer: Any = None
        self._reply: list[str] = []
        self.turns: list[tuple[str, str]] = []  # (who, Markdown) as the transcript shows them

        self.system_edit = QLineEdit(DEFAULT_SYSTEM)
        self.system_edit.setAccessibleName("System prompt")
        self.system_edit.setToolTip("Sent first in every request; changing it applies to the next question")
        self.temperature_spin = QDoubleSpinBox()
        self.temperature_spin.setRange(0.0, 2.0)
        self.temperature_spin.setSingleStep(0.1)
        self.temperature_spin.setValue(0.7)
        self.temperature_spin.setAccessibleName("Temperature")
        self.max_tokens_spin = QSpinBox()
        self.max_tokens_spin.setRange(1, 32_768)
        self.max_tokens_spin.setValue(256)
        self.max_tokens_spin.setAccessibleName("Maximum answer tokens")
        settings = QHBoxLayout()
        for caption, widget, stretch in (("S&ystem:", self.system_edit, 1), ("Temperat&ure:", self.temperature_spin, 0),
                                         ("Max to&kens:", self.max_tokens_spin, 0)):
            label = QLabel(caption)
            label.setBuddy(widget)
            settings.addWidget(label)
            settings.addWidget(widget, stretch)

        self.transcript = QTextBrowser()
        self.transcript.setAccessibleName("Conversation")
        self.transcript.setOpenLinks(False)
        self.transcript.setPlaceholderText("Start an engine above, then ask the model something here.")
        self.input = QPlainTextEdit()
        self.input.setAccessibleName("Your message")
        self.input.setPlaceholderText("Ask the model… (Ctrl+Enter sends)")
        self.input.setMaximumHeight(70)
        self.send_button = QPushButton("Sen&d")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop &answer")
        self.stop_button.clicked.connect(self.stop)
        self.clear_button = QPushButton("C&lear")
        self.clear_button.setToolTip("Forget the conversation")
        self.clear_button.clicked.connect(self.clear)
        self.copy_button = QPushButton("Cop&y answer")
        self.copy_button.setToolTip("Put the last answer, as the model wrote it (Markdown), on the clipboard")
        self.copy_button.clicked.connect(self.copy_answer)
        self.regenerate_button = QPushButton("&Regenerate")
        self.regenerate_button.setToolTip("Ask the last question again; the new answer replaces the last one")
        self.regenerate_button.clicked.connect(self.regenerate)
        self.note_label = QLabel("")  # e.g. the demo's weights are random: its answers are noise
        self.note_label.setObjectName("chatNote")
        self.note_label.setStyleSheet("color: #8a5a00;")
        self.note_label.setAccessibleName("About this model's answers")
        self.note_label.hide()
        for keys in ("Ctrl+Return", "Ctrl+Enter"):
            shortcut = QShortcut(QKeySequence(keys), self.input)
            shortcut.setContext(Qt.ShortcutContext.WidgetShortcut)
            shortcut.activated.connect(self.send)
        self.stats_label = QLabel("")
        self.stats_label.setAccessibleName("Answer speed")
        self.stats_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        buttons.addWidget(self.clear_button)
        answer_row = QHBoxLayout()
        answer_row.addWidget(self.stats_label, 1)
        answer_row.addWidget(self.copy_button)
        answer_row.addWidget(self.regenerate_button)
        entry = QHBoxLayout()
        entry.addWidget(self.input, 1)
        entry.addLayout(buttons)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(settings)
        layout.addWidget(self.note_label)
        layout.addWidget(self.transcript, 1)
        layout.addLayout(answer_row)
        layout.addLayout(entry)
        self._update()

    # --- state ---
    def set_endpoint(self, base_url: str | None, model: str | None = None) -> None:
        """The OpenAI base URL (…/v1) to talk to, and the model name clients use; None: nothing serves."""
        self.base_url, self.model = base_url, model
        self._update()

    def show_engine_state(self, serving: str | None, starting: str | None) -> None:
        """The transcript's placeholder says what serves now, so "start an engine" is never shown while one
        answers: `serving` names the serving engine, `starting` describes one that is starting."""
        if serving:
            text = f"{serving} serves this endpoint: ask the model something below (Ctrl+Enter sends)."
        elif starting:
            text = f"{starting}: you can ask once it serves."
        else:
            text = "Start an engine above, then ask the model something here."
        if self.transcript.placeholderText() != text:
            self.transcript.setPlaceholderText(text)

    def set_note(self, note: str | None) -> None:
        """A line over the transcript about what answers (the demo: "random weights: its answers are noise")."""
        self.note_label.setText(note or "")
        self.note_label.setVisible(bool(note))

    @property
    def answering(self) -> bool:
        return self.stream is not None

    def _update(self) -> None:
        self.send_button.setEnabled(self.base_url is not None and not self.answering)
        self.stop_button.setEnabled(self.answering)
        self.clear_button.setEnabled(not self.answering and bool(self.messages))
        has_answer = bool(self.messages) and self.messages[-1]["role"] == "assistant"
        self.copy_button.setEnabled(has_answer)
        self.regenerate_button.setEnabled(has_answer and self.base_url is not None and not self.answering)

    # --- actions ---
    def send(self, text: str | None = None) -> bool:
        """Ask `text` (default: what is typed); False when nothing can be sent now."""
        from desktop.core.measure.chat import ChatStream

        question = (text if isinstance(text, str) else self.input.toPlainText()).strip()
        if not question or self.base_url is None or self.answering:
            return False
        self.input.clear()
        self.messages.append({"role": "user", "content": question})
        system = self.system_edit.text().strip()
        request = ([{"role": "system", "content": system}] if system else []) + self.messages
        self.turns += [("You", question), (self.model or "Model", "")]
        self._render()
        self._reply = []
        self.stats_label.setText("waiting for the first token…")
        stream = ChatStream(self.base_url, request, model=self.model, temperature=self.temperature_spin.value(),
                            max_tokens=self.max_tokens_spin.value())
        self.stream = stream
        self._update()
        submit(stream.run, on_progress=self._on_text, on_finished=self._on_answer, on_error=self._on_error)
        return True

    def stop(self) -> None:
        if self.stream is not None:
            self.stream.stop()
            self.stats_label.setText("stopping…")

    def copy_answer(self) -> None:
        """The last answer as the model wrote it (Markdown source, not the rendered text) to the clipboard."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            QGuiApplication.clipboard().setText(self.messages[-1]["content"])

    def regenerate(self) -> bool:
        """Ask the last question again; its old answer leaves the conversation and the transcript."""
        if self.answering or len(self.messages) < 2 or self.messages[-1]["role"] != "assistant":
            return False
        self.messages.pop()
        question = self.messages.pop()["content"]
        del self.turns[-2:]
        return self.send(question)

    def clear(self) -> None:
        if self.answering:
            return
        self.messages.clear()
        self.turns.clear()
        self.transcript.clear()
        self.stats_label.setText("")
        self._update()

    def shutdown(self) -> None:
        """Window closing: end a running answer so its worker finishes at once."""
        self.stop()

    # --- worker callbacks (GUI thread) ---
    def _on_text(self, text: Any) -> None:
        self._reply.append(str(text))
        if self.turns:
            self.turns[-1] = (self.turns[-1][0], "".join(self._reply))
        self._render()

    def _on_answer(self, answer: Any) -> None:
        self.stream = None
        self.last_answer = answer
        if answer.text:
            self.messages.append({"role": "assistant", "content": answer.text})
        else:  # nothing came back: the question is not part of the conversation
            self.messages.pop()
        self.stats_label.setText(answer.summary())
        self._update()
        self.answered.emit(answer)

    def _on_error(self, message: str) -> None:
        self.stream = None
        self.messages.pop()  # the question got no answer
        self.stats_label.setText("")
        if self.turns and not self.turns[-1][1]:
            self.turns.pop()  # the empty answer that never came
        self.turns.append(("Error", message))
        self._render()
        self._update()

    def _render(self) -> None:
        """The conversation as Markdown, each turn under its speaker's name in bold; kept scrolled to the end."""
        parts = []
        for who, text in self.turns:
            name = who.replace("*", "\\*").replace("_", "\\_")
            if text.count("```") % 2:  # a code block still streaming: closed here so the next turn is not in it
                text += "\n```"
            parts.append(f"**{name}:**\n\n{text}" if text else f"**{name}:**")
        self.transcript.setMarkdown("\n\n".join(parts))
        shade_code_blocks(self.transcript.document())
        bar = self.transcript.verticalScrollBar()
        if bar is not None:
            bar.setValue(bar.maximum())
