"""Offscreen: the Recommend page's traffic panel reads the profile from a real history file, fills the questions
from it (the recommendation then says so; an edit overrides it), and draws the crossover chart with tagged curves,
the operating point and the crossover."""

from __future__ import annotations

import os
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

from desktop.core.storage.history import RunRecord, Store

pytestmark = [pytest.mark.gui, pytest.mark.qt_log_ignore("propagateSizeHints")]


def _traffic(store: Store, now: float) -> None:
    """60 requests one at a time, then 80 four at a time (prompts 100, outputs 20); one launch an hour ago."""
    rows = []
    t = now - 600.0
    for _ in range(60):
        rows.append({"t": t, "path": "/v1/completions", "model": "switchyard", "engine": "llama.cpp",
                     "status": 200, "prompt_tokens": 100, "output_tokens": 20, "ttft_s": 0.1, "e2e_s": 0.9})
        t += 1.0
    for step in range(20):
        for lane in range(4):
            rows.append({"t": t + step * 1.0 + lane * 0.01, "path": "/v1/completions", "model": "switchyard",
                         "engine": "llama.cpp", "status": 200, "prompt_tokens": 100, "output_tokens": 20,
                         "ttft_s": 0.2, "e2e_s": 0.95})
    store.add_requests(rows)
    store.add_run(RunRecord(kind="launch", engine="llama.cpp", model="demo", created_at=now - 3600.0,
                            summary={"cold_start": {"t3_first_request_s": 2.0}}))
    comparison = [{"concurrency": c, "output_throughput": {"llama.cpp": {"mean": a}, "vllm": {"mean": b}},
                   "p95_ttft_ms": {"llama.cpp": {"mean": 10.0}, "vllm": {"mean": 20.0}}}
                  for c, a, b in ((1, 40.0, 30.0), (8, 80.0, 160.0))]
    store.add_run(RunRecord(kind="ab", engine="llama.cpp,vllm", model="demo", created_at=now - 60.0, summary={
        "comparison": comparison, "cold_start": {"t3_first_request_s": {"llama.cpp": {"mean": 2.0},
                                                                        "vllm": {"mean": 50.0}}}}))


def test_traffic_panel_fills_the_questions_and_draws_the_crossover(qtbot, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    now = time.time()
    with Store() as store:
        _traffic(store, now)
    from desktop.ui.pages.recommend import RecommendPage

    page = RecommendPage()
    qtbot.addWidget(page)
    panel = page.traffic
    qtbot.waitUntil(lambda: panel.picture is not None, timeout=30_000)
    assert panel.summary.text().startswith("From your traffic: from 140 requests over")
    assert "p95 concurrency 4" in panel.summary.text()
    # enough traffic: the questions hold the profile's numbers
    assert (page.concurrency.value(), page.prompt_len.value(), page.output_len.value()) == (4, 100, 20)
    assert panel.use_button.isEnabled()
    # the chart: both engines' measured curves, tagged, the operating point at p95 4 and the crossover between 1, 8
    assert set(panel.series) == {"llama.cpp", "vllm"} and panel.series["vllm"] == [(1.0, 30.0), (8.0, 160.0)]
    assert panel.marks["operating"] == 4.0 and 1.0 < panel.marks["crossover"] < 8.0
    day = time.strftime("%Y-%m-%d", time.localtime(now - 60.0))  # the A/B's: both curves and both cold starts
    legend = panel.legend.text()
    assert f"llama.cpp: measured here on {day}; cold start 2.0 s measured here on {day}" in legend
    assert f"vllm: measured here on {day}; cold start 50.0 s measured here on {day}" in legend
    assert "default" not in legend
    assert "operating c=4" in legend and "crossover c=" in legend  # named here, not drawn over the curves
    import pyqtgraph as pg

    for chart in (panel.plot, panel.ttft_plot):
        lines = [i for i in chart.getPlotItem().items if isinstance(i, pg.InfiniteLine)]
        assert len(lines) == 2 and all(getattr(line, "label", None) is None for line in lines)
    assert "overtakes llama.cpp at concurrency" in panel.verdict.text()
    assert page._traffic_line() and "from 140 requests" in page._traffic_line()[0]
    page.concurrency.setValue(9)  # a typed number overrides: the recommendation no longer claims the traffic
    assert page._traffic_line() == []
    page.concurrency.setValue(1)
    panel.use()  # the button puts the traffic's numbers back
    assert page.concurrency.value() == 4 and page._traffic_line()


def test_traffic_panel_without_traffic_keeps_typed_numbers_and_default_curves(  # type: ignore[no-untyped-def]
        qtbot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "empty"))
    from desktop.ui.pages.recommend import RecommendPage

    page = RecommendPage()
    qtbot.addWidget(page)
    before = page.concurrency.value()
    qtbot.waitUntil(lambda: page.traffic.picture is not None, timeout=30_000)
    assert "No traffic through the endpoint yet" in page.traffic.summary.text()
    assert page.concurrency.value() == before and not page.traffic.use_button.isEnabled()
    assert "default" in page.traffic.legend.text() and "operating" not in page.traffic.marks
    # no traffic and default curves: no empty rate or TTFT chart, the throughput chart says it is relative
    assert page.traffic.rate_plot.isHidden() and page.traffic.ttft_plot.isHidden()
    assert "relative" in page.traffic.plot.getPlotItem().getAxis("left").labelText


def _drawn(plot) -> dict[str, tuple[list[float], list[float]]]:  # type: ignore[no-untyped-def]
    """What a pyqtgraph plot really draws: each named data item's x and y."""
    return {item.name(): (list(item.getData()[0]), list(item.getData()[1]))
            for item in plot.getPlotItem().listDataItems()}


def _vertical_lines(plot) -> list[float]:  # type: ignore[no-untyped-def]
    import pyqtgraph as pg

    return sorted(item.value() for item in plot.getPlotItem().items
                  if isinstance(item, pg.InfiniteLine) and item.angle == 90)


def test_profile_panel_shows_what_switchyard_profile_reports(qtbot, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The panel's facts and its requests-per-minute chart are the figures `switchyard profile --json` prints for
    the same history (the CLI in its own process)."""
    import json
    import subprocess
    import sys

    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    with Store() as store:
        _traffic(store, time.time())
    out = subprocess.run([sys.executable, "-m", "desktop", "profile", "--json"], capture_output=True, text=True,
                         timeout=120, env={**os.environ}, check=False)
    assert out.returncode == 0, out.stderr
    cli = json.loads(out.stdout)
    from desktop.ui.pages.recommend import RecommendPage

    page = RecommendPage()
    qtbot.addWidget(page)
    panel = page.traffic
    qtbot.waitUntil(lambda: panel.picture is not None, timeout=30_000)
    assert panel.summary.text() == f"From your traffic: {cli['summary']}."
    facts = panel.facts.text()
    c, p, o = cli["concurrency"], cli["prompt_tokens"], cli["output_tokens"]
    assert f"in flight: p50 {c['p50']:g}, p95 {c['p95']:g}, max {c['max']} (busy {c['busy_share']:.0%} of the time)" \
        in facts
    assert (f"prompt tokens: p50 {p['p50']:g}, p95 {p['p95']:g}, max {p['max']} (log-normal \u03bc "
            f"{p['lognormal_mu']:.2f}, \u03c3 {p['lognormal_sigma']:.2f})") in facts
    assert f"output tokens: p50 {o['p50']:g}, p95 {o['p95']:g}, max {o['max']} (log-normal" in facts
    assert (f"requests/min: mean {cli['mean_rpm']:.2f}, peak {cli['peak_rpm']:.2f} (burstiness "
            f"{cli['burstiness']:g} peak/mean); 0 failed") in facts
    assert f"launches: {len(cli['lifetimes'])}, restarts {cli['restarts']}" in facts
    assert "shared prefix: unknown (no captured bodies" in facts and cli["shared_prefix_share"] is None
    # the rate chart: one step per bucket at the CLI's requests per minute
    (xs, ys), = _drawn(panel.rate_plot).values()
    assert [round(y, 6) for y in ys] == [round(rpm, 6) for _, rpm in cli["requests_per_minute"]]
    assert xs[:-1] == [t for t, _ in cli["requests_per_minute"]] and xs[-1] == xs[-2] + cli["bucket_s"]
    # the mean is named in the title, not by a label drawn across the bars (issue 52)
    import pyqtgraph as pg

    item = panel.rate_plot.getPlotItem()
    assert f"mean {cli['mean_rpm']:.1f}/min" in item.titleLabel.text
    assert all(getattr(line, "label", None) is None for line in item.items if isinstance(line, pg.InfiniteLine))


def test_crossover_chart_draws_the_crossover_modules_curves(qtbot, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Both charts draw the curves planning.crossover computes from the same history (throughput and TTFT p95 on
    log2 concurrency), with the crossover and the operating point as vertical lines, and its verdict."""
    import math

    from desktop.core.measure.profile import load_profile
    from desktop.core.planning.crossover import crossover, curves_from_history

    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    now = time.time()
    with Store() as store:
        _traffic(store, now)
        profile = load_profile(store, since=now - 7 * 86400)
        expected = crossover(curves_from_history(store.runs(limit=500), "demo", cpu=True),
                             operating_concurrency=profile.concurrency.p95, operating_source="traffic")
    from desktop.ui.traffic_panel import TrafficPanel

    panel = TrafficPanel()
    qtbot.addWidget(panel)
    panel.refresh("demo")
    qtbot.waitUntil(lambda: panel.picture is not None, timeout=30_000)
    throughput, ttft = _drawn(panel.plot), _drawn(panel.ttft_plot)
    assert set(throughput) == set(ttft) == {"llama.cpp", "vllm"}
    for curve in expected.curves:
        assert throughput[curve.engine] == ([math.log2(p.concurrency) for p in curve.points],
                                            [p.output_tok_s for p in curve.points])
        assert ttft[curve.engine] == ([math.log2(p.concurrency) for p in curve.points],
                                      [p.ttft_p95_ms for p in curve.points])
    assert throughput["vllm"][1] == [30.0, 160.0] and ttft["vllm"][1] == [20.0, 20.0]  # the seeded A/B's numbers
    lines = sorted([math.log2(expected.crossover_concurrency), math.log2(4.0)])
    assert _vertical_lines(panel.plot) == pytest.approx(lines) and _vertical_lines(panel.ttft_plot) == pytest.approx(lines)
    assert panel.verdict.text() == expected.verdict and "pays back after" in panel.verdict.text()
    assert expected.break_even_s is not None and expected.break_even_s > 0
    ticks = panel.plot.getPlotItem().getAxis("bottom")._tickLevels[0]  # labelled in concurrency, not log2
    assert [label for _, label in ticks] == ["1", "8"]
    assert not panel.ttft_plot.isHidden() and not panel.rate_plot.isHidden()


def _has_colour(image, colour: str, tolerance: int = 12) -> int:  # type: ignore[no-untyped-def]
    """How many pixels of `image` are within `tolerance` of `colour` (#rrggbb) in every channel."""
    from PySide6.QtGui import QColor

    want = QColor(colour)
    count = 0
    for y in range(0, image.height(), 2):
        for x in range(0, image.width(), 2):
            got = image.pixelColor(x, y)
            if (abs(got.red() - want.red()) <= tolerance and abs(got.green() - want.green()) <= tolerance
                    and abs(got.blue() - want.blue()) <= tolerance):
                count += 1
    return count


def test_screenshot_of_the_crossover_shows_both_curves(qtbot, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`gui --screenshots`' traffic shots: the PNG is the panel, with both engines' curve colours drawn (not an
    empty chart), and the page's splitter is put back afterwards."""
    from PySide6.QtGui import QImage

    from desktop.ui.charts import PALETTE
    from desktop.ui.main_window import MainWindow
    from desktop.ui.screenshots import save_traffic
    from desktop.ui.traffic_panel import RATE_COLOUR

    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    with Store() as store:
        _traffic(store, time.time())
    window = MainWindow()
    window.confirm_quit = lambda: True
    qtbot.addWidget(window)
    window.show()
    recommend = window.show_page("Recommend")
    qtbot.waitUntil(lambda: recommend.traffic.picture is not None, timeout=30_000)
    path = save_traffic(window, tmp_path, "crossover.png", panel_only=True)
    assert path is not None and recommend.result_box.isVisible()  # the answer is back after the panel's shot
    image = QImage(str(path))
    assert image.width() >= recommend.traffic.width() and image.height() >= recommend.traffic.height()
    # both engines' curves are drawn in their colours (the rate chart has a colour of its own)
    assert _has_colour(image, PALETTE[0]) > 50 and _has_colour(image, PALETTE[1]) > 50
    assert _has_colour(image, RATE_COLOUR) > 50
    window.close()
