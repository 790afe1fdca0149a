"""The desktop app's endpoint, driven from a shell like one started by `switchyard serve --endpoint`:
`switchyard status` shows it, `switchyard switch --to E` moves it (the Serve page follows), and `switchyard stop`
stops its engines (the app stays open; its endpoint answers "no engine" until the user starts one again).

Control requests arrive on the endpoint's threads; whatever touches the session's Qt state runs on the GUI thread
(queued through a signal) while the control thread waits for it, so the page sees a CLI switch exactly like a click.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, Signal

from desktop.ui.workers import readable_error

GUI_CALL_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 120.0


class AppControl(QObject):
    """The `control.ControlTarget` of the app's endpoint (created on the GUI thread, called from any)."""

    _call = Signal(object)

    def __init__(self, session: Any) -> None:
        super().__init__(session)
        self.session = session
        self._call.connect(self._run)

    def _run(self, job: Callable[[], None]) -> None:  # a method of this QObject: queued to the GUI thread
        job()

    def _on_gui(self, fn: Callable[[], Any], timeout: float = GUI_CALL_TIMEOUT_S) -> Any:
        """Run `fn` on the GUI thread, wait for it, return its result or raise its exception here."""
        from desktop.core.common.errors import SwitchyardError

        done = threading.Event()
        outcome: dict[str, Any] = {}

        def job() -> None:
            try:
                outcome["result"] = fn()
            except BaseException as exc:  # handed to the waiting control thread
                outcome["error"] = exc
            finally:
                done.set()

        self._call.emit(job)
        if not done.wait(timeout):
            raise SwitchyardError("the Switchyard app did not answer in time", "is its window frozen?")
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("result")

    # --- ControlTarget ---
    def status(self) -> dict[str, Any]:
        manager = self.session.manager
        data: dict[str, Any] = manager.status() if manager is not None else {}
        data["pid"] = os.getpid()
        return data

    def switch(self, engine: str, model: str | None, name: str | None = None) -> dict[str, Any]:
        from desktop.core.common.errors import SwitchyardError

        session = self.session
        if name is not None and session.manager is not None and name != session.manager.route:
            raise SwitchyardError(f"the app's endpoint serves one model; there is no '{name}' to pick", "drop --name")

        def begin() -> None:
            if session.manager is None or session.manager.active is None:
                raise SwitchyardError("the app serves nothing yet", "start an engine on its Serve page first")
            if session.busy:
                raise SwitchyardError("the app is already starting or switching an engine", "wait for it to finish")
            session.busy = session.switching = True
            session.progress.emit(f"Switching to {engine} (asked from the command line); the current engine keeps "
                                  "serving meanwhile", "switch")

        self._on_gui(begin)
        try:
            result = session._switch(engine, model)
        except BaseException as exc:
            message = readable_error(exc)
            self._on_gui(lambda: session._on_error(message))
            raise
        self._on_gui(lambda: session._on_switched(result))
        return dict(result.to_json())

    def switch_preview(self, engine: str, model: str | None, name: str | None = None) -> dict[str, Any]:
        """`switchyard switch --dry-run` against the app: the checked plan it would start (nothing starts)."""
        from desktop.core.common.errors import SwitchyardError

        manager = self.session.manager
        if manager is None:
            raise SwitchyardError("the app serves nothing yet", "start an engine on its Serve page first")
        return dict(manager.switch_preview(engine, model, name))

    def request_stop(self) -> bool:
        """Stop the app's engines and wait until they are gone; the app itself stays (returns False: no exit)."""
        from desktop.core.common.errors import SwitchyardError

        stopped = threading.Event()
        self._on_gui(lambda: self.session.stop(then=stopped.set))
        if not stopped.wait(STOP_TIMEOUT_S):
            raise SwitchyardError("the app's engines did not stop in time", "stop them on its Serve page")
        return False
