"""Stopping an engine's whole process tree: the one place that knows how, used by the supervisor, the watchdog,
the orphan reaper and the uninstaller.

An engine is more than one process. vLLM's API server forks `VLLM::EngineCore`, `VLLM::Worker` and
multiprocessing's resource tracker; they share its process group (the engine leads its own session), but
PR_SET_PDEATHSIG reaches only the API server, so they outlive a crashed app unless someone stops the *group*.
Members are found three ways (POSIX): the process group, the descendants of the leader, and, when the leader is
already dead, the group alone. A group id is not reused while the group lives, but once all of an engine's group
died (or after a reboot) a new, unrelated leaderless group may carry the same number: callers that act on an old
record (the orphan reaper, the uninstaller) pass `programs`, so only processes running an engine are touched. Every member gets one SIGTERM (llama-server aborts its graceful
shutdown on a second one), then SIGKILL after the grace period. On Windows (no groups) CTRL_BREAK goes to the
engine's console group, then the tree is terminated.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

GRACE_SECONDS = 5.0
_SAME_START = 1.0  # seconds of slack when comparing recorded start times


@dataclass(frozen=True)
class Recorded:
    """What a pidfile says about an engine: its pid, start time, process group and (since issue 60) the command
    line it ran, which its leader must still show to be stopped."""

    pid: int
    created: float | None
    pgid: int | None = None
    cmdline: tuple[str, ...] | None = None


PID_LIMIT = 1 << 22  # the largest pid Linux hands out (PID_MAX_LIMIT); macOS stops at 99,999


def valid_pid(value: object) -> int | None:
    """`value` if a pid file may name it as a pid or process group: an int, not a bool, in 2..PID_LIMIT (0, 1 and
    negative numbers mean init, "my group" or "every process" to kill())."""
    if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= PID_LIMIT:
        return None
    return value


def valid_time(value: object) -> float | None:
    """`value` if it can be a recorded start time: a finite number of seconds after the epoch, not more than a day
    ahead. A NaN made every comparison with it false, so any live pid passed for the recorded process."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        seconds = float(value)
    except OverflowError:
        return None
    if not math.isfinite(seconds) or not 0 < seconds <= time.time() + 86400:
        return None
    return seconds


def recorded_from(record: Mapping[str, Any]) -> Recorded | None:
    """The engine a pid file records, or None when a field is not what Switchyard writes (the file is then
    dropped, never acted on): the one check of a pid file's numbers, for the reaper and the uninstaller."""
    pid, created = valid_pid(record.get("pid")), valid_time(record.get("created"))
    raw_pgid, cmdline = record.get("pgid"), record.get("cmdline")
    pgid = valid_pid(raw_pgid)
    if pid is None or created is None or (raw_pgid is not None and pgid is None):
        return None
    if cmdline is not None and not (isinstance(cmdline, list) and cmdline
                                    and all(isinstance(arg, str) for arg in cmdline)):
        return None
    return Recorded(pid, created, pgid, tuple(cmdline) if cmdline else None)


def valid_owner(record: Mapping[str, Any]) -> bool:
    """Whether a pid file's owner fields are absent (`owner_pid` 0 or null) or what Switchyard writes."""
    owner_pid, owner_created = record.get("owner_pid"), record.get("owner_created")
    no_owner = owner_pid is None or (type(owner_pid) is int and owner_pid == 0)
    return (no_owner or valid_pid(owner_pid) is not None) and \
        (owner_created is None or valid_time(owner_created) is not None)


def command_line(pid: int) -> list[str] | None:
    """What `pid` shows as its command line now (what a pid file records right after the spawn), or None."""
    try:
        return list(psutil.Process(pid).cmdline())
    except psutil.Error:
        return None


def process_group(pid: int) -> int | None:
    """The process group of `pid` (POSIX), or None."""
    if os.name != "posix":
        return None
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def group_members(pgid: int, since: float | None = None) -> list[psutil.Process]:
    """Live (non-zombie) processes of process group `pgid`, started at or after `since` when given."""
    if os.name != "posix" or pgid <= 1:
        return []
    found = []
    for proc in psutil.process_iter(["status", "create_time"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE or os.getpgid(proc.pid) != pgid:
                continue
        except (OSError, psutil.Error):
            continue
        if since is not None and (proc.info["create_time"] or 0) < since - _SAME_START:
            continue
        found.append(proc)
    return found


def same_process(pid: int, created: float | None, cmdline: Sequence[str] | None = None) -> psutil.Process | None:
    """The live process `pid` if it is the one that started at `created` (pids are reused) and, when given, still
    runs `cmdline`, else None."""
    started = valid_time(created)
    if started is None or valid_pid(pid) is None:
        return None
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE or not _is_recorded(proc, started, cmdline):
            return None
    except (psutil.Error, ValueError, TypeError):
        return None
    return proc


def _is_recorded(proc: psutil.Process, created: float, cmdline: Sequence[str] | None) -> bool:
    """Whether `proc` is the recorded process: the same start time and, where recorded, the same command line."""
    if abs(proc.create_time() - created) >= _SAME_START:
        return False
    return cmdline is None or proc.cmdline() == list(cmdline)


def tree_rss(pid: int | None) -> int | None:
    """Resident bytes of a process and all its descendants (vLLM forks an engine core); None when the process is
    gone. The one definition: launch records, the endpoint's standby decision, the A/B sampler and telemetry."""
    if pid is None:
        return None
    try:
        root = psutil.Process(pid)
        members = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for proc in members:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total


def members_of(record: Recorded) -> list[psutil.Process]:
    """Every live process of the recorded engine's tree: the leader (if it still is the recorded process), its
    descendants and its process group. An empty list when the pid now belongs to someone else."""
    found: dict[int, psutil.Process] = {}
    created = valid_time(record.created)
    if created is None or valid_pid(record.pid) is None:
        return []  # nothing a pid file may name: never "any live pid"
    try:
        proc = psutil.Process(record.pid)
        dead = proc.status() == psutil.STATUS_ZOMBIE  # a zombie shows no command line; its group may live on
        recycled = not _is_recorded(proc, created, None if dead else record.cmdline)
    except psutil.NoSuchProcess:
        recycled, dead = False, True
    except (psutil.Error, ValueError, TypeError):
        return []
    if recycled:
        return []  # the pid is someone else's now, so its old group is empty (a group id is never reused in use)
    if not dead:
        found[proc.pid] = proc
        with contextlib.suppress(psutil.Error):
            for child in proc.children(recursive=True):
                found[child.pid] = child
    pgid = record.pgid if record.pgid is not None else (record.pid if process_group(record.pid) == record.pid
                                                        else None)
    if pgid == record.pid:  # only the engine's own group: never a group it merely belonged to
        for member in group_members(pgid, since=created):
            found.setdefault(member.pid, member)
    return list(found.values())


def runs_from(proc: psutil.Process, programs: Sequence[Path]) -> bool:
    """Whether the process's program is one of `programs` or lives under one of them (a folder): its executable,
    or the path it was started as (a vLLM engine runs its venv's python, a link to the system interpreter)."""
    candidates: list[str] = []
    with contextlib.suppress(psutil.Error, OSError):
        candidates.append(proc.exe())
    with contextlib.suppress(psutil.Error, OSError, IndexError):
        candidates.append(proc.cmdline()[0])
    for candidate in candidates:
        if not candidate or not os.path.isabs(candidate):
            continue
        path = Path(os.path.normpath(candidate))
        if any(path == Path(os.path.normpath(root)) or path.is_relative_to(os.path.normpath(root))
               for root in programs):
            return True
    return False


def _uid_of(proc: psutil.Process) -> int | None:
    try:
        return int(proc.uids().real)
    except (psutil.Error, AttributeError):
        return None


def stop(record: Recorded, grace: float = GRACE_SECONDS, *, uid: int | None = None,
         programs: Sequence[Path] | None = None) -> list[int]:
    """Stop the recorded engine's whole tree: one SIGTERM each, SIGKILL after `grace` seconds for what is left.
    With `uid`, only processes of that user are touched (the uninstaller runs as root); with `programs`, only
    processes that run one of them (`runs_from`): what a stale pidfile names may now be someone else's, e.g. a
    new leaderless group reusing a dead engine's group id. Returns the pids signalled."""

    def wanted(proc: psutil.Process) -> bool:
        return (uid is None or _uid_of(proc) == uid) and (programs is None or runs_from(proc, programs))

    members = [p for p in members_of(record) if wanted(p)]
    if not members:
        return []
    if sys.platform == "win32":
        with contextlib.suppress(OSError):
            os.kill(record.pid, signal.CTRL_BREAK_EVENT)  # type: ignore[attr-defined,unused-ignore]
    else:
        for proc in members:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
    _gone, alive = psutil.wait_procs(members, timeout=grace)
    # late forks (a worker started while we waited) and whatever ignored SIGTERM
    late = [p for p in members_of(record) if wanted(p)]
    leftovers = {p.pid: p for p in [*alive, *late]}
    for proc in leftovers.values():
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(list(leftovers.values()), timeout=5)
    return [p.pid for p in members]


def stop_pid(pid: int, grace: float = GRACE_SECONDS, *, uid: int | None = None) -> list[int]:
    """Stop the live process `pid` with its descendants and (when it leads one) its process group."""
    try:
        created = psutil.Process(pid).create_time()
    except psutil.Error:
        return []
    pgid = process_group(pid)
    return stop(Recorded(pid, created, pgid if pgid == pid else None), grace, uid=uid)
