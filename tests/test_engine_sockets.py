"""The real engines behind the endpoint listen on private Unix sockets: no process of the engine's tree holds a
TCP listening socket (so no TCP port answers inference, vLLM's unauthenticated /invocations included), the socket
lives in a 0700 folder of this user, and requests through the endpoint, telemetry scraping and the load
generator all reach the engine over it."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from test_endpoint_guard import vllm_refuses_v1_without_the_key
from test_prefix_cache import vllm_reuses_the_repeated_prompt

from desktop.core.common import unixhttp
from desktop.core.runtime import proctree
from desktop.core.runtime.ports import find_free_port
from desktop.core.runtime.telemetry import EngineScraper
from desktop.core.serving.proxy import ProxyServer


def _tcp_listeners(pid: int) -> list[Any]:
    """Every TCP listening socket held by the engine's process tree (its group and descendants)."""
    found = []
    for proc in proctree.members_of(proctree.Recorded(pid, psutil.Process(pid).create_time(), os.getpgid(pid))):
        try:
            found += [c for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
    return found


def _http_answer(host: str, port: int, route: str) -> bytes:
    """What a TCP listener answers to an unauthenticated inference request (b"" for nothing within 3 s)."""
    body = b'{"model":"x","prompt":"Hi","max_tokens":2}'
    head = (f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
            f"Origin: http://evil.example\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    try:
        with socket.create_connection((host, port), timeout=3) as sock:
            sock.sendall(head + body)
            return sock.recv(4096)
    except OSError:
        return b""


def _assert_no_listener_serves(listeners: list[Any], routes: tuple[str, ...]) -> None:
    """No listener answers an inference request on any of `routes` with a 2xx. Asked all at once: a listener that
    does not speak HTTP stays silent for `_http_answer`'s whole 3 s, and vLLM's CPU tree holds a dozen of them
    (one at a time that was ~36 s of a test's waiting per route)."""
    asks = [(listener, route) for listener in listeners for route in routes]
    if not asks:
        return
    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(lambda ask: _http_answer(ask[0].laddr.ip, ask[0].laddr.port, ask[1]), asks))
    for (listener, route), answer in zip(asks, answers, strict=True):
        assert not answer.startswith((b"HTTP/1.1 2", b"HTTP/1.0 2")), \
            f"{listener.laddr} answered {route}: {answer[:80]!r}"


def _check_private_engine(manager: Any, proxy: ProxyServer, tcp_allowed: bool = False,
                          also: Callable[[Any], None] | None = None) -> None:
    active = manager.active
    assert active is not None
    process = active.process
    path = unixhttp.socket_of(process.base_url)
    assert path is not None, f"the engine is on {process.base_url}, not a Unix socket"
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    folder = os.lstat(Path(path).parent)
    assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == os.getuid()
    assert "--port" not in psutil.Process(process.pid).cmdline()
    if not tcp_allowed:
        assert _tcp_listeners(process.pid) == [], "a process of the engine listens on TCP"
    # vLLM CPU: torch.distributed's rendezvous, never HTTP
    _assert_no_listener_serves(_tcp_listeners(process.pid), ("/invocations", "/v1/completions"))
    body = {"model": "x", "prompt": "Hi", "max_tokens": 2}
    through = httpx.post(proxy.url + "/v1/completions", json=body, trust_env=False, timeout=300)
    assert through.status_code == 200 and through.json()["choices"]
    scraper = EngineScraper("t", process.adapter, process.base_url, process.pid, api_key=process.plan.api_key)
    try:
        series = {s.series for s in scraper.sample_once()}
    finally:
        scraper.close()
    assert "requests_running" in series, scraper.last_error  # /metrics came over the socket
    if also is not None:  # more checks on the same engine while it serves (one vLLM start for several checks)
        also(active)
    manager.close()
    assert not os.path.exists(path), "the socket file outlives its engine"


@pytest.mark.engine
@pytest.mark.llamacpp
def test_llama_server_behind_the_endpoint_has_no_tcp_port(llama_install: Any, demo_model: Any) -> None:
    from desktop.core.planning.planner import ask
    from desktop.core.serving.endpoint import EndpointManager

    proxy = ProxyServer(port=find_free_port(), wait_timeout=600)
    proxy.start()
    manager = EndpointManager(proxy, ready_timeout=600)
    try:
        # a plan that carries a port (a form, a models.yaml entry, an old pin) still gets the private socket
        manager.start(ask("llama.cpp", str(demo_model.gguf_path), {"slots": 1, "port": find_free_port()}))
        _check_private_engine(manager, proxy)
    finally:
        manager.close()
        proxy.stop()


@pytest.mark.engine
@pytest.mark.vllm
def test_vllm_behind_the_endpoint_has_no_tcp_port(vllm_install: Any, demo_model: Any) -> None:
    """vLLM's /invocations, /tokenize, /pause need no key: on a TCP port they answered anyone (and web pages).
    On its socket, no TCP port of vLLM's tree answers an inference request. The same start (one vLLM load for all,
    issue 71) also shows vLLM's own key guarding /v1 on its socket (was test_endpoint_guard's) and its prefix cache
    reusing a repeated prompt behind the endpoint (was test_prefix_cache's)."""
    from desktop.core.planning.planner import ask
    from desktop.core.serving.endpoint import EndpointManager

    proxy = ProxyServer(port=find_free_port(), wait_timeout=900)
    proxy.start()
    manager = EndpointManager(proxy, ready_timeout=900)
    try:
        manager.start(ask("vllm", "demo", {"slots": 1, "eager": True}))
        # vLLM's CPU workers rendezvous over torch.distributed (a TCPStore and gloo pairs on 127.0.0.1): those
        # loopback listeners exist, but none of them speaks HTTP, so none answers inference
        _check_private_engine(manager, proxy, tcp_allowed=True, also=lambda active: (
            vllm_refuses_v1_without_the_key(active, proxy), vllm_reuses_the_repeated_prompt(active, proxy)))
    finally:
        manager.close()
        proxy.stop()


def _plain_serve(engine: str, *more: str, env: dict[str, str] | None = None
                 ) -> tuple[subprocess.Popen[str], list[str]]:
    """A plain `serve` of the demo on `engine` with `more` options, and its stderr lines up to "ready:"."""
    proc = subprocess.Popen([sys.executable, "-m", "desktop", "serve", "--engine", engine,  # noqa: S603
                             "--model", "demo", "--parallel", "1", *more], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    before: list[str] = []
    for line in proc.stderr:
        before.append(line)
        if line.startswith("ready:"):
            break
    return proc, before


@pytest.mark.engine
@pytest.mark.llamacpp
def test_plain_serve_gets_a_per_launch_key_printed_once_and_kept_in_the_discovery_file(llama_install: Any,
                                                                                       demo_model: Any) -> None:
    """Plain `serve` keeps TCP (its clients talk to the engine) but no longer serves anyone who finds the port:
    without the key, even a request from a web page's origin gets 401."""
    import json

    from desktop.core.common import paths

    proc, before = _plain_serve("llama.cpp")
    ready = before[-1] if before else ""
    try:
        assert ready.startswith("ready: http://127.0.0.1:"), ready
        base_url = ready.split()[1].removesuffix("/v1")
        port = int(base_url.rsplit(":", 1)[1])
        discovery = paths.run_dir() / f"endpoint-{port}.json"
        assert stat.S_IMODE(os.stat(discovery).st_mode) == 0o600
        key = json.loads(discovery.read_text())["api_key"]
        assert len(key) >= 32 and key not in " ".join(psutil.Process(proc.pid).cmdline())
        body = {"prompt": "hi", "max_tokens": 2}
        refused = httpx.post(base_url + "/v1/completions", json=body, trust_env=False, timeout=60,
                             headers={"Origin": "http://evil.example"})
        assert refused.status_code == 401
        served = httpx.post(base_url + "/v1/completions", json=body, trust_env=False, timeout=120,
                            headers={"Authorization": f"Bearer {key}"})
        assert served.status_code == 200 and served.json()["choices"]
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=60)
    assert sum(line.count(key) for line in before) == 1 and key not in err, "the key is printed exactly once"


@pytest.mark.engine
@pytest.mark.llamacpp
def test_plain_serve_takes_the_key_from_api_key_env_and_never_prints_it(llama_install: Any, demo_model: Any) -> None:
    """`serve --api-key-env VAR` of llama.cpp (its plain serve: the engine on TCP) guarded the engine with a fresh
    key instead of the person's: clients holding the key they chose got 401 (found by the issue-59 benchmark)."""

    key = "chosen-by-the-person-" + "k" * 16
    proc, before = _plain_serve("llama.cpp", "--api-key-env", "PLAIN_SERVE_TEST_KEY", env={**os.environ, "PLAIN_SERVE_TEST_KEY": key})
    try:
        assert before and before[-1].startswith("ready: http://127.0.0.1:"), before
        base_url = before[-1].split()[1].removesuffix("/v1")
        body = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(base_url + "/v1/completions", json=body, trust_env=False, timeout=60).status_code == 401
        served = httpx.post(base_url + "/v1/completions", json=body, trust_env=False, timeout=120,
                            headers={"Authorization": f"Bearer {key}"})
        assert served.status_code == 200 and served.json()["choices"]
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=60)
    assert not any("API key of this launch" in line for line in before), "the person's own key is not echoed"


@pytest.mark.engine
@pytest.mark.vllm
def test_plain_serve_of_vllm_puts_the_keyed_endpoint_on_the_port_and_vllm_on_its_socket(vllm_install: Any,
                                                                                        demo_model: Any) -> None:
    """vLLM's own key guards /v1, /v2, /inference and /cohere only (its /invocations answered anyone who found a
    plain serve's port): a plain `serve --engine vllm` now gives the port to the endpoint, with a per-launch key,
    and vLLM listens on its private socket only."""
    import json

    from conftest import run_cli

    from desktop.core.common import paths

    port = find_free_port()
    proc, before = _plain_serve("vllm", "--ctx", "2048", "--port", str(port), "--vllm-eager")
    base_url = f"http://127.0.0.1:{port}"
    try:
        assert before and before[-1].startswith(f"ready: {base_url}/v1"), "".join(before[-5:])
        discovery = paths.run_dir() / f"endpoint-{port}.json"
        assert stat.S_IMODE(os.stat(discovery).st_mode) == 0o600
        key = json.loads(discovery.read_text())["api_key"]
        status = json.loads(run_cli("status", "--json", "--port", str(port)).stdout)
        engine_pid = status["active"]["pid"]
        assert status["active"]["engine"] == "vllm" and unixhttp.socket_of(status["active"]["base_url"])
        # torch.distributed's CPU rendezvous only: never HTTP
        _assert_no_listener_serves(_tcp_listeners(engine_pid), ("/invocations",))
        for route in ("/invocations", "/v1/completions", "/tokenize", "/metrics"):
            assert _http_answer("127.0.0.1", port, route).startswith(b"HTTP/1.1 403")  # a web page's origin
            bare = httpx.post(base_url + route, json={"prompt": "Hi"}, trust_env=False, timeout=60)
            assert bare.status_code == 401, (route, bare.text[:200])  # a local process without the key
        keyed = {"Authorization": f"Bearer {key}"}
        assert httpx.post(base_url + "/invocations", json={"prompt": "Hi"}, headers=keyed, trust_env=False,
                          timeout=60).status_code == 404  # not an inference route of the endpoint
        served = httpx.post(base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=keyed,
                            trust_env=False, timeout=300)
        assert served.status_code == 200 and served.json()["choices"]
        assert run_cli("stop", "--port", str(port)).returncode == 0
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        _out, err = proc.communicate(timeout=60)
    assert sum(line.count(key) for line in before) == 1 and key not in err, "the key is printed exactly once"


def test_plain_serve_of_vllm_with_no_key_warns_which_routes_stay_open() -> None:
    from conftest import run_cli

    refused = run_cli("serve", "--engine", "vllm", "--model", "/nonexistent/model", "--no-key")
    assert refused.returncode != 0
    assert "warning: --no-key puts vLLM itself on TCP with no key" in refused.stderr
    assert "/invocations" in refused.stderr and "/tokenize" in refused.stderr


@pytest.mark.engine
@pytest.mark.llamacpp
def test_a_tcp_engines_port_bound_by_another_after_it_stopped_is_sent_nothing(llama_install: Any,
                                                                               demo_model: Any) -> None:
    """Review L2 (issue 35): the listener was proven the engine's once, at start; the endpoint's later
    connections were not checked, so a process that bound the freed port of a dead engine got the engine's key
    and the prompts. Now every new connection to an engine on TCP is checked first."""
    import threading

    from desktop.core.engines import get_adapter
    from desktop.core.engines.base import LaunchPlan
    from desktop.core.runtime.supervisor import EngineProcess
    from desktop.core.serving.router import Upstream

    port = find_free_port()
    plan = LaunchPlan(engine="llama.cpp", model_path=demo_model.gguf_path, port=port, slots=1, ctx_per_request=512,
                      api_key="engine-key-" + "k" * 32)
    process = EngineProcess(get_adapter("llama.cpp"), plan, llama_install, tcp=True)
    proxy = ProxyServer(port=find_free_port(), wait_timeout=3)
    proxy.start()
    received: list[bytes] = []
    impostor = socket.socket()
    try:
        process.start()
        process.wait_ready(timeout=120)
        assert process.listener_holds()
        proxy.set_upstream(Upstream("llama.cpp@tcp", "llama.cpp", process.base_url, "switchyard",
                                    api_key=plan.api_key, listener_check=process.listener_holds))
        body = {"prompt": "a secret prompt", "max_tokens": 2}
        assert httpx.post(proxy.url + "/v1/completions", json=body, trust_env=False, timeout=60).status_code == 200
        process.stop()
        assert not process.listener_holds()
        impostor.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        impostor.bind(("127.0.0.1", port))
        impostor.listen()
        impostor.settimeout(0.5)

        def listen() -> None:
            while True:
                try:
                    conn, _ = impostor.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                with conn:
                    conn.settimeout(2)
                    try:
                        received.append(conn.recv(65536))
                    except OSError:
                        received.append(b"")

        thread = threading.Thread(target=listen, daemon=True)
        thread.start()
        refused = httpx.post(proxy.url + "/v1/completions", json=body, trust_env=False, timeout=60)
        assert refused.status_code >= 500
    finally:
        impostor.close()
        proxy.stop()
        process.stop()
    assert received, "the endpoint never connected to the port (the check was not exercised)"
    assert all(b"engine-key" not in data and b"secret prompt" not in data for data in received), received


def test_plain_serve_of_vllm_refuses_capture_bodies_with_its_key() -> None:
    from conftest import run_cli

    refused = run_cli("serve", "--engine", "vllm", "--model", "demo", "--capture-bodies")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "--capture-bodies is not available on an endpoint with an API key" in refused.stderr


@pytest.mark.engine
@pytest.mark.llamacpp
def test_endpoint_serve_gives_port_to_the_endpoint_and_the_engine_a_socket(llama_install: Any,
                                                                           demo_model: Any) -> None:
    """`serve --endpoint --port N` used to put llama-server (or vLLM, with /invocations, /tokenize, /pause open)
    itself on TCP port N: now N is the endpoint's, and the engine listens on its private socket only; --port with
    --proxy-port is refused before anything starts."""
    import json

    from conftest import run_cli, serve_until_ready

    port = find_free_port()
    both = run_cli("serve", "--engine", "llama.cpp", "--model", "demo", "--endpoint", "--port", str(port),
                   "--proxy-port", str(find_free_port()))
    assert both.returncode != 0 and "both name a port for the endpoint" in both.stderr, both.stderr
    proc, ready = serve_until_ready("--engine", "llama.cpp", "--model", "demo", "--parallel", "1", "--ctx", "2048",
                                    "--endpoint", "--port", str(port))
    try:
        assert ready.startswith(f"ready: http://127.0.0.1:{port}/v1"), ready
        status = json.loads(run_cli("status", "--json", "--port", str(port)).stdout)
        engine_pid = status["active"]["pid"]
        assert unixhttp.socket_of(status["active"]["base_url"]), status["active"]["base_url"]
        assert "--port" not in psutil.Process(engine_pid).cmdline()
        assert _tcp_listeners(engine_pid) == []  # llama-server: no TCP socket at all
        served = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                            trust_env=False, timeout=120)
        assert served.status_code == 200, served.text
        assert run_cli("stop", "--port", str(port)).returncode == 0
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)
