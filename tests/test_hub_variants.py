"""Search and variant listing: grouping of quants and shards, fit tags, the recommendation, and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakehub import FakeHub, random_bytes

from desktop.core.common.errors import SwitchyardError
from desktop.core.hub.search import list_variants, search
from desktop.core.hub.variants import RemoteFile, group_variants, tag_and_recommend
from desktop.core.models.quant_names import quant_from_name

SWITCHYARD = [sys.executable, "-m", "desktop"]


def rf(path: str, size: int = 100) -> RemoteFile:
    return RemoteFile(path, size, "0" * 40, "a" * 64)


@pytest.mark.parametrize(
    ("name", "quant"),
    [
        ("Qwen3-8B-Q4_K_M.gguf", "Q4_K_M"),
        ("model.IQ2_XXS.gguf", "IQ2_XXS"),
        ("Q4_K_M/Llama-3.3-70B-Q4_K_M-00001-of-00002.gguf", "Q4_K_M"),
        ("gemma-3-4b-it-BF16.gguf", "BF16"),
        ("phi-4-q8_0.gguf", "Q8_0"),
        ("model.gguf", None),
    ],
)
def test_quant_from_name(name: str, quant: str | None) -> None:
    assert quant_from_name(name) == quant


def test_grouping_shards_quants_safetensors_and_side_files() -> None:
    files = [
        rf("m-Q4_K_M.gguf", 400),
        rf("m-Q8_0-00001-of-00003.gguf", 300),
        rf("m-Q8_0-00003-of-00003.gguf", 100),
        rf("m-Q8_0-00002-of-00003.gguf", 300),
        rf("mmproj-m-f16.gguf", 50),
        rf("model-00001-of-00002.safetensors", 1000),
        rf("model-00002-of-00002.safetensors", 500),
        rf("config.json", 1),
        rf("awq/model.safetensors", 400),
    ]
    variants, others = group_variants(files, safetensors_params={"BF16": 10, "F32": 1})
    by_name = {v.name: v for v in variants}
    assert set(by_name) == {"Q4_K_M", "Q8_0", "safetensors", "awq"}
    q8 = by_name["Q8_0"]
    assert q8.shards == 3 and q8.size_bytes == 700
    assert q8.primary_file == "m-Q8_0-00001-of-00003.gguf"
    assert [f.path for f in q8.files] == sorted(f.path for f in q8.files)
    st = by_name["safetensors"]
    assert (st.engine, st.dtype, st.size_bytes, st.shards, st.primary_file) == ("vllm", "BF16", 1500, 2, "")
    assert by_name["awq"].quantization == "AWQ" and by_name["awq"].primary_file == "awq"
    assert "mmproj-m-f16.gguf" in others and "config.json" in others


def test_safetensors_quant_from_config() -> None:
    variants, _ = group_variants([rf("model.safetensors")], config={"quantization_config": {"quant_method": "gptq"}})
    assert variants[0].quantization == "GPTQ"


def test_recommendation_prefers_best_full_fit_then_smallest_partial() -> None:
    files = [rf("m-Q2_K.gguf", 100), rf("m-Q4_K_M.gguf", 200), rf("m-Q8_0.gguf", 400), rf("m-F16.gguf", 800)]
    variants, _ = group_variants(files)
    tag_and_recommend(variants, lambda engine, size, cfg: "yes" if size <= 800 else "no", None)
    assert [v.name for v in variants if v.recommended] == ["Q8_0"]  # not F16 while a quant fits
    variants, _ = group_variants(files)
    tag_and_recommend(variants, lambda e, size, c: "yes" if size <= 250 else "partial" if size <= 500 else "no", None)
    assert {v.name: v.fit for v in variants} == {"F16": "no", "Q2_K": "yes", "Q4_K_M": "yes", "Q8_0": "partial"}
    assert [v.name for v in variants if v.recommended] == ["Q4_K_M"]
    variants, _ = group_variants(files)
    tag_and_recommend(variants, lambda e, size, c: "partial" if size >= 200 else "no", None)
    assert [v.name for v in variants if v.recommended] == ["Q4_K_M"]
    variants, _ = group_variants(files)
    tag_and_recommend(variants, lambda e, s, c: "no", None)
    assert not any(v.recommended for v in variants)


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SWITCHYARD_NO_KEYRING", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with FakeHub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
        fake.add_repo("bart/Qwen3-8B-GGUF", {
            "Qwen3-8B-Q4_K_M.gguf": random_bytes(4000, 1),
            "Qwen3-8B-Q8_0-00001-of-00002.gguf": random_bytes(4000, 2),
            "Qwen3-8B-Q8_0-00002-of-00002.gguf": random_bytes(3000, 3),
        }, tags=["gguf", "text-generation"], downloads=500, library_name="gguf",
            last_modified="2026-03-01T00:00:00.000Z")
        fake.add_repo("qwen/Qwen3-8B-AWQ", {
            "model.safetensors": random_bytes(6000, 4), "config.json": b'{"a": 1}'},
            tags=["safetensors", "awq"], downloads=900, last_modified="2025-01-01T00:00:00.000Z",
            config={"quantization_config": {"quant_method": "awq"}},
            safetensors={"parameters": {"I32": 100, "F16": 10}, "total": 110})
        fake.add_repo("other/tiny-fp8", {"model.safetensors": random_bytes(2000, 5)}, tags=["safetensors", "fp8"],
                      downloads=10, last_modified="2026-05-01T00:00:00.000Z")
        fake.add_repo("gated/Llama-GGUF", {"m-Q4_K_M.gguf": random_bytes(2000, 6)}, gated=True, tags=["gguf"])
        yield fake


def test_search_filters_and_sorts(hub: FakeHub) -> None:
    assert [h.repo_id for h in search("qwen3")] == ["qwen/Qwen3-8B-AWQ", "bart/Qwen3-8B-GGUF"]
    assert [h.repo_id for h in search("qwen3", formats=["gguf"])] == ["bart/Qwen3-8B-GGUF"]
    assert [h.repo_id for h in search("", formats=["safetensors"], sort="recent")] == [
        "other/tiny-fp8", "qwen/Qwen3-8B-AWQ"]
    hit = search("", formats=["awq"])[0]
    assert hit.formats == ["safetensors", "awq"] and hit.downloads == 900
    with pytest.raises(SwitchyardError, match="Unknown format"):
        search("x", formats=["exl9"])


def test_list_variants_from_fake_hub(hub: FakeHub) -> None:
    result = list_variants("bart/Qwen3-8B-GGUF", tagger=lambda e, size, c: "yes" if size < 5000 else "partial")
    assert result.commit == hub.repos["bart/Qwen3-8B-GGUF"].sha
    by_name = {v.name: v for v in result.variants}
    assert by_name["Q8_0"].shards == 2 and by_name["Q8_0"].size_bytes == 7000 and by_name["Q8_0"].fit == "partial"
    assert by_name["Q4_K_M"].fit == "yes" and by_name["Q4_K_M"].recommended
    awq = list_variants("qwen/Qwen3-8B-AWQ", tagger=lambda e, s, c: "yes").variants
    assert [(v.format, v.engine, v.quantization, v.dtype) for v in awq] == [("safetensors", "vllm", "AWQ", "I32")]


def test_project_fit_module_is_used(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    from desktop.core.machine import hardware
    from desktop.core.planning import fit

    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(fit, "quick_verdict", lambda engine, size, config, hw: calls.append((engine, size)) or "no")
    monkeypatch.setattr(hardware, "detect", lambda: "snapshot")
    result = list_variants("bart/Qwen3-8B-GGUF")
    assert {v.fit for v in result.variants} == {"no"}
    assert sorted(calls) == [("llama.cpp", 4000), ("llama.cpp", 7000)]


def test_cli_search_and_variants_json(hub: FakeHub) -> None:
    env = dict(os.environ)
    out = subprocess.run([*SWITCHYARD, "search", "qwen3", "--gguf", "--json"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [h["repo_id"] for h in json.loads(out.stdout)] == ["bart/Qwen3-8B-GGUF"]
    out = subprocess.run([*SWITCHYARD, "variants", "bart/Qwen3-8B-GGUF", "--json"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {v["name"] for v in data["variants"]} == {"Q4_K_M", "Q8_0"}
    assert all(v["fit"] in ("yes", "partial", "no") for v in data["variants"])
    assert sum(v["recommended"] for v in data["variants"]) <= 1
    out = subprocess.run([*SWITCHYARD, "variants", "gated/Llama-GGUF"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"accept the license at {hub.endpoint}/gated/Llama-GGUF and add a token" in out.stderr
