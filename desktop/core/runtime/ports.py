"""Loopback ports: pick a free one, or say clearly who holds a busy one.

"Free" means what the listeners will find: asyncio's servers and the engines (cpp-httplib, uvicorn) bind with
SO_REUSEADDR on POSIX, so a port whose last connection lingers in TIME-WAIT after a restart is free to them and
is free here too (checking without it made a restart on the same port fail for a minute)."""

from __future__ import annotations

import contextlib
import os
import socket

import psutil

from desktop.core.common.errors import PortBusy

LOOPBACK = "127.0.0.1"


def find_free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether a listener could bind `port` now, binding the way the listeners do."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        if os.name == "posix":  # on Windows SO_REUSEADDR would let a bind steal a port in use: not what they do
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _describe(pid: int) -> str:
    with contextlib.suppress(psutil.Error):
        return f"pid {pid} ({psutil.Process(pid).name()})"
    return f"pid {pid}"


def holder_of(port: int) -> str | None:
    """Best effort: 'pid 123 (llama-server)' for the process holding `port`: its listener, else any socket bound
    to it; None when no visible process holds it (another user's, without the rights to see it)."""
    bound: int | None = None
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="tcp"):
            if not (conn.laddr and conn.laddr.port == port and conn.pid):
                continue
            if conn.status == psutil.CONN_LISTEN:
                return _describe(conn.pid)
            bound = bound or conn.pid
    return _describe(bound) if bound else None


def ensure_port_free(port: int, host: str = LOOPBACK) -> None:
    if not 0 < port < 65536:
        raise PortBusy(f"port {port} is not a valid TCP port", "use a number between 1024 and 65535")
    if not port_is_free(port, host):
        holder = holder_of(port)
        raise PortBusy(
            f"port {port} on {host} is already in use "
            f"{f'by {holder}' if holder else 'by a process this user cannot see (another user or the system)'}",
            "pick another --port, or leave it out to use a free one",
        )
