"""Building the GUI's stable endpoint: the core's EndpointHost and EndpointManager, wired as `switchyard serve
--endpoint` wires them, with the session's listeners. Kept out of EngineSession, which owns when the endpoint is
built and what its events become on the GUI thread; this module owns how it is built (Qt-free, worker thread).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("switchyard.ui.engine")


def open_history() -> Any:
    """The request log's history (serving goes on without it if it cannot open)."""
    from desktop.core.common.errors import SwitchyardError
    from desktop.core.storage.history import Store

    try:
        return Store()
    except SwitchyardError as exc:
        log.warning("request history disabled: %s", exc)
        return None


def open_endpoint(port: int | None, *, capture_bodies: bool, telemetry_interval: float, launcher: Any,
                  progress: Callable[[Any], None], control: Any, on_request: Callable[[str, Any], None],
                  on_samples: Callable[[list[Any]], None], on_event: Callable[[Any], None]) -> tuple[Any, Any]:
    """(host, manager): the app's endpoint on `port` (None: the saved settings' port), listening, with its
    engine manager serving behind it; `switchyard status|switch|stop|requests` from a shell reach it through
    `control` like the CLI's. Raises PortBusy (a readable SwitchyardError) when the port is taken, the host
    having closed its parts."""
    from desktop.core.machine.hardware import detect
    from desktop.core.runtime.telemetry import Telemetry
    from desktop.core.serving.endpoint import EndpointManager, machine_budget, make_launcher
    from desktop.core.serving.host import EndpointHost
    from desktop.core.storage import settings as core_settings

    saved = core_settings.load()
    port = port if port is not None else saved.endpoint_port
    host = EndpointHost(port=port, allowed_origins=saved.allowed_origins, capture_bodies=capture_bodies,
                        store=open_history(), telemetry=Telemetry(interval=telemetry_interval), kind="app")
    host.request_log.subscribe(on_request)
    host.telemetry.subscribe(on_samples)
    host.control(control)
    host.start()
    budget = machine_budget()
    manager = EndpointManager(host.proxy, telemetry=host.telemetry, budget=budget,
                              hardware=budget.hardware if budget else None, redetect=detect,
                              launcher=launcher or make_launcher(progress, install_missing=True))
    manager.subscribe(on_event)
    host.serve(manager)
    return host, manager
