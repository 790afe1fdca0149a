"""Loopback ports: pick a free one, or say clearly who holds a busy one."""

from __future__ import annotations

import contextlib
import socket

import psutil

from desktop.core.common.errors import PortBusy

LOOPBACK = "127.0.0.1"


def find_free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def holder_of(port: int) -> str | None:
    """Best effort: 'pid 123 (llama-server)' for a listening socket on `port`."""
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                with contextlib.suppress(psutil.Error):
                    return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
                return f"pid {conn.pid}"
    return None


def ensure_port_free(port: int, host: str = LOOPBACK) -> None:
    if not 0 < port < 65536:
        raise PortBusy(f"port {port} is not a valid TCP port", "use a number between 1024 and 65535")
    if not port_is_free(port, host):
        holder = holder_of(port)
        raise PortBusy(
            f"port {port} on {host} is already in use{f' by {holder}' if holder else ''}",
            "pick another --port, or leave it out to use a free one",
        )
