"""Qt-light units of the desktop app: settings schema, ring buffers, chart redraw policy, workers' errors."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

from desktop.core.common.errors import SwitchyardError
from desktop.core.storage import settings as core_settings

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")


# --- settings ---------------------------------------------------------------------------------------------
def test_settings_round_trip_and_defaults(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    assert core_settings.load(path) == core_settings.Settings()
    saved = core_settings.Settings(endpoint_port=9001, default_workload="many-users", models_dir="/data/models")
    core_settings.save(saved, path)
    assert json.loads(path.read_text())["version"] == core_settings.SCHEMA_VERSION
    assert core_settings.load(path) == saved


def test_settings_migrate_unversioned_file_keeps_the_users_choices(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"port": 9100, "workload": "batch"}))
    loaded = core_settings.load(path)
    assert (loaded.endpoint_port, loaded.default_workload, loaded.preferred_engine) == (9100, "batch", "auto")
    assert json.loads(path.read_text())["version"] == core_settings.SCHEMA_VERSION  # rewritten migrated


def test_unreadable_settings_are_set_aside_not_lost(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    path.write_text("{not json")
    loaded = core_settings.load(path)
    assert loaded == core_settings.Settings()
    assert "unusable" in loaded.notes[0]
    assert (tmp_path / "settings.json.bad").read_text() == "{not json"


@pytest.mark.parametrize("bad", [{"endpoint_port": 80}, {"default_workload": "gaming"},
                                 {"models_dir": "relative/dir"}, {"endpoint_port": "8080"}])
def test_invalid_settings_are_refused_with_a_reason(bad: dict[str, object]) -> None:
    with pytest.raises(SwitchyardError) as excinfo:
        core_settings.from_dict({"version": core_settings.SCHEMA_VERSION, **bad})
    assert next(iter(bad)).split("_")[-1] in excinfo.value.message


def test_settings_from_a_newer_version_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SwitchyardError, match="newer"):
        core_settings.migrate({"version": core_settings.SCHEMA_VERSION + 1})


# --- ring buffer and charts ---------------------------------------------------------------------------------
def test_ring_buffer_keeps_the_newest_points_in_order_without_copying() -> None:
    from desktop.ui.charts import RingBuffer

    ring = RingBuffer(capacity=4)
    for i in range(10):
        ring.append(float(i), float(i * 10))
    t, v = ring.view()
    assert list(t) == [6.0, 7.0, 8.0, 9.0] and list(v) == [60.0, 70.0, 80.0, 90.0]
    assert t.base is not None  # a view into the preallocated storage, not a copy
    assert ring.last() == (9.0, 90.0)


def test_chart_board_redraws_only_dirty_curves_once_per_tick(qtbot) -> None:
    from desktop.ui.charts import ChartBoard, LiveChart

    board = ChartBoard()
    chart = LiveChart("Throughput", "tokens/s")
    qtbot.addWidget(chart)
    board.add(chart, {"a": "A", "b": "B"})
    calls: list[str] = []
    for key, curve in chart.curves.items():
        original = curve.item.setData
        curve.item.setData = lambda *args, _k=key, _o=original, **kw: (calls.append(_k), _o(*args, **kw))
    t0 = board.origin
    for i in range(100):
        board.push("a", float(i), t0 + i * 0.01)
    assert not board.push("unknown", 1.0)
    board.tick()
    assert calls == ["a"]  # 100 samples, one setData; the untouched curve is not redrawn
    board.set_paused(True)
    board.push("b", 5.0, t0 + 2)
    board.tick()
    assert calls == ["a"]
    board.set_paused(False)
    board.tick()
    assert calls == ["a", "b"]
    assert "A: 99" in chart.hover_at(0.99)
    board.stop()


def test_board_timer_redraws_one_visible_chart_per_turn_and_a_shown_chart_catches_up(qtbot) -> None:
    """Axis painting costs milliseconds per chart: the timer paints one visible chart per turn (so one event
    never paints them all), skips hidden ones, and a chart redraws the moment it is shown."""
    from desktop.ui.charts import REDRAW_MS, ChartBoard, LiveChart

    board = ChartBoard()
    shown, hidden = LiveChart("shown"), LiveChart("hidden")
    for chart in (shown, hidden):
        qtbot.addWidget(chart)
    board.add(shown, {"a": "A"})
    board.add(hidden, {"b": "B"})
    assert board.timer.interval() == REDRAW_MS // 2  # each chart once per REDRAW_MS
    shown.show()
    qtbot.waitExposed(shown)
    redrawn: list[int] = []
    board.redrawn.connect(redrawn.append)
    board.push("a", 1.0, board.origin + 1)
    board.push("b", 2.0, board.origin + 1)
    for _ in range(3):
        board._tick_next()
    assert redrawn == [1, 0, 0]  # "a" once (then clean); "b" never: hidden
    assert hidden.curves["b"].dirty
    hidden.show()
    qtbot.waitExposed(hidden)
    assert not hidden.curves["b"].dirty
    board.stop()


def test_out_of_order_and_non_finite_samples_are_dropped(qtbot) -> None:
    from desktop.ui.charts import ChartBoard, LiveChart

    board = ChartBoard()
    chart = LiveChart("x")
    qtbot.addWidget(chart)
    board.add(chart, {"a": "A"})
    assert board.push("a", 1.0, board.origin + 5)
    assert not board.push("a", 2.0, board.origin + 4)
    assert not board.push("a", float("nan"), board.origin + 6)


def test_legend_sits_outside_the_plot_and_follows_the_series(qtbot) -> None:
    from desktop.ui.charts import ChartBoard, LiveChart

    board = ChartBoard()
    chart = LiveChart("Throughput", "tokens/s")
    qtbot.addWidget(chart)
    board.add(chart, {"gen": "generated", "prompt": "prompt"})
    assert chart.plot.getPlotItem().legend is None  # nothing drawn over the data
    assert chart.legend.text() == ""  # no series has data yet: none is named
    assert board.push("gen", 12.0, board.origin + 1)
    assert "generated" in chart.legend.text() and "prompt" not in chart.legend.text()  # only what has data
    assert board.push("prompt", 30.0, board.origin + 1)
    assert "generated" in chart.legend.text() and "prompt" in chart.legend.text()
    assert chart.curves["gen"].color in chart.legend.text()
    chart.mark(board.origin + 2, "→ vLLM")
    assert "→ vLLM at 2 s" in chart.legend.text()  # the mark's label is in the legend, not on the plot
    from pyqtgraph import InfiniteLine

    lines = [i for i in chart.plot.getPlotItem().items if isinstance(i, InfiniteLine)]
    assert lines and all(getattr(line, "label", None) is None for line in lines)  # pyqtgraph: no label item
    board.remove_all_series(chart)
    assert chart.legend.text() == ""


@pytest.mark.parametrize(("low", "high", "span", "expected"), [
    (0.52, 0.521, 0.5, (0.2705, 0.7705)),  # barely moves: centred on the data
    (0.0, 0.3, 5.0, (0.0, 5.0)),  # near zero, never negative: starts at 0
    (10.0, 90.0, 5.0, None),  # moves enough: the plot fits it
    (-3.0, -2.9, 1.0, (-3.45, -2.45)),  # negative data may stay negative
])
def test_y_range_keeps_a_minimum_span(low: float, high: float, span: float,
                                      expected: tuple[float, float] | None) -> None:
    from desktop.ui.charts import y_range

    result = y_range(low, high, span)
    assert result == expected if expected is None else result == pytest.approx(expected)


def test_a_flat_series_gets_a_readable_axis(qtbot) -> None:
    from desktop.ui.charts import ChartBoard, LiveChart

    board = ChartBoard()
    chart = LiveChart("Memory", "GiB")
    qtbot.addWidget(chart)
    board.add(chart, {"rss": "RSS"})
    for i in range(10):
        board.push("rss", 0.52 + i * 1e-5, board.origin + i)
    board.tick()
    low, high = chart.plot.getPlotItem().vb.viewRange()[1]
    assert high - low >= chart.min_span and low <= 0.52 <= high
    for i in range(10, 20):
        board.push("rss", 0.52 + (i - 9) * 2.0, board.origin + i)  # now it moves: plain auto-range
    board.tick()
    chart.show()  # pyqtgraph applies auto-range when it paints
    qtbot.waitExposed(chart)
    vb = chart.plot.getPlotItem().vb
    assert vb.autoRangeEnabled()[1]
    qtbot.waitUntil(lambda: vb.viewRange()[1][1] >= 0.52 + 20 and vb.viewRange()[1][0] <= 2.6, timeout=5_000)
    board.stop()


@pytest.mark.parametrize(("line", "level"), [
    ("0.00.474.146 I srv  llama_server: listening on http://127.0.0.1:43203", "info"),
    ("0.00.010.632 W llama_model_loader: something odd", "warning"),
    ("0.00.010.632 E srv  load_model: failed to load model", "error"),
    ("0.00.010.632 D slot update: debug detail", "debug"),
    ("(APIServer pid=20263) WARNING 12-01 05:04:20 [system_utils.py:255] Found ulimit of 20000", "warning"),
    ("(EngineCore pid=1) INFO 12-01 05:04:20 [core.py:1] ready", "info"),
    ("ERROR 12-01 05:04:20 [engine.py:1] EngineDeadError", "error"),
    ("Traceback (most recent call last):", "error"),
    ("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig", "error"),
    ('error while handling argument "--ctx-size": stoi', "error"),
    ("/x/api_server.py:24: DeprecationWarning: deprecated", "warning"),
    ("usage:", "info"),
])
def test_engine_log_levels_are_read_from_both_engines_formats(line: str, level: str) -> None:
    from desktop.core.engines.loglevel import line_level

    assert line_level(line) == level


def test_a_traceback_frame_keeps_the_error_level() -> None:
    from desktop.core.engines.loglevel import line_level

    assert line_level('  File "x.py", line 3, in main', "error") == "error"
    assert line_level('  File "x.py", line 3, in main', "info") == "info"


def test_log_pane_colours_levels_and_filters_by_level_and_text(qtbot) -> None:
    from desktop.ui.widgets import LogPane

    pane = LogPane()
    qtbot.addWidget(pane)
    lines = ["0.00.1.1 I srv  listening on http://127.0.0.1:1", "0.00.1.2 W srv  slow disk",
             "0.00.1.3 E srv  failed to load", "0.00.1.4 D slot detail", "Traceback (most recent call last):",
             '  File "x.py", line 3']
    pane.append_lines(lines)
    assert pane.text_shown().splitlines() == lines
    block = pane.view.document().findBlockByNumber(2)  # the error line: red and bold
    fmt = block.begin().fragment().charFormat()
    assert fmt.foreground().color().name() == LogPane.COLORS["error"] and fmt.fontWeight() > 400
    pane.level_box.setCurrentIndex(pane.level_box.findData("warning"))
    assert pane.text_shown().splitlines() == [lines[1], lines[2], lines[4], lines[5]]
    assert pane.count_label.text() == "4 of 6 lines"
    pane.append_lines(["0.00.1.5 I srv  more info", "0.00.1.6 E srv  another failure"])
    assert pane.text_shown().splitlines()[-1] == "0.00.1.6 E srv  another failure"
    assert "more info" not in pane.text_shown()
    pane.filter_edit.setText("FAIL")  # case-insensitive, on top of the level choice
    assert pane.text_shown().splitlines() == [lines[2], "0.00.1.6 E srv  another failure"]
    pane.level_box.setCurrentIndex(pane.level_box.findData("debug"))
    pane.filter_edit.clear()
    assert len(pane.text_shown().splitlines()) == 8 and pane.count_label.text() == ""
    pane.search.setText("slow disk")
    assert pane.status.text() == ""  # found


# --- workers --------------------------------------------------------------------------------------------------
def test_worker_delivers_progress_and_result_on_the_gui_thread(qtbot) -> None:
    from desktop.ui.workers import submit, wait_idle

    gui = threading.get_ident()
    seen: list[tuple[str, bool]] = []

    def work(progress):  # type: ignore[no-untyped-def]
        progress("half")
        return threading.get_ident()

    submit(work, on_progress=lambda p: seen.append((p, threading.get_ident() == gui)),
           on_finished=lambda r: seen.append(("done", r != gui)))
    qtbot.waitUntil(lambda: len(seen) == 2, timeout=5000)
    assert seen == [("half", True), ("done", True)]
    assert wait_idle(5000)


def test_a_workers_callable_is_dropped_on_the_gui_thread(qtbot) -> None:
    """The pool thread lets go of what it ran before it reports, so the callable's owner (a page, a session: Qt
    objects in the app) loses its last reference on the GUI thread, not on the pool thread."""
    from desktop.ui.workers import submit, wait_idle

    died_on_main: list[bool] = []
    results: list[int] = []

    class Owner:
        def work(self) -> int:
            return 7

        def __del__(self) -> None:
            died_on_main.append(threading.current_thread() is threading.main_thread())

    submit(Owner().work, on_finished=results.append)  # the job holds the only references
    qtbot.waitUntil(lambda: results == [7], timeout=5000)
    assert wait_idle(5000)
    qtbot.waitUntil(lambda: bool(died_on_main), timeout=5000)
    assert died_on_main == [True]


@pytest.mark.parametrize(("error", "expected"), [
    (SwitchyardError("the port is taken", "pick another"), "the port is taken\nHint: pick another"),
    (ModuleNotFoundError("x", name="desktop.core.measure.ab"), "not available yet"),
    (RuntimeError("boom"), "Unexpected error: boom (RuntimeError"),
])
def test_errors_become_readable_messages_not_tracebacks(qtbot, error: BaseException, expected: str) -> None:
    from desktop.ui.workers import submit

    def fail() -> None:
        raise error

    messages: list[str] = []
    submit(fail, on_error=messages.append)
    qtbot.waitUntil(lambda: bool(messages), timeout=5000)
    assert expected in messages[0] and "Traceback" not in messages[0]


def test_compare_sweep_levels_are_validated() -> None:
    from desktop.ui.pages.compare import parse_levels

    assert parse_levels("1, 4;16") == [1, 4, 16]
    with pytest.raises(SwitchyardError, match="whole numbers"):
        parse_levels("1, many")
    with pytest.raises(SwitchyardError, match="between 1 and 4096"):
        parse_levels("0")


def test_many_signal_emits_from_threads_do_not_crash_the_app(qtbot) -> None:
    """PySide6 6.12.0 drops a reference to True on every Signal.emit and aborts the process (bool_dealloc);
    pyproject pins an unaffected release. This guards against the pin being lifted onto a broken one."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import threading
        import desktop.ui
        from PySide6.QtCore import QCoreApplication, QObject, Signal
        app = QCoreApplication([])
        class S(QObject):
            sig = Signal(object)
        s = S()
        got = []
        s.sig.connect(lambda v: got.append(v))
        n = 60000
        t = threading.Thread(target=lambda: [s.sig.emit(None) for _ in range(n)])
        t.start(); t.join()
        while len(got) < n:
            app.processEvents()
        print("ok", len(got))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,  # noqa: S603
                            env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert result.returncode == 0 and "ok 60000" in result.stdout, result.stderr[-500:]


def test_app_control_runs_session_work_on_the_gui_thread_and_hands_back_errors(qtbot) -> None:
    """Control requests arrive on the endpoint's threads; what touches Qt state must run on the GUI thread."""
    import threading

    from PySide6.QtCore import QObject

    from desktop.core.common.errors import SwitchyardError
    from desktop.ui.app_control import AppControl

    owner = QObject()
    control = AppControl(owner)
    results: list[object] = []

    def from_another_thread() -> None:
        results.append(control._on_gui(threading.get_ident))
        try:
            control._on_gui(lambda: (_ for _ in ()).throw(SwitchyardError("no engine", "start one")))
        except SwitchyardError as exc:
            results.append(exc.hint)

    thread = threading.Thread(target=from_another_thread)
    thread.start()
    qtbot.waitUntil(lambda: not thread.is_alive(), timeout=10_000)
    assert results == [threading.get_ident(), "start one"]


# --- garbage collection on the GUI thread only (desktop/ui/gc_policy.py) -------------------------------------
def test_cycles_dropped_on_a_worker_thread_are_collected_on_the_gui_thread(qtbot) -> None:
    """A worker that leaves cyclic garbage behind (a generation's worth, enough for CPython to collect right there)
    does not collect it; the GUI timer does, on the GUI thread."""
    import gc

    from desktop.ui import gc_policy

    died_on_main: list[bool] = []

    class Node:
        def __del__(self) -> None:
            died_on_main.append(threading.current_thread() is threading.main_thread())

    def leave_cycles() -> None:
        node = Node()
        node.me = node  # type: ignore[attr-defined]
        del node  # garbage now, while it is young: the next collection of generation 0 frees it
        for _ in range(2 * gc.get_threshold()[0]):
            cycle: list[object] = []
            cycle.append(cycle)

    gc.enable()  # as a plain interpreter starts
    gc_policy.collect_on_gui_thread()
    assert not gc.isenabled()
    worker = threading.Thread(target=leave_cycles, name="leaves-cycles")
    worker.start()
    worker.join()
    assert died_on_main == []  # nothing collected on the worker
    qtbot.waitUntil(lambda: bool(died_on_main), timeout=10_000)  # the GUI timer's next check
    assert died_on_main == [True]


# The app's own start path (`switchyard gui`) in a process of its own: no test configuration installs the policy
# there. A worker thread stands in for the app's (engine logs, telemetry, the thread pool): once the app exists it
# allocates twenty generations' worth of containers, so CPython would collect on it if automatic collection were on.
_GC_PROBE = r"""
import gc, json, sys, threading

starts = []
gc.callbacks.append(lambda phase, info: starts.append(threading.current_thread().name) if phase == "start" else None)
from desktop.ui import app

create = app.create_app


def create_then_allocate(*args, **kwargs):
    made = create(*args, **kwargs)
    worker = threading.Thread(target=lambda: [[] for _ in range(20 * gc.get_threshold()[0])], name="allocates")
    worker.start()
    worker.join()
    return made


app.create_app = create_then_allocate
from desktop.cli import main

code = main(["gui", "--quit-when-ready"])
with open(sys.argv[1], "w") as out:
    json.dump({"code": code, "starts": starts, "main": threading.main_thread().name}, out)
"""


def test_the_apps_own_start_collects_garbage_on_the_gui_thread_only(tmp_path: Path) -> None:
    """desktop/ui/app.py installs gc_policy itself (the suite's conftest installs it too, so only a process of its
    own shows the app's call doing it): every collection in `switchyard gui` starts on the GUI (main) thread."""
    import subprocess
    import sys

    result = tmp_path / "collections.json"
    done = subprocess.run([sys.executable, "-c", _GC_PROBE, str(result)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(result.read_text())
    assert seen["code"] == 0 and "interactive after" in done.stdout, done.stdout + done.stderr[-3000:]
    assert seen["starts"], "no collection at all: the hook saw nothing"  # imports collect before the app exists
    assert set(seen["starts"]) == {seen["main"]}, seen["starts"]
