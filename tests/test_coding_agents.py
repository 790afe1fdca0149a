"""Issue 48: the real coding agents through the stable endpoint. Claude Code (`claude -p`) and the Codex CLI
(`codex exec`), installed from the npm registry at pinned versions, each complete a request through
`switchyard serve --proxy-port P` in front of the stand-in engine (tests/standin_engine.py: Anthropic Messages for
Claude Code, the OpenAI Responses stream for Codex), and against the real llama-server on the demo model (a
4,096-token window) each prints the endpoint's context message for its first request (tens of thousands of tokens).

The agents are installed once per user into ~/.cache/switchyard-tests/npm/<package>@<version> (XDG_CACHE_HOME
honoured) and reused by every later run and clone. Where the registry cannot be reached (npm's network error
codes) the tests skip and say so; any other install failure fails them. At run time the agents reach nothing but
127.0.0.1: their HOME is a temp folder, telemetry is off, and an unreachable proxy stands in every other host's way.

The stand-in runs behind the real CLI through the existing SWITCHYARD_LLAMA_SERVER setting (a configured
llama-server binary): a small script that takes llama-server's argv and execs the stand-in on the same socket."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import filelock
import pytest
from conftest import run_cli, serve_until_ready

from desktop.core.runtime.ports import find_free_port

STANDIN = Path(__file__).parent / "standin_engine.py"
# Pinned: what the issue was reported with (`npm view <package> version` said 2.1.332 / 0.171.0 on 2026-12-05;
# Claude Code >= 2.1.2xx wants Node 22, Debian 12's is 18).
CLAUDE_CODE = ("@anthropic-ai/claude-code", "2.1.197", "claude")
CODEX = ("@openai/codex", "0.171.0", "codex")
INSTALL_TIMEOUT_S = 600
AGENT_TIMEOUT_S = 180  # one agent run, to its exit (about 1 s against the stand-in)
TOKEN = "switchyard-test-token"  # what the agents send as their key; the endpoint runs without one
PROMPT = "Say hi."
ANSWER = "standin0 standin1 standin2 standin3"  # what the stand-in streams (its name `standin`, four chunks)
# npm's codes for a registry it cannot reach (a request that never got an HTTP answer)
NETWORK_CODES = frozenset({"ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ECONNRESET", "ETIMEDOUT", "ENETUNREACH",
                           "EHOSTUNREACH", "ENETDOWN", "ESOCKETTIMEDOUT", "ERR_SOCKET_TIMEOUT", "EPROTO",
                           "UNABLE_TO_GET_ISSUER_CERT_LOCALLY", "SELF_SIGNED_CERT_IN_CHAIN"})
CONTEXT_PHRASE = "is served with a context of 4096 tokens"


# --- installing the agents --------------------------------------------------------------------------------------
class NpmUnreachable(Exception):
    """npm could not reach its registry (the only install failure the tests skip for)."""


class NpmInstallFailed(Exception):
    """Any other failure to install or run an agent package: a test failure."""


def npm_root() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "switchyard-tests" / "npm"


def npm_install(package: str, version: str, command: str, root: Path | None = None,
                registry: str | None = None) -> Path:
    """The agent's executable, installed into ROOT/<package>@<version> by `npm install` unless a finished install is
    there (one process installs at a time; a half-done one is never used). Raises NpmUnreachable for npm's network
    errors, NpmInstallFailed for anything else."""
    npm = shutil.which("npm")
    if npm is None:
        raise NpmInstallFailed("npm is not installed: the coding-agent tests install Claude Code and Codex with it "
                               "(`apt-get install npm`, Node.js 18 or later)")
    folder = (root or npm_root()) / f"{package}@{version}"
    binary = folder / "node_modules" / ".bin" / command
    marker = folder / "switchyard-installed.json"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(folder.parent / f".{folder.name}.lock"), timeout=INSTALL_TIMEOUT_S + 60):
        if marker.exists() and binary.exists():
            return binary
        staging = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        argv = [npm, "install", "--prefix", str(staging), "--no-audit", "--no-fund", "--loglevel=error",
                "--fetch-retries=1", "--fetch-retry-mintimeout=2000", *(["--registry", registry] if registry else []), f"{package}@{version}"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,  # noqa: S603
                                  stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise NpmInstallFailed(f"`npm install {package}@{version}` took over {INSTALL_TIMEOUT_S} s") from exc
        if done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            said = done.stdout + done.stderr
            codes = re.findall(r"^npm (?:ERR!|error) code (\S+)", said, re.M)
            if codes and codes[0] in NETWORK_CODES:
                raise NpmUnreachable(f"npm could not reach its registry ({codes[0]}) to install {package}@{version}")
            raise NpmInstallFailed(f"`npm install {package}@{version}` exited {done.returncode}: {said[-2000:]}")
        staged = staging / "node_modules" / ".bin" / command
        version_said = _version(staged)
        if version not in version_said:
            shutil.rmtree(staging, ignore_errors=True)
            raise NpmInstallFailed(f"{staged} --version said {version_said!r}, not {version}")
        (staging / marker.name).write_text(json.dumps({"package": package, "version": version}))
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    return binary


def _version(binary: Path) -> str:
    with tempfile.TemporaryDirectory() as home:
        try:
            done = subprocess.run([str(binary), "--version"], capture_output=True, text=True,  # noqa: S603
                                  timeout=60, stdin=subprocess.DEVNULL, env=_agent_env(Path(home)), check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"(did not run: {exc})"
    return (done.stdout + done.stderr).strip()


def _installed(package: str, version: str, command: str) -> Path:
    try:
        return npm_install(package, version, command)
    except NpmUnreachable as exc:
        pytest.skip(f"{exc}: the coding-agent tests need the npm registry once")
    except NpmInstallFailed as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def claude_code() -> Path:
    return _installed(*CLAUDE_CODE)


@pytest.fixture(scope="session")
def codex() -> Path:
    return _installed(*CODEX)


# --- running them -----------------------------------------------------------------------------------------------
@dataclass
class AgentRun:
    returncode: int
    output: str  # stdout and stderr together
    seconds: float


def _agent_env(home: Path, **extra: str) -> dict[str, str]:
    """A clean environment: a temp HOME, no network but loopback (an unreachable proxy for every other host)."""
    dead_proxy = f"http://127.0.0.1:{find_free_port()}"
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8", "TERM": "dumb",
            "NO_COLOR": "1", "HTTP_PROXY": dead_proxy, "HTTPS_PROXY": dead_proxy, "ALL_PROXY": dead_proxy,
            "http_proxy": dead_proxy, "https_proxy": dead_proxy, "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost", **extra}


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> AgentRun:
    started = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=AGENT_TIMEOUT_S, env=env,  # noqa: S603
                              cwd=cwd, stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired as exc:
        said = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"{Path(argv[0]).name} ran past {AGENT_TIMEOUT_S} s; it said: {said[-3000:]}", pytrace=False)
    return AgentRun(done.returncode, done.stdout + done.stderr, time.monotonic() - started)


def run_claude(binary: Path, port: int, home: Path, prompt: str = PROMPT) -> AgentRun:
    """`claude -p PROMPT` against the endpoint, as `ollama launch claude` sets it up but with Claude Code's own
    defaults otherwise (its attribution header stays on)."""
    home.mkdir(parents=True, exist_ok=True)
    env = _agent_env(home, ANTHROPIC_BASE_URL=f"http://127.0.0.1:{port}", ANTHROPIC_AUTH_TOKEN=TOKEN,
                     ANTHROPIC_API_KEY="", DISABLE_TELEMETRY="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
                     DISABLE_ERROR_REPORTING="1")
    return _run([str(binary), "-p", "--model", "switchyard", prompt], env, home)


CODEX_CONFIG = """model = "switchyard"
model_provider = "switchyard"

[model_providers.switchyard]
name = "Switchyard"
base_url = "http://127.0.0.1:{port}/v1"
wire_api = "responses"
env_key = "SWITCHYARD_API_KEY"
"""


def run_codex(binary: Path, port: int, home: Path, prompt: str = PROMPT) -> AgentRun:
    """`codex exec PROMPT` with a provider at the endpoint (CODEX_HOME/config.toml), in an empty folder."""
    codex_home, work = home / "codex-home", home / "work"
    codex_home.mkdir(parents=True, exist_ok=True)
    work.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(port=port))
    env = _agent_env(home, CODEX_HOME=str(codex_home), SWITCHYARD_API_KEY=TOKEN)
    return _run([str(binary), "exec", "--skip-git-repo-check", prompt], env, work)


# --- the stand-in behind the CLI's endpoint ------------------------------------------------------------------------
# A "llama-server" for SWITCHYARD_LLAMA_SERVER: answers --version, then becomes the stand-in on the socket the
# supervisor gave llama-server (--host PATH.sock behind the endpoint, or --host/--port).
STANDIN_BINARY = '''
import os, sys
argv = sys.argv[1:]
if "--version" in argv or "--list-devices" in argv:
    print("version: 0 (stand-in)")
    sys.exit(0)
host = argv[argv.index("--host") + 1]
where = ["--uds", host] if host.endswith(".sock") else ["--port", argv[argv.index("--port") + 1]]
ctx = argv[argv.index("--ctx-size") + 1] if "--ctx-size" in argv else "2048"
slots = int(argv[argv.index("--parallel") + 1]) if "--parallel" in argv else 1
options = [str(int(ctx) // slots) if o == "PER_REQUEST_CONTEXT" else o for o in {options!r}]
os.execv(sys.executable, [sys.executable, {standin!r}, *where, "--ctx", ctx, "--name", "standin", *options])
'''


@dataclass
class Endpoint:
    port: int
    bodies: Path  # the stand-in's --bodies: every request's path, headers and body

    def seen(self) -> list[dict[str, Any]]:
        if not self.bodies.exists():
            return []
        return [json.loads(line) for line in self.bodies.read_text().splitlines()]


@pytest.fixture(scope="session")
def standin_folder(tmp_path_factory: pytest.TempPathFactory, demo_model: Any) -> Iterator[Path]:
    """The folder the stand-in "llama-server" scripts go into (the demo GGUF is the model the plan checks)."""
    yield tmp_path_factory.mktemp("standin-binary")


def serve_standin(folder: Path, *options: str) -> tuple[subprocess.Popen[str], Endpoint]:
    """`switchyard serve --engine llama.cpp --model demo --proxy-port P` with the stand-in as llama-server."""
    bodies = folder / f"bodies-{find_free_port()}.jsonl"
    script = folder / f"llama-server-{bodies.stem}"
    script.write_text(f"#!{sys.executable}\n" + STANDIN_BINARY.format(
        standin=str(STANDIN), options=["--bodies", str(bodies), *options]))
    script.chmod(0o755)
    port = find_free_port()
    proc, ready = serve_until_ready("--engine", "llama.cpp", "--model", "demo", "--proxy-port", str(port),
                                    env={**os.environ, "SWITCHYARD_LLAMA_SERVER": str(script)})
    if not ready.startswith(f"ready: http://127.0.0.1:{port}/v1"):
        stop(proc)
        pytest.fail(f"the endpoint did not get ready: {ready}", pytrace=False)
    return proc, Endpoint(port, bodies)


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def standin_endpoint(standin_folder: Path) -> Iterator[Endpoint]:
    proc, endpoint = serve_standin(standin_folder)
    try:
        yield endpoint
    finally:
        stop(proc)


# --- through the endpoint to the stand-in ------------------------------------------------------------------------
def test_claude_code_completes_a_request_through_the_endpoint(claude_code: Path, standin_endpoint: Endpoint,
                                                              tmp_path: Path) -> None:
    before = len(standin_endpoint.seen())
    run = run_claude(claude_code, standin_endpoint.port, tmp_path / "home")
    assert run.returncode == 0, run.output
    assert ANSWER in run.output, run.output
    asked = [r for r in standin_endpoint.seen()[before:] if r["path"].startswith("/v1/messages")]
    assert asked, "the stand-in saw no /v1/messages request"
    first = asked[0]
    assert first["path"] == "/v1/messages?beta=true" and first["body"]["stream"] is True
    assert first["body"]["model"] == "switchyard" and first["body"]["tools"]
    assert first["headers"]["anthropic-version"] == "2023-06-01", first["headers"]
    assert "claude-code-20250219" in first["headers"]["anthropic-beta"], first["headers"]  # passed through
    # Claude Code's attribution line (on by default) never reaches the engine: its prefix cache would miss
    assert "x-anthropic-billing-header" not in json.dumps(first["body"]["system"]), first["body"]["system"][:1]
    assert first["headers"]["user-agent"].startswith(f"claude-cli/{CLAUDE_CODE[1]} ")
    assert PROMPT in json.dumps(first["body"]["messages"])


def test_codex_completes_a_request_through_the_endpoint(codex: Path, standin_endpoint: Endpoint,
                                                        tmp_path: Path) -> None:
    before = len(standin_endpoint.seen())
    run = run_codex(codex, standin_endpoint.port, tmp_path / "home")
    assert run.returncode == 0, run.output
    assert ANSWER in run.output, run.output
    asked = [r for r in standin_endpoint.seen()[before:] if r["path"] == "/v1/responses"]
    assert asked, "the stand-in saw no /v1/responses request"
    body = asked[0]["body"]
    assert body["stream"] is True and body["model"] == "switchyard" and body["tools"]
    assert asked[0]["headers"]["user-agent"].startswith(f"codex_exec/{CODEX[1]} ")
    assert PROMPT in json.dumps(body["input"])


def test_the_standins_agent_apis_read_right_with_the_official_clients(standin_endpoint: Endpoint) -> None:
    """What the agents parse, read by the official SDKs through the endpoint (no npm needed): Anthropic Messages
    whole and streamed (the SDK's accumulator checks the event sequence), count_tokens equal to the message's
    usage.input_tokens for the same prompt, and the Responses stream to its completed response."""
    import anthropic
    import httpx
    import openai

    base = f"http://127.0.0.1:{standin_endpoint.port}"
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    client = anthropic.Anthropic(base_url=base, api_key=TOKEN, max_retries=0, timeout=60,
                                 http_client=anthropic.DefaultHttpxClient(trust_env=False))
    whole = client.messages.create(model="switchyard", max_tokens=8, system="Be brief.", messages=ask)  # type: ignore[arg-type]
    assert whole.content[0].text == ANSWER + " " and whole.stop_reason == "end_turn"  # type: ignore[union-attr]
    with client.messages.stream(model="switchyard", max_tokens=8, system="Be brief.", messages=ask) as stream:  # type: ignore[arg-type]
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert streamed.content[0].text == ANSWER + " " and streamed.usage.output_tokens == 4  # type: ignore[union-attr]
    assert events[0] == "message_start" and events[-1] == "message_stop" and "message_delta" in events
    counted = client.messages.count_tokens(model="switchyard", system="Be brief.", messages=ask)  # type: ignore[arg-type]
    assert counted.input_tokens == whole.usage.input_tokens == streamed.usage.input_tokens > 1
    http = httpx.Client(trust_env=False, timeout=60)
    responses = openai.OpenAI(base_url=base + "/v1", api_key=TOKEN, http_client=http, max_retries=0)
    with responses.responses.stream(model="switchyard", input="What is the weather in Paris?") as stream_r:
        kinds = [event.type for event in stream_r]
        final = stream_r.get_final_response()
    assert final.output_text == ANSWER + " " and final.usage is not None and final.usage.output_tokens == 4
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_item.done" in kinds and "response.content_part.done" in kinds
    http.close()


def test_codex_completes_when_the_engine_leaves_the_streams_end_out(codex: Path, standin_folder: Path,
                                                                   tmp_path: Path) -> None:
    """An engine whose Responses stream ends without output_item.done and response.completed (vLLM's once did):
    Codex alone fails ("stream closed before response.completed"); through the endpoint, which adds what was left
    out (serving.responses), it prints the answer. The official openai client reads the same stream to its end."""
    import httpx
    import openai

    omitted = ("response.output_item.done", "response.completed")
    proc, endpoint = serve_standin(standin_folder, *(arg for name in omitted for arg in ("--omit", name)))
    try:
        run = run_codex(codex, endpoint.port, tmp_path / "home")
        http = httpx.Client(trust_env=False, timeout=60)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{endpoint.port}/v1", api_key=TOKEN, http_client=http,
                               max_retries=0)
        with client.responses.stream(model="switchyard", input="What is the weather in Paris?") as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
        http.close()
    finally:
        stop(proc)
    assert endpoint.seen(), "the stand-in saw no request"
    assert run.returncode == 0, run.output
    assert ANSWER in run.output, run.output
    assert kinds[-2:] == list(omitted), kinds
    assert final.status == "completed" and final.output_text == ANSWER + " ", final


def test_a_budget_the_engine_refuses_is_sent_again_with_what_the_context_leaves(standin_folder: Path) -> None:
    """An engine that refuses prompt + max_tokens beyond its context (vLLM before 0.10; the stand-in says it in
    those words): Claude Code's 32,000 goes as the context served per request, is refused, and is sent again at
    once with what the context leaves after the prompt; the client sees one 200. A prompt longer than the context
    gets the endpoint's context message in each API's own error shape."""
    import httpx

    proc, endpoint = serve_standin(standin_folder, "--context", "PER_REQUEST_CONTEXT")
    try:
        base, port = f"http://127.0.0.1:{endpoint.port}", str(endpoint.port)
        context = json.loads(run_cli("status", "--json", "--port", port).stdout)["active"]["plan"]["ctx_per_request"]
        headers = {"x-api-key": TOKEN, "anthropic-version": "2023-06-01"}

        def post(path: str, body: dict[str, Any]) -> httpx.Response:
            return httpx.post(base + path, json=body, headers=headers, trust_env=False, timeout=60)

        messages = [{"role": "user", "content": "Say hi."}]
        prompt = post("/v1/messages/count_tokens", {"model": "switchyard", "messages": messages}).json()["input_tokens"]
        answer = post("/v1/messages", {"model": "switchyard", "max_tokens": 32000, "messages": messages})
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-switchyard-adjusted"] == \
            f"max_tokens 32000 -> {context - prompt} (what the served context leaves after the prompt)"
        assert [r["body"]["max_tokens"] for r in endpoint.seen() if r["path"] == "/v1/messages"] == \
            [context, context - prompt]
        listed = json.loads(run_cli("requests", "--json", "--port", port).stdout)["requests"]
        assert [r["status"] for r in listed if r["path"] == "/v1/messages"] == [200], listed  # one request

        # 5 characters a word, 4 a token by count_tokens: about 1.25 x the context, under the model's 4,096-token window
        long = [{"role": "user", "content": "word " * context}]
        too_long = post("/v1/messages/count_tokens", {"model": "switchyard", "messages": long}).json()["input_tokens"]
        assert context < too_long < 4096, too_long
        told = f"the prompt has {too_long} tokens, but model 'switchyard' is served with a context of {context}"
        refused = post("/v1/messages", {"model": "switchyard", "max_tokens": 8, "messages": long})
        assert refused.status_code == 400 and refused.json()["type"] == "error", refused.text
        assert told in refused.json()["error"]["message"] and "--ctx" in refused.json()["error"]["message"]
        chat = post("/v1/chat/completions", {"model": "switchyard", "max_tokens": 8, "messages": long}).json()
        assert told in chat["error"]["message"] and chat["error"]["code"] == "context_length_exceeded", chat
        responses = post("/v1/responses", {"model": "switchyard", "input": long[0]["content"]}).json()
        assert f"is served with a context of {context} tokens" in responses["error"]["message"], responses
        assert responses["error"]["code"] is None  # Codex would show its fixed text instead of the message
    finally:
        stop(proc)


def test_claude_code_asks_again_for_a_whole_message_when_the_stream_has_no_message_start(
        claude_code: Path, standin_folder: Path, tmp_path: Path) -> None:
    """Claude Code's fallback: a stream it cannot read is asked again without `stream`; the whole Anthropic message
    (the stand-in's non-streamed /v1/messages through the endpoint) is what it prints."""
    proc, endpoint = serve_standin(standin_folder, "--omit", "message_start")
    try:
        run = run_claude(claude_code, endpoint.port, tmp_path / "home")
    finally:
        stop(proc)
    assert run.returncode == 0 and ANSWER in run.output, run.output
    streamed = [bool(r["body"].get("stream")) for r in endpoint.seen() if r["path"].startswith("/v1/messages")]
    assert streamed == [True, False], streamed


def test_claude_code_prints_nothing_from_a_stream_without_content_block_stop(claude_code: Path, standin_folder: Path,
                                                                            tmp_path: Path) -> None:
    """The other side of the first test: the text block must be closed for Claude Code to print it."""
    proc, endpoint = serve_standin(standin_folder, "--omit", "content_block_stop")
    try:
        run = run_claude(claude_code, endpoint.port, tmp_path / "home")
    finally:
        stop(proc)
    assert ANSWER not in run.output, run.output
    assert endpoint.seen(), "the stand-in saw no request"


# --- against the real llama-server: the endpoint's context message reaches each agent ------------------------------
@pytest.fixture(scope="module")
def llama_endpoint(llama_install: Any, demo_model: Any) -> Iterator[int]:
    port = find_free_port()
    proc, ready = serve_until_ready("--engine", "llama.cpp", "--model", "demo", "--ctx", "4096", "--parallel", "1",
                                    "--proxy-port", str(port))
    try:
        assert ready.startswith(f"ready: http://127.0.0.1:{port}/v1"), ready
        yield port
    finally:
        stop(proc)


def _says_the_context(run: AgentRun) -> None:
    assert CONTEXT_PHRASE in run.output, run.output
    counts = [int(n.replace(",", "")) for n in re.findall(r"(\d[\d,]*) tokens", run.output)]
    assert any(n > 4096 for n in counts), run.output  # the prompt's own count, over the window


@pytest.mark.engine
@pytest.mark.llamacpp
def test_claude_code_prints_the_endpoints_context_message(claude_code: Path, llama_endpoint: int,
                                                          tmp_path: Path) -> None:
    _says_the_context(run_claude(claude_code, llama_endpoint, tmp_path / "home"))


@pytest.mark.engine
@pytest.mark.llamacpp
def test_codex_prints_the_endpoints_context_message(codex: Path, llama_endpoint: int, tmp_path: Path) -> None:
    _says_the_context(run_codex(codex, llama_endpoint, tmp_path / "home"))


# --- the install: skipped only where the registry is unreachable -------------------------------------------------
class _NotFound(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        body = b'{"error":"Not found"}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def test_an_unreachable_registry_is_told_apart_from_a_failed_install(tmp_path: Path) -> None:
    if shutil.which("npm") is None:
        pytest.fail("npm is not installed (`apt-get install npm`)", pytrace=False)
    closed = f"http://127.0.0.1:{find_free_port()}/"
    with pytest.raises(NpmUnreachable, match="ECONNREFUSED"):
        npm_install(*CODEX, root=tmp_path / "a", registry=closed)
    registry = ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=registry.serve_forever, daemon=True).start()
    try:
        with pytest.raises(NpmInstallFailed, match="E404"):
            npm_install(*CODEX, root=tmp_path / "b", registry=f"http://127.0.0.1:{registry.server_port}/")
    finally:
        registry.shutdown()
        registry.server_close()
    left = [p for p in tmp_path.glob("*/*/*") if not p.name.endswith(".lock")]
    assert not left, left  # nothing half-installed stays
