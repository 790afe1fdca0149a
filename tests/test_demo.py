"""The embedded demo model: deterministic, cached, and the same weights and tokenizer in GGUF and safetensors."""

from __future__ import annotations

import hashlib
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from desktop.core.common.errors import SwitchyardError
from desktop.core.common.progress import ProgressEvent
from desktop.core.models import demo

# The greedy continuations (16 tokens) both real engines returned for the agreement test's prompts.
GREEDY_CONTINUATIONS = {
    "The capital of France is": [
        675,
        504,
        399,
        677,
        450,
        262,
        623,
        73,
        287,
        602,
        368,
        380,
        263,
        67,
        541,
        355,
    ],
    "Once upon a time": [73, 321, 415, 688, 436, 273, 651, 549, 695, 41, 741, 328, 458, 13, 735, 286],
    "def fibonacci(n):": [629, 674, 302, 712, 417, 535, 31, 528, 294, 538, 439, 517, 49, 329, 73, 287],
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> demo.DemoModel:
    return demo.ensure_demo_model(root=tmp_path_factory.mktemp("demo") / demo.DEMO_VERSION)


@pytest.fixture(scope="module")
def reader(model: demo.DemoModel) -> gguf.GGUFReader:
    return gguf.GGUFReader(model.gguf_path)


@pytest.fixture(scope="module")
def hf_weights(model: demo.DemoModel) -> dict[str, npt.NDArray[np.float32]]:
    return load_file(str(model.hf_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def hf_config(model: demo.DemoModel) -> dict[str, object]:
    config: dict[str, object] = json.loads((model.hf_dir / "config.json").read_text())
    return config


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digests(model: demo.DemoModel) -> tuple[str, str]:
    return _digest(model.gguf_path), _digest(model.hf_dir / "model.safetensors")


@pytest.fixture(scope="module")
def model_digests(model: demo.DemoModel) -> tuple[str, str]:
    return _digests(model)


def _field(reader: gguf.GGUFReader, key: str) -> object:
    field = reader.get_field(key)
    assert field is not None, f"GGUF lacks {key}"
    return field.contents()


def test_model_layout_and_size(model: demo.DemoModel) -> None:
    assert model.gguf_path.is_file()
    assert model.path_for("gguf") == model.gguf_path
    assert model.path_for("hf") == model.hf_dir
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (model.hf_dir / name).is_file(), name
    assert 10_000_000 < model.parameters < 100_000_000
    as_json = model.to_json()
    assert as_json["parameters"] == model.parameters
    assert as_json["gguf_path"] == str(model.gguf_path)
    json.dumps(as_json)


def test_generation_is_deterministic_and_cached(
    model: demo.DemoModel, model_digests: tuple[str, str], tmp_path: Path
) -> None:
    events: list[ProgressEvent] = []
    again = demo.ensure_demo_model(events.append, root=tmp_path / "again")
    assert events and events[-1].fraction == 1.0
    assert _digests(again) == model_digests
    assert (again.hf_dir / "tokenizer.json").read_bytes() == (model.hf_dir / "tokenizer.json").read_bytes()

    stamp = again.gguf_path.stat().st_mtime_ns
    events.clear()
    cached = demo.ensure_demo_model(events.append, root=tmp_path / "again")
    assert cached == again
    assert events == []  # nothing regenerated
    assert cached.gguf_path.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".again.tmp")] == []


def test_default_root_lives_in_the_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_CACHE_DIR", str(tmp_path))
    assert demo.default_root() == tmp_path / "demo" / demo.DEMO_VERSION


@pytest.mark.parametrize("damage", ["truncate_gguf", "delete_safetensors", "no_manifest", "old_version"])
def test_damaged_cache_is_regenerated(model_digests: tuple[str, str], tmp_path: Path, damage: str) -> None:
    root = tmp_path / "cache"
    first = demo.ensure_demo_model(root=root)
    if damage == "truncate_gguf":
        with first.gguf_path.open("r+b") as handle:
            handle.truncate(1000)
    elif damage == "delete_safetensors":
        (first.hf_dir / "model.safetensors").unlink()
    elif damage == "no_manifest":
        (root / demo.MANIFEST_NAME).unlink()
    else:
        manifest = json.loads((root / demo.MANIFEST_NAME).read_text())
        manifest["version"] = "0"
        (root / demo.MANIFEST_NAME).write_text(json.dumps(manifest))
    events: list[ProgressEvent] = []
    repaired = demo.ensure_demo_model(events.append, root=root)
    assert events, "a damaged cache must be regenerated"
    assert _digests(repaired) == model_digests


def test_concurrent_callers_generate_once(model_digests: tuple[str, str], tmp_path: Path) -> None:
    events: list[ProgressEvent] = []
    root = tmp_path / demo.DEMO_VERSION
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: demo.ensure_demo_model(events.append, root=root), range(2)))
    assert results[0] == results[1]
    assert len([e for e in events if e.fraction == 1.0 and "ready" in e.message]) == 1
    assert _digests(results[0]) == model_digests


def test_leftovers_of_a_crashed_generation_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / f".{demo.DEMO_VERSION}.tmp-crashed"
    stale.mkdir()
    (stale / demo.GGUF_NAME).write_bytes(b"GGUF half")
    model = demo.ensure_demo_model(root=tmp_path / demo.DEMO_VERSION)
    assert not stale.exists()
    assert model.gguf_path.stat().st_size > 1000


def test_failed_generation_leaves_nothing_ready(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(*_args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(demo, "write_hf", crash)
    root = tmp_path / "demo"
    with pytest.raises(SwitchyardError, match="could not write the demo model"):
        demo.ensure_demo_model(root=root)
    assert not root.exists()
    assert [p for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_gguf_metadata(reader: gguf.GGUFReader, hf_config: dict[str, object]) -> None:
    expected = {
        "general.architecture": "llama",
        "llama.context_length": 4096,
        "llama.embedding_length": 512,
        "llama.block_count": 8,
        "llama.feed_forward_length": 1536,
        "llama.attention.head_count": 8,
        "llama.attention.head_count_kv": 4,
        "llama.rope.dimension_count": 64,
        "llama.vocab_size": hf_config["vocab_size"],
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": demo.CHAT_TEMPLATE,
    }
    for key, value in expected.items():
        assert _field(reader, key) == value, key
    assert _field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert _field(reader, "llama.rope.freq_base") == pytest.approx(10000.0)


def test_gguf_tensor_shapes(reader: gguf.GGUFReader, hf_config: dict[str, object]) -> None:
    vocab = int(str(hf_config["vocab_size"]))
    shapes = {tensor.name: tuple(int(n) for n in tensor.shape) for tensor in reader.tensors}  # ggml order
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    assert shapes["token_embd.weight"] == (512, vocab)
    assert shapes["output.weight"] == (512, vocab)
    assert shapes["output_norm.weight"] == (512,)
    for layer in range(8):
        block = f"blk.{layer}"
        assert shapes[f"{block}.attn_norm.weight"] == (512,)
        assert shapes[f"{block}.attn_q.weight"] == (512, 512)
        assert shapes[f"{block}.attn_k.weight"] == (512, 256)
        assert shapes[f"{block}.attn_v.weight"] == (512, 256)
        assert shapes[f"{block}.attn_output.weight"] == (512, 512)
        assert shapes[f"{block}.ffn_norm.weight"] == (512,)
        assert shapes[f"{block}.ffn_gate.weight"] == (512, 1536)
        assert shapes[f"{block}.ffn_up.weight"] == (512, 1536)
        assert shapes[f"{block}.ffn_down.weight"] == (1536, 512)
    assert len(shapes) == 3 + 8 * 9


def test_gguf_tokenizer_matches_tokenizer_json(reader: gguf.GGUFReader, model: demo.DemoModel) -> None:
    tokenizer_json = json.loads((model.hf_dir / "tokenizer.json").read_text())
    vocab = {
        **tokenizer_json["model"]["vocab"],
        **{t["content"]: t["id"] for t in tokenizer_json["added_tokens"]},
    }
    by_id = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    assert _field(reader, "tokenizer.ggml.tokens") == by_id
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    assert _field(reader, "tokenizer.ggml.merges") == merges
    types = _field(reader, "tokenizer.ggml.token_type")
    assert isinstance(types, list)
    assert types[:2] == [gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    assert set(types[2:]) == {gguf.TokenType.NORMAL}
    assert by_id[:2] == ["<s>", "</s>"]
    assert len(by_id) > 256 + 2 + 300  # bytes, specials and a few hundred merges

    config = json.loads((model.hf_dir / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<s>", "</s>")
    assert config["chat_template"] == demo.CHAT_TEMPLATE


def test_tokenizer_round_trips_and_prepends_bos(model: demo.DemoModel) -> None:
    tokenizer = Tokenizer.from_file(str(model.hf_dir / "tokenizer.json"))
    text = "Hello, world!  Two spaces,\nnew lines and ümlauts 日本."
    ids = tokenizer.encode(text).ids
    assert ids[0] == 0
    assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode(" the capital").ids) == 3  # merged words, not bytes


def test_hf_weights_equal_gguf_weights(
    reader: gguf.GGUFReader, hf_weights: dict[str, npt.NDArray[np.float32]]
) -> None:
    gguf_tensors = {tensor.name: np.asarray(tensor.data) for tensor in reader.tensors}
    assert len(gguf_tensors) == len(hf_weights)
    for hf_name, hf_tensor in hf_weights.items():
        stored = gguf_tensors[demo.gguf_tensor_name(hf_name)].reshape(hf_tensor.shape)
        if hf_name.endswith("q_proj.weight"):
            stored = demo.unpermute_from_llamacpp(stored, demo.NUM_HEADS)
        elif hf_name.endswith("k_proj.weight"):
            stored = demo.unpermute_from_llamacpp(stored, demo.NUM_KV_HEADS)
        assert hf_tensor.dtype == np.float32, hf_name
        np.testing.assert_array_equal(stored, hf_tensor, err_msg=hf_name)


def test_permutation_is_llamacpps_and_invertible() -> None:
    weights = np.arange(64 * 4 * 3, dtype=np.float32).reshape(64 * 4, 3)
    permuted = demo.permute_for_llamacpp(weights, 4)
    # llama.cpp interleaves each head's two rotary halves: row 2i is half-1 row i, row 2i+1 is half-2 row i.
    np.testing.assert_array_equal(permuted[0], weights[0])
    np.testing.assert_array_equal(permuted[1], weights[32])
    np.testing.assert_array_equal(permuted[2], weights[1])
    np.testing.assert_array_equal(demo.unpermute_from_llamacpp(permuted, 4), weights)


def test_config_is_a_llama_vllm_accepts(hf_config: dict[str, object]) -> None:
    assert hf_config["architectures"] == ["LlamaForCausalLM"]
    assert hf_config["head_dim"] == 64
    assert hf_config["num_key_value_heads"] == 4
    assert hf_config["tie_word_embeddings"] is False
    assert hf_config["torch_dtype"] == "float32"


# --- a numpy reference of the Hugging Face Llama forward pass ------------------------------------------------


def _reference_logits(weights: dict[str, npt.NDArray[np.float32]], ids: list[int]) -> npt.NDArray[np.float32]:
    """Logits at every position, computed like transformers' LlamaForCausalLM (rotate-half RoPE, GQA)."""
    heads, kv_heads, head_dim, eps = demo.NUM_HEADS, demo.NUM_KV_HEADS, demo.HEAD_DIM, demo.RMS_NORM_EPS
    length = len(ids)

    def rms_norm(x: npt.NDArray[np.float32], weight: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        normed: npt.NDArray[np.float32] = (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)) * weight
        return normed

    inv_freq = 1.0 / (demo.ROPE_THETA ** (np.arange(0, head_dim, 2) / head_dim))
    angles = np.outer(np.arange(length), inv_freq)
    cos = np.cos(np.concatenate([angles, angles], -1))[:, None, :].astype(np.float32)
    sin = np.sin(np.concatenate([angles, angles], -1))[:, None, :].astype(np.float32)

    def rope(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        rotated = np.concatenate([-x[..., head_dim // 2 :], x[..., : head_dim // 2]], -1)
        embedded: npt.NDArray[np.float32] = x * cos + rotated * sin
        return embedded

    mask = np.triu(np.full((length, length), -np.inf, dtype=np.float32), 1)
    x = weights["model.embed_tokens.weight"][ids]
    for layer in range(demo.NUM_LAYERS):
        w = {
            name.split(f"layers.{layer}.", 1)[1]: t
            for name, t in weights.items()
            if f"layers.{layer}." in name
        }
        h = rms_norm(x, w["input_layernorm.weight"])
        q = rope((h @ w["self_attn.q_proj.weight"].T).reshape(length, heads, head_dim))
        k = rope((h @ w["self_attn.k_proj.weight"].T).reshape(length, kv_heads, head_dim))
        v = (h @ w["self_attn.v_proj.weight"].T).reshape(length, kv_heads, head_dim)
        k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(head_dim) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        attention = np.einsum("hts,shd->thd", scores, v).reshape(length, heads * head_dim)
        x = x + attention @ w["self_attn.o_proj.weight"].T
        h = rms_norm(x, w["post_attention_layernorm.weight"])
        gate, up = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * up) @ w["mlp.down_proj.weight"].T
    result: npt.NDArray[np.float32] = rms_norm(x, weights["model.norm.weight"]) @ weights["lm_head.weight"].T
    return result


def test_greedy_choices_have_clear_margins(
    model: demo.DemoModel, hf_weights: dict[str, npt.NDArray[np.float32]]
) -> None:
    """The known greedy continuations win every step by far more than engine rounding (~1e-3) moves a logit.

    The expected ids are what both llama-server and vLLM returned for DEMO_VERSION "1"; a change to the
    generator that alters them must bump DEMO_VERSION (and these ids).
    """
    tokenizer = Tokenizer.from_file(str(model.hf_dir / "tokenizer.json"))
    for prompt, expected in GREEDY_CONTINUATIONS.items():
        prompt_ids = tokenizer.encode(prompt).ids
        logits = _reference_logits(hf_weights, prompt_ids + expected[:-1])[len(prompt_ids) - 1 :]
        assert logits.argmax(-1).tolist() == expected, prompt
        top_two = np.sort(logits, -1)[:, -2:]
        margins = top_two[:, 1] - top_two[:, 0]
        assert margins.min() > 0.02, (prompt, margins)
        assert tokenizer.decode(
            expected
        ).isascii()  # no half UTF-8 sequences engines would render differently
