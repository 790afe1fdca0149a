"""Every default a launch and the endpoint use, in one module that imports nothing: the CLI shows them in `--help`
without loading the proxy (which pulls in httpx, asyncio and the engines), and the plan, the fit, the endpoint,
the fleet, bench, the A/B and the GUI read them from here instead of repeating the numbers."""

from __future__ import annotations

# --- a launch plan -----------------------------------------------------------------------------------------
DEFAULT_CTX_PER_REQUEST = 2048  # tokens one request may use (vLLM --max-model-len; llama.cpp -c is this x slots)
DEFAULT_SLOTS = 4  # requests served at once (llama.cpp --parallel, vLLM --max-num-seqs)
SERVED_MODEL_NAME = "switchyard"  # the model name clients see, at the endpoint and at the engine
DEFAULT_VLLM_UTILIZATION = 0.9  # vLLM's own --gpu-memory-utilization default
DEFAULT_VLLM_CPU_KV_GIB = 4  # VLLM_CPU_KVCACHE_SPACE the fit assumes (and the plan then sets) when none is given
# How long an engine may take from spawn until it answers a first real request (a cold vLLM with torch.compile
# on a busy CPU box takes minutes).
DEFAULT_READY_TIMEOUT = 900.0

# --- the stable endpoint -----------------------------------------------------------------------------------
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
