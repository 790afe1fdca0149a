"""The supervisor with the real llama-server: cold-start phases in order, clean stop, explained failures (corrupt
GGUF, missing binary, busy port, out of memory, killed mid-request), orphan reaping and PDEATHSIG."""

from __future__ import annotations

import contextlib
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


LLAMA_BAD_CTX_LOG = [
    'error while handling argument "--ctx-size": stoi',
    "",
    "usage:",
    "-c,    --ctx-size N                     size of the prompt context (default: 0, 0 = loaded from model)",
    "                                        (env: LLAMA_ARG_CTX_SIZE)",
    "",
    "",
    "to show complete usage, run with -h",
]


def test_llama_argument_errors_are_explained_by_their_first_line_not_the_usage_text() -> None:
    reason = llama.explain_failure(1, LLAMA_BAD_CTX_LOG)
    assert "--ctx-size" in reason.reason and "32-bit" in reason.reason, reason
    other = llama.explain_failure(1, ['error while handling argument "--cache-type-k": unsupported type: q9',
                                      "usage:", "to show complete usage, run with -h"])
    assert "--cache-type-k" in other.reason and "q9" in other.reason
    unknown = llama.explain_failure(1, ["main: error: something new went wrong", "", "to show complete usage"])
    assert "something new went wrong" in unknown.reason


def test_vllm_validation_errors_are_explained_by_their_message_not_the_pydantic_link() -> None:
    """Lines recorded from the real vLLM CPU build started with --ctx 1000000000 (cheaper than starting it)."""
    recorded = (Path(__file__).parent / "data" / "vllm-max-model-len-too-long.log").read_text().splitlines()
    assert recorded[-1].strip().startswith("For further information visit")
    reason = get_adapter("vllm").explain_failure(1, recorded)
    assert "1000000000" in reason.reason and "max_position_embeddings=4096" in reason.reason, reason
    assert "--ctx" in reason.suggestion
    other = get_adapter("vllm").explain_failure(1, [
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for SchedulerConfig",
        "  Value error, max_num_batched_tokens (16) must be greater than or equal to max_num_seqs (64). "
        "[type=value_error, input_value=ArgsKwargs((), {}), input_type=ArgsKwargs]",
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error"])
    assert "max_num_batched_tokens (16)" in other.reason and "errors.pydantic.dev" not in other.reason
    fallback = get_adapter("vllm").explain_failure(1, ["RuntimeError: something new", "    For further information"])
    assert "RuntimeError: something new" in fallback.reason


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
                    "engine": "test", "port": 1, "log": "", "program": sys.executable}

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


_LEADER_WITH_A_CHILD = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
"""


def test_the_next_start_reaps_an_engines_group_after_its_leader_died() -> None:
    """vLLM's EngineCore and workers share the API server's process group and outlive it: the pidfile records
    the group, and the next start stops what is left of it although the recorded pid is gone."""
    dead_owner = subprocess.Popen([sys.executable, "-c", "pass"])  # noqa: S603
    dead_owner.wait()
    leader = subprocess.Popen([sys.executable, "-c", _LEADER_WITH_A_CHILD],  # noqa: S603
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert leader.stdout is not None
    child_pid = int(leader.stdout.readline())
    created = psutil.Process(leader.pid).create_time()
    leader.wait(10)  # the leader exits; its child lives on in its group
    child = psutil.Process(child_pid)
    try:
        assert os.getpgid(child_pid) == leader.pid
        record = {"pid": leader.pid, "created": created, "pgid": leader.pid, "owner_pid": dead_owner.pid,
                  "owner_created": 1.0, "engine": "vllm", "port": 1, "log": "", "program": sys.executable}
        pidfile = paths.run_dir() / f"engine-{leader.pid}.json"
        pidfile.write_text(json.dumps(record))
        assert reap_orphans() == [leader.pid]
        assert _gone(child_pid, 10)
        assert not pidfile.exists()
    finally:
        if child.is_running():
            child.kill()


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
def test_a_log_reader_behind_the_health_poll_still_puts_load_markers_before_t1(
        llama_install: EngineInstall, demo_model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader thread can fall behind the health poll (a loaded CI box): the load markers it reads after T1 were
    printed before it, so they are stamped no later than T1 and their phase events come before T1's."""
    from desktop.core.runtime.enginelog import EngineLog

    original = EngineLog._line
    behind = {"model_loaded": False}

    def lagging(self: Any, raw: bytes) -> None:
        if b"model loaded" in raw and not behind["model_loaded"]:
            behind["model_loaded"] = True
            time.sleep(0.3)  # simulates the lag itself (not a wait for anything): the poll answers meanwhile
        original(self, raw)

    monkeypatch.setattr(EngineLog, "_line", lagging)
    events: list[EngineEvent] = []
    with EngineProcess(llama, LaunchPlan("llama.cpp", demo_model.gguf_path, slots=1), llama_install,
                       log_dir=tmp_path) as engine:
        engine.subscribe(events.append)
        engine.start()
        cold = engine.wait_ready(timeout=300)
    assert behind["model_loaded"]
    assert cold.t1_health_s is not None and cold.markers["model_loaded"] <= cold.t1_health_s
    assert all(end <= cold.t1_health_s for end in cold.phase_ends.values()), cold.phase_ends
    phases = [e.phase for e in events if e.kind == "phase"]
    assert phases.index("model_loaded") < phases.index("T1_health"), phases


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
    from desktop.core.runtime import enginelog

    monkeypatch.setattr(enginelog, "LOG_MAX_BYTES", 1000)
    log = enginelog.RotatingLog(tmp_path / "engine.log")
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
from desktop.core.runtime.spawning import spawn
engine, watcher = spawn([sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ), None)
print(engine.pid, watcher.pid, flush=True)
sys.stdin.readline()
"""


def test_watchdog_stops_the_engine_when_the_app_is_killed() -> None:
    """The macOS path (no PDEATHSIG there), run here by choosing it: SIGKILL the app, the engine goes too."""
    app = subprocess.Popen([sys.executable, "-c", _APP_WITH_A_WATCHED_ENGINE],  # noqa: S603
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert app.stdout is not None
    engine_pid, watcher_pid = (int(word) for word in app.stdout.readline().split())
    # Popen returns once exec began; /proc shows the new argv only when the kernel finished loading it
    assert _wait_for(lambda: psutil.Process(watcher_pid).cmdline()[-2:] == [str(app.pid), str(engine_pid)], 10)
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
    from desktop.core.runtime import spawning

    monkeypatch.delenv("SWITCHYARD_ORPHAN_GUARD", raising=False)
    for platform, guard in (("linux", "pdeathsig"), ("darwin", "watchdog"), ("freebsd14", "watchdog"),
                            ("win32", "job")):
        monkeypatch.setattr(spawning.sys, "platform", platform)
        assert spawning.orphan_guard() == guard
    monkeypatch.setattr(spawning.sys, "platform", "linux")
    monkeypatch.setenv("SWITCHYARD_ORPHAN_GUARD", "watchdog")
    assert spawning.orphan_guard() == "watchdog"


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for(condition: Any, timeout: float, step: float = 0.1) -> Any:
    """Poll `condition` until it returns something truthy or `timeout` passes (then its last value)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)


@pytest.mark.engine
@pytest.mark.vllm
@pytest.mark.parametrize("moment", ["serving", "loading"])
def test_sigkill_of_switchyard_leaves_no_vllm_process(moment: str, vllm_install: EngineInstall,
                                                     demo_model: Any) -> None:
    """vLLM's EngineCore, workers and resource tracker share the API server's group, which PDEATHSIG does not
    reach: the watchdog stops the group when the app dies (and the next start would reap what is left)."""
    from desktop.core.runtime import proctree

    before = set(_engine_pids())
    proc = subprocess.Popen(  # noqa: S603 - our own CLI
        [sys.executable, "-m", "desktop", "serve", "--engine", "vllm", "--model", "demo", "--no-install",
         "--ctx", "2048", "--vllm-eager"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def engine_pid() -> int | None:
            for pid in set(_engine_pids()) - before:
                record = json.loads((paths.run_dir() / f"engine-{pid}.json").read_text())
                if record["owner_pid"] == proc.pid:
                    return pid
            return None

        pid = _wait_for(engine_pid, 120)
        assert pid is not None, "no engine was recorded"
        record = json.loads((paths.run_dir() / f"engine-{pid}.json").read_text())
        assert record["pgid"] == pid
        if moment == "serving":
            assert proc.stderr is not None
            assert any(line.startswith("ready:") for line in proc.stderr), "vLLM never became ready"
        else:  # loading: the engine core (or multiprocessing's helpers) has been forked, the server is not ready

            def forked() -> bool:
                for member in proctree.group_members(pid):
                    with contextlib.suppress(psutil.Error):
                        if member.pid != pid and ("VLLM::" in member.name()
                                                  or "multiprocessing" in " ".join(member.cmdline())):
                            return True
                return False

            assert _wait_for(forked, 300), "vLLM forked no engine core"
        members = proctree.members_of(proctree.Recorded(pid, record["created"], pid))
        names = {m.name() for m in members if _running(m)}
        assert len(members) >= 2, names
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        def alive() -> list[psutil.Process]:
            return [m for m in members if _running(m)]

        started = time.monotonic()
        gone = _wait_for(lambda: not alive(), 5.0)
        print(f"vLLM ({moment}) tree of {len(members)} {sorted(names)}: "
              f"{'gone after' if gone else 'still there after'} {time.monotonic() - started:.2f} s")
        if not gone:
            reap_orphans()  # the next start
        assert not alive(), [m.pid for m in alive()]
        assert not proctree.group_members(pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.engine
@pytest.mark.llamacpp
def test_restart_on_the_same_proxy_port_right_after_a_kill_with_a_client_connected(
        llama_install: EngineInstall, demo_model: Any) -> None:
    """The killed endpoint's connection lingers in TIME-WAIT on the proxy port; the new one must start at once."""
    port = _free_port()
    first, _lines = _serve_until_ready("--endpoint", "--proxy-port", str(port))
    client = socket.create_connection(("127.0.0.1", port))
    try:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # a kept-alive client
        assert client.recv(65536).startswith(b"HTTP/1.1")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        assert client.recv(65536) == b""  # the kernel closed the endpoint's side first
    finally:
        client.close()
    second, lines = _serve_until_ready("--endpoint", "--proxy-port", str(port))
    try:
        assert f":{port}" in lines[-1]
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10, trust_env=False).status_code == 200
    finally:
        second.send_signal(signal.SIGINT)
        second.wait(30)
