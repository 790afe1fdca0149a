"""The stable endpoint's defaults, in a module that imports nothing, so the CLI can show them in `--help` without
loading the proxy (which pulls in httpx, asyncio and the engines)."""

from __future__ import annotations

DEFAULT_PROXY_PORT = 8800
DEFAULT_WAIT_TIMEOUT = 600.0
