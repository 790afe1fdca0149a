"""An engine's watchdog: stops the engine when the app that started it dies, where the kernel will not.

Linux kills an engine with its app through PR_SET_PDEATHSIG, but that reaches the engine's first process only
(vLLM's EngineCore and workers live on); macOS has no such thing at all. So on every POSIX system a tiny process
per engine waits, without polling, for the first of the two to exit (kqueue on macOS and BSD, pidfd on Linux,
psutil's polling elsewhere). If the app went first, it stops the engine's process group and tree
(desktop.core.runtime.proctree); if the engine went first while the app lives, it simply exits. It runs in its
own session so that whatever kills the app's process group does not kill the watchdog with it, and it imports
nothing heavy: it lives as long as the engine.

Run as `python -m desktop.core.runtime.watchdog APP_PID ENGINE_PID` (or `switchyard --engine-watchdog …` when frozen).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import psutil

from desktop.core.runtime import proctree

GRACE_SECONDS = 2.0  # the app is gone: nobody waits for a graceful shutdown
FLAG = "--engine-watchdog"


def command(app_pid: int, engine_pid: int) -> list[str]:
    """The argument list that starts a watchdog, from a source checkout or a frozen app alike."""
    if getattr(sys, "frozen", False):
        return [sys.executable, FLAG, str(app_pid), str(engine_pid)]
    return [sys.executable, "-m", "desktop.core.runtime.watchdog", str(app_pid), str(engine_pid)]


def first_to_exit(pids: Sequence[int]) -> int:
    """Block until one of `pids` exits and return it (a pid that is already gone returns at once)."""
    for pid in pids:
        if not psutil.pid_exists(pid):
            return pid
    if hasattr(select, "kqueue"):
        return _first_to_exit_kqueue(pids)
    if hasattr(os, "pidfd_open"):
        with contextlib.suppress(OSError):  # pidfd needs Linux 5.3
            return _first_to_exit_pidfd(pids)
    return _first_to_exit_polling(pids)


def _first_to_exit_kqueue(pids: Sequence[int]) -> int:
    kq: Any = select  # the kqueue names exist only on macOS and the BSDs
    queue = kq.kqueue()
    try:
        events = []
        for pid in pids:
            events.append(kq.kevent(pid, filter=kq.KQ_FILTER_PROC, flags=kq.KQ_EV_ADD, fflags=kq.KQ_NOTE_EXIT))
        try:
            queue.control(events, 0)
        except ProcessLookupError:  # one exited between the check and the registration
            return next(pid for pid in pids if not psutil.pid_exists(pid))
        while True:
            for event in queue.control(None, 1):
                return int(event.ident)
    finally:
        queue.close()


def _first_to_exit_pidfd(pids: Sequence[int]) -> int:
    descriptors: dict[int, int] = {}
    try:
        for pid in pids:
            try:
                descriptors[os.pidfd_open(pid)] = pid
            except ProcessLookupError:
                return pid
        poller = select.poll()
        for fd in descriptors:
            poller.register(fd, select.POLLIN)
        while True:
            for fd, _mask in poller.poll():
                return descriptors[fd]
    finally:
        for fd in descriptors:
            os.close(fd)


def _first_to_exit_polling(pids: Sequence[int]) -> int:
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            return pid
    while True:
        gone, _alive = psutil.wait_procs(processes, timeout=1.0)
        if gone:
            return int(gone[0].pid)


def _app_gone(app_pid: int, app_created: float | None, within: float) -> bool:
    """True once the app has exited (a zombie counts), waiting up to `within` seconds: when the app is SIGKILLed,
    PDEATHSIG may end the engine a moment before the app itself shows as exited."""
    deadline = time.monotonic() + within
    while True:
        if proctree.same_process(app_pid, app_created) is None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)  # a short poll: a non-child's exit gives no event once its pidfd has fired


def watch(app_pid: int, engine_pid: int) -> bool:
    """Wait for the app or the engine to exit; once the app is gone, stop the engine's whole tree (its group too:
    vLLM's EngineCore and workers outlive the API server, whom PDEATHSIG reaches alone). True if it stopped it."""
    try:
        engine_created = psutil.Process(engine_pid).create_time()
    except psutil.NoSuchProcess:
        return False
    try:
        app_created: float | None = psutil.Process(app_pid).create_time()
    except psutil.NoSuchProcess:
        app_created = None
    if first_to_exit([app_pid, engine_pid]) != app_pid and not _app_gone(app_pid, app_created, 2.0):
        return False  # the engine ended while the app lives: the supervisor collects what is left
    pgid = engine_pid if proctree.process_group(engine_pid) in (engine_pid, None) else None
    return bool(proctree.stop(proctree.Recorded(engine_pid, engine_created, pgid), GRACE_SECONDS))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or not all(a.isdigit() for a in args):
        print(f"usage: {FLAG} APP_PID ENGINE_PID", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the app must not end the watch
    watch(int(args[0]), int(args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
