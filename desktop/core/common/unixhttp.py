"""Engines listen on Unix sockets, not TCP ports: how their addresses are written and how clients reach them.

An engine on a TCP port answers every local user and, through DNS rebinding or text/plain CSRF, web pages: vLLM
guards only `/v1*` with its key and sends CORS `*`. A Unix socket in a 0700 folder of this user (`socket_dir`) is
reachable by this user's processes only, and nobody else can bind its path first. So where the platform has them
(every POSIX system) engines are started on one: llama-server `--host PATH.sock`, vLLM `--uds PATH`. Where it
has not (Windows), engines stay on loopback TCP with the per-launch key, and the supervisor proves the listener
is the engine's before it sends anything (`desktop.core.runtime.supervisor`).

An engine's address is one string everywhere (the endpoint's upstream, telemetry, the load generator, history):
`http+unix://<percent-encoded socket path>` (the requests-unixsocket convention), or `http://127.0.0.1:PORT`.
`client`/`async_client` give an httpx client that reaches either; `http_url` is the plain URL to ask it for."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import httpx

SCHEME = "http+unix"
NOMINAL_HOST = "localhost"  # the Host header on a socket: the engines ignore it
SUN_PATH_MAX = 100  # sockaddr_un holds 104 (macOS) to 108 (Linux) bytes: leave room
_fallback_dir: Path | None = None


def supported() -> bool:
    """Whether engines can be put on Unix sockets here (not on Windows: vLLM does not run there, and
    llama-server's AF_UNIX support depends on the build)."""
    return os.name == "posix" and hasattr(socket, "AF_UNIX")


def is_socket_host(host: str) -> bool:
    """A LaunchPlan host that names a socket path (llama-server's own convention: ends in `.sock`)."""
    return host.endswith(".sock") and os.path.isabs(host)


def engine_url(host: str, port: int) -> str:
    """The base URL of an engine listening on `host` (a socket path, or an address with `port`)."""
    if is_socket_host(host):
        return f"{SCHEME}://{quote(host, safe='')}"
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def socket_of(url: str) -> str | None:
    """The socket path of an `http+unix://` URL, else None."""
    parts = urlsplit(url)
    return unquote(parts.netloc) if parts.scheme == SCHEME else None


def http_url(url: str) -> str:
    """The URL to ask an httpx client from `client(url)` for: `http+unix://SOCK/p` becomes `http://localhost/p`."""
    parts = urlsplit(url)
    if parts.scheme != SCHEME:
        return url
    rest = url[len(SCHEME) + 3 + len(parts.netloc):]
    return f"http://{NOMINAL_HOST}{rest}"


def describe(url: str) -> str:
    """For people: `unix:/path/x.sock` or the URL itself."""
    path = socket_of(url)
    return f"unix:{path}" if path is not None else url


def transport(url: str, **options: Any) -> httpx.HTTPTransport | None:
    """The httpx transport that reaches `url`'s socket (None for a TCP URL: httpx's default)."""
    path = socket_of(url)
    return httpx.HTTPTransport(uds=path, **options) if path is not None else None


def async_transport(url: str, **options: Any) -> httpx.AsyncHTTPTransport | None:
    path = socket_of(url)
    return httpx.AsyncHTTPTransport(uds=path, **options) if path is not None else None


def client(url: str, **options: Any) -> httpx.Client:
    """An httpx.Client that reaches `url` (socket or TCP), never through an environment proxy. `limits` and
    `verify` go to the transport where one is needed (httpx ignores the client's own then)."""
    options.setdefault("trust_env", False)
    moved = {k: options.pop(k) for k in ("limits", "verify") if k in options} if socket_of(url) else {}
    sock = transport(url, **moved)
    return httpx.Client(transport=sock, **options) if sock is not None else httpx.Client(**options)


def async_client(url: str, **options: Any) -> httpx.AsyncClient:
    options.setdefault("trust_env", False)
    moved = {k: options.pop(k) for k in ("limits", "verify") if k in options} if socket_of(url) else {}
    sock = async_transport(url, **moved)
    return httpx.AsyncClient(transport=sock, **options) if sock is not None else httpx.AsyncClient(**options)


def _private_folder(path: Path) -> bool:
    """`path` is a real folder (not a link) of this user that nobody else can enter or write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not stat.S_IMODE(st.st_mode) & 0o077


def socket_dir(run_dir: Path) -> Path:
    """The 0700 folder of this user where engine sockets go: `run_dir/sock`, or, when that path is too long for
    a socket address (a deep home folder), a private folder under the temp dir (created 0700 and checked: a
    folder another user planted there is never used)."""
    from desktop.core.common.private import private_dir

    preferred = private_dir(run_dir / "sock")
    if len(os.fsencode(preferred)) + 40 <= SUN_PATH_MAX and _private_folder(preferred):
        return preferred
    global _fallback_dir
    if _fallback_dir is not None and _private_folder(_fallback_dir):
        return _fallback_dir
    stable = Path(tempfile.gettempdir()) / f"switchyard-{os.getuid()}"
    with contextlib.suppress(OSError):
        stable.mkdir(mode=0o700)
    _fallback_dir = stable if _private_folder(stable) else Path(tempfile.mkdtemp(prefix="switchyard-"))
    return _fallback_dir


def listener_summary(run_dir: Path) -> str:
    """How engines listen on this machine, for `switchyard engines doctor`."""
    if supported():
        return (f"a Unix socket in {socket_dir(run_dir)} (0700): no TCP port, only this user can connect; "
                "TCP only where you ask for an engine port (plain `serve`, `serve --port`), with a per-launch key")
    return ("loopback TCP with a per-launch API key (this platform has no Unix sockets for the engines); the "
            "listener is checked to be the engine's own process before anything is sent to it")


def peer_pid(path: str, timeout: float = 1.0) -> int | None:
    """The pid of the process listening on the socket `path` (SO_PEERCRED on Linux, LOCAL_PEERPID on macOS),
    or None when it cannot be told or nobody listens."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            if sys.platform.startswith("linux"):
                raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                return int(struct.unpack("3i", raw)[0])
            if sys.platform == "darwin":
                raw = sock.getsockopt(0, 0x002, struct.calcsize("i"))  # SOL_LOCAL, LOCAL_PEERPID
                return int(struct.unpack("i", raw)[0])
    except OSError:
        return None
    return None
