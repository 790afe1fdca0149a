"""The hybrid policy behind `serve --engine auto`: start on llama.cpp (its fast cold start serves the first
requests), bring vLLM in only when this machine's measurements say it pays, hand back when the load goes.

Pure: numbers in, one `Decision` out (an event with a reason a person can check). Inputs are the crossover from
this machine's history (`planning.crossover`, defaults where nothing was measured), the in-flight samples of the
last minutes, the expected remaining service time, and whether both engines fit at once.

The arithmetic, at the sustained load c (in-flight p95 over the window) where vLLM serves tb tokens/s and
llama.cpp ta < tb, with vLLM's cold start C:
- both fit: vLLM loads in the background while llama.cpp serves; the price is what the loading engine takes
  from the serving one (`co_resident_cost`, a fraction of ta; default 0.2, not measured: a vLLM compiling on a
  2-core box takes both cores; an *idle* second llama-server measured 0.98-1.07x of a c=32 run alone on this
  project's 2-core machine, benchmarks/results/autopilot/). Paid back after C + ta*C*cost / (tb - ta).
- only one fits: stop-first, nothing serves for about C seconds (the expected gap, shown before it happens):
  paid back after C + ta*C / (tb - ta).
vLLM is brought in only when the expected remaining service time exceeds that payback. Where llama.cpp measures
faster at every concurrency (a CPU, typically), it stays on llama.cpp and says why.

The live endpoint acts on it (`serving.autopilot`: start llama.cpp, start vLLM in the background, hand over
with drain, retire after idle); this module only decides.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from desktop.core.planning.basis import crossover_at, ends_with_action, faster_everywhere, named_basis
from desktop.core.planning.crossover import Crossover

Action = Literal["stay", "watch", "start_standby", "switch_stop_first", "hand_over", "retire"]
DEFAULT_WINDOW_S = 300.0  # sustained load: in-flight p95 over the last 5 minutes
DEFAULT_IDLE_S = 600.0  # vLLM is retired after 10 minutes without load above the crossover
DEFAULT_CO_RESIDENT_COST = 0.2  # share of the serving engine's throughput a loading/idle second engine takes
RETIRE_BELOW = 0.5  # hysteresis: hand back only when the load falls to half the crossover (or to nothing)
COVERED_SLACK_S = 1e-6  # a window's spans sum to its length only up to float rounding (wall-clock times)


@dataclass(frozen=True)
class PolicyInputs:
    now: float
    crossover: Crossover  # base: llama.cpp, other: vLLM
    inflight: Sequence[tuple[float, float]]  # (time, requests in flight) samples, oldest first
    expected_remaining_s: float | None  # how much longer the service is expected to run (None: unknown)
    both_fit: bool  # the fit says llama.cpp and vLLM fit at the same time
    active: str = "llama.cpp"  # the engine serving now
    vllm_state: Literal["off", "starting", "ready"] = "off"  # ready: loaded, not serving yet (or serving)
    window_s: float = DEFAULT_WINDOW_S
    idle_s: float = DEFAULT_IDLE_S
    co_resident_cost: float = DEFAULT_CO_RESIDENT_COST


@dataclass(frozen=True)
class Decision:
    """What the policy decided and why; an event for the request log, `status --json` and the Serve page."""

    action: Action
    reason: str
    t: float = field(default_factory=time.time)
    numbers: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "autopilot", "action": self.action, "reason": self.reason, "t": self.t,
                "numbers": dict(self.numbers)}


def sustained_load(samples: Sequence[tuple[float, float]], now: float, window_s: float) -> tuple[float, float]:
    """(in-flight p95, seconds of the window the samples cover), time-weighted: each sample holds until the next."""
    inside = [(t, v) for t, v in samples if now - window_s <= t <= now]
    before = [(t, v) for t, v in samples if t < now - window_s]
    if before:  # the level in force when the window opened
        inside.insert(0, (now - window_s, before[-1][1]))
    if not inside:
        return 0.0, 0.0
    spans = []
    for (t0, v0), (t1, _) in zip(inside, [*inside[1:], (now, 0.0)], strict=True):
        spans.append((v0, max(0.0, t1 - t0)))
    total = sum(d for _, d in spans)
    if total <= 0:
        return float(inside[-1][1]), 0.0
    acc = 0.0
    for value, dur in sorted(spans):
        acc += dur
        if acc >= 0.95 * total - 1e-12:
            return float(value), total
    return float(max(v for v, _ in spans)), total


def _minutes(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def decide(inputs: PolicyInputs) -> Decision:
    """The next step for the hybrid endpoint."""
    x = inputs.crossover
    vllm = x.curve("vllm") or x.curve(x.other)
    llama = x.curve("llama.cpp") or x.curve(x.base)
    load, covered = sustained_load(inputs.inflight, inputs.now, inputs.window_s)
    numbers: dict[str, Any] = {"inflight_p95": load, "window_s": inputs.window_s, "covered_s": round(covered, 1),
                               "crossover": x.crossover_concurrency, "both_fit": inputs.both_fit,
                               "expected_remaining_s": inputs.expected_remaining_s}
    window = _minutes(inputs.window_s)
    tags = [(c.engine, c.tag) for c in x.curves]  # where the curves, and so the crossover, come from

    def made(action: Action, reason: str, **extra: Any) -> Decision:
        return Decision(action, reason, inputs.now, {**numbers, **extra})

    if x.crossover_concurrency is None or vllm is None or llama is None:
        levels = [p.concurrency for p in (llama.points if llama else ())]
        if inputs.active != "llama.cpp":
            return made("retire", faster_everywhere("llama.cpp", "vLLM", levels, tags, "handing back to llama.cpp"))
        return made("stay", faster_everywhere("llama.cpp", "vLLM", levels, tags,
                                              "vLLM never pays back on this machine, staying on llama.cpp"))
    cross = x.crossover_concurrency
    crossing = crossover_at(cross, tags)  # "crossover 4 (measured here on DATE)": the figure and its basis
    on_vllm = inputs.active == "vllm"
    if on_vllm:
        idle, idle_cov = sustained_load(inputs.inflight, inputs.now, inputs.idle_s)
        numbers["idle_window_p95"] = idle
        if idle_cov >= inputs.idle_s - COVERED_SLACK_S and idle <= cross * RETIRE_BELOW:
            return made("retire", f"in-flight p95 {idle:g} over {_minutes(inputs.idle_s)} <= {RETIRE_BELOW:g} x "
                                  f"{crossing}: retiring vLLM, llama.cpp serves")
        return made("stay", f"in-flight p95 {idle:g} over {_minutes(inputs.idle_s)}: vLLM keeps serving")
    if inputs.vllm_state == "ready":
        return made("hand_over", f"vLLM is ready: handing over (in-flight requests on llama.cpp drain), in-flight "
                                 f"p95 {load:g} over {window} > {crossing}")
    if inputs.vllm_state == "starting":
        return made("watch", "vLLM is starting in the background; llama.cpp serves meanwhile")
    if covered < inputs.window_s - COVERED_SLACK_S:
        return made("watch", f"watching the load: {_minutes(covered)} of the {window} window seen, in-flight p95 "
                             f"{load:g} so far ({crossing})")
    if load <= cross:
        return made("stay", ends_with_action(f"in-flight p95 {load:g} over {window} <= {crossing}: llama.cpp "
                                             "serves this load at least as fast", tags))
    ta, tb = llama.at(load), vllm.at(load)
    cold = vllm.cold_start_s
    numbers.update(llama_tok_s=ta, vllm_tok_s=tb, vllm_cold_start_s=cold, cold_start_tag=vllm.cold_start_tag)
    if ta is None or tb is None or tb <= ta or cold is None:
        return made("stay", f"in-flight p95 {load:g} over {window} > {crossing}, but vLLM is not faster "
                            "at this load by the curves: staying on llama.cpp")
    lost_share = inputs.co_resident_cost if inputs.both_fit else 1.0
    payback = cold + ta * cold * lost_share / (tb - ta)
    numbers.update(payback_s=round(payback, 1), lost_share=lost_share)
    head = f"in-flight p95 {load:g} over {window} > {crossing}"
    cold_basis = named_basis("its cold start", vllm.cold_start_tag)  # "its cold start measured here on DATE"
    figures = [*tags, ("vllm cold start", vllm.cold_start_tag)]
    remaining = inputs.expected_remaining_s
    if remaining is not None and remaining < payback:
        return made("stay", ends_with_action(
            f"{head}, but the service is expected to end in {_minutes(remaining)}, before vLLM's cold start "
            f"{cold:.0f} s pays back ({_minutes(payback)}; {cold_basis}): staying on llama.cpp", figures))
    pays = f"vLLM cold start {cold:.0f} s pays back in {_minutes(payback)} ({cold_basis})"
    if inputs.both_fit:
        return made("start_standby", ends_with_action(f"{head}; {pays}: starting vLLM in the background (both fit)",
                                                      figures))
    return made("switch_stop_first", ends_with_action(
        f"{head}; {pays}; only one engine fits: stop-first, no engine serves for about {cold:.0f} s (requests wait "
        "at the endpoint)", figures), expected_gap_s=cold)


__all__ = ["Decision", "PolicyInputs", "decide", "sustained_load"]
