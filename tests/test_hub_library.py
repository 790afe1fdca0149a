"""The local library: HF cache (ours and other tools'), user-added paths, and delete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakehub import FakeHub, random_bytes, write_tiny_gguf

from desktop.core.common.errors import ModelError
from desktop.core.hub import library
from desktop.core.hub.download import RetryPolicy, pull

SWITCHYARD = [sys.executable, "-m", "desktop"]
FAST = RetryPolicy(attempts=3, base_delay=0.01, stall_timeout=2)
REPO = "demo/tiny-GGUF"


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeHub, Path]]:
    cache_dir = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setenv("SWITCHYARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SWITCHYARD_NO_KEYRING", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        hub.add_repo(REPO, {
            "tiny-Q4_K_M.gguf": write_tiny_gguf(tmp_path / "src" / "a.gguf", n_bytes=30_000).read_bytes(),
            "tiny-Q8_0-00001-of-00002.gguf": random_bytes(20_000, 1),
            "tiny-Q8_0-00002-of-00002.gguf": random_bytes(10_000, 2),
        })
        hub.add_repo("org/st-model", {
            "model.safetensors": random_bytes(40_000, 3), "config.json": b'{"torch_dtype": "bfloat16"}',
        })
        yield hub, cache_dir


def test_lists_pulled_variants_and_deletes_one_without_touching_the_other(env: tuple[FakeHub, Path]) -> None:
    hub, cache_dir = env
    q4 = pull(f"{REPO}:Q4_K_M", policy=FAST)
    q8 = pull(f"{REPO}:Q8_0", policy=FAST)
    st = pull("org/st-model", policy=FAST)
    models = {m.name: m for m in library.list_local()}
    assert set(models) == {f"{REPO}:Q4_K_M", f"{REPO}:Q8_0", "org/st-model"}
    assert models[f"{REPO}:Q8_0"].shards == 2 and models[f"{REPO}:Q8_0"].size_bytes == 30_000
    assert models[f"{REPO}:Q8_0"].path == q8.path
    assert models[f"{REPO}:Q4_K_M"].quantization == "Q4_K_M" and models[f"{REPO}:Q4_K_M"].format == "gguf"
    assert models["org/st-model"].format == "safetensors" and models["org/st-model"].path == st.path
    assert (st.path / "config.json").exists()  # side files come with a safetensors set

    result = library.delete(f"{REPO}:Q8_0")
    assert result.freed_bytes == 30_000
    assert not q8.path.exists()
    assert q4.path.read_bytes()  # the other quant in the same repo is intact
    assert {m.name for m in library.list_local()} == {f"{REPO}:Q4_K_M", "org/st-model"}
    library.delete(f"{REPO}:Q4_K_M")
    assert not (cache_dir / "models--demo--tiny-GGUF").exists()
    with pytest.raises(ModelError, match="No local model named"):
        library.delete("nope/nothing:Q4_K_M")


def test_user_paths_are_listed_and_only_forgotten(env: tuple[FakeHub, Path], tmp_path: Path) -> None:
    folder = tmp_path / "my-models"
    single = write_tiny_gguf(tmp_path / "loose" / "solo-Q5_K_M.gguf", n_bytes=1000)
    write_tiny_gguf(folder / "big-Q4_0-00001-of-00002.gguf", n_bytes=1000)
    write_tiny_gguf(folder / "big-Q4_0-00002-of-00002.gguf", n_bytes=1000)
    library.add_path(folder)
    library.add_path(single)
    models = {m.name: m for m in library.list_local()}
    shard_set = models[str(folder / "big-Q4_0-00001-of-00002.gguf")]
    assert (shard_set.source, shard_set.shards, shard_set.quantization) == ("folder", 2, "Q4_0")
    assert models[str(single)].source == "file" and models[str(single)].quantization == "Q5_K_M"
    result = library.delete(str(single))
    assert result.forgotten and single.exists()
    assert str(single) not in {m.name for m in library.list_local()}
    with pytest.raises(ModelError, match="not a .gguf"):
        library.add_path(Path(__file__))


def test_cli_models_and_rm(env: tuple[FakeHub, Path]) -> None:
    pull(f"{REPO}:Q4_K_M", policy=FAST)
    env_vars = dict(os.environ)
    out = subprocess.run([*SWITCHYARD, "models", "--json"], env=env_vars, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [m["name"] for m in json.loads(out.stdout)] == [f"{REPO}:Q4_K_M"]
    out = subprocess.run([*SWITCHYARD, "rm", f"{REPO}:Q4_K_M"], env=env_vars, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "freed" in out.stdout
    out = subprocess.run([*SWITCHYARD, "rm", f"{REPO}:Q4_K_M"], env=env_vars, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "No local model named" in out.stderr and "Traceback" not in out.stderr
