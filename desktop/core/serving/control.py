"""The local control channel of a running endpoint: `status`, `switch`, `stop` and `requests` from another
process.

It is plain HTTP on the endpoint's own loopback port under /switchyard/, guarded by a random token that only the
user can read: the running instance writes `run_dir()/endpoint-<port>.json` (mode 0600) with its pid, port and
token, and removes it on exit. Clients find the instance through that file.

Three kinds register: `endpoint` (`switchyard serve --endpoint`), `app` (the desktop app's endpoint: `stop` stops
its engines, the app stays open) and `engine` (a plain `switchyard serve`: no control channel, so its file carries
what `status` shows, `stop` sends it SIGTERM and `switch` explains that it needs the endpoint). The client side
loads neither httpx nor the server's HTTP code until it talks to an endpoint, so `switchyard status` answers at once.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import secrets
import signal
import time
from collections.abc import Callable, Container
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs

import psutil

from desktop.core.common import paths, private
from desktop.core.common.errors import SwitchyardError
from desktop.core.runtime import proctree

if TYPE_CHECKING:  # the server side's HTTP code (asyncio) and the request log load with the server only
    from desktop.core.serving.http1 import LocalRequest, LocalResponse, LocalRoute
    from desktop.core.serving.requestlog import RequestLog

REQUESTS_MAX_WAIT = 30.0  # seconds a `requests?wait=` long poll may hold (the client asks again)

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
    created: float | None = None  # the process's start time: a reused pid is not this instance
    kind: str = "endpoint"
    info: dict[str, Any] = field(default_factory=dict)  # kind `engine`: what `status` shows (no channel to ask)
    api_key: str | None = None  # the key clients send, where the instance asks for one (`launch` passes it on)
    cmdline: tuple[str, ...] | None = None  # what the instance ran: `stop` signals nothing else

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("token")  # never printed
        data.pop("api_key")
        data.pop("cmdline")
        return data


def discovery_path(port: int) -> Path:
    return paths.run_dir() / f"endpoint-{port}.json"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_discovery(port: int, url: str, token: str, kind: str = "endpoint", info: dict[str, Any] | None = None,
                    api_key: str | None = None) -> Path:
    """Create the discovery file readable by this user only (created 0600, never widened). `api_key`: the key
    clients must send (an endpoint's, or a plain serve's per-launch engine key), kept here for the user's own
    clients (`switchyard launch`, never printed by `status`)."""
    if kind not in KINDS:
        raise ValueError(f"unknown discovery kind {kind!r}")
    path = discovery_path(port)
    me = psutil.Process()
    record = {"pid": me.pid, "created": me.create_time(), "cmdline": me.cmdline(), "port": port, "url": url,
              "token": token, "started_at": time.time(), "kind": kind, "info": info or {}}
    if api_key:
        record["api_key"] = api_key
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle)
    return path


def remove_discovery(path: Path) -> None:
    path.unlink(missing_ok=True)


def _alive(pid: int, created: float | None, cmdline: tuple[str, ...] | None = None) -> bool:
    """Whether the instance still runs: its pid is live, not a zombie, started when it did and (where recorded)
    runs what it ran, so a pid the system handed to another process after a crash is not taken for the instance,
    nor is any live pid a file without a valid start time names (NaN once passed every comparison)."""
    return proctree.same_process(pid, created, cmdline) is not None


def find_instances() -> list[Discovery]:
    """Running endpoints of this user; files left by dead instances are removed."""
    found: list[Discovery] = []
    for file in sorted(paths.run_dir().glob("endpoint-*.json")):
        try:
            record = private.read_record(file)
            if record is None:
                raise ValueError("not a discovery record")
            cmdline = record.get("cmdline")
            discovery = Discovery(int(record["pid"]), int(record["port"]), str(record["url"]), str(record["token"]),
                                  float(record.get("started_at", 0)), proctree.valid_time(record.get("created")),
                                  str(record.get("kind", "endpoint")), dict(record.get("info") or {}),
                                  str(record["api_key"]) if record.get("api_key") else None,
                                  tuple(str(arg) for arg in cmdline) if isinstance(cmdline, list) else None)
        except (OSError, ValueError, KeyError, TypeError, OverflowError):
            continue
        if not _alive(discovery.pid, discovery.created, discovery.cmdline):
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

    def switch(self, engine: str, model: str | None, name: str | None = None) -> dict[str, Any]: ...

    def switch_preview(self, engine: str, model: str | None, name: str | None = None) -> dict[str, Any]:
        """The checked plan a switch would start (argv, env) and its kind; nothing starts (`switch --dry-run`)."""
        ...

    def request_stop(self) -> bool | None:
        """Start stopping. False: the process stays (the app) and its engines are already stopped on return."""
        ...


class Served(Protocol):
    """What an endpoint serves through (the engine manager, or the fleet of several models)."""

    def status(self) -> dict[str, Any]: ...

    def switch(self, engine: str, model: str | None = None, name: str | None = None) -> Any: ...

    def switch_preview(self, engine: str, model: str | None = None, name: str | None = None) -> dict[str, Any]: ...


class EndpointControl:
    """The control target of an endpoint (`serve --endpoint`, `serve --config`): status with the pid, switch,
    `switch --dry-run` and a stop request the serving loop waits on. Written once for both."""

    def __init__(self, served: Served) -> None:
        import threading

        self.served = served
        self.stop_requested = threading.Event()

    def status(self) -> dict[str, Any]:
        data = self.served.status()
        data["pid"] = os.getpid()
        return data

    def switch(self, engine: str, model: str | None, name: str | None = None) -> dict[str, Any]:
        return dict(self.served.switch(engine, model, name).to_json())

    def switch_preview(self, engine: str, model: str | None, name: str | None = None) -> dict[str, Any]:
        return self.served.switch_preview(engine, model, name)

    def request_stop(self) -> bool | None:
        self.stop_requested.set()
        return None


def _error(status: int, exc: Exception) -> LocalResponse:
    from desktop.core.serving.http1 import LocalResponse

    message = exc.message if isinstance(exc, SwitchyardError) else str(exc)
    hint = exc.hint if isinstance(exc, SwitchyardError) else None
    return LocalResponse.json({"error": message, "hint": hint}, status=status)


def _allowed(request: LocalRequest, token: str) -> bool:
    return hmac.compare_digest(request.headers.get(TOKEN_HEADER).encode(), token.encode())


def _denied() -> LocalResponse:
    from desktop.core.serving.http1 import LocalResponse

    return LocalResponse.json({"error": "missing or wrong control token"}, status=403)


def control_routes(target: ControlTarget, token: str) -> list[LocalRoute]:
    """Routes under /switchyard/ for the endpoint. Each checks the token; slow work runs in a thread."""
    import asyncio

    from desktop.core.serving.http1 import LocalResponse, LocalRoute

    def allowed(request: LocalRequest) -> bool:
        return _allowed(request, token)

    denied = _denied()

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
            name = body.get("name")
            dry_run = bool(body.get("dry_run"))
        except (ValueError, KeyError, TypeError, AttributeError):
            return LocalResponse.json({"error": 'expected JSON {"engine": ..., "model": ...}'}, status=400)
        try:
            named = {"name": str(name)} if name else {}  # only for an endpoint of several models
            call = target.switch_preview if dry_run else target.switch
            result = await asyncio.to_thread(call, engine, str(model) if model else None, **named)
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
        LocalRoute("GET", f"{PREFIX}/status", status, token),
        LocalRoute("POST", f"{PREFIX}/switch", switch, token),
        LocalRoute("POST", f"{PREFIX}/stop", stop, token),
    ]


def request_routes(request_log: RequestLog, token: str, capture: Any = None,
                   model_names: Callable[[], Container[str]] | None = None) -> list[LocalRoute]:
    """`GET /switchyard/requests?limit=N&after=SEQ&wait=S`: the requests in flight and the last finished ones
    (seq > after). With `wait`, an empty answer is held until a request finishes (a long poll for --follow).
    `capture` is a callable telling whether bodies are being captured (shown, not changed, here); `model_names`
    the names the endpoint serves (the metrics' only `model` labels)."""
    import asyncio

    from desktop.core.serving.http1 import LocalResponse, LocalRoute

    denied = _denied()

    async def requests(request: LocalRequest) -> LocalResponse:
        if not _allowed(request, token):
            return denied
        try:
            query = {key: values[-1] for key, values in parse_qs(request.query).items()}
            limit = max(1, min(int(query.get("limit", 100)), request_log.capacity))
            after = int(query.get("after", 0))
            wait = max(0.0, min(float(query.get("wait", 0)), REQUESTS_MAX_WAIT))
        except ValueError:
            return LocalResponse.json({"error": "limit and after must be integers, wait a number of seconds"},
                                      status=400)
        records = request_log.recent(limit, after)
        if not records and wait > 0:
            loop = asyncio.get_running_loop()
            finished = asyncio.Event()

            def wake(kind: str, _record: object) -> None:
                if kind == "finished":
                    loop.call_soon_threadsafe(finished.set)

            request_log.subscribe(wake)  # before looking again: a request finishing in between is not missed
            try:
                if not request_log.recent(limit, after):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(finished.wait(), wait)
            finally:
                request_log.unsubscribe(wake)
            records = request_log.recent(limit, after)
        return LocalResponse.json({
            "inflight": [r.to_json() for r in request_log.inflight()],
            "requests": [r.to_json() for r in records],
            "events": request_log.events(limit),  # the endpoint's events (autopilot decisions), oldest first
            "capture_bodies": bool(capture()) if capture is not None else False,
        })

    from desktop.core.serving.metrics import metrics_routes  # GET /metrics (Prometheus), fed by the same log

    return [LocalRoute("GET", f"{PREFIX}/requests", requests, token),
            *metrics_routes(request_log, getattr(request_log, "_sink", None), model_names)]


# --- client side -------------------------------------------------------------------------------------------
class ControlClient:
    """Talks to one running endpoint found through its discovery file."""

    def __init__(self, discovery: Discovery) -> None:
        self.discovery = discovery

    def _request(self, method: str, route: str, timeout: float, body: dict[str, Any] | None = None,
                 params: dict[str, Any] | None = None) -> dict[str, Any]:
        import httpx

        url = f"{self.discovery.url}{PREFIX}/{route}"
        try:
            with httpx.Client(timeout=httpx.Timeout(timeout, connect=5.0), trust_env=False) as client:
                response = client.request(method, url, json=body, params=params,
                                          headers={TOKEN_HEADER: self.discovery.token})
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

    def requests(self, limit: int = 100, after: int = 0, wait: float = 0.0) -> dict[str, Any]:
        """The request log: {"inflight": [...], "requests": [...] (oldest first)}; with `wait`, held until a
        request newer than `after` finishes (or `wait` seconds pass)."""
        if self.discovery.kind == "engine":
            raise SwitchyardError(f"the `switchyard serve` on port {self.discovery.port} runs an engine without the "
                                  "stable endpoint, which is what logs requests",
                                  "start it with --endpoint (or --proxy-port P)")
        return self._request("GET", "requests", 10.0 + wait, params={"limit": limit, "after": after, "wait": wait})

    def switch(self, engine: str, model: str | None = None, name: str | None = None, timeout: float = 1800.0,
               dry_run: bool = False) -> dict[str, Any]:
        if self.discovery.kind == "engine":
            raise SwitchyardError(f"the `switchyard serve` on port {self.discovery.port} runs an engine without the "
                                  "stable endpoint, so it cannot switch engines",
                                  "start it with --endpoint (or --proxy-port P) to switch without changing the URL")
        body: dict[str, Any] = {"engine": engine, "model": model}
        if dry_run:
            body["dry_run"] = True
        if name:
            body["name"] = name
        return self._request("POST", "switch", timeout, body)

    def stop(self, wait: float = 60.0) -> bool:
        """Ask the instance to stop and wait until its process is gone (the app: until its engines are stopped).
        True when that happened in time."""
        if self.discovery.kind == "engine":  # a plain serve stops cleanly on SIGTERM
            serve = proctree.same_process(self.discovery.pid, self.discovery.created, self.discovery.cmdline)
            if serve is None:
                return True  # gone, or the pid is someone else's now: nothing of ours to signal
            with contextlib.suppress(psutil.Error):
                serve.send_signal(signal.SIGTERM)
        elif self._request("POST", "stop", wait).get("exits") is False:
            return True
        deadline = time.monotonic() + wait
        pid, created, cmdline = self.discovery.pid, self.discovery.created, self.discovery.cmdline
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            while _alive(pid, created, cmdline) and time.monotonic() < deadline:
                # psutil's wait on another's process counts a zombie as running: look at the state each step
                with contextlib.suppress(psutil.TimeoutExpired):
                    process.wait(0.1)
        return not _alive(pid, created, cmdline)
