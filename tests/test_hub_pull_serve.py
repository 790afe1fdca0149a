"""End to end: `switchyard pull` a GGUF from the fake Hub, then `switchyard serve` the printed path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fakehub import FakeHub

pytestmark = [pytest.mark.engine, pytest.mark.llamacpp]

SWITCHYARD = [sys.executable, "-m", "desktop"]


def pull(tmp_path: Path, repo: str, files: dict[str, bytes | Path], selector: str = "") -> tuple[Path, dict[str, str]]:
    """`switchyard pull REPO[SELECTOR]` from a stand-in Hub holding `files` into a Hub cache under `tmp_path`: the
    path it printed, and the environment the later commands of the test run with."""
    with FakeHub() as hub:
        hub.add_repo(repo, files, tags=["gguf"])
        env = dict(os.environ, HF_ENDPOINT=hub.endpoint, HF_HUB_CACHE=str(tmp_path / "hf-cache"),
                   SWITCHYARD_HOME=str(tmp_path / "home"), SWITCHYARD_NO_KEYRING="1",
                   HF_HUB_DISABLE_IMPLICIT_TOKEN="1")
        pulled = subprocess.run([*SWITCHYARD, "pull", repo + selector], env=env, capture_output=True, text=True,
                                timeout=120)
        assert pulled.returncode == 0, pulled.stderr
    return Path(pulled.stdout.strip()), env


def test_pull_then_serve(tmp_path: Path, llama_install, demo_model) -> None:  # type: ignore[no-untyped-def]
    """No skip guards: `serve`, the demo model and llama-server are all part of the product now, so a regression in
    any of them fails here (the conftest fixtures provision the engine and generate the demo model)."""
    demo_gguf = Path(demo_model.gguf_path)
    model, env = pull(tmp_path, "demo/switchyard-demo-GGUF", {"demo-Q8_0.gguf": demo_gguf}, ":Q8_0")
    assert model.read_bytes() == demo_gguf.read_bytes()
    served = subprocess.run(
        [*SWITCHYARD, "serve", "--engine", "llama.cpp", "--model", str(model), "--prompt", "Hi", "--json",
         "--no-install", "--max-tokens", "8", "--ready-timeout", "300"],
        env=env, capture_output=True, text=True, timeout=400,
    )
    assert served.returncode == 0, served.stderr[-2000:]
    result = json.loads(served.stdout)
    assert Path(result["model"]).resolve() == model.resolve()
    assert result["usage"] and result["usage"]["completion_tokens"] > 0


def test_a_split_set_pulled_into_the_cache_is_sized_whole_and_served_from_the_snapshot(
        tmp_path: Path, llama_install, demo_model) -> None:  # type: ignore[no-untyped-def]
    """The Hub cache keeps each shard as a symlink `snapshots/<commit>/NAME-0000K-of-0000N.gguf -> ../../blobs/<etag>`:
    the fit reads the set through the snapshot's names (a blob's name says nothing of its set), and llama-server is
    handed the snapshot path of the first shard, from which it opens the others by name."""
    from gguf_tools import split_gguf

    from desktop.core.models.facts import read_gguf_header

    whole = Path(demo_model.gguf_path)
    tensors = len(read_gguf_header(whole).tensors)
    shards = split_gguf(whole, tmp_path / "split", max_tensors=-(-tensors // 3))
    assert len(shards) == 3
    model, env = pull(tmp_path, "demo/switchyard-demo-split-GGUF", {f"Q8_0/{s.name}": s for s in shards})
    snapshot = model.parent.parent
    assert snapshot.parent.name == "snapshots" and model.is_symlink(), model  # the layout users have
    assert sorted(p.name for p in model.parent.iterdir()) == [s.name for s in shards]
    assert all(p.is_symlink() and p.resolve().parent.name == "blobs" for p in model.parent.iterdir())

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*SWITCHYARD, *args], env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stderr[-2000:]
        return done

    one = json.loads(run("fit", str(whole), "--engine", "llama.cpp", "--json", "--no-history").stdout)
    for named in (model, model.with_name(shards[-1].name), snapshot):  # first shard, a later shard, the folder
        got = json.loads(run("fit", str(named), "--engine", "llama.cpp", "--json", "--no-history").stdout)
        assert got["breakdown"]["bytes.weights"] == one["breakdown"]["bytes.weights"] > 0, named
        assert got["fits"] == one["fits"], named
    served = run("serve", "--engine", "llama.cpp", "--model", str(snapshot), "--prompt", "Hi", "--json",
                 "--no-install", "--max-tokens", "8", "--ready-timeout", "300", timeout=400)
    result = json.loads(served.stdout)
    assert result["usage"] and result["usage"]["completion_tokens"] > 0
    assert result["model"] == str(model), result["model"]  # llama-server's --model: the snapshot path, no blob
