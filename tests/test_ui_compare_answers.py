"""Issue 52, Compare answers first and charts that do not hide their answer (offscreen):
- the Compare page, handed an A/B result made by hand, names the winner per concurrency over the results (the
  engine worked out here from the numbers), says which way each metric is better, marks the better figure, and
  shows every row of its tables (no "three and a half rows");
- no blank band: charts without data are hidden, charts with data take the room that is left;
- a live chart's legend names a series only once it has a point;
- the traffic panel's mean is not drawn inside the plot's data rectangle.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from test_ui_pages import no_leaks, window  # noqa: F401 - shared fixtures

pytestmark = [pytest.mark.gui, pytest.mark.qt_log_ignore("propagateSizeHints")]

LLAMA, VLLM = "llama.cpp", "vllm"
BAND_PX = 48  # a gap taller than a group box's title and margins is a blank band
# per concurrency: (llama.cpp tok/s, vLLM tok/s, llama.cpp TTFT p50 / p95 ms, vLLM TTFT p50 / p95 ms)
LEVELS = {1: (45.0, 30.0, (41.0, 60.0), (120.0, 140.0)),
          4: (60.0, 75.0, (90.0, 180.0), (110.0, 170.0)),
          8: (90.0, 210.0, (300.0, 400.0), (150.0, 250.0))}


def _cell(a: float, b: float) -> dict[str, Any]:
    return {LLAMA: {"mean": a, "n": 1}, VLLM: {"mean": b, "n": 1}, "ratio": {"mean": b / a, "n": 1}}


def _result(replay: bool = False) -> dict[str, Any]:
    """An A/B result's JSON as desktop.core.measure.ab writes it, with numbers chosen by hand."""
    comparison = [{"concurrency": c, "output_throughput": _cell(ta, tb), "median_ttft_ms": _cell(pa[0], pb[0]),
                   "p95_ttft_ms": _cell(pa[1], pb[1]), "request_throughput": _cell(ta / 32, tb / 32)}
                  for c, (ta, tb, pa, pb) in LEVELS.items()]
    result: dict[str, Any] = {
        "kind": "ab", "engines": [{"engine": LLAMA, "repetitions": []}, {"engine": VLLM, "repetitions": []}],
        "cold_start": {"t1_health_s": _cell(0.3, 60.0), "t2_first_token_s": _cell(0.4, 61.0),
                       "t3_first_request_s": _cell(0.5, 62.0), "peak_rss_mib": {LLAMA: 150.0, VLLM: 3100.0}},
        "comparison": comparison, "amortization": {"verdict": "hand-made: no verdict computed"}}
    if replay:
        result["replay"] = {"speed": 2.0, "schedule": {"requests": 12, "span_s": 6.0, "prompt_tokens_mean": 100,
                                                       "output_tokens_mean": 20},
                            "engines": {LLAMA: {"completed": 12, "failed": 0, "output_throughput": 20.0,
                                                "p95_ttft_ms": 300.0},
                                        VLLM: {"completed": 12, "failed": 0, "output_throughput": 25.0,
                                               "p95_ttft_ms": 200.0}}}
    return result


def _names() -> tuple[str, str]:
    from desktop.core.engines import get_adapter

    return get_adapter(LLAMA).display_name, get_adapter(VLLM).display_name


def _every_row_in_view(table: Any) -> bool:
    rows = sum(table.rowHeight(r) for r in range(table.rowCount()))
    return table.rowCount() > 0 and table.viewport().height() >= rows and table.verticalScrollBar().maximum() == 0


def _drawn(item: Any) -> Any:
    """What a page layout item puts on screen: a box's visible children (an empty box draws nothing), a plain
    widget or a row of buttons as laid out; None for a spacer or a hidden widget."""
    if item.spacerItem() is not None or item.isEmpty():
        return None
    widget = item.widget()
    if widget is not None and widget.layout() is not None:
        inside = widget.childrenRect()
        return None if inside.isEmpty() else inside.translated(widget.pos())
    return item.geometry()


def _visible_gaps(compare: Any) -> list[int]:
    """Vertical gaps between what the page draws, top to bottom (a blank band is a large one)."""
    layout = compare.page_scroll.widget().layout()
    shown = [rect for rect in (_drawn(layout.itemAt(i)) for i in range(layout.count())) if rect is not None]
    return [below.top() - above.bottom() for above, below in zip(shown, shown[1:], strict=False)]


def test_compare_names_the_winner_per_level_marks_the_better_side_and_shows_every_row(window, qtbot) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    llama, vllm = _names()
    window.resize(1280, 1400)  # taller than the page needs: room that could be left as a blank band
    compare = window.show_page("Compare")
    compare.show_result({"result": _result(), "report": None, "run_id": None})
    verdict = compare.verdict_label.text()
    # by hand, from LEVELS: c=1 45 > 30 tok/s, c=4 75 > 60, c=8 210 > 90
    assert f"c=1: {llama}, 45.0 vs 30.0 tok/s; TTFT p95 60 vs 140 ms" in verdict
    assert f"c=4: {vllm}, 75.0 vs 60.0 tok/s; TTFT p95 170 vs 180 ms" in verdict
    assert f"c=8: {vllm}, 210.0 vs 90.0 tok/s; TTFT p95 250 vs 400 ms" in verdict
    table = compare.results_table
    # the answer first: the verdict sits over the table
    assert compare.verdict_label.isVisible() and compare.verdict_label.geometry().bottom() <= table.geometry().top()
    header = table.horizontalHeaderItem(4).text()
    assert "tok/s, req/s: higher" in header and "ms" in header and "lower" in header
    assert table.horizontalHeaderItem(3).text() == f"{vllm} / {llama}"
    assert "whether larger is better depends on the metric" in table.horizontalHeaderItem(3).toolTip()
    rows = {table.item(r, 0).text(): r for r in range(table.rowCount())}
    better = {name: table.item(r, 4).text() for name, r in rows.items()}
    assert better["concurrency 1: output tok/s"] == f"{llama} (higher is better)"
    assert better["concurrency 1: TTFT p50 (ms)"] == f"{llama} (lower is better)"  # 41 < 120
    assert better["concurrency 8: TTFT p50 (ms)"] == f"{vllm} (lower is better)"  # 150 < 300
    assert better["concurrency 8: requests/s"] == f"{vllm} (higher is better)"
    assert better["Peak memory (MiB, process tree)"] == f"{llama} (lower is better)"  # 150 < 3100 MiB

    def bold(name: str) -> list[bool]:
        return [table.item(rows[name], c).font().bold() for c in (1, 2)]

    assert bold("concurrency 1: output tok/s") == [True, False]
    assert bold("concurrency 8: output tok/s") == [False, True]
    assert bold("Cold start T1: health OK (s)") == [True, False]  # 0.3 s < 60 s
    assert table.rowCount() == 3 + 1 + 4 * len(LEVELS)  # cold start T1-T3, peak memory, 4 figures per level
    qtbot.waitUntil(lambda: _every_row_in_view(table), timeout=5_000)
    # no data came for the live charts (a result handed in): none is shown, no band is left blank
    assert not compare.charts_box.isVisible()
    assert all(gap <= BAND_PX for gap in _visible_gaps(compare)), _visible_gaps(compare)


def test_compare_replay_leaves_no_blank_band_and_charts_with_data_take_the_room(window, qtbot) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    llama, vllm = _names()
    compare = window.show_page("Compare")
    # one second of the run per engine: output tokens and requests in flight came, TTFT did not
    for engine in (LLAMA, VLLM):
        compare.on_bucket({"engine": engine, "output_tokens": 50.0, "ttft_p50_ms": None, "in_flight": 2})
    compare.show_result({"result": _result(replay=True), "report": None, "run_id": None})
    assert compare.replay_table.isVisible()
    replay = {compare.replay_table.item(r, 0).text(): compare.replay_table.item(r, 4).text()
              for r in range(compare.replay_table.rowCount())}
    assert replay["TTFT p95 (ms)"] == f"{vllm} (lower is better)" and replay["failed"] == "same"
    assert f"your replayed traffic (12 requests at 2x): {vllm}, TTFT p95 200 ms vs 300 ms" \
        in compare.verdict_label.text()
    for table in (compare.results_table, compare.replay_table):
        qtbot.waitUntil(lambda table=table: _every_row_in_view(table), timeout=5_000)
    charts = compare.live_charts
    assert compare.charts_box.isVisible()
    assert charts["output_tokens"].isVisible() and charts["in_flight"].isVisible()
    assert not charts["ttft_p50_ms"].isVisible()  # no point: no empty chart
    gaps = _visible_gaps(compare)
    assert gaps and all(gap <= BAND_PX for gap in gaps), gaps
    # the charts take what is left down to the page's end: no band under them either
    body = compare.page_scroll.widget()
    assert body.height() - compare.charts_box.geometry().bottom() <= 20
    assert compare.charts_box.geometry().top() > compare.results.geometry().bottom()  # the answer comes first
    assert llama in charts["output_tokens"].legend.text() and vllm in charts["output_tokens"].legend.text()


def test_a_series_enters_the_legend_with_its_first_point(qtbot) -> None:  # type: ignore[no-untyped-def]
    from desktop.ui.charts import ChartBoard, LiveChart

    board = ChartBoard()
    chart = board.add(LiveChart("Latency", "ms"), {"ttft": "TTFT", "tpot": "TPOT / ITL"})
    qtbot.addWidget(chart)

    def named() -> list[str]:
        return [label for label in ("TTFT", "TPOT / ITL") if label in chart.legend.text()]

    assert named() == []
    assert board.push("ttft", 120.0, board.origin + 1)
    assert board.push("ttft", 90.0, board.origin + 2)
    assert named() == ["TTFT"]  # TPOT never came: the engine reports none
    assert chart.plot.getPlotItem().legend is None  # no pyqtgraph legend drawn over the data either
    assert board.push("tpot", 8.0, board.origin + 3)
    assert named() == ["TTFT", "TPOT / ITL"]
    board.clear()  # the buffers emptied: nothing left to name
    assert named() == []


def test_traffic_panel_mean_is_named_outside_the_data_rectangle(qtbot) -> None:  # type: ignore[no-untyped-def]
    import pyqtgraph as pg

    from desktop.ui.traffic_panel import TrafficPanel

    panel = TrafficPanel()
    qtbot.addWidget(panel)
    panel.resize(1200, 500)
    panel.show()
    rate = [(1_700_000_000.0 + 60.0 * i, rpm) for i, rpm in enumerate((80.0, 70.0, 5.0))]
    panel.draw_rate(SimpleNamespace(rate=rate, bucket_s=60.0, mean_rpm=(80.0 + 70.0 + 5.0) / 3))
    qtbot.waitExposed(panel)
    item = panel.rate_plot.getPlotItem()
    assert "mean 51.7/min" in item.titleLabel.text  # 155 / 3 requests per minute
    data_rect = item.vb.sceneBoundingRect()
    assert not item.titleLabel.sceneBoundingRect().intersects(data_rect)
    # nothing that draws text lives in the ViewBox (a labelled line, a TextItem)
    texts = [child for child in item.vb.allChildItems()
             if isinstance(child, (pg.TextItem, pg.InfLineLabel)) and child.isVisible()]
    assert texts == []
