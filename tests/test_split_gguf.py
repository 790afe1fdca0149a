"""Split GGUFs (`NAME-0000K-of-0000N.gguf`, how every large GGUF ships) are one model: sized over every shard,
served from the first, refused in one line when a shard is missing, partial or from another set.

The sets are the demo model written again by gguf-py's split writer (tests/gguf_tools.py), in both layouts:
tensors from the first shard on, and gguf-split's --no-tensor-first-split (the first shard holds metadata only)."""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import run_cli
from gguf_tools import split_gguf

from desktop.core.common.errors import ModelError
from desktop.core.engines import get_adapter
from desktop.core.engines.model_path import resolve_model
from desktop.core.machine.hardware import GIB, HardwareSnapshot
from desktop.core.models.facts import facts_for, facts_from_gguf, read_gguf_header
from desktop.core.planning.fit import estimate, sizing_plan
from desktop.core.planning.planner import plan_launch

SNAPDIR = Path(__file__).parent / "snapshots"
LAYOUTS = {"tensors-in-every-shard": False, "metadata-only-first-shard": True}


@pytest.fixture(scope="module")
def whole() -> Path:
    from desktop.core.models.demo import ensure_demo_model

    return ensure_demo_model().gguf_path


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=list(LAYOUTS))
def split(request: pytest.FixtureRequest, whole: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    tensors = len(read_gguf_header(whole).tensors)
    return split_gguf(whole, tmp_path_factory.mktemp("split"), max_tensors=math.ceil(tensors / 3),
                      small_first_shard=LAYOUTS[request.param])


def copy_set(shards: list[Path], folder: Path) -> list[Path]:
    folder.mkdir()
    return [Path(shutil.copy(shard, folder / shard.name)) for shard in shards]


def small_gpu(vram_gib: float) -> HardwareSnapshot:
    """The RTX 3090 snapshot with `vram_gib` of VRAM free: where the demo fits whole, partly or not at all."""
    hardware = HardwareSnapshot.load(SNAPDIR / "rtx3090.json")
    gpu = replace(hardware.gpus[0], memory_total_bytes=int(vram_gib * GIB), memory_free_bytes=int(vram_gib * GIB))
    return replace(hardware, gpus=[gpu])


def test_the_shards_really_split_the_tensors(split: list[Path], whole: Path) -> None:
    """The set under test is what the issue describes: several shards, none of which holds the whole model."""
    counts = [len(read_gguf_header(shard).tensors) for shard in split]
    assert len(split) >= 3 and sum(counts) == len(read_gguf_header(whole).tensors)
    assert max(counts) < sum(counts)
    if "-00001-of-" in split[0].name and counts[0] == 0:
        assert read_gguf_header(split[0]).metadata["general.architecture"] == "llama"  # metadata-only first


def test_a_split_set_is_sized_as_the_whole_file_from_any_shard(split: list[Path], whole: Path) -> None:
    one = facts_from_gguf(whole)
    for shard in (split[0], split[1], split[-1]):
        facts = facts_from_gguf(shard)
        for key in ("weights_bytes", "nonrepeating_bytes", "embedding_bytes", "params", "tensor_types",
                    "tensor_type_bytes", "n_layers", "vocab_size", "architecture", "name", "has_output_tensor"):
            assert getattr(facts, key) == getattr(one, key), key
        assert facts.path == str(split[0].resolve()) and facts.shards == len(split)
        assert any("split GGUF" in note for note in facts.notes)


@pytest.mark.parametrize("vram_gib", [4.0, 0.45, 0.05])
def test_a_split_set_gets_the_verdict_of_the_whole_file(split: list[Path], whole: Path, vram_gib: float) -> None:
    """Fits, fits in part, does not fit on the GPU: the same answer and the same numbers, split or not."""
    hardware = small_gpu(vram_gib)
    plan = sizing_plan("llama.cpp", ctx_per_request=2048, slots=1)
    expected = estimate(facts_from_gguf(whole), hardware, plan)
    got = estimate(facts_from_gguf(split[0]), hardware, plan)
    assert expected.fits == {4.0: "yes", 0.45: "partial", 0.05: "no"}.get(vram_gib, expected.fits)
    assert (got.fits, got.gpu_layers, got.total_gib, got.cpu_ram_gib, got.breakdown) == \
        (expected.fits, expected.gpu_layers, expected.total_gib, expected.cpu_ram_gib, expected.breakdown)


def test_the_first_shard_alone_would_have_been_sized_wrong(split: list[Path], whole: Path) -> None:
    """What the bug was: the first shard's own tensors are a fraction (or none) of the model."""
    own = sum(1 for _ in read_gguf_header(split[0]).tensors)
    assert own < len(read_gguf_header(whole).tensors)
    assert facts_from_gguf(split[0]).weights_bytes == facts_from_gguf(whole).weights_bytes


def test_any_shard_resolves_to_the_first_for_llama_server(split: list[Path]) -> None:
    adapter = get_adapter("llama.cpp")
    assert resolve_model(str(split[-1]), adapter) == split[0]
    assert resolve_model(str(split[0]), adapter) == split[0]


def test_a_missing_shard_is_refused_in_one_line_and_nothing_is_planned(split: list[Path], tmp_path: Path) -> None:
    shards = copy_set(split, tmp_path / "set")
    shards[1].unlink()
    for given in (shards[0], shards[-1]):
        with pytest.raises(ModelError) as refused:
            facts_for(str(given))
        assert refused.value.message == (f"shard 2 of {len(shards)} of demo is missing ({shards[1].name}): "
                                         "finish the download")
        assert "switchyard pull" in (refused.value.hint or "")
    with pytest.raises(ModelError, match="shard 2 of"):
        plan_launch("llama.cpp", str(shards[0]), HardwareSnapshot.load(SNAPDIR / "cpu_laptop.json"))


def test_a_partial_shard_is_refused_as_an_unfinished_download(split: list[Path], tmp_path: Path) -> None:
    shards = copy_set(split, tmp_path / "set")
    last = shards[-1]
    size = last.stat().st_size
    os.truncate(last, size - 4096)
    with pytest.raises(ModelError) as refused:
        facts_from_gguf(shards[0])
    assert refused.value.message == (f"shard {len(shards)} of {len(shards)} of demo is incomplete "
                                     f"({size - 4096:,} of {size:,} bytes): finish the download")


def test_a_shard_of_another_set_is_refused(split: list[Path], tmp_path: Path) -> None:
    """Files of different downloads mixed in one folder: the names agree, the shards' own split keys do not."""
    shards = copy_set(split, tmp_path / "set")
    shutil.copy(shards[2], shards[1])  # shard 3's file under shard 2's name
    with pytest.raises(ModelError, match=r"says it is shard 3 of \d+, not 2 of"):
        facts_from_gguf(shards[0])


def test_a_renamed_shard_cannot_find_its_set(split: list[Path], tmp_path: Path) -> None:
    folder = tmp_path / "renamed"
    folder.mkdir()
    lone = Path(shutil.copy(split[0], folder / "model.gguf"))
    with pytest.raises(ModelError, match=r"is one shard of a GGUF split in \d+, but its name does not say"):
        facts_from_gguf(lone)


def test_the_cli_fit_sizes_the_set(split: list[Path], whole: Path) -> None:
    def fit(model: Path) -> Any:
        result = run_cli("fit", str(model), "--engine", "llama.cpp", "--json", "--no-history")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    one, got = fit(whole), fit(split[-1])
    assert got["breakdown"]["bytes.weights"] == one["breakdown"]["bytes.weights"] > 0
    assert got["fits"] == one["fits"]


@pytest.mark.engine
@pytest.mark.llamacpp
def test_serve_the_first_shard_with_the_real_llama_server(split: list[Path], llama_install: Any) -> None:
    """llama-server is handed the first shard and opens the others itself: it answers."""
    result = run_cli("serve", "--engine", "llama.cpp", "--model", str(split[0]), "--prompt", "Hello",
                     "--max-tokens", "8", "--json", "--no-install", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["completion"] and report["usage"]["completion_tokens"] == 8


def cache_layout(files: list[Path], root: Path, repo: str = "org/name-GGUF") -> Path:
    """`files` as the Hub cache keeps them: blobs named by hash, snapshot names linking to them (relative links,
    as huggingface_hub makes them). Returns the snapshot folder."""
    storage = root / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / ("c0ffee" * 6 + "abcd")
    (storage / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for index, file in enumerate(files):
        blob = storage / "blobs" / f"{index:064x}"
        shutil.copy(file, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    return snapshot


def test_a_cached_file_keeps_its_snapshot_name_and_shows_as_the_repo(whole: Path, tmp_path: Path) -> None:
    """A single GGUF in the cache: llama-server gets the snapshot link and /v1/models the repo, not the blob's hash."""
    from desktop.core.engines.model_path import model_label

    snapshot = cache_layout([whole], tmp_path)
    link = snapshot / whole.name
    adapter = get_adapter("llama.cpp")
    assert resolve_model(str(link), adapter) == link
    assert resolve_model(str(snapshot), adapter) == link  # the snapshot folder names the model too
    assert model_label(str(resolve_model(str(snapshot), adapter))) == f"org/name-GGUF/{whole.name}"


def test_a_cached_split_set_is_served_from_its_snapshot_names(split: list[Path], whole: Path, tmp_path: Path) -> None:
    snapshot = cache_layout(split, tmp_path)
    adapter = get_adapter("llama.cpp")
    assert resolve_model(str(snapshot / split[-1].name), adapter) == snapshot / split[0].name
    assert facts_for(str(snapshot / split[-1].name)).weights_bytes == facts_for(str(whole)).weights_bytes


def test_a_folder_of_several_models_names_them_and_a_projector_is_not_one(whole: Path, tmp_path: Path) -> None:
    folder = tmp_path / "repo"
    folder.mkdir()
    shutil.copy(whole, folder / "model-Q8_0.gguf")
    shutil.copy(whole, folder / "mmproj-model-f16.gguf")
    adapter = get_adapter("llama.cpp")
    assert resolve_model(str(folder), adapter) == folder / "model-Q8_0.gguf"
    (folder / "Q4_K_M").mkdir()
    shutil.copy(whole, folder / "Q4_K_M" / "model-Q4_K_M.gguf")
    with pytest.raises(ModelError, match=r"holds 2 GGUF models \(Q4_K_M/model-Q4_K_M.gguf, model-Q8_0.gguf\)"):
        resolve_model(str(folder), adapter)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json, no .gguf file"):
        resolve_model(str(tmp_path / "empty"), adapter)
