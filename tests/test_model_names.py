"""Every page names a model as the Hub names it (issue 52): `org/name:QUANT` from a real Hub cache layout (a
snapshot folder named by commit hash, files linked to blobs), never the hash or the demo's `hf` folder."""

from __future__ import annotations

from pathlib import Path

from desktop.core.hub.names import DEMO_LABEL, display_name, is_demo


def _snapshot(root: Path, repo: str, files: list[str]) -> Path:
    storage = root / ("models--" + repo.replace("/", "--"))
    snap = storage / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    (storage / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for index, name in enumerate(files):
        blob = storage / "blobs" / f"{index:040x}"
        blob.write_bytes(b"GGUF")
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(blob)
    return snap


def test_a_hub_cache_gguf_is_named_by_repo_and_quantization(tmp_path: Path) -> None:
    snap = _snapshot(tmp_path, "Qwen/Qwen2.5-0.5B-Instruct-GGUF",
                     ["qwen2.5-0.5b-instruct-q4_k_m.gguf", "Q8_0/qwen2.5-0.5b-instruct-q8_0-00001-of-00002.gguf"])
    assert display_name(snap / "qwen2.5-0.5b-instruct-q4_k_m.gguf") == "Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M"
    assert display_name(str(snap / "Q8_0" / "qwen2.5-0.5b-instruct-q8_0-00001-of-00002.gguf")) == \
        "Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q8_0"
    assert display_name(snap) == "Qwen/Qwen2.5-0.5B-Instruct-GGUF"  # a safetensors snapshot folder
    assert "0123456789" not in display_name(snap / "qwen2.5-0.5b-instruct-q4_k_m.gguf")


def test_the_demo_pair_is_named_demo_wherever_it_lives(demo_model) -> None:  # type: ignore[no-untyped-def]
    assert display_name(demo_model.hf_dir) == "demo"  # not "hf"
    assert display_name(demo_model.gguf_path) == "demo"
    assert is_demo("demo") and is_demo(demo_model.hf_dir) and not is_demo("/tmp/other.gguf")
    assert DEMO_LABEL == "demo (random weights: its answers are noise)"
    assert display_name("/data/models/mistral-7b.Q5_K_M.gguf") == "mistral-7b.Q5_K_M.gguf"


def test_a_switch_finds_the_same_download_in_the_other_engines_format(tmp_path: Path) -> None:
    """A repo pulled with its GGUF and its safetensors in one snapshot: llama.cpp's copy is the GGUF, vLLM's the
    snapshot folder (config.json + safetensors); a repo without the other copy, or with several GGUFs, has none."""
    from desktop.core.hub.names import counterpart

    snap = _snapshot(tmp_path, "switchyard/demo-chat", ["demo-chat-F32.gguf", "config.json", "model.safetensors"])
    gguf = snap / "demo-chat-F32.gguf"
    assert counterpart(str(gguf), "vllm") == str(snap)
    assert counterpart(str(snap), "llama.cpp") == str(gguf)
    assert counterpart(str(gguf), "llama.cpp") is None  # already llama.cpp's
    only_gguf = _snapshot(tmp_path, "switchyard/only-GGUF", ["only-Q4_K_M.gguf"])
    assert counterpart(str(only_gguf / "only-Q4_K_M.gguf"), "vllm") is None
    two = _snapshot(tmp_path, "switchyard/two", ["two-Q4_K_M.gguf", "two-Q8_0.gguf", "config.json",
                                                  "model.safetensors"])
    assert counterpart(str(two), "llama.cpp") is None  # which quantization is the person's to pick
    assert counterpart("demo", "vllm") is None  # the demo is one name for both engines already
