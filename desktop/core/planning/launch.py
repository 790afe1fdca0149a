"""From a checked plan to the command that would run: the exact argv and environment next to the fit's memory
breakdown (`serve --dry-run`, `recommend --json`), and the one refusal of a plan that does not fit."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines import get_adapter
from desktop.core.engines.base import CommandLine, EngineInstall, LaunchPlan
from desktop.core.planning.fit import FitResult

SECRET_ENV = ("LLAMA_API_KEY", "VLLM_API_KEY")


class PlanRefused(SwitchyardError):
    """A launch the planner will not start: it does not fit, or it asks one engine for another's setting."""


def planned_command(plan: LaunchPlan, install: EngineInstall | None = None) -> CommandLine:
    """The argv and environment `plan` starts with: the installed engine's, or a stand-in executable name when
    the engine is not installed yet (a dry run installs nothing)."""
    adapter = get_adapter(plan.engine)
    if install is None:
        install = adapter.find_install() or EngineInstall(adapter.name, "not installed", "dry-run",
                                                          Path(adapter.dry_run_executable))
    return adapter.build_command(plan, install)


def require_fit(result: FitResult, model: str) -> LaunchPlan:
    """The checked plan, or one clear error with the fix when it does not fit (nothing is started)."""
    if result.plan is None:
        raise SwitchyardError("the fit returned no plan", "report this as a bug")
    if result.fits == "no":
        why = result.notes[-1] if result.notes else "not enough memory"
        util = re.search(r"lower gpu_memory_utilization to ([\d.]+)", why)
        hint = (f"pass --util {util.group(1)}, or free GPU memory" if util else
                "lower --ctx or --parallel, pick a smaller quantization, or ask `switchyard recommend` for a plan "
                "that fits")
        raise PlanRefused(
            f"{model} does not fit with {result.engine} on {result.device}: needs {result.total_gib:.1f} GiB, "
            f"{result.available_gib:.1f} GiB available ({why})", hint)
    return result.plan


def describe(result: FitResult, install: EngineInstall | None = None) -> dict[str, Any]:
    """What would run and why it fits: the plan, its argv and env (secrets masked), and the memory breakdown."""
    if result.plan is None:
        raise SwitchyardError("the fit returned no plan", "report this as a bug")
    command = planned_command(result.plan, install)
    env = {k: ("***" if k in SECRET_ENV else v) for k, v in command.env.items()}
    fit = result.to_json()
    fit.pop("plan", None)
    return {"plan": result.plan.to_json(), "argv": command.argv, "env": env, "fit": fit}
