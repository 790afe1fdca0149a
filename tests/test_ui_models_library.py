"""The Models page's library, model first: Delete removes one model's files from a real Hub cache (and only
those) after a confirmation that says the disk it frees; Serve and a finished download's Serve now hand the
model to the Serve page; the demo rows cannot be deleted. Downloads come from the stand-in Hub on loopback."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from test_ui_pages import no_leaks, window  # noqa: F401 - shared fixtures

pytestmark = [pytest.mark.gui, pytest.mark.qt_log_ignore("propagateSizeHints")]


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[object]:
    """The stand-in Hub, with the app's Hub cache under tmp_path."""
    from fakehub import FakeHub

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("SWITCHYARD_NO_KEYRING", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with FakeHub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
        yield fake


def _add_gguf_repo(hub, tmp_path: Path, repo: str, filename: str, n_bytes: int, seed: int) -> Path:  # type: ignore[no-untyped-def]
    from fakehub import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "src" / repo.replace("/", "_") / filename, n_bytes=n_bytes, seed=seed)
    hub.add_repo(repo, {filename: gguf, "README.md": f"# {repo}\n".encode()}, tags=["gguf"])
    return gguf


def _download(page, qtbot, spec: str) -> None:  # type: ignore[no-untyped-def]
    page.download_spec(spec)
    qtbot.waitUntil(lambda: not page.downloading, timeout=60_000)
    assert page.progress_label.text().startswith("Downloaded to"), page.progress_label.text()


def _names(page) -> list[str]:  # type: ignore[no-untyped-def]
    return [page.library_table.item(row, 0).text() for row in range(page.library_table.rowCount())]


def _cache_files(root: Path) -> dict[str, tuple[str, bytes]]:
    """Every file and link under the cache: its path -> (where a link points, the bytes it reads)."""
    out = {}
    for folder, _dirs, files in os.walk(root):
        for name in files:
            path = Path(folder) / name
            target = os.readlink(path) if path.is_symlink() else ""
            out[str(path.relative_to(root))] = (target, path.read_bytes() if path.exists() else b"")
    return out


def _select(page, name: str) -> None:  # type: ignore[no-untyped-def]
    page.library_table.selectRow(_names(page).index(name))


def test_delete_removes_only_that_models_files_and_says_what_it_frees(window, qtbot, hub, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    alpha = _add_gguf_repo(hub, tmp_path, "alpha-org/alpha-GGUF", "alpha-Q4_K_M.gguf", 300_000, seed=1)
    beta = _add_gguf_repo(hub, tmp_path, "beta-org/beta-GGUF", "beta-Q8_0.gguf", 200_000, seed=2)
    page = window.show_page("Models")
    _download(page, qtbot, "alpha-org/alpha-GGUF:Q4_K_M")
    _download(page, qtbot, "beta-org/beta-GGUF:Q8_0")
    qtbot.waitUntil(lambda: {"alpha-org/alpha-GGUF:Q4_K_M", "beta-org/beta-GGUF:Q8_0"} <= set(_names(page)),
                    timeout=30_000)
    cache_root = tmp_path / "hf-cache"
    before = _cache_files(cache_root)
    alpha_storage, beta_storage = "models--alpha-org--alpha-GGUF", "models--beta-org--beta-GGUF"
    alpha_links = [p for p, (target, _) in before.items() if p.startswith(f"{alpha_storage}/snapshots/") and target]
    assert [Path(p).name for p in alpha_links] == ["alpha-Q4_K_M.gguf"]  # the link, pointing at its blob
    assert before[alpha_links[0]][1] == alpha.read_bytes()
    assert any(p.startswith(f"{beta_storage}/snapshots/") for p in before)

    asked = []

    def answer_yes(row) -> bool:  # type: ignore[no-untyped-def]
        from desktop.core.hub.library_view import delete_question

        asked.append((row, delete_question(row)))
        return True

    page.confirm_delete = answer_yes
    _select(page, "alpha-org/alpha-GGUF:Q4_K_M")
    assert page.library_box.delete_button.isEnabled()
    page.library_box.delete_button.click()
    qtbot.waitUntil(lambda: "alpha-org/alpha-GGUF:Q4_K_M" not in _names(page) and not page.library_box.deleting,
                    timeout=30_000)

    # the confirmation said the disk it frees: the GGUF written above, byte for byte
    (row, question), = asked
    size = alpha.stat().st_size
    assert row["freed_bytes"] == size
    assert f"{size:,} bytes" in question, question
    assert page.notice.text() == f"Deleted alpha-org/alpha-GGUF:Q4_K_M: freed {size / 1024:,.1f} KiB.", page.notice.text()
    # the deleted model's snapshot link and blob are gone; every other file is still there, byte-identical
    after = _cache_files(cache_root)
    alpha_blob = Path(os.path.normpath((cache_root / alpha_links[0]).parent / before[alpha_links[0]][0]))
    assert alpha_blob.parent.name == "blobs" and f"{alpha_storage}/blobs/{alpha_blob.name}" in before
    assert not (cache_root / alpha_links[0]).exists() and not (cache_root / alpha_links[0]).is_symlink()
    assert not alpha_blob.exists()
    assert not any(p.startswith(f"{alpha_storage}/") for p in after), sorted(after)
    kept = {p: v for p, v in before.items() if not p.startswith(f"{alpha_storage}/")
            and not p.startswith(f".locks/{alpha_storage}/")}
    assert after == kept
    beta_links = [p for p, (target, _) in after.items() if p.startswith(f"{beta_storage}/snapshots/") and target]
    assert [after[p][1] for p in beta_links] == [beta.read_bytes()]
    # the library no longer lists it and still lists the other
    assert "beta-org/beta-GGUF:Q8_0" in _names(page)
    assert not any("alpha" in row["name"] for row in page.library)


def test_serve_now_and_library_serve_hand_the_model_to_the_serve_page(window, qtbot, hub, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    _add_gguf_repo(hub, tmp_path, "gamma-org/gamma-GGUF", "gamma-Q4_K_M.gguf", 200_000, seed=3)
    page = window.show_page("Models")
    served: list[tuple[str, str]] = []
    page.serve_requested.connect(lambda model, engine: served.append((model, engine)))
    assert not page.serve_now_button.isEnabled()  # nothing downloaded yet
    _download(page, qtbot, "gamma-org/gamma-GGUF:Q4_K_M")
    assert page.serve_now_button.isEnabled()
    assert served == []  # a plain download does not serve by itself
    page.serve_now_button.click()
    (model, engine), = served
    snapshots = tmp_path / "hf-cache" / "models--gamma-org--gamma-GGUF" / "snapshots"
    assert Path(model).parent.parent == snapshots and Path(model).name == "gamma-Q4_K_M.gguf", model
    assert Path(model).read_bytes() == (tmp_path / "src" / "gamma-org_gamma-GGUF" / "gamma-Q4_K_M.gguf").read_bytes()
    assert engine == "llama.cpp"
    assert "Downloaded to this machine: gamma-org/gamma-GGUF:Q4_K_M" == page.progress_label.text()

    # the library's Serve on the demo rows
    qtbot.waitUntil(lambda: "demo (vLLM)" in _names(page), timeout=60_000)
    served.clear()
    _select(page, "demo (llama.cpp)")
    page.library_box.serve_button.click()
    _select(page, "demo (vLLM)")
    page.library_box.serve_button.click()
    assert served == [("demo", "llama.cpp"), ("demo", "vllm")]


def test_download_spec_with_serve_after_serves_when_done(window, qtbot, hub, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    _add_gguf_repo(hub, tmp_path, "delta-org/delta-GGUF", "delta-Q8_0.gguf", 100_000, seed=4)
    page = window.show_page("Models")
    with qtbot.waitSignal(page.serve_requested, timeout=60_000) as signal:
        page.download_spec("delta-org/delta-GGUF:Q8_0", serve_after=True)
    model, engine = signal.args
    assert Path(model).name == "delta-Q8_0.gguf" and "models--delta-org--delta-GGUF" in Path(model).parts
    assert engine == "llama.cpp"
    qtbot.waitUntil(lambda: window.stack.currentWidget() is window.pages.get("Serve"), timeout=10_000)


def test_demo_rows_cannot_be_deleted(window, qtbot, monkeypatch) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    page = window.show_page("Models")
    qtbot.waitUntil(lambda: "demo (vLLM)" in _names(page), timeout=60_000)
    page.confirm_delete = lambda row: pytest.fail(f"asked to delete the demo: {row}")
    notes_column = [page.library_table.horizontalHeaderItem(c).text()
                    for c in range(page.library_table.columnCount())].index("Notes")
    for name in ("demo (llama.cpp)", "demo (vLLM)"):
        _select(page, name)
        row = _names(page).index(name)
        assert page.library_table.item(row, notes_column).text() == "random weights: its answers are noise"
        assert not page.library_box.delete_button.isEnabled()
        assert "demo" in page.library_box.delete_button.toolTip()
        page.library_box.delete_selected()  # even when called directly: nothing happens
        assert not page.library_box.deleting
    assert page.library_box.serve_button.isEnabled()


def test_freed_bytes_leave_out_a_blob_another_snapshot_links(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Two revisions of one repo share a GGUF blob: deleting the Q8_0 only one revision has frees its own blob
    (the disk hub.delete then really frees); the Q4_K_M blob both link frees nothing and stays."""
    from desktop.core.hub import delete, list_local
    from desktop.core.hub.library_view import freed_bytes

    cache_root = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache_root))
    storage = cache_root / "models--omega-org--omega-GGUF"
    (storage / "blobs").mkdir(parents=True)
    shared, own = b"s" * 5_000, b"o" * 7_000
    (storage / "blobs" / ("a" * 64)).write_bytes(shared)
    (storage / "blobs" / ("b" * 64)).write_bytes(own)
    old, new = "1" * 40, "2" * 40
    for commit, links in ((old, {"omega-Q4_K_M.gguf": "a", "omega-Q8_0.gguf": "b"}), (new, {"omega-Q4_K_M.gguf": "a"})):
        folder = storage / "snapshots" / commit
        folder.mkdir(parents=True)
        for name, blob in links.items():
            (folder / name).symlink_to(f"../../blobs/{blob * 64}")
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(new)

    models = {(m.commit, m.quantization): m for m in list_local(cache_root)}
    older_q4, older_q8 = models[(old, "Q4_K_M")], models[(old, "Q8_0")]
    assert freed_bytes(older_q4, cache_root) == 0  # its blob is the newer revision's too
    assert freed_bytes(older_q8, cache_root) == len(own)
    result = delete(older_q8.name, cache_dir=cache_root)
    assert result.freed_bytes == len(own)
    assert (storage / "blobs" / ("a" * 64)).read_bytes() == shared and not (storage / "blobs" / ("b" * 64)).exists()


def test_delete_of_a_path_the_user_added_forgets_it_and_keeps_its_file(window, qtbot, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: E501, F811
    from fakehub import write_tiny_gguf

    from desktop.core.hub import add_path

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    mine = write_tiny_gguf(tmp_path / "mine" / "mine-Q4_K_M.gguf", n_bytes=50_000, seed=5)
    content = mine.read_bytes()
    add_path(mine)
    page = window.show_page("Models")
    qtbot.waitUntil(lambda: "mine-Q4_K_M.gguf" in _names(page), timeout=60_000)
    asked = []
    page.confirm_delete = lambda row: asked.append(row) or True
    _select(page, "mine-Q4_K_M.gguf")
    assert page.library_box.delete_button.isEnabled()
    page.library_box.delete_button.click()
    qtbot.waitUntil(lambda: "mine-Q4_K_M.gguf" not in _names(page) and not page.library_box.deleting, timeout=30_000)
    from desktop.core.hub.library_view import delete_question

    (row,) = asked
    assert row["forget_only"] and row["freed_bytes"] == 0
    assert "Forget" in delete_question(row) and "nothing is deleted" in delete_question(row)
    assert mine.read_bytes() == content  # forgotten, not deleted
    assert page.notice.text().startswith("Forgot mine-Q4_K_M.gguf"), page.notice.text()
