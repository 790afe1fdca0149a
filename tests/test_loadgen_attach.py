"""Attach mode for bench and A/B: a real llama-server on another loopback port stands in for a remote host (with
and without `--api-key`), a self-signed HTTPS fake for TLS, and dead ports for unreachable hosts."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_external import MemoryKeyring
from test_loadgen_faults import FakeServer, ThreadedServer, stream_tokens

from desktop.cli import main
from desktop.core.engines import get_adapter
from desktop.core.engines.base import EngineInstall, LaunchPlan
from desktop.core.engines.external import EndpointStore
from desktop.core.runtime.supervisor import EngineProcess
from desktop.core.storage.history import Store

RIGHT_KEY = "sk-attach-right-key-123"
SMALL = ["--concurrency", "1,2", "--requests", "4", "--input-len", "16", "--output-len", "4"]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Per-test settings/history, and a keyring that works headless."""
    import keyring

    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    previous = keyring.get_keyring()
    keyring.set_keyring(MemoryKeyring())
    yield tmp_path / "home"
    keyring.set_keyring(previous)


@pytest.fixture(scope="module")
def keyed_llama(llama_install: EngineInstall, demo_model: Any) -> Iterator[EngineProcess]:
    """A second real llama-server that demands an API key."""
    adapter = get_adapter("llama.cpp")
    plan = LaunchPlan(engine=adapter.name, model_path=demo_model.gguf_path, ctx_per_request=1024, slots=2, api_key=RIGHT_KEY)
    with EngineProcess(adapter, plan, llama_install, tcp=True) as engine:  # stands in for a remote endpoint
        engine.start()
        engine.wait_ready(timeout=120)
        yield engine


def _dead_url() -> str:
    with socket.socket() as probe:  # a port with nobody listening
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def _bench(args: list[str], out: Path) -> tuple[int, dict[str, Any] | None]:
    code = main(["bench", *args, *SMALL, "--json", str(out)])
    return code, json.loads(out.read_text()) if out.exists() else None


def _one_clear_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("switchyard: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# --- bench --endpoint ------------------------------------------------------------------------------------
@pytest.mark.engine
@pytest.mark.llamacpp
def test_bench_attached_by_url_and_by_saved_name(llama_server: Any, home: Path, tmp_path: Path) -> None:
    code, by_url = _bench(["--endpoint", llama_server.base_url], tmp_path / "url.json")
    assert code == 0 and by_url is not None
    EndpointStore().add("box", llama_server.base_url)
    code, by_name = _bench(["--endpoint", "box"], tmp_path / "name.json")
    assert code == 0 and by_name is not None
    for data in (by_url, by_name):
        assert data["endpoint"] == llama_server.base_url and data["model"] == "switchyard"  # from /v1/models
        assert [(lvl["completed"], lvl["failed"], lvl["total_output_tokens"]) for lvl in data["levels"]] == \
            [(4, 0, 16), (4, 0, 16)]
    assert by_name["endpoint_name"] == "box" and by_name["levels"][0]["target"]["name"] == "box"


@pytest.mark.engine
@pytest.mark.llamacpp
def test_bench_attached_with_api_key(keyed_llama: EngineProcess, home: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    url = keyed_llama.base_url
    EndpointStore().add("keyed", url, api_key=RIGHT_KEY)
    code, data = _bench(["--endpoint", "keyed"], tmp_path / "ok.json")
    assert code == 0 and data is not None
    assert [lvl["completed"] for lvl in data["levels"]] == [4, 4]
    assert data["levels"][0]["target"]["has_api_key"] is True
    by_url = tmp_path / "by-url.json"  # the URL of an attached endpoint finds its stored key
    assert _bench(["--endpoint", url], by_url)[0] == 0
    with Store() as store:
        assert len(store.runs(kind="bench")) == 2
    history = b"".join(p.read_bytes() for p in home.rglob("history.sqlite3*"))
    for text in (b"".join(p.read_bytes() for p in tmp_path.glob("*.json")), history):
        assert RIGHT_KEY.encode() not in text  # the key is sent, never recorded
    capsys.readouterr()

    EndpointStore().add("keyed", url, api_key="sk-wrong", replace=True)
    started = time.monotonic()
    code, data = _bench(["--endpoint", "keyed"], tmp_path / "wrong.json")
    err = capsys.readouterr().err
    assert code != 0 and data is None and time.monotonic() - started < 30
    assert f"keyed ({url}) rejected the API key (HTTP 401)" in _one_clear_error(err)
    assert f"switchyard endpoints add keyed {url} --api-key-stdin --replace" in err  # the hint says how to fix it

    code, data = _bench(["--endpoint", url, "--api-key-env", "NO_SUCH_VARIABLE_SET"], tmp_path / "unset.json")
    assert code != 0 and "NO_SUCH_VARIABLE_SET is not set" in _one_clear_error(capsys.readouterr().err)
    EndpointStore().remove("keyed")
    code, data = _bench(["--endpoint", url], tmp_path / "nokey.json")
    assert code != 0 and "requires an API key (HTTP 401)" in _one_clear_error(capsys.readouterr().err)


def test_bench_unreachable_endpoint_fails_fast(home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dead = _dead_url()
    EndpointStore().add("gone", dead)
    for where in ("gone", dead):
        started = time.monotonic()
        code, data = _bench(["--endpoint", where], tmp_path / "dead.json")
        line = _one_clear_error(capsys.readouterr().err)
        assert code != 0 and data is None and time.monotonic() - started < 10
        assert f"cannot reach gone ({dead}): connection refused" in line  # the URL finds the attached name
    code = main(["bench", "--endpoint", "never-attached", *SMALL])
    assert code != 0 and "no endpoint named 'never-attached'" in _one_clear_error(capsys.readouterr().err)


def test_bench_honours_the_endpoints_tls_choice(self_signed: ssl.SSLContext, home: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    async def handler(server: FakeServer, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        await stream_tokens(writer, body["max_tokens"])

    with ThreadedServer(handler, tls=self_signed) as server:
        code, data = _bench(["--endpoint", server.url], tmp_path / "verified.json")
        assert code != 0 and data is None
        assert "TLS certificate" in _one_clear_error(capsys.readouterr().err)
        EndpointStore().add("self-signed", server.url, verify_tls=False)
        code, data = _bench(["--endpoint", "self-signed"], tmp_path / "insecure.json")
    assert code == 0 and data is not None
    assert [lvl["completed"] for lvl in data["levels"]] == [4, 4]
    assert data["levels"][0]["target"]["verify_tls"] is False


# --- ab against an attached endpoint ---------------------------------------------------------------------
@pytest.mark.engine
@pytest.mark.llamacpp
def test_ab_local_engine_against_attached_endpoint(keyed_llama: EngineProcess, home: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    EndpointStore().add("remote-llama", keyed_llama.base_url, api_key=RIGHT_KEY)
    report = tmp_path / "ab"
    code = main(["ab", "--model", "demo", "--engines", "llama.cpp", "--endpoint", "remote-llama",
                 "--concurrency", "1,2", "--requests", "4", "--input-len", "16", "--output-len", "4",
                 "--report", str(report), "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert json.loads((report / "ab.json").read_text())["engines"][1]["engine"] == "endpoint:remote-llama"
    local, attached = data["engines"]
    assert (local["kind"], attached["kind"]) == ("local", "external")
    cold = local["repetitions"][0]["cold_start"]
    assert 0 < cold["t1_health_s"] <= cold["t2_first_token_s"] <= cold["t3_first_request_s"]
    assert attached["repetitions"][0]["cold_start"] == {"attached": True, "note": attached["note"]}
    assert "no cold start" in attached["note"] and attached["peak_rss_mib"] is None
    assert attached["version"] == "llama.cpp (detected from /metrics)" or attached["version"] == "unknown"
    for engine_data in data["engines"]:
        for level in engine_data["repetitions"][0]["sweep"]["levels"]:
            assert (level["completed"], level["failed"], level["total_output_tokens"]) == (4, 0, 16)
    for row in data["comparison"]:
        assert row["output_throughput"]["ratio"]["mean"] > 0
    assert data["cold_start"]["t3_first_request_s"]["endpoint:remote-llama"]["n"] == 0
    assert "already running" in data["amortization"]["verdict"]
    assert "no cold start" in (report / "ab.html").read_text()
    assert RIGHT_KEY not in (report / "ab.json").read_text() + (report / "ab.html").read_text()


def test_ab_unreachable_endpoint_fails_before_any_engine_starts(home: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    code = main(["ab", "--engines", "llama.cpp", "--endpoint", _dead_url(), "--report", str(tmp_path / "ab")])
    line = _one_clear_error(capsys.readouterr().err)
    assert code != 0 and "cannot reach" in line and time.monotonic() - started < 10
    assert not (tmp_path / "ab").exists()
    code = main(["ab", "--engines", "llama.cpp,vllm", "--endpoint", "x"])
    assert code != 0 and "one local engine" in _one_clear_error(capsys.readouterr().err)
