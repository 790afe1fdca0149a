"""The words of one engine's life, shared by the supervisor and its collaborators (log reading, readiness,
spawning): the states it goes through, the events subscribers hear, the cold-start phases it passes (and how
they stack up for bars, reports and history) and how its life ended. Data only: nothing here runs a process.
`desktop.core.runtime.supervisor` re-exports these names, where the rest of the app imports them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from desktop.core.engines.base import FailureReason


class EngineState(str, Enum):
    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    CRASHED = "crashed"


@dataclass(frozen=True)
class Phase:
    """One cold-start phase: its key (what adapters' log markers `end`), its label and a short tag for narrow
    bars. The names are written here once: the Serve page's bar, the compare page, reports and history read
    them from COLD_START_PHASES."""

    key: str
    label: str
    short: str
    color: str  # the same colour on the Serve page's bar and in reports


COLD_START_PHASES: tuple[Phase, ...] = (
    Phase("process", "process & imports", "start", "#9e9ac8"),
    Phase("weights", "weights", "weights", "#2b8cbe"),
    Phase("compile", "torch.compile", "compile", "#e6550d"),
    Phase("memory", "memory profile & KV cache", "KV", "#31a354"),
    Phase("graphs", "CUDA graphs / warm-up", "warm-up", "#756bb1"),
    Phase("api", "API up (T1)", "T1", "#636363"),
    Phase("first_token", "first token (T2)", "T2", "#fdae6b"),
    Phase("first_request", "first request done (T3)", "T3", "#74c476"),
)
PHASE_BY_KEY = {phase.key: phase for phase in COLD_START_PHASES}
SERVING_PHASES = ("api", "first_token", "first_request")  # every engine has these: T1, T2, T3
# The serving phases' event names (EngineEvent("phase") and the GUI's timeline carry them; one spelling: here).
PHASE_NAMES = {"t1_health_s": "T1_health", "t2_first_token_s": "T2_first_token", "t3_first_request_s": "T3_first_request"}


@dataclass
class ColdStart:
    """Cold-start phases in seconds since spawn (T0). T1 health OK, T2 first token, T3 first request done."""

    spawned_at: float = 0.0  # wall clock (epoch) of T0
    t1_health_s: float | None = None
    t2_first_token_s: float | None = None
    t3_first_request_s: float | None = None
    markers: dict[str, float] = field(default_factory=dict)  # log marker name -> seconds since T0
    facts: dict[str, str] = field(default_factory=dict)  # values captured from log markers (KV size, ...)
    page_cache_resident: float | None = None  # fraction of model bytes cached before spawn
    phase_ends: dict[str, float] = field(default_factory=dict)  # phase key -> seconds since T0 its last marker came
    expected: tuple[str, ...] = ()  # the engine's phases for this plan, in order (adapter.cold_start_phases)
    compile_cache_dir: str | None = None  # where this plan's compiled graphs are kept (vLLM), if the app keeps them
    compile_cache_found: bool | None = None  # that folder held compiled code before the spawn

    def end_phase(self, key: str, seconds: float) -> None:
        self.phase_ends[key] = max(seconds, self.phase_ends.get(key, seconds))

    def _ends(self) -> dict[str, float]:
        ends = dict(self.phase_ends)
        for key, value in zip(SERVING_PHASES, (self.t1_health_s, self.t2_first_token_s, self.t3_first_request_s),
                              strict=True):
            if value is not None:
                ends[key] = value
        return ends

    def phases(self, now: float | None = None) -> list[dict[str, Any]]:
        """The phases reached so far, stacked: each starts where the one before it ended (a phase whose
        marker never came is folded into the next). With `now` (seconds since T0) and the start not yet done,
        the phase under way is added as `running`, so a live bar grows."""
        ends = self._ends()
        out: list[dict[str, Any]] = []
        start = 0.0
        for phase in COLD_START_PHASES:
            if phase.key not in ends or (self.expected and phase.key not in (*self.expected, *SERVING_PHASES)):
                continue  # not reached, or not this plan's (an eager vLLM's warm-up is no compile)
            end = max(start, ends[phase.key])
            out.append({"phase": phase.key, "label": phase.label, "start_s": round(start, 3),
                        "end_s": round(end, 3), "seconds": round(end - start, 3)})
            start = end
        if now is not None and self.t3_first_request_s is None:
            current = self.current_phase()
            if current is not None:
                out.append({"phase": current, "label": PHASE_BY_KEY[current].label, "start_s": round(start, 3),
                            "end_s": round(max(now, start), 3), "seconds": round(max(0.0, now - start), 3),
                            "running": True})
        return out

    def current_phase(self) -> str | None:
        """The phase under way: the first expected one after the last phase that ended (None once T3 is in)."""
        ends = self._ends()
        order = [p.key for p in COLD_START_PHASES
                 if p.key in (*(self.expected or [k.key for k in COLD_START_PHASES]), *SERVING_PHASES)]
        reached = [i for i, key in enumerate(order) if key in ends]
        after = reached[-1] + 1 if reached else 0
        return order[after] if after < len(order) else None

    @property
    def compile_cache(self) -> str | None:
        """vLLM's torch.compile cache on this start: "hit" (loaded compiled graphs), "stale" (found them but
        could not load them: compiled again), "miss" (compiled and saved them), "warm" (compiled again from a
        filled Inductor cache: vLLM CPU), "off" (the plan does not compile); None when nothing is known."""
        if "compile_cache_hit" in self.markers:
            return "hit"
        if "compile_cache_stale" in self.markers:
            return "stale"
        if "compile_cache_miss" in self.markers:
            return "miss"
        if self.compile_cache_dir is not None and "compile" not in self.expected:
            return "off"
        if self.compile_cache_found is not None:  # the engine logs nothing of it (Inductor's cache): what was there
            return "warm" if self.compile_cache_found else "miss"
        return None

    def event_phases(self) -> dict[str, float]:
        """The serving phases reached so far, by their event names (T1_health ...)."""
        return {name: value for key, name in PHASE_NAMES.items() if (value := getattr(self, key)) is not None}

    def phase_seconds(self) -> dict[str, float]:
        """{phase key: seconds} of the finished phases (what reports and history tabulate)."""
        return {p["phase"]: p["seconds"] for p in self.phases()}

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["expected"] = list(self.expected)
        data["phases"] = self.phases()
        data["compile_cache"] = self.compile_cache
        return data


def phases_of(cold: dict[str, Any]) -> list[dict[str, Any]]:
    """The stacked phases of a stored cold start (`ColdStart.to_json()`), also for rows stored before phases
    were recorded (then T1/T2/T3 only)."""
    if isinstance(cold.get("phases"), list):
        return [p for p in cold["phases"] if isinstance(p, dict) and p.get("phase") in PHASE_BY_KEY]
    rebuilt = ColdStart(t1_health_s=cold.get("t1_health_s"), t2_first_token_s=cold.get("t2_first_token_s"),
                        t3_first_request_s=cold.get("t3_first_request_s"))
    return rebuilt.phases()


@dataclass
class EngineEvent:
    """What subscribers (CLI, GUI) hear: a state change, a log line, or a phase reached."""

    kind: str  # "state" | "log" | "phase"
    state: EngineState | None = None
    line: str = ""
    phase: str = ""
    seconds: float | None = None


Listener = Callable[[EngineEvent], None]


@dataclass
class EngineOutcome:
    """How the engine's life ended, recorded for history and shown to the user."""

    state: EngineState
    exit_code: int | None
    reason: FailureReason | None
    log_path: str

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["state"] = self.state.value
        return data
