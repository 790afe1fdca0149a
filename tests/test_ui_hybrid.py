"""The Serve page's hybrid mode ("Hybrid (auto)", as `serve --engine auto`), offscreen: choosing it starts
llama.cpp through the GUI's own endpoint with the autopilot attached, the page's label says the loop's state and
decisions as `status --json` has them, and with a forced crossover a held streaming load brings vLLM in and the
label reports the hand-over. Stand-in engines (tests/standin_engine.py, as in test_autopilot_live) so it runs in
seconds; the real Qt, proxy, manager, planner and autopilot loop."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from test_fleet import standin_launcher
from test_switch import StreamingLoad
from test_ui_pages import no_leaks, window  # noqa: F401 - shared fixtures (no leaks, no timers left)

from desktop.core.engines.base import LaunchPlan
from desktop.core.serving.autopilot import AutopilotSettings

pytestmark = [pytest.mark.gui, pytest.mark.qt_log_ignore("propagateSizeHints")]

# crossover forced at 2: four requests held in flight over a 1 s window make vLLM pay; retiring it waits 60 s
FORCED = AutopilotSettings(window_s=1.0, idle_s=60.0, tick_s=0.05, crossover=2.0)


def _until(condition: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Poll `condition()` until truthy or the deadline passes (no sleep as synchronisation)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        threading.Event().wait(0.02)
    return condition()


def _shown_matches_status(serve: Any, qtbot: Any) -> str:
    """The label, refreshed, equals the words for the manager's own status (`status --json`'s "autopilot"); the
    loop decides every tick, so poll until one refresh and one status read agree. Returns the text shown."""
    from desktop.ui.pages.serve import autopilot_text

    manager = serve.session.manager
    seen: list[tuple[str, str]] = []

    def agree() -> bool:
        serve.refresh_live()
        shown, wanted = serve.autopilot_label.text(), autopilot_text(manager.status()["autopilot"])
        seen.append((shown, wanted))
        return shown == wanted

    qtbot.waitUntil(agree, timeout=10_000)
    return seen[-1][0]


def test_hybrid_mode_starts_llamacpp_shows_the_decisions_and_reports_the_hand_over(  # type: ignore[no-untyped-def]
        window, qtbot, tmp_path: Path) -> None:  # noqa: F811
    from PySide6.QtCore import Qt

    hold = tmp_path / "hold"
    launched: list[LaunchPlan] = []

    def options(plan: LaunchPlan) -> list[str]:  # llama.cpp holds its streams while `hold` exists
        return ["--hold-file", str(hold)] if plan.engine == "llama.cpp" else ["--load-seconds", "0.3"]

    session = window.session
    standin = standin_launcher(tmp_path, options, launched)

    def announcing(plan: LaunchPlan) -> Any:  # says what the real launcher says before each start
        from desktop.core.common.progress import ProgressEvent

        session._progress(ProgressEvent(f"Starting {plan.engine} on demo; waiting until it serves"))
        return standin(plan)

    session.launcher = announcing
    session.autopilot_settings = FORCED
    serve = window.show_page("Serve")
    index = serve.engine_box.findData("auto")
    assert index >= 0 and serve.engine_box.itemText(index) == "Hybrid (auto)"
    serve.engine_box.setCurrentIndex(index)
    qtbot.mouseClick(serve.start_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: bool(serve.endpoint_edit.text()) or serve.notice.level == "error", timeout=120_000)
    assert serve.endpoint_edit.text(), serve.notice.text()
    manager = session.manager
    # llama.cpp first, alone; the loop attached and watching, vLLM's plan checked up front
    assert [p.engine for p in launched] == ["llama.cpp"] and manager.active.plan.engine == "llama.cpp"
    auto = manager.status()["autopilot"]
    assert auto is not None and auto["mode"] == "auto" and auto["vllm_refused"] is None
    assert manager.autopilot.other_plan is not None and manager.autopilot.other_plan.engine == "vllm"
    assert serve.autopilot_label.isVisible()
    assert not serve.switch_button.isEnabled()  # the loop switches; a manual switch would fight it
    assert _until(lambda: manager.autopilot.steps >= 3)
    shown = _shown_matches_status(serve, qtbot)
    assert shown.startswith("Hybrid (watching): ") and "Last move" not in shown, shown
    assert any(word in shown for word in ("watch — ", "stay — in-flight p95")), shown

    hold.write_text("")
    with StreamingLoad(session.proxy.url, concurrency=4, max_tokens=4) as load:
        assert _until(lambda: session.proxy.inflight() >= 4, 20), session.proxy.inflight()
        # in-flight 4 > crossover 2 over the window: vLLM starts beside llama.cpp and takes over when it serves
        assert _until(lambda: manager.active is not None and manager.active.plan.engine == "vllm"), \
            manager.status()["autopilot"]
        hold.unlink()  # the held requests drain on llama.cpp, then the hand-over is done
        qtbot.waitUntil(lambda: "Last move: hand_over llama.cpp → vLLM" in serve.autopilot_label.text(),
                        timeout=30_000)
        served = session.request_log.finished_count
        assert _until(lambda: session.request_log.finished_count > served + 8)  # vLLM serves the load
    assert load.result.failed == [] and session.proxy.counters["failed"] == 0, load.result.failed[:3]
    assert [p.engine for p in launched] == ["llama.cpp", "vllm"]
    # one account (issue 52): the standby start's "Starting vLLM ..." notice ended with it; the bar says what serves
    qtbot.waitUntil(lambda: window.statusBar().currentMessage() == "Engine: serving: vLLM", timeout=10_000)
    assert not (serve.notice.isVisible() and serve.notice.text().startswith("Starting")), serve.notice.text()
    shown = _shown_matches_status(serve, qtbot)
    status = manager.status()["autopilot"]
    hand_over = next(d for d in reversed(status["decisions"]) if d["action"] == "hand_over")
    assert "vLLM is ready: handing over" in hand_over["reason"]
    switch = hand_over["numbers"]["switch"]
    assert switch["kind"] == "standby" and switch["cut_requests"] == 0
    assert (f"Last move: hand_over llama.cpp → vLLM at {time.strftime('%H:%M:%S', time.localtime(hand_over['t']))}"
            f" — standby switch in {switch['seconds']:.1f} s") in shown and "0 requests cut" in shown, shown
    moves = [d["action"] for d in status["decisions"] if d["action"] in ("start_standby", "hand_over", "retire")]
    assert moves == ["start_standby", "hand_over"], status["decisions"]  # vLLM beside llama.cpp, then in front
    # the decisions went to the request log too, as the CLI's do
    assert [e["action"] for e in session.request_log.events()] == [d["action"] for d in status["decisions"]]

    serve.stop_clicked()
    qtbot.waitUntil(lambda: manager.active is None and not session.busy, timeout=60_000)
    assert manager.autopilot.state == "off"


def test_a_plain_start_after_hybrid_mode_shows_no_hybrid_label(window, qtbot, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]  # noqa: E501,F811
    from desktop.core.planning.planner import ask

    session = window.session
    session.launcher = standin_launcher(tmp_path)
    session.autopilot_settings = FORCED
    serve = window.show_page("Serve")
    serve.engine_box.setCurrentIndex(serve.engine_box.findData("auto"))
    serve.start_clicked()
    qtbot.waitUntil(lambda: serve.autopilot_label.isVisible() and session.manager.active is not None,
                    timeout=120_000)
    serve.stop_clicked()
    qtbot.waitUntil(lambda: session.manager.active is None and not session.busy, timeout=60_000)
    serve.launch(ask("llama.cpp", "demo", {"ctx_per_request": 512}))
    qtbot.waitUntil(lambda: not session.busy, timeout=120_000)
    assert session.manager.active is not None, serve.notice.text()
    serve.refresh_live()
    assert session.manager.status()["autopilot"] is None and not serve.autopilot_label.isVisible()
