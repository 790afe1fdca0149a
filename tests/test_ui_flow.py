"""The desktop app's real flows with real engines: recommend → serve llama.cpp → live charts → switch to vLLM
behind the same URL while a client streams (no failed request) → stop; benchmarks from the Compare page in a
child process (a sweep against the endpoint, and the engine-vs-engine A/B) into charts, tables, reports and
history. The autouse fixture checks that no engine, benchmark process or worker outlives a test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import httpx
import pytest
from test_ui_pages import llama_ready, no_leaks, vllm_ready, window  # noqa: F401 - shared fixtures

pytestmark = [pytest.mark.gui, pytest.mark.engine, pytest.mark.llamacpp,
              pytest.mark.qt_log_ignore("propagateSizeHints")]


class StreamingClient(threading.Thread):
    """Streams completions through the stable endpoint back to back until stopped; counts what failed."""

    def __init__(self, url: str) -> None:
        super().__init__(name="streaming-client", daemon=True)
        self.url = url
        self.stop_event = threading.Event()
        self.completed = 0
        self.failures: list[str] = []

    def run(self) -> None:
        with httpx.Client(timeout=300, trust_env=False) as client:
            while not self.stop_event.is_set():
                try:
                    self._one(client)
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                self.stop_event.wait(0.2)  # pacing, so the engine being started keeps most of the CPU

    def _one(self, client: httpx.Client) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 8, "stream": True}
        tokens, done = 0, False
        with client.stream("POST", self.url + "/completions", json=body) as response:
            if response.status_code != 200:
                self.failures.append(f"HTTP {response.status_code}: {response.read()[:200]!r}")
                return
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    tokens += sum(1 for choice in chunk.get("choices", []) if choice.get("text"))
        if done and tokens:
            self.completed += 1
        else:
            self.failures.append(f"stream ended without [DONE] or tokens (tokens={tokens})")

    def finish(self) -> None:
        self.stop_event.set()
        self.join(timeout=120)
        assert not self.is_alive(), "the streaming client did not finish"


def _serve_recommended(win, qtbot):  # type: ignore[no-untyped-def]
    recommend = win.show_page("Recommend")
    recommend.compute()
    qtbot.waitUntil(lambda: recommend.recommendation is not None, timeout=60_000)
    assert recommend.recommendation.engine == "llama.cpp"  # CPU-only machine, empty history: the CPU default
    serve = win.page("Serve")
    with qtbot.waitSignal(serve.engine_ready, timeout=300_000):
        recommend.launch_button.click()
    assert win.stack.currentWidget() is serve
    return serve


def test_recommend_serve_llamacpp_charts_and_quit_stops_it(window, qtbot, llama_ready, demo_model) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """Recommendation → launch → ready behind the stable endpoint → live samples → log and phases → quitting
    stops the engine."""
    serve = _serve_recommended(window, qtbot)
    url = serve.endpoint_edit.text()
    assert url == window.session.endpoint_url and url.endswith("/v1")
    answer = httpx.post(url + "/completions", json={"prompt": "Hello", "max_tokens": 8}, timeout=60, trust_env=False)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
    qtbot.waitUntil(lambda: serve.charts["Utilization"].curves["cpu_percent"].buffer.count >= 2, timeout=30_000)
    memory = serve.charts["Memory"].curves["rss_gib"].buffer
    last = memory.last()
    assert last is not None and 0.01 < last[1] < 64  # GiB, on its own axis
    qtbot.waitUntil(lambda: serve.charts["Latency"].curves["proxy_ttft_ms"].buffer.count >= 1, timeout=30_000)
    assert {"api", "first_token"} <= set(serve.timeline.phases)
    assert serve.state_label.text() == "serving: llama.cpp"
    qtbot.waitUntil(lambda: "listening" in serve.log_pane.view.toPlainText(), timeout=10_000)
    serve.log_pane.search.setText("listening")
    assert serve.log_pane.status.text() == ""  # found
    serve.open_export(modal=False)  # the plan being served, not the form's
    dialog = serve.export_dialog
    qtbot.addWidget(dialog)
    dialog.set_format("shell")
    assert str(window.session.process.plan.model_path) in dialog.text.toPlainText()
    dialog.close()
    process = window.session.process
    window.close()
    qtbot.waitUntil(lambda: not window.isVisible(), timeout=120_000)
    assert not process.is_running()


def test_compare_sweeps_the_endpoint_in_a_child_process_into_charts_report_and_history(window, qtbot, llama_ready, demo_model) -> None:  # type: ignore[no-untyped-def]  # noqa: E501, F811
    serve = _serve_recommended(window, qtbot)
    compare = window.show_page("Compare")
    compare.endpoint_radio.setChecked(True)
    compare.levels_edit.setText("1, 4")
    compare.requests_spin.setValue(12)
    compare.output_spin.setValue(16)
    assert compare.start()
    assert window.benchmark_running()
    qtbot.waitUntil(lambda: not compare.running, timeout=300_000)
    assert compare.result is not None, compare.notice.text()
    assert compare.buckets_received >= 1
    assert compare.live_charts["output_tokens"].curves["endpoint:output_tokens"].buffer.count >= 1
    table = compare.results_table
    assert [table.item(r, 0).text() for r in range(table.rowCount())] == ["concurrency 1", "concurrency 4"]
    assert all(table.item(r, 1).text() == "12" and table.item(r, 2).text() == "0" for r in range(2))
    assert Path(compare.report["html"]).is_file() and compare.export_button.isEnabled()
    history = window.show_page("History")
    qtbot.waitUntil(lambda: history.table.rowCount() == 2, timeout=10_000)  # the launch, then the sweep
    assert [run.kind for run in history.runs] == ["bench", "launch"]
    assert history.runs[0].report_path == compare.report["html"]
    assert serve.samples_received > 0  # the endpoint's own telemetry saw the benchmark's requests


def test_compare_stop_keeps_what_the_sweep_measured(window, qtbot, llama_ready, demo_model) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    _serve_recommended(window, qtbot)
    compare = window.show_page("Compare")
    compare.endpoint_radio.setChecked(True)
    compare.levels_edit.setText("2")
    compare.requests_spin.setValue(100_000)
    assert compare.start()
    qtbot.waitUntil(lambda: compare.buckets_received >= 2, timeout=120_000)
    compare.stop_button.click()
    qtbot.waitUntil(lambda: not compare.running, timeout=120_000)
    assert compare.result is not None and compare.result["aborted"] == "stopped by the user"
    assert "Incomplete: stopped by the user" in compare.notice.text()
    assert int(compare.results_table.item(0, 1).text()) >= 1


@pytest.mark.vllm
def test_flow_recommend_serve_llamacpp_switch_to_vllm_stop(window, qtbot, llama_ready, vllm_ready, demo_model) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """recommend → serve llama.cpp → charts receive samples → switch to vLLM behind the same URL while a client
    streams (no request fails) → stop; no engine left, thread pool idle (checked by the fixture)."""
    window.session.vllm_eager = True  # skips torch.compile: the switch takes about a minute less on CPU
    serve = _serve_recommended(window, qtbot)
    url = serve.endpoint_edit.text()
    qtbot.waitUntil(lambda: serve.samples_received > 0, timeout=30_000)
    client = StreamingClient(url)
    client.start()
    try:
        qtbot.waitUntil(lambda: client.completed >= 2, timeout=60_000)
        outcome: list[object] = []
        window.session.switched.connect(outcome.append)
        window.session.failed.connect(outcome.append)
        serve.switch_button.click()
        qtbot.waitUntil(lambda: bool(outcome), timeout=900_000)
        result = outcome[0]
        assert not isinstance(result, str), f"the switch failed: {result}"
        after_switch = client.completed
        samples_at_switch = serve.samples_received
        qtbot.waitUntil(lambda: client.completed >= after_switch + 3, timeout=120_000)  # now served by vLLM
        qtbot.waitUntil(lambda: serve.samples_received > samples_at_switch, timeout=30_000)
    finally:
        client.finish()
    assert (result.from_engine, result.to_engine) == ("llama.cpp", "vllm")
    assert client.failures == [] and result.failed_requests == 0
    assert client.completed >= 5
    assert "Switched llama.cpp → vllm" in serve.switch_label.text() and "0 failed requests" in serve.switch_label.text()
    assert serve.endpoint_edit.text() == url  # the same URL before and after
    assert window.session.process.adapter.name == "vllm" and window.session.process.plan.eager
    assert serve.state_label.text() == "serving: vLLM"
    with qtbot.waitSignal(window.session.stopped, timeout=120_000):
        serve.stop_button.click()
    assert not window.session.is_running()
    assert serve.start_button.isEnabled()


@pytest.mark.vllm
def test_compare_ab_llamacpp_vs_vllm_live_results_verdict_and_report(window, qtbot, llama_ready, vllm_ready, demo_model, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: E501, F811
    """The real A/B from the Compare page: both engines start in turn in the child process, live buckets land in
    per-engine curves, the side-by-side table and verdict come from desktop.core.measure.ab, the report from reports."""
    compare = window.show_page("Compare")
    compare.levels_edit.setText("1, 2")
    compare.requests_spin.setValue(16)  # a few seconds per level even on llama.cpp: live buckets for both
    compare.output_spin.setValue(32)
    job = compare.job_for_inputs()
    job["config"]["eager"] = True  # vLLM without torch.compile (`ab --eager`): a minute sooner, the same page
    assert compare.start(job)
    qtbot.waitUntil(lambda: not compare.running, timeout=1_500_000)
    assert compare.result is not None, compare.notice.text()
    assert compare.result["errors"] == [], compare.result["errors"]
    curves = compare.live_charts["output_tokens"].curves
    assert curves["llama.cpp:output_tokens"].buffer.count >= 1 and curves["vllm:output_tokens"].buffer.count >= 1
    table = compare.results_table
    cells = {table.item(r, 0).text(): [table.item(r, c).text() for c in (1, 2, 3)] for r in range(table.rowCount())}
    for phase in ("T1: health OK", "T2: first token", "T3: first request done"):
        row = cells[f"Cold start {phase} (s)"]
        assert all(value != "–" for value in row), row
    assert all(value != "–" for value in cells["concurrency 2: output tok/s"])
    assert compare.verdict_label.text().startswith("Verdict: ")
    written = compare.export_to(tmp_path / "exported")
    assert sorted(p.name for p in written) == ["ab.csv", "ab.html", "ab.json"]
    assert json.loads((tmp_path / "exported" / "ab.json").read_text())["kind"] == "ab"
    history = window.show_page("History")
    qtbot.waitUntil(lambda: history.table.rowCount() == 1, timeout=10_000)
    assert history.runs[0].kind == "ab"


def _launch_demo(win, qtbot):  # type: ignore[no-untyped-def]
    from desktop.core.planning.planner import ask

    serve = win.show_page("Serve")
    with qtbot.waitSignal(serve.engine_ready, timeout=300_000):
        serve.launch(ask("llama.cpp", "demo", {"slots": 2}))
    return serve


def test_try_it_chat_streams_through_the_endpoint_and_stops(window, qtbot, llama_ready, demo_model) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """The chat pane asks the stable endpoint (not the engine) like any client, streams the answer into the
    conversation with its speed, keeps the conversation, and Stop ends a long answer at once."""
    from PySide6.QtCore import Qt

    serve = _launch_demo(window, qtbot)
    chat = serve.chat
    serve.bottom_tabs.setCurrentWidget(chat)
    assert chat.base_url == window.session.endpoint_url and chat.send_button.isEnabled()
    requests_before = window.session.proxy.counters.get("requests", 0)
    chat.system_edit.setText("Answer in one short sentence.")
    chat.temperature_spin.setValue(0.0)
    chat.max_tokens_spin.setValue(16)
    chat.input.setPlainText("Say hello.")
    with qtbot.waitSignal(chat.answered, timeout=120_000) as answered:
        qtbot.mouseClick(chat.send_button, Qt.MouseButton.LeftButton)
    answer = answered.args[0]
    assert answer.text and not answer.stopped and answer.output_tokens > 0
    assert answer.text.strip()[:20] in chat.transcript.toPlainText()
    assert "tokens/s" in chat.stats_label.text() and "first token" in chat.stats_label.text()
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]
    assert window.session.proxy.counters.get("requests", 0) > requests_before  # through the endpoint
    assert chat.send_button.isEnabled() and not chat.stop_button.isEnabled() and not chat.input.toPlainText()

    chat.max_tokens_spin.setValue(1500)
    assert chat.send("Count from one to one thousand.")
    assert not chat.send_button.isEnabled() and chat.stop_button.isEnabled()
    qtbot.waitUntil(lambda: len(chat._reply) >= 3, timeout=60_000)
    with qtbot.waitSignal(chat.answered, timeout=30_000) as stopped:
        qtbot.mouseClick(chat.stop_button, Qt.MouseButton.LeftButton)
    assert stopped.args[0].stopped and stopped.args[0].output_tokens < 1500
    assert "stopped" in chat.stats_label.text()
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
    chat.clear()
    assert chat.messages == [] and not chat.transcript.toPlainText()


def _cli_off_thread(qtbot, *args: str) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    """Run the CLI while the Qt event loop keeps turning (the app answers some control calls on its GUI thread)."""
    done: list[subprocess.CompletedProcess[str]] = []
    thread = threading.Thread(target=lambda: done.append(subprocess.run(  # noqa: S603 - our own CLI
        [sys.executable, "-m", "desktop", *args], capture_output=True, text=True, timeout=300,
        env={**os.environ})))
    thread.start()
    qtbot.waitUntil(lambda: not thread.is_alive(), timeout=310_000)
    return done[0]


def test_app_endpoint_is_visible_to_status_switch_and_stop(window, qtbot, llama_ready, demo_model, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """The app's endpoint registers like `switchyard serve --endpoint`: `status` sees it, `switch` moves it (the
    Serve page follows), `stop` stops its engines while the app stays; closing the app unregisters it."""
    from desktop.core.serving import control

    serve = _launch_demo(window, qtbot)
    port = window.session.proxy.port
    result = _cli_off_thread(qtbot, "status", "--json", "--port", str(port))
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["kind"] == "app" and status["pid"] == os.getpid() and status["state"] == "serving"
    assert status["openai_base_url"] == window.session.endpoint_url and status["active"]["engine"] == "llama.cpp"
    old_pid = status["active"]["pid"]

    refused = _cli_off_thread(qtbot, "switch", "--to", "llama.cpp", "--port", str(port))
    assert refused.returncode != 0 and "already serves" in refused.stderr and "Traceback" not in refused.stderr
    assert not window.session.busy and serve.notice.level == "error"  # the page shows it too
    copy = tmp_path / "demo-copy.gguf"
    shutil.copyfile(demo_model.gguf_path, copy)
    switched = _cli_off_thread(qtbot, "switch", "--to", "llama.cpp", "--model", str(copy), "--port", str(port),
                               "--json")
    assert switched.returncode == 0, switched.stderr
    assert json.loads(switched.stdout)["to_engine"] == "llama.cpp"
    assert window.session.process.plan.model_path == copy.resolve()
    assert serve.switch_label.text().startswith("Switched llama.cpp → llama.cpp")
    assert window.session.process.pid != old_pid and not window.session.busy

    stopped = _cli_off_thread(qtbot, "stop", "--port", str(port))
    assert stopped.returncode == 0, stopped.stderr
    assert not window.session.is_running() and serve.state_label.text() == "stopped"
    assert not serve.chat.send_button.isEnabled()
    after = json.loads(_cli_off_thread(qtbot, "status", "--json", "--port", str(port)).stdout)
    assert after["kind"] == "app" and after["active"] is None  # the app and its endpoint stay
    window.close()
    qtbot.waitUntil(lambda: not window.isVisible(), timeout=120_000)
    assert not control.discovery_path(port).exists()
