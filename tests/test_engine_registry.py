"""Adding an engine touches one place: a fake third engine registered once in the adapter registry is offered by
`serve`, `ab`, `fit` and the Serve page's engine list (with its display name), and its plans are the planner's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from desktop.cli import main
from desktop.core.engines import ADAPTERS, EngineInstall, get_adapter, register, unregister
from desktop.core.engines.llamacpp import LlamaCppAdapter

SNAPSHOT = str(Path(__file__).parent / "snapshots" / "rtx4090_20free.json")


class FakeEngine(LlamaCppAdapter):
    """A llama-server-compatible third engine: its own name, spellings and display name; llama.cpp's accounting."""

    name = "fake-engine"
    display_name = "Fake Engine (test)"
    aliases = ("fake", "fakeserver")
    sizing = "llama.cpp"
    dry_run_executable = "fake-server"

    def find_install(self) -> EngineInstall | None:
        return None


@pytest.fixture
def fake() -> Iterator[FakeEngine]:
    adapter = FakeEngine()
    register(adapter)  # the one place
    yield adapter
    unregister(adapter.name)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_registry_knows_its_names_and_spellings(fake: FakeEngine) -> None:
    assert get_adapter("FAKE ") is fake and get_adapter("fakeserver") is fake
    assert get_adapter("llama-server").name == "llama.cpp"
    with pytest.raises(Exception, match="fake-engine"):  # the error lists every registered engine
        get_adapter("nope")


def test_serve_ab_and_fit_offer_the_registered_engine(fake: FakeEngine, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "serve", "--engine", "fake", "--model", "demo", "--hardware", SNAPSHOT,
                         "--dry-run", "--json")
    assert code == 0, err
    described = json.loads(out)
    assert described["plan"]["engine"] == "fake-engine" and described["argv"][0] == "fake-server"
    code, out, err = run(capsys, "ab", "--engines", "fake,llama.cpp", "--hardware", SNAPSHOT, "--dry-run", "--json")
    assert code == 0, err
    assert set(json.loads(out)["engines"]) == {"fake-engine", "llama.cpp"}
    code, out, err = run(capsys, "fit", "demo", "--engine", "fake", "--hardware", SNAPSHOT, "--json")
    assert code == 0, err
    assert json.loads(out)["engine"] == "fake-engine"


def test_the_serve_page_lists_it_by_its_display_name(fake: FakeEngine, qtbot) -> None:  # type: ignore[no-untyped-def]
    from desktop.ui.engine_session import EngineSession
    from desktop.ui.pages.serve import ServePage

    session = EngineSession(endpoint_port=0)
    page = ServePage(session)
    qtbot.addWidget(page)
    listed = {page.engine_box.itemData(i): page.engine_box.itemText(i) for i in range(page.engine_box.count())}
    from desktop.ui.pages.serve import HYBRID

    # every registered engine by its display name, then the hybrid entry (both of the two engines it switches)
    assert {k: v for k, v in listed.items() if k != HYBRID} == {a.name: a.display_name for a in ADAPTERS.values()}
    assert listed[HYBRID] == "Hybrid (auto)"
    assert listed["fake-engine"] == "Fake Engine (test)"
    page.board.stop()
