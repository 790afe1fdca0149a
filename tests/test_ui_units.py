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
