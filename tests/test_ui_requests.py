"""The Serve page's request log view: in-flight requests live, finished ones with TTFT and tokens, capture of
bodies; offscreen, fed by the core's RequestLog, and with the real llama-server behind the GUI's endpoint."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import httpx
import pytest
from test_ui_pages import llama_ready, no_leaks, window  # noqa: F401 - shared fixtures (no leaks, no timers left)

from desktop.core.serving.metering import RequestRecord
from desktop.core.serving.requestlog import RequestLog

pytestmark = [pytest.mark.gui, pytest.mark.qt_log_ignore("propagateSizeHints")]


def cells(panel: Any, row: int) -> list[str]:
    return [panel.table.item(row, column).text() for column in range(panel.table.columnCount())]


def test_the_panel_shows_in_flight_requests_live_then_their_results(qtbot) -> None:  # type: ignore[no-untyped-def]
    from desktop.ui.engine_session import EngineSession
    from desktop.ui.requests_panel import HEADERS, RequestsPanel

    session = EngineSession()
    session.request_log = RequestLog()
    session.request_log.subscribe(session._on_request)  # as _ensure_endpoint does, without an endpoint
    panel = RequestsPanel(session)
    qtbot.addWidget(panel)
    panel.show()
    started = RequestRecord(1000.0, "POST", "/v1/messages", None, 0, False, None, 0.0, None, model="stable",
                            client="127.0.0.1:5000", seq=1)
    session.request_log.started(started)
    qtbot.waitUntil(lambda: panel.table.rowCount() == 1)
    row = dict(zip(HEADERS, cells(panel, 0), strict=True))
    assert row["Status"] == "…" and row["Engine"] == "waiting" and row["Duration s"].endswith("…")
    assert row["Model"] == "stable" and row["Client"] == "127.0.0.1:5000" and row["Request"] == "POST /v1/messages"
    assert panel.ticker.isActive()  # the in-flight duration counts up
    assert "1 in flight" in panel.summary.text() and panel.title == "Requests (1 in flight)"

    done = RequestRecord(1000.0, "POST", "/v1/messages", "llama.cpp@1", 200, True, 0.25, 1.5, 8, prompt_tokens=22,
                         model="stable", engine="llama.cpp", client="127.0.0.1:5000", seq=1,
                         request_body='{"messages": []}', response_body="event: message_stop")
    failed = RequestRecord(1001.0, "POST", "/v1/chat/completions", None, 503, False, None, 30.0, None,
                           "no engine is serving", seq=2)
    session.request_log.finished(done)
    session.request_log.finished(failed)
    qtbot.waitUntil(lambda: panel.table.rowCount() == 2 and cells(panel, 1)[3] == "200")
    newest, first = (dict(zip(HEADERS, cells(panel, row), strict=True)) for row in (0, 1))
    assert newest["Status"] == "503"
    assert (first["Prompt"], first["Output"], first["TTFT ms"], first["Duration s"]) == ("22", "8", "250", "1.50")
    assert not panel.ticker.isActive()
    assert "0 in flight" in panel.summary.text() and "1 failed" in panel.summary.text()
    panel.table.selectRow(1)
    assert "message_stop" in panel.details.toPlainText() and '"ttft_s": 0.25' in panel.details.toPlainText()

    panel.capture_box.setChecked(True)
    assert session.capture_bodies is True
    panel.shutdown()


@pytest.mark.engine
@pytest.mark.llamacpp
def test_requests_through_the_guis_endpoint_appear_on_the_serve_page(  # type: ignore[no-untyped-def]  # noqa: E501
        window, qtbot, llama_ready, tmp_path: Path) -> None:  # noqa: F811
    from desktop.core.planning.planner import ask
    from desktop.ui.screenshots import save_requests_panel

    serve = window.show_page("Serve")
    window.launch(ask("llama.cpp", "demo", {"slots": 2}))
    qtbot.waitUntil(lambda: bool(serve.endpoint_edit.text()) or serve.notice.level == "error", timeout=300_000)
    assert serve.endpoint_edit.text(), serve.notice.text()
    url = window.session.proxy.url
    chat = httpx.post(url + "/v1/chat/completions", trust_env=False, timeout=120,
                      json={"model": "switchyard", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    message = httpx.post(url + "/v1/messages", trust_env=False, timeout=120,
                         json={"model": "switchyard", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == message.status_code == 200
    panel = serve.requests_panel
    assert panel.title == "Requests"  # the tab title follows while another tab is in front
    serve.bottom_tabs.setCurrentWidget(panel)  # the table is built when it is looked at
    qtbot.waitUntil(lambda: panel.table.rowCount() == 2, timeout=10_000)
    assert [cells(panel, row)[9] for row in (0, 1)] == ["POST /v1/messages", "POST /v1/chat/completions"]
    assert all(cells(panel, row)[2] == "llama.cpp" and cells(panel, row)[5] == "4" for row in (0, 1))
    shot = save_requests_panel(window, tmp_path)
    assert shot.stat().st_size > 0
    assert window.session.request_log.flush()
    from desktop.core.storage.history import Store

    with Store() as history:  # the GUI's endpoint keeps its requests in history like `switchyard serve`
        assert [r["path"] for r in history.requests()] == ["/v1/chat/completions", "/v1/messages"]


def test_a_busy_endpoint_port_leaves_no_request_log_writer_or_history_open(qtbot) -> None:  # type: ignore[no-untyped-def]
    import socket

    from desktop.core.planning.planner import ask
    from desktop.ui.engine_session import EngineSession

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        session = EngineSession(endpoint_port=holder.getsockname()[1])
        failures: list[str] = []
        session.failed.connect(failures.append)
        session.start(ask("llama.cpp", "demo"))
        qtbot.waitUntil(lambda: bool(failures), timeout=30_000)
    assert "cannot listen" in failures[0]
    assert session.proxy is None and session.host is None
    assert not any(t.name == "switchyard-requestlog" for t in threading.enumerate())
    session.shutdown()
