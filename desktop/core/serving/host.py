"""One stable endpoint, composed once: the proxy, the request log (kept in history when a store is given), engine
telemetry, the control channel (`status`, `switch`, `stop`, `requests`), the discovery file that lets other shells
find it, and whatever serves behind it (an EndpointManager or a Fleet). `switchyard serve` and the desktop app
build the same host and only adapt its events; `close()` tears the parts down in reverse order, whichever of
them were started."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from desktop.core.common.defaults import DEFAULT_WAIT_TIMEOUT, SERVED_MODEL_NAME
from desktop.core.runtime.telemetry import Telemetry
from desktop.core.serving import control
from desktop.core.serving.proxy import ProxyServer
from desktop.core.serving.requestlog import RequestLog
from desktop.core.serving.upstream import Timeouts

log = logging.getLogger("switchyard.endpoint")


class Closable(Protocol):
    def close(self) -> None: ...


class EndpointHost:
    """The parts of one endpoint and their order. Built cheaply (nothing listens yet): `control(target)` adds
    the control routes, `start()` listens and writes the discovery file, `serve(x)` hands over what serves behind
    it (closed first on teardown), `close()` undoes all of it."""

    def __init__(self, *, port: int, model_name: str = SERVED_MODEL_NAME, api_key: str | None = None,
                 wait_timeout: float = DEFAULT_WAIT_TIMEOUT, capture_bodies: bool = False,
                 allowed_origins: Iterable[str] = (), timeouts: Timeouts | None = None, store: Any = None,
                 telemetry: Telemetry | None = None, kind: str = "endpoint") -> None:
        self.proxy = ProxyServer(port=port, model_name=model_name, api_key=api_key, wait_timeout=wait_timeout,
                                 capture_bodies=capture_bodies, allowed_origins=allowed_origins, timeouts=timeouts)
        self.store = store  # history: requests (and, from the CLI, telemetry) are kept there; None: memory only
        self.telemetry = telemetry if telemetry is not None else Telemetry(sink=store)
        self.request_log = RequestLog(sink=store)
        self.request_log.attach(self.proxy)
        self.kind = kind
        self.token = control.new_token()
        self.discovery: Path | None = None
        self.served: Closable | None = None
        self._telemetry_started = False

    def control(self, target: control.ControlTarget) -> None:
        """`switchyard status|switch|stop|requests` from other shells reach `target` (before `start`)."""
        proxy = self.proxy
        proxy.add_routes(control.control_routes(target, self.token))
        proxy.add_routes(control.request_routes(self.request_log, self.token, lambda: proxy.capture_bodies,
                                                model_names=proxy.served_names))

    def start(self, api_key: str | None = None) -> None:
        """Listen (PortBusy, a readable error, when the port is taken: then nothing is left open), let other shells
        find this endpoint (with `api_key`, the endpoint's per-launch key, for the user's own clients), start
        telemetry."""
        try:
            self.proxy.start()
        except BaseException:
            self._close_log()
            raise
        self.discovery = control.write_discovery(self.proxy.port, self.proxy.url, self.token, kind=self.kind,
                                                 api_key=api_key)
        self.telemetry.start()
        self._telemetry_started = True

    def serve(self, served: Closable) -> None:
        """What serves behind the proxy (an EndpointManager or a Fleet): stopped first on close."""
        self.served = served

    def close(self) -> None:
        """In reverse order: nobody finds it any more, the engines stop, telemetry, the proxy, the request log."""
        if self.discovery is not None:
            control.remove_discovery(self.discovery)
            self.discovery = None
        if self.served is not None:
            try:
                self.served.close()
            finally:
                self.served = None
        if self._telemetry_started:
            self.telemetry.stop()
            self._telemetry_started = False
        self.proxy.stop()
        self._close_log()

    def _close_log(self) -> None:
        self.request_log.stop()
        if self.store is not None:
            self.store.close()
            self.store = None
