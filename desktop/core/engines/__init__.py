"""Engine adapters behind one interface. Adding an engine = one module here plus its tests, registered below:
its name, aliases and display name then reach `serve`, `ab`, the fit and the GUI's engine lists from here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from desktop.core.common.errors import EngineNotInstalled, SwitchyardError
from desktop.core.common.progress import ProgressCallback, ProgressEvent, no_progress
from desktop.core.engines.base import EngineAdapter, EngineInstall, LaunchPlan
from desktop.core.engines.llamacpp import LlamaCppAdapter
from desktop.core.engines.runtimes import BuildChoice
from desktop.core.engines.vllm import VllmAdapter
from desktop.core.machine.hardware import HardwareSnapshot

ADAPTERS: dict[str, EngineAdapter] = {}


def register(adapter: EngineAdapter) -> EngineAdapter:
    """Add an engine: the one place its name and spellings become known (tests register a fake one here)."""
    ADAPTERS[adapter.name] = adapter
    return adapter


def unregister(name: str) -> None:
    ADAPTERS.pop(name, None)


for _adapter in (LlamaCppAdapter(), VllmAdapter()):
    register(_adapter)


def get_adapter(name: str) -> EngineAdapter:
    """The adapter for an engine name (its aliases accepted, any case, spaces ignored); a clear error otherwise."""
    key = name.strip().lower()
    for adapter in ADAPTERS.values():
        if key == adapter.name.lower() or key in adapter.aliases:
            return adapter
    raise SwitchyardError(f"unknown engine '{name}'", f"choose one of: {', '.join(ADAPTERS)}")


def engine_names() -> list[str]:
    return list(ADAPTERS)


def require_install(adapter: EngineAdapter, *, install_missing: bool = False, what: str = "",
                    progress: ProgressCallback = no_progress) -> EngineInstall:
    """The engine's install, or (with `install_missing`) install it once, cached; else the error naming the
    install command. The one copy of "install or fail" (serve, the endpoint, the fleet, bench, ab, the GUI)."""
    install = adapter.find_install()
    if install is not None:
        return install
    if not install_missing:
        raise EngineNotInstalled(f"{adapter.display_name}{what} is not installed",
                                 f"run `switchyard engines install {adapter.name}` first")
    progress(ProgressEvent(f"{adapter.display_name} is not installed yet: installing it (once, cached)"))
    return adapter.install(progress)


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


__all__ = ["ADAPTERS", "EngineAdapter", "EngineBuild", "EngineInstall", "LaunchPlan", "engine_builds", "engine_names",
           "get_adapter", "register", "require_install", "unregister"]
