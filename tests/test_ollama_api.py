"""Issue 54: the official `ollama` Python client (PyPI) through the endpoint. Against the stand-in engine behind
`switchyard serve --endpoint` (tests/standin_engine.py as llama-server): it lists, shows and chats, streamed and
not, the request log names /api/chat, the engine receives OpenAI's chat body, and the endpoint's key and Origin
checks hold for /api/ too, with errors the client raises as ResponseError. Against the real engines: the demo
model on llama-server, then after `switchyard switch --to vllm` on vLLM, listed and chatted with the same way."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import run_cli, serve_until_ready
from test_coding_agents import ANSWER, STANDIN, STANDIN_BINARY, Endpoint, serve_standin, stop

from desktop.core.runtime.ports import find_free_port

ollama = pytest.importorskip("ollama")


def _client(port: int, **headers: str) -> Any:
    return ollama.Client(host=f"http://127.0.0.1:{port}", headers=headers or None, trust_env=False, timeout=120)


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory, demo_model: Any) -> Iterator[Endpoint]:
    proc, endpoint = serve_standin(tmp_path_factory.mktemp("ollama-standin"))
    try:
        yield endpoint
    finally:
        stop(proc)


def test_the_ollama_client_lists_shows_and_chats_through_the_endpoint(standin: Endpoint) -> None:
    client = _client(standin.port)
    listed = client.list()
    assert [m.model for m in listed.models] == ["switchyard"]
    assert listed.models[0].details.family == "llama"  # the demo's architecture (demo.py writes a llama GGUF)
    shown = client.show("switchyard:latest")  # Ollama clients add the tag
    assert shown.modelinfo["general.architecture"] == "llama"
    assert [m.model for m in client.ps().models] == ["switchyard"]
    before = len(standin.seen())
    whole = client.chat(model="switchyard", messages=[{"role": "user", "content": "hi"}], stream=False)
    assert whole.message.content == "hi from standin" and whole.done and whole.done_reason == "stop"
    parts = list(client.chat(model="switchyard", messages=[{"role": "user", "content": "hi"}], stream=True,
                             options={"temperature": 0, "num_predict": 16}))
    assert "".join(p.message.content for p in parts) == ANSWER + " " and parts[-1].done
    assert parts[-1].eval_count == 4  # the stand-in's four chunks (its usage chunk)
    generated = client.generate(model="switchyard", prompt="hi", stream=False)
    assert generated.response == "hi from standin"
    loaded = [client.generate(model="switchyard", prompt="", stream=False),  # Ollama's "load the model"
              *client.generate(model="switchyard", prompt="", stream=True)]
    assert [(g.done, g.done_reason) for g in loaded] == [(True, "load"), (True, "load")]
    # what the engine received: OpenAI chat bodies with Ollama's options under OpenAI's names
    sent = [r for r in standin.seen()[before:] if r["path"] == "/v1/chat/completions"]
    assert len(sent) == 3 and sent[1]["body"]["max_tokens"] == 16 and sent[1]["body"]["temperature"] == 0
    assert sent[1]["body"]["stream"] is True and sent[1]["body"]["stream_options"] == {"include_usage": True}
    logged = json.loads(run_cli("requests", "--json", "--port", str(standin.port)).stdout)["requests"]
    assert [r["path"] for r in logged[-3:]] == ["/api/chat", "/api/chat", "/api/generate"]
    assert all(r["status"] == 200 for r in logged[-3:])
    # what could not be carried over is said, in the header and the log, as the endpoint's own rules are
    answer = httpx.post(f"http://127.0.0.1:{standin.port}/api/chat", trust_env=False, timeout=60,
                        json={"model": "switchyard", "stream": False, "options": {"num_ctx": 32768},
                              "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200 and "num_ctx 32768 ignored" in answer.headers["x-switchyard-adjusted"]
    logged = json.loads(run_cli("requests", "--json", "--port", str(standin.port)).stdout)["requests"]
    assert "num_ctx 32768 ignored" in (logged[-1]["note"] or ""), logged[-1]


def test_launch_env_points_the_ollama_library_at_the_endpoint(standin: Endpoint) -> None:
    """`eval "$(switchyard launch --env)"` sets OLLAMA_HOST: the library's module-level functions (which read it
    and nothing else) reach the endpoint instead of 127.0.0.1:11434."""
    import subprocess

    exports = run_cli("launch", "--env", "--port", str(standin.port))
    assert exports.returncode == 0, exports.stderr
    assert f"export OLLAMA_HOST=http://127.0.0.1:{standin.port}\n" in exports.stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLLAMA_")}
    env.update(EXPORTS=exports.stdout, PY=sys.executable, NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    program = "import ollama; print(ollama.chat(model='switchyard', messages=[{'role': 'user', 'content': 'hi'}], stream=False).message.content)"
    done = subprocess.run(["bash", "-c", f'eval "$EXPORTS" && "$PY" -c "{program}"'], capture_output=True,  # noqa: S607
                          text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "hi from standin", done.stdout + done.stderr


def test_ollamas_errors_and_the_endpoints_checks_on_the_api_routes(standin: Endpoint) -> None:
    client = _client(standin.port)
    with pytest.raises(ollama.ResponseError) as refused:
        client.pull("llama3")
    assert refused.value.status_code == 501 and "switchyard pull" in refused.value.error
    with pytest.raises(ollama.ResponseError) as missing:
        client.show("nope")
    assert missing.value.status_code == 404 and "not found" in missing.value.error
    page = httpx.post(f"http://127.0.0.1:{standin.port}/api/chat", headers={"Origin": "https://evil.example"},
                      json={"model": "switchyard", "messages": []}, trust_env=False)
    assert page.status_code == 403 and "refused" in page.json()["error"]  # Ollama's shape: a string
    assert httpx.get(f"http://127.0.0.1:{standin.port}/api/version", trust_env=False).json()["version"]
    with pytest.raises(ollama.ResponseError) as no_embeddings:  # a chat model's engine: no embeddings route
        client.embed(model="switchyard", input="hello")
    assert "serve an embedding model" in no_embeddings.value.error and "models.yaml" in no_embeddings.value.error


def test_a_keyed_endpoint_takes_the_ollama_client_with_its_key_only(tmp_path: Path, demo_model: Any) -> None:
    script = tmp_path / "llama-server-standin"
    script.write_text(f"#!{sys.executable}\n" + STANDIN_BINARY.format(standin=str(STANDIN), options=[]))
    script.chmod(0o755)
    port = find_free_port()
    proc, ready = serve_until_ready("--engine", "llama.cpp", "--model", "demo", "--proxy-port", str(port),
                                    "--api-key-env", "OLLAMA_TEST_KEY",
                                    env={**os.environ, "SWITCHYARD_LLAMA_SERVER": str(script),
                                         "OLLAMA_TEST_KEY": "k-123"})
    try:
        assert ready.startswith(f"ready: http://127.0.0.1:{port}/v1"), ready
        with pytest.raises(ollama.ResponseError) as locked:
            _client(port).list()
        assert locked.value.status_code == 401
        answer = _client(port, Authorization="Bearer k-123").chat(
            model="switchyard", messages=[{"role": "user", "content": "hi"}], stream=False)
        assert answer.message.content == "hi from standin"
    finally:
        stop(proc)


@pytest.mark.engine
@pytest.mark.llamacpp
def test_embed_reaches_a_llama_server_started_with_embeddings(llama_install: Any, demo_model: Any) -> None:
    """`/api/embed` on an engine that embeds (llama-server --embeddings --pooling mean: the demo's GGUF, a chat
    model, sets no pooling): one vector per input, as wide as the demo's hidden size (its config.json)."""
    hidden = json.loads((demo_model.path_for("hf") / "config.json").read_text())["hidden_size"]
    port = find_free_port()
    proc, ready = serve_until_ready("--engine", "llama.cpp", "--model", "demo", "--ctx", "512", "--parallel", "1",
                                    "--proxy-port", str(port), "--", "--embeddings", "--pooling", "mean")
    try:
        assert ready.startswith(f"ready: http://127.0.0.1:{port}/v1"), ready
        embedded = _client(port).embed(model="switchyard", input=["a railway", "a switchyard"])
        assert len(embedded.embeddings) == 2 and all(len(v) == hidden for v in embedded.embeddings)
        assert embedded.embeddings[0] != embedded.embeddings[1] and embedded.prompt_eval_count > 0
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def qwen_templated(tmp_path_factory: pytest.TempPathFactory, demo_model: Any) -> tuple[Path, Path]:
    """(GGUF, HF folder): the demo's weights with Qwen3.5's chat template as llama.cpp ships it (a thinking
    template: `<think>\n` opens the answer, `<think>\n\n</think>\n\n` when enable_thinking is false), so both
    engines launch with their Qwen3 reasoning parser. The HF folder links the demo's files but its tokenizer
    config."""
    from gguf_tools import with_chat_template

    template = (Path(__file__).parent / "data" / "templates" / "Qwen3.5-4B.jinja").read_text()
    folder = tmp_path_factory.mktemp("qwen-templated")
    gguf = with_chat_template(demo_model.path_for("gguf"), folder / "demo-qwen.gguf", template)
    hf = folder / "demo-qwen-hf"
    hf.mkdir()
    source = demo_model.path_for("hf")
    for file in source.iterdir():
        if file.name != "tokenizer_config.json":
            (hf / file.name).symlink_to(file)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return gguf, hf


@pytest.mark.engine
@pytest.mark.llamacpp
@pytest.mark.vllm
def test_the_ollama_client_and_reasoning_off_on_llama_server_then_after_a_switch_on_vllm(
        llama_install: Any, vllm_install: Any, qwen_templated: tuple[Path, Path]) -> None:
    """Both Done-whens on the real engines: the client lists, shows and chats (whole and streamed); the model's
    setting off (`serve --reasoning-effort off`, a request that says nothing) reaches each engine as its own
    fields, which its thinking template renders as a closed think block: the answer is content, no thinking, and
    the prompt the engine counted is longer; a request's `think: true` wins, and the open think block makes the
    engine's reasoning parser give everything as thinking."""
    gguf, hf = qwen_templated
    port = find_free_port()
    proc, ready = serve_until_ready("--engine", "llama.cpp", "--model", str(gguf), "--ctx", "1024", "--parallel",
                                    "2", "--proxy-port", str(port), "--reasoning-effort", "off", "--vllm-eager")
    try:
        assert ready.startswith(f"ready: http://127.0.0.1:{port}/v1"), ready
        for engine in ("llama.cpp", "vllm"):
            if engine == "vllm":
                switched = run_cli("switch", "--to", "vllm", "--model", str(hf), "--port", str(port), "--json",
                                   timeout=900)
                assert switched.returncode == 0, switched.stderr
            status = json.loads(run_cli("status", "--json", "--port", str(port)).stdout)
            assert status["active"]["engine"] == engine, status
            client = _client(port)
            assert [m.model for m in client.list().models] == ["switchyard"]
            info = client.show("switchyard").modelinfo
            assert info[f"{info['general.architecture']}.context_length"] == 4096  # the demo's window (demo.py)
            ask = [{"role": "user", "content": "Name a colour."}]
            options = {"num_predict": 8, "temperature": 0}
            quiet = client.chat(model="switchyard", messages=ask, stream=False, options=options)  # the model's: off
            assert quiet.done and quiet.done_reason == "length" and quiet.eval_count == 8, (engine, quiet)
            assert quiet.message.content and not quiet.message.thinking, (engine, quiet)
            parts = list(client.chat(model="switchyard", messages=ask, stream=True, options=options))
            assert parts[-1].done and parts[-1].eval_count == 8 and not any(p.done for p in parts[:-1])
            assert "".join(p.message.content for p in parts) and not any(p.message.thinking for p in parts)
            thinking = client.chat(model="switchyard", messages=ask, stream=False, think=True, options=options)
            assert thinking.message.thinking and not thinking.message.content, (engine, thinking)
            # `<think>\n\n</think>\n\n` against `<think>\n`: the prompt the engine evaluated is longer when off
            assert quiet.prompt_eval_count > thinking.prompt_eval_count > 0, (engine, quiet, thinking)
            if engine == "llama.cpp":  # served without --embeddings: llama-server's refusal, and the way out
                with pytest.raises(ollama.ResponseError) as refused:
                    client.embed(model="switchyard", input="hello")
                assert "does not support embeddings" in refused.value.error, refused.value.error
    finally:
        stop(proc)
