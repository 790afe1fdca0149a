"""Whether the context an endpoint serves is enough for an agent, and, where it is not, the largest one the fit
allows for the model on this machine (so `launch` can offer it), or that the model's own window is too small.

The largest context is found by bisection over the planner's own check (planning.planner.plan_launch: the same
fit every launch goes through), not by a formula of its own."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from desktop.core.agents.clients import Agent
from desktop.core.common.errors import SwitchyardError

STEP = 1024  # contexts are offered in whole KiB of tokens


@dataclass(frozen=True)
class ContextVerdict:
    enough: bool
    served: int
    needed: int
    window: int | None  # the model's trained window, where known
    largest: int | None  # the most the fit allows per request (None: not worked out, or nothing fits)
    message: str  # empty when enough


def largest_context(engine: str, model: str, hardware: Any, slots: int, window: int,
                    model_path: Path | None = None, facts: Any = None) -> int | None:
    """The largest context per request, in steps of STEP up to the model's window, whose plan the fit accepts
    with `slots` requests at once; None when not even STEP fits."""
    from desktop.core.planning.planner import plan_launch

    def fits(ctx: int) -> bool:
        try:
            plan_launch(engine, model, hardware, {"ctx_per_request": ctx, "slots": slots}, model_path=model_path,
                        facts=facts)
        except SwitchyardError:
            return False
        return True

    low, high = 0, window // STEP  # in steps; low fits (0: nothing yet), high is the window
    if fits(window):
        return window
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid * STEP):
            low = mid
        else:
            high = mid
    return low * STEP or None


def judge(agent: Agent, served: int, model_label: str, window: int | None, largest: int | None) -> ContextVerdict:
    """Enough, or the one paragraph that says why not and what to do."""
    need = agent.context_needed
    if served >= need:
        return ContextVerdict(True, served, need, window, largest, "")
    said = (f"the context is too small for {agent.title}: {model_label} is served with a context of {served:,} "
            f"tokens per request, and {agent.title} needs about {need:,} ({agent.why}).")
    if window is not None and window < need:
        said += (f" The model's own window is {window:,} tokens, so no setting makes it fit: choose a model "
                 f"with a window of {need:,} tokens or more.")
    elif largest is not None and largest >= need:
        said += f" This machine fits up to {largest:,} tokens per request for this model."
    elif largest is not None:
        said += (f" This machine fits at most {largest:,} tokens for this model: a smaller quantization or a "
                 f"smaller model leaves room for more.")
    return ContextVerdict(False, served, need, window, largest, said)
