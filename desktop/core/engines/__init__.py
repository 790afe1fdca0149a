"""Engine adapters behind one interface. Adding an engine = one module here plus its tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.base import EngineAdapter, EngineInstall, LaunchPlan
from desktop.core.engines.llamacpp import LlamaCppAdapter
from desktop.core.engines.runtimes import BuildChoice
from desktop.core.engines.vllm import VllmAdapter
from desktop.core.machine.hardware import HardwareSnapshot

ADAPTERS: dict[str, EngineAdapter] = {adapter.name: adapter for adapter in (LlamaCppAdapter(), VllmAdapter())}
ALIASES = {"llamacpp": "llama.cpp", "llama-cpp": "llama.cpp", "llama": "llama.cpp", "llama-server": "llama.cpp"}


def get_adapter(name: str) -> EngineAdapter:
    """The adapter for an engine name (a few spellings accepted); a clear error for anything else."""
    key = ALIASES.get(name.lower(), name.lower())
    try:
        return ADAPTERS[key]
    except KeyError:
        raise SwitchyardError(f"unknown engine '{name}'", f"choose one of: {', '.join(ADAPTERS)}") from None


@dataclass(frozen=True)
class EngineBuild:
    """One engine on one machine: the build it should run (or why it cannot run), what is installed, and
    whether the installed build wastes the GPU. What `engines list` and the GUI's Machine page show."""

    engine: str
    display_name: str
    build: BuildChoice | None
    blocker: str | None
    fix: str | None
    install: EngineInstall | None

    @property
    def installed_variant(self) -> str | None:
        return self.install.details.get("backend") if self.install else None

    @property
    def warning(self) -> str | None:
        """Set when the installed build is CPU-only but this machine should run a GPU build."""
        if self.build is None or self.installed_variant != "cpu" or not self.build.offloads:
            return None
        return (f"the installed {self.display_name} is a CPU-only build; this machine should run the "
                f"{self.build.variant} build ({self.build.reason})")

    @property
    def warning_fix(self) -> str | None:
        return f"switchyard engines install {self.engine} --variant {self.build.variant}" if self.warning and \
            self.build else None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.engine,
            "display_name": self.display_name,
            "supported": self.build is not None,
            "build": ({"ok": True, **self.build.to_json()} if self.build else
                      {"ok": False, "engine": self.engine, "reason": self.blocker, "fix": self.fix}),
            "installed": self.install is not None,
            "installed_variant": self.installed_variant,
            "install": self.install.to_json() if self.install else None,
            "warning": self.warning,
            "warning_fix": self.warning_fix,
        }


def engine_builds(hardware: HardwareSnapshot) -> list[EngineBuild]:
    """Every engine's build for `hardware`, with what is installed here (cheap: no downloads, no builds)."""
    rows = []
    for adapter in ADAPTERS.values():
        try:
            build: BuildChoice | None = adapter.install_plan(hardware)
            blocker = fix = None
        except SwitchyardError as exc:
            build, blocker, fix = None, exc.message, exc.hint
        rows.append(EngineBuild(adapter.name, adapter.display_name, build, blocker, fix, adapter.find_install()))
    return rows


__all__ = ["ADAPTERS", "EngineAdapter", "EngineBuild", "EngineInstall", "LaunchPlan", "engine_builds", "get_adapter"]
