"""Which `Host` and `Origin` a local server answers: the one rule shared by the endpoint (which enforces it) and
the settings/CLI (which validate the origins a user allows).

Why: a server on 127.0.0.1 is reachable from every web page the user opens. A page may POST to it (the browser
sends an `Origin` that is not local) and, through DNS rebinding, read the answers (the browser then sends a `Host`
that is the attacker's name). Refusing both unless the user allowed the origin is what Ollama does with
OLLAMA_ORIGINS.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

from desktop.core.common.errors import SwitchyardError

ANY_ORIGIN = "*"
_PORT = re.compile(r"\d{1,5}")


def is_loopback_name(name: str) -> bool:
    """localhost, *.localhost (RFC 6761: always loopback), 127.0.0.0/8 or ::1."""
    name = name.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_loopback_host(host: str) -> bool:
    """A `Host` header value (name or address, IPv6 in brackets, optional port) that names this machine."""
    host = host.strip()
    if host.startswith("["):
        name, bracket, port = host[1:].partition("]")
        if not bracket or (port and not (port.startswith(":") and _PORT.fullmatch(port[1:]))):
            return False
    else:
        name, colon, port = host.partition(":")
        if colon and not _PORT.fullmatch(port):
            return False
    return bool(name) and is_loopback_name(name)


def normalize_origin(origin: str) -> str | None:
    """`scheme://host[:port]` in lower case, or None when `origin` is not one (e.g. "null", a path)."""
    origin = origin.strip().lower()
    try:
        parts = urlsplit(origin)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") \
            or parts.query or parts.fragment or parts.username or parts.password:
        return None
    return f"{parts.scheme}://{parts.netloc}"


def is_local_origin(origin: str) -> bool:
    """http(s)://localhost|127.x|[::1][:port]: a page served from this machine."""
    normalized = normalize_origin(origin)
    return normalized is not None and is_loopback_name(urlsplit(normalized).hostname or "")


def parse_allowed_origins(values: Iterable[str]) -> tuple[str, ...]:
    """The origins a user allows, normalized; `*` allows every origin. SwitchyardError names a bad entry."""
    allowed: list[str] = []
    for raw in values:
        for value in (part.strip() for part in raw.split(",")):
            if not value:
                continue
            normalized = ANY_ORIGIN if value == ANY_ORIGIN else normalize_origin(value)
            if normalized is None:
                raise SwitchyardError(f"'{value}' is not an origin",
                                      "write origins as scheme://host[:port], e.g. http://192.168.1.5:3000, "
                                      "or * for any")
            if normalized not in allowed:
                allowed.append(normalized)
    return tuple(allowed)
