"""Issue 25 on the Compare page: an A/B that also replays the endpoint's recorded traffic (`ab --replay` from the
GUI). The form says what the request log holds for the span, the child process reads the same log and sends it open
loop to both engines after their sweeps, and the replay table shows what each engine did with it. Real parts: the
history file, the benchmark child process, a real llama-server on each side (one started by the A/B, one attached)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from test_ui_pages import llama_ready, no_leaks, window  # noqa: F401 - shared fixtures

from desktop.core.storage.history import Store

pytestmark = [pytest.mark.gui, pytest.mark.qt_log_ignore("propagateSizeHints")]

RECORDED = 12
GAP_S = 0.5


def _record_traffic(count: int = RECORDED, gap: float = GAP_S) -> None:
    """`count` requests `gap` seconds apart a minute ago, as the endpoint's request log keeps them (no bodies)."""
    start = time.time() - 60.0
    rows = [{"t": start + i * gap, "path": "/v1/completions", "model": "switchyard", "engine": "llama.cpp",
             "status": 200, "prompt_tokens": 48 + 8 * (i % 3), "output_tokens": 8 + (i % 4), "ttft_s": 0.1,
             "e2e_s": 0.4} for i in range(count)]
    with Store() as store:
        store.add_requests(rows)


def _cells(table: Any) -> dict[str, list[str]]:
    return {table.item(r, 0).text(): [table.item(r, c).text() for c in range(1, table.columnCount())]
            for r in range(table.rowCount())}


def test_compare_replay_says_what_it_will_send_and_refuses_an_empty_log(window, qtbot) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    compare = window.show_page("Compare")
    assert not compare.replay_info.isVisible() and not compare.replay_since.isEnabled()
    compare.replay_check.setChecked(True)
    qtbot.waitUntil(lambda: bool(compare.replay_error), timeout=30_000)
    assert "no recorded requests to replay" in compare.replay_info.text()
    compare.levels_edit.setText("1")
    assert not compare.start()  # nothing to replay: refused before any engine starts
    assert "no recorded requests to replay" in compare.notice.text() and compare.notice.level == "warning"
    assert compare.job is None and not compare.running

    _record_traffic()
    compare.replay_since.setCurrentIndex(0)  # the last hour: read again
    qtbot.waitUntil(lambda: compare.replay_schedule is not None, timeout=30_000)
    span = (RECORDED - 1) * GAP_S
    assert compare.replay_schedule["requests"] == RECORDED and compare.replay_schedule["span_s"] == span
    assert compare.replay_info.text().startswith(f"Replays {RECORDED} recorded requests over {span:.1f} s (none "
                                                 "with a captured body")
    compare.replay_speed.setValue(4.0)  # the send time follows the speed without reading the log again
    assert compare.replay_info.text().endswith(f"sent in {span / 4:.1f} s per engine at 4x")
    compare.replay_max.setValue(5)
    qtbot.waitUntil(lambda: compare.replay_schedule is not None and compare.replay_schedule["requests"] == 5,
                    timeout=30_000)
    job = compare.job_for_inputs()
    assert job["config"]["replay"] == {"since": "1h", "max_requests": 5} and job["config"]["replay_speed"] == 4.0
    compare.endpoint_radio.setChecked(True)  # a sweep of the endpoint replays nothing
    assert not compare.replay_options.isEnabled() and not compare.replaying()
    compare.ab_radio.setChecked(True)
    qtbot.waitUntil(lambda: compare.replay_schedule is not None, timeout=30_000)
    compare.replay_check.setChecked(False)
    assert "replay" not in compare.job_for_inputs()["config"] and not compare.replay_info.isVisible()


@pytest.mark.engine
@pytest.mark.llamacpp
def test_compare_ab_replays_the_recorded_traffic_on_both_engines(window, qtbot, llama_ready, llama_server,  # type: ignore[no-untyped-def]  # noqa: F811
                                                                 demo_model, tmp_path: Path) -> None:
    """llama.cpp started by the A/B against an attached llama-server: both get the sweep and then the 12 recorded
    requests open loop; the replay table shows the child's numbers for each side and the report has the replay."""
    _record_traffic()
    compare = window.show_page("Compare")
    compare.levels_edit.setText("1")
    compare.requests_spin.setValue(4)
    compare.output_spin.setValue(8)
    compare.replay_check.setChecked(True)
    compare.replay_since.setCurrentIndex(0)
    compare.replay_speed.setValue(4.0)
    qtbot.waitUntil(lambda: compare.replay_schedule is not None, timeout=30_000)
    job = compare.job_for_inputs()
    job["config"]["engines"] = ["llama.cpp", f"endpoint:{llama_server.base_url}"]  # the form offers adapters only
    job["report_dir"] = str(tmp_path / "report")
    assert compare.start(job)
    assert "then a replay of the recorded traffic at 4x" in compare.notice.text()
    qtbot.waitUntil(lambda: not compare.running, timeout=600_000)
    assert compare.result is not None, compare.notice.text()
    replay = compare.result["replay"]
    assert replay["schedule"]["requests"] == RECORDED and replay["speed"] == 4.0
    a, b = "llama.cpp", f"endpoint:{llama_server.base_url}"
    assert replay["engines"][a]["completed"] == RECORDED and replay["engines"][b]["completed"] == RECORDED
    assert replay["engines"][a]["failed"] == 0 and replay["engines"][b]["failed"] == 0
    for engine in compare.result["engines"]:  # the closed-loop sweep ran too, before the replay
        assert engine["repetitions"][0]["sweep"]["levels"][0]["completed"] == 4

    table = compare.replay_table
    assert table.isVisible()
    cells = _cells(table)
    assert cells["completed"][:2] == [str(RECORDED), str(RECORDED)] and cells["failed"][:2] == ["0", "0"]
    for key, label, digits in (("p95_ttft_ms", "TTFT p95 (ms)", 0), ("output_throughput", "output tok/s", 1),
                               ("send_lag_p95_ms", "send lag p95 (ms, late vs the schedule)", 1)):
        va, vb = replay["engines"][a][key], replay["engines"][b][key]
        assert cells[label][:2] == [f"{va:.{digits}f}", f"{vb:.{digits}f}"]
        if key != "send_lag_p95_ms":
            assert cells[label][2] == f"{vb / va:.2f}"
    assert f"your replayed traffic ({RECORDED} requests at 4x)" in compare.verdict_label.text()
    html = Path(compare.report["html"]).read_text()
    assert "Replay of the recorded traffic (open loop, 4x)" in html


def test_compare_replay_table_hides_for_an_ab_without_replay(window, qtbot, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """A result without a replay leaves no stale replay table from an earlier one."""
    from desktop.ui.pages.compare import replay_rows

    result = {"kind": "ab", "engines": [{"engine": "llama.cpp", "repetitions": []},
                                        {"engine": "vllm", "repetitions": []}],
              "replay": {"schedule": {"requests": 3, "span_s": 1.0}, "speed": 1.0,
                         "engines": {"llama.cpp": {"completed": 3, "failed": 0, "output_throughput": 20.0,
                                                   "p95_ttft_ms": 50.0},
                                     "vllm": {"completed": 2, "failed": 1, "output_throughput": 30.0,
                                              "p95_ttft_ms": 100.0}}}}
    headers, rows = replay_rows(result)
    rows_by = {row[0]: row[1:4] for row in rows}
    assert rows_by["failed"] == ["0", "1", "–"]  # counts get no ratio
    assert rows_by["output tok/s"] == ["20.0", "30.0", "1.50"] and rows_by["TTFT p95 (ms)"][2] == "2.00"
    assert rows_by["E2E p95 (ms)"] == ["–", "–", "–"]  # not in the result: a dash, not a made-up 0
    from desktop.core.engines import get_adapter

    # which way is better, per metric: fewer failures, more tok/s, lower TTFT
    llama, vllm = get_adapter("llama.cpp").display_name, get_adapter("vllm").display_name
    verdicts = {row[0]: row[4] for row in rows}
    assert verdicts["failed"] == f"{llama} (lower is better)"
    assert verdicts["output tok/s"] == f"{vllm} (higher is better)"
    assert verdicts["TTFT p95 (ms)"] == f"{llama} (lower is better)" and verdicts["E2E p95 (ms)"] == "–"
    compare = window.show_page("Compare")
    compare.show_result({"result": result, "report": None, "run_id": None})
    assert compare.replay_table.isVisible() and compare.replay_table.rowCount() == len(rows)
    compare.show_result({"result": {**result, "replay": None}, "report": None, "run_id": None})
    assert not compare.replay_table.isVisible()
