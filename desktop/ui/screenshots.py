"""`switchyard gui --screenshots DIR`: drive the real window through every page with real data (hardware, the
demo model, a recommendation, llama.cpp serving, a short benchmark sweep, a chat answer, a switch to vLLM under
load, the profile of that traffic, an A/B that replays it, the crossover from that A/B) and save one PNG per
page or panel."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import QEventLoop, QTimer


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    """Run a real event loop (as the app does: no polling sleeps) until `predicate()` holds or `timeout`
    seconds pass; the predicate is checked every 50 ms."""
    if predicate():
        return True
    deadline = time.monotonic() + timeout
    loop = QEventLoop()
    poll = QTimer()
    poll.setInterval(50)
    poll.timeout.connect(lambda: loop.quit() if predicate() or time.monotonic() > deadline else None)
    poll.start()
    loop.exec()
    poll.stop()
    return predicate()


def _save(window: Any, out: Path, index: int, name: str) -> Path:
    window.show_page(name)
    wait_until(lambda: False, 0.6)  # let charts redraw and layouts settle
    path = out / f"{index}-{name.lower()}.png"
    window.grab().save(str(path))
    print(f"saved {path}", file=sys.stderr, flush=True)
    return path


def save_requests_panel(window: Any, out: Path, index: str = "4b") -> Path:
    """The Serve page with its Requests tab shown (the tabs take the page's room below the state)."""
    serve = window.show_page("Serve")
    tabs = serve.bottom_tabs
    shown = tabs.currentIndex()
    tabs.setCurrentWidget(serve.requests_panel)
    serve.requests_panel.refresh()
    wait_until(lambda: False, 0.4)
    path = out / f"{index}-serve-requests.png"
    window.grab().save(str(path))
    print(f"saved {path}", file=sys.stderr, flush=True)
    tabs.setCurrentIndex(shown)
    return path


def _grab(widget: Any, path: Path) -> Path:
    widget.grab().save(str(path))
    print(f"saved {path}", file=sys.stderr, flush=True)
    return path


class BackgroundLoad:
    """A few streamed requests at a time through the endpoint until stopped (a thread): the serving engine's
    charts have something to draw while a switch runs, and the request log has traffic to profile and replay."""

    def __init__(self, url: str, concurrency: int = 2, max_tokens: int = 24) -> None:
        import threading

        self.url, self.max_tokens = url, max_tokens
        self.sent = self.failed = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(lane,), daemon=True, name=f"shot-load-{lane}")
                         for lane in range(concurrency)]

    def __enter__(self) -> BackgroundLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)

    def _run(self, lane: int) -> None:
        import httpx

        body = {"model": "switchyard", "prompt": f"Tell me about railway yards, part {lane}.", "stream": True,
                "max_tokens": self.max_tokens, "temperature": 0}
        with httpx.Client(trust_env=False, timeout=120) as client:
            while not self._stop.is_set():
                try:
                    with client.stream("POST", self.url + "/v1/completions", json=body) as response:
                        response.read()
                        self.failed += response.status_code != 200
                except httpx.HTTPError:
                    self.failed += 1
                self.sent += 1
                self._stop.wait(0.3)  # a chat-like pace: gaps between a lane's requests


def save_switch_in_progress(window: Any, out: Path) -> list[Path]:
    """The Serve page during a switch to vLLM (llama.cpp still serving, vLLM's row growing on the cold-start
    bar, both engines' states on one line) and once it is done (the hand-over marked on the charts)."""
    from desktop.core.engines import get_adapter

    if get_adapter("vllm").find_install() is None:
        print("vLLM is not installed: no switch screenshots", file=sys.stderr)
        return []
    serve = window.show_page("Serve")
    with BackgroundLoad(window.session.proxy.url):
        return _switch(window, serve, out)


def _switch(window: Any, serve: Any, out: Path) -> list[Path]:
    serve.switch_clicked()
    saved = []

    def past_weights() -> bool:
        _serving, starting = serve.engines()
        return starting is not None and starting.cold_start.current_phase() not in (None, "process", "weights")

    wait_until(lambda: past_weights() or not window.session.switching, 600)
    wait_until(lambda: False, 3.0)  # a few live points of the serving engine, the bar grown a little
    if window.session.switching:
        saved.append(_grab(window, out / "4d-serve-switching.png"))
    if not wait_until(lambda: not window.session.switching, 1200):
        print("the switch did not finish in time", file=sys.stderr)
    wait_until(lambda: False, 20.0)  # the new engine's points after the hand-over mark
    saved.append(_grab(window, out / "4e-serve-switched.png"))
    return saved


def save_traffic(window: Any, out: Path, name: str, *, panel_only: bool = False) -> Path | None:
    """The Recommend page's traffic panel, read again from history: the whole page as laid out (the answer first,
    whole, the profile of what went through the endpoint below it) or, once an A/B has measured both engines, the
    crossover charts (the panel alone, given the page's height while the answer is hidden for the shot)."""
    recommend = window.show_page("Recommend")
    panel = recommend.traffic
    panel.refresh(recommend.model_edit.text().strip())
    if not wait_until(lambda: not panel.loading, 60) or panel.picture is None:
        print("the traffic profile did not arrive in time", file=sys.stderr)
        return None
    recommend.result_box.setVisible(not panel_only)
    wait_until(lambda: False, 0.6)
    try:
        return _grab(panel if panel_only else window, out / name)
    finally:
        recommend.result_box.setVisible(True)


def _anthropic_request(url: str) -> None:
    """One Anthropic Messages request (streamed) through the endpoint, so the request log shows that route too."""
    import httpx

    body = {"model": "switchyard", "max_tokens": 16, "stream": True,
            "messages": [{"role": "user", "content": "Say hello"}]}
    with httpx.stream("POST", url + "/v1/messages", json=body, trust_env=False, timeout=120) as response:
        response.read()


def save_hybrid(window: Any, out: Path, timeout: float = 900.0) -> Path | None:
    """The Serve page in hybrid mode ("Hybrid (auto)", as `serve --engine auto`) with the autopilot's decision
    shown: the crossover forced low (2) so a small streaming load brings vLLM in (eager, the quick CPU start), the
    shot taken once the label reports the hand-over (or, past `timeout`, whatever it decided by then)."""
    from desktop.core.engines import get_adapter
    from desktop.core.serving.autopilot import AutopilotSettings

    if get_adapter("vllm").find_install() is None:
        print("vLLM is not installed: no hybrid screenshot", file=sys.stderr)
        return None
    session = window.session
    serve = window.show_page("Serve")
    serve.model_edit.setText("demo")
    serve.engine_box.setCurrentIndex(serve.engine_box.findData("auto"))
    session.autopilot_settings = AutopilotSettings(window_s=5.0, idle_s=900.0, tick_s=0.5, crossover=2.0)
    eager, session.vllm_eager = session.vllm_eager, True
    try:
        serve.start_clicked()
        if not wait_until(lambda: not session.busy, 900) or session.manager is None or \
                session.manager.active is None:
            print(f"hybrid mode did not start: {serve.notice.text()}", file=sys.stderr)
            return None
        with BackgroundLoad(session.proxy.url, concurrency=4):
            if not wait_until(lambda: "Last move" in serve.autopilot_label.text(), timeout):
                print("the hybrid hand-over did not happen in time", file=sys.stderr)
            wait_until(lambda: False, 5.0)  # vLLM's first points on the charts after the hand-over mark
            serve.refresh_live()
            return _grab(window, out / "4f-serve-hybrid.png")
    finally:
        session.autopilot_settings = None
        session.vllm_eager = eager
        session.stop()
        wait_until(lambda: not session.is_running() and not session.busy, 120)


SHOTS: dict[str, Callable[[Any, Path], Any]] = {"hybrid": save_hybrid}  # one shot again without the whole run


def take_screenshots(window: Any, out: Path, only: str | None = None) -> None:
    try:
        if only is not None:
            SHOTS[only](window, out)
        else:
            _drive(window, out)
    finally:
        window.close()


def _drive(window: Any, out: Path) -> None:
    machine = window.show_page("Machine")
    wait_until(lambda: machine.snapshot is not None, 30)
    _save(window, out, 1, "Machine")

    models = window.show_page("Models")
    wait_until(lambda: bool(models.library), 60)
    import tempfile

    from desktop.ui.screenshot_hub import save_models

    with tempfile.TemporaryDirectory(prefix="switchyard-shots-") as scratch:
        if save_models(window, out, Path(scratch), wait_until, _grab) is None:
            _save(window, out, 2, "Models")

    recommend = window.show_page("Recommend")
    recommend.compute()
    if not wait_until(lambda: recommend.recommendation is not None or recommend.notice.level == "error", 60):
        print("the recommendation did not arrive in time", file=sys.stderr)
    _save(window, out, 3, "Recommend")
    if recommend.recommendation is not None:
        dialog = recommend.open_export(modal=False)
        dialog.set_format("compose")
        wait_until(lambda: False, 0.4)
        dialog.grab().save(str(out / "3b-export-dialog.png"))
        print(f"saved {out / '3b-export-dialog.png'}", file=sys.stderr, flush=True)
        dialog.close()

    serve = window.show_page("Serve")
    request = recommend.launch_request()
    if request is not None and request.engine != "llama.cpp":
        from dataclasses import replace

        request = replace(request, engine="llama.cpp", model="demo")
    window.launch(request or _default_request())
    if not wait_until(lambda: bool(serve.endpoint_edit.text()) or serve.notice.level == "error", 900):
        print("the engine did not become ready in time", file=sys.stderr)
    compare = window.show_page("Compare")
    if serve.endpoint_edit.text():  # traffic through the endpoint, so the Serve page's charts have something
        compare.endpoint_radio.setChecked(True)
        compare.levels_edit.setText("1, 4")
        compare.requests_spin.setValue(24)
        if compare.start():
            wait_until(lambda: not compare.running, 600)
        wait_until(lambda: serve.samples_received > 20, 20)
        _anthropic_request(window.session.proxy.url)
    serve.bottom_tabs.setCurrentWidget(serve.live)  # 4: the live charts of that traffic
    _save(window, out, 4, "Serve")
    if serve.endpoint_edit.text():
        save_requests_panel(window, out)
    if serve.endpoint_edit.text():  # Try it: one streamed answer through the endpoint, with its speed
        serve.bottom_tabs.setCurrentWidget(serve.chat)
        serve.chat.temperature_spin.setValue(0.0)
        serve.chat.max_tokens_spin.setValue(48)
        if serve.chat.send("Write one sentence about railway switchyards."):
            if not wait_until(lambda: serve.chat.last_answer is not None, 120):
                print("the chat answer did not arrive in time", file=sys.stderr)
        wait_until(lambda: False, 0.4)
        window.grab().save(str(out / "4c-serve-chat.png"))
        print(f"saved {out / '4c-serve-chat.png'}", file=sys.stderr, flush=True)
        serve.bottom_tabs.setCurrentWidget(serve.connect_app)  # what to paste into Claude Code, its context warning
        serve.connect_app.choose("claude")
        window.grab().save(str(out / "4g-serve-connect-app.png"))
        print(f"saved {out / '4g-serve-connect-app.png'}", file=sys.stderr, flush=True)
        serve.bottom_tabs.setCurrentWidget(serve.live)  # the switch's hand-over marks on the charts
    if serve.endpoint_edit.text():
        save_switch_in_progress(window, out)
    window.session.stop()  # the A/B starts its own engines: nothing else should share the cores
    wait_until(lambda: not window.session.is_running() and not window.session.busy, 120)
    save_traffic(window, out, "3c-recommend-traffic.png")  # the profile of everything sent so far
    save_hybrid(window, out)  # hybrid mode: llama.cpp first, vLLM brought in under load (stopped after the shot)

    compare = window.show_page("Compare")
    compare.ab_radio.setChecked(True)
    compare.levels_edit.setText("1, 4")
    compare.requests_spin.setValue(16)  # a few seconds per level on llama.cpp, so its curves have points
    compare.output_spin.setValue(32)
    compare.replay_check.setChecked(True)  # and the recorded traffic, open loop, on both engines
    compare.replay_since.setCurrentIndex(0)  # the last hour: this run's own traffic
    compare.replay_speed.setValue(2.0)
    compare.replay_max.setValue(32)
    wait_until(lambda: compare.replay_schedule is not None or bool(compare.replay_error), 30)
    if compare.start():
        if not wait_until(lambda: not compare.running, 1800):
            print("the A/B did not finish in time", file=sys.stderr)
    _save(window, out, 5, "Compare")
    save_compare_replay(window, out)
    save_traffic(window, out, "3d-recommend-crossover.png", panel_only=True)  # both engines measured now
    history = window.show_page("History")
    wait_until(lambda: not history.loading, 10)
    _save(window, out, 6, "History")


def save_compare_replay(window: Any, out: Path) -> Path | None:
    """The Compare page's results with the replay table in view (the page scrolled to it; charts without data
    are hidden, so no band is left blank)."""
    compare = window.show_page("Compare")
    if not compare.replay_table.isVisible():
        print("the A/B has no replay results: no replay screenshot", file=sys.stderr)
        return None
    compare.page_scroll.ensureWidgetVisible(compare.replay_table)  # the page scrolls; its tables do not
    wait_until(lambda: False, 0.6)
    return _grab(window, out / "5b-compare-replay.png")


def _default_request() -> Any:
    from desktop.core.planning.planner import ask

    return ask("llama.cpp", "demo")


def main(argv: list[str] | None = None) -> int:
    """`python -m desktop.ui.screenshots DIR --only hybrid`: one shot again, offscreen, without the full run that
    `switchyard gui --screenshots DIR` makes (every page, minutes with real engines)."""
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="python -m desktop.ui.screenshots")
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", choices=sorted(SHOTS), required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    args.out.mkdir(parents=True, exist_ok=True)
    from desktop.ui.app import create_app
    from desktop.ui.main_window import MainWindow

    app = create_app()
    window = MainWindow()
    window.show()
    QTimer.singleShot(0, lambda: take_screenshots(window, args.out, args.only))
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
