"""A llama-server that dies with SIGILL while loading (this machine's build 11434 does on Q8_0/Q4_K_M files: its
CPU weight repack runs AMX/AVX-512 code the VM cannot) is named in one line, retried once with --no-repack, and
the fix is remembered in history, so the next start of the same model on the same build begins with it.

The crash is made deterministic on any CPU by a stand-in engine binary (a small Python script) that kills itself
with SIGILL unless it is given --no-repack: once in front of a stand-in server (no engine needed), once in front
of the real llama-server (it execs it), through the real CLI. One test loads a real Q8_0 file with the real
llama-server as the app launches it, whatever this CPU does with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from desktop.core.common.errors import EngineFailed
from desktop.core.engines.base import EngineInstall, LaunchPlan
from desktop.core.engines.llamacpp import NO_REPACK, LlamaCppAdapter
from desktop.core.engines.vllm import VllmAdapter
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.planning.planner import ask as ask_plan
from desktop.core.runtime import enginefix
from desktop.core.runtime.ports import find_free_port
from desktop.core.runtime.supervisor import EngineProcess, start_ready
from desktop.core.serving.endpoint import EndpointEvent, EndpointManager, LoadCrashed
from desktop.core.serving.proxy import ProxyServer
from desktop.core.storage.history import Store

HERE = Path(__file__).parent
STANDIN = HERE / "standin_engine.py"
CPU = HardwareSnapshot.load(HERE / "snapshots" / "cpu_laptop.json")
LOAD_LINE = "load_tensors: loading model tensors, this can take a while... (mmap = true)"

# The stand-in binary: counts the starts it killed, then SIGILL (no core file), like llama-server 11434 loading a
# Q8_0 file here; with --no-repack it becomes the real server it stands in front of.
SIGILL_SCRIPT = '''
import os, resource, signal, sys
argv = sys.argv[1:]
if "--version" not in argv and "--list-devices" not in argv and "--no-repack" not in argv:
    with open({count!r}, "a") as handle:
        handle.write("sigill\\n")
    print({load_line!r}, flush=True)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGILL, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGILL)
{then}
'''
EXEC_REAL = '''
real = {real!r}
os.environ["LD_LIBRARY_PATH"] = os.path.dirname(real) + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")
os.execv(real, [real, *argv])
'''
RUN_STANDIN = '''
host = argv[argv.index("--host") + 1]
os.execv(sys.executable, [sys.executable, {standin!r}, "--uds", host, "--name", "standin"])
'''


def sigill_binary(tmp_path: Path, then: str) -> tuple[Path, Path]:
    """The stand-in binary and the file counting the starts it killed with SIGILL."""
    count = tmp_path / "sigill-starts"
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\n" + SIGILL_SCRIPT.format(count=str(count), load_line=LOAD_LINE,
                                                                      then=then))
    script.chmod(0o755)
    return script, count


def sigill_starts(count: Path) -> int:
    return len(count.read_text().splitlines()) if count.exists() else 0


# --- recognising it ---------------------------------------------------------------------------------------------
def test_llamacpp_names_an_illegal_instruction_and_knows_no_repack_avoids_it() -> None:
    adapter = LlamaCppAdapter()
    plan = LaunchPlan(engine="llama.cpp", model_path=Path("m.gguf"))
    tail = ["llama_model_loader: loaded meta data with 30 key-value pairs", LOAD_LINE]
    reason = adapter.explain_failure(-signal.SIGILL, tail)
    assert "illegal instruction (SIGILL)" in reason.reason and "repack" in reason.reason
    assert NO_REPACK in reason.suggestion and not reason.memory
    told = adapter.crash_retry(-signal.SIGILL, tail, plan)
    assert told is not None and told.args == (NO_REPACK,) and "SIGILL" in told.why
    # a shell wrapper exits 128 + 4 and the shell says why
    assert adapter.crash_retry(132, [*tail, "Illegal instruction (core dumped)"], plan) is not None
    # another signal while it repacks (at -v it logs each tensor it repacks)
    repacking = [*tail, "repack: repack tensor blk.0.attn_q.weight with q8_0_4x8"]
    assert adapter.crash_retry(-signal.SIGSEGV, repacking, plan) is not None
    assert "repacking" in adapter.explain_failure(-signal.SIGSEGV, repacking).reason
    # once only, and never for what it does not know
    assert adapter.crash_retry(-signal.SIGILL, tail, replace(plan, extra_args=(NO_REPACK,))) is None
    assert adapter.crash_retry(1, [*tail, "error loading model: bad tensor"], plan) is None
    assert adapter.crash_retry(-signal.SIGKILL, tail, plan) is None  # the OOM killer, or a person
    assert adapter.crash_retry(132, tail, plan) is None  # an exit code alone is no illegal instruction
    assert VllmAdapter().crash_retry(-signal.SIGILL, tail, replace(plan, engine="vllm")) is None


# --- the endpoint retries once and remembers (stand-in server, no engine needed) ------------------------------
@pytest.fixture
def proxy() -> Iterator[ProxyServer]:
    server = ProxyServer(port=find_free_port(), wait_timeout=60)
    server.start()
    yield server
    server.stop()


def standin_launcher(binary: Path, model: Path, version: str) -> Any:
    """Like make_launcher: the real llama.cpp adapter (argv, failure explanations, crash_retry) with the stand-in
    binary installed as llama-server at `version`; the checked plan launched as is, on the stand-in's model."""

    def launch(checked: LaunchPlan) -> tuple[LlamaCppAdapter, LaunchPlan, EngineInstall]:
        return LlamaCppAdapter(), replace(checked, model_path=model), EngineInstall("llama.cpp", version, "cache",
                                                                                    binary)

    return launch


def test_a_sigill_while_loading_is_retried_once_with_no_repack_and_the_next_start_begins_with_it(
        proxy: ProxyServer, tmp_path: Path) -> None:
    binary, count = sigill_binary(tmp_path, RUN_STANDIN.format(standin=str(STANDIN)))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"stand-in weights")
    version = f"stand-in {uuid.uuid4().hex[:8]}"  # this test's build: no other test's fix applies to it
    events: list[EndpointEvent] = []
    manager = EndpointManager(proxy, hardware=CPU, launcher=standin_launcher(binary, model, version),
                              ready_timeout=60, record_launches=False)
    manager.subscribe(events.append)
    try:
        manager.start(ask_plan("llama.cpp", "demo", {"ctx_per_request": 512}))
        retries = [e for e in events if e.state == "retrying"]
        assert len(retries) == 1, [e.message for e in events]
        assert "illegal instruction (SIGILL)" in retries[0].message and f"retrying once with {NO_REPACK}" in \
            retries[0].message
        active = manager.active
        assert active is not None and NO_REPACK in active.plan.extra_args
        assert NO_REPACK in active.process.plan.extra_args and sigill_starts(count) == 1
        answer = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30,
                            trust_env=False)
        assert answer.status_code == 200 and "standin" in answer.text
    finally:
        manager.close()
    with Store() as store:
        fixes = [r for r in store.runs(kind=enginefix.KIND, engine="llama.cpp") if r.engine_version == version]
    assert len(fixes) == 1 and fixes[0].settings["args"] == [NO_REPACK] and fixes[0].model == str(model)
    assert "SIGILL" in fixes[0].summary["why"] and fixes[0].summary["exit_code"] == -signal.SIGILL
    from desktop.ui.pages.history import describe, summarize

    assert NO_REPACK in describe(fixes[0]) and "SIGILL" in summarize(fixes[0])  # what the History page shows

    # the next start of the same plan begins with it: no crash, no retry
    again: list[EndpointEvent] = []
    second = EndpointManager(proxy, hardware=CPU, launcher=standin_launcher(binary, model, version),
                             ready_timeout=60, record_launches=False)
    second.subscribe(again.append)
    try:
        second.start(ask_plan("llama.cpp", "demo", {"ctx_per_request": 512}))
        assert not [e for e in again if e.state == "retrying"]
        assert second.active is not None and NO_REPACK in second.active.process.plan.extra_args
        assert second.active.process.learned_fix is not None and sigill_starts(count) == 1
    finally:
        second.close()

    # another build (version) learns for itself
    other: list[EndpointEvent] = []
    third = EndpointManager(proxy, hardware=CPU, launcher=standin_launcher(binary, model, version + "-new"),
                            ready_timeout=60, record_launches=False)
    third.subscribe(other.append)
    try:
        third.start(ask_plan("llama.cpp", "demo", {"ctx_per_request": 512}))
        assert len([e for e in other if e.state == "retrying"]) == 1 and sigill_starts(count) == 2
    finally:
        third.close()


def test_a_sigill_with_no_repack_too_is_reported_after_exactly_one_retry(proxy: ProxyServer,
                                                                          tmp_path: Path) -> None:
    binary, count = sigill_binary(tmp_path, "os.kill(os.getpid(), signal.SIGILL)")
    binary.write_text(binary.read_text().replace('and "--no-repack" not in argv', ""))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"stand-in weights")
    events: list[EndpointEvent] = []
    manager = EndpointManager(proxy, hardware=CPU, ready_timeout=60, record_launches=False,
                              launcher=standin_launcher(binary, model, f"stand-in {uuid.uuid4().hex[:8]}"))
    manager.subscribe(events.append)
    try:
        with pytest.raises(EngineFailed) as caught:
            manager.start(ask_plan("llama.cpp", "demo", {"ctx_per_request": 512}))
        assert "illegal instruction (SIGILL)" in caught.value.message and not isinstance(caught.value, LoadCrashed)
        assert caught.value.hint and "reinstall it" in caught.value.hint
        assert sigill_starts(count) == 2 and [e.state for e in events].count("retrying") == 1
        assert manager.active is None
    finally:
        manager.close()


def test_a_plain_start_says_why_and_every_later_start_of_the_build_begins_with_no_repack(tmp_path: Path) -> None:
    """The paths that start one engine process without the endpoint (plain serve, bench, prepare): a start that
    crashes says the cause and that the build adds --no-repack from now on; every later start of the build, of
    this model or another (the fault is the CPU's kernels', issue 71), begins with it; `start_ready` (what those
    paths call) starts again at once with it."""
    binary, count = sigill_binary(tmp_path, RUN_STANDIN.format(standin=str(STANDIN)))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"stand-in weights")
    install = EngineInstall("llama.cpp", f"stand-in {uuid.uuid4().hex[:8]}", "cache", binary)
    plan = LaunchPlan(engine="llama.cpp", model_path=model, ctx_per_request=512)
    with EngineProcess(LlamaCppAdapter(), plan, install) as first:
        first.start()
        with pytest.raises(EngineFailed) as caught:
            first.wait_ready(timeout=60)
        assert "illegal instruction (SIGILL)" in caught.value.message
        assert caught.value.hint and f"every start of this engine build here adds {NO_REPACK}" in caught.value.hint
        assert first.crash_fix is not None and NO_REPACK not in first.plan.extra_args
    with EngineProcess(LlamaCppAdapter(), plan, install) as second:
        second.start()
        second.wait_ready(timeout=60)
        assert NO_REPACK in second.plan.extra_args and second.learned_fix is not None
        assert sigill_starts(count) == 1
    # another model on the same build begins with it too
    other = tmp_path / "other.gguf"
    other.write_bytes(b"stand-in weights")
    with EngineProcess(LlamaCppAdapter(), replace(plan, model_path=other), install) as third:
        third.start()
        third.wait_ready(timeout=60)
        assert NO_REPACK in third.plan.extra_args
    assert sigill_starts(count) == 1
    # another build learns for itself, and start_ready retries it at once, saying so once
    said: list[str] = []
    rebuilt = replace(install, version=install.version + "-new")
    with start_ready(lambda p: EngineProcess(LlamaCppAdapter(), p, rebuilt), plan, timeout=60,
                     say=said.append) as fourth:
        assert NO_REPACK in fourth.plan.extra_args and fourth.state.value == "ready"
    assert sigill_starts(count) == 2 and len(said) == 1 and NO_REPACK in said[0], said


# --- the real llama-server behind the stand-in binary, through the CLI ---------------------------------------
def _serve_until_ready(home: Path, binary: Path, *args: str) -> tuple[subprocess.Popen[str], list[str]]:
    env = {**os.environ, "SWITCHYARD_HOME": str(home), "SWITCHYARD_LLAMA_SERVER": str(binary)}
    proc = subprocess.Popen(  # noqa: S603 - our own CLI
        [sys.executable, "-m", "desktop", "serve", "--engine", "llama.cpp", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    assert proc.stderr is not None
    deadline = time.monotonic() + 300
    for line in proc.stderr:  # ends at the child's exit
        lines.append(line)
        if line.startswith("ready:") or time.monotonic() > deadline:
            break
    return proc, lines


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.engine
@pytest.mark.llamacpp
def test_cli_serve_says_why_in_one_line_retries_with_no_repack_and_starts_with_it_next_time(
        tmp_path: Path, llama_install: EngineInstall, demo_model: Any) -> None:
    binary, count = sigill_binary(tmp_path, EXEC_REAL.format(real=str(llama_install.executable)))
    home = tmp_path / "home"
    model = str(demo_model.gguf_path)
    port = find_free_port()
    proc, lines = _serve_until_ready(home, binary, "--model", model, "--proxy-port", str(port), "--ctx", "512")
    try:
        assert lines and lines[-1].startswith("ready:"), "".join(lines)
        said = [line for line in lines if line.startswith("[retrying]")]
        assert len(said) == 1 and "illegal instruction (SIGILL)" in said[0] and NO_REPACK in said[0], lines
        assert "Traceback" not in "".join(lines) and sigill_starts(count) == 1
        assert not [line for line in lines if "ERROR" in line], lines  # the one line is the [retrying] one
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                            timeout=60, trust_env=False)
        assert answer.status_code == 200, answer.text
    finally:
        _stop(proc)
    with Store(home / "history.sqlite3") as store:
        launches = store.runs(kind="launch", engine="llama.cpp")
        fixes = store.runs(kind=enginefix.KIND, engine="llama.cpp")
    assert [r.settings["args"] for r in fixes] == [[NO_REPACK]]  # in history: this build needs it here
    assert launches and NO_REPACK in launches[0].settings["extra_args"]  # and the launch that served had it

    proc, lines = _serve_until_ready(home, binary, "--model", model, "--proxy-port", str(port), "--ctx", "512")
    try:
        assert lines and lines[-1].startswith("ready:"), "".join(lines)
        assert not [line for line in lines if line.startswith("[retrying]")] and sigill_starts(count) == 1
    finally:
        _stop(proc)


@pytest.mark.engine
@pytest.mark.llamacpp
def test_calibrate_retries_a_sigill_probe_with_no_repack_and_says_so(tmp_path: Path,
                                                                    llama_install: EngineInstall) -> None:
    """A Q4_K_M file (repacked on AVX2 CPUs): the retry launches with --no-repack, so calibrate compares the engine
    with the fit of *that* launch (no repacked copy), not with the plan it started from."""
    from desktop.core.models import archs

    model = archs.ensure_arch("llama3").gguf_paths["Q4_K_M"]
    binary, count = sigill_binary(tmp_path, EXEC_REAL.format(real=str(llama_install.executable)))
    env = {**os.environ, "SWITCHYARD_HOME": str(tmp_path / "home"), "SWITCHYARD_LLAMA_SERVER": str(binary)}
    done = subprocess.run([sys.executable, "-m", "desktop", "calibrate", "--engine", "llama.cpp", "--model",  # noqa: S603
                           str(model), "--json"], capture_output=True, text=True, timeout=600,
                          env=env, check=False)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)["results"][0]
    assert found["started"] and NO_REPACK in found["argv"] and sigill_starts(count) == 1
    assert "SIGILL" in found["retried"] and "retried once" in found["retried"]
    assert found["components"]["weights"]["measured_bytes"] > 0
    assert "repacked" not in found["components"], found["components"]
    assert found["components"]["total"]["ratio"] == pytest.approx(1.0, abs=0.01)


# --- the real thing -------------------------------------------------------------------------------------------
@pytest.mark.engine
@pytest.mark.llamacpp
def test_a_q8_0_model_serves_through_the_endpoint_as_the_app_launches_it(proxy: ProxyServer,
                                                                         llama_install: EngineInstall) -> None:
    """The real llama-server on a Q8_0 file with the app's own argv (no --no-repack asked for). On this machine's
    CPU build 11434 dies of SIGILL in the repack: the endpoint must still serve, with exactly one retry that says
    why; where the repack works, it serves without one."""
    from desktop.core.models import archs

    model = archs.ensure_arch("llama3").gguf_paths["Q8_0"]
    events: list[EndpointEvent] = []
    manager = EndpointManager(proxy, ready_timeout=300, record_launches=False)
    manager.subscribe(events.append)
    try:
        manager.start(ask_plan("llama.cpp", str(model), {"ctx_per_request": 512}))
        retries = [e.message for e in events if e.state == "retrying"]
        assert len(retries) <= 1, retries
        active = manager.active
        assert active is not None
        if retries:
            assert "SIGILL" in retries[0] and NO_REPACK in active.process.plan.extra_args
        answer = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60,
                            trust_env=False)
        assert answer.status_code == 200, answer.text
    finally:
        manager.close()
