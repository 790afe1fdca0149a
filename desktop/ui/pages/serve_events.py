"""The Serve page's answers to its session's events: an engine's state, a step's progress, the session's one
account of its engines (serving.serve_status: the state label and the notices follow it), ready, failed, stopped,
samples, a finished switch and the endpoint's own events. Mixed into ServePage, which builds the widgets."""

from __future__ import annotations

from typing import Any

from desktop.core.hub.names import DEMO_NOTE, display_name, is_demo
from desktop.ui.pages.serve_state import switched_text


class ServeEvents:
    """What ServePage provides: its session, widgets and the methods named below."""

    session: Any
    notice: Any
    state_label: Any
    endpoint_edit: Any
    chat: Any
    live: Any
    headline: Any
    switch_label: Any
    switch_button: Any
    engine_box: Any
    endpoint_state: str
    samples_received: int
    _serving_source: str | None
    _shown_engine: str | None = None  # the serving engine the engine box was last set to
    engine_ready: Any

    def refresh_live(self) -> None:
        raise NotImplementedError

    def other_engine(self) -> str:
        raise NotImplementedError

    def _update_buttons(self) -> None:
        raise NotImplementedError

    def _hybrid_running(self) -> bool:
        raise NotImplementedError

    def on_state(self, state: str) -> None:
        self.state_label.setAccessibleDescription(state)
        self.refresh_live()
        if state == "crashed" and self.session.process is not None:
            outcome = self.session.process.outcome
            reason = outcome.reason if outcome else None
            if reason:
                self.notice.show_message(f"The engine stopped: {reason.reason}\nHint: {reason.suggestion}", "error")
        self._update_buttons()

    def on_progress(self, text: str, tag: str) -> None:
        """A step's progress ("Starting vLLM on demo; waiting until it serves"), tagged with the step it belongs to
        as it stood when said: shown until that step ends (serve_status.notice_ends), or not at all when it
        already has (the message arrived after the engines moved on)."""
        from desktop.core.serving.serve_status import notice_ends

        ends, tag_now = notice_ends(tag, self.session.status())
        if ends:
            return
        self.notice.show_message(text, action=tag_now)

    def on_status(self, status: Any) -> None:
        """The session's one account of its engines: the state label says its line (the status bar says the same),
        and a notice of a step that ended is taken down."""
        from desktop.core.serving.serve_status import notice_ends

        self.state_label.setText(status.line)
        if status.action == "start":
            self.switch_label.setText("")  # the last switch was of the engines a new start replaces
        if status.engine and status.engine != self._shown_engine and not self._hybrid_running():
            self.engine_box.setCurrentIndex(self.engine_box.findData(status.engine))  # the box names what serves
        self._shown_engine = status.engine
        ends, action = notice_ends(self.notice.action, status)
        if ends:
            self.notice.show_message("")
        else:
            self.notice.action = action
        self._update_buttons()

    def on_ready(self, cold: Any) -> None:
        process = self.session.process
        if process is None:
            return
        self.endpoint_edit.setText(self.session.endpoint_url or f"{process.base_url}/v1")
        self.chat.set_endpoint(self.endpoint_edit.text(), getattr(self.session.proxy, "model_name", None))
        demo = is_demo(process.plan.model or process.plan.model_path)
        self.chat.set_note(f"This is the demo model: {DEMO_NOTE}. Download a real model on the Models page."
                           if demo else None)
        t2 = cold.t2_first_token_s
        self.notice.show_message(
            f"{process.adapter.display_name} serves {display_name(process.plan.model or process.plan.model_path)}"
            f" (engine at {process.base_url})"
            f" — health OK after {cold.t1_health_s:.2f} s" + (f", first token after {t2:.2f} s" if t2 else ""))
        gpu = getattr(self.session.telemetry, "gpu", None)
        if gpu is None or gpu.unavailable:
            self.live.say_no_gpu()
        self.refresh_live()
        self._update_buttons()
        self._preview_switch()
        self.engine_ready.emit(cold)

    def _preview_switch(self) -> None:
        """Say on the switch button which kind of switch it will be and how long it should take."""
        if self._hybrid_running():
            return  # _update_buttons says why there is no manual switch
        preview = self.session.switch_preview(self.other_engine())
        self.switch_button.setToolTip(f"Switch to {self.other_engine()}: {preview}" if preview else "")

    def on_failed(self, message: str) -> None:
        if "endpoint cannot listen" in message:
            message += "\nOr change the endpoint port in File → Settings."
        self.notice.show_message(message, "error")
        self.switch_label.setText("")
        self._update_buttons()

    def on_stopped(self) -> None:
        self.refresh_live()
        self.chat.stop()
        self.chat.set_endpoint(None)
        if self.notice.level != "error":
            self.notice.show_message("Engine stopped")
        self._update_buttons()

    def on_samples(self, samples: list[Any]) -> None:
        self.samples_received += self.live.push(samples, self._serving_source)
        self.headline.push(samples, self._serving_source)

    def on_switched(self, result: Any) -> None:
        self.refresh_live()
        self.switch_label.setText(switched_text(result))
        self._update_buttons()
        self._preview_switch()

    def on_endpoint(self, state: str, message: str) -> None:
        self.endpoint_state = state
        if state in ("down", "failover"):
            self.notice.show_message(message, "error" if state == "down" else "warning")
        self._update_buttons()
