"""Starting an engine process so that it never outlives the app, and cleaning up after one that did.

The engine is spawned in its own session from one long-lived thread (PDEATHSIG fires when the *thread* that
forked exits) and tied to the app's life by the orphan guard this platform has (`orphan_guard`): PDEATHSIG and a
watchdog on Linux, a watchdog elsewhere on POSIX, a kill-on-close Job Object on Windows. `SpawnedEngine` is what
a start leaves: the first process, its creation time and process group (what `proctree` stops) and the watchdog;
it writes the pidfile from which `reap_orphans()`, at the next start, stops an engine whose owner is gone.
`desktop.core.runtime.supervisor.EngineProcess` holds one per start."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import logging
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from desktop.core.common import paths, private
from desktop.core.runtime import proctree, watchdog, winjob

log = logging.getLogger("switchyard.supervisor")


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


def spawn(argv: list[str], env: dict[str, str], cwd: Path | None
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
def pidfile(pid: int) -> Path:
    return paths.run_dir() / f"engine-{pid}.json"


def create_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


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
        engine = proctree.recorded_from(record) if record is not None else None
        owner_known = record is not None and proctree.valid_owner(record)
        if record is None or engine is None or not owner_known or engine.created is None:
            log.warning("dropped %s: not a pid file Switchyard wrote (a field is missing or out of range)", file.name)
            private.remove_record(file)
            continue
        owner = proctree.same_process(record.get("owner_pid") or 0, record.get("owner_created"))
        if engine.created < boot:
            private.remove_record(file)  # recorded before this boot: its pids and group ids mean nothing now
            continue
        if owner is not None:
            continue  # its owner is alive: not an orphan
        if proctree.stop(engine, grace=5.0, programs=_engine_programs(record)):
            log.warning("reaped orphaned %s engine pid %s (owner gone)", record.get("engine"), engine.pid)
            killed.append(engine.pid)
        private.remove_record(file)
    return killed


# --- one started engine -------------------------------------------------------------------------------------
@dataclass
class SpawnedEngine:
    """One started engine: its first process, when it was created and its process group (what the pidfile
    records and `proctree` stops: vLLM's EngineCore and workers live in that group), and the watchdog that stops
    the group should the app die."""

    proc: subprocess.Popen[bytes]
    watchdog: subprocess.Popen[bytes] | None
    created: float | None
    pgid: int | None

    @classmethod
    def of(cls, proc: subprocess.Popen[bytes], watcher: subprocess.Popen[bytes] | None) -> SpawnedEngine:
        return cls(proc, watcher, create_time(proc.pid), proctree.process_group(proc.pid))

    @property
    def recorded(self) -> proctree.Recorded:
        return proctree.Recorded(self.proc.pid, self.created, self.pgid)

    def stop_tree(self, grace: float) -> None:
        """Stop the engine, its descendants and its process group (desktop.core.runtime.proctree)."""
        proctree.stop(self.recorded, grace)
        winjob.release(self.proc.pid)

    def end_watchdog(self) -> None:
        """The engine is gone and the app lives: the watchdog has nothing to do."""
        if self.watchdog is not None:
            with contextlib.suppress(OSError):
                self.watchdog.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.watchdog.wait(10)

    def write_pidfile(self, **facts: Any) -> None:
        """Record the engine for `reap_orphans`, with `facts` (engine, port, socket, program, log)."""
        record = {
            "pid": self.proc.pid,
            "created": self.created,
            "pgid": self.pgid,  # vLLM's EngineCore and workers live in it: the next start reaps them by group
            "owner_pid": os.getpid(),
            "owner_created": create_time(os.getpid()),
            "cmdline": proctree.command_line(self.proc.pid),  # what its leader must still run to be stopped
            **facts,
        }
        private.write_private_text(pidfile(self.proc.pid), json.dumps(record))

    def remove_pidfile(self) -> None:
        pidfile(self.proc.pid).unlink(missing_ok=True)
