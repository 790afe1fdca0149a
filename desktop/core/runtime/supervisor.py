"""One object per engine process: spawn it from an argument list, own its process group, stream its log, time
its cold start in phases, tell when it really serves, explain why it died, and never leave it orphaned.

Orphan protection, in layers: the engine gets PR_SET_PDEATHSIG (Linux) so it dies with the app, and on every POSIX
system a watchdog process (`desktop.core.runtime.watchdog`) stops its whole process group when the app dies
(PDEATHSIG reaches the engine's first process only; vLLM's EngineCore and workers share its group); Windows uses
a kill-on-close Job Object. Every engine we start is recorded in a pidfile with its process group, and
`reap_orphans()` at the next start stops leftovers whose owner is gone, by group, even when the recorded pid is
already dead. `stop()` and all of these stop a tree the one way `desktop.core.runtime.proctree` knows."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import itertools
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import psutil

from desktop.core.common import paths, private, unixhttp
from desktop.core.common.errors import EngineFailed, SwitchyardError
from desktop.core.common.sse import iter_deltas
from desktop.core.engines.base import CrashRetry, EngineAdapter, EngineInstall, FailureReason, LaunchPlan
from desktop.core.runtime import enginefix, pagecache, proctree, watchdog, winjob

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
from desktop.core.runtime.ports import ensure_port_free, find_free_port

log = logging.getLogger("switchyard.supervisor")

LOG_TAIL_LINES = 2000
LOG_MAX_BYTES = 20 * 1024 * 1024  # per file; then it rotates to .1, .2, .3 (llama-server -lv 4 writes ~7 kB/request)
LOG_BACKUPS = 3
MARKER_CATCH_UP_S = 0.5  # how long wait_ready lets the log reader catch up on pre-serving markers


# --- spawning: from one long-lived thread, because PDEATHSIG fires when the *thread* that forked exits -------
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="switchyard-spawner")
_PR_SET_PDEATHSIG = 1


def orphan_guard() -> str:
    """How engines die with the app here: "pdeathsig" (Linux), "job" (Windows: a kill-on-close Job Object) or
    "watchdog" (macOS and other POSIX systems). SWITCHYARD_ORPHAN_GUARD picks a POSIX one explicitly (tests use
    it to run the watchdog on Linux)."""
    if sys.platform == "win32":
        return "job"
    chosen = os.environ.get("SWITCHYARD_ORPHAN_GUARD", "")
    if chosen in ("pdeathsig", "watchdog"):
        return chosen
    return "pdeathsig" if sys.platform.startswith("linux") else "watchdog"


def _new_session() -> None:  # runs in the child between fork and exec
    os.setsid()


def _new_session_dying_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _spawn(argv: list[str], env: dict[str, str], cwd: Path | None
           ) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes] | None]:
    """Start the engine in its own session, tied to this process's life. Returns (engine, watchdog or None).

    On POSIX a watchdog always watches it: PDEATHSIG (Linux) kills only the engine's first process, while vLLM's
    EngineCore and workers share its group and would outlive a SIGKILLed app."""
    guard = orphan_guard()
    if guard == "job":
        engine = subprocess.Popen(  # noqa: S603 - argument list from an adapter, never a shell
            argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            creationflags=getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0), close_fds=True)
        try:
            winjob.assign_kill_on_close_job(engine)
        except OSError as exc:  # the engine still runs; the pidfile lets the next start reap it if we die
            log.warning("could not tie the engine to the app (%s): an orphan is reaped at the next start", exc)
        return engine, None

    def run() -> subprocess.Popen[bytes]:
        return subprocess.Popen(  # noqa: S603 - argument list from an adapter, never a shell
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=_new_session_dying_with_parent if guard == "pdeathsig" else _new_session,  # noqa: PLW1509
            close_fds=True,
        )

    engine = _SPAWNER.submit(run).result()
    try:  # PDEATHSIG reaches the engine's first process only; the watchdog stops its whole group

        watcher = subprocess.Popen(  # noqa: S603 - our own interpreter and module
            watchdog.command(os.getpid(), engine.pid), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except OSError as exc:  # the engine still runs; the pidfile lets the next start reap it if we die
        log.warning("could not start the engine watchdog (%s): an orphaned engine is reaped at the next start", exc)
        return engine, None
    return engine, watcher


# --- pidfiles and reaping ------------------------------------------------------------------------------------
def _pidfile(pid: int) -> Path:
    return paths.run_dir() / f"engine-{pid}.json"


def _create_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def _recorded(record: dict[str, Any]) -> proctree.Recorded:
    pgid = record.get("pgid")
    return proctree.Recorded(int(record.get("pid", 0)), record.get("created"),
                             int(pgid) if isinstance(pgid, int) else None)


def _engine_programs(record: dict[str, Any]) -> list[Path]:
    """What an orphan's processes may run to be killed: something under the engines folder, or the very program
    the pidfile says the engine was started as (a configured llama-server elsewhere)."""
    programs = [paths.engines_dir()]
    program = record.get("program")
    if isinstance(program, str) and os.path.isabs(program):
        programs.append(Path(program))
    return programs


def reap_orphans() -> list[int]:
    """Kill engines (their whole process group and tree) recorded by a Switchyard process that no longer runs.
    Returns the recorded engine pids whose leftovers were stopped.

    A pidfile is only a hint: one from before the last boot names pids and groups that now belong to others (it
    is dropped), and only processes running an engine program (`_engine_programs`) are touched, so a new
    leaderless process group that happens to reuse a dead engine's group id is left alone."""
    killed: list[int] = []
    boot = psutil.boot_time()
    for file in paths.run_dir().glob("engine-*.json"):
        record = private.read_record(file)
        try:
            if record is None:
                raise ValueError("not a pidfile")
            engine = _recorded(record)
            created = float(record.get("created") or 0)
            owner = proctree.same_process(int(record.get("owner_pid", 0)), record.get("owner_created"))
        except (ValueError, TypeError, OverflowError):
            private.remove_record(file)
            continue
        if created < boot:
            private.remove_record(file)  # recorded before this boot: its pids and group ids mean nothing now
            continue
        if owner is not None:
            continue  # its owner is alive: not an orphan
        if proctree.stop(engine, grace=5.0, programs=_engine_programs(record)):
            log.warning("reaped orphaned %s engine pid %s (owner gone)", record.get("engine"), engine.pid)
            killed.append(engine.pid)
        private.remove_record(file)
    return killed


class _RotatingLog:
    """An engine's log file that rotates at LOG_MAX_BYTES (keeping LOG_BACKUPS older files), so a server that
    runs for days keeps its latest lines on disk without filling it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sink = self._open()
        self._size = self._sink.tell()

    def _open(self) -> Any:
        """Append, 0600: logs hold what the engine prints (llama-server shows part of its key)."""
        return os.fdopen(private.open_private(self.path), "ab")

    def write(self, block: bytes) -> None:
        if self._size + len(block) > LOG_MAX_BYTES and self._size > 0:
            self._rotate()
        self._sink.write(block)
        self._sink.flush()
        self._size += len(block)

    def _rotate(self) -> None:
        self._sink.close()
        for index in range(LOG_BACKUPS - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{index + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        self._sink = self._open()
        self._size = 0

    def close(self) -> None:
        self._sink.close()


# --- the engine process ---------------------------------------------------------------------------------------
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_SOCKETS = itertools.count()


def _listens_on(pids: set[int], port: int) -> bool:
    """Whether one of `pids` holds a listening TCP socket on `port` (psutil, per process: cheap, and it sees
    only what those processes hold, so another user's listener can never count)."""
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            connections = proc.net_connections("inet") if hasattr(proc, "net_connections") else proc.connections("inet")
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in connections):
                return True
    return False


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
    ) -> None:
        """`tcp`: the user asked for the engine on a TCP port (plain `serve`, whose clients talk to the engine
        itself); otherwise a plan without an explicit port gets a private Unix socket where the platform has
        them (desktop.core.common.unixhttp)."""
        self.adapter = adapter
        self._tcp = tcp
        self.install = install
        self.plan = plan
        self.cold_start = ColdStart()
        self.learned_fix: enginefix.LearnedFix | None = None  # arguments added at start that an earlier crash taught
        self.crash_fix: CrashRetry | None = None  # it crashed while loading, and these arguments avoid that crash
        self.state = EngineState.STOPPED
        self.outcome: EngineOutcome | None = None
        self._log_dir = log_dir or paths.logs_dir()
        self.log_path = self._log_dir / f"{adapter.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        self._tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._created: float | None = None
        self._pgid: int | None = None
        self._program: str | None = None
        self._t0 = 0.0
        self._exited = threading.Event()
        self._reader: threading.Thread | None = None
        self._stop_requested = False
        self._final = False  # CRASHED or STOPPED was reached: no later state (a late READY) overwrites it
        self._listener_checked = False
        self._marker_lines_left = 2000
        self._marker_seen = threading.Condition()  # the reader matched a marker: wait_ready's catch-up waits on it
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
        return list(self._tail)[-lines:]

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

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
        if self._proc is not None:
            raise SwitchyardError("this engine process was already started")
        self._choose_address()
        self._apply_learned_fix()
        command = self.adapter.build_command(self.plan, self.install)
        self._program = command.argv[0] if command.argv and os.path.isabs(command.argv[0]) else None
        env = {**os.environ, **command.env}
        self.cold_start.page_cache_resident = pagecache.resident_fraction(self.plan.model_path)
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._set_state(EngineState.STARTING)
        self._t0 = time.monotonic()
        self.cold_start.spawned_at = time.time()
        try:
            self._proc, self._watchdog = _spawn(command.argv, env, None)
        except OSError as exc:
            self._set_state(EngineState.CRASHED)
            raise EngineFailed(f"could not start {self.adapter.display_name}: {exc}",
                               "check the engine install: switchyard engines doctor") from exc
        self._created = _create_time(self._proc.pid)
        self._pgid = proctree.process_group(self._proc.pid)
        self._write_pidfile()
        self._reader = threading.Thread(target=self._read_output, name=f"{self.adapter.name}-log", daemon=True)
        self._reader.start()
        self._set_state(EngineState.LOADING)

    def _choose_address(self) -> None:
        """Where the engine listens: a fresh socket in the user's 0700 socket folder unless the user asked for a
        TCP port (or the platform has no Unix sockets); a TCP port is checked free (or picked) here."""
        host = self.plan.host
        if unixhttp.is_socket_host(host):
            Path(host).unlink(missing_ok=True)  # a stale socket of ours: the engine's bind would fail on it
            return
        if self.plan.port == 0 and not self._tcp and unixhttp.supported() and host in _LOOPBACK:
            name = f"{self.adapter.name.replace('.', '')}-{os.getpid()}-{next(_SOCKETS)}.sock"
            path = unixhttp.socket_dir(paths.run_dir()) / name
            path.unlink(missing_ok=True)
            self.plan = replace(self.plan, host=str(path))
            return
        if host not in _LOOPBACK:
            log.warning("binding %s to non-loopback host %s at the user's request", self.adapter.name, host)
        if not self._tcp and self.plan.api_key is None:  # TCP only because the platform has no sockets: a key
            self.plan = replace(self.plan, api_key=secrets.token_urlsafe(32))
        if self.plan.port == 0:
            self.plan = replace(self.plan, port=find_free_port(host))
        else:
            ensure_port_free(self.plan.port, host)

    def _apply_learned_fix(self) -> None:
        """Start with the arguments an earlier crash of this build on this model taught (runtime.enginefix): a
        llama-server that died of SIGILL in its weight repack here starts with --no-repack from then on."""
        fix = enginefix.learned(self.adapter.name, self.install, self.plan.model_path)
        missing = tuple(a for a in fix.args if a not in self.plan.extra_args) if fix else ()
        if fix is None or not missing:
            return
        self.plan = replace(self.plan, extra_args=(*self.plan.extra_args, *missing))
        self.learned_fix = fix
        log.info("%s starts with %s (learned here: %s)", self.adapter.name, " ".join(missing), fix.why)

    def _learn_from_crash(self, code: int | None, reason: FailureReason) -> FailureReason:
        """A crash while loading that the adapter knows arguments avoid (`crash_retry`): remember them for this
        build and model (the next start here begins with them; the endpoint retries at once) and say so."""
        fix = self.adapter.crash_retry(code, self.log_tail(400), self.plan)
        if fix is None:
            return reason
        self.crash_fix = fix
        enginefix.remember(self.adapter.name, self.install, self.plan.model_path, fix, code)
        return replace(reason, suggestion=f"the next start of this model adds {' '.join(fix.args)} (remembered "
                                          "for this engine build here): start it again")

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
        if self._proc is None or self._proc.poll() is not None:  # exited: its port is anybody's
            return False
        path = self.socket_path
        if path is None and _listens_on({self._proc.pid}, self.plan.port):
            return True
        tree = {p.pid for p in proctree.members_of(proctree.Recorded(self._proc.pid, self._created, self._pgid))}
        if path is not None:
            pid = unixhttp.peer_pid(path)
            return pid in tree if pid is not None else (
                sys.platform not in ("linux", "darwin") and os.path.exists(path))
        return _listens_on(tree, self.plan.port)

    def _remove_socket(self) -> None:
        path = self.socket_path
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _write_pidfile(self) -> None:
        assert self._proc is not None
        record = {
            "pid": self._proc.pid,
            "created": self._created,
            "pgid": self._pgid,  # vLLM's EngineCore and workers live in it: the next start reaps them by group
            "owner_pid": os.getpid(),
            "owner_created": _create_time(os.getpid()),
            "engine": self.adapter.name,
            "port": self.plan.port,
            "socket": self.socket_path,
            "program": self._program,  # the reaper kills only processes running this or from the engines folder
            "log": str(self.log_path),
        }
        private.write_private_text(_pidfile(self._proc.pid), json.dumps(record))

    def _read_output(self) -> None:
        """Copy the engine's output to the log file and subscribers. Reads whole blocks: under load an engine
        writes thousands of lines a second, and one write per block (not per line) keeps that cheap."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        log_file = _RotatingLog(self.log_path)
        pending = b""
        try:
            while block := os.read(fd, 65536):
                log_file.write(block)
                *lines, pending = (pending + block).split(b"\n")
                for raw in lines:
                    self._line(raw)
            if pending:
                self._line(pending)
        finally:
            log_file.close()
        code = self._proc.wait()
        # what the engine forked may outlive it (vLLM's EngineCore after its API server crashed): stop its group
        self._stop_tree(5.0)
        if self._watchdog is not None:  # the engine is gone and the app lives: the watchdog has nothing to do
            with contextlib.suppress(OSError):
                self._watchdog.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(10)
        self._exited.set()
        _pidfile(self._proc.pid).unlink(missing_ok=True)
        self._remove_socket()
        if self._stop_requested:
            self.outcome = EngineOutcome(EngineState.STOPPED, code, None, str(self.log_path))
            self._set_state(EngineState.STOPPED)
        else:
            reason = self.adapter.explain_failure(code, self.log_tail(self.adapter.failure_tail_lines))
            if self.state in (EngineState.STARTING, EngineState.LOADING):
                reason = self._learn_from_crash(code, reason)
            self.outcome = EngineOutcome(EngineState.CRASHED, code, reason, str(self.log_path))
            # a crash with a known fix is the caller's one line to tell (the endpoint retries with it)
            log.log(logging.INFO if self.crash_fix else logging.ERROR, "%s exited (code %s): %s", self.adapter.name,
                    code, reason.reason)
            self._set_state(EngineState.CRASHED)

    def _line(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip()
        if self.adapter.is_polling_line(line):
            return  # the app's own /health, /metrics, /slots polls: kept in the file, not in the pane or tail
        self._tail.append(line)
        # Cold-start markers come before the engine serves; this thread may still be catching up on them when
        # health says ready, so it keeps looking for a while (at most a pipe buffer's worth of lines).
        if self.state in (EngineState.STARTING, EngineState.LOADING):
            self._match_markers(line)
        elif self._marker_lines_left > 0:
            self._marker_lines_left -= 1
            self._match_markers(line)
        self._emit(EngineEvent("log", line=line))

    def _catch_up_markers(self, deadline: float) -> None:
        """Health answered; the reader thread may still hold the log lines printed before it (their markers
        stamped late, their phase events after T1). Wait, briefly and on the reader's own signal, until every
        phase this plan expects before serving has ended; a marker that never comes costs MARKER_CATCH_UP_S."""
        before_serving = [key for key in self.cold_start.expected if key not in SERVING_PHASES]
        with self._marker_seen:
            while any(key not in self.cold_start.phase_ends for key in before_serving):
                left = deadline - time.monotonic()
                if left <= 0 or self._exited.is_set():
                    return
                self._marker_seen.wait(left)

    def _match_markers(self, line: str) -> None:
        for marker in self.adapter.log_markers:
            match = marker.match(line)
            if not match:
                continue
            seconds = round(self.elapsed(), 3)
            if self.cold_start.t1_health_s is not None:  # printed before health answered, read after it
                seconds = min(seconds, self.cold_start.t1_health_s)
            first = marker.name not in self.cold_start.markers
            self.cold_start.markers.setdefault(marker.name, seconds)
            if marker.ends and first:
                self.cold_start.end_phase(marker.ends, seconds)
            for key, value in match.groupdict().items():
                if value is not None:
                    self.cold_start.facts[f"{marker.name}.{key}"] = value
            self._emit(EngineEvent("phase", phase=marker.name, seconds=seconds))
            with self._marker_seen:
                self._marker_seen.notify_all()

    def _stop_tree(self, grace: float) -> None:
        """Stop the engine, its descendants and its process group (desktop.core.runtime.proctree)."""
        assert self._proc is not None
        proctree.stop(proctree.Recorded(self._proc.pid, self._created, self._pgid), grace)
        winjob.release(self._proc.pid)

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=5)

    def is_running(self) -> bool:
        return self._proc is not None and not self._exited.is_set()

    def failure(self) -> EngineFailed:
        reason = self.outcome.reason if self.outcome else None
        code = self.outcome.exit_code if self.outcome else None
        message = f"{self.adapter.display_name} stopped before it was ready"
        if reason:
            message = f"{self.adapter.display_name} failed: {reason.reason}"
        hint = f"{reason.suggestion}; log: {self.log_path}" if reason else f"exit code {code}; log: {self.log_path}"
        return EngineFailed(message, hint)

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
        self._catch_up_markers(time.monotonic() + MARKER_CATCH_UP_S)
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
        """T2/T3: one short real completion, proving the server serves (not only that a port is open)."""
        first_token: float | None = None
        try:
            for delta in stream_completion(self.base_url, "Hello", max_tokens=8, model=self.plan.served_model_name,
                                           api_key=self.plan.api_key, timeout=max(5.0, deadline - time.monotonic())):
                if delta.error:
                    raise EngineFailed(f"{self.adapter.display_name} answered the first request with an error: "
                                       f"{delta.error}", f"log: {self.log_path}")
                if delta.has_token and first_token is None:
                    first_token = self.elapsed()
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

    def stop(self, grace: float = 15.0) -> EngineOutcome | None:
        """Stop the engine and everything it forked; idempotent."""
        if self._proc is None:
            return self.outcome
        if not self._exited.is_set():
            self._stop_requested = True
            self._set_state(EngineState.STOPPING)
            self._stop_tree(grace)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)
        if self._reader:
            self._reader.join(timeout=10)
        _pidfile(self._proc.pid).unlink(missing_ok=True)
        self._remove_socket()
        if self._proc.stdout:
            self._proc.stdout.close()
        return self.outcome

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
