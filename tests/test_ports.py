"""The free-port check binds like the listeners (a port in TIME-WAIT is free) and names who holds a busy one."""

from __future__ import annotations

import os
import socket
import sys

import psutil
import pytest

from desktop.core.common.errors import PortBusy
from desktop.core.runtime.ports import ensure_port_free, holder_of, port_is_free


def _time_wait_port() -> int:
    """A loopback port whose only trace is a server-side connection in TIME-WAIT: the listener closed first."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = int(listener.getsockname()[1])
        client = socket.create_connection(("127.0.0.1", port))
        served, _addr = listener.accept()
        served.close()  # the server closes first: its side goes through FIN-WAIT to TIME-WAIT
        client.recv(1)  # EOF: the client saw the FIN
        client.close()
    return port


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX SO_REUSEADDR semantics")
def test_a_port_in_time_wait_is_free_like_the_listener_finds_it() -> None:
    port = _time_wait_port()
    states = {c.status for c in psutil.net_connections(kind="tcp") if c.laddr and c.laddr.port == port}
    assert psutil.CONN_TIME_WAIT in states, states
    assert port_is_free(port)
    ensure_port_free(port)
    with socket.socket() as again:  # and a listener really binds it, as asyncio's server does
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))
        again.listen()


def test_a_busy_port_names_its_holder() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = int(holder.getsockname()[1])
        assert not port_is_free(port)
        assert holder_of(port) == f"pid {os.getpid()} ({psutil.Process().name()})"
        with pytest.raises(PortBusy, match=f"already in use by pid {os.getpid()}"):
            ensure_port_free(port)
