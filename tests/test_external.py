"""Attach mode against real HTTP servers on 127.0.0.1 acting as remote hosts: an OpenAI-compatible stub with an
API-key check and vLLM- or llama.cpp-format /metrics, a self-signed HTTPS one, and a real llama-server if built."""

from __future__ import annotations

import http.server
import json
import os
import socket
import ssl
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import keyring
import keyring.backend
import keyring.backends.fail
import pytest

from desktop.cli import main
from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.external import (
    EndpointStore,
    ExternalEndpoint,
    SecretStore,
    list_models,
    normalize_base_url,
    probe_endpoint,
    resolve_endpoint,
    scrape_metrics,
)

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="remote-llama"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="remote-llama"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="remote-llama"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="remote-llama"} 1200.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="remote-llama"} 3400.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="remote-llama"} 5.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="remote-llama"} 8.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="remote-llama"} 8.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="remote-llama"} 1.6
"""
LLAMACPP_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 42
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 99
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""


@dataclass
class Remote:
    """What the stub serves, and every request it saw (path, Authorization header)."""

    api_key: str | None = None
    metrics: str | None = VLLM_METRICS
    redirect_to: str | None = None
    seen: list[tuple[str, str | None]] = field(default_factory=list)
    url: str = ""


def _serve(remote: Remote, tls: ssl.SSLContext | None = None) -> Iterator[Remote]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, status: int, body: str, content_type: str = "application/json") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            remote.seen.append((self.path, self.headers.get("Authorization")))
            if remote.redirect_to:
                self.send_response(307)
                self.send_header("Location", remote.redirect_to + self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/metrics":  # like vLLM: --api-key protects /v1 only
                if remote.metrics is None:
                    self._send(404, '{"detail":"Not Found"}')
                else:
                    self._send(200, remote.metrics, "text/plain; version=0.0.4")
            elif self.path == "/v1/models":
                if remote.api_key and self.headers.get("Authorization") != f"Bearer {remote.api_key}":
                    self._send(401, '{"error":"Unauthorized"}')
                    return
                self._send(200, json.dumps({"object": "list", "data": [
                    {"id": "remote-llama", "object": "model", "owned_by": "vllm", "max_model_len": 8192}]}))
            else:
                self._send(404, '{"detail":"Not Found"}')

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    remote.url = f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]}"
    try:
        yield remote
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def open_remote() -> Iterator[Remote]:
    yield from _serve(Remote())


@pytest.fixture
def keyed_remote() -> Iterator[Remote]:
    yield from _serve(Remote(api_key="sk-right-key"))


class MemoryKeyring(keyring.backend.KeyringBackend):
    """A keyring that works headless: stands in for the OS keyring in tests."""

    priority = 1  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.secrets: dict[tuple[str, str], str] = {}

    def get_password(self, service: str, username: str) -> str | None:
        return self.secrets.get((service, username))

    def set_password(self, service: str, username: str, password: str) -> None:
        self.secrets[(service, username)] = password

    def delete_password(self, service: str, username: str) -> None:
        self.secrets.pop((service, username), None)


@pytest.fixture
def memory_keyring() -> Iterator[MemoryKeyring]:
    previous = keyring.get_keyring()
    backend = MemoryKeyring()
    keyring.set_keyring(backend)
    yield backend
    keyring.set_keyring(previous)


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _unused_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- attaching ----------------------------------------------------------------------------------------
def test_endpoint_with_api_key_lists_models_and_maps_vllm_metrics(
        keyed_remote: Remote, memory_keyring: MemoryKeyring, state: Path) -> None:
    store = EndpointStore()
    store.add("team-vllm", keyed_remote.url + "/v1/", api_key="sk-right-key")
    assert "sk-right-key" not in (state / "endpoints.json").read_text()
    assert memory_keyring.secrets == {("switchyard-endpoint", "team-vllm"): "sk-right-key"}

    endpoint = resolve_endpoint("team-vllm")
    assert endpoint.base_url == keyed_remote.url and endpoint.kind == "external"
    assert endpoint.headers() == {"Authorization": "Bearer sk-right-key"}
    assert "sk-right-key" not in repr(endpoint) and "sk-right-key" not in json.dumps(endpoint.to_json())

    report = probe_endpoint(endpoint)
    assert [m.id for m in report.models] == ["remote-llama"] and report.models[0].max_model_len == 8192
    assert report.engine == "vllm" and report.metrics_exposed
    assert report.metrics["requests_running"] == 3.0
    assert report.metrics["kv_cache_usage"] == 0.25
    assert report.metrics["ttft_seconds_count"] == 8.0
    assert ("/v1/models", "Bearer sk-right-key") in keyed_remote.seen


def test_endpoint_without_api_key(open_remote: Remote, state: Path) -> None:
    endpoint = EndpointStore().add("plain", open_remote.url)
    assert endpoint.headers() == {}
    assert [m.id for m in list_models(endpoint)] == ["remote-llama"]
    assert all(auth is None for _, auth in open_remote.seen)


def test_wrong_api_key_is_named_as_such(keyed_remote: Remote) -> None:
    wrong = ExternalEndpoint("team", keyed_remote.url, api_key="sk-wrong")
    with pytest.raises(SwitchyardError) as info:
        list_models(wrong)
    assert info.value.message == "the endpoint rejected the API key"
    assert "--api-key-stdin --replace" in (info.value.hint or "")
    with pytest.raises(SwitchyardError, match="requires an API key"):
        list_models(ExternalEndpoint("team", keyed_remote.url))


def test_unreachable_host_fails_fast_and_clearly() -> None:
    port = _unused_loopback_port()
    started = time.monotonic()
    with pytest.raises(SwitchyardError, match=rf"cannot reach http://127.0.0.1:{port}: connection refused"):
        probe_endpoint(ExternalEndpoint("gone", f"http://127.0.0.1:{port}"))
    assert time.monotonic() - started < 5


def test_llamacpp_metrics_are_recognised() -> None:
    for remote in _serve(Remote(metrics=LLAMACPP_METRICS)):
        scraped = scrape_metrics(ExternalEndpoint("l", remote.url))
        assert scraped is not None and scraped[0] == "llama.cpp"
        report = probe_endpoint(ExternalEndpoint("l", remote.url))
        assert report.engine == "llama.cpp"
        assert report.metrics["requests_running"] == 2 and report.metrics["generation_tokens_total"] == 99


def test_endpoint_without_metrics_still_attaches() -> None:
    for remote in _serve(Remote(metrics=None)):
        report = probe_endpoint(ExternalEndpoint("m", remote.url))
        assert not report.metrics_exposed and report.engine is None and report.models


def test_redirects_are_not_followed_to_an_address_the_user_did_not_enter(open_remote: Remote) -> None:
    for redirector in _serve(Remote(redirect_to=open_remote.url)):
        with pytest.raises(SwitchyardError, match="redirects to"):
            list_models(ExternalEndpoint("r", redirector.url, api_key="sk-x"))
        assert open_remote.seen == []  # the key never reached the other address


def test_tls_failure_suggests_insecure_and_insecure_works(self_signed: ssl.SSLContext) -> None:
    for remote in _serve(Remote(), tls=self_signed):
        with pytest.raises(SwitchyardError, match="TLS certificate .* could not be verified") as info:
            list_models(ExternalEndpoint("tls", remote.url))
        assert "--insecure" in (info.value.hint or "")
        assert [m.id for m in list_models(ExternalEndpoint("tls", remote.url, verify_tls=False))] == ["remote-llama"]


# --- secrets and the registry ----------------------------------------------------------------------------
def test_without_a_keyring_the_key_goes_to_a_private_file_with_a_warning(tmp_path: Path) -> None:
    previous = keyring.get_keyring()
    keyring.set_keyring(keyring.backends.fail.Keyring())
    warnings: list[str] = []
    try:
        store = EndpointStore(tmp_path / "endpoints.json", SecretStore(tmp_path / "secrets", warnings.append))
        store.add("box", "http://127.0.0.1:9", api_key="sk-file")
        key_file = tmp_path / "secrets" / "endpoint-box.key"
        assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
        assert warnings and str(key_file) in warnings[0] and "sk-file" not in warnings[0]
        assert store.get("box").api_key == "sk-file"
        store.remove("box")
        assert not key_file.exists()
    finally:
        keyring.set_keyring(previous)


def test_bad_input_is_refused_and_nothing_is_lost(memory_keyring: MemoryKeyring, state: Path) -> None:
    store = EndpointStore()
    store.add("a", "http://127.0.0.1:1234")
    for url, message in (("ftp://x", "not an http"), ("http://user:pw@host:1", "user name or password"),
                         ("not a url at all", "not an http")):
        with pytest.raises(SwitchyardError, match=message):
            store.add("b", url)
    with pytest.raises(SwitchyardError, match="already exists"):
        store.add("a", "http://127.0.0.1:9999")
    with pytest.raises(SwitchyardError, match="invalid endpoint name"):
        store.add("../etc", "http://127.0.0.1:1")
    assert [(e.name, e.base_url) for e in store.list()] == [("a", "http://127.0.0.1:1234")]
    assert normalize_base_url("https://Host.example:8443/api/v1/") == "https://host.example:8443/api"


def test_resolve_by_url_finds_the_attached_endpoint_and_its_key(memory_keyring: MemoryKeyring, state: Path) -> None:
    EndpointStore().add("k", "http://127.0.0.1:4321", api_key="sk-k")
    assert resolve_endpoint("http://127.0.0.1:4321/v1").api_key == "sk-k"
    adhoc = resolve_endpoint("http://127.0.0.1:5555")
    assert (adhoc.name, adhoc.api_key) == ("127.0.0.1:5555", None)
    with pytest.raises(SwitchyardError, match="no endpoint named 'nope'"):
        resolve_endpoint("nope")


# --- CLI --------------------------------------------------------------------------------------------------
def test_cli_add_list_check_remove(keyed_remote: Remote, memory_keyring: MemoryKeyring, state: Path,
                                   monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TEAM_KEY", "sk-wrong")
    assert main(["endpoints", "add", "team", keyed_remote.url, "--api-key-env", "TEAM_KEY"]) == 2
    assert "the endpoint rejected the API key" in capsys.readouterr().err
    assert main(["endpoints", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []  # nothing saved after a failed check

    monkeypatch.setenv("TEAM_KEY", "sk-right-key")
    assert main(["endpoints", "add", "team", keyed_remote.url, "--api-key-env", "TEAM_KEY"]) == 0
    out = capsys.readouterr().out
    assert "remote-llama (max_model_len 8192)" in out and "engine: vllm" in out
    assert main(["endpoints", "list", "--json"]) == 0
    listed = capsys.readouterr().out
    assert json.loads(listed)[0]["has_api_key"] is True and "sk-right-key" not in listed
    assert main(["endpoints", "check", "team", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"]["requests_waiting"] == 1.0
    assert main(["endpoints", "remove", "team"]) == 0
    assert memory_keyring.secrets == {}


def test_cli_check_unreachable_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    port = _unused_loopback_port()
    assert main(["endpoints", "check", f"http://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach" in err and "Traceback" not in err


# --- a real llama-server as the remote ------------------------------------------------------------------
@pytest.mark.engine
@pytest.mark.llamacpp
def test_real_llama_server_attached_by_url(request: pytest.FixtureRequest) -> None:
    from desktop.core.engines import get_adapter

    if get_adapter("llama.cpp").find_install() is None:
        pytest.skip("llama-server is not built here (switchyard engines install llama.cpp)")
    server = request.getfixturevalue("llama_server")
    endpoint = ExternalEndpoint("local-llama", server.base_url)
    report = probe_endpoint(endpoint)
    assert report.models and report.engine == "llama.cpp"
    assert "prompt_tokens_total" in report.metrics
