"""Embedding and rerank servers (issue 57, first part): the flags a models.yaml entry's `kind` adds to its engine,
checked against the real llama-server.

Expected values come from outside the code under test: the vector width is the GGUF's own
`llama.embedding_length` (read with the gguf library), the token count is llama-server's own /tokenize, and the
refusal without the raised physical batch is the server's own message (server-context.cpp)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from desktop.core.common.errors import SwitchyardError
from desktop.core.engines.pooling import task_args


def test_an_embedding_entry_gets_the_switch_a_pooling_and_a_batch_the_size_of_its_context() -> None:
    assert task_args("llama.cpp", "chat", 4096, []) == []
    assert task_args("llama.cpp", "embedding", 4096, []) == ["--embeddings", "--pooling", "mean",
                                                             "--ubatch-size", "4096", "--batch-size", "4096"]
    # within llama-server's defaults (-ub 512, -b 2048) nothing is raised
    assert task_args("llama.cpp", "embedding", 512, []) == ["--embeddings", "--pooling", "mean"]
    assert task_args("llama.cpp", "rerank", 1024, []) == ["--reranking", "--pooling", "rank", "--ubatch-size", "1024"]
    assert task_args("vllm", "embedding", 4096, []) == ["--runner", "pooling"]


def test_the_persons_own_flags_win_in_any_spelling() -> None:
    given = ["--embedding", "--pooling=cls", "-ub", "1024", "--batch_size", "8192"]
    assert task_args("llama.cpp", "embedding", 4096, given) == []
    assert task_args("llama.cpp", "rerank", 4096, ["--rerank"]) == ["--pooling", "rank", "--ubatch-size", "4096",
                                                                    "--batch-size", "4096"]
    assert task_args("vllm", "rerank", 4096, ["--runner=pooling"]) == []
    with pytest.raises(SwitchyardError, match="unknown kind 'embed'"):
        task_args("llama.cpp", "embed", 4096, [])


def test_a_gguf_that_names_its_pooling_keeps_it(tmp_path: Path) -> None:
    """A GGUF with `<arch>.pooling_type` (as embedding models' GGUFs have: 1 = mean, 2 = cls) gets no --pooling."""
    import gguf

    path = tmp_path / "embedder.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_pooling_type(gguf.PoolingType.CLS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert task_args("llama.cpp", "embedding", 1024, [], path) == ["--embeddings", "--ubatch-size", "1024"]


def _server(install: Any, model: Path, args: list[str]) -> Iterator[Any]:
    from conftest import _running

    yield from _running("llama.cpp", model, install, ctx_per_request=1024, slots=1, extra_args=tuple(args))


def _long_input(base_url: str) -> tuple[str, int]:
    """A text over llama-server's default physical batch (512 tokens), measured by its own tokenizer."""
    text = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
    tokens = httpx.post(f"{base_url}/tokenize", json={"content": text}, timeout=30).json()["tokens"]
    return text, len(tokens)


@pytest.mark.engine
@pytest.mark.llamacpp
def test_the_real_llama_server_embeds_an_input_longer_than_its_default_batch(llama_install: Any,
                                                                              demo_model: Any) -> None:
    import gguf
    import openai

    model = Path(demo_model.gguf_path)
    width = gguf.GGUFReader(model).fields["llama.embedding_length"].contents()
    servers = _server(llama_install, model, task_args("llama.cpp", "embedding", 1024, [], model))
    server = next(servers)
    try:
        text, count = _long_input(server.base_url)
        assert 512 < count < 1024, count
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        answer = client.embeddings.create(model="demo", input=[text, "a short one"])
        assert [len(item.embedding) for item in answer.data] == [width, width]
        assert answer.usage.prompt_tokens >= count
    finally:
        servers.close()
    # the same server without the raised batch refuses it, in its own words: the flag is what makes the difference
    flags = task_args("llama.cpp", "embedding", 1024, [], model)
    bare = flags[:flags.index("--ubatch-size")]
    servers = _server(llama_install, model, bare)
    server = next(servers)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        with pytest.raises(openai.APIStatusError, match="too large to process. increase the physical batch size"):
            client.embeddings.create(model="demo", input=text)
    finally:
        servers.close()


# --- models.yaml: a chat model and an embedder on one endpoint ----------------------------------------------------
def test_kind_is_read_written_and_refused_with_the_allowed_values(tmp_path: Path) -> None:
    from desktop.core.serving.fleet import parse_models_config
    from desktop.core.serving.models_file import dump_models_yaml

    config = parse_models_config({"models": [{"name": "chat", "engine": "llama.cpp", "model": "demo"},
                                             {"name": "embed", "engine": "llama.cpp", "model": "demo",
                                              "kind": "embedding"}]})
    assert [e.kind for e in config.models] == ["chat", "embedding"]
    text = dump_models_yaml(config)
    assert "kind: embedding" in text and text.count("kind:") == 1  # a chat entry stays as short as before
    with pytest.raises(SwitchyardError, match=r"\('embed'\): kind must be one of chat, embedding, rerank, not 'vector'"):
        parse_models_config({"models": [{"name": "embed", "engine": "llama.cpp", "model": "demo", "kind": "vector"}]})


@pytest.mark.engine
@pytest.mark.llamacpp
def test_a_chat_model_and_an_embedder_answer_through_one_endpoint(llama_install: Any, demo_model: Any,
                                                                 tmp_path: Path) -> None:
    """The issue's check: models.yaml with a chat entry and an `embedding` entry on the generated GGUF; the openai
    SDK's embeddings.create through the endpoint returns vectors of the model's embedding width from the real
    llama-server, an input longer than its default batch included, while chat keeps answering."""
    import gguf
    import openai

    from desktop.core.runtime.ports import find_free_port
    from desktop.core.serving.endpoint import make_launcher
    from desktop.core.serving.fleet import Fleet, load_models_config
    from desktop.core.serving.proxy import ProxyServer

    width = gguf.GGUFReader(Path(demo_model.gguf_path)).fields["llama.embedding_length"].contents()
    config_file = tmp_path / "models.yaml"
    config_file.write_text("models:\n"
                           "  - {name: chat, engine: llama.cpp, model: demo, ctx: 1024, parallel: 1}\n"
                           "  - {name: embed, engine: llama.cpp, model: demo, ctx: 1024, parallel: 1, kind: embedding}\n")
    proxy = ProxyServer(port=find_free_port(), wait_timeout=300)
    proxy.start()
    fleet = Fleet(proxy, load_models_config(config_file), launcher=make_launcher(), ready_timeout=300)
    try:
        fleet.start()
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        text = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
        vectors = client.embeddings.create(model="embed", input=[text, "short"])
        assert [len(item.embedding) for item in vectors.data] == [width, width]
        assert vectors.usage.prompt_tokens > 512  # longer than llama-server's default physical batch
        answer = client.chat.completions.create(model="chat", max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": "Say hi"}])
        assert answer.choices[0].message.content
        with pytest.raises(openai.BadRequestError, match="'chat' is a chat model and serves no embeddings; ask "
                                                         "embed instead"):
            client.embeddings.create(model="chat", input="hello")
        listed = {m["id"]: m["switchyard"]["kind"] for m in httpx.get(proxy.url + "/v1/models").json()["data"]}
        assert listed == {"chat": "chat", "embed": "embedding"}
        import ollama  # an Ollama-speaking app: /api/embed reaches the same embedder

        embedded = ollama.Client(host=proxy.url, trust_env=False, timeout=120).embed(model="embed", input=[text, "short"])
        assert [len(vector) for vector in embedded.embeddings] == [width, width]
        assert proxy.counters["failed"] == 0
    finally:
        fleet.close()
        proxy.stop()


def test_embeddings_asked_of_a_list_without_an_embedder_say_how_to_add_one() -> None:
    from desktop.core.serving.dispatch import wrong_kind
    from desktop.core.serving.fleet import parse_models_config
    from desktop.core.serving.router import Route, Router

    config = parse_models_config({"models": [
        {"name": "chat", "engine": "llama.cpp", "model": "demo"},
        {"name": "old-embedder", "engine": "llama.cpp", "model": "demo", "args": ["--embedding", "--pooling", "cls"]}]})
    router = Router({})
    router.routes = {e.name: Route(info=e.info()) for e in config.models}
    assert router.routes["old-embedder"].info["kind"] == "embedding"  # configured the way it was before `kind`
    assert wrong_kind(router, "old-embedder", router.routes["old-embedder"], "/v1/embeddings") is None
    assert wrong_kind(router, "chat", router.routes["chat"], "/v1/chat/completions") is None
    assert wrong_kind(router, "chat", router.routes["chat"], "/v1/embeddings") == \
        "'chat' is a chat model and serves no embeddings; ask old-embedder instead"
    router.routes.pop("old-embedder")
    said = wrong_kind(router, "chat", router.routes["chat"], "/v1/rerank")
    assert said is not None and said.startswith("'chat' is a chat model and serves no reranking; add a models.yaml "
                                                "entry with `kind: rerank`"), said


@pytest.mark.gui
@pytest.mark.qt_log_ignore("propagateSizeHints")
def test_the_models_editor_offers_the_kind_and_keeps_what_it_does_not_edit(qtbot: Any, tmp_path: Path) -> None:
    """An embedder added in the editor is saved as the CLI reads it; editing an entry keeps its args (the dialog
    used to drop every key it has no field for)."""
    from desktop.core.serving.fleet import load_models_config
    from desktop.ui.models_editor import ModelsEditor

    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - {name: chat, engine: llama.cpp, model: demo, args: [--n-cpu-moe, '2']}\n",
                    encoding="utf-8")
    editor = ModelsEditor()
    qtbot.addWidget(editor)
    assert editor.load(str(path))
    dialog = editor.add(modal=False)
    dialog.name_edit.setText("embed")
    dialog.kind_box.setCurrentIndex(dialog.kind_box.findData("embedding"))
    assert dialog.try_accept()
    editor.table.selectRow(0)
    edit = editor.edit_selected(modal=False)
    edit.ctx_spin.setValue(1024)
    assert edit.try_accept()
    editor.path_edit.setText(str(path))
    assert editor.save()
    saved = {e.name: e for e in load_models_config(path).models}
    assert saved["embed"].kind == "embedding" and saved["chat"].kind == "chat"
    assert saved["chat"].args == ("--n-cpu-moe", "2") and saved["chat"].ctx == 1024
