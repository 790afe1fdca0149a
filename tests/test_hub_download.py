"""Downloads against the loopback fake Hub, with every fault the issue lists injected for real."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakehub import DEFAULT_TOKEN, FakeHub, random_bytes, write_tiny_gguf

from desktop.core.common.errors import SwitchyardError
from desktop.core.hub import cache
from desktop.core.hub.download import (
    ChecksumMismatch,
    DiskFull,
    DownloadCancelled,
    DownloadControl,
    DownloadProgress,
    RetryPolicy,
    pull,
)
from desktop.core.hub.search import GatedModelError

FAST = RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.05, stall_timeout=0.5, connect_timeout=5)
REPO = "demo/tiny-GGUF"
Q4 = "tiny-Q4_K_M.gguf"
SHARDS = ("tiny-Q8_0-00001-of-00002.gguf", "tiny-Q8_0-00002-of-00002.gguf")


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeHub, Path]]:
    cache_dir = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SWITCHYARD_NO_KEYRING", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        gguf = write_tiny_gguf(tmp_path / "src" / Q4, n_bytes=400_000)
        hub.add_repo(
            REPO,
            {
                Q4: gguf.read_bytes(),
                SHARDS[0]: random_bytes(300_000, 1),
                SHARDS[1]: random_bytes(200_000, 2),
                "README.md": b"# tiny\n",
            },
            tags=["gguf"],
        )
        hub.add_repo("gated/llama", {"model-Q4_K_M.gguf": random_bytes(50_000, 3)}, gated=True, tags=["gguf"])
        yield hub, cache_dir


def blob_of(hub: FakeHub, repo: str, path: str, cache_dir: Path) -> Path:
    return cache.blob_path(repo, hub.repos[repo].files[path].sha256, cache_dir)


def assert_complete(hub: FakeHub, result_path: Path, repo: str = REPO, path: str = Q4) -> None:
    data = result_path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == hub.repos[repo].files[path].sha256


def test_clean_pull_lands_in_hf_cache_layout(env: tuple[FakeHub, Path]) -> None:
    hub, cache_dir = env
    events: list[DownloadProgress] = []
    result = pull(f"{REPO}:Q4_K_M", policy=FAST, on_progress=events.append)
    commit = hub.repos[REPO].sha
    assert result.path == cache_dir / "models--demo--tiny-GGUF" / "snapshots" / commit / Q4
    assert result.path.is_symlink()
    assert_complete(hub, result.path)
    assert (cache_dir / "models--demo--tiny-GGUF" / "refs" / "main").read_text() == commit
    assert events[-1].state == "complete" and events[-1].done_bytes == events[-1].total_bytes == result.total_bytes
    assert not list(cache_dir.rglob("*.incomplete"))


def test_dropped_connection_resumes_from_partial_bytes(env: tuple[FakeHub, Path]) -> None:
    hub, _ = env
    hub.faults.drop(Q4, after_bytes=150_000)
    result = pull(f"{REPO}:Q4_K_M", policy=FAST)
    assert_complete(hub, result.path)
    ranges = hub.range_requests(Q4)
    assert ranges[0] == ""
    start = int(ranges[1].removeprefix("bytes=").rstrip("-"))
    assert start >= 150_000 - 1024 * 1024 and start > 0  # continued, not from zero
    assert result.downloaded_bytes == hub.repos[REPO].files[Q4].size  # every byte fetched once


def test_stalled_server_is_detected_and_resumed(env: tuple[FakeHub, Path]) -> None:
    hub, _ = env
    hub.faults.stall(Q4, after_bytes=100_000)
    events: list[DownloadProgress] = []
    result = pull(f"{REPO}:Q4_K_M", policy=FAST, on_progress=events.append)
    assert_complete(hub, result.path)
    assert any(e.state == "retrying" and "stalled" in e.message for e in events)
    assert hub.range_requests(Q4)[1].startswith("bytes=") and hub.range_requests(Q4)[1] != "bytes=0-"


def test_5xx_then_success(env: tuple[FakeHub, Path]) -> None:
    hub, _ = env
    hub.faults.fail_5xx(Q4, times=2)
    result = pull(f"{REPO}:Q4_K_M", policy=FAST)
    assert_complete(hub, result.path)
    assert len(hub.range_requests(Q4)) == 3


def test_persistent_5xx_gives_clear_error_and_keeps_nothing_wrong(env: tuple[FakeHub, Path]) -> None:
    hub, cache_dir = env
    hub.faults.fail_5xx(Q4, times=100)
    with pytest.raises(Exception) as info:
        pull(f"{REPO}:Q4_K_M", policy=FAST)
    assert "failed 4 times in a row: HTTP 503" in str(info.value)
    assert "run the same pull again to resume" in str(info.value)
    assert not blob_of(hub, REPO, Q4, cache_dir).exists()


def test_corrupt_bytes_are_never_marked_complete(env: tuple[FakeHub, Path]) -> None:
    hub, cache_dir = env
    hub.faults.corrupt_bytes(Q4, times=2)
    with pytest.raises(ChecksumMismatch, match="failed its sha256 check twice"):
        pull(f"{REPO}:Q4_K_M", policy=FAST)
    storage = cache.storage_folder(REPO, cache_dir)
    assert not blob_of(hub, REPO, Q4, cache_dir).exists()
    assert not list(storage.rglob("*.incomplete"))  # bad bytes are not kept to be resumed
    assert not (storage / "snapshots").exists() or not list((storage / "snapshots").rglob(Q4))


def test_one_corrupt_transfer_is_redownloaded_and_verified(env: tuple[FakeHub, Path]) -> None:
    hub, _ = env
    hub.faults.corrupt_bytes(Q4, times=1)
    result = pull(f"{REPO}:Q4_K_M", policy=FAST)
    assert_complete(hub, result.path)
    assert hub.range_requests(Q4) == ["", ""]  # second try from zero: the bad bytes could be anywhere


def test_resume_after_partial_hashes_existing_bytes(env: tuple[FakeHub, Path]) -> None:
    """A checksum after resume covers the bytes from before the resume too (LM Studio #1222)."""
    hub, cache_dir = env
    data = hub.repos[REPO].files[Q4].data
    assert data is not None
    part = cache.incomplete_path(REPO, hub.repos[REPO].files[Q4].sha256, cache_dir)
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\x00" * 1000 + data[1000:123_456])  # a partial whose head is damaged
    result = pull(f"{REPO}:Q4_K_M", policy=FAST)
    assert_complete(hub, result.path)
    assert hub.range_requests(Q4) == ["bytes=123456-", ""]  # resumed, failed the digest, refetched whole


@pytest.mark.skipif(os.name != "posix", reason="symlinks")
def test_a_symlinked_partial_download_is_never_written_through(env: tuple[FakeHub, Path]) -> None:
    """In a shared HF cache another user can plant `blobs/<etag>.incomplete -> <some file>`: a pull must refuse to
    resume into it rather than truncate and overwrite the target. (A target outside the repo's folder is refused
    by the containment check already; one inside it, or a link swapped in after that check, needs O_NOFOLLOW.)"""
    hub, cache_dir = env
    part = cache.incomplete_path(REPO, hub.repos[REPO].files[Q4].sha256, cache_dir)
    part.parent.mkdir(parents=True)
    victim = part.parent / "another-users-finished-blob"
    victim.write_text("export PATH=$HOME/bin:$PATH\n")
    part.symlink_to(victim)
    with pytest.raises(SwitchyardError, match="symbolic link"):
        pull(f"{REPO}:Q4_K_M", policy=FAST)
    assert victim.read_text() == "export PATH=$HOME/bin:$PATH\n"
    assert part.is_symlink()


def test_sharded_set_is_one_unit(env: tuple[FakeHub, Path]) -> None:
    hub, cache_dir = env
    hub.faults.fail_5xx(SHARDS[1], times=100)
    with pytest.raises(Exception, match="failed"):
        pull(f"{REPO}:Q8_0", policy=FAST, workers=1)
    storage = cache.storage_folder(REPO, cache_dir)
    assert blob_of(hub, REPO, SHARDS[0], cache_dir).exists()  # the verified shard is kept...
    assert not (storage / "snapshots").exists()  # ...but the set is not published half-done
    hub.faults.server_errors.clear()
    result = pull(f"{REPO}:Q8_0", policy=FAST)
    assert result.path.name == SHARDS[0]
    assert result.reused_bytes == hub.repos[REPO].files[SHARDS[0]].size
    assert hub.range_requests(SHARDS[0]) == [""]  # not fetched a second time
    for name in SHARDS:
        assert_complete(hub, result.path.parent / name, path=name)


def test_pause_resume_and_cancel(env: tuple[FakeHub, Path]) -> None:
    hub, cache_dir = env
    hub.faults.throttle(Q4, 0.01)
    control = DownloadControl()
    paused = threading.Event()
    states: list[str] = []

    def on_progress(e: DownloadProgress) -> None:
        states.append(e.state)
        if e.done_bytes > 50_000 and not control.paused and "paused" not in states:
            control.pause()
        if e.state == "paused":
            paused.set()

    box: dict[str, object] = {}
    worker = threading.Thread(target=lambda: box.setdefault("r", pull(f"{REPO}:Q4_K_M", policy=FAST,
                                                                        control=control, on_progress=on_progress)))
    worker.start()
    assert paused.wait(10)
    hub.faults.delay_per_chunk.clear()
    control.resume()
    worker.join(20)
    result = box["r"]
    assert_complete(hub, result.path)  # type: ignore[attr-defined]
    second = hub.range_requests(Q4)[1]
    assert second.startswith("bytes=") and int(second[6:-1]) > 50_000

    # cancel keeps the partial file so a later pull resumes
    hub.faults.throttle(SHARDS[0], 0.01)
    control = DownloadControl()

    def cancel_soon(e: DownloadProgress) -> None:
        if e.done_bytes > 40_000:
            control.cancel()

    with pytest.raises(DownloadCancelled):
        pull(f"{REPO}:{SHARDS[0]}", policy=FAST, control=control, on_progress=cancel_soon, workers=1)
    part = cache.incomplete_path(REPO, hub.repos[REPO].files[SHARDS[0]].sha256, cache_dir)
    assert part.stat().st_size > 0


def test_gated_repo_without_token_says_what_to_do(env: tuple[FakeHub, Path]) -> None:
    hub, _ = env
    with pytest.raises(GatedModelError) as info:
        pull("gated/llama:Q4_K_M", policy=FAST)
    assert f"accept the license at {hub.endpoint}/gated/llama and add a token" in info.value.message
    assert "HF_TOKEN" in (info.value.hint or "")


def test_gated_repo_with_wrong_token_then_right_token(
    env: tuple[FakeHub, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    hub, _ = env
    monkeypatch.setenv("HF_TOKEN", "hf_wrongwrongwrong123")
    with pytest.raises(GatedModelError, match="this token has no access"):
        pull("gated/llama:Q4_K_M", policy=FAST)
    monkeypatch.setenv("HF_TOKEN", DEFAULT_TOKEN)
    caplog.set_level(logging.DEBUG)
    result = pull("gated/llama:Q4_K_M", policy=FAST)
    assert result.path.read_bytes() == hub.repos["gated/llama"].files["model-Q4_K_M.gguf"].data
    resolves = [r for r in hub.requests if "/resolve/" in r.path and r.path.startswith("/gated/")]
    assert resolves and all(r.headers.get("authorization") == f"Bearer {DEFAULT_TOKEN}" for r in resolves)
    assert DEFAULT_TOKEN not in caplog.text


def test_gated_cli_error_is_one_clear_line_without_token(env: tuple[FakeHub, Path], tmp_path: Path) -> None:
    hub, _ = env
    environment = dict(os.environ, HF_TOKEN="hf_wrongwrongwrong123")
    proc = subprocess.run(
        [str(Path(".venv/bin/switchyard").resolve()), "pull", "gated/llama:Q4_K_M"],
        capture_output=True, text=True, env=environment, timeout=60,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "gated" in proc.stderr and "accept the license" in proc.stderr
    assert "hf_wrongwrongwrong123" not in proc.stderr + proc.stdout


def test_free_disk_precheck_refuses_before_writing(env: tuple[FakeHub, Path]) -> None:
    hub, cache_dir = env
    with pytest.raises(DiskFull, match="Not enough disk space") as info:
        pull(f"{REPO}:Q8_0", policy=FAST, free_bytes=lambda _p: 100_000)
    assert "HF_HUB_CACHE" in (info.value.hint or "")
    assert not [r for r in hub.requests if "/resolve/" in r.path]


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "tinyfs"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=700k", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a 700 KiB tmpfs here ({proc.stderr.decode().strip()}); the ENOSPC path is "
                    "covered by the injected-free-space test only")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_on_a_real_tiny_filesystem(
    env: tuple[FakeHub, Path], tiny_fs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pre-check is told there is room (it cannot foresee other writers); the kernel says ENOSPC."""
    hub, _ = env
    monkeypatch.setenv("HF_HUB_CACHE", str(tiny_fs))
    first = pull(f"{REPO}:Q4_K_M", policy=FAST)  # 400 KB: fits
    before = first.path.read_bytes()
    with pytest.raises(DiskFull, match="disk filled up") as info:
        pull(f"{REPO}:Q8_0", policy=FAST, workers=1, free_bytes=lambda _p: 10 << 30)
    assert "resumes" in (info.value.hint or "")
    assert first.path.read_bytes() == before  # nothing already complete is lost
    assert_complete(hub, first.path)
    # with the precheck telling the truth, the same pull is refused up front
    with pytest.raises(DiskFull, match="Not enough disk space"):
        pull(f"{REPO}:Q8_0", policy=FAST)


def test_interop_with_huggingface_hub_both_ways(env: tuple[FakeHub, Path]) -> None:
    from huggingface_hub import hf_hub_download

    hub, cache_dir = env
    ours = pull(f"{REPO}:Q4_K_M", policy=FAST)
    theirs = hf_hub_download(REPO, Q4, cache_dir=cache_dir, endpoint=hub.endpoint)
    assert Path(theirs) == ours.path
    assert len(hub.range_requests(Q4)) == 1  # the library reused our blob

    hf_hub_download(REPO, SHARDS[0], cache_dir=cache_dir, endpoint=hub.endpoint)
    hf_hub_download(REPO, SHARDS[1], cache_dir=cache_dir, endpoint=hub.endpoint)
    result = pull(f"{REPO}:Q8_0", policy=FAST)
    assert result.reused_bytes == result.total_bytes and result.downloaded_bytes == 0
    assert all(len(hub.range_requests(s)) == 1 for s in SHARDS)


def test_unknown_variant_and_repo_errors(env: tuple[FakeHub, Path]) -> None:
    from desktop.core.common.errors import ModelError

    with pytest.raises(ModelError, match="no variant or file 'Q3_K_S'") as info:
        pull(f"{REPO}:Q3_K_S", policy=FAST)
    assert "Q4_K_M" in (info.value.hint or "")
    with pytest.raises(ModelError, match="No model repo"):
        pull("nobody/nothing", policy=FAST)
    with pytest.raises(ModelError, match="not a Hub repo id"):
        pull("just-a-name", policy=FAST)
