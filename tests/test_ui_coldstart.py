"""The Serve page while engines start and switch, with the real engines offscreen: a start's phases appear live and
in order on the cold-start bar, whose final durations are the ones `serve --json` prints (ColdStart.to_json);
both engines' states are named during a switch, the serving engine's throughput chart keeps gaining points and
every chart marks the hand-over; the engine log shows no line caused by the app's own polling after 30 scrapes;
the models editor round-trips the models.yaml the CLI reads."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from test_ui_flow import StreamingClient
from test_ui_pages import llama_ready, no_leaks, vllm_ready, window  # noqa: F401 - shared fixtures

pytestmark = [pytest.mark.gui, pytest.mark.qt_log_ignore("propagateSizeHints")]

POLLING = re.compile(r'"GET /(metrics|health|slots)\b|request: GET /(metrics|health|slots)\b')
SCRAPE_INTERVAL_S = 0.2  # 30 scrapes in 6 s: what a 1 Hz telemetry does in 30 s


class ScrapeCounter:
    """Counts telemetry scrapes of each engine (one `cpu_percent` sample per scrape)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def __call__(self, samples: list[Any]) -> None:
        with self.lock:
            for sample in samples:
                if sample.series == "cpu_percent":
                    self.counts[sample.source] = self.counts.get(sample.source, 0) + 1

    def of(self, engine: str) -> int:
        with self.lock:
            return sum(n for source, n in self.counts.items() if source.startswith(engine + "@"))


def _pane_lines_since(serve: Any, header: str) -> list[str]:
    text = serve.log_pane.text_shown().splitlines()
    starts = [i for i, line in enumerate(text) if line.startswith("────") and header in line]
    return text[starts[-1]:] if starts else []


def _row(serve: Any, process: Any) -> Any:
    return serve.timeline.rows.get(id(process))


def _in_order(keys: list[str]) -> bool:
    from desktop.core.runtime.supervisor import COLD_START_PHASES

    order = [phase.key for phase in COLD_START_PHASES]
    indexes = [order.index(key) for key in keys]
    return indexes == sorted(indexes) and len(set(indexes)) == len(indexes)


@pytest.mark.engine
@pytest.mark.llamacpp
@pytest.mark.vllm
def test_switch_told_live_phases_bar_charts_and_quiet_log(window, qtbot, llama_ready, vllm_ready, demo_model) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    from desktop.core.planning.planner import ask

    session = window.session
    session.vllm_eager = True  # no torch.compile: the switch is a minute shorter on CPU (the phases still show)
    session.telemetry_interval = SCRAPE_INTERVAL_S
    serve = window.show_page("Serve")
    with qtbot.waitSignal(serve.engine_ready, timeout=300_000):
        serve.launch(ask("llama.cpp", "demo", {"slots": 2}))
    llama = session.process
    scrapes = ScrapeCounter()
    session.telemetry.subscribe(scrapes)

    # the final bar is the start's phases exactly as `serve --json` prints them (ColdStart.to_json)
    printed = session.manager.status()["active"]["cold_start"]["phases"]  # what `serve --endpoint --json` prints
    row = _row(serve, llama)
    assert row is not None and not row.running
    assert row.phases == printed == llama.cold_start.to_json()["phases"]
    assert [p["phase"] for p in row.phases][-3:] == ["api", "first_token", "first_request"]
    assert _in_order([p["phase"] for p in row.phases])
    from desktop.core.runtime.supervisor import PHASE_BY_KEY

    summary = serve.timeline.summary(row)  # the line under the bar: every phase's duration, never overlapping
    for phase in row.phases:
        assert f"{PHASE_BY_KEY[phase['phase']].short} {phase['seconds']:.1f} s" in summary
        assert f"{phase['label']} {phase['seconds']:.2f} s" in serve.timeline.toolTip()
    assert serve.state_label.text() == "serving: llama.cpp"
    assert "llama.cpp serves this endpoint" in serve.chat.transcript.placeholderText()

    # 30 scrapes of llama.cpp (/metrics and /slots each time): none of them reaches the log pane
    qtbot.waitUntil(lambda: scrapes.of("llama.cpp") >= 30, timeout=60_000)
    qtbot.waitUntil(lambda: not session._pending_lines, timeout=10_000)  # the pane has what the engine wrote
    lines = _pane_lines_since(serve, "llama.cpp")
    assert lines and not [line for line in lines if POLLING.search(line)]

    # switch to vLLM while a client streams: both states named, vLLM's row grows live, llama.cpp's charts go on
    client = StreamingClient(serve.endpoint_edit.text())
    client.start()
    throughput = serve.charts["Throughput"].curves["generation_tokens_per_s"].buffer
    snapshots: list[tuple[float, list[str], bool]] = []
    states: list[str] = []
    outcome: list[object] = []
    try:
        qtbot.waitUntil(lambda: client.completed >= 2, timeout=60_000)
        session.switched.connect(outcome.append)
        session.failed.connect(outcome.append)
        serve.switch_clicked()
        qtbot.waitUntil(lambda: serve.engines()[1] is not None, timeout=120_000)
        vllm = serve.engines()[1]
        points_at_start = throughput.count

        def observe() -> bool:
            found = _row(serve, vllm)
            if found is not None and found.phases:
                snapshots.append((float(found.phases[-1]["end_s"]), [p["phase"] for p in found.phases],
                                  bool(found.phases[-1].get("running"))))
            states.append(serve.state_label.text())
            return bool(outcome)

        qtbot.waitUntil(observe, timeout=900_000)
        result = outcome[0]
        assert not isinstance(result, str), f"the switch failed: {result}"
        during = [t for t in snapshots if t[2]]
        points_during = throughput.count - points_at_start
    finally:
        client.finish()
    assert client.failures == []
    # the serving engine's throughput chart gained points while vLLM started
    assert points_during >= 3, f"llama.cpp's throughput chart gained {points_during} points during the switch"
    # vLLM's row grew live: its phases in order, more of them over time, the running one growing
    assert len({t[0] for t in during}) >= 5
    assert all(_in_order(keys) for _t, keys, _running in snapshots)
    assert len(during[-1][1]) > len(during[0][1])
    assert any(re.fullmatch(r"serving: llama\.cpp · starting: vLLM \d+ s, .+", state) for state in states)
    # the final vLLM bar is its to_json; the llama.cpp row stays above it (one row per start)
    final = _row(serve, vllm)
    assert final is not None and not final.running and final.phases == vllm.cold_start.to_json()["phases"]
    assert list(serve.timeline.rows)[-2:] == [id(llama), id(vllm)]
    # every chart marks the hand-over
    assert all(chart.marks and "vLLM" in chart.marks[-1][1] for chart in serve.charts.values())
    assert serve.state_label.text() == "serving: vLLM"

    # 30 scrapes of vLLM: its access log keeps the app's /metrics and /health out of the pane
    before = scrapes.of("vllm")
    qtbot.waitUntil(lambda: scrapes.of("vllm") >= before + 30, timeout=60_000)
    qtbot.waitUntil(lambda: not session._pending_lines, timeout=10_000)
    lines = _pane_lines_since(serve, "vLLM")
    assert lines and not [line for line in lines if POLLING.search(line)]
    assert any("POST /v1/completions" in line for line in lines)  # clients' requests are still logged
    with qtbot.waitSignal(session.stopped, timeout=120_000):
        serve.stop_button.click()


def test_models_editor_round_trips_the_models_yaml_the_cli_reads(window, qtbot, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    from desktop.core.serving.fleet import load_models_config
    from desktop.ui.models_editor import ModelsEditor

    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - {name: chat, engine: llama.cpp, model: demo, ttl: 300}\n"
                    "  - {name: big, engine: vllm, model: demo, ctx: 4096, parallel: 2}\n", encoding="utf-8")
    original = load_models_config(path)
    serve = window.show_page("Serve")
    editor = serve.models_editor
    serve.bottom_tabs.setCurrentWidget(editor)
    assert editor.load(str(path))
    assert [editor.table.item(r, 0).text() for r in range(editor.table.rowCount())] == ["chat", "big"]
    assert editor.table.item(0, 5).text() == "300 s" and editor.table.item(1, 6).text() == "not loaded"

    dialog = editor.add(modal=False)
    dialog.name_edit.setText("chat")  # taken: refused with the CLI parser's own words, the dialog stays open
    assert not dialog.try_accept() and "used twice" in dialog.notice.text() and dialog.isVisible()
    dialog.name_edit.setText("small")
    dialog.ctx_spin.setValue(1024)
    assert dialog.try_accept()
    editor.table.selectRow(1)
    edit = editor.edit_selected(modal=False)
    assert edit is not None
    edit.parallel_spin.setValue(8)
    assert edit.try_accept()
    editor.table.selectRow(0)
    editor.remove_selected()
    assert editor.save()

    saved = load_models_config(path)  # what `switchyard serve --config` will read
    assert [(m.name, m.engine, m.ctx, m.parallel) for m in saved.models] == [("big", "vllm", 4096, 8),
                                                                              ("small", "llama.cpp", 1024, 4)]
    fresh = ModelsEditor()
    qtbot.addWidget(fresh)
    assert fresh.load(str(path)) and fresh.entries == editor.entries
    assert fresh.save(str(tmp_path / "again.yaml"))
    assert load_models_config(tmp_path / "again.yaml").models == saved.models
    assert original.models[1].name == "big"


def test_prepare_vllm_button_reports_a_bad_model_and_starts_nothing(window, qtbot, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    serve = window.show_page("Serve")
    serve.model_edit.setText(str(tmp_path / "no-such-model"))
    assert serve.prepare_vllm() and not serve.prepare_button.isEnabled()
    assert not serve.prepare_vllm()  # one at a time
    qtbot.waitUntil(lambda: not serve.preparing, timeout=60_000)
    assert serve.notice.level == "error" and serve.notice.text().startswith("Preparing vLLM failed:")
    assert "no-such-model" in serve.notice.text() and serve.prepare_button.isEnabled()
    assert window.session.manager is None  # no endpoint, no engine
