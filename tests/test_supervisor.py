"""The supervisor with the real llama-server: cold-start phases in order, clean stop, explained failures (corrupt
GGUF, missing binary, busy port, out of memory, killed mid-request), orphan reaping and PDEATHSIG."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from desktop.core.common import paths
from desktop.core.common.errors import EngineFailed, PortBusy
from desktop.core.engines import get_adapter
from desktop.core.engines.base import EngineInstall, LaunchPlan
from desktop.core.runtime.supervisor import (
    EngineEvent,
    EngineProcess,
    EngineState,
    reap_orphans,
    stream_completion,
)

llama = get_adapter("llama.cpp")


def _gone(pid: int, timeout: float = 15.0) -> bool:
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return False
    return True


def test_oom_log_lines_are_explained() -> None:
    tail = ["llama_kv_cache: CPU KV buffer size = 99999.00 MiB",
            "ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate CPU buffer of size 104857600000",
            "main: exiting due to model loading error"]
    reason = llama.explain_failure(1, tail)
    assert "allocate memory" in reason.reason and "context" in reason.suggestion
    vllm_reason = get_adapter("vllm").explain_failure(1, ["torch.OutOfMemoryError: CUDA out of memory."])
    assert "out of" in vllm_reason.reason.lower() and "gpu_memory_utilization" in vllm_reason.suggestion


def test_orphans_of_a_dead_owner_are_reaped_and_live_owners_left_alone() -> None:
    dead_owner = subprocess.Popen([sys.executable, "-c", "pass"])  # noqa: S603
    dead_owner.wait()
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],  # noqa: S603
                              start_new_session=True)
    kept = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],  # noqa: S603
                            start_new_session=True)
    try:
        def record(pid: int, owner: int) -> dict[str, Any]:
            return {"pid": pid, "created": psutil.Process(pid).create_time(), "owner_pid": owner,
                    "owner_created": psutil.Process(owner).create_time() if psutil.pid_exists(owner) else 1.0,
                    "engine": "test", "port": 1, "log": ""}

        (paths.run_dir() / f"engine-{orphan.pid}.json").write_text(json.dumps(record(orphan.pid, dead_owner.pid)))
        (paths.run_dir() / f"engine-{kept.pid}.json").write_text(json.dumps(record(kept.pid, os.getpid())))
        assert reap_orphans() == [orphan.pid]
        assert orphan.wait(10) is not None
        assert kept.poll() is None
        assert not (paths.run_dir() / f"engine-{orphan.pid}.json").exists()
        assert (paths.run_dir() / f"engine-{kept.pid}.json").exists()
    finally:
        for proc in (orphan, kept):
            proc.kill()
            proc.wait()
        (paths.run_dir() / f"engine-{kept.pid}.json").unlink(missing_ok=True)


def test_missing_binary_is_a_clear_crash(tmp_path: Path) -> None:
    install = EngineInstall("llama.cpp", "test", "configured", tmp_path / "no-such-llama-server")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 64)
    engine = EngineProcess(llama, LaunchPlan("llama.cpp", model), install, log_dir=tmp_path)
    with pytest.raises(EngineFailed, match="could not start") as caught:
        engine.start()
    assert caught.value.hint and "engines doctor" in caught.value.hint
    assert engine.state == EngineState.CRASHED


def test_busy_port_is_refused_before_spawning(tmp_path: Path, llama_install: EngineInstall) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        engine = EngineProcess(llama, LaunchPlan("llama.cpp", tmp_path / "m.gguf", port=port), llama_install,
                               log_dir=tmp_path)
        with pytest.raises(PortBusy, match=f"port {port}"):
            engine.start()
        assert engine.pid is None


@pytest.mark.engine
@pytest.mark.llamacpp
def test_phases_in_order_and_stop_leaves_nothing(llama_install: EngineInstall, demo_model: Any,
                                                 tmp_path: Path) -> None:
    events: list[EngineEvent] = []
    engine = EngineProcess(llama, LaunchPlan("llama.cpp", demo_model.gguf_path, slots=2), llama_install,
                           log_dir=tmp_path)
    engine.subscribe(events.append)
    engine.start()
    cold = engine.wait_ready(timeout=300)
    pid = engine.pid
    assert pid is not None and (paths.run_dir() / f"engine-{pid}.json").exists()
    markers = cold.markers
    assert markers["loading_model"] <= markers["model_loaded"] <= cold.t1_health_s  # type: ignore[operator]
    assert cold.t1_health_s <= cold.t2_first_token_s <= cold.t3_first_request_s < 120  # type: ignore[operator]
    phases = [e.phase for e in events if e.kind == "phase"]
    assert phases.index("loading_model") < phases.index("T1_health") < phases.index("T2_first_token") \
        < phases.index("T3_first_request")
    assert any(e.kind == "log" for e in events)
    children = [p.pid for p in psutil.Process(pid).children(recursive=True)]
    outcome = engine.stop()
    states = [e.state for e in events if e.kind == "state"]
    assert states == [EngineState.STARTING, EngineState.LOADING, EngineState.READY, EngineState.STOPPING,
                      EngineState.STOPPED]
    assert outcome is not None and outcome.state == EngineState.STOPPED and outcome.reason is None
    assert all(_gone(p) for p in [pid, *children])
    assert not (paths.run_dir() / f"engine-{pid}.json").exists()
    assert Path(outcome.log_path).read_text().strip()


@pytest.mark.engine
@pytest.mark.llamacpp
def test_corrupt_gguf_crashes_at_load_with_an_explanation(llama_install: EngineInstall, tmp_path: Path) -> None:
    model = tmp_path / "corrupt.gguf"
    model.write_bytes(b"GGUF" + os.urandom(4096))
    engine = EngineProcess(llama, LaunchPlan("llama.cpp", model), llama_install, log_dir=tmp_path)
    engine.start()
    with pytest.raises(EngineFailed) as caught:
        engine.wait_ready(timeout=120)
    engine.stop()
    assert engine.state == EngineState.CRASHED
    assert engine.outcome is not None and engine.outcome.reason is not None
    assert "GGUF" in caught.value.message or "could not load the model" in caught.value.message
    assert str(engine.log_path) in (caught.value.hint or "")


@pytest.mark.engine
@pytest.mark.llamacpp
def test_absurd_context_fails_allocation_with_a_memory_explanation(llama_install: EngineInstall,
                                                                   demo_model: Any, tmp_path: Path) -> None:
    total = psutil.virtual_memory().total + psutil.swap_memory().total
    # 8 layers × 4 KV heads × 64 dims × (K + V) × 2 bytes = 8 KiB of f16 KV cache per token of context.
    ctx = int(total * 4 // 8192)
    plan = LaunchPlan("llama.cpp", demo_model.gguf_path, ctx_per_request=ctx, slots=1, extra_args=("--fit", "off"))
    engine = EngineProcess(llama, plan, llama_install, log_dir=tmp_path)
    engine.start()
    with pytest.raises(EngineFailed) as caught:
        engine.wait_ready(timeout=120)
    engine.stop()
    assert engine.state == EngineState.CRASHED
    assert "memory" in caught.value.message, caught.value


@pytest.mark.engine
@pytest.mark.llamacpp
def test_engine_killed_mid_request(llama_install: EngineInstall, demo_model: Any, tmp_path: Path) -> None:
    engine = EngineProcess(llama, LaunchPlan("llama.cpp", demo_model.gguf_path, slots=1), llama_install,
                           log_dir=tmp_path)
    engine.start()
    try:
        engine.wait_ready(timeout=300)
        stream = stream_completion(engine.base_url, "Once", max_tokens=4000, model="switchyard",
                                   extra={"ignore_eos": True})
        next(d for d in stream if d.has_token)
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(httpx.HTTPError):
            for _ in stream:
                pass
        assert engine._exited.wait(10)
        engine._join_reader()
        assert engine.state == EngineState.CRASHED
        assert engine.outcome is not None and engine.outcome.reason is not None
        assert "killed by signal 9" in engine.outcome.reason.reason
        assert "killed by signal 9" in engine.failure().message
    finally:
        engine.stop()


def _serve_until_ready(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen(  # noqa: S603 - our own CLI
        [sys.executable, "-m", "desktop", "serve", "--engine", "llama.cpp", "--model", "demo", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    lines: list[str] = []
    assert proc.stderr is not None
    deadline = time.monotonic() + 300
    for line in proc.stderr:  # blocks on the child's output; ends if it exits
        lines.append(line)
        if line.startswith("ready:") or time.monotonic() > deadline:
            break
    assert lines and lines[-1].startswith("ready:"), "".join(lines)
    return proc, lines


def _engine_pids() -> list[int]:
    pids = []
    for file in paths.run_dir().glob("engine-*.json"):
        record = json.loads(file.read_text())
        pids.append(int(record["pid"]))
    return pids


@pytest.mark.engine
@pytest.mark.llamacpp
@pytest.mark.parametrize(("endpoint", "guard"), [(False, "pdeathsig"), (True, "pdeathsig"), (False, "watchdog")],
                         ids=["plain", "endpoint", "watchdog"])
def test_sigkill_of_switchyard_takes_the_engine_with_it(endpoint: bool, guard: str, llama_install: EngineInstall,
                                                        demo_model: Any) -> None:
    """PDEATHSIG on Linux; the watchdog is what macOS uses, run here by choosing it."""
    before = set(_engine_pids())
    extra = ("--endpoint", "--proxy-port", str(_free_port())) if endpoint else ()
    proc, _lines = _serve_until_ready(*extra, env={"SWITCHYARD_ORPHAN_GUARD": guard})
    owned = [pid for pid in _engine_pids() if pid not in before
             and json.loads((paths.run_dir() / f"engine-{pid}.json").read_text())["owner_pid"] == proc.pid]
    assert len(owned) == 1
    engine_pid = owned[0]
    assert psutil.pid_exists(engine_pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert _gone(engine_pid), f"{guard} should have stopped the engine with its owner"
    reap_orphans()  # the pidfile of the dead owner is cleaned at the next start
    assert not (paths.run_dir() / f"engine-{engine_pid}.json").exists()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_engine_log_rotates_and_keeps_the_newest_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from desktop.core.runtime import supervisor

    monkeypatch.setattr(supervisor, "LOG_MAX_BYTES", 1000)
    log = supervisor._RotatingLog(tmp_path / "engine.log")
    for index in range(60):  # 60 lines of 100 bytes: six files' worth
        log.write(f"line {index:03d} ".ljust(99, ".").encode() + b"\n")
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["engine.log", "engine.log.1", "engine.log.2", "engine.log.3"]  # three backups, no more
    assert all(p.stat().st_size <= 1000 for p in tmp_path.iterdir())
    assert (tmp_path / "engine.log").read_text().splitlines()[-1].startswith("line 059")
    assert (tmp_path / "engine.log.1").read_text().splitlines()[-1].startswith("line 049")
    assert (tmp_path / "engine.log.3").read_text().splitlines()[0].startswith("line 020")


_APP_WITH_A_WATCHED_ENGINE = """
import os, sys
os.environ["SWITCHYARD_ORPHAN_GUARD"] = "watchdog"
from desktop.core.runtime.supervisor import _spawn
engine, watcher = _spawn([sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ), None)
print(engine.pid, watcher.pid, flush=True)
sys.stdin.readline()
"""


def test_watchdog_stops_the_engine_when_the_app_is_killed() -> None:
    """The macOS path (no PDEATHSIG there), run here by choosing it: SIGKILL the app, the engine goes too."""
    app = subprocess.Popen([sys.executable, "-c", _APP_WITH_A_WATCHED_ENGINE],  # noqa: S603
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert app.stdout is not None
    engine_pid, watcher_pid = (int(word) for word in app.stdout.readline().split())
    assert psutil.Process(watcher_pid).cmdline()[-2:] == [str(app.pid), str(engine_pid)]
    assert psutil.Process(engine_pid).status() != psutil.STATUS_ZOMBIE
    app.send_signal(signal.SIGKILL)
    app.wait(10)
    assert _gone(engine_pid), "the watchdog should have stopped the engine"
    assert _gone(watcher_pid), "the watchdog should end once its engine is stopped"


def test_watchdog_ends_quietly_when_the_engine_exits_first() -> None:
    from desktop.core.runtime import watchdog

    app = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],  # noqa: S603
                           stdin=subprocess.PIPE)
    engine = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],  # noqa: S603
                              stdin=subprocess.PIPE, start_new_session=True)
    try:
        watcher = subprocess.Popen(watchdog.command(app.pid, engine.pid))  # noqa: S603
        assert engine.stdin is not None
        engine.stdin.close()  # the engine exits on its own
        engine.wait(10)
        assert watcher.wait(15) == 0
        assert app.poll() is None  # the app was left alone
    finally:
        assert app.stdin is not None
        app.stdin.close()
        app.wait(10)


def test_each_platform_gets_its_orphan_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    from desktop.core.runtime import supervisor

    monkeypatch.delenv("SWITCHYARD_ORPHAN_GUARD", raising=False)
    for platform, guard in (("linux", "pdeathsig"), ("darwin", "watchdog"), ("freebsd14", "watchdog"),
                            ("win32", "job")):
        monkeypatch.setattr(supervisor.sys, "platform", platform)
        assert supervisor.orphan_guard() == guard
    monkeypatch.setattr(supervisor.sys, "platform", "linux")
    monkeypatch.setenv("SWITCHYARD_ORPHAN_GUARD", "watchdog")
    assert supervisor.orphan_guard() == "watchdog"
