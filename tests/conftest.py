"""Shared fixtures: isolated app state per session, provisioned real engines, the demo model, and one running
server per engine shared by the tests that only need "a real server" (vLLM on 2 CPU cores starts in minutes)."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from desktop.core.engines import get_adapter
from desktop.core.engines.base import EngineInstall, LaunchPlan


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
    from desktop.core.runtime.supervisor import EngineProcess

    adapter = get_adapter(engine)
    plan = LaunchPlan(engine=adapter.name, model_path=model_path, **plan_args)  # type: ignore[arg-type]
    # TCP (with no key): the shared servers stand in for attached endpoints and plain `serve` in many tests;
    # engines behind the endpoint run on their private sockets (tests/test_engine_sockets.py).
    process = EngineProcess(adapter, plan, install, tcp=True)
    try:
        process.start()
        process.wait_ready(timeout=900)
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
