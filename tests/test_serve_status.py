"""One account of the endpoint's state (issue 52, item 4): the state label, the status bar and the notices read
`serving.serve_status`, so the contradictions of the old screenshots cannot come back: "switching" in the status
bar after the switch ended (4e), "Engine: ready" under "serving" (4), a "Starting vLLM" notice left standing after
the hand-over (4f)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from desktop.core.serving.serve_status import PENDING, notice_ends, pending_tag, serve_status


class _State(Enum):
    READY = "ready"
    LOADING = "loading"
    CRASHED = "crashed"
    STOPPED = "stopped"


@dataclass
class _Adapter:
    display_name: str

    @property
    def name(self) -> str:  # the registry's key, as the adapters name themselves
        return "llama.cpp" if self.display_name.startswith("llama.cpp") else "vllm"


@dataclass
class _Cold:
    phase: str | None = "weights"

    def current_phase(self) -> str | None:
        return self.phase


@dataclass
class _Process:
    name: str
    state: _State = _State.READY
    seconds: float = 23.4
    running: bool = True
    cold_start: Any = field(default_factory=_Cold)

    @property
    def adapter(self) -> _Adapter:
        return _Adapter(self.name)

    def is_running(self) -> bool:
        return self.running

    def elapsed(self) -> float:
        return self.seconds


LLAMA, VLLM = "llama.cpp (llama-server)", "vLLM"


def test_serving_reads_serving_in_the_label_and_the_status_bar() -> None:
    status = serve_status(_Process(LLAMA), None)
    assert (status.word, status.line, status.status_bar) == ("serving", "serving: llama.cpp",
                                                              "Engine: serving: llama.cpp")
    assert "ready" not in status.status_bar  # the old bar said "Engine: ready" under "serving"


def test_a_switch_says_switching_while_it_runs_and_serving_once_it_is_done() -> None:
    during = serve_status(_Process(LLAMA), _Process(VLLM, _State.LOADING), switching=True)
    assert during.word == "switching" and during.action == "switch"
    assert during.line == "serving: llama.cpp · starting: vLLM 23 s, weights"
    assert during.status_bar == "Engine: switching (serving: llama.cpp · starting: vLLM 23 s, weights)"
    assert during.engine == "llama.cpp"  # the form's engine box names the one serving until the hand-over
    after = serve_status(_Process(VLLM), None)
    assert after.status_bar == "Engine: serving: vLLM" and after.action is None and after.engine == "vllm"


def test_hybrid_standby_start_is_its_own_step_and_its_notice_ends_with_it() -> None:
    # the autopilot's "Starting vLLM on demo; waiting until it serves" arrives before vLLM is in the starting slot
    before = serve_status(_Process(LLAMA), None)
    arrived = pending_tag(before)
    assert arrived == f"{PENDING}llama.cpp|None"
    ends, tag = notice_ends(arrived, before)
    assert (ends, tag) == (False, arrived)
    starting = serve_status(_Process(LLAMA), _Process(VLLM, _State.LOADING))
    assert (starting.word, starting.action) == ("serving", "standby")
    ends, tag = notice_ends(tag, starting)
    assert (ends, tag) == (False, "standby")
    handed_over = serve_status(_Process(VLLM), None)
    assert notice_ends(tag, handed_over) == (True, "standby")  # the notice goes with its step
    assert notice_ends(None, handed_over) == (False, None)  # a result or an error stays


def test_stopped_crashed_and_starting() -> None:
    assert serve_status(None, None).line == "stopped"
    crashed = serve_status(None, None, _Process(LLAMA, _State.CRASHED, running=False))
    assert (crashed.word, crashed.line) == ("crashed", "crashed: llama.cpp")
    first = serve_status(None, _Process(LLAMA, _State.LOADING), starting_asked=True)
    assert (first.word, first.action) == ("starting", "start")
    assert first.status_bar == "Engine: starting: llama.cpp 23 s, weights"
    stopping = serve_status(_Process(LLAMA), None, stopping=True)
    assert stopping.status_bar == "Engine: stopping (serving: llama.cpp)"


def test_a_start_too_fast_to_show_still_ends_its_notice() -> None:
    """The standby's "Starting vLLM" arrived while llama.cpp served; the next account already has vLLM serving
    (the start never showed between two looks): the step came and went, so its notice ends."""
    arrived = pending_tag(serve_status(_Process(LLAMA), None))
    assert notice_ends(arrived, serve_status(_Process(VLLM), None)) == (True, arrived)
    # "Preparing vLLM" progress while the same engine keeps serving: nothing changed, it stays
    assert notice_ends(arrived, serve_status(_Process(LLAMA), None)) == (False, arrived)

