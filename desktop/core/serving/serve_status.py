"""What the app's endpoint is doing, in one object: the Serve page's state label, the window's status bar and the
page's notices all read it, so they cannot contradict each other (issue 52: "switching" in the status bar after
the switch ended, "Engine: ready" under "serving", a "Starting vLLM" notice left standing after the hand-over).

`serve_status` is computed from the engines the endpoint holds (the one serving, the one starting) and what the
app asked (a start, a switch, a stop); `action` names the step in progress, and a notice that belongs to an action
ends when the action does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ACTIONS = ("start", "switch", "standby", "stop")  # a person's start / switch / stop; hybrid mode's standby start


def engine_short(process: Any) -> str:
    """"llama.cpp", "vLLM": the engine's name without its server's."""
    return str(process.adapter.display_name).split(" (")[0] if process is not None else ""


@dataclass(frozen=True)
class ServeStatus:
    word: str  # stopped | starting | serving | switching | stopping | crashed
    line: str  # "serving: llama.cpp · starting: vLLM 23 s, compile"
    serving: str | None  # the engine answering requests now ("llama.cpp"), if any
    starting: str | None  # the engine being started, if any
    action: str | None  # the step in progress (ACTIONS), None when nothing is underway
    engine: str | None = None  # the serving engine's adapter name ("vllm"), for the form's engine box

    @property
    def status_bar(self) -> str:
        """The status bar's text: the line the page shows, with the step underway when the line does not say it
        ("Engine: switching (serving: llama.cpp · starting: vLLM 23 s, weights)")."""
        if self.line.startswith(self.word):
            return f"Engine: {self.line}"
        return f"Engine: {self.word} ({self.line})"


PENDING = "pending:"  # a progress message that arrived before its step showed in the state, and what served then


def pending_tag(state: ServeStatus) -> str:
    """The tag of a message that arrived while no step showed: which engines served and started at the time."""
    return f"{PENDING}{state.serving}|{state.starting}"


def notice_ends(notice_action: str | None, state: ServeStatus) -> tuple[bool, str | None]:
    """Whether a notice tagged `notice_action` ends now that the state is `state`, and its tag from now on. A
    message of a step (start, switch, standby, stop) ends when that step does. One that arrived before its step
    showed ("Starting vLLM ...; waiting until it serves" comes before the engine is in the endpoint's starting
    slot; a fast start may never show at all) joins the step that shows next, or ends once the engines differ
    from when it arrived with no step underway (the step came and went). An untagged message (a result, an
    error) stays."""
    if notice_action is None:
        return False, None
    if notice_action.startswith(PENDING):
        if state.action:
            return False, state.action
        return notice_action != pending_tag(state), notice_action
    return state.action != notice_action, notice_action


def serve_status(serving: Any, starting: Any, shown: Any = None, *, starting_asked: bool = False,
                switching: bool = False, stopping: bool = False) -> ServeStatus:
    """The state of the endpoint's engines: `serving` (the active engine's process), `starting` (the one being
    started), `shown` (the session's last engine, kept when it crashed or stopped); `starting_asked` while a
    person's start runs, `switching` while their switch runs, `stopping` while a stop runs."""
    from desktop.core.runtime.supervisor import PHASE_BY_KEY

    parts: list[str] = []
    serving_name = starting_name = engine = None
    if serving is not None:
        state = serving.state.value
        parts.append(f"serving: {engine_short(serving)}" if state == "ready" else f"{state}: {engine_short(serving)}")
        serving_name = engine_short(serving) if state == "ready" else None
        engine = str(serving.adapter.name) if state == "ready" else None
    if starting is not None and starting.is_running():
        phase = starting.cold_start.current_phase()
        label = PHASE_BY_KEY[phase].label if phase else "ready"
        parts.append(f"starting: {engine_short(starting)} {starting.elapsed():.0f} s, {label}")
        starting_name = engine_short(starting)
    if not parts and shown is not None:  # an engine that crashed or stopped, or the very first start
        parts.append(f"{shown.state.value}: {engine_short(shown)}")
    line = " · ".join(parts) or "stopped"
    if stopping:
        return ServeStatus("stopping", line, serving_name, starting_name, "stop", engine)
    if switching:
        return ServeStatus("switching", line, serving_name, starting_name, "switch", engine)
    if starting_asked:
        return ServeStatus("starting", line, serving_name, starting_name, "start", engine)
    if starting_name is not None:  # hybrid mode bringing in its standby, or a crash failover's restart
        return ServeStatus("serving" if serving_name else "starting", line, serving_name, starting_name, "standby",
                           engine)
    if serving_name is not None:
        return ServeStatus("serving", line, serving_name, None, None, engine)
    word = shown.state.value if shown is not None and shown.state.value in ("crashed", "stopped") else "stopped"
    if serving is not None and serving_name is None:
        word = serving.state.value
    return ServeStatus(word, line, None, None, None)
