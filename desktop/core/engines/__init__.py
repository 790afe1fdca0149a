"""Engine adapters behind one interface. Adding an engine = one module here plus its tests."""

from __future__ import annotations

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.base import EngineAdapter, EngineInstall, LaunchPlan
from desktop.core.engines.llamacpp import LlamaCppAdapter
from desktop.core.engines.vllm import VllmAdapter

ADAPTERS: dict[str, EngineAdapter] = {adapter.name: adapter for adapter in (LlamaCppAdapter(), VllmAdapter())}
ALIASES = {"llamacpp": "llama.cpp", "llama-cpp": "llama.cpp", "llama": "llama.cpp", "llama-server": "llama.cpp"}


def get_adapter(name: str) -> EngineAdapter:
    """The adapter for an engine name (a few spellings accepted); a clear error for anything else."""
    key = ALIASES.get(name.lower(), name.lower())
    try:
        return ADAPTERS[key]
    except KeyError:
        raise SwitchyardError(f"unknown engine '{name}'", f"choose one of: {', '.join(ADAPTERS)}") from None


__all__ = ["ADAPTERS", "EngineAdapter", "EngineInstall", "LaunchPlan", "get_adapter"]
