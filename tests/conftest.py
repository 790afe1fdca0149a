"""Shared fixtures: isolated app state per session, provisioned real engines, the demo model, and one running
server per engine shared by the tests that only need "a real server" (vLLM on 2 CPU cores starts in minutes)."""

from __future__ import annotations

import gc
import os
import signal
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from desktop.core.engines import get_adapter
from desktop.core.engines.base import EngineInstall, LaunchPlan

# -- The garbage-collector guard -------------------------------------------------------------------------------
# Python's cyclic collector frees whole cycles on whichever thread allocates when a generation fills. A cycle that
# owns a Qt object (a chart, a page, a worker's signals) then dies off the GUI thread, and Qt's destructor there
# can deadlock against the GUI thread (shared/reference/review/qt-threads.md). The guard records every collection
# that starts off the main thread and fails the test during which it happened, naming the thread and its stack.
_off_main_collections: list[str] = []


def _where(limit: int = 12) -> str:
    """A short stack of the collecting thread, built without the traceback module (cheap inside gc)."""
    frame = sys._getframe(2)
    lines = []
    while frame is not None and len(lines) < limit:
        lines.append(f"    {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return "\n".join(lines)


def _gc_guard(phase: str, info: dict[str, int]) -> None:
    if phase == "start" and threading.current_thread() is not threading.main_thread():
        _off_main_collections.append(
            f"generation {info.get('generation')} collection on thread {threading.current_thread().name!r}:\n"
            + _where())


def pytest_configure(config: pytest.Config) -> None:
    # Tests stop their `switchyard serve` children with SIGINT, as Ctrl-C does. A suite started in the background
    # of a non-interactive shell (`cmd &`) inherits SIGINT ignored, and an ignored signal stays ignored across
    # exec: the children would never stop. A handled one is reset to the default in them.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    gc.callbacks.append(_gc_guard)
    # As in the app (desktop/ui/gc_policy.py): no automatic collection on any thread. The main thread collects
    # after each test (below) and, in GUI tests, from the app's GUI-thread timer while the event loop runs.
    gc.disable()


def _collect_when_due() -> None:
    """What CPython's automatic collection would do now, done on the main thread: each generation whose
    threshold is passed (cheap, unlike a full collection after each of the ~1,100 tests)."""
    thresholds, counts = gc.get_threshold(), gc.get_count()
    generation = max((g for g in range(3) if counts[g] > thresholds[g]), default=-1)
    if generation >= 0:
        gc.collect(generation)


@pytest.hookimpl(trylast=True)  # after the runner's own, which tears the session fixtures down
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Collections after the last test (a session fixture's teardown) fail the run too."""
    if _off_main_collections:
        print(f"\n{len(_off_main_collections)} garbage collection(s) started off the main thread after the last "
              "test; the first:\n" + _off_main_collections[0], file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    if _gc_guard in gc.callbacks:
        gc.callbacks.remove(_gc_guard)


@pytest.fixture(autouse=True)
def _no_collection_off_the_main_thread(request: pytest.FixtureRequest) -> Iterator[None]:
    """Collects on the main thread after each test (a GUI test: after its workers are done, then Qt's deferred
    deletions), and fails the test during which a collection started on any other thread."""
    _off_main_collections.clear()
    gui = "qapp" in request.fixturenames
    if gui:
        from desktop.ui import gc_policy

        request.getfixturevalue("qapp")
        gc_policy.collect_on_gui_thread()  # the app's own collector, on this (the GUI) thread
    yield
    if gui:
        from PySide6.QtCore import QThreadPool

        from desktop.ui import gc_policy

        QThreadPool.globalInstance().waitForDone(60_000)
        gc_policy.collect_now()
    else:
        _collect_when_due()
    seen = list(_off_main_collections)
    _off_main_collections.clear()
    if seen:
        pytest.fail(f"{len(seen)} garbage collection(s) started off the main thread (Qt objects in a cycle would "
                    "be destroyed there); the first:\n" + seen[0], pytrace=False)


@pytest.fixture(autouse=True)
def _keep_umask() -> Iterator[None]:
    """`desktop.cli.main` sets the app's umask 077 for its whole process; a test that calls it in-process must not
    leave it for the next one (which may create files another user has to read)."""
    previous = os.umask(0o022)
    os.umask(previous)
    yield
    os.umask(previous)


@pytest.fixture(scope="session", autouse=True)
def isolated_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Settings, history, logs and pidfiles go to a temp dir; engines and the demo model stay shared (cached)."""
    home = tmp_path_factory.mktemp("switchyard-home")
    previous = os.environ.get("SWITCHYARD_HOME")
    os.environ["SWITCHYARD_HOME"] = str(home)
    yield home
    if previous is None:
        os.environ.pop("SWITCHYARD_HOME", None)
    else:
        os.environ["SWITCHYARD_HOME"] = previous


def _provisioned(engine: str) -> EngineInstall:
    """A configured or cached engine as is; otherwise provision it (the README's test command did already)."""
    adapter = get_adapter(engine)
    return adapter.find_install() or adapter.install()


@pytest.fixture(scope="session")
def llama_install() -> EngineInstall:
    return _provisioned("llama.cpp")


@pytest.fixture(scope="session")
def vllm_install() -> EngineInstall:
    return _provisioned("vllm")


@pytest.fixture(scope="session")
def demo_model():  # type: ignore[no-untyped-def]
    from desktop.core.models.demo import ensure_demo_model

    return ensure_demo_model()


def _running(engine: str, model_path: Path, install: EngineInstall, **plan_args: object) -> Iterator[object]:
    from desktop.core.runtime.supervisor import EngineProcess, start_ready

    adapter = get_adapter(engine)
    plan = LaunchPlan(engine=adapter.name, model_path=model_path, **plan_args)  # type: ignore[arg-type]
    if engine == "vllm":  # as the planner lays it out on this machine (on 2 cores: no worker process of its own)
        from desktop.core.engines.vllm import worker_in_engine_core

        plan = worker_in_engine_core(plan, adapter, psutil.cpu_count(logical=True) or 1)
    # TCP (with no key): the shared servers stand in for attached endpoints and plain `serve` in many tests;
    # engines behind the endpoint run on their private sockets (tests/test_engine_sockets.py). Started as the app
    # starts one: a CPU kernel that faults on this host is started again at once without it (issue 71).
    process = start_ready(lambda p: EngineProcess(adapter, p, install, tcp=True), plan, timeout=900)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
def llama_server(llama_install: EngineInstall, demo_model) -> Iterator[object]:  # type: ignore[no-untyped-def]
    """A real llama-server on the demo GGUF, shared by the session."""
    yield from _running("llama.cpp", demo_model.gguf_path, llama_install, ctx_per_request=2048, slots=8)


@pytest.fixture(scope="session")
def vllm_server(vllm_install: EngineInstall, demo_model) -> Iterator[object]:  # type: ignore[no-untyped-def]
    """A real vLLM CPU server on the demo HF folder, shared by the session (started once: it is slow; eager mode
    skips torch.compile and starts ~40 s sooner on CPU with the same outputs)."""
    yield from _running("vllm", demo_model.hf_dir, vllm_install, ctx_per_request=2048, slots=8, eager=True, dtype="float32")


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory: pytest.TempPathFactory) -> ssl.SSLContext:
    """A TLS server context with a fresh self-signed certificate for 127.0.0.1 (attach-mode TLS tests)."""
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",  # noqa: S607
                    "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


def installed_vllm_package() -> Path | None:
    """The pinned vLLM's own source (its site-packages folder), to check tables against; None when not installed."""
    install = get_adapter("vllm").find_install()
    if install is None:
        return None
    found = sorted(Path(install.executable).parent.parent.glob("lib/python3*/site-packages/vllm"))
    return found[0] if found else None


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`switchyard ARGS` as its own process, to its end (stdout and stderr captured)."""
    return subprocess.run([sys.executable, "-m", "desktop", *args], capture_output=True, text=True,  # noqa: S603
                          timeout=timeout, env={**os.environ})


def serve_until_ready(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """Start `switchyard serve ARGS` as its own process and read its stderr up to the "ready:" line (returned; the
    caller asserts on it and stops the process). Ends at the process's exit when it never gets ready."""
    proc = subprocess.Popen(  # noqa: S603 - our own CLI
        [sys.executable, "-m", "desktop", "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env if env is not None else {**os.environ})
    assert proc.stderr is not None
    lines: list[str] = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("ready:"):
            break
    return proc, "".join(lines) if not lines or not lines[-1].startswith("ready:") else lines[-1]
