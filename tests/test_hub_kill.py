"""kill -9 of a running `switchyard pull`, then the same pull again: it continues from the partial bytes."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fakehub import FakeHub, write_tiny_gguf

from desktop.core.hub import cache

REPO = "demo/tiny-GGUF"
FILE = "tiny-Q4_K_M.gguf"
SWITCHYARD = [sys.executable, "-m", "desktop"]


def wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_kill_9_then_resume(tmp_path: Path) -> None:
    cache_dir = tmp_path / "hf-cache"
    with FakeHub() as hub:
        gguf = write_tiny_gguf(tmp_path / "src" / FILE, n_bytes=600_000)
        hub.add_repo(REPO, {FILE: gguf.read_bytes()}, tags=["gguf"])
        expected = hub.repos[REPO].files[FILE]
        env = dict(
            os.environ,
            HF_ENDPOINT=hub.endpoint,
            HF_HUB_CACHE=str(cache_dir),
            SWITCHYARD_HOME=str(tmp_path / "home"),
            SWITCHYARD_NO_KEYRING="1",
            HF_HUB_DISABLE_IMPLICIT_TOKEN="1",
        )
        env.pop("HF_TOKEN", None)
        part = cache.incomplete_path(REPO, expected.sha256, cache_dir)

        hub.faults.throttle(FILE, 0.02)  # ~800 KB/s: slow enough to catch it in flight
        proc = subprocess.Popen([*SWITCHYARD, "pull", f"{REPO}:Q4_K_M"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            wait_for(lambda: part.exists() and part.stat().st_size >= 64 * 1024 or proc.poll() is not None,
                     60, "the partial file to have bytes")
            assert proc.poll() is None, proc.communicate()
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
        partial = part.stat().st_size
        assert 0 < partial < expected.size

        hub.faults.delay_per_chunk.clear()
        done = subprocess.run([*SWITCHYARD, "pull", f"{REPO}:Q4_K_M"], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        path = Path(done.stdout.strip())
        assert path.name == FILE and path.is_relative_to(cache_dir)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == expected.sha256
        assert hub.range_requests(FILE)[-1] == f"bytes={partial}-"
        assert not part.exists()

