"""The stable endpoint's defaults, in a module that imports nothing, so the CLI can show them in `--help` without
loading the proxy (which pulls in httpx, asyncio and the engines)."""

from __future__ import annotations

DEFAULT_PROXY_PORT = 8800
DEFAULT_WAIT_TIMEOUT = 600.0
# How long a switch lets requests on the old engine finish before ending them with a retryable error: long enough
# for a long answer on a busy CPU box (streams caught at a switch took up to ~330 s there), and a bound all the same.
# One deadline for the endpoint, the fleet and the CLI.
DEFAULT_DRAIN_TIMEOUT = 300.0
# How long the endpoint waits on an engine: for the first response byte (bounds a whole non-streamed generation on
# a slow CPU) and for the longest silence once the answer started (see serving.upstream.Timeouts).
DEFAULT_FIRST_BYTE_TIMEOUT = 600.0
DEFAULT_IDLE_TIMEOUT = 300.0
