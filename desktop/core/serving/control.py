"""The local control channel of a running endpoint: `status`, `switch` and `stop` from another process.

It is plain HTTP on the endpoint's own loopback port under /switchyard/, guarded by a random token that only the
user can read: the running instance writes `run_dir()/endpoint-<port>.json` (mode 0600) with its pid, port and
token, and removes it on exit. Clients find the instance through that file.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import secrets
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import psutil

from desktop.core.common import paths
from desktop.core.common.errors import SwitchyardError

if TYPE_CHECKING:
    from desktop.core.serving.proxy import LocalRequest, LocalResponse, LocalRoute

TOKEN_HEADER = "X-Switchyard-Token"
PREFIX = "/switchyard"
KINDS = ("endpoint", "app", "engine")


class NoInstance(SwitchyardError):
    """No running endpoint to talk to."""


@dataclass(frozen=True)
class Discovery:
    """What a client needs to reach a running endpoint."""

    pid: int
    port: int
    url: str
    token: str
    started_at: float
    kind: str = "endpoint"
    info: dict[str, Any] = field(default_factory=dict)  # kind `engine`: what `status` shows (no channel to ask)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("token")  # never printed
        return data


def discovery_path(port: int) -> Path:
    return paths.run_dir() / f"endpoint-{port}.json"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_discovery(port: int, url: str, token: str, kind: str = "endpoint", info: dict[str, Any] | None = None
                    ) -> Path:
    """Create the discovery file readable by this user only (created 0600, never widened)."""
    if kind not in KINDS:
        raise ValueError(f"unknown discovery kind {kind!r}")
    path = discovery_path(port)
    record = {"pid": os.getpid(), "port": port, "url": url, "token": token, "started_at": time.time(),
              "kind": kind, "info": info or {}}
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle)
    return path


def remove_discovery(path: Path) -> None:
    path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).is_running() and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False


def find_instances() -> list[Discovery]:
    """Running endpoints of this user; files left by dead instances are removed."""
    found: list[Discovery] = []
    for file in sorted(paths.run_dir().glob("endpoint-*.json")):
        try:
            record = json.loads(file.read_text())
            discovery = Discovery(int(record["pid"]), int(record["port"]), str(record["url"]), str(record["token"]),
                                  float(record.get("started_at", 0)), str(record.get("kind", "endpoint")),
                                  dict(record.get("info") or {}))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not _alive(discovery.pid):
            file.unlink(missing_ok=True)
            continue
        found.append(discovery)
    return found


def find_instance(port: int | None = None) -> Discovery:
    instances = [d for d in find_instances() if port is None or d.port == port]
    if not instances:
        where = f" on port {port}" if port else ""
        raise NoInstance(f"no running Switchyard endpoint{where}",
                         "start one with `switchyard serve --engine llama.cpp --model demo --endpoint`")
    if len(instances) > 1:
        ports = ", ".join(str(d.port) for d in instances)
        raise SwitchyardError(f"several Switchyard endpoints are running (ports {ports})",
                              "say which one with --port")
    return instances[0]


# --- server side -------------------------------------------------------------------------------------------
class ControlTarget(Protocol):
    """What the control channel drives (the endpoint manager, adapted by the serve command)."""

    def status(self) -> dict[str, Any]: ...

    def switch(self, engine: str, model: str | None) -> dict[str, Any]: ...

    def request_stop(self) -> bool | None:
        """Start stopping. False: the process stays (the app) and its engines are already stopped on return."""
        ...


def _error(status: int, exc: Exception) -> LocalResponse:
    from desktop.core.serving.proxy import LocalResponse

    message = exc.message if isinstance(exc, SwitchyardError) else str(exc)
    hint = exc.hint if isinstance(exc, SwitchyardError) else None
    return LocalResponse.json({"error": message, "hint": hint}, status=status)


def control_routes(target: ControlTarget, token: str) -> list[LocalRoute]:
    """Routes under /switchyard/ for the endpoint. Each checks the token; slow work runs in a thread."""
    import asyncio

    from desktop.core.serving.proxy import LocalResponse, LocalRoute

    def allowed(request: LocalRequest) -> bool:
        return hmac.compare_digest(request.headers.get(TOKEN_HEADER).encode(), token.encode())

    denied = LocalResponse.json({"error": "missing or wrong control token"}, status=403)

    async def status(request: LocalRequest) -> LocalResponse:
        if not allowed(request):
            return denied
        return LocalResponse.json(await asyncio.to_thread(target.status))

    async def switch(request: LocalRequest) -> LocalResponse:
        if not allowed(request):
            return denied
        try:
            body = request.json()
            engine = str(body["engine"])
            model = body.get("model")
        except (ValueError, KeyError, TypeError, AttributeError):
            return LocalResponse.json({"error": 'expected JSON {"engine": ..., "model": ...}'}, status=400)
        try:
            result = await asyncio.to_thread(target.switch, engine, str(model) if model else None)
        except SwitchyardError as exc:
            return _error(409, exc)
        except Exception as exc:  # reported to the client instead of dropping the connection
            return _error(500, exc)
        return LocalResponse.json(result)

    async def stop(request: LocalRequest) -> LocalResponse:
        if not allowed(request):
            return denied
        try:
            exits = await asyncio.to_thread(target.request_stop)  # the app stops its engines before it answers
        except Exception as exc:  # reported to the client instead of dropping the connection
            return _error(409 if isinstance(exc, SwitchyardError) else 500, exc)
        return LocalResponse.json({"stopping": True, "exits": exits is not False})

    return [
        LocalRoute("GET", f"{PREFIX}/status", status),
        LocalRoute("POST", f"{PREFIX}/switch", switch),
        LocalRoute("POST", f"{PREFIX}/stop", stop),
    ]


# --- client side -------------------------------------------------------------------------------------------
class ControlClient:
    """Talks to one running endpoint found through its discovery file."""

    def __init__(self, discovery: Discovery) -> None:
        self.discovery = discovery

    def _request(self, method: str, route: str, timeout: float, body: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
        import httpx

        url = f"{self.discovery.url}{PREFIX}/{route}"
        try:
            with httpx.Client(timeout=httpx.Timeout(timeout, connect=5.0), trust_env=False) as client:
                response = client.request(method, url, json=body, headers={TOKEN_HEADER: self.discovery.token})
        except httpx.HTTPError as exc:
            raise SwitchyardError(f"could not reach the endpoint at {self.discovery.url}: {exc}",
                                  f"is pid {self.discovery.pid} still running?") from exc
        try:
            data = response.json()
        except ValueError:
            data = {"error": response.text[:300]}
        if response.status_code != 200:
            raise SwitchyardError(str(data.get("error") or f"HTTP {response.status_code}"), data.get("hint"))
        if not isinstance(data, dict):
            raise SwitchyardError(f"unexpected answer from the endpoint: {str(data)[:200]}")
        return data

    def status(self) -> dict[str, Any]:
        if self.discovery.kind == "engine":
            return {**self.discovery.info, "pid": self.discovery.pid}
        return self._request("GET", "status", 10.0)

    def switch(self, engine: str, model: str | None = None, timeout: float = 1800.0) -> dict[str, Any]:
        if self.discovery.kind == "engine":
            raise SwitchyardError(f"the `switchyard serve` on port {self.discovery.port} runs an engine without the "
                                  "stable endpoint, so it cannot switch engines",
                                  "start it with --endpoint (or --proxy-port P) to switch without changing the URL")
        return self._request("POST", "switch", timeout, {"engine": engine, "model": model})

    def stop(self, wait: float = 60.0) -> bool:
        """Ask the instance to stop and wait until its process is gone (the app: until its engines are stopped).
        True when that happened in time."""
        if self.discovery.kind == "engine":  # a plain serve stops cleanly on SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.discovery.pid, signal.SIGTERM)
        else:
            answer = self._request("POST", "stop", wait)
            if answer.get("exits") is False:
                return True
        with contextlib.suppress(psutil.Error):
            psutil.Process(self.discovery.pid).wait(wait)
        return not _alive(self.discovery.pid)
