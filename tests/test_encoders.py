"""Encoder models (issue 57): BERT-like embedders and cross-encoder rerankers are read and sized, refused as chat
models with the way to serve them, counted in a fleet's memory budget and switched with their kind's flags.

Expected values come from outside the code under test: bert-base-uncased's parameter count by hand (109,482,240:
embeddings 23,837,184 + 12 layers x 7,087,872 + pooler 590,592, biases included, the count `BertModel` reports), the
tiny checkpoints' tensors as written (tests/tiny_encoders.py), llama.cpp's own choice to build BERT without a KV
cache (llama-model.cpp create_memory), vLLM's own crash with a prefix cache on an encoder (its scheduler's
"requires at least one cacheable group")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from tiny_encoders import bert_config, bert_params, write_bert

from desktop.core.common.errors import ModelError, SwitchyardError
from desktop.core.machine.hardware import HardwareSnapshot
from desktop.core.models.facts import facts_from_config, facts_from_gguf, facts_from_path
from desktop.core.planning.planner import plan_launch

SNAPSHOTS = Path(__file__).parent / "snapshots"
CPU = HardwareSnapshot.load(SNAPSHOTS / "cpu_laptop.json")
GPU = HardwareSnapshot.load(SNAPSHOTS / "rtx4090.json")

BERT_BASE = {  # bert-base-uncased's config.json as the Hub serves it
    "architectures": ["BertForMaskedLM"], "attention_probs_dropout_prob": 0.1, "gradient_checkpointing": False,
    "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 768, "initializer_range": 0.02,
    "intermediate_size": 3072, "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert",
    "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 0, "position_embedding_type": "absolute",
    "transformers_version": "4.6.0.dev0", "type_vocab_size": 2, "use_cache": True, "vocab_size": 30522,
}


def test_a_bert_config_is_read_as_an_encoder_and_counted_by_hand() -> None:
    facts = facts_from_config({**BERT_BASE, "architectures": ["BertModel"]})
    assert facts.encoder and not facts.scores
    assert facts.params == 109_482_240  # 23,837,184 + 12 x 7,087,872 + 590,592
    assert facts.weights_bytes == 109_482_240 * 2  # no torch_dtype: served in 16 bits
    reranker = facts_from_config(bert_config(classifier=True))
    assert reranker.encoder and reranker.scores
    assert reranker.params == bert_params(classifier=True)
    assert facts_from_config(bert_config()).params == bert_params()


def test_models_that_are_neither_language_models_nor_text_encoders_are_still_refused() -> None:
    with pytest.raises(ModelError, match="neither a language model nor a text encoder"):
        facts_from_config({"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "d_model": 512,
                           "num_layers": 6, "num_heads": 8})


def _bert_gguf(path: Path, classifier: bool = False) -> Path:
    """A BERT GGUF's header as llama.cpp's converter writes it (a reranker's with its cls.output head)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(2)
    writer.add_embedding_length(32)
    writer.add_head_count(4)
    writer.add_context_length(512)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.RANK if classifier else gguf.PoolingType.MEAN)
    writer.add_tensor("token_embd.weight", np.zeros((100, 32), dtype=np.float32))
    if classifier:
        writer.add_tensor("cls.output.weight", np.zeros((1, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_encoder_holds_no_kv_cache_on_either_engine(tmp_path: Path) -> None:
    folder = write_bert(tmp_path / "tiny-bert")
    checked = plan_launch("vllm", str(folder), CPU, {"extra_args": ("--runner", "pooling"), "ctx_per_request": 512})
    assert checked.fit.breakdown["bytes.kv_cache"] == 0
    gguf_file = _bert_gguf(tmp_path / "bert.gguf")
    checked = plan_launch("llama.cpp", str(gguf_file), CPU, {"extra_args": ("--embeddings",), "ctx_per_request": 512})
    assert checked.fit.breakdown["bytes.kv_cache"] == 0
    decoder = plan_launch("llama.cpp", "demo", CPU, {"extra_args": ("--embeddings",), "ctx_per_request": 512})
    assert decoder.fit.breakdown["bytes.kv_cache"] > 0  # a decoder embedder still has its cache
    on_gpu = plan_launch("vllm", str(folder), GPU, {"extra_args": ("--runner", "pooling"), "ctx_per_request": 512})
    assert on_gpu.fit.fits == "yes" and on_gpu.fit.breakdown["bytes.kv_cache"] == 0
    # vLLM takes gpu_memory_utilization x total and would fill it with KV: an encoder asks for what it uses, so a
    # chat model fits beside it (the budget reads the same number)
    chat = plan_launch("vllm", "demo", GPU, {"ctx_per_request": 512})
    assert on_gpu.plan.gpu_memory_utilization is not None and chat.plan.gpu_memory_utilization is not None
    assert on_gpu.plan.gpu_memory_utilization < 0.2 < chat.plan.gpu_memory_utilization


def test_a_bert_gguf_is_an_encoder_the_way_llama_cpp_builds_it(tmp_path: Path) -> None:
    facts = facts_from_gguf(_bert_gguf(tmp_path / "embedder.gguf"))
    assert facts.encoder and not facts.scores
    reranker = facts_from_gguf(_bert_gguf(tmp_path / "reranker.gguf", classifier=True))
    assert reranker.encoder and reranker.scores


def test_an_encoder_served_as_a_chat_model_is_refused_with_the_way_to_serve_it(tmp_path: Path) -> None:
    embedder = write_bert(tmp_path / "embedder")
    reranker = write_bert(tmp_path / "reranker", classifier=True)
    with pytest.raises(SwitchyardError) as refused:
        plan_launch("vllm", str(embedder), CPU, {"ctx_per_request": 512})
    assert "is a text encoder (BertModel): it embeds text and cannot chat" in refused.value.message
    assert "kind: embedding" in refused.value.hint and "--runner pooling" in refused.value.hint
    with pytest.raises(SwitchyardError) as refused:
        plan_launch("vllm", str(reranker), CPU, {"ctx_per_request": 512})
    assert "it scores (reranks) text" in refused.value.message and "kind: rerank" in refused.value.hint
    with pytest.raises(SwitchyardError) as refused:
        plan_launch("llama.cpp", str(_bert_gguf(tmp_path / "rerank.gguf", classifier=True)), CPU,
                    {"ctx_per_request": 512})
    assert "kind: rerank" in refused.value.hint and "--reranking" in refused.value.hint


def test_an_encoders_vllm_plan_turns_the_prefix_cache_off(tmp_path: Path) -> None:
    """vLLM's scheduler fails on an encoder with --enable-prefix-caching (no cacheable KV group); the plan says
    --no-enable-prefix-caching, and a chat model keeps the cache on."""
    from desktop.core.engines import get_adapter
    from desktop.core.engines.base import EngineInstall

    folder = write_bert(tmp_path / "embedder")
    plan = plan_launch("vllm", str(folder), CPU, {"extra_args": ("--runner", "pooling"), "ctx_per_request": 512}).plan
    adapter = get_adapter("vllm")
    argv = adapter.build_command(plan, EngineInstall("vllm", "0", "cache", Path("/usr/bin/python3"))).argv
    assert "--no-enable-prefix-caching" in argv and "--enable-prefix-caching" not in argv
    assert argv[-2:] == ["--runner", "pooling"]
    chat = plan_launch("vllm", "demo", CPU, {"ctx_per_request": 512}).plan
    assert "--enable-prefix-caching" in adapter.build_command(chat, EngineInstall(
        "vllm", "0", "cache", Path("/usr/bin/python3"))).argv


def test_a_models_yaml_embedder_on_a_bert_folder_plans_on_both_engines(tmp_path: Path) -> None:
    from desktop.core.serving.fleet import parse_models_config, plan_models

    folder = write_bert(tmp_path / "embedder")
    config = parse_models_config({"models": [
        {"name": "chat", "engine": "llama.cpp", "model": "demo", "ctx": 512},
        {"name": "embed", "engine": "vllm", "model": str(folder), "ctx": 512, "kind": "embedding"}]})
    plans = plan_models(config, CPU)
    assert plans["embed"].plan.extra_args[:2] == ("--runner", "pooling")
    assert plans["embed"].fit.kv_cache_gib == 0
    assert facts_from_path(folder).encoder


def _fleet_config(**embed: Any) -> Any:
    from desktop.core.serving.fleet import parse_models_config

    return parse_models_config({"models": [
        {"name": "chat", "engine": "llama.cpp", "model": "demo", "ctx": 512, "parallel": 1},
        {"name": "embed", "engine": "llama.cpp", "model": "demo", "ctx": 512, "parallel": 1, "kind": "embedding",
         **embed}]}, "test.yaml")


def test_the_fleet_budget_counts_an_embedder_beside_the_chat_model(tmp_path: Path) -> None:
    """With room for one engine, a request for the embedder stops the chat model first and the next chat
    request stops the embedder: the embedder is in the budget like any model. On a GPU machine its need comes
    from the fit (weights and compute, no KV cache beyond its context)."""
    from test_fleet import standin_launcher

    from desktop.core.runtime.ports import find_free_port
    from desktop.core.serving.endpoint import MemoryBudget
    from desktop.core.serving.fleet import Fleet, plan_models
    from desktop.core.serving.proxy import ProxyServer

    real = MemoryBudget(float(GPU.gpus[0].memory_free_bytes), hardware=GPU)
    plans = plan_models(_fleet_config(), GPU)
    assert real.need_of(plans["embed"].plan).gpu_total > 0

    proxy = ProxyServer(port=find_free_port(), wait_timeout=60)
    proxy.start()
    budget = MemoryBudget(free_bytes=1.5, need=lambda plan: 1.0)  # one engine fits, two do not
    fleet = Fleet(proxy, _fleet_config(), hardware=CPU, launcher=standin_launcher(tmp_path, lambda plan: ["--embeds"]), ready_timeout=60,
                  budget=budget)
    try:
        fleet.start()
        assert fleet.lanes["chat"].loaded and not fleet.lanes["embed"].loaded  # it did not fit beside chat
        vectors = httpx.post(proxy.url + "/v1/embeddings", json={"model": "embed", "input": ["a", "bb"]},
                             timeout=60, trust_env=False)
        assert vectors.status_code == 200, vectors.text
        assert [d["embedding"][0] for d in vectors.json()["data"]] == [1.0, 2.0]
        assert fleet.lanes["embed"].loaded and not fleet.lanes["chat"].loaded
        answer = httpx.post(proxy.url + "/v1/completions", json={"model": "chat", "prompt": "hi", "max_tokens": 4},
                            timeout=60, trust_env=False)
        assert answer.status_code == 200, answer.text
        assert fleet.lanes["chat"].loaded and not fleet.lanes["embed"].loaded
        assert proxy.counters["failed"] == 0
    finally:
        fleet.close()
        proxy.stop()


def test_an_embedder_switched_to_the_other_engine_keeps_serving_embeddings(tmp_path: Path) -> None:
    """A switch plans the other engine from the entry's kind: the demo embedder on llama.cpp moves to vLLM with
    --runner pooling (the entry's own llama-server args stay behind), and back with --embeddings."""
    from test_fleet import standin_launcher

    from desktop.core.runtime.ports import find_free_port
    from desktop.core.serving.fleet import Fleet
    from desktop.core.serving.proxy import ProxyServer

    proxy = ProxyServer(port=find_free_port(), wait_timeout=60)
    proxy.start()
    fleet = Fleet(proxy, _fleet_config(args=["--pooling", "last"]), hardware=CPU,
                  launcher=standin_launcher(tmp_path, lambda plan: ["--embeds"]), ready_timeout=60)
    try:
        start = fleet.lanes["embed"].plan
        assert start is not None and "--embeddings" in start.extra_args and "last" in start.extra_args
        to_vllm = json.dumps(fleet.switch_preview("vllm", name="embed"))
        assert '"--runner", "pooling"' in to_vllm and "--embeddings" not in to_vllm and "last" not in to_vllm
        fleet.load("embed")
        fleet.switch("vllm", name="embed")
        vectors = httpx.post(proxy.url + "/v1/embeddings", json={"model": "embed", "input": "abc"}, timeout=60,
                             trust_env=False)
        assert vectors.status_code == 200 and vectors.json()["model"].startswith("vllm:"), vectors.text
        back = json.dumps(fleet.switch_preview("llama.cpp", name="embed"))
        assert '"--embeddings"' in back and "--runner" not in back
    finally:
        fleet.close()
        proxy.stop()


def test_an_embedder_is_never_autopilot_switched(tmp_path: Path) -> None:
    """The hybrid endpoint (the only autopilot) refuses an embedder's flags and an encoder; a models list, where
    `kind` lives, runs no autopilot on any lane."""
    from test_fleet import standin_launcher

    from desktop.core.runtime.ports import find_free_port
    from desktop.core.serving.autopilot import plan_hybrid
    from desktop.core.serving.fleet import Fleet
    from desktop.core.serving.proxy import ProxyServer

    with pytest.raises(SwitchyardError, match="never autopilot-switched"):
        plan_hybrid("demo", CPU, {"extra_args": ("--embeddings",)})
    with pytest.raises(SwitchyardError, match="is a text encoder"):
        plan_hybrid(str(write_bert(tmp_path / "embedder")), CPU, {})
    proxy = ProxyServer(port=find_free_port(), wait_timeout=60)
    proxy.start()
    fleet = Fleet(proxy, _fleet_config(), hardware=CPU, launcher=standin_launcher(tmp_path, lambda plan: ["--embeds"]), ready_timeout=60)
    try:
        assert [lane.autopilot for lane in fleet.lanes.values()] == [None, None]
    finally:
        fleet.close()
        proxy.stop()


@pytest.mark.engine
@pytest.mark.vllm
def test_a_bert_embedder_and_a_cross_encoder_reranker_on_the_real_vllm_beside_a_chat_model(
        llama_install: Any, vllm_install: Any, demo_model: Any, tmp_path: Path) -> None:
    """The two most used retrieval models in the Hub cache's layout (a BertModel embedder, a
    BertForSequenceClassification cross-encoder, pulled from a stand-in Hub), served by the real vLLM's pooling runner behind the endpoint
    beside the real llama-server's chat: the openai SDK's embeddings.create returns vectors of the config's
    hidden_size, /v1/rerank ranks every document, chat keeps answering, and the models list says who does what."""
    import openai
    from test_hub_pull_serve import pull

    from desktop.core.runtime.ports import find_free_port
    from desktop.core.serving.endpoint import make_launcher
    from desktop.core.serving.fleet import Fleet, load_models_config
    from desktop.core.serving.proxy import ProxyServer

    def pulled(repo: str, classifier: bool) -> Path:  # `switchyard pull` from a stand-in Hub: the cache's layout
        folder = write_bert(tmp_path / "src" / repo, classifier=classifier)
        snapshot, _ = pull(tmp_path, repo, {f.name: f for f in folder.iterdir()})
        assert snapshot.parent.name == "snapshots" and (snapshot / "model.safetensors").is_symlink()
        return snapshot

    embedder = pulled("sentence-transformers/all-MiniLM-tiny", classifier=False)
    reranker = pulled("cross-encoder/ms-marco-tiny", classifier=True)
    width = json.loads((embedder / "config.json").read_text())["hidden_size"]
    config_file = tmp_path / "models.yaml"
    config_file.write_text("models:\n"
                           "  - {name: chat, engine: llama.cpp, model: demo, ctx: 1024, parallel: 1}\n"
                           f"  - {{name: embed, engine: vllm, model: '{embedder}', ctx: 512, parallel: 2, "
                           "kind: embedding, args: ['--enforce-eager']}\n"  # no torch.compile: sooner
                           f"  - {{name: rerank, engine: vllm, model: '{reranker}', ctx: 512, parallel: 2, "
                           "kind: rerank, args: ['--enforce-eager']}\n")
    proxy = ProxyServer(port=find_free_port(), wait_timeout=600)
    proxy.start()
    fleet = Fleet(proxy, load_models_config(config_file), launcher=make_launcher(), ready_timeout=600)
    try:
        fleet.start()
        for name, route in (("embed", "/v1/embeddings"), ("rerank", "/v1/rerank")):
            # the cold start's first request was the lane's own kind (a pooling server answers no completion),
            # as the engine's own access log says before any request of this test
            active = fleet.lanes[name].active
            assert active is not None
            log = Path(active.process.log_path).read_text(encoding="utf-8", errors="replace")
            assert f'"POST {route} HTTP/1.1" 200' in log and "/v1/completions" not in log, log[-2000:]
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        vectors = client.embeddings.create(model="embed", input=["the quick brown fox", "paris is the capital"])
        assert [len(item.embedding) for item in vectors.data] == [width, width]
        assert vectors.data[0].embedding != vectors.data[1].embedding
        documents = ["paris is the capital of france", "the fox jumps over the dog", "rain today"]
        ranked = httpx.post(proxy.url + "/v1/rerank", json={"model": "rerank", "query": "capital of france",
                                                            "documents": documents}, timeout=120, trust_env=False)
        assert ranked.status_code == 200, ranked.text
        results = ranked.json()["results"]
        assert sorted(r["index"] for r in results) == [0, 1, 2]
        scores = [r["relevance_score"] for r in results]
        assert scores == sorted(scores, reverse=True)  # best first, as Cohere's and Jina's rerank APIs answer
        answer = client.chat.completions.create(model="chat", max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": "Say hi"}])
        assert answer.choices[0].message.content
        listed = {m["id"]: m["switchyard"]["kind"] for m in httpx.get(proxy.url + "/v1/models").json()["data"]}
        assert listed == {"chat": "chat", "embed": "embedding", "rerank": "rerank"}
        assert proxy.counters["failed"] == 0
    finally:
        fleet.close()
        proxy.stop()
