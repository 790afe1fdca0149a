"""The session's queries: the requests view's snapshot, a switch's preview, and its one account of what its
endpoint does (desktop.core.serving.serve_status), computed from the engines the endpoint holds and the step the
session is taking, and published when it changes, so the Serve page's state label, the status bar and the page's
notices all read the same thing."""

from __future__ import annotations

from typing import Any

from shiboken6 import isValid


class SessionStatus:
    """Mixed into EngineSession, which provides `manager`, `process`, the step flags (`busy`,
    `switching`, `stopping`), `_last_status` and the `status_changed` signal."""

    manager: Any
    busy: bool
    switching: bool
    stopping: bool
    _last_status: Any
    _requests_pending: bool
    request_log: Any
    status_changed: Any

    @property
    def process(self) -> Any:  # EngineSession's
        raise NotImplementedError

    def engines(self) -> tuple[Any, Any]:
        """(serving engine process, starting engine process), either None."""
        manager = self.manager
        if manager is None:
            return None, None
        active, starting = manager.active, manager.starting
        return (active.process if active is not None else None,
                starting.process if starting is not None else None)

    def status(self) -> Any:
        """The one account of what the endpoint does (serving.serve_status.ServeStatus), from its engines and the
        step this session is taking."""
        from desktop.core.serving.serve_status import serve_status

        serving, starting = self.engines()
        return serve_status(serving, starting, self.process, starting_asked=self.busy and
                            not self.switching, switching=self.switching, stopping=self.stopping)

    @property
    def shown_status(self) -> Any:
        """The account the page, the status bar and the notices show now: the last one published. The live
        status() may be a step ahead (an engine's phase moved in its thread) until the next publish."""
        return self._last_status if self._last_status is not None else self.status()

    def publish_status(self) -> None:
        """Tell the page and the status bar when the account changed (called on every event and log tick)."""
        if not isValid(self):
            return
        status = self.status()
        if status != self._last_status:
            self._last_status = status
            self.status_changed.emit(status)

    def request_snapshot(self, limit: int = 200) -> tuple[list[Any], list[Any]]:
        """(in flight, last `limit` finished) for the requests view; re-arms requests_changed."""
        self._requests_pending = False
        request_log = self.request_log
        if request_log is None:
            return [], []
        return request_log.inflight(), request_log.recent(limit)

    def switch_preview(self, engine: str) -> str | None:
        """Which kind of switch it will be (warm, stop-first, wake) and how long it should take, in words."""
        if self.manager is None or self.manager.active is None:
            return None
        from desktop.core.common.errors import SwitchyardError

        try:
            return str(self.manager.switch_preview(engine)["message"])
        except SwitchyardError:
            return None
