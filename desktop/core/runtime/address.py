"""Where an engine listens, and whether what listens there is the engine.

A plan without an explicit port gets a fresh Unix socket in the user's 0700 socket folder where the platform has
them (desktop.core.common.unixhttp); otherwise a TCP port is checked free or picked, with an API key when TCP is
only the platform's fallback. Before anything (the key, a prompt) is sent to that address, `listener_holds`
checks that the listener belongs to the engine's own process tree, so a local user who bound the port first is
never trusted."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import sys
from dataclasses import replace
from pathlib import Path

import psutil

from desktop.core.common import paths, unixhttp
from desktop.core.engines.base import LaunchPlan
from desktop.core.runtime import proctree
from desktop.core.runtime.ports import ensure_port_free, find_free_port
from desktop.core.runtime.spawning import SpawnedEngine

log = logging.getLogger("switchyard.supervisor")

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_SOCKETS = itertools.count()


def choose_address(plan: LaunchPlan, engine: str, *, tcp: bool) -> LaunchPlan:
    """`plan` with where the engine listens: a fresh socket in the user's 0700 socket folder unless the user asked
    for a TCP port (`tcp`) or the platform has no Unix sockets; a TCP port is checked free (or picked) here."""
    host = plan.host
    if unixhttp.is_socket_host(host):
        Path(host).unlink(missing_ok=True)  # a stale socket of ours: the engine's bind would fail on it
        return plan
    if plan.port == 0 and not tcp and unixhttp.supported() and host in _LOOPBACK:
        name = f"{engine.replace('.', '')}-{os.getpid()}-{next(_SOCKETS)}.sock"
        path = unixhttp.socket_dir(paths.run_dir()) / name
        path.unlink(missing_ok=True)
        return replace(plan, host=str(path))
    if host not in _LOOPBACK:
        log.warning("binding %s to non-loopback host %s at the user's request", engine, host)
    if not tcp and plan.api_key is None:  # TCP only because the platform has no sockets: a key
        plan = replace(plan, api_key=secrets.token_urlsafe(32))
    if plan.port == 0:
        return replace(plan, port=find_free_port(host))
    ensure_port_free(plan.port, host)
    return plan


def listens_on(pids: set[int], port: int) -> bool:
    """Whether one of `pids` holds a listening TCP socket on `port` (psutil, per process: cheap, and it sees
    only what those processes hold, so another user's listener can never count)."""
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            connections = proc.net_connections("inet") if hasattr(proc, "net_connections") else proc.connections("inet")
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in connections):
                return True
    return False


def listener_holds(spawned: SpawnedEngine | None, plan: LaunchPlan) -> bool:
    """Whether the engine's address is held by its own process tree now: the engine's own process first, where
    the listener is; on a socket, the peer pid where the system tells it (Linux, macOS)."""
    if spawned is None or spawned.proc.poll() is not None:  # exited: its port is anybody's
        return False
    path = plan.host if unixhttp.is_socket_host(plan.host) else None
    if path is None and listens_on({spawned.proc.pid}, plan.port):
        return True
    tree = {p.pid for p in proctree.members_of(spawned.recorded)}
    if path is not None:
        pid = unixhttp.peer_pid(path)
        return pid in tree if pid is not None else (
            sys.platform not in ("linux", "darwin") and os.path.exists(path))
    return listens_on(tree, plan.port)
