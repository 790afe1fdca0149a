"""Model facts from GGUF headers, HF configs/folders, a (loopback fake) Hub, and the demo hook; bad input."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from desktop.core.common.errors import ModelError, SwitchyardError
from desktop.core.models import facts as modelinfo
from desktop.core.models.facts import facts_for, facts_from_config, facts_from_path, read_gguf_header

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32,
            "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
            "vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}


def write_gguf(path: Path, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 96,
               ctx: int = 2048, qtype: str = "f16") -> Path:
    """A small but complete llama GGUF: embeddings, per-layer attention/MLP tensors, output head."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("tiny-test")
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(hidden * 2)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_context_length(ctx)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if qtype == "f16" else gguf.LlamaFileType.ALL_F32)
    dtype = np.float16 if qtype == "f16" else np.float32
    head_dim = hidden // heads

    def add(name: str, shape: tuple[int, ...]) -> None:
        writer.add_tensor(name, np.zeros(shape, dtype=dtype))

    add("token_embd.weight", (vocab, hidden))
    for i in range(layers):
        add(f"blk.{i}.attn_q.weight", (hidden, hidden))
        add(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden))
        add(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden))
        add(f"blk.{i}.attn_output.weight", (hidden, hidden))
        add(f"blk.{i}.ffn_up.weight", (hidden * 2, hidden))
        add(f"blk.{i}.ffn_down.weight", (hidden, hidden * 2))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
    add("output.weight", (vocab, hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_facts_come_from_the_header_and_tensor_table(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", layers=3, hidden=64, heads=4, kv_heads=2, vocab=96, ctx=4096)
    facts = facts_from_path(path)
    assert (facts.architecture, facts.n_layers, facts.hidden_size) == ("llama", 3, 64)
    assert (facts.n_heads, facts.n_kv_heads, facts.head_dim, facts.context_length) == (4, 2, 16, 4096)
    assert facts.vocab_size == 96
    hidden, kv = 64, 2 * 16
    per_layer_f16 = (hidden * hidden * 2 + kv * hidden * 2 + 2 * hidden * 2 * hidden) * 2
    expected = 3 * (per_layer_f16 + hidden * 4) + 2 * 96 * hidden * 2
    assert facts.weights_bytes == expected
    assert facts.tensor_types["F16"] == 2 + 3 * 6 and facts.tensor_types["F32"] == 3
    assert facts.embedding_bytes == 96 * 64 * 2 and facts.has_output_tensor
    assert facts.quantization == "gguf:F16" and facts.is_gguf


def test_reading_a_gguf_never_reads_the_tensor_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_gguf(tmp_path / "m.gguf", layers=2, hidden=256, vocab=4096)
    header_end = path.stat().st_size - 2 * 4096 * 256 * 2  # at least the two big matrices are data
    reads: list[int] = []
    original = modelinfo._BoundedReader.read

    def spy(self: modelinfo._BoundedReader, n: int) -> bytes:
        reads.append(self.pos + n)
        return original(self, n)

    monkeypatch.setattr(modelinfo._BoundedReader, "read", spy)
    read_gguf_header(path)
    assert max(reads) < header_end


def test_truncated_gguf_header_is_a_clear_error(tmp_path: Path) -> None:
    full = write_gguf(tmp_path / "full.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full[:200])
    with pytest.raises(ModelError, match="truncated"):
        facts_from_path(cut)


def test_non_gguf_and_missing_files_are_clear_errors(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelError, match="neither a GGUF"):
        facts_from_path(text)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ModelError, match="not a GGUF"):
        facts_for(str(fake))
    with pytest.raises(ModelError, match="no such file"):
        facts_for(str(tmp_path / "missing.gguf"))


def test_huge_counts_are_refused_without_reading_them(tmp_path: Path) -> None:
    path = tmp_path / "huge.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**62, 2**62))
    start = time.monotonic()
    with pytest.raises(ModelError, match="claims"):
        read_gguf_header(path)
    # a huge string length inside an otherwise sane header
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**40))
    with pytest.raises(ModelError):
        read_gguf_header(path)
    assert time.monotonic() - start < 1.0


@settings(max_examples=300, deadline=1000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=4096), version=st.sampled_from([2, 3, 7]),
       counts=st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)))
def test_random_bytes_never_crash_or_hang_the_header_reader(tmp_path: Path, body: bytes, version: int,
                                                             counts: tuple[int, int]) -> None:
    path = tmp_path / "random.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", version, *counts) + body)
    try:
        modelinfo.facts_from_gguf(path)
    except SwitchyardError:
        pass


def test_config_facts_for_dense_moe_multimodal_and_quantized_models() -> None:
    llama = facts_from_config(LLAMA_8B)
    assert (llama.n_layers, llama.n_kv_heads, llama.head_dim, llama.context_length) == (32, 8, 128, 131072)
    assert 7.9e9 < (llama.params or 0) < 8.2e9  # Llama 3.1 8B has 8.03 B parameters
    moe = facts_from_config({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_hidden_layers": 32,
                             "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                             "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
                             "vocab_size": 32000, "max_position_embeddings": 32768, "sliding_window": None})
    assert moe.is_moe and moe.n_experts_active == 2 and 45e9 < (moe.params or 0) < 48e9  # 46.7 B
    mm = facts_from_config({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                            "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 48, "hidden_size": 3840,
                                            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                                            "intermediate_size": 15360, "vocab_size": 262208,
                                            "max_position_embeddings": 131072, "sliding_window": 1024}})
    assert mm.n_layers == 48 and mm.sliding_window == 1024 and mm.swa_layers == 40
    awq = facts_from_config({**LLAMA_8B, "quantization_config": {"quant_method": "awq", "bits": 4}})
    assert awq.quantization == "awq" and awq.quant_bits == 4.0
    assert (awq.weights_bytes or 0) < 0.4 * (llama.weights_bytes or 1)
    fp8 = facts_from_config({**LLAMA_8B, "quantization_config": {"quant_method": "fp8"}})
    assert fp8.quantization == "fp8" and fp8.quant_bits == 8.0


def test_unsupported_architectures_are_refused() -> None:
    # a BERT encoder is read (issue 57: served as an embedder, tests/test_encoders.py); Whisper is not a text model
    with pytest.raises(ModelError, match="unsupported architecture"):
        facts_from_config({"architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper",
                           "num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12})
    with pytest.raises(ModelError, match="unsupported architecture"):
        facts_from_config({"architectures": ["WeirdNet"], "model_type": "weird"})


def test_hf_folder_uses_exact_safetensors_size(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 16_060_522_496}}))
    facts = facts_for(str(tmp_path))
    assert facts.weights_bytes == 16_060_522_496 and facts.hf_dir == str(tmp_path.resolve())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        facts_for(str(bad))


def test_repo_id_fetches_only_the_config_from_a_loopback_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fakehub import FakeHub

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with FakeHub() as hub:
        hub.add_repo("org/llama-ish", {"config.json": json.dumps(LLAMA_8B).encode(),
                                       "model-00001-of-00001.safetensors": b"\0" * 4096})
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        facts = facts_for("org/llama-ish")
        fetched = [r.path for r in hub.requests if r.method == "GET"]
    assert facts.repo_id == "org/llama-ish" and facts.n_layers == 32
    assert not any("safetensors\"" in p or p.endswith(".safetensors") for p in fetched)
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        with pytest.raises(ModelError):
            facts_for("org/does-not-exist")


def test_demo_uses_the_demo_hook_lazily(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from desktop.core.models import demo

    gguf_path = write_gguf(tmp_path / "demo.gguf")
    monkeypatch.setattr(demo, "ensure_demo_model", lambda *a, **k: SimpleNamespace(gguf_path=gguf_path,
                                                                                    hf_dir=tmp_path / "hf"))
    facts = facts_for("demo")
    assert facts.source == "demo" and facts.n_layers == 2 and facts.hf_dir == str(tmp_path / "hf")
    monkeypatch.delattr(demo, "ensure_demo_model")
    with pytest.raises(SwitchyardError, match="demo model is not available"):
        facts_for("demo")
