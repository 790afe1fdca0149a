"""An engine's watchdog: stops the engine when the app that started it dies, where the kernel will not.

Linux kills an engine with its app through PR_SET_PDEATHSIG. macOS has no such thing, so there a tiny process
per engine waits, without polling, for the first of the two to exit (kqueue on macOS and BSD, pidfd on Linux,
psutil's polling elsewhere). If the app went first, it stops the engine's process group (SIGTERM, then SIGKILL);
if the engine went first, it simply exits. It runs in its own session so that whatever kills the app's process
group does not kill the watchdog with it, and it imports nothing heavy: it lives as long as the engine.

Run as `python -m desktop.core.runtime.watchdog APP_PID ENGINE_PID` (or `switchyard --engine-watchdog …` when frozen).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
from collections.abc import Sequence
from typing import Any

import psutil

GRACE_SECONDS = 5.0
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


def stop_group(engine_pid: int, grace: float = GRACE_SECONDS) -> None:
    """SIGTERM the engine's process group (it leads its own session) and descendants that left it, then SIGKILL
    whatever is left after `grace` seconds. POSIX; the supervisor uses it too."""
    try:
        root = psutil.Process(engine_pid)
        members = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(engine_pid, signal.SIGTERM)
    for proc in members:  # descendants that left the group; one signal each, or llama-server aborts its shutdown
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) != engine_pid:
                proc.terminate()
    _gone, alive = psutil.wait_procs(members, timeout=grace)
    if alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(engine_pid, signal.SIGKILL)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=5)


def watch(app_pid: int, engine_pid: int) -> bool:
    """Wait for the app or the engine to exit; stop the engine if the app went first. True if it stopped it."""
    try:
        engine_created = psutil.Process(engine_pid).create_time()
    except psutil.NoSuchProcess:
        return False
    if first_to_exit([app_pid, engine_pid]) != app_pid:
        return False
    with contextlib.suppress(psutil.NoSuchProcess):
        if abs(psutil.Process(engine_pid).create_time() - engine_created) < 1.0:  # not a recycled pid
            stop_group(engine_pid)
            return True
    return False


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
