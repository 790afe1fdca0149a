"""The engines' and the app's local surface (issue 21 items 1 and 4), without the real engines: a rogue listener on
the engine's port or socket is never trusted and never gets the key, CRASHED/STOPPED stay final, the app's files
are private under any umask, the root uninstaller survives hostile pidfiles, reaping leaves a reused process group
alone, `switchyard requests` cannot drive the terminal, /v1/models names no paths. tests/test_engine_sockets.py
runs the real engines on their sockets."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from desktop import _frozen
from desktop.core.common import paths, unixhttp
from desktop.core.common.errors import EngineFailed
from desktop.core.engines.base import CommandLine, EngineInstall, LaunchPlan
from desktop.core.engines.llamacpp import LlamaCppAdapter
from desktop.core.runtime.ports import find_free_port
from desktop.core.runtime.supervisor import EngineProcess, EngineState, reap_orphans
from desktop.core.serving.proxy import ProxyServer
from desktop.core.serving.router import Upstream

posix_only = pytest.mark.skipif(os.name != "posix", reason="POSIX sockets, modes and process groups")

# An engine that takes its time before binding its address, as a real one does while it loads; a rogue who binds
# the address first makes its bind fail, and it exits with llama-server's own words.
_LATE_BINDER = """
import socket, sys, time
kind, where = sys.argv[1], sys.argv[2]
print("loading model", flush=True)
time.sleep(1.5)
sock = socket.socket(socket.AF_UNIX if kind == "unix" else socket.AF_INET)
try:
    sock.bind(where if kind == "unix" else ("127.0.0.1", int(where)))
except OSError as exc:
    print(f"couldn't bind HTTP server socket ({exc})", flush=True)
    sys.exit(1)
sock.listen()
time.sleep(60)
"""


class _LateBinder(LlamaCppAdapter):
    """llama.cpp's adapter (its health rule and failure explanations) with the late binder as the server."""

    def build_command(self, plan: LaunchPlan, install: EngineInstall) -> CommandLine:
        where = ("unix", plan.host) if plan.host.endswith(".sock") else ("tcp", str(plan.port))
        return CommandLine([sys.executable, "-c", _LATE_BINDER, *where], {})


class _Rogue:
    """A listener that got to the engine's address first: it answers every request 200 and keeps what it got."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.received: list[bytes] = []
        sock.listen()
        sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    data = conn.recv(65536)
                    if data:
                        self.received.append(data)
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                                     b"Connection: close\r\n\r\n{}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@posix_only
@pytest.mark.parametrize("where", ["tcp", "unix"])
def test_a_rogue_listener_on_the_engines_address_is_never_trusted_and_gets_no_key(where: str, tmp_path: Path
                                                                                  ) -> None:
    """Between the supervisor's check and the engine's bind, another local process binds the address and answers
    /health. The supervisor must not take it for the engine: no request (least of all the per-launch key) goes to
    it, and the engine, unable to bind, is CRASHED with the reason, and stays CRASHED."""
    key = "per-launch-key-" + "x" * 32
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    if where == "tcp":
        plan = LaunchPlan("llama.cpp", model, port=find_free_port(), api_key=key)
    else:
        plan = LaunchPlan("llama.cpp", model, host=str(tmp_path / "engine.sock"), api_key=key)
    install = EngineInstall("llama.cpp", "test", "configured", Path(sys.executable))
    engine = EngineProcess(_LateBinder(), plan, install, log_dir=tmp_path, tcp=where == "tcp")
    engine.start()
    if where == "tcp":
        rogue_sock = socket.socket(socket.AF_INET)
        rogue_sock.bind(("127.0.0.1", plan.port))
    else:
        rogue_sock = socket.socket(socket.AF_UNIX)
        rogue_sock.bind(plan.host)
    rogue = _Rogue(rogue_sock)
    try:
        with pytest.raises(EngineFailed, match="could not bind|stopped before"):
            engine.wait_ready(timeout=30)
        assert rogue.received == [], "the impostor was asked something (with the engine's key)"
        assert engine.state == EngineState.CRASHED
        engine._set_state(EngineState.READY)  # a late READY (e.g. a probe that raced the crash)
        assert engine.state == EngineState.CRASHED, "CRASHED is final"
    finally:
        engine.stop()
        rogue.close()
    assert all(key.encode() not in data for data in rogue.received)


def test_stopped_is_final_too(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    engine = EngineProcess(LlamaCppAdapter(), LaunchPlan("llama.cpp", model), EngineInstall(
        "llama.cpp", "t", "configured", Path(sys.executable)), log_dir=tmp_path)
    engine._set_state(EngineState.STARTING)
    engine._set_state(EngineState.STOPPED)
    for late in (EngineState.READY, EngineState.LOADING, EngineState.CRASHED):
        engine._set_state(late)
        assert engine.state == EngineState.STOPPED


@posix_only
def test_an_engine_without_an_explicit_port_gets_a_private_socket_and_no_tcp_port(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    install = EngineInstall("llama.cpp", "test", "configured", Path("/opt/llama/llama-server"))
    engine = EngineProcess(LlamaCppAdapter(), LaunchPlan("llama.cpp", model), install, log_dir=tmp_path)
    engine._choose_address()
    path = Path(engine.plan.host)
    assert unixhttp.is_socket_host(engine.plan.host) and engine.plan.port == 0
    assert engine.base_url.startswith("http+unix://") and unixhttp.socket_of(engine.base_url) == str(path)
    folder = os.lstat(path.parent)
    assert stat.S_ISDIR(folder.st_mode) and stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == os.getuid()
    argv = LlamaCppAdapter().build_command(engine.plan, install).argv
    assert "--port" not in argv and argv[argv.index("--host") + 1] == str(path)
    asked = EngineProcess(LlamaCppAdapter(), LaunchPlan("llama.cpp", model), install, log_dir=tmp_path, tcp=True)
    asked._choose_address()
    assert asked.plan.port > 0 and asked.base_url == f"http://127.0.0.1:{asked.plan.port}"


# --- files: private under any umask --------------------------------------------------------------------------
def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask_022() -> Iterator[None]:
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


@posix_only
def test_the_apps_files_are_private_under_umask_022(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    umask_022: None) -> None:
    from desktop.core.runtime.telemetry import SqliteSamples
    from desktop.core.storage.history import Store

    home = tmp_path / "home"
    monkeypatch.setenv("SWITCHYARD_HOME", str(home))
    with Store() as store:
        store.add_requests([{"t": time.time(), "method": "POST", "path": "/v1/completions", "status": 200,
                             "request_body": "a captured prompt"}])
    SqliteSamples(home / "samples.sqlite3").add_samples([(1.0, "s", "x", 1.0)])
    for folder in (home, paths.logs_dir(), paths.run_dir()):
        assert _mode(folder) == 0o700, folder
    for file in home.glob("*.sqlite3*"):
        assert _mode(file) & 0o077 == 0, file
    # an engine's log and pidfile, written by the supervisor
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    install = EngineInstall("llama.cpp", "test", "configured", Path(sys.executable))
    engine = EngineProcess(_LateBinder(), LaunchPlan("llama.cpp", model), install, tcp=True)
    engine.start()
    try:
        pidfile = paths.run_dir() / f"engine-{engine.pid}.json"
        assert _mode(pidfile) == 0o600
        deadline = time.monotonic() + 10
        while not engine.log_path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # the log is opened by the reader thread as the engine's first bytes arrive
        assert _mode(engine.log_path) == 0o600
    finally:
        engine.stop()


@posix_only
def test_existing_state_is_tightened_on_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              umask_022: None) -> None:
    from desktop.core.storage.history import Store

    home = tmp_path / "old-home"
    (home / "logs").mkdir(parents=True)
    (home / "run").mkdir()
    db = home / "history.sqlite3"
    with Store(db):
        pass
    for path, mode in ((home, 0o755), (home / "logs", 0o755), (home / "run", 0o755), (db, 0o644)):
        path.chmod(mode)
    monkeypatch.setenv("SWITCHYARD_HOME", str(home))
    with Store():
        pass
    paths.logs_dir(), paths.run_dir()
    assert [_mode(p) for p in (home, home / "logs", home / "run")] == [0o700] * 3
    assert _mode(db) == 0o600


@posix_only
def test_the_cli_runs_under_umask_077(tmp_path: Path) -> None:
    """Started from a shell with umask 022, `switchyard requests` creates the data folder and history 0700/0600."""
    home = tmp_path / "cli-home"
    result = subprocess.run([sys.executable, "-m", "desktop", "requests", "--history"],  # noqa: S603
                            capture_output=True, text=True, timeout=120, preexec_fn=lambda: os.umask(0o022),  # noqa: PLW1509
                            env={**os.environ, "SWITCHYARD_HOME": str(home)})
    assert result.returncode == 0, result.stderr
    assert _mode(home) == 0o700
    assert _mode(home / "history.sqlite3") == 0o600
    # and what it writes without asking for a mode (an export) is the user's only too: the process umask is 077
    out = tmp_path / "plan.sh"
    result = subprocess.run([sys.executable, "-m", "desktop", "export", "--engine", "vllm", "--model", "org/x",  # noqa: S603
                             "--format", "shell", "-o", str(out)], capture_output=True, text=True, timeout=120,
                            preexec_fn=lambda: os.umask(0o022), env={**os.environ, "SWITCHYARD_HOME": str(home)})  # noqa: PLW1509
    assert result.returncode == 0, result.stderr
    assert _mode(out) == 0o600


# --- the root uninstaller and the orphan reaper against hostile pidfiles ------------------------------------
def _deep_json(depth: int = 100_000) -> str:
    return '{"pid": ' + "[" * depth + "]" * depth + "}"


@posix_only
def test_the_uninstaller_survives_a_fifo_a_folder_and_deep_json(tmp_path: Path) -> None:
    """Any local user can put these in their own run folder before an admin runs `apt remove`: the sweep must
    neither hang (FIFO), nor stop (a folder, deep JSON), and still stop the real orphan recorded after them."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.mkfifo(run_dir / "engine-1.json")
    (run_dir / "engine-2.json").mkdir()
    (run_dir / "engine-3.json").write_text(_deep_json())
    (run_dir / "engine-4.json").write_bytes(b'{"pid": 1, "x": "' + b"a" * 70_000 + b'"}')  # over 64 KiB
    program = run_dir.parent / "engines" / "llama.cpp" / "bin" / "llama-server"
    program.parent.mkdir(parents=True)
    program.write_bytes(Path("/bin/sleep").read_bytes())
    program.chmod(0o755)
    orphan = subprocess.Popen([str(program), "60"], start_new_session=True)  # noqa: S603
    try:
        created = psutil.Process(orphan.pid).create_time()
        (run_dir / f"engine-{orphan.pid}.json").write_text(json.dumps(
            {"pid": orphan.pid, "created": created, "owner_pid": 0, "engine": "llama.cpp"}))
        outcome: list[Any] = []
        sweep = threading.Thread(target=lambda: outcome.append(_frozen.stop_recorded_engines([run_dir], grace=2)),
                                 daemon=True)
        sweep.start()
        sweep.join(10)
        assert not sweep.is_alive(), "the uninstaller hangs on a FIFO pidfile"
        assert outcome and [item.pid for item in outcome[0]] == [orphan.pid]
        assert orphan.wait(10) is not None
        assert (run_dir / "engine-2.json").is_dir(), "a folder is never removed"
    finally:
        with contextlib.suppress(OSError):  # unblock a sweep stuck in open() on the FIFO (old code)
            os.close(os.open(run_dir / "engine-1.json", os.O_WRONLY | os.O_NONBLOCK))
        orphan.kill()
        orphan.wait()


@posix_only
def test_reaping_survives_hostile_pidfiles() -> None:
    run = paths.run_dir()
    fifo, folder, deep = run / "engine-900001.json", run / "engine-900002.json", run / "engine-900003.json"
    os.mkfifo(fifo)
    folder.mkdir()
    deep.write_text(_deep_json())
    try:
        done: list[list[int]] = []
        reaper = threading.Thread(target=lambda: done.append(reap_orphans()), daemon=True)
        reaper.start()
        reaper.join(10)
        assert not reaper.is_alive() and done == [[]]
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        for path in (fifo, deep):
            path.unlink(missing_ok=True)
        folder.rmdir()


def _leaderless_group(command: list[str]) -> tuple[int, psutil.Process]:
    """Start `command` in a new session whose leader exits at once: a leaderless process group (a double-forked
    daemon, a shell pipeline) holding only the leader's child. Returns (group id, the child)."""
    leader = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, text=True)  # noqa: S603
    assert leader.stdout is not None
    child_pid = int(leader.stdout.readline())
    leader.wait(10)
    return leader.pid, psutil.Process(child_pid)


@posix_only
@pytest.mark.parametrize("stale", ["reused-group", "before-boot"])
def test_reaping_leaves_a_reused_leaderless_group_alone(stale: str) -> None:
    """The pidfile of an engine whose whole group died names a group id that a new leaderless group now has:
    unrelated programs (`sleep` here), or even the same interpreter when the pidfile is older than this boot."""
    if stale == "reused-group":
        pgid, child = _leaderless_group(["sh", "-c", "sleep 120 & echo $!; exit"])
        created = max(psutil.boot_time() + 1, time.time() - 3600)
    else:
        pgid, child = _leaderless_group([sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen("
                                         "[sys.executable, '-c', 'import time; time.sleep(120)']).pid, flush=True)"])
        created = psutil.boot_time() - 100
    pidfile = paths.run_dir() / f"engine-{pgid}.json"
    try:
        assert os.getpgid(child.pid) == pgid
        pidfile.write_text(json.dumps({"pid": pgid, "pgid": pgid, "created": created, "owner_pid": 999_999_999,
                                       "owner_created": 1.0, "engine": "vllm", "program": sys.executable}))
        assert reap_orphans() == []
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE, "an unrelated process was killed"
        assert not pidfile.exists()
    finally:
        pidfile.unlink(missing_ok=True)
        with contextlib.suppress(psutil.Error):
            child.kill()


# --- what the CLI prints and what /v1/models shows --------------------------------------------------------------
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def test_switchyard_requests_escapes_control_characters(tmp_path: Path) -> None:
    from desktop.core.storage.history import Store

    home = tmp_path / "req-home"
    with Store(home / "history.sqlite3") as store:
        store.add_requests([{"t": time.time(), "seq": 1, "method": "POST", "path": "/v1/completions\x1b[8m",
                             "status": 400, "model": "\x1b]0;owned\x07\x1b[2J", "engine": "llama.cpp",
                             "client": "127.0.0.1:5\u202e", "error": "bad \x9b31m model"}])
    result = subprocess.run([sys.executable, "-m", "desktop", "requests", "--history"],  # noqa: S603
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "SWITCHYARD_HOME": str(home)})
    assert result.returncode == 0, result.stderr
    assert not _CONTROL.search(result.stdout), repr(result.stdout)
    assert "\\x1b]0;owned" in result.stdout  # shown, escaped: the operator still sees what was sent


def test_v1_models_shows_names_not_paths() -> None:
    home_path = "/home/alice/.cache/huggingface/hub/models--org--tiny/snapshots/0123abcd/tiny-Q4_K_M.gguf"
    proxy = ProxyServer(port=find_free_port())
    proxy.start()
    try:
        proxy.set_upstream(Upstream("llama.cpp@1", "llama.cpp", "http://127.0.0.1:9", "switchyard", model=home_path))
        data = httpx.get(proxy.url + "/v1/models", trust_env=False, timeout=10).json()
    finally:
        proxy.stop()
    text = json.dumps(data)
    assert "/home/alice" not in text and "snapshots" not in text
    assert data["data"][0]["switchyard"]["model"] == "org/tiny/tiny-Q4_K_M.gguf"

    multi = ProxyServer(port=find_free_port())
    multi.set_models({"chat": {"engine": "llama.cpp", "model": "/home/alice/models/chat.gguf"}})
    multi.start()
    try:
        listed = httpx.get(multi.url + "/v1/models", trust_env=False, timeout=10).json()
    finally:
        multi.stop()
    assert "/home/alice" not in json.dumps(listed)
    assert listed["data"][0]["switchyard"]["model"] == "chat.gguf"
