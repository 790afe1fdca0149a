"""The control channel's view of a running endpoint: a reused pid or a zombie is not a live instance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import psutil
import pytest

from desktop.core.serving import control


def _write(pid: int, created: float | None, port: int = 1) -> None:
    record: dict[str, Any] = {"pid": pid, "port": port, "url": f"http://127.0.0.1:{port}", "token": "t",
                              "started_at": time.time()}
    if created is not None:
        record["created"] = created
    control.discovery_path(port).write_text(json.dumps(record))


def test_a_restarted_pid_is_not_the_instance() -> None:
    """The file names a pid that now belongs to another process (this one, started at another time)."""
    _write(os.getpid(), psutil.Process().create_time() - 1000)
    assert control.find_instances() == []
    assert not control.discovery_path(1).exists()


def test_the_live_instance_is_found() -> None:
    _write(os.getpid(), psutil.Process().create_time(), port=2)
    try:
        assert [d.pid for d in control.find_instances()] == [os.getpid()]
    finally:
        control.discovery_path(2).unlink()


def test_a_zombie_is_not_alive_and_stop_does_not_wait_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])  # noqa: S603 - exits; not reaped: a zombie
    try:
        process = psutil.Process(child.pid)
        created = process.create_time()
        deadline = time.monotonic() + 30
        while process.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.02)
        assert process.status() == psutil.STATUS_ZOMBIE
        discovery = control.Discovery(child.pid, 3, "http://127.0.0.1:3", "t", time.time(), created)
        monkeypatch.setattr(control.ControlClient, "_request", lambda *args, **kwargs: {"stopping": True})
        started = time.monotonic()
        assert control.ControlClient(discovery).stop(wait=60.0) is True
        assert time.monotonic() - started < 30, "stop waited on a zombie"
    finally:
        child.wait()
