"""One object per engine process: spawn it from an argument list, own its process group, stream its log, time
its cold start in phases, tell when it really serves, explain why it died, and never leave it orphaned.

Orphan protection, in layers: the engine gets PR_SET_PDEATHSIG (Linux) so it dies with the app, and on every POSIX
system a watchdog process (`desktop.core.runtime.watchdog`) stops its whole process group when the app dies
(PDEATHSIG reaches the engine's first process only; vLLM's EngineCore and workers share its group); Windows uses
a kill-on-close Job Object. Every engine we start is recorded in a pidfile with its process group, and
`reap_orphans()` at the next start stops leftovers whose owner is gone, by group, even when the recorded pid is
already dead. `stop()` and all of these stop a tree the one way `desktop.core.runtime.proctree` knows.

`EngineProcess` stays the one object the rest of the app holds per engine process; it delegates each concern to
a collaborator: starting the process and the orphan guard, pidfiles and reaping (`runtime.spawning`), reading
its log and matching cold-start markers (`runtime.enginelog`), where it listens and whether the listener is its
own (`runtime.address`), why it died and what its crashes taught (`runtime.crashes`). Its vocabulary (states,
events, phases) lives in `runtime.lifecycle`."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from desktop.core.common import paths, unixhttp
from desktop.core.common.errors import EngineFailed, SwitchyardError
from desktop.core.common.sse import iter_deltas
from desktop.core.engines.base import CrashRetry, EngineAdapter, EngineInstall, LaunchPlan
from desktop.core.engines.pooling import args_kind
from desktop.core.runtime import crashes, enginefix, pagecache
from desktop.core.runtime.address import choose_address, listener_holds
from desktop.core.runtime.enginelog import LOG_TAIL_LINES as LOG_TAIL_LINES  # re-exported (runtime.launches)
from desktop.core.runtime.enginelog import EngineLog

# An engine's vocabulary (states, events, cold-start phases) lives in runtime.lifecycle; re-exported from here,
# where the app imports it.
from desktop.core.runtime.lifecycle import COLD_START_PHASES as COLD_START_PHASES
from desktop.core.runtime.lifecycle import PHASE_BY_KEY as PHASE_BY_KEY
from desktop.core.runtime.lifecycle import PHASE_NAMES as PHASE_NAMES
from desktop.core.runtime.lifecycle import SERVING_PHASES as SERVING_PHASES
from desktop.core.runtime.lifecycle import ColdStart as ColdStart
from desktop.core.runtime.lifecycle import EngineEvent as EngineEvent
from desktop.core.runtime.lifecycle import EngineOutcome as EngineOutcome
from desktop.core.runtime.lifecycle import EngineState as EngineState
from desktop.core.runtime.lifecycle import Listener as Listener
from desktop.core.runtime.lifecycle import Phase as Phase
from desktop.core.runtime.lifecycle import phases_of as phases_of
from desktop.core.runtime.spawning import SpawnedEngine, spawn
from desktop.core.runtime.spawning import orphan_guard as orphan_guard  # re-exported, as is reap_orphans
from desktop.core.runtime.spawning import reap_orphans as reap_orphans

log = logging.getLogger("switchyard.supervisor")

MARKER_CATCH_UP_S = 0.5  # how long wait_ready lets the log reader catch up on pre-serving markers


class EngineProcess:
    """A supervised engine server. Use as a context manager so it is always stopped."""

    def __init__(
        self,
        adapter: EngineAdapter,
        plan: LaunchPlan,
        install: EngineInstall,
        *,
        log_dir: Path | None = None,
        tcp: bool = False,
        lessons: bool = True,
    ) -> None:
        """`tcp`: the user asked for the engine on a TCP port (plain `serve`, whose clients talk to the engine
        itself); otherwise a plan without an explicit port gets a private Unix socket where the platform has
        them (desktop.core.common.unixhttp). `lessons=False` starts the plan exactly as given and learns nothing
        from a crash: the kernel probe (runtime.kernelprobe) tests what the build does without them."""
        self.adapter = adapter
        self._tcp = tcp
        self._lessons = lessons
        self.install = install
        self.plan = plan
        self.cold_start = ColdStart()
        self.learned_fix: enginefix.LearnedFix | None = None  # arguments added at start that an earlier crash taught
        self.crash_fix: CrashRetry | None = None  # it crashed while loading, and these arguments avoid that crash
        self.state = EngineState.STOPPED
        self.outcome: EngineOutcome | None = None
        self._log_dir = log_dir or paths.logs_dir()
        self.log_path = self._log_dir / f"{adapter.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        self._log = EngineLog(adapter, self.cold_start, self.log_path, elapsed=self.elapsed, emit=self._emit,
                              loading=lambda: self.state in (EngineState.STARTING, EngineState.LOADING))
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()
        self._spawned: SpawnedEngine | None = None  # the process, its group and watchdog (runtime.spawning)
        self._t0 = 0.0
        self._exited = threading.Event()
        self._reader: threading.Thread | None = None
        self._stop_requested = False
        self._final = False  # CRASHED or STOPPED was reached: no later state (a late READY) overwrites it
        self._listener_checked = False
        self.cold_start.expected = tuple(adapter.cold_start_phases(plan))
        cache_dir = adapter.compile_cache_dir(plan)
        self.cold_start.compile_cache_dir = str(cache_dir) if cache_dir is not None else None
        self.cold_start.compile_cache_found = adapter.compile_cache_found(plan)

    # --- observation ---
    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _emit(self, event: EngineEvent) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # a broken subscriber must not kill supervision
                log.exception("engine event listener failed")

    def _set_state(self, state: EngineState) -> None:
        with self._lock:
            if self.state == state or self._final:
                return  # CRASHED and STOPPED are final: a READY that comes late never revives an engine
            if state == EngineState.READY and self.state == EngineState.STOPPING:
                return
            self._final = state in (EngineState.CRASHED, EngineState.STOPPED)
            self.state = state
        log.info("%s %s", self.adapter.name, state.value)
        self._emit(EngineEvent("state", state=state))

    def log_tail(self, lines: int = 200) -> list[str]:
        return self._log.tail(lines)

    @property
    def pid(self) -> int | None:
        return self._spawned.proc.pid if self._spawned else None

    @property
    def base_url(self) -> str:
        """`http+unix://<socket>` or `http://127.0.0.1:PORT`: reach it with desktop.core.common.unixhttp."""
        return unixhttp.engine_url(self.plan.host, self.plan.port)

    @property
    def socket_path(self) -> str | None:
        return self.plan.host if unixhttp.is_socket_host(self.plan.host) else None

    @property
    def address_tag(self) -> str:
        """Short and unique among this app's engines: the port, or the socket's name."""
        path = self.socket_path
        return Path(path).stem.split("-", 1)[-1] if path else str(self.plan.port)  # "<app pid>-<n>"

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    # --- lifecycle ---
    def start(self) -> None:
        """Validate the port, spawn the engine and start streaming its log. Returns immediately."""
        if self._spawned is not None:
            raise SwitchyardError("this engine process was already started")
        self._choose_address()
        if self._lessons:
            self.plan, self.learned_fix = crashes.with_learned_fix(self.adapter, self.install, self.plan)
        command = self.adapter.build_command(self.plan, self.install)
        program = command.argv[0] if command.argv and os.path.isabs(command.argv[0]) else None
        env = {**os.environ, **command.env}
        self.cold_start.page_cache_resident = pagecache.resident_fraction(self.plan.model_path)
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._set_state(EngineState.STARTING)
        self._t0 = time.monotonic()
        self.cold_start.spawned_at = time.time()
        try:
            proc, watcher = spawn(command.argv, env, None)
        except OSError as exc:
            self._set_state(EngineState.CRASHED)
            raise EngineFailed(f"could not start {self.adapter.display_name}: {exc}",
                               "check the engine install: switchyard engines doctor") from exc
        self._spawned = SpawnedEngine.of(proc, watcher)
        self._spawned.write_pidfile(
            engine=self.adapter.name, port=self.plan.port, socket=self.socket_path,
            program=program,  # the reaper kills only processes running this or from the engines folder
            log=str(self.log_path))
        self._reader = threading.Thread(target=self._read_output, name=f"{self.adapter.name}-log", daemon=True)
        self._reader.start()
        self._set_state(EngineState.LOADING)

    def _choose_address(self) -> None:
        """Where the engine listens: a fresh socket in the user's 0700 socket folder unless the user asked for a
        TCP port (or the platform has no Unix sockets); a TCP port is checked free (or picked) here."""
        self.plan = choose_address(self.plan, self.adapter.name, tcp=self._tcp)

    def _listener_is_ours(self) -> bool:
        """Whether what listens at the engine's address belongs to the engine's process tree, checked before
        anything (the key, a prompt) is sent there. A local user who binds the TCP port first (between our check
        and the engine's bind) answers /health; that listener is never trusted, and the engine, unable to bind,
        crashes with an explained reason. A socket path in the user's 0700 folder cannot be taken by another
        user; where the system tells the listening pid (Linux, macOS) it is checked too."""
        if self._listener_checked:
            return True
        self._listener_checked = self.listener_holds()
        return self._listener_checked

    def listener_holds(self) -> bool:
        """Whether the engine's address is held by its own process tree now (not cached: the endpoint asks it
        for every new connection to an engine on TCP; the engine's own process first, where the listener is)."""
        return listener_holds(self._spawned, self.plan)

    def _remove_socket(self) -> None:
        path = self.socket_path
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _read_output(self) -> None:
        """The log thread: copy the engine's output (runtime.enginelog) until it exits, then say how it ended."""
        assert self._spawned is not None and self._spawned.proc.stdout is not None
        self._log.copy(self._spawned.proc.stdout.fileno())
        code = self._spawned.proc.wait()
        # what the engine forked may outlive it (vLLM's EngineCore after its API server crashed): stop its group
        self._spawned.stop_tree(5.0)
        self._spawned.end_watchdog()
        self._exited.set()
        self._spawned.remove_pidfile()
        self._remove_socket()
        if self._stop_requested:
            self.outcome = EngineOutcome(EngineState.STOPPED, code, None, str(self.log_path))
            self._set_state(EngineState.STOPPED)
        else:
            reason, self.crash_fix = crashes.explain_crash(
                self.adapter, self.install, self.plan, code, self.log_tail,
                loading=self._lessons and self.state in (EngineState.STARTING, EngineState.LOADING))
            self.outcome = EngineOutcome(EngineState.CRASHED, code, reason, str(self.log_path))
            # a crash with a known fix is the caller's one line to tell (the endpoint retries with it)
            log.log(logging.INFO if self.crash_fix else logging.ERROR, "%s exited (code %s): %s", self.adapter.name,
                    code, reason.reason)
            self._set_state(EngineState.CRASHED)

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=5)

    def is_running(self) -> bool:
        return self._spawned is not None and not self._exited.is_set()

    def failure(self) -> EngineFailed:
        return crashes.failure(self.adapter, self.outcome, self.log_path)

    def wait_ready(self, timeout: float = 600.0, first_request: bool = True) -> ColdStart:
        """Block until health says ready (T1) and, by default, a real first request streams (T2) and ends (T3).

        Raises EngineFailed with an explained reason when the engine dies or the timeout passes.
        """
        deadline = time.monotonic() + timeout
        health_url = unixhttp.http_url(self.base_url) + self.adapter.health_path
        with unixhttp.client(self.base_url, timeout=httpx.Timeout(5.0, connect=1.0)) as client:
            while True:
                if self._exited.is_set():
                    self._join_reader()
                    raise self.failure()
                if time.monotonic() > deadline:
                    raise EngineFailed(
                        f"{self.adapter.display_name} was not ready after {timeout:.0f} s",
                        f"last log line: {(self.log_tail(1) or ['(none)'])[0][:200]}; log: {self.log_path}",
                    )
                status: int | None = None
                body = ""
                if self._listener_is_ours():  # else an impostor holds the address: it gets nothing from us
                    try:
                        response = client.get(health_url, headers=self._auth_headers())
                        status, body = response.status_code, response.text
                    except httpx.HTTPError:
                        status, body = None, ""
                if self.adapter.health_state(status, body) == "ready":
                    break
                self._exited.wait(0.1)  # wakes at once if the engine dies
        self.cold_start.t1_health_s = round(self.elapsed(), 3)
        self._log.catch_up(time.monotonic() + MARKER_CATCH_UP_S, self._exited)
        self._emit(EngineEvent("phase", phase=PHASE_NAMES["t1_health_s"], seconds=self.cold_start.t1_health_s))
        if first_request:
            self._first_request(deadline)
        self._set_state(EngineState.READY)
        if self.state != EngineState.READY:  # it crashed (or was stopped) meanwhile: final, never READY
            self._join_reader()
            raise self.failure()
        return self.cold_start

    def _auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.plan.api_key}"} if self.plan.api_key else {}

    def _first_request(self, deadline: float) -> None:
        """T2/T3: one short real completion, proving the server serves (not only that a port is open); an
        embedder or reranker (engines.pooling) answers one embedding or ranking instead, and its T2 is its T3."""
        first_token: float | None = None
        kind = args_kind(self.plan.engine, self.plan.extra_args, self.plan.model_path)
        try:
            if kind != "chat":
                self._first_pooling(kind, deadline)
            else:
                first_token = self._first_completion(deadline)
        except httpx.HTTPError as exc:
            if self._exited.is_set():
                self._join_reader()
                raise self.failure() from exc
            raise EngineFailed(f"{self.adapter.display_name} did not answer a first request: {exc}",
                               f"log: {self.log_path}") from exc
        done = self.elapsed()
        self.cold_start.t2_first_token_s = round(first_token if first_token is not None else done, 3)
        self.cold_start.t3_first_request_s = round(done, 3)
        self._emit(EngineEvent("phase", phase=PHASE_NAMES["t2_first_token_s"], seconds=self.cold_start.t2_first_token_s))
        self._emit(EngineEvent("phase", phase=PHASE_NAMES["t3_first_request_s"], seconds=self.cold_start.t3_first_request_s))

    def _first_completion(self, deadline: float) -> float | None:
        """Streams the first completion; returns when its first token came (None: no token)."""
        first_token: float | None = None
        for delta in stream_completion(self.base_url, "Hello", max_tokens=8, model=self.plan.served_model_name,
                                       api_key=self.plan.api_key, timeout=max(5.0, deadline - time.monotonic())):
            if delta.error:
                raise EngineFailed(f"{self.adapter.display_name} answered the first request with an error: "
                                   f"{delta.error}", f"log: {self.log_path}")
            if delta.has_token and first_token is None:
                first_token = self.elapsed()
        return first_token

    def _first_pooling(self, kind: str, deadline: float) -> None:
        route, body = ("/v1/embeddings", {"input": "Hello"}) if kind == "embedding" else \
            ("/v1/rerank", {"query": "Hello", "documents": ["Hello"]})
        with unixhttp.client(self.base_url, timeout=httpx.Timeout(max(5.0, deadline - time.monotonic()),
                                                                  connect=5.0)) as client:
            response = client.post(unixhttp.http_url(self.base_url) + route, headers=self._auth_headers(),
                                   json={**body, "model": self.plan.served_model_name})
        if response.status_code != 200:
            raise EngineFailed(f"{self.adapter.display_name} answered the first {kind} request with HTTP "
                               f"{response.status_code}: {response.text[:300]}", f"log: {self.log_path}")

    def stop(self, grace: float = 15.0) -> EngineOutcome | None:
        """Stop the engine and everything it forked; idempotent."""
        spawned = self._spawned
        if spawned is None:
            return self.outcome
        if not self._exited.is_set():
            self._stop_requested = True
            self._set_state(EngineState.STOPPING)
            spawned.stop_tree(grace)
        with contextlib.suppress(subprocess.TimeoutExpired):
            spawned.proc.wait(timeout=10)
        if self._reader:
            self._reader.join(timeout=10)
        spawned.remove_pidfile()
        self._remove_socket()
        if spawned.proc.stdout:
            spawned.proc.stdout.close()
        return self.outcome

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_ready(make: Callable[[LaunchPlan], EngineProcess], plan: LaunchPlan, *, timeout: float = 600.0,
                first_request: bool = True, on_start: Callable[[EngineProcess], None] | None = None,
                say: Callable[[str], None] | None = None) -> EngineProcess:
    """Start `make(plan)` and wait until it serves; a start that crashed while loading in a way the adapter knows
    arguments avoid (llama-server's SIGILL in its repacked kernels) is started again at once with them, once, and
    `say` tells it in one line. The lesson is already stored (every later start begins with it). The process is
    stopped when it does not serve; the caller owns (and stops) the one returned."""
    process = make(plan)
    try:
        process.start()
        if on_start is not None:
            on_start(process)
        process.wait_ready(timeout=timeout, first_request=first_request)
        return process
    except EngineFailed as failed:
        process.stop()
        fix = process.crash_fix
        if fix is None:
            raise
        reason = process.outcome.reason if process.outcome else None
        why = reason.reason if reason else failed.message
        (say or log.warning)(f"{process.adapter.display_name} crashed while loading: {why}; starting it again at "
                             f"once with {' '.join(fix.args)} (kept for every later start of this build here)")
    except BaseException:
        process.stop()
        raise
    retry = make(replace(plan, extra_args=(*plan.extra_args, *(a for a in fix.args if a not in plan.extra_args))))
    try:
        retry.start()
        if on_start is not None:
            on_start(retry)
        retry.wait_ready(timeout=timeout, first_request=first_request)
    except BaseException:
        retry.stop()
        raise
    return retry


def stream_completion(
    base_url: str,
    prompt: str,
    *,
    max_tokens: int = 32,
    model: str | None = None,
    api_key: str | None = None,
    timeout: float = 120.0,
    temperature: float = 0.0,
    extra: dict[str, Any] | None = None,
) -> Iterator[Any]:
    """Stream one /v1/completions request, yielding `StreamDelta`s (synchronous; for CLI and readiness)."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    body.update(extra or {})
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with unixhttp.client(base_url, timeout=httpx.Timeout(timeout, connect=5.0)) as client, \
            client.stream("POST", unixhttp.http_url(base_url) + "/v1/completions", json=body,
                          headers=headers) as response:
        if response.status_code != 200:
            response.read()
            raise httpx.HTTPStatusError(f"HTTP {response.status_code}: {response.text[:300]}",
                                        request=response.request, response=response)
        yield from iter_deltas(response.iter_bytes())
