"""The endpoint's defaults: they live in `desktop.core.common.defaults` (one module for every default); this name
stays for the proxy's imports."""

from __future__ import annotations

from desktop.core.common.defaults import (
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_FIRST_BYTE_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_PROXY_PORT,
    DEFAULT_WAIT_TIMEOUT,
)

__all__ = ["DEFAULT_DRAIN_TIMEOUT", "DEFAULT_FIRST_BYTE_TIMEOUT", "DEFAULT_IDLE_TIMEOUT", "DEFAULT_PROXY_PORT",
           "DEFAULT_WAIT_TIMEOUT"]
