"""The hybrid endpoint live (`serve --engine auto`): llama.cpp serves at once, a small loop watches the requests in
flight, asks the hybrid policy (`planning.autopilot.decide`) what to do, and does it with the manager's own
switching: vLLM starts in the background as the warm standby, takes over when it serves (in-flight requests on
llama.cpp drain), or, where only one engine fits, a stop-first switch; after the idle window vLLM is retired and
llama.cpp serves again.

The in-flight level is exact, not polled: the proxy tells the loop of every request as it arrives and as it
finishes (a set add/discard on the endpoint's loop), so the level's history is a step function the policy reads
time-weighted. Every decision whose action changes (and every failed action) is kept: in `status()` (the control
channel's `status --json`, the Serve page) and in the request log's events (`switchyard requests`, history).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from desktop.core.common.errors import SwitchyardError
from desktop.core.common.progress import ProgressCallback, no_progress
from desktop.core.engines.base import COMMON_PLAN_FIELDS, LaunchPlan
from desktop.core.engines.pooling import args_kind
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.planning.autopilot import (
    DEFAULT_CO_RESIDENT_COST,
    DEFAULT_IDLE_S,
    DEFAULT_WINDOW_S,
    Decision,
    PolicyInputs,
    decide,
)
from desktop.core.planning.crossover import Crossover, CurvePoint, EngineCurve, crossover, curves_from_history
from desktop.core.planning.planner import Checked, plan_launch, replan
from desktop.core.runtime.supervisor import EngineState
from desktop.core.serving.budget import MemoryBudget
from desktop.core.serving.metering import RequestRecord

if TYPE_CHECKING:
    from desktop.core.serving.endpoint import EndpointManager
    from desktop.core.serving.managed import ManagedEngine

log = logging.getLogger("switchyard.autopilot")

BASE, OTHER = "llama.cpp", "vllm"
# the engine each switching action moves toward: a failure waits out the retry period in that direction only
TOWARD = {"start_standby": OTHER, "switch_stop_first": OTHER, "hand_over": OTHER, "retire": BASE}
DEFAULT_TICK_S = 1.0
DEFAULT_RETRY_AFTER_S = 600.0  # a vLLM that failed to start is not tried again for this long
KEEP_DECISIONS = 50

Journal = Callable[[dict[str, Any]], None]  # where decisions go besides status (the request log's events)


@dataclass(frozen=True)
class AutopilotSettings:
    """The thresholds a person (or a test, or a demo) can set; defaults are the policy's."""

    window_s: float = DEFAULT_WINDOW_S  # sustained load: in-flight p95 over this window
    idle_s: float = DEFAULT_IDLE_S  # vLLM is retired after this long at low load
    tick_s: float = DEFAULT_TICK_S  # how often the loop decides
    crossover: float | None = None  # forced crossover concurrency (tests, demos); None: this machine's history
    lifetime_s: float | None = None  # how long this service is expected to run (None: unknown)
    retry_after_s: float = DEFAULT_RETRY_AFTER_S
    co_resident_cost: float = DEFAULT_CO_RESIDENT_COST

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def forced_crossover(at: float, cold_start_s: float | None, cold_start_tag: str | None = None) -> Crossover:
    """A crossover at concurrency `at` by construction (--auto-crossover): llama.cpp flat, vLLM half as fast at 1,
    level at `at`, 4x at the top; vLLM's cold start as measured (or the default), tagged as its curve was (None:
    the forced tag, a figure the caller chose)."""
    tag = f"forced (--auto-crossover {at:g})"
    level = max(1, round(at))
    top = max(64, 2 * level)
    llama = EngineCurve(BASE, (CurvePoint(1, 1.0), CurvePoint(top, 1.0)), tag, relative=True)
    points = (CurvePoint(1, 1.01), CurvePoint(top, 4.0)) if level <= 1 else \
        (CurvePoint(1, 0.5), CurvePoint(level, 1.0), CurvePoint(top, 4.0))
    vllm = EngineCurve(OTHER, points, tag, cold_start_s, cold_start_tag or tag, relative=True)
    return crossover([llama, vllm])


def machine_crossover(runs: Iterable[Any], model: str, hardware: HardwareSnapshot, forced: float | None = None
                      ) -> Crossover:
    """This machine's crossover for `model` from history (defaults where nothing was measured), or a forced one
    (keeping vLLM's measured or default cold start)."""
    curves = curves_from_history(list(runs), model, cpu=not hardware.cuda_gpus)
    if forced is not None:
        vllm = next((c for c in curves if c.engine == OTHER), None)
        return forced_crossover(forced, vllm.cold_start_s if vllm else None, vllm.cold_start_tag if vllm else None)
    return crossover(curves)


def both_fit(plans: list[LaunchPlan], budget: MemoryBudget | None, hardware: HardwareSnapshot) -> bool:
    """Whether the two checked plans fit at once: the endpoint's budget (free VRAM), else the machine's RAM."""
    return (budget or ram_budget(hardware)).fits(plans)


def ram_budget(hardware: HardwareSnapshot) -> MemoryBudget:
    """A CPU machine's shared memory: the engines' RAM needs (from the fit) against the RAM available."""
    return MemoryBudget(float(hardware.ram_available_bytes), hardware=hardware, label="RAM")


class Autopilot:
    """The hybrid endpoint's loop over one EndpointManager. `start()` after the first engine serves; `stop()`
    before the manager closes (its close() does). `other_plan` None: one engine was refused by the planner
    (`refused` says why, `only` is the one that serves), and the loop only says so."""

    def __init__(self, manager: EndpointManager, crossover_: Crossover, other_plan: LaunchPlan | None, *,
                 both_fit: bool, settings: AutopilotSettings | None = None, journal: Journal | None = None,
                 refused: str | None = None, only: str | None = None, clock: Callable[[], float] = time.time
                 ) -> None:
        self.manager = manager
        self.crossover = crossover_
        self.other_plan = other_plan
        self.first_plan: LaunchPlan | None = None  # the plan it starts on (build_autopilot), for the status tables
        self.both_fit = both_fit
        self.settings = settings or AutopilotSettings()
        self.journal = journal
        self.refused = refused
        self.only = only or BASE  # with no other plan: the one engine that serves
        self.clock = clock
        self.started_at = clock()
        self.last: Decision | None = None
        self.decisions: deque[Decision] = deque(maxlen=KEEP_DECISIONS)
        self.state = "off"
        self._lock = threading.Lock()
        self._life = threading.Lock()  # start() and stop() one at a time (a Stop may come while it starts)
        self._inflight: set[int] = set()
        self._samples: deque[tuple[float, float]] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._action: threading.Thread | None = None
        self._acting: str | None = None
        # per direction (toward vLLM, back to llama.cpp): a failed or refused switch is not tried again before
        # this, and what failed then, for the decisions that wait (a refusal is not asked again every tick)
        self._not_before = {OTHER: 0.0, BASE: 0.0}
        self._setback = {OTHER: "", BASE: ""}
        self.steps = 0  # decisions made so far (tests wait on it)
        manager.proxy.subscribe_started(self._arrived)
        manager.proxy.subscribe(self._finished)

    # --- the in-flight level (called on the endpoint's loop: a set and a deque, nothing more) ---
    def _arrived(self, record: RequestRecord) -> None:
        with self._lock:
            self._inflight.add(record.seq)
            self._samples.append((self.clock(), float(len(self._inflight))))

    def _finished(self, record: RequestRecord) -> None:
        with self._lock:
            if record.seq in self._inflight:
                self._inflight.discard(record.seq)
                self._samples.append((self.clock(), float(len(self._inflight))))

    def samples(self, now: float) -> list[tuple[float, float]]:
        """The level's steps inside the longer window, with the level in force when it opened; older ones go."""
        keep = max(self.settings.window_s, self.settings.idle_s) + 1.0
        with self._lock:
            while len(self._samples) > 1 and self._samples[1][0] < now - keep:
                self._samples.popleft()
            return list(self._samples)

    # --- the loop ---
    def start(self) -> None:
        """Watch and decide from now on; nothing once stop() ran (the endpoint stopped while it was starting)."""
        with self._life:
            if self._stop.is_set():
                return
            with self._lock:
                self._samples.append((self.clock(), float(len(self._inflight))))  # the window starts now
            self.state = "watching"
            if self.other_plan is None:
                other = OTHER if self.only == BASE else BASE
                self._record(Decision("stay", f"only {self.only} can serve this model here ({other}: "
                                              f"{self.refused}): the hybrid mode stays on {self.only}", self.clock()))
            self._thread = threading.Thread(target=self._run, name="switchyard-autopilot", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._life:  # never between start()'s making its thread and starting it
            self._stop.set()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        self.state = "off"

    def _run(self) -> None:
        while not self._stop.wait(self.settings.tick_s):
            try:
                self.step()
            except Exception:  # the endpoint serves on whatever the loop does
                log.exception("autopilot step failed")

    def _busy(self) -> bool:
        return self._action is not None and self._action.is_alive()

    def step(self) -> Decision | None:
        """Decide once and act on it (an action runs in its own thread; while a switch runs nothing is decided)."""
        m = self.manager
        if self.other_plan is None or m.active is None or self._stop.is_set():
            return None
        if self._busy() and self._acting != "start_standby":
            return None
        now = self.clock()
        decision = decide(self._inputs(now))
        toward = TOWARD.get(decision.action)
        if toward is not None and now < self._not_before[toward]:
            decision = Decision("stay", f"{decision.reason} — but {self._setback[toward]} and is not tried again "
                                        f"before {time.strftime('%H:%M:%S', time.localtime(self._not_before[toward]))}",
                                now, decision.numbers)
        self._record(decision)
        self.steps += 1
        if not self._busy():
            self._act(decision)
        return decision

    def _inputs(self, now: float) -> PolicyInputs:
        m = self.manager
        active, standby = m.active, m.standby
        on = active.plan.engine if active is not None else BASE
        vllm_state: Literal["off", "starting", "ready"] = "off"
        if self._busy() and self._acting == "start_standby":
            vllm_state = "starting"
        elif standby is not None and standby.plan.engine == OTHER and standby.process.state == EngineState.READY:
            vllm_state = "ready"
        s = self.settings
        remaining = None if s.lifetime_s is None else max(0.0, s.lifetime_s - (now - self.started_at))
        return PolicyInputs(now=now, crossover=self.crossover, inflight=self.samples(now),
                            expected_remaining_s=remaining, both_fit=self.both_fit,
                            active=OTHER if on == OTHER else BASE, vllm_state=vllm_state,
                            window_s=s.window_s, idle_s=s.idle_s, co_resident_cost=s.co_resident_cost)

    def _record(self, decision: Decision) -> None:
        """Keep `decision` as the last one; when its action differs from the last kept one, also in the list and
        the journal (a decision a second would drown the log)."""
        with self._lock:
            self.last = decision
            changed = not self.decisions or self.decisions[-1].action != decision.action
            if changed:
                self.decisions.append(decision)
        if not changed:
            return
        log.info("autopilot %s: %s", decision.action, decision.reason)
        if self.journal is not None:
            try:
                self.journal(decision.to_json())
            except Exception:
                log.exception("could not journal an autopilot decision")

    # --- acting, with the manager's own switching ---
    def _act(self, decision: Decision) -> None:
        action = decision.action
        if action == "start_standby":
            self._spawn(action, self._start_standby)
        elif action in ("hand_over", "switch_stop_first"):
            self._spawn(action, lambda: self._switch(OTHER, action))
        elif action == "retire":
            self._spawn(action, self._retire)

    def _spawn(self, action: str, work: Callable[[], None]) -> None:
        self._acting = action
        self.state = {"start_standby": "starting vLLM", "retire": "retiring vLLM"}.get(action, "handing over")

        def run() -> None:
            try:
                work()
            finally:
                self.state = "watching"

        self._action = threading.Thread(target=run, name=f"switchyard-autopilot-{action}", daemon=True)
        self._action.start()

    def _failed(self, what: str, exc: SwitchyardError, toward: str = OTHER) -> None:
        """A switch toward `toward` failed (a vLLM start, a hand-over, a hand-back; a refused capability too:
        serving.capabilities): the engine serving keeps serving, and that direction is not tried again for
        retry_after_s (a refusal is not asked again every tick, nor a fresh engine started to be refused)."""
        now = self.clock()
        self._not_before[toward] = now + self.settings.retry_after_s
        self._setback[toward] = f"{what} failed at {time.strftime('%H:%M:%S', time.localtime(now))} ({exc.message})"
        serving, target = ("llama.cpp", "vLLM") if toward == OTHER else ("vLLM", "llama.cpp")
        self._record(Decision("stay", f"{what} failed ({exc.message}): {serving} keeps serving; {target} is not "
                                      f"tried again for {self.settings.retry_after_s:g} s", now))

    def _start_standby(self) -> None:
        m = self.manager
        try:
            m.prepare_standby(m.target(OTHER))
        except SwitchyardError as exc:
            self._failed("starting vLLM in the background", exc)

    def _switch(self, engine: str, action: str) -> None:
        try:
            result = self.manager.switch(engine)
        except SwitchyardError as exc:
            self._failed("the hand-over to vLLM" if engine == OTHER else "handing back to llama.cpp", exc,
                         toward=engine)
            return
        last = self.last
        if last is not None:  # what the switch did, next to why
            done = replace(last, numbers={**last.numbers, "switch": {
                "kind": result.kind, "seconds": result.seconds, "gap_s": result.gap_s,
                "cut_requests": result.cut_requests}})
            with self._lock:
                if self.decisions and self.decisions[-1] is last:
                    self.decisions[-1] = done
                self.last = done

    def _retire(self) -> None:
        self._switch(BASE, "retire")
        standby: ManagedEngine | None = self.manager.standby
        if standby is not None and standby.plan.engine == OTHER:  # kept warm by --keep-standby: retiring frees it
            self.manager.retire(standby)

    # --- what status shows ---
    def status(self) -> dict[str, Any]:
        with self._lock:
            last = self.last.to_json() if self.last else None
            decisions = [d.to_json() for d in self.decisions]
            level = len(self._inflight)
        x = self.crossover
        return {"mode": "auto", "state": self.state, "inflight": level, "last": last, "decisions": decisions,
                "settings": self.settings.to_json(), "both_fit": self.both_fit,
                "vllm_refused": self.refused,
                "crossover": {"concurrency": x.crossover_concurrency, "verdict": x.verdict,
                              "tags": {c.engine: c.tag for c in x.curves},
                              "vllm_cold_start_s": next((c.cold_start_s for c in x.curves if c.engine == OTHER),
                                                        None)}}


# --- building the hybrid endpoint (one place for `serve --engine auto` and the GUI's "Hybrid (auto)") ---
@dataclass(frozen=True)
class HybridPlans:
    """Both engines' checked plans for one model, made before anything starts, and why a refused one was refused.
    `first` serves at once (llama.cpp where it fits); `other` is the engine the autopilot may bring in."""

    llama: Checked | None
    vllm: Checked | None
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def first(self) -> Checked:
        first = self.llama if self.llama is not None else self.vllm
        assert first is not None  # plan_hybrid refuses when neither engine can serve
        return first

    @property
    def other(self) -> Checked | None:
        return self.vllm if self.llama is not None else None

    def without_vllm(self, why: str) -> HybridPlans:
        """vLLM cannot be brought in after all (e.g. it is not installed): llama.cpp alone, and why."""
        return replace(self, vllm=None, refused={**self.refused, OTHER: why})


def plan_hybrid(model: str, hardware: HardwareSnapshot, wanted: Mapping[str, Any], *,
                progress: ProgressCallback = no_progress, hint: str = "serve a smaller model or context",
                other_asks: Mapping[str, Any] | None = None) -> HybridPlans:
    """Both engines' checked plans up front. vLLM is planned like a switch to it from llama.cpp's plan (only the
    asks every engine shares carry over, and `other_asks`: vLLM's own, e.g. eager). Neither fits: one clear
    SwitchyardError naming both refusals."""
    if args_kind(BASE, wanted.get("extra_args") or ()) != "chat":  # the other engine would not embed the same way
        raise SwitchyardError("the hybrid endpoint hands chat traffic between engines; an embedder or reranker is "
                              "never autopilot-switched",
                              "serve it on one engine (--engine llama.cpp or vllm), or as `kind: embedding` (or "
                              "rerank) in a models.yaml entry")
    refused: dict[str, str] = {}
    llama: Checked | None = None
    vllm: Checked | None = None
    try:
        llama = plan_launch(BASE, model, hardware, wanted, progress=progress)
    except SwitchyardError as exc:
        refused[BASE] = str(exc)
    try:
        vllm = replan(llama.plan, hardware, engine=OTHER, progress=progress, changes=other_asks) \
            if llama is not None else \
            plan_launch(OTHER, model, hardware, {**{k: v for k, v in wanted.items() if k in COMMON_PLAN_FIELDS},
                                                 **(other_asks or {})}, progress=progress)
    except SwitchyardError as exc:
        refused[OTHER] = str(exc)
    if llama is None and vllm is None:
        raise SwitchyardError(f"neither engine can serve {model} here: llama.cpp: {refused[BASE]}; "
                              f"vLLM: {refused[OTHER]}", hint)
    return HybridPlans(llama, vllm, refused)


def build_autopilot(manager: EndpointManager, plans: HybridPlans, *, hardware: HardwareSnapshot,
                    budget: MemoryBudget | None, runs: Iterable[Any], model: str,
                    settings: AutopilotSettings | None = None, journal: Journal | None = None) -> Autopilot:
    """The hybrid loop over `manager` for `plans`: this machine's crossover for `model` from the history `runs`
    (or the settings' forced one), whether both plans fit at once in `budget` (the machine's RAM where None), and
    the refusal to say when only one engine can serve. Attached as `manager.autopilot` (status, close); the caller
    starts it once the first engine serves."""
    settings = settings or AutopilotSettings()
    first, other = plans.first.plan, plans.other.plan if plans.other is not None else None
    only = None if other is not None else first.engine
    autopilot = Autopilot(manager, machine_crossover(runs, model, hardware, settings.crossover), other,
                          both_fit=other is not None and both_fit([first, other], budget, hardware),
                          settings=settings, journal=journal,
                          refused=plans.refused.get(OTHER if only == BASE else BASE), only=only)
    autopilot.first_plan = first
    manager.autopilot = autopilot
    return autopilot


__all__ = ["Autopilot", "AutopilotSettings", "HybridPlans", "both_fit", "build_autopilot", "forced_crossover",
           "machine_crossover", "plan_hybrid", "ram_budget"]
